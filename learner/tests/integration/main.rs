//! The learner's integration tests, one module per capability, in one test binary: one
//! build and one link for them all instead of one each (`cargo test -p learner --test
//! integration`; a module's tests alone: `... --test integration push::`).
//!
//! Two stay binaries of their own, `train_local.rs` and `train_eval.rs`: each installs the
//! process's one metrics recorder, and each is a whole training run whose reward curve
//! should not share two cores with the rest.

mod common;

mod bench_cli;
mod compare_cli;
mod eval_cli;
mod fused_parity;
mod grpo_parity;
mod init_cli;
mod micro_batches;
mod mixed_precision;
mod push;
mod queue_grpc;
mod queue_load;
mod relay;
mod resume;
mod run_dir;
mod shared_push;
mod stall;
mod step_path;
mod train_ops;
mod updates_per_batch;
mod worker_logprobs;
