//! The rollout queue: prompts leased to workers with deadlines, scored groups waiting for
//! the learner, and the accounting that shows nothing is lost or counted twice.
//!
//! Every prompt has an id. It is leased to one worker at a time; a lease that passes its
//! deadline (or whose worker goes away) puts the prompt back at the front of the queue and
//! a later submission under the old lease is refused. A submitted group waits in a bounded
//! buffer until the learner takes it; groups older than the allowed weight-version lag are
//! dropped and counted, and so are groups of weights the learner no longer stands on (a
//! retired version range, after a resume from a crash) or never published. So every prompt
//! ends in exactly one consumed group or one counted drop; the counters go into checkpoints
//! and continue on resume. The queue is bounded everywhere: pending prompts, leases, scored
//! groups and the worker table. Time is passed in, so the logic is tested without clocks.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use crate::prompts::TaskPrompt;

#[derive(Debug, Clone)]
struct Lease {
    worker: String,
    prompt: QueuedPrompt,
    deadline: Instant,
    issued: Instant,
}

/// The rollout queue.
#[derive(Debug)]
pub struct Queue {
    cfg: QueueConfig,
    pending: VecDeque<QueuedPrompt>,
    leases: HashMap<LeaseId, Lease>,
    /// Scored groups with the prompt each answers (kept for checkpoints).
    scored: VecDeque<(QueuedPrompt, ScoredGroup)>,
    /// What `scored` holds, bytes.
    scored_bytes: usize,
    workers: BTreeMap<String, WorkerStats>,
    counters: Counters,
    next_prompt: PromptId,
    next_lease: LeaseId,
    /// Consumed groups by version lag (0, 1, 2, …; the last bucket holds the rest).
    staleness: [u64; 8],
    /// Inclusive version ranges whose groups are dropped (weights of a crashed run).
    retired: Vec<(u64, u64)>,
    /// No more leases (the learner is draining before it stops).
    closed: bool,
    /// The run the learner's weight versions belong to.
    run_id: String,
    /// Push addresses the learner could not connect to, and what to tell their workers.
    push_problems: BTreeMap<String, String>,
    /// Push addresses a push has reached: one that stops answering has stopped, not been
    /// advertised wrongly.
    pushes_reached: std::collections::BTreeSet<String>,
    /// Who sent each push address its current weights: `learner` or a relay's address.
    weight_parents: BTreeMap<String, String>,
    /// Worker calls refused before they reached the queue ([`problems`]).
    refused: BTreeMap<(String, String, String), Refused>,
}

impl Queue {
    pub fn new(cfg: QueueConfig) -> Self {
        Self {
            cfg,
            pending: VecDeque::new(),
            leases: HashMap::new(),
            scored: VecDeque::new(),
            scored_bytes: 0,
            workers: BTreeMap::new(),
            counters: Counters::default(),
            next_prompt: 0,
            next_lease: 1,
            staleness: [0; 8],
            retired: Vec::new(),
            closed: false,
            run_id: String::new(),
            push_problems: BTreeMap::new(),
            pushes_reached: std::collections::BTreeSet::new(),
            weight_parents: BTreeMap::new(),
            refused: BTreeMap::new(),
        }
    }

