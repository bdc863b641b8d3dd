//! Every command stops the same way: Ctrl-C (SIGINT) or SIGTERM ends it within 10 s with
//! exit code 0, it says what it finished, and it leaves no partial or temporary file —
//! `learner train` during its warm-up, `learner sft`, `learner eval`, `rollout-worker
//! generate`, `reward-server score` and the three binaries' benchmarks, each a real process
//! signalled while it works.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cluster::{LEARNER, REWARD, WORKER};

/// A command at work: its log (stderr, `RUST_LOG=info`) read line by line, its stdout
/// collected.
struct Running {
    child: std::process::Child,
    log: mpsc::Receiver<String>,
    /// Every log line read so far.
    seen: Vec<String>,
    stdout: std::thread::JoinHandle<String>,
    /// Kept open, so that a command reading it waits for more.
    _stdin: Option<std::process::ChildStdin>,
}

impl Running {
    /// `bin` with `args`; with `input`, that much is written to its stdin, which stays open.
    fn start(bin: &str, args: &[&std::ffi::OsStr], input: Option<&[u8]>) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("LEARNER_RESUME")
            .env_remove("ROOKWORLD_CONFIG")
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = input.map(|bytes| {
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(bytes).unwrap();
            stdin.flush().unwrap();
            stdin
        });
        let (lines, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let mut out = child.stdout.take().unwrap();
        let stdout = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        Self {
            child,
            log,
            seen: Vec::new(),
            stdout,
            _stdin: stdin,
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

    /// Sends `signal` (`-TERM`, `-INT`) and asserts that the command exited 0 within 10 s
    /// (else it is killed); its whole log and its stdout.
    fn stop_with(mut self, signal: &str) -> (String, String) {
        let sent = Instant::now();
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exited: Option<ExitStatus> = loop {
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
        let stdout = self.stdout.join().unwrap();
        std::thread::sleep(Duration::from_millis(100)); // the reader's last lines
        self.seen.extend(self.log.try_iter());
        let log = self.seen.join("\n");
        let status = exited.unwrap_or_else(|| panic!("still running 10 s after {signal}:\n{log}"));
        assert!(status.success(), "exit {status} after {signal}:\n{log}");
        (log, stdout)
    }
}

fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
    args.iter().map(Into::into).collect()
}

fn refs(args: &[std::ffi::OsString]) -> Vec<&std::ffi::OsStr> {
    args.iter().map(|a| a.as_os_str()).collect()
}

/// The names in `dir`.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// SIGTERM during the warm-up: the run stops within 10 s, exits 0, says where it stopped,
/// and leaves no checkpoint (the next run starts afresh, without --overwrite).
#[test]
fn train_stops_during_its_warm_up_without_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = os(&[
        "train",
        "--local",
        "--preset",
        "tiny",
        "--steps",
        "2",
        // Long enough that only the signal ends it.
        "--sft-steps",
        "100000",
        "--no-progress",
        "--metrics",
        "off",
        "--run-dir",
    ]);
    args.push(run.clone().into());
    let mut learner = Running::start(LEARNER, &refs(&args), None);
    // The warm-up's first progress line (every 10 of its steps).
    learner.wait_for("warm-up progress", |l| {
        l.contains("warm-up") && l.contains("loss")
    });
    let (log, _) = learner.stop_with("-TERM");
    assert!(
        log.contains("stopped during the supervised warm-up"),
        "the stop does not say where it stopped:\n{log}"
    );
    assert!(
        entries(&run.join("checkpoints")).is_empty(),
        "a stopped warm-up leaves no checkpoint"
    );
}

/// SIGTERM during `learner sft`: the step in progress ends, a checkpoint of the steps done
/// is written, and the line names it and how to resume.
#[test]
fn sft_stops_after_its_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut args = os(&[
        "sft",
        "--preset",
        "tiny",
        "--steps",
        "100000",
        "--policy-fraction",
        "0",
        "--checkpoint-every",
        "100000",
        "--run-dir",
    ]);
    args.push(run.clone().into());
    let mut learner = Running::start(LEARNER, &refs(&args), None);
    learner.wait_for("an sft step", |l| {
        l.contains("sft step") && l.contains("loss")
    });
    let (log, _) = learner.stop_with("-TERM");
    let line = log
        .lines()
        .find(|l| l.starts_with("sft: stopped by a signal after step "))
        .unwrap_or_else(|| panic!("the stop does not say where it stopped:\n{log}"));
    assert!(
        line.contains("of 100000; checkpoint ") && line.contains("--start resume"),
        "{line}"
    );
    let checkpoints = entries(&run.join("checkpoints"));
    assert!(
        checkpoints.iter().any(|c| c.starts_with("step-")),
        "no checkpoint after the stop: {checkpoints:?}\n{log}"
    );
}

