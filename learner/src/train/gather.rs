//! Waiting for a step's groups: the queue kept topped up with prompts (their sampling seeds
//! from one stream per run), the stall watchdog consulted, and the taken groups as a batch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::watchdog::{self, Verdict, Watchdog};
use super::{Run, TrainSettings};
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
/// log-probs.
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
    }
}
