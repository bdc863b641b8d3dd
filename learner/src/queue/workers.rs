//! The queue's bounded table of workers: what each leased, submitted and reported.

use std::time::Instant;

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
    /// The version it said it runs in its latest lease, and when.
    pub reported_version: Option<u64>,
    #[serde(skip)]
    pub reported_at: Option<Instant>,
    #[serde(skip)]
    pub last_seen: Option<Instant>,
}

impl Queue {
    /// Records where a known `worker` takes weight pushes and the version it says it runs.
    pub fn describe_worker(&mut self, worker: &str, address: &str, version: u64, now: Instant) {
        if let Some(w) = self.workers.get_mut(worker) {
            if w.push_address != address {
                w.push_address = address.to_owned();
            }
            w.reported_version = Some(version);
            w.reported_at = Some(now);
        }
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

    pub(super) fn seen(&mut self, worker: &str, now: Instant) {
        if let Some(w) = self.workers.get_mut(worker) {
            w.last_seen = Some(now);
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
