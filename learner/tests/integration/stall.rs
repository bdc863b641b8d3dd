//! The stall watchdog: a run whose groups never come says why while it waits, then
//! checkpoints and exits non-zero with one line, instead of waiting forever.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn a_run_without_workers_explains_the_stall_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args([
            "train",
            "--preset",
            "tiny",
            "--token",
            "t",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--sft-steps",
            "0",
            "--steps",
            "2",
            "--stall-timeout",
            "4",
            "--no-progress",
            "--run-dir",
        ])
        .arg(&run)
        .env("RUST_LOG", "error")
        .env("NO_COLOR", "1")
        .env_remove("LEARNER_RESUME")
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
    // One ERROR line while waiting (from half the timeout), then the final one.
    let reports: Vec<&str> = err.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(!reports.is_empty(), "{err}");
    assert!(reports[0].contains("the run stops at 4 s"), "{err}");
    let last = err.lines().last().unwrap();
    assert!(last.starts_with("error: no step for 4 s"), "{err}");
    assert!(last.contains("no worker has leased a prompt"), "{err}");
    assert!(last.contains("0 workers registered"), "{err}");
    // Nothing is lost: the run checkpointed before it stopped.
    assert!(run.join("checkpoints/latest").is_file());
}
