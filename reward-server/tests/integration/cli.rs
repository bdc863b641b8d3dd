//! `reward-server score` and `bench` as a user runs them.

use std::io::Write;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_reward-server");

fn score(input: &[u8], args: &[&str]) -> Output {
    let mut child = Command::new(BIN)
        .arg("score")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn one_result_per_line_in_order_and_bad_lines_do_not_stop_the_rest() {
    let start = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1";
    let mut input = Vec::new();
    writeln!(input, r#"{{"task":"A","prompt":"A: {start}+e2e4+e2e4+","completion":"rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0"}}"#).unwrap();
    writeln!(input, "not json").unwrap();
    input.extend_from_slice(b"{\"task\":\"A\",\"prompt\":\"\xff\xfe\",\"completion\":\"\"}\n");
    writeln!(input, r#"{{"task":"Z","prompt":"","completion":""}}"#).unwrap();
    writeln!(input, r#"{{"task":"A","prompt":5,"completion":""}}"#).unwrap();
    writeln!(
        input,
        r#"{{"task":"P","prompt":"P: {start}","completion":"garbage"}}"#
    )
    .unwrap();
    writeln!(
        input,
        r#"{{"task":"A","prompt":"A: {start}+e2e5+e2e5+","completion":""}}"#
    )
    .unwrap();
    let out = score(&input, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 7);
    assert_eq!(lines[0]["reward"], 1.0);
    assert_eq!(lines[0]["components"]["placement"], 1.0);
    for (i, needle) in [
        (1, "line 2"),
        (2, "UTF-8"),
        (3, "unknown task"),
        (4, "line 5"),
        (6, "e2e5"),
    ] {
        assert!(
            lines[i]["error"].as_str().unwrap().contains(needle),
            "{i}: {}",
            lines[i]
        );
    }
    assert_eq!(lines[5]["reward"], -1.0);
    assert_eq!(lines[5]["verdict"], "malformed");
    assert!(
        lines[5]["components"]["reason"]
            .as_str()
            .unwrap()
            .contains("M:")
    );
}

#[test]
fn io_and_configuration_errors_exit_non_zero_with_one_line() {
    let cases: [&[&str]; 3] = [
        &["--input", "/nonexistent/in.jsonl"],
        &["--engine", "/nonexistent/stockfish"],
        &["--weights", "/nonexistent/weights.json"],
    ];
    for args in cases {
        let out = score(b"", args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains("/nonexistent/"),
            "{stderr}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("w.json");
    std::fs::write(&weights, r#"{"environment":{"placement":-1}}"#).unwrap();
    let out = score(b"", &["--weights", weights.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("placement"));
}

#[test]
fn bench_reports_rates_and_writes_its_items() {
    let dir = tempfile::tempdir().unwrap();
    let items = dir.path().join("items.jsonl");
    let out = Command::new(BIN)
        .args(["bench", "--items", "200", "--repeat", "1", "--write-items"])
        .arg(&items)
        .output()
        .unwrap();
    assert!(out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["environment_per_second"]["one_thread"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // The written items score exactly: their completions are the truth.
    let written = std::fs::read(&items).unwrap();
    assert_eq!(written.iter().filter(|&&b| b == b'\n').count(), 400);
    let scored = score(&written, &[]);
    let text = String::from_utf8(scored.stdout).unwrap();
    assert!(
        text.lines()
            .take(200)
            .all(|l| l.contains(r#""reward":1.0"#)),
        "environment truths are exact"
    );
}
