//! The rollout worker: holds the current policy and samples G completions per prompt.
//!
//! - [`engine`]: continuous-batching generation with shared prompt caches.
//! - [`metrics`]: the Prometheus metrics the worker exports.
//! - [`generate_cmd`]: `rollout-worker generate`, one-shot generation printing JSON lines.
//! - [`bench_cmd`]: `rollout-worker bench`, new tokens per second on the benchmark shape.

pub mod bench_cmd;
pub mod engine;
pub mod generate_cmd;
pub mod metrics;
