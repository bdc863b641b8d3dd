//! `--log-format json` (and `ROOKWORLD_LOG_FORMAT=json`) on every service binary: each
//! stderr line is one JSON object with the level and the fields, and long work (a bench)
//! logs its progress, one line per run, when stderr is not a terminal.

use std::process::Command;

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");
const REWARD: &str = env!("CARGO_BIN_EXE_rw-reward-server");

/// Runs `bin args` with `env`, expects exit 0; returns its stderr lines as JSON objects.
fn json_lines(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Vec<serde_json::Value> {
    let out = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("ROOKWORLD_LOG_FORMAT")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{bin} {args:?}: {err}");
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "{bin} {args:?} logged nothing");
    for l in &lines {
        assert!(l["level"].is_string() && l["fields"].is_object(), "{l}");
        assert!(l["timestamp"].is_string(), "{l}");
    }
    lines
}

fn messages(lines: &[serde_json::Value]) -> Vec<String> {
    lines
        .iter()
        .map(|l| {
            l["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[test]
fn every_service_logs_json_lines_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("init");
    let learner = json_lines(
        LEARNER,
        &[
            "--log-format",
            "json",
            "init",
            "--preset",
            "tiny",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(learner.iter().any(|l| l["level"] == "INFO"), "{learner:?}");

    // The flag also goes after the subcommand, and the variable does the same.
    let worker = json_lines(
        WORKER,
        &[
            "generate",
            "--preset",
            "tiny",
            "--prompt",
            "A: x",
            "--max-new-tokens",
            "2",
            "--log-format",
            "json",
        ],
        &[],
    );
    assert!(
        messages(&worker).iter().any(|m| m == "model loaded"),
        "{worker:?}"
    );

    let reward = json_lines(
        REWARD,
        &["bench", "--items", "20", "--repeat", "2"],
        &[("ROOKWORLD_LOG_FORMAT", "json")],
    );
    // Off a terminal, the bench's progress is one line per timed run: 2 tasks × 2 pools
    // × 2 repeats.
    let runs = messages(&reward)
        .iter()
        .filter(|m| m.as_str() == "bench run")
        .count();
    assert_eq!(runs, 8, "{reward:?}");
}

#[test]
fn an_unknown_log_format_is_one_line_and_exit_1() {
    let out = Command::new(REWARD)
        .args(["--log-format", "xml", "bench"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("invalid value 'xml' for '--log-format"),
        "{err}"
    );
    assert!(err.contains("possible values: text, json"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
