//! The rollout worker: holds the current policy and samples G completions per prompt.
//!
//! - [`app`]: the command line; `main.rs` only calls [`app::main`].
//! - generation (continuous batching with shared prompt caches) is the
//!   `rookworld-generation` crate, named `engine` here.
//! - [`worker`]: [`Worker::start`], the one way to run a worker: its service, its loop
//!   and its GPU monitor over one model.
//! - [`service`]: the gRPC service (`rookworld.rollout.v1.RolloutService`); [`error`]
//!   maps its errors to gRPC status codes.
//! - [`worker_loop`]: lease → generate → score → submit against a learner and a reward
//!   server, with back-off and several groups in flight.
//! - weight sets on the wire (chunks, checksum, checks) are the `rookworld-weights` crate.
//! - [`metrics`]: the Prometheus metrics the worker exports; [`gpu`] reads the GPU's
//!   utilisation from NVML for them.
//! - [`generate_cmd`]: `rollout-worker generate`, one-shot generation printing JSON lines.
//! - [`serve_cmd`]: `rollout-worker serve`, the gRPC service and metrics endpoint.
//! - [`bench_cmd`]: `rollout-worker bench`, new tokens per second on the benchmark shape.
//! - [`parity_cmd`]: `rollout-worker parity`, a device's logits and greedy tokens against
//!   the CPU's.

pub mod app;
pub mod bench_cmd;
pub mod error;
pub mod generate_cmd;
pub mod gpu;
pub mod metrics;
pub mod parity_cmd;
pub mod serve_cmd;
pub mod service;
pub mod worker;
pub mod worker_loop;

pub use service::ServiceConfig;
pub use worker::{StartError, Worker, WorkerConfig};
pub use worker_loop::LoopConfig;

use rookworld_generation as engine;
