//! Ctrl-C and SIGTERM end `learner train` in any phase within 10 s: here, during the
//! supervised warm-up, which runs on a thread of its own and asks between its steps.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// SIGTERM during the warm-up: the run stops within 10 s, exits 0, says where it stopped,
/// and leaves no checkpoint (the next run starts afresh, without --overwrite).
#[test]
fn sigterm_during_the_warm_up_stops_the_run_within_10_s() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut learner = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["train", "--local", "--preset", "tiny", "--steps", "2"])
        // Long enough that only the signal ends it.
        .args(["--sft-steps", "100000", "--no-progress", "--metrics", "off"])
        .arg("--run-dir")
        .arg(&run)
        .env("RUST_LOG", "info")
        .env_remove("LEARNER_RESUME")
        .env_remove("ROOKWORLD_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, log) = mpsc::channel();
    let stderr = learner.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    // The warm-up's first progress line (every 10 of its steps).
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let line = log
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no warm-up progress within 120 s:\n{}", seen.join("\n")));
        let warming = line.contains("warm-up") && line.contains("loss");
        seen.push(line);
        if warming {
            break;
        }
    }

    let sent = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &learner.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = loop {
        if let Some(status) = learner.try_wait().unwrap() {
            break Some(status);
        }
        if sent.elapsed() > Duration::from_secs(10) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = sent.elapsed();
    if exited.is_none() {
        learner.kill().unwrap();
    }
    learner.wait().unwrap();
    seen.extend(log.try_iter());
    let text = seen.join("\n");
    let status = exited.unwrap_or_else(|| panic!("still running 10 s after SIGTERM:\n{text}"));
    assert!(status.success(), "exit {status} after {took:?}:\n{text}");
    assert!(
        text.contains("stopped during the supervised warm-up"),
        "the stop does not say where it stopped:\n{text}"
    );
    let checkpoints = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(checkpoints, 0, "a stopped warm-up leaves no checkpoint");
}

/// Ctrl-C (SIGINT) during `learner eval` of the default checkmate suite (3,500 items): it
/// shows its progress in the log first, stops within 10 s, exits 0, says how far it got,
/// and leaves neither `--out` nor `--dump` (nor their temporary files) behind.
#[test]
fn sigint_during_an_evaluation_stops_it_within_10_s_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (out, dump) = (
        dir.path().join("report.json"),
        dir.path().join("dump.jsonl"),
    );
    let mut learner = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["eval", "--preset", "tiny", "--suite", "checkmate-in-one"])
        .arg("--out")
        .arg(&out)
        .arg("--dump")
        .arg(&dump)
        .env("RUST_LOG", "info")
        .env_remove("ROOKWORLD_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, log) = mpsc::channel();
    let stderr = learner.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    // The suite's first progress line in the log: samples done, rate, time left.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let line = log
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no eval progress within 120 s:\n{}", seen.join("\n")));
        let progress = line.contains("eval 1/1: checkmate-in-one")
            && line.contains("samples=3500")
            && line.contains("rate=")
            && line.contains("left=");
        seen.push(line);
        if progress {
            break;
        }
    }

    let sent = Instant::now();
    let status = Command::new("kill")
        .args(["-INT", &learner.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = loop {
        if let Some(status) = learner.try_wait().unwrap() {
            break Some(status);
        }
        if sent.elapsed() > Duration::from_secs(10) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if exited.is_none() {
        learner.kill().unwrap();
    }
    learner.wait().unwrap();
    std::thread::sleep(Duration::from_millis(100)); // the reader's last lines
    seen.extend(log.try_iter());
    let text = seen.join("\n");
    let status = exited.unwrap_or_else(|| panic!("still running 10 s after SIGINT:\n{text}"));
    assert!(status.success(), "exit {status}:\n{text}");
    assert!(
        text.contains("eval: stopped by a signal in suite 1/1 (checkmate-in-one:")
            && text.contains("of 3500 samples; 0 suites finished); no report written"),
        "the stop does not say how far it got:\n{text}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "a stopped evaluation leaves {left:?}");
}
