//! What the worker's loop is told: where it connects and how hard it works (the loop and
//! its peers both read it).

use std::time::Duration;

/// Where the loop connects and how hard it works.
#[derive(Clone)]
pub struct LoopConfig {
    /// Learner queue URL, e.g. `http://127.0.0.1:50051`.
    pub learner: String,
    /// Reward server URL.
    pub reward: String,
    /// Shared token for the learner's worker calls.
    pub token: String,
    pub worker_id: String,
    /// This worker's RolloutService URL, for the learner's weight pushes (empty: none).
    pub push_address: String,
    /// Groups in flight (leased and not yet submitted).
    pub max_in_flight: usize,
    /// Deadline of every remote call.
    pub call_timeout: Duration,
    /// Longest wait between retries.
    pub max_backoff: Duration,
    /// TLS towards `https://` peers.
    pub tls: rookworld_service::tls::ClientTlsArgs,
}

impl std::fmt::Debug for LoopConfig {
    /// Everything but the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopConfig")
            .field("learner", &self.learner)
            .field("reward", &self.reward)
            .field("worker_id", &self.worker_id)
            .field("push_address", &self.push_address)
            .field("max_in_flight", &self.max_in_flight)
            .field("call_timeout", &self.call_timeout)
            .field("max_backoff", &self.max_backoff)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}
