//! The metric names this crate records (the reward server describes them).

/// Every metric name of this crate, once: the describe calls and the recording sites use
/// these.
pub mod names {
    pub const ENGINE_CACHE_HITS_TOTAL: &str = "reward_engine_cache_hits_total";
    pub const ENGINE_CACHE_MISSES_TOTAL: &str = "reward_engine_cache_misses_total";
    pub const ENGINE_FAILURES_TOTAL: &str = "reward_engine_failures_total";
    pub const ENGINE_RESTARTS_TOTAL: &str = "reward_engine_restarts_total";
}
