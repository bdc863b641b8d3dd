//! The GRPO learner.
//!
//! - [`app`]: the command line; `main.rs` only calls [`app::main`].
//! - [`init_cmd`]: `learner init`, writes a starting checkpoint (random preset or a
//!   converted checkpoint) in Hugging Face layout; [`export_cmd`]: `learner export`, a
//!   model as a directory `transformers` loads (model, tokenizer, generation config only).
//!
//! - [`grpo`]: the GRPO objective as small pure functions (advantages, ratio, clipped
//!   surrogate, k3 KL, aggregation); [`batch`] lays a batch out as tensors; [`policy`] holds
//!   the trainable model and computes token log-probs; [`loss`] assembles the loss.
//! - [`offpolicy`]: decoupled off-policy correction (importance weights of the proximal
//!   policy against the sampler's) and the sampler/learner mismatch figures.
//! - [`loss_cmd`]: `learner loss`, the loss and gradient norm of one batch as JSON.
//! - [`sft`]: `learner sft`, supervised warm-up ([`sft_loss`]: its loss and gradients); [`checkpoint`]: training checkpoints
//!   (model, optimizer, trainer state) written atomically, for exact resume.
//! - [`queue`]: the rollout queue (leases with deadlines, bounded buffers, staleness);
//!   [`queue_service`]: it over gRPC with inspection calls.
//! - [`metrics`]: the learner's Prometheus metrics (queue, pushes).
//! - [`push`]: BF16 weight pushes to every worker in parallel, each with a deadline;
//!   their payload is [`rookworld_weights::export`], written by the optimizer.
//! - [`prompts`]: generated and loaded training prompts, with a resumable cursor.
//! - [`train`]: `learner train`, the GRPO loop against the rollout queue (`--local`: with
//!   a reward server and a worker in-process); [`head`]: LM-head log-probs without the
//!   (N, V) logits.
//! - [`fused`]: the fused training pass on the CPU (explicit forward/backward, each
//!   group's prompt once); [`bench_cmd`]: `learner bench`, one timed GRPO step;
//!   [`bench_push`]: `learner bench-push`, timed weight pushes beside their floor.
//! - [`eval`]: `learner eval`, a checkpoint on checkmate-in-one, held-out policy lines and
//!   environment prompts (rollout engine to generate, the reward server's code to grade).
//! - [`optim`]: gradient accumulation, norm and clipping, AdamW, the LR schedule;
//!   [`step`]: one optimizer step in micro-batches.
//! - [`tensorboard`]: TensorBoard event files, the run's curves (`learner train --tensorboard`).

pub mod app;
pub mod batch;
pub mod bench_cmd;
pub mod bench_push;
pub mod checkpoint;
pub mod compare_cmd;
pub mod eval;
pub mod export_cmd;
pub mod fused;
pub mod grpo;
pub mod head;
pub mod init_cmd;
pub mod loss;
pub mod loss_cmd;
pub mod metrics;
pub mod offpolicy;
pub mod optim;
pub mod policy;
pub mod prompts;
pub mod push;
pub mod queue;
pub mod queue_service;
pub mod run_dir;
pub mod run_lock;
pub mod run_record;
pub mod settings;
pub mod sft;
pub mod sft_loss;
pub mod step;
pub mod tensorboard;
pub mod train;
