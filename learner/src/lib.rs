//! The GRPO learner: the service around the training step of [`rookworld_train`] (its
//! objectives, policy, micro-batch loop and optimizer). The learner holds the command
//! line, the rollout queue, the weight pushes, run directories and evaluation; its flags
//! become the step's own settings in one place ([`settings`]).
//!
//! - [`app`]: the command line; `main.rs` only calls [`app::main`].
//! - [`init_cmd`]: `learner init`, writes a starting checkpoint (random preset or a
//!   converted checkpoint) in Hugging Face layout; [`export_cmd`]: `learner export`, a
//!   model as a directory `transformers` loads (model, tokenizer, generation config only).
//! - [`settings`]: the objective's and the batch's flags shared by `train`, `loss` and
//!   `bench`, and their conversion into [`rookworld_train::loss::LossConfig`].
//! - [`loss_cmd`]: `learner loss`, the loss and gradient norm of one batch as JSON.
//! - [`sft`]: `learner sft`, supervised warm-up; [`checkpoint`]: training checkpoints
//!   (model, optimizer, trainer state) written atomically, for exact resume.
//! - [`queue`]: the rollout queue (leases with deadlines, bounded buffers, staleness);
//!   [`queue_service`]: it over gRPC with inspection calls.
//! - [`metrics`]: the learner's Prometheus metrics (queue, pushes).
//! - [`push`]: BF16 weight pushes to every worker in parallel, each with a deadline;
//!   their payload is [`rookworld_weights::export`], written by the optimizer.
//! - [`prompts`]: generated and loaded training prompts, with a resumable cursor.
//! - [`train`]: `learner train`, the GRPO loop against the rollout queue (`--local`: with
//!   a reward server and a worker in-process).
//! - [`bench_cmd`]: `learner bench`, one timed GRPO step; [`bench_push`]: `learner
//!   bench-push`, timed weight pushes beside their floor; [`bench_fleet`]: `learner
//!   bench-fleet`, pushes to worker processes behind shaped links; [`compare_cmd`]:
//!   `learner compare-backends`.
//! - [`eval`]: `learner eval`, a checkpoint on checkmate-in-one, held-out policy lines and
//!   environment prompts (rollout engine to generate, the reward server's code to grade).
//! - [`tensorboard`]: TensorBoard event files, the run's curves (`learner train --tensorboard`).

pub mod app;
pub mod bench_cmd;
pub mod bench_fleet;
pub mod bench_push;
pub mod checkpoint;
pub mod compare_cmd;
pub mod eval;
pub mod export_cmd;
pub mod init_cmd;
pub mod loss_cmd;
pub mod metrics;
pub mod prompts;
pub mod push;
pub mod queue;
pub mod queue_service;
pub mod run_dir;
pub mod run_lock;
pub mod run_record;
pub mod settings;
pub mod sft;
pub mod tensorboard;
pub mod train;
