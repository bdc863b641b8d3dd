//! The rollout worker: holds the current policy and samples G completions per prompt.
//!
//! - [`generate_cmd`]: `rollout-worker generate`, one-shot generation printing JSON lines.
//!
//! The gRPC service (`serve`) arrives with the rollout-worker issue.

pub mod generate_cmd;
