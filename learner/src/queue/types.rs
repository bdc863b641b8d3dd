//! The queue's vocabulary: its bounds, what a worker leases and submits, what the learner
//! takes, the refusals, and the counters that account for every prompt.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::prompts::TaskPrompt;

pub type PromptId = u64;
pub type LeaseId = u64;

/// Bounds and policies of the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// Prompts kept ready to lease.
    pub max_pending: usize,
    /// Scored groups waiting for the learner; at this bound leases stop (backpressure).
    /// Leases already out may still submit, so at most `max_scored + max_leased` wait.
    pub max_scored: usize,
    /// Leases outstanding at once.
    pub max_leased: usize,
    /// Time a worker has to submit a leased prompt.
    pub lease_timeout: Duration,
    /// Groups sampled more than this many versions behind the learner are dropped.
    pub max_version_lag: u64,
    /// Workers tracked at once; past it the longest-silent worker without leases is
    /// forgotten, and when every one holds leases a new worker is refused.
    pub max_workers: usize,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_pending: 256,
            max_scored: 64,
            max_leased: 256,
            lease_timeout: Duration::from_secs(120),
            max_version_lag: 2,
            max_workers: 1024,
        }
    }
}

/// A prompt as queued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedPrompt {
    pub id: PromptId,
    pub prompt: TaskPrompt,
    /// Sampling seed of this prompt's group.
    pub seed: u64,
    /// Leases issued for it so far (re-issues after expiry count).
    pub attempts: u32,
}

/// What a worker receives for one leased prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub lease: LeaseId,
    pub prompt: QueuedPrompt,
    pub deadline: Instant,
}

/// One scored completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoredCompletion {
    pub ids: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<f32>,
    pub reward: f32,
    /// Reward components by name (format, legality, …).
    pub components: BTreeMap<String, f32>,
    /// The weight version that sampled each id, where they differ (an update mid-
    /// completion); empty when the group's `weight_version` sampled them all.
    pub token_versions: Vec<u64>,
    /// Leading ids the learner leaves out of the loss, sampled by weights past its
    /// staleness limit (set when the learner takes the group; 0 before).
    #[serde(skip_serializing_if = "is_zero")]
    pub stale_prefix: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A prompt's G scored completions, as a worker submits them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoredGroup {
    pub prompt_id: PromptId,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub completions: Vec<ScoredCompletion>,
    pub worker: String,
    /// The run of the weights it was sampled with (versions count within a run).
    pub run_id: String,
    /// The oldest weight version that sampled a token of the group; each token's own in
    /// its completion's `token_versions`. The staleness limit keeps the group while its
    /// newest token is within it, and leaves the tokens past it out of the loss.
    pub weight_version: u64,
    pub seed: u64,
    pub generate_seconds: f64,
    pub score_seconds: f64,
    /// Lease to submission, as the queue saw it.
    pub lease_seconds: f64,
}

impl ScoredGroup {
    /// The newest weight version that sampled a token of the group.
    pub fn newest_version(&self) -> u64 {
        self.completions
            .iter()
            .flat_map(|c| c.token_versions.iter().copied())
            .fold(self.weight_version, u64::max)
    }

    /// Whether its rewards differ (equal rewards give every completion advantage 0).
    pub fn has_signal(&self) -> bool {
        self.completions
            .windows(2)
            .any(|w| w[0].reward != w[1].reward)
    }

    /// Bytes the group holds: its ids, log-probs, texts and components (what the queue's
    /// memory is made of; the bounded size of each comes from the submission checks).
    pub fn size_bytes(&self) -> usize {
        let completions: usize = self
            .completions
            .iter()
            .map(|c| {
                8 * c.ids.len()
                    + 8 * c.token_versions.len()
                    + c.text.len()
                    + c.components.keys().map(|k| k.len() + 4).sum::<usize>()
            })
            .sum();
        4 * self.prompt_ids.len() + self.prompt.len() + self.worker.len() + completions
    }
}

/// Why a lease was not granted now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Backpressure {
    #[error("the learner is behind: {scored} scored groups wait (bound {bound})")]
    LearnerBehind { scored: usize, bound: usize },
    #[error("{leased} leases outstanding (bound {bound})")]
    TooManyLeases { leased: usize, bound: usize },
    #[error("no prompts pending")]
    Empty,
    #[error("the learner is shutting down")]
    Closed,
    #[error("{bound} workers hold leases already (bound)")]
    TooManyWorkers { bound: usize },
    /// The learner cannot reach the worker's push address: its groups would all be made
    /// with weights that never change. The text says what to do.
    #[error("{0}")]
    PushUnreachable(String),
}

/// Why a submission was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("lease {0} is unknown, expired or already submitted")]
    UnknownLease(LeaseId),
    #[error("lease {lease} belongs to worker {owner}, not {worker}")]
    WrongWorker {
        lease: LeaseId,
        owner: String,
        worker: String,
    },
    #[error("group is for prompt {got}, lease {lease} is for prompt {want}")]
    WrongPrompt {
        lease: LeaseId,
        got: PromptId,
        want: PromptId,
    },
}

/// Refused calls of one (call, cause, caller).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refused {
    pub count: u64,
    pub last: Instant,
}

/// Counters of everything that ever happened in the run (monotonic, kept across resumes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub prompts_added: u64,
    pub leases_issued: u64,
    pub leases_expired: u64,
    pub leases_released: u64,
    pub groups_submitted: u64,
    pub submissions_refused: u64,
    pub groups_consumed: u64,
    /// Groups not trained on: too many versions behind, or of a retired or unknown version.
    pub groups_dropped_stale: u64,
}

/// The queue's depths now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Depths {
    pub pending: usize,
    pub leased: usize,
    pub scored: usize,
    /// Bytes the scored groups hold ([`ScoredGroup::size_bytes`]).
    pub scored_bytes: usize,
    pub counters: Counters,
}
