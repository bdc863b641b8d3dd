//! `learner train --local` end to end: a reward server and a rollout worker in-process on
//! loopback, real gRPC between them and the learner's queue.
//!
//! - the default run, shortened to 60 GRPO steps, raises the mean reward, and leaves
//!   TensorBoard curves in RUN/tensorboard (one `train/reward` per step, read back by the
//!   decoder below);
//! - a shutdown mid-run drains, checkpoints the queue's unfinished prompts (none lost),
//!   and `--resume` continues from that step with those prompts first (and a second event
//!   file that restarts the curves there); the learner's Prometheus endpoint shows the
//!   steps.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use clap::Parser;
use learner::checkpoint::TrainerState;
use learner::tensorboard::{Event, SessionLog, masked_crc32c};
use learner::train::{self, StepRecord, TrainArgs};
use prost::Message;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TrainArgs,
}

fn args(run: &Path, extra: &[&str]) -> TrainArgs {
    let run = run.to_str().unwrap();
    let mut argv = vec![
        "train",
        "--local",
        "--run-dir",
        run,
        "--metrics",
        "off",
        "--no-progress",
    ];
    argv.extend_from_slice(extra);
    Cli::parse_from(argv).args
}

/// The two runs here one at a time: each is a whole local cluster (learner, worker,
/// reward server) on a machine that may have two cores, and the reward's rise over a
/// short run depends on how far the worker's rollouts lag the learner's steps.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn listener() -> tokio::net::TcpListener {
    tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()
}

fn jsonl(path: &Path) -> Vec<StepRecord> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The events of a TensorBoard event file: its TFRecords (both CRCs checked), decoded.
fn events(path: &Path) -> Vec<Event> {
    let bytes = std::fs::read(path).unwrap();
    let mut rest = bytes.as_slice();
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest.split_at(8);
        let (len_crc, tail) = tail.split_at(4);
        assert_eq!(len_crc, masked_crc32c(len).to_le_bytes(), "length CRC");
        let n = usize::try_from(u64::from_le_bytes(len.try_into().unwrap())).unwrap();
        let (data, tail) = tail.split_at(n);
        let (data_crc, tail) = tail.split_at(4);
        assert_eq!(data_crc, masked_crc32c(data).to_le_bytes(), "data CRC");
        out.push(Event::decode(data).unwrap());
        rest = tail;
    }
    out
}

/// The event files in `dir`, in name order (the order TensorBoard reads them).
fn event_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_str().unwrap().contains("events.out.tfevents."))
        .collect();
    files.sort();
    files
}

/// A file's session start step and its `tag` scalars as (step, value).
fn curve(events: &[Event], tag: &str) -> (i64, Vec<(i64, f32)>) {
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let start = events[1].session_log.as_ref().unwrap();
    assert_eq!(start.status, SessionLog::START);
    let points = events[2..]
        .iter()
        .flat_map(|e| {
            let values = &e.summary.as_ref().unwrap().value;
            values
                .iter()
                .filter(|v| v.tag == tag)
                .map(|v| (e.step, v.simple_value.unwrap()))
        })
        .collect();
    (events[1].step, points)
}

