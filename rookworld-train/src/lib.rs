//! The GRPO step's numerical core: the GPT-2 forward and backward of a micro-batch
//! written once ([`pass`]) over a [`Backend`] that supplies its kernels and buffers.
//!
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
//! - **The prompt once per group** ([`batch::Packed`]): a group's completions attend to
//!   their prompt's keys and values, and its gradients collect all of theirs.
//! - **Two backends, one step compared** ([`compare`]): the same micro-batch through both,
//!   naming the first buffer, in the pass's order, that differs beyond its tolerance.
//!
//! The CPU backend ([`cpu::Cpu`]) is the learner's fused pass: f32 kernels with f32 or
//! BF16 products. The GRPO objective between the forward and the backward is the
//! learner's, on the host: it reads the log-probs and hands back their gradients.
//!
//! Letters: R rows fed (prompts once, completions without their last token), E width,
//! H heads, D = E / H, I MLP width, V vocabulary, N predicted tokens.

pub mod backend;
pub mod batch;
pub mod compare;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gemm;
pub mod launch;
pub mod pass;
pub mod profile;
pub mod weights;

pub use backend::{Backend, Error, Heads, Result};
pub use batch::{GroupInput, GroupRows, Packed};
pub use pass::{Activations, Trained, backward, forward, train};
pub use profile::KernelProfile;
pub use weights::{PER_LAYER, Weights};
