//! Waiting for a step's groups: the queue kept topped up with prompts (their sampling seeds
//! from one stream per run), the stall watchdog consulted, and the taken groups as a batch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::settings::TrainSettings;
use super::state::Run;
use super::watchdog::{self, Verdict, Watchdog};
use crate::push::Fleet;
use crate::queue::ScoredGroup;
use rookworld_train::batch::GrpoBatch;

/// Seeds of the groups' sampling, one stream per run (continued on resume).
pub(super) fn rand_seed_stream(seed: u64, step: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    rng.set_stream(step);
    rng
}

/// How waiting for a step's groups ended.
pub(super) enum Gathered {
    /// The step's groups, and how many without signal were consumed and skipped on the
    /// way (`--dynamic-sampling`).
    Groups(Vec<ScoredGroup>, usize),
    /// The shutdown signal.
    Stopped,
    /// No step for the stall timeout; why.
    Stalled(String),
}

/// Keeps the queue topped up and waits until P groups are taken, watching for a stall.
pub(super) async fn gather(
    run: &mut Run,
    s: &TrainSettings,
    seeds: &mut rand_chacha::ChaCha8Rng,
    stop: &mut watch::Receiver<bool>,
    watchdog: &mut Watchdog,
    fleet: &Arc<Mutex<Fleet>>,
) -> Gathered {
    use rand::RngCore;
    let version = run.version.load(Ordering::SeqCst);
    let mut skipped = 0;
    loop {
        // The signal is seen before anything is taken: while workers keep a step's groups
        // ready, the loop would otherwise never wait, and never stop.
        if *stop.borrow() {
            return Gathered::Stopped;
        }
        // Only this loop adds prompts: the room it reads is there when they arrive.
        let room = run.queue.run(|q| q.pending_room()).await;
        let prompts: Vec<_> = (0..room)
            .map(|_| (run.source.next_prompt(), seeds.next_u64()))
            .collect();
        let (need, dynamic) = (s.batch.prompts_per_step, s.dynamic_sampling);
        let (groups, dropped, cause_known) = run
            .queue
            .run(move |q| {
                for (p, seed) in prompts {
                    q.add(p, seed);
                }
                q.expire(Instant::now());
                q.purge(version);
                let dropped = if dynamic {
                    q.take_without_signal().len()
                } else {
                    0
                };
                // Take only a full step's worth, so a shutdown never strands taken groups.
                let groups = (q.ready(version) >= need).then(|| q.take(need, version));
                crate::metrics::record_queue(q);
                (groups, dropped, !q.causes(Instant::now()).is_empty())
            })
            .await;
        skipped += dropped;
        if let Some(groups) = groups {
            return Gathered::Groups(groups, skipped);
        }
        let now = Instant::now();
        let verdict = watchdog.check(now, cause_known);
        if verdict != Verdict::Fine {
            let fleet = fleet.clone();
            let why = run
                .queue
                .run(move |q| {
                    let fleet = fleet
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    watchdog::diagnose(q, &fleet, version, need, now)
                })
                .await;
            let limit = watchdog.timeout().unwrap_or_default().as_secs();
            match verdict {
                Verdict::Stalled(idle) => {
                    return Gathered::Stalled(format!(
                        "no step for {} s (--stall-timeout {limit}): {why}",
                        idle.as_secs()
                    ));
                }
                Verdict::Report(idle) if limit == 0 => {
                    tracing::error!("no step for {} s: {why}", idle.as_secs())
                }
                Verdict::Report(idle) => tracing::error!(
                    "no step for {} s (the run stops at {limit} s, --stall-timeout): {why}",
                    idle.as_secs()
                ),
                Verdict::Fine => {}
            }
        }
        tokio::select! {
            _ = stop.wait_for(|&s| s) => return Gathered::Stopped,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// The groups as a batch: the worker's prompt ids, sampled ids, rewards and behaviour
/// log-probs, and the ids left out of the loss as stale.
pub(super) fn to_batch(groups: &[ScoredGroup]) -> GrpoBatch {
    GrpoBatch {
        prompts: groups.iter().map(|g| g.prompt_ids.clone()).collect(),
        completions: groups
            .iter()
            .map(|g| g.completions.iter().map(|c| c.ids.clone()).collect())
            .collect(),
        rewards: groups
            .iter()
            .map(|g| g.completions.iter().map(|c| c.reward).collect())
            .collect(),
        old_logprobs: Some(
            groups
                .iter()
                .map(|g| g.completions.iter().map(|c| c.logprobs.clone()).collect())
                .collect(),
        ),
        proximal_logprobs: None,
        stale_prefix: groups
            .iter()
            .any(|g| g.completions.iter().any(|c| c.stale_prefix > 0))
            .then(|| {
                groups
                    .iter()
                    .map(|g| g.completions.iter().map(|c| c.stale_prefix).collect())
                    .collect()
            }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use candle_core::{DType, Device};
    use clap::{Args, FromArgMatches};

    use super::*;
    use crate::prompts::{Generator, Source};
    use crate::queue::{Queue, QueueHandle};
    use rookworld_train::optim::AdamW;
    use rookworld_train::policy::Trainable;

    fn settings() -> TrainSettings {
        let cmd = TrainSettings::augment_args(clap::Command::new("train"));
        let matches = cmd
            .try_get_matches_from(["train", "--prompts-per-step", "2"])
            .unwrap();
        TrainSettings::from_arg_matches(&matches).unwrap()
    }

    /// Makes `n` of the queue's prompts scored groups of version 1, as a worker would.
    async fn score(queue: &QueueHandle, source: &mut Source, n: usize) {
        let prompts: Vec<_> = (0..n).map(|_| source.next_prompt()).collect();
        queue
            .run(move |q| {
                let now = Instant::now();
                for (seed, prompt) in prompts.into_iter().enumerate() {
                    q.add(prompt, seed as u64);
                    let grant = q.lease("worker", 1, now).unwrap();
                    let group = ScoredGroup {
                        prompt_id: grant[0].prompt.id,
                        prompt: String::new(),
                        prompt_ids: vec![],
                        completions: vec![],
                        worker: String::new(),
                        run_id: "run".into(),
                        weight_version: 1,
                        seed: 0,
                        generate_seconds: 0.0,
                        score_seconds: 0.0,
                        lease_seconds: 0.0,
                    };
                    q.submit("worker", grant[0].lease, group, now).unwrap();
                }
            })
            .await;
    }

    /// A run of the tiny preset at version 1.
    fn run(dir: &std::path::Path, s: &TrainSettings) -> Run {
        let cfg = rookworld_lm::Config::tiny();
        let model = rookworld_lm::model_io::init_random(&cfg, 0, DType::F32, &Device::Cpu).unwrap();
        let mut queue = Queue::new(s.queue_config());
        queue.set_run("run");
        Run {
            policy: Trainable::from_model(&model).unwrap(),
            reference: None,
            opt: AdamW::new(s.adamw()),
            step: 0,
            source: Source::Generated(Box::new(Generator::new(s.seed, s.policy_fraction))),
            queue: QueueHandle::start(queue),
            version: Arc::new(AtomicU64::new(1)),
            run_id: "run".into(),
            settings_json: serde_json::Value::Null,
            resumed: false,
            eval: None,
            record: None,
            _lock: crate::run_lock::RunLock::acquire(dir).unwrap(),
        }
    }

    #[tokio::test]
    async fn a_shutdown_is_seen_while_groups_keep_coming_and_strands_none() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings();
        let mut run = run(dir.path(), &s);
        score(&run.queue, &mut run.source, 2).await;
        let mut seeds = rand_seed_stream(s.seed, 0);
        let mut watchdog = Watchdog::new(Duration::ZERO, Instant::now());
        let fleet = Arc::new(Mutex::new(Fleet::new(Duration::from_secs(1))));
        let (stop_tx, mut stop) = watch::channel(false);

        // A step's groups are ready: they are taken.
        let gathered = gather(&mut run, &s, &mut seeds, &mut stop, &mut watchdog, &fleet).await;
        assert!(matches!(gathered, Gathered::Groups(ref g, 0) if g.len() == 2));

        // Ready again, and the signal has come: the run stops, the groups stay queued.
        score(&run.queue, &mut run.source, 2).await;
        stop_tx.send(true).unwrap();
        let gathered = gather(&mut run, &s, &mut seeds, &mut stop, &mut watchdog, &fleet).await;
        assert!(matches!(gathered, Gathered::Stopped));
        assert_eq!(run.queue.run(|q| q.ready(1)).await, 2);
    }
}
