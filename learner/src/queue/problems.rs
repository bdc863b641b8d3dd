//! Why workers cannot deliver groups: what each reports (`Report`), and the worker calls
//! refused before they reached the queue (no or wrong token), by call, cause and caller. The
//! learner names these when it waits for groups, instead of counts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Backpressure, Queue, Refused};
use crate::metrics::names;

/// Most distinct (call, cause, caller) entries kept; the oldest goes first.
const MAX_REFUSED: usize = 64;

/// A cause is current while it was seen this recently.
pub const CURRENT: Duration = Duration::from_secs(60);

/// Why a worker cannot deliver (the proto's `ProblemCause` but none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Cause {
    ScoringRefused,
    RewardUnreachable,
    SubmitRefused,
    GenerationFailed,
}

impl Cause {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Cause::ScoringRefused => "scoring_refused",
            Cause::RewardUnreachable => "reward_unreachable",
            Cause::SubmitRefused => "submit_refused",
            Cause::GenerationFailed => "generation_failed",
        }
    }
}

/// What a worker reported keeps it from delivering.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Problem {
    pub cause: Cause,
    /// The peer at fault as the worker reaches it (empty: the worker itself).
    pub peer: String,
    /// gRPC code of the failed call, if any.
    pub code: String,
    pub message: String,
    #[serde(skip)]
    pub at: Option<Instant>,
}

impl Problem {
    /// `cannot score: reward server URL refuses (PermissionDenied): no token …`
    pub fn describe(&self) -> String {
        let code = if self.code.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.code)
        };
        match self.cause {
            Cause::ScoringRefused => format!(
                "cannot score: reward server {} refuses{code}: {}",
                self.peer, self.message
            ),
            Cause::RewardUnreachable => format!(
                "cannot score: reward server {} unreachable: {}",
                self.peer, self.message
            ),
            Cause::SubmitRefused => format!(
                "cannot submit: this queue ({}) refuses{code}: {}",
                self.peer, self.message
            ),
            Cause::GenerationFailed => format!("cannot generate: {}", self.message),
        }
    }
}

impl Queue {
    /// Records what `worker` reports keeps it from delivering (`None`: nothing any more).
    /// A worker not seen before takes a place in the worker table.
    pub fn report(
        &mut self,
        worker: &str,
        problem: Option<Problem>,
        now: Instant,
    ) -> Result<(), Backpressure> {
        self.admit(worker, now)?;
        let w = self.workers.get_mut(worker).expect("admitted");
        if let Some(p) = &problem
            && w.problem.as_ref().is_none_or(|old| old.cause != p.cause)
        {
            metrics::counter!(names::WORKER_PROBLEMS_TOTAL, "cause" => p.cause.label())
                .increment(1);
        }
        w.problem = problem;
        Ok(())
    }

    /// Counts a worker call refused before it reached the queue.
    pub fn refused_call(&mut self, call: &str, cause: &str, caller: &str, now: Instant) {
        metrics::counter!(names::QUEUE_REFUSED_CALLS_TOTAL, "call" => call.to_owned(), "cause" => cause.to_owned())
            .increment(1);
        let key = (call.to_owned(), cause.to_owned(), caller.to_owned());
        if !self.refused.contains_key(&key) && self.refused.len() >= MAX_REFUSED {
            let oldest = self
                .refused
                .iter()
                .min_by_key(|(_, r)| r.last)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.refused.remove(&k);
            }
        }
        let entry = self.refused.entry(key).or_insert(Refused {
            count: 0,
            last: now,
        });
        entry.count += 1;
        entry.last = now;
    }

    /// Refused calls by (call, cause, caller).
    pub fn refused_calls(&self) -> &BTreeMap<(String, String, String), Refused> {
        &self.refused
    }

    /// The causes seen in the last [`CURRENT`], one phrase each, most common first: workers'
    /// reports grouped by what they say, then refused calls, then what blocks the pushes
    /// to workers heard from ([`Queue::set_push_problem`]). Empty when none is known.
    pub fn causes(&self, now: Instant) -> Vec<String> {
        let recent =
            |t: Option<Instant>| t.is_some_and(|t| now.saturating_duration_since(t) < CURRENT);
        let total = self.workers.len();
        let mut reports: BTreeMap<String, usize> = BTreeMap::new();
        for w in self.workers.values() {
            if let Some(p) = w.problem.as_ref().filter(|p| recent(p.at)) {
                *reports.entry(p.describe()).or_default() += 1;
            }
        }
        let mut reports: Vec<(String, usize)> = reports.into_iter().collect();
        reports.sort_by_key(|r| std::cmp::Reverse(r.1));
        let mut out: Vec<String> = reports
            .into_iter()
            .map(|(what, n)| format!("{n} of {total} workers {what}"))
            .collect();
        for ((call, cause, caller), r) in &self.refused {
            if recent(Some(r.last)) {
                let hint = match cause.as_str() {
                    "wrong token" => "; the caller's --token differs from this learner's",
                    "no token" => "; the caller sends no token (--token, --token-file)",
                    _ => "",
                };
                out.push(format!(
                    "{call} calls from {caller} refused: {cause} ({} calls{hint})",
                    r.count
                ));
            }
        }
        let blocked: std::collections::BTreeSet<&String> = self
            .workers
            .values()
            .filter(|w| recent(w.last_seen))
            .filter_map(|w| self.push_problems.get(&w.push_address))
            .collect();
        out.extend(blocked.into_iter().cloned());
        out
    }
}
