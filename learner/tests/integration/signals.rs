//! Ctrl-C and SIGTERM end a command within 10 s with exit code 0: `learner train` during
//! the supervised warm-up (which runs on a thread of its own and asks between its steps),
//! and `learner eval` in the middle of a suite.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The learner with `args`, its log (stderr, `RUST_LOG=info`) read line by line.
struct Learner {
    child: std::process::Child,
    log: mpsc::Receiver<String>,
    /// Every line read so far.
    seen: Vec<String>,
}

impl Learner {
    fn start(args: &[&std::ffi::OsStr]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_learner"))
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("LEARNER_RESUME")
            .env_remove("ROOKWORLD_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (lines, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            log,
            seen: Vec::new(),
        }
    }

    /// Reads the log until a line satisfies `wanted` (failing after 120 s, naming `what`).
    fn wait_for(&mut self, what: &str, wanted: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let line = self
                .log
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("no {what} within 120 s:\n{}", self.seen.join("\n")));
            let found = wanted(&line);
            self.seen.push(line);
            if found {
                return;
            }
        }
    }

    /// Sends `signal` (`-TERM`, `-INT`); the exit status if the process ended within
    /// 10 s (else it is killed), and the whole log.
    fn signal(mut self, signal: &str) -> (Option<ExitStatus>, String) {
        let sent = Instant::now();
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exited = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break Some(status);
            }
            if sent.elapsed() > Duration::from_secs(10) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if exited.is_none() {
            self.child.kill().unwrap();
        }
        self.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(100)); // the reader's last lines
        self.seen.extend(self.log.try_iter());
        (exited, self.seen.join("\n"))
    }
}

/// SIGTERM during the warm-up: the run stops within 10 s, exits 0, says where it stopped,
/// and leaves no checkpoint (the next run starts afresh, without --overwrite).
#[test]
fn sigterm_during_the_warm_up_stops_the_run_within_10_s() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut learner = Learner::start(&[
        "train".as_ref(),
        "--local".as_ref(),
        "--preset".as_ref(),
        "tiny".as_ref(),
        "--steps".as_ref(),
        "2".as_ref(),
        // Long enough that only the signal ends it.
        "--sft-steps".as_ref(),
        "100000".as_ref(),
        "--no-progress".as_ref(),
        "--metrics".as_ref(),
        "off".as_ref(),
        "--run-dir".as_ref(),
        run.as_os_str(),
    ]);
    // The warm-up's first progress line (every 10 of its steps).
    learner.wait_for("warm-up progress", |l| {
        l.contains("warm-up") && l.contains("loss")
    });
    let (exited, text) = learner.signal("-TERM");
    let status = exited.unwrap_or_else(|| panic!("still running 10 s after SIGTERM:\n{text}"));
    assert!(status.success(), "exit {status}:\n{text}");
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
    let mut learner = Learner::start(&[
        "eval".as_ref(),
        "--preset".as_ref(),
        "tiny".as_ref(),
        "--suite".as_ref(),
        "checkmate-in-one".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
        "--dump".as_ref(),
        dump.as_os_str(),
    ]);
    // The suite's first progress line in the log: samples done, rate, time left.
    learner.wait_for("eval progress", |l| {
        l.contains("eval 1/1: checkmate-in-one")
            && l.contains("samples=3500")
            && l.contains("rate=")
            && l.contains("left=")
    });
    let (exited, text) = learner.signal("-INT");
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