    /// Sets the run whose weight versions count: groups of another run's weights are
    /// dropped (and counted with the stale ones), and workers reporting another run's
    /// weights are taken to run none of the learner's versions.
    pub fn set_run(&mut self, run_id: &str) {
        self.run_id = run_id.to_owned();
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Stops handing out leases; submissions under outstanding leases are still taken.
    pub fn close(&mut self) {
        self.closed = true;
    }

    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    /// Room for this many more pending prompts.
    pub fn pending_room(&self) -> usize {
        self.cfg.max_pending.saturating_sub(self.pending.len())
    }

    /// Queues a prompt (when there is room); returns its id.
    pub fn add(&mut self, prompt: TaskPrompt, seed: u64) -> Option<PromptId> {
        if self.pending_room() == 0 {
            return None;
        }
        let id = self.next_prompt;
        self.next_prompt += 1;
        self.counters.prompts_added += 1;
        self.pending.push_back(QueuedPrompt {
            id,
            prompt,
            seed,
            attempts: 0,
        });
        Some(id)
    }

    /// Leases up to `max` prompts to `worker` until `now + lease_timeout`.
    pub fn lease(
        &mut self,
        worker: &str,
        max: usize,
        now: Instant,
    ) -> Result<Vec<Grant>, Backpressure> {
        self.expire(now);
        self.admit(worker, now)?;
        if let Some(problem) = self.push_problem(worker) {
            return Err(Backpressure::PushUnreachable(problem.to_owned()));
        }
        if self.closed {
            return Err(Backpressure::Closed);
        }
        if self.scored.len() >= self.cfg.max_scored {
            return Err(Backpressure::LearnerBehind {
                scored: self.scored.len(),
                bound: self.cfg.max_scored,
            });
        }
        let room = self.cfg.max_leased.saturating_sub(self.leases.len());
        if room == 0 {
            return Err(Backpressure::TooManyLeases {
                leased: self.leases.len(),
                bound: self.cfg.max_leased,
            });
        }
        if self.pending.is_empty() {
            return Err(Backpressure::Empty);
        }
        let deadline = now + self.cfg.lease_timeout;
        let mut grants = Vec::new();
        while grants.len() < max.min(room) {
            let Some(mut prompt) = self.pending.pop_front() else {
                break;
            };
            prompt.attempts += 1;
            let lease = self.next_lease;
            self.next_lease += 1;
            self.leases.insert(
                lease,
                Lease {
                    worker: worker.to_owned(),
                    prompt: prompt.clone(),
                    deadline,
                    issued: now,
                },
            );
            grants.push(Grant {
                lease,
                prompt,
                deadline,
            });
        }
        self.counters.leases_issued += grants.len() as u64;
        let w = self.workers.entry(worker.to_owned()).or_default();
        w.leased += grants.len() as u64;
        w.outstanding += grants.len();
        Ok(grants)
    }

    /// Takes a worker's scored group for `lease`.
    pub fn submit(
        &mut self,
        worker: &str,
        lease: LeaseId,
        mut group: ScoredGroup,
        now: Instant,
    ) -> Result<(), SubmitError> {
        self.expire(now);
        self.seen(worker, now);
        let refuse = |q: &mut Self, e: SubmitError| {
            q.counters.submissions_refused += 1;
            if let Some(w) = q.workers.get_mut(worker) {
                w.refused += 1;
            }
            Err(e)
        };
        let Some(held) = self.leases.get(&lease) else {
            return refuse(self, SubmitError::UnknownLease(lease));
        };
        if held.worker != worker {
            let e = SubmitError::WrongWorker {
                lease,
                owner: held.worker.clone(),
                worker: worker.to_owned(),
            };
            return refuse(self, e);
        }
        if held.prompt.id != group.prompt_id {
            let e = SubmitError::WrongPrompt {
                lease,
                got: group.prompt_id,
                want: held.prompt.id,
            };
            return refuse(self, e);
        }
        let held = self.leases.remove(&lease).expect("checked above");
        group.worker = worker.to_owned();
        // The lease's owner is in the table: a worker with leases is never forgotten.
        group.prompt = held.prompt.prompt.prompt.clone();
        group.seed = held.prompt.seed;
        group.lease_seconds = now.duration_since(held.issued).as_secs_f64();
        let w = self.workers.entry(worker.to_owned()).or_default();
        w.submitted += 1;
        w.outstanding = w.outstanding.saturating_sub(1);
        w.weight_version = group.weight_version;
        self.counters.groups_submitted += 1;
        self.scored_bytes += group.size_bytes();
        self.scored.push_back((held.prompt, group));
        Ok(())
    }

    /// The prompt text under lease `lease`, while it is outstanding.
    pub fn leased_prompt(&self, lease: LeaseId) -> Option<String> {
        self.leases
            .get(&lease)
            .map(|l| l.prompt.prompt.prompt.clone())
    }

    /// Puts every lease past its deadline back at the front of the queue; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        let n = expired.len();
        self.requeue(expired, true);
        n
    }

    fn requeue(&mut self, mut ids: Vec<LeaseId>, expired: bool) {
        // Oldest prompts first at the front.
        ids.sort_unstable_by_key(|id| std::cmp::Reverse(self.leases[id].prompt.id));
        for id in ids {
            let lease = self.leases.remove(&id).expect("listed above");
            let w = self.workers.entry(lease.worker.clone()).or_default();
            w.outstanding = w.outstanding.saturating_sub(1);
            if expired {
                w.expired += 1;
                self.counters.leases_expired += 1;
            } else {
                self.counters.leases_released += 1;
            }
            self.pending.push_front(lease.prompt);
        }
    }

    /// The version lag of a group for a learner at `version`, or `None` when the group is
    /// not to be trained on: of another run's weights, or its newest token's version too
    /// many versions behind, retired, or ahead of the learner (weights it never published).
    fn lag(&self, version: u64, group: &ScoredGroup) -> Option<u64> {
        if group.run_id != self.run_id {
            return None;
        }
        self.version_lag(version, group.newest_version())
    }

