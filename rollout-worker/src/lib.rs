//! The rollout worker: holds the current policy and samples G completions per prompt.
//!
//! - [`generate_cmd`]: `rollout-worker generate`, one-shot generation printing JSON lines.
//! - [`bench_cmd`]: `rollout-worker bench`, new tokens per second on the benchmark shape.
//!
//! The gRPC service (`serve`) arrives with the rollout-worker issue.

pub mod bench_cmd;
pub mod generate_cmd;
