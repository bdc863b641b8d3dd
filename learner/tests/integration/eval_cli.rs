//! `learner eval` end to end: every suite generated with the rollout engine and graded on
//! a tiny preset (near zero, as a random model must be), the report, the dump, and bad
//! input as one clear line with a non-zero exit.

use std::process::Command;

fn eval(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_learner"))
        .arg("eval")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn every_suite_is_generated_graded_reported_and_dumped() {
    let dir = tempfile::tempdir().unwrap();
    let (out_path, dump_path) = (dir.path().join("eval.json"), dir.path().join("items.jsonl"));
    let out = eval(&[
        "--preset",
        "tiny",
        "--limit",
        "3",
        "--samples",
        "2",
        "--temperature",
        "1",
        "--max-new-tokens",
        "24",
        "--out",
        out_path.to_str().unwrap(),
        "--dump",
        dump_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    let report: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    assert_eq!(report, written);
    assert_eq!(report["samples"], 2);
    assert_eq!(report["policy_ranking"], "the data lines' evaluations");
    assert_eq!(
        report["temperature"], 1.0,
        "several samples sample at temperature 1"
    );
    let suites = report["suites"].as_array().unwrap();
    let names: Vec<&str> = suites
        .iter()
        .map(|s| s["suite"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["checkmate-in-one", "policy", "environment"]);
    for (s, primary) in suites.iter().zip(["mate", "top1", "exact_fen"]) {
        assert_eq!(
            (s["items"].as_u64(), s["completions"].as_u64()),
            (Some(3), Some(6)),
            "{s}"
        );
        assert_eq!(s["primary"], primary);
        let (p1, pk) = (
            s["pass_at_1"].as_f64().unwrap(),
            s["pass_at_k"].as_f64().unwrap(),
        );
        assert!((0.0..=1.0).contains(&p1) && p1 <= pk && pk <= 1.0, "{s}");
        let reward = s["mean_reward"].as_f64().unwrap();
        assert!((-1.0..=1.0).contains(&reward), "{s}");
        assert!(s["metrics"]["well_formed"].as_f64().is_some(), "{s}");
        assert!(s["items_per_second"].as_f64().unwrap() > 0.0);
    }
    let dump = std::fs::read_to_string(&dump_path).unwrap();
    let lines: Vec<serde_json::Value> = dump
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3 * 3 * 2);
    for l in &lines {
        for key in [
            "suite",
            "item",
            "sample",
            "prompt",
            "completion",
            "verdict",
            "reward",
            "metrics",
        ] {
            assert!(!l[key].is_null(), "{key} in {l}");
        }
    }
    assert!(lines[0]["prompt"].as_str().unwrap().starts_with("P: "));
    assert!(lines[17]["prompt"].as_str().unwrap().starts_with("A: "));
}

#[test]
fn greedy_evaluation_is_reproducible() {
    let run = || {
        let out = eval(&[
            "--preset",
            "tiny",
            "--suite",
            "environment",
            "--limit",
            "2",
            "--max-new-tokens",
            "16",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["temperature"], 0.0, "one sample is greedy");
        v["suites"][0]["metrics"].clone()
    };
    assert_eq!(run(), run());
}

#[test]
fn bad_input_is_one_line_and_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    std::fs::write(
        dir.path().join("opening_dataset_eval.json"),
        "[{\"prompt\": 3}]",
    )
    .unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--preset", "tiny", "--suite", "chess960"],
            "unknown suite",
        ),
        (
            vec!["--preset", "tiny", "--suite", "policy", "--data-dir", data],
            "rook_val_500.txt",
        ),
        (
            vec![
                "--preset",
                "tiny",
                "--suite",
                "environment",
                "--data-dir",
                data,
            ],
            "opening_dataset_eval.json",
        ),
        (
            vec![
                "--model",
                "/nonexistent/model-dir",
                "--suite",
                "policy",
                "--limit",
                "1",
            ],
            "/nonexistent/model-dir",
        ),
        (
            vec![
                "--preset",
                "tiny",
                "--suite",
                "policy",
                "--limit",
                "1",
                "--engine",
                "/nonexistent/stockfish",
            ],
            "--engine",
        ),
    ];
    for (args, needle) in cases {
        let out = eval(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let err = err.trim();
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // A flag out of range is clap's usage error (its first line says which).
    let out = eval(&["--preset", "tiny", "--samples", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().next().unwrap().contains("--samples"), "{err}");
}