/// Resolves once `path` holds `n` step records.
async fn after_steps(path: std::path::PathBuf, n: usize) {
    while jsonl(&path).len() < n {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_local_run_raises_the_reward() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let dump = dir.path().join("rollouts.jsonl");
    let a = args(
        dir.path(),
        &[
            // The default run, shortened: warm-up as usual, 60 GRPO steps instead of 100.
            "--steps",
            "60",
            "--log-jsonl",
            log.to_str().unwrap(),
            "--rollout-dump",
            dump.to_str().unwrap(),
        ],
    );
    let summary = train::run(a, listener().await, std::future::pending())
        .await
        .unwrap();
    assert!(!summary.interrupted);
    let warm = &summary.warm_up;
    assert!(
        warm.last().unwrap().loss < warm[0].loss - 3.0,
        "warm-up learns"
    );
    let steps = jsonl(&log);
    assert_eq!(steps.len(), 60);
    for (logged, kept) in steps.iter().zip(&summary.steps) {
        assert_eq!(logged.step, kept.step);
        assert!((logged.reward_mean - kept.reward_mean).abs() < 1e-9);
    }
    let (early, late) = train::reward_trend(&steps).unwrap();
    eprintln!("mean reward: first 20% {early:.4}, last 20% {late:.4}");
    assert!(late > early + 0.05, "reward did not rise: {early} → {late}");
    for r in &steps {
        assert!(
            r.loss.is_finite() && r.kl >= 0.0 && r.grad_norm.is_finite(),
            "step {}: loss {}, kl {}, grad norm {}",
            r.step,
            r.loss,
            r.kl,
            r.grad_norm
        );
        assert!(r.step_seconds.total >= r.step_seconds.forward_backward);
        assert!(r.reward_components.contains_key("format"));
    }
    // The local worker reads the versions from the shared file (a push that finds the
    // file busy is streamed instead).
    let shared: u64 = steps.iter().map(|r| r.pushed.shared).sum();
    assert!(shared > 0, "no push read the shared file");
    // Every consumed group is in the dump once.
    let dumped = std::fs::read_to_string(&dump).unwrap();
    let ids: BTreeSet<u64> = dumped
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt_id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(dumped.lines().count(), 60 * 6);
    assert_eq!(ids.len(), 60 * 6);
    assert!(summary.checkpoint.unwrap().ends_with("step-00000060"));

    // `--local` writes the curves under the run directory: one file, one `train/reward`
    // per step, the step's mean reward.
    let files = event_files(&dir.path().join("tensorboard"));
    assert_eq!(files.len(), 1, "{files:?}");
    let events = events(&files[0]);
    let (start, rewards) = curve(&events, "train/reward");
    assert_eq!(start, 1);
    let expected: Vec<(i64, f32)> = steps
        .iter()
        .map(|r| (r.step as i64, r.reward_mean as f32))
        .collect();
    assert_eq!(rewards, expected);
    for tag in [
        "train/loss",
        "train/kl",
        "train/lr",
        "train/tokens_per_second",
    ] {
        assert_eq!(curve(&events, tag).1.len(), 60, "{tag}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_every_prompt_and_resume_continues() {
    let _serial = SERIAL.lock().await;
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    learner::metrics::install_exporter(metrics).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let dump = dir.path().join("rollouts.jsonl");
    let common = [
        "--sft-steps",
        "0",
        "--steps",
        "50",
        "--prompts-per-step",
        "3",
        "--group-size",
        "2",
        "--max-new-tokens",
        "16",
        "--log-jsonl",
        log.to_str().unwrap(),
        "--rollout-dump",
        dump.to_str().unwrap(),
    ];
    let summary = train::run(
        args(dir.path(), &common),
        listener().await,
        after_steps(log.clone(), 2),
    )
    .await
    .unwrap();
    assert!(summary.interrupted);
    let k = summary.steps.len() as u64;
    assert!(k >= 2);
    let checkpoint = summary.checkpoint.unwrap();
    assert!(checkpoint.ends_with(format!("step-{k:08}")));
    let state: TrainerState =
        serde_json::from_slice(&std::fs::read(checkpoint.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state.step, k);
    let snapshot = state.queue.unwrap();
    let unfinished: BTreeSet<u64> = snapshot.unfinished.iter().map(|p| p.id).collect();
    assert!(!unfinished.is_empty());
    // Nothing lost: every prompt id ever issued was consumed, dropped or is kept.
    let dropped = summary.steps.last().unwrap().dropped_stale_total;
    assert_eq!(
        snapshot.next_prompt_id,
        k * 3 + dropped + unfinished.len() as u64
    );

    // The endpoint shows the steps and the pushes.
    let text =
        tokio::task::spawn_blocking(move || rookworld_service::probe::scrape_metrics(metrics))
            .await
            .unwrap()
            .unwrap();
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert!(value("learner_steps_total") >= k as f64);
    // The learner's first weights are version 1; each step adds one.
    assert_eq!(value("learner_weight_version"), (k + 1) as f64);
    assert!(value("learner_queue_groups_consumed_total") >= (k * 3) as f64);
    assert!(text.contains("learner_step_seconds_bucket{phase=\"forward_backward\""));

    // Resume: the next step is k + 1 and its groups are the kept prompts.
    let before = std::fs::read_to_string(&dump).unwrap().lines().count();
    let mut resumed = common.to_vec();
    resumed.push("--resume");
    let summary = train::run(
        args(dir.path(), &resumed),
        listener().await,
        after_steps(log.clone(), k as usize + 1),
    )
    .await
    .unwrap();
    assert_eq!(summary.steps[0].step, k + 1);
    // The resumed run's curves: a second event file, restarted at step k + 1.
    let files = event_files(&dir.path().join("tensorboard"));
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(curve(&events(&files[0]), "train/reward").1.len() as u64, k);
    let (start, rewards) = curve(&events(&files[1]), "train/reward");
    assert_eq!(start, (k + 1) as i64);
    assert_eq!(rewards[0].0, (k + 1) as i64);
    let dumped = std::fs::read_to_string(&dump).unwrap();
    let first: Vec<u64> = dumped
        .lines()
        .skip(before)
        .take(3)
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt_id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(
        first.iter().all(|id| unfinished.contains(id)),
        "{first:?} not from {unfinished:?}"
    );
}

/// `--no-shared-dir`: the local worker is streamed its weights as a worker on another
/// host would be, deltas included (`--push-deltas always`: on loopback `auto` would
/// stream payloads). Untrained, every group scores alike, so the steps change nothing and
/// each delta after the first push is a few hundred bytes; the step log counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_local_worker_is_sent_deltas_and_the_step_log_counts_them() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let a = args(
        dir.path(),
        &[
            "--sft-steps",
            "0",
            "--steps",
            "6",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "8",
            "--no-shared-dir",
            "--push-deltas",
            "always",
            "--log-jsonl",
            log.to_str().unwrap(),
        ],
    );
    let summary = train::run(a, listener().await, std::future::pending())
        .await
        .unwrap();
    assert_eq!(summary.steps.len(), 6);
    let steps = jsonl(&log);
    let sum = |f: fn(&StepRecord) -> u64| steps.iter().map(f).sum::<u64>();
    let (full, delta, shared) = (
        sum(|r| r.pushed.full),
        sum(|r| r.pushed.delta),
        sum(|r| r.pushed.shared),
    );
    let deltas = sum(|r| u64::from(r.pushed.delta > 0));
    eprintln!("pushed: {full} B full, {delta} B in deltas over {deltas} steps");
    assert_eq!(shared, 0, "no shared file");
    assert!(
        full > 0,
        "the first push is the payload (the worker holds no base)"
    );
    // Pushes run beside the steps: on a loaded machine the sync loop falls behind and
    // sends only the newest version (steps without a push of their own), so count deltas,
    // not steps that carried one.
    assert!(
        delta > 0 && deltas >= 1,
        "later pushes are deltas: {steps:?}"
    );
    if steps.iter().all(|r| r.tokens == 0) {
        let most = steps.iter().map(|r| r.pushed.delta).max().unwrap();
        assert!(
            most < 10_000,
            "steps that changed nothing send almost nothing: {most} B"
        );
    }
}
