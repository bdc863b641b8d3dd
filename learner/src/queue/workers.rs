//! The queue's bounded table of workers: what each leased, submitted and reported.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Backpressure, LeaseId, Queue};

/// Per-worker view.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WorkerStats {
    pub leased: u64,
    pub submitted: u64,
    pub expired: u64,
    pub refused: u64,
    pub outstanding: usize,
    /// Weight version of its latest submission.
    pub weight_version: u64,
    /// Where it takes weight pushes (from its latest lease; empty: none).
    pub push_address: String,
    /// The run of the weights it said it runs in its latest lease.
    pub reported_run: String,
    /// The version it said it runs in its latest lease (0 when of another run: none of
    /// the learner's versions), and when.
    pub reported_version: Option<u64>,
    #[serde(skip)]
    pub reported_at: Option<Instant>,
    #[serde(skip)]
    pub last_seen: Option<Instant>,
    /// When the worker at `push_address` last leased under this id, or a group was
    /// submitted under it: the address holds the id while this is recent
    /// ([`Queue::claim`]).
    #[serde(skip)]
    pub held_at: Option<Instant>,
    /// What it last reported keeps it from delivering ([`super::problems`]).
    pub problem: Option<super::problems::Problem>,
}

/// A worker that leases under an id another worker holds: two workers started with one
/// `--worker-id`, which would otherwise take turns as one worker (each lease moving its
/// push address).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "worker id `{id}` is in use by the worker at {holder} (heard from {:.0} s ago, and it \
     answers there), so the worker at {claimant} is refused: give each worker its own \
     --worker-id (ROLLOUT_WORKER_ID)",
    silent.as_secs_f64()
)]
pub struct DuplicateWorker {
    pub id: String,
    /// The push address of the worker that holds the id.
    pub holder: String,
    /// The push address of the one refused.
    pub claimant: String,
    /// How long ago the holder was heard from.
    pub silent: Duration,
}

impl Queue {
    /// Whether the worker at push address `address` may lease under the id `worker`: not
    /// while the worker at another address holds it (leased under it, or a group came
    /// under it, within the lease timeout: a live worker does one or the other that
    /// often). The queue's service lets the newcomer in all the same when nothing answers
    /// at the holder's address (it restarted elsewhere). Workers without a push address
    /// are not told apart.
    pub fn claim(&self, worker: &str, address: &str, now: Instant) -> Result<(), DuplicateWorker> {
        let Some(w) = self.workers.get(worker) else {
            return Ok(());
        };
        if address.is_empty() || w.push_address.is_empty() || w.push_address == address {
            return Ok(());
        }
        match w.held_at.map(|t| now.saturating_duration_since(t)) {
            Some(silent) if silent < self.cfg.lease_timeout => Err(DuplicateWorker {
                id: worker.to_owned(),
                holder: w.push_address.clone(),
                claimant: address.to_owned(),
                silent,
            }),
            _ => Ok(()),
        }
    }

    /// Records where a known `worker` takes weight pushes and the version (of run `run`)
    /// it says it runs.
    pub fn describe_worker(
        &mut self,
        worker: &str,
        address: &str,
        (run, version): (&str, u64),
        now: Instant,
    ) {
        let ours = run == self.run_id;
        if let Some(w) = self.workers.get_mut(worker) {
            if w.push_address != address {
                w.push_address = address.to_owned();
            }
            if w.reported_run != run {
                w.reported_run = run.to_owned();
            }
            w.reported_version = Some(if ours { version } else { 0 });
            w.reported_at = Some(now);
            w.held_at = Some(now);
        }
    }

    /// Records that no push reaches or fits the worker at `address` (`Some(why)`: no
    /// answer, TLS on one side only, another model) or that one did (`None`); returns
    /// whether `why` is new for the address.
    pub fn set_push_problem(&mut self, address: &str, problem: Option<String>) -> bool {
        match problem {
            Some(why) => {
                let new = self.push_problems.get(address) != Some(&why);
                self.push_problems.insert(address.to_owned(), why);
                new
            }
            None => {
                self.push_problems.remove(address);
                self.pushes_reached.insert(address.to_owned());
                false
            }
        }
    }

    /// Records who sent the worker at `address` its current weights (`learner`, or the
    /// address of the worker that relayed them); returns the one before, when it differs.
    pub fn set_weight_parent(&mut self, address: &str, parent: &str) -> Option<Option<String>> {
        let before = self.weight_parents.get(address).cloned();
        if before.as_deref() == Some(parent) {
            return None;
        }
        self.weight_parents
            .insert(address.to_owned(), parent.to_owned());
        Some(before)
    }

    /// Who sent the worker at `address` its current weights ([`Queue::set_weight_parent`]).
    pub fn weight_parent(&self, address: &str) -> Option<&str> {
        self.weight_parents.get(address).map(String::as_str)
    }

    /// Whether a push has reached the worker at `address` in this run.
    pub fn push_reached(&self, address: &str) -> bool {
        self.pushes_reached.contains(address)
    }

    /// Why `worker` should not lease: no push reaches or fits it (it would generate with
    /// weights that never change, and every group would be dropped).
    pub fn push_problem(&self, worker: &str) -> Option<&str> {
        let address = &self.workers.get(worker)?.push_address;
        self.push_problems.get(address).map(String::as_str)
    }

    /// Makes room for `worker` in the bounded worker table: a new worker takes the place of
    /// the longest-silent one without leases, or is refused when every one holds leases.
    pub(super) fn admit(&mut self, worker: &str, now: Instant) -> Result<(), Backpressure> {
        if !self.workers.contains_key(worker) && self.workers.len() >= self.cfg.max_workers {
            let idle = self
                .workers
                .iter()
                .filter(|(_, w)| w.outstanding == 0)
                .min_by_key(|(_, w)| w.last_seen)
                .map(|(id, _)| id.clone());
            let Some(idle) = idle else {
                return Err(Backpressure::TooManyWorkers {
                    bound: self.cfg.max_workers,
                });
            };
            self.workers.remove(&idle);
        }
        self.workers.entry(worker.to_owned()).or_default().last_seen = Some(now);
        Ok(())
    }

    /// A group came under `worker`'s id (only the holder of an id leases under it).
    pub(super) fn seen(&mut self, worker: &str, now: Instant) {
        if let Some(w) = self.workers.get_mut(worker) {
            w.last_seen = Some(now);
            w.held_at = Some(now);
        }
    }

    pub fn workers(&self) -> &std::collections::BTreeMap<String, WorkerStats> {
        &self.workers
    }

    /// Returns every lease of `worker` to the queue (it went away); returns how many.
    pub fn release_worker(&mut self, worker: &str) -> usize {
        let held: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.worker == worker)
            .map(|(&id, _)| id)
            .collect();
        let n = held.len();
        self.requeue(held, false);
        n
    }
}
