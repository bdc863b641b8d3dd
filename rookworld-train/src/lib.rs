//! The GRPO training step, with settings of its own and no command line: the objectives,
//! the policy, one optimizer step in micro-batches, AdamW, the supervised loss; and under
//! them the GPT-2 forward and backward of a micro-batch written once ([`pass`]) over a
//! [`Backend`] that supplies its kernels and buffers.
//!
//! The step, from the top:
//! - [`step`]: one optimizer step over a batch of scored groups, in micro-batches whose
//!   gradients accumulate ([`fused::micro_batch`] on the fused pass, candle's autograd
//!   otherwise), then [`optim`] (clipping, AdamW, the schedule) and the weight push's
//!   payload written while the weights change.
//! - [`loss`]: the GRPO loss of a batch, assembled from the pure functions of [`grpo`]
//!   (advantages, ratios, clipped surrogates, k3 KL, aggregation) and [`offpolicy`]
//!   (decoupled correction, the sampler/learner mismatch), over the tensors of [`batch`].
//! - [`policy`]: the trainable model, its reference, and token log-probs ([`head`]: the LM
//!   head's without the (N, V) logits); [`sft_loss`]: the supervised warm-up's loss.
//! - [`fused`]: the hand-written pass fed with the candle model's weights in place, on
//!   the CPU backend ([`cpu`]) or, with the `cuda` feature, the CUDA one.
//! - [`choice`]: the settings chosen by name (the command line's parser is the caller's).
//!
//! The pass:
//! - **One sequence.** Embedding, the blocks, ln_f, the head's log-probs, then the
//!   backward in reverse — the order, the buffers and every matrix product's operands and
//!   transposes are the pass's; a backend only runs kernels. A product is handed over as
//!   the column-major call that cuBLAS takes ([`gemm::Gemm`]), mapped once from the
//!   row-major maths ([`gemm::row_major`]); the CPU backend runs that same call, so CPU
//!   tests prove the mapping a GPU backend relies on.
//! - **Planned buffers.** Every activation, gradient scratch and the head's buffer are
//!   sized from the micro-batch's shape before it runs ([`pass::Activations`]) and reused
//!   by the next micro-batch and step: nothing is allocated inside a step once the shape
//!   has been seen.
//! - **The prompt once per group** ([`packed::Packed`]): a group's completions attend to
//!   their prompt's keys and values, and its gradients collect all of theirs.
//! - **Two backends, one step compared** ([`compare`]): the same micro-batch through both,
//!   naming the first buffer, in the pass's order, that differs beyond its tolerance.
//!
//! The CPU backend ([`cpu::Cpu`]) is the fused pass's: f32 kernels with f32 or BF16
//! products. The GRPO objective between the forward and the backward runs on the host
//! ([`fused::micro_batch`]): it reads the log-probs and hands back their gradients.
//!
//! Letters: R rows fed (prompts once, completions without their last token), E width,
//! H heads, D = E / H, I MLP width, V vocabulary, N predicted tokens.

pub mod backend;
pub mod batch;
pub mod choice;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod desk;
pub mod fused;
pub mod gemm;
pub mod grpo;
pub mod head;
pub mod kernels;
pub mod launch;
pub mod loss;
pub mod offpolicy;
pub mod optim;
pub mod packed;
pub mod pass;
pub mod policy;
pub mod profile;
pub mod sft_loss;
pub mod step;
pub mod weights;

pub use backend::{Backend, Error, Heads, Result};
pub use packed::{GroupInput, GroupRows, Packed};
pub use pass::{Activations, Trained, backward, forward, train};
pub use profile::KernelProfile;
pub use weights::{PER_LAYER, Weights};