    /// How far weight version `v` of this run is behind a learner at `version`, when its
    /// tokens are trained on: at most `max_version_lag`, not retired, not ahead.
    fn version_lag(&self, version: u64, v: u64) -> Option<u64> {
        let lag = version.checked_sub(v)?;
        let retired = self
            .retired
            .iter()
            .any(|&(from, to)| (from..=to).contains(&v));
        (!retired && lag <= self.cfg.max_version_lag).then_some(lag)
    }

    /// Sets each completion's `stale_prefix` for a learner at `version`: its ids up to the
    /// last one whose version is not trained on (an update reached the worker mid-
    /// completion, so its first ids may be older than the limit). Returns the lag of the
    /// oldest version the group is trained on.
    fn mark_stale(&self, version: u64, group: &mut ScoredGroup) -> u64 {
        let mut oldest = None;
        for c in &mut group.completions {
            c.stale_prefix = c
                .token_versions
                .iter()
                .rposition(|&v| self.version_lag(version, v).is_none())
                .map_or(0, |i| i + 1);
            let first = match c.token_versions.get(c.stale_prefix) {
                Some(&v) => v,
                None if c.token_versions.is_empty() => group.weight_version,
                None => continue, // every id stale
            };
            oldest = oldest.max(Some(version.saturating_sub(first)));
        }
        oldest.unwrap_or(version.saturating_sub(group.weight_version))
    }

    /// Drops (and counts) every waiting group a learner at `version` would not train on,
    /// so that unusable groups never hold the buffer (and with it the leases) shut;
    /// returns how many.
    pub fn purge(&mut self, version: u64) -> usize {
        let before = self.scored.len();
        let scored = std::mem::take(&mut self.scored);
        for (prompt, group) in scored {
            if self.lag(version, &group).is_some() {
                self.scored.push_back((prompt, group));
            } else {
                self.scored_bytes -= group.size_bytes();
                self.counters.groups_dropped_stale += 1;
            }
        }
        before - self.scored.len()
    }

    /// DAPO's dynamic sampling: consumes (and returns) every waiting group without signal,
    /// so that it neither fills a step nor holds the buffer that other groups need.
    pub fn take_without_signal(&mut self) -> Vec<ScoredGroup> {
        let (keep, skip): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.scored)
            .into_iter()
            .partition(|(_, g)| g.has_signal());
        self.scored = keep;
        skip.into_iter()
            .map(|(_, group)| {
                self.scored_bytes -= group.size_bytes();
                self.counters.groups_consumed += 1;
                group
            })
            .collect()
    }

    /// Scored groups a learner at `version` could take now.
    pub fn ready(&self, version: u64) -> usize {
        self.scored
            .iter()
            .filter(|(_, g)| self.lag(version, g).is_some())
            .count()
    }

    /// Up to `max` scored groups for a learner at weight version `version`, oldest first,
    /// each completion's ids past the staleness limit marked (`stale_prefix`). Groups it
    /// would not train on (see [`Queue::purge`]) are dropped and counted instead.
    pub fn take(&mut self, max: usize, version: u64) -> Vec<ScoredGroup> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some((_, mut group)) = self.scored.pop_front() else {
                break;
            };
            self.scored_bytes -= group.size_bytes();
            if self.lag(version, &group).is_none() {
                self.counters.groups_dropped_stale += 1;
                continue;
            }
            let lag = self.mark_stale(version, &mut group);
            self.staleness[(lag as usize).min(self.staleness.len() - 1)] += 1;
            self.counters.groups_consumed += 1;
            out.push(group);
        }
        out
    }

    pub fn depths(&self) -> Depths {
        Depths {
            pending: self.pending.len(),
            leased: self.leases.len(),
            scored: self.scored.len(),
            scored_bytes: self.scored_bytes,
            counters: self.counters,
        }
    }

    /// Consumed groups by version lag: bucket i holds lag i (the last: that or more).
    pub fn staleness(&self) -> &[u64] {
        &self.staleness
    }

    /// Up to `n` waiting groups, newest or oldest first.
    pub fn peek(&self, n: usize, newest: bool) -> Vec<ScoredGroup> {
        if newest {
            self.scored
                .iter()
                .rev()
                .take(n)
                .map(|(_, g)| g.clone())
                .collect()
        } else {
            self.scored.iter().take(n).map(|(_, g)| g.clone()).collect()
        }
    }
}

mod handle;
pub mod problems;
mod snapshot;
mod types;
mod workers;

pub use handle::QueueHandle;
pub use snapshot::QueueSnapshot;
pub use types::{
    Backpressure, Counters, Depths, Grant, LeaseId, PromptId, QueueConfig, QueuedPrompt, Refused,
    ScoredCompletion, ScoredGroup, SubmitError,
};
pub use workers::{DuplicateWorker, WorkerStats};

#[cfg(test)]
mod tests;