/// Ctrl-C during `learner eval` of the default checkmate suite (3,500 items): it shows its
/// progress in the log first, stops, says how far it got, and leaves neither `--out` nor
/// `--dump` (nor their temporary files) behind.
#[test]
fn eval_stops_in_a_suite_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (out, dump) = (
        dir.path().join("report.json"),
        dir.path().join("dump.jsonl"),
    );
    let mut args = os(&["eval", "--preset", "tiny", "--suite", "checkmate-in-one"]);
    args.extend(["--out".into(), out.into(), "--dump".into(), dump.into()]);
    let mut learner = Running::start(LEARNER, &refs(&args), None);
    // The suite's first progress line in the log: samples done, rate, time left.
    learner.wait_for("eval progress", |l| {
        l.contains("eval 1/1: checkmate-in-one")
            && l.contains("samples=3500")
            && l.contains("rate=")
            && l.contains("left=")
    });
    let (log, _) = learner.stop_with("-INT");
    assert!(
        log.contains("eval: stopped by a signal in suite 1/1 (checkmate-in-one:")
            && log.contains("of 3500 samples; 0 suites finished); no report written"),
        "the stop does not say how far it got:\n{log}"
    );
    assert_eq!(entries(dir.path()), Vec::<String>::new());
}

/// Ctrl-C during `rollout-worker generate`: the prompts finished are written whole (one
/// JSON line each, all their completions), the rest abandoned, and the line says how many.
#[test]
fn generate_stops_and_writes_the_prompts_it_finished() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    let lines: Vec<String> = (0..4000)
        .map(|i| format!("P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1 {i} M:"))
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let mut args = os(&[
        "generate",
        "--preset",
        "tiny",
        "-n",
        "2",
        "--max-new-tokens",
        "64",
        "--prompts-file",
    ]);
    args.push(prompts.into());
    let mut worker = Running::start(WORKER, &refs(&args), None);
    worker.wait_for("the model loaded", |l| l.contains("model loaded"));
    std::thread::sleep(Duration::from_secs(2));
    let (log, stdout) = worker.stop_with("-INT");
    let line = log
        .lines()
        .find(|l| l.starts_with("generate: stopped by a signal; "))
        .unwrap_or_else(|| panic!("the stop does not say what it finished:\n{log}"));
    let written: usize = line["generate: stopped by a signal; ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        line.contains("of 4000 prompts finished and written"),
        "{line}"
    );
    assert!(written < 4000, "{line}");
    assert_eq!(stdout.lines().count(), written, "{line}");
    for json in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(v["completions"].as_array().unwrap().len(), 2, "{json}");
    }
}

/// SIGTERM while `reward-server score` waits for more input: it exits at once, every
/// result written is a whole line, and the line says how many it scored.
#[test]
fn score_stops_while_it_waits_for_input() {
    // One full batch (4,096 lines) and a few more that wait for the rest of theirs.
    let item = serde_json::json!({
        "task": "environment",
        "prompt": "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+",
        "completion": "+rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0",
    });
    let input = format!("{item}\n").repeat(4096 + 7);
    let scorer = Running::start(REWARD, &refs(&os(&["score"])), Some(input.as_bytes()));
    std::thread::sleep(Duration::from_secs(3));
    let (log, stdout) = scorer.stop_with("-TERM");
    assert!(
        log.contains("score: stopped by a signal after 4096 lines (each written whole)"),
        "the stop does not say what it scored:\n{log}"
    );
    assert_eq!(stdout.lines().count(), 4096);
    for json in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        assert!(
            v.get("reward").is_some() || v.get("error").is_some(),
            "{json}"
        );
    }
}

/// Each binary's benchmark ends at once on a signal, exit 0, with one line that it stopped
/// and no report on stdout; `bench-push` removes its pushes' directory.
#[test]
fn benchmarks_stop_at_once_without_a_report() {
    let cases: [(&str, Vec<&str>, &str, &str); 4] = [
        (
            LEARNER,
            vec!["bench", "--preset", "tiny", "--steps", "1000000"],
            "bench step",
            "learner bench",
        ),
        (
            LEARNER,
            vec!["bench-push", "--preset", "tiny", "--pushes", "2000"],
            "bench push",
            "learner bench-push",
        ),
        (
            WORKER,
            vec!["bench", "--preset", "tiny", "--repeat", "100000"],
            "bench run",
            "rollout-worker bench",
        ),
        (
            REWARD,
            vec!["bench", "--items", "200", "--repeat", "100000"],
            "bench run",
            "reward-server bench",
        ),
    ];
    for (bin, args, progress, command) in cases {
        let mut bench = Running::start(bin, &refs(&os(&args)), None);
        let pid = bench.child.id();
        bench.wait_for(progress, |l| l.contains(progress));
        let (log, stdout) = bench.stop_with("-INT");
        assert!(
            log.contains(&format!("{command}: stopped by a signal; no report")),
            "{command}: the stop is not said:\n{log}"
        );
        assert_eq!(stdout, "", "{command} printed a report");
        if command == "learner bench-push" {
            let left = rookworld_weights::export::process_dir("rookworld-bench-push");
            let left = left.with_file_name(format!("rookworld-bench-push-{pid}"));
            assert!(!left.exists(), "{} left behind", left.display());
        }
    }
}
