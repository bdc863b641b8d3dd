//! Weight sets as they travel from the learner to the rollout workers, in one crate both
//! sides use: the learner builds and pushes them, a worker assembles, checks and applies
//! them.
//!
//! - [`set`]: a model serialised as a bfloat16 safetensors payload
//!   ([`rookworld_lm::bf16_payload`]), cut into chunks behind a header (version, run,
//!   size, BLAKE3 hash) and put back together with every check made before anything is
//!   trusted; the same-host path, where the payload is one shared file.
//! - [`export`]: the learner's side — payload buffers the optimizer writes into (pooled;
//!   files in the shared directory on the same-host path), hashed and published off the
//!   training thread, newest first.
//! - [`refill`]: a worker's next weights written into a retired model's memory, in place.
//! - [`delta`]: a payload sent against one the worker holds, only what changed.
//! - [`relay`]: a push that the worker forwards to others while it receives it.

pub mod delta;
pub mod export;
pub mod refill;
pub mod relay;
pub mod set;

pub use set::{WeightError, WeightSet};
