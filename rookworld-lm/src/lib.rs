//! RookWorld-LM (GPT-2) in candle: the model, its checkpoints, tokenizer, sampling and
//! generation, shared by the rollout worker and the learner.
//!
//! - [`config`]: hyper-parameters, presets (`gpt2-124m`, `tiny`), Hugging Face `config.json`.
//! - [`model`]: the forward pass ([`Gpt2`]); weights only, no per-sequence state.
//! - [`cache`]: the KV cache ([`KvCache`]), owned by the caller.
//! - [`grouped`]: the decode cache of continuous batching, one prompt cache per group ([`GroupedCache`]).
//! - [`mask`]: position ids and attention bias for left-padded batches ([`LeftPadding`]).
//! - [`checkpoint`]: loading and saving Hugging Face checkpoints, seeded random init.
//! - [`bf16_payload`]: the bfloat16 safetensors payload of a weight push, built in place.
//! - [`weights_buffer`]: the one buffer a model's weights are views of, after one upload of a
//!   payload, and the payload's layout.
//! - [`cpu_gemm`]: packed-weight matmuls for the CPU (f32, BF16, INT8; AVX2/FMA, AVX-512) and the
//!   training pass's BF16 products.
//! - [`cpu_features`]: what the CPU offers those kernels (AVX2 and FMA, AVX-512), detected once.
//! - [`simd`]: vectorised exp and GELU for the CPU hot paths.
//! - [`tokenizer`]: GPT-2 byte-level BPE, built in.
//! - [`sampling`]: greedy / temperature / top-k / top-p with per-row seeded streams.
//! - [`generate`]: G completions per prompt, prompt prefilled once.
//! - [`device`]: device and dtype selection.
//! - [`device_sampling`]: a decode step's tokens drawn on the logits' device (CUDA), with its CPU reference.
//! - `cuda` (feature `cuda`): the decode step's CUDA kernels (fused grouped attention, sampling,
//!   the small fused ops of `decode_ops`: q/k/v split into the cache, bias + GELU, residual + norm).
//! - [`train_ops`]: the training forward's layer norm, bias + GELU, masked softmax and target
//!   log-probs as custom ops with hand-written backwards (CPU, and CUDA kernels with `cuda`).
//! - [`cli`]: the model options every binary shares (`--model`/`--preset`, `--device`, `--dtype`).
//! - [`alloc`]: glibc malloc set to keep freed buffers for the next request (each binary's `main`).
//! - [`error`]: the crate's [`Error`].

pub mod alloc;
pub mod bf16_payload;
pub mod cache;
pub mod cli;
pub mod config;
mod cpu_attention;
pub mod cpu_features;
pub mod cpu_gemm;
#[cfg(feature = "cuda")]
pub mod cuda;
mod decode_ops;
pub mod device;
pub mod device_sampling;
pub mod error;
pub mod generate;
pub mod grouped;
pub mod hub;
pub mod kernels;
pub mod launch;
pub mod mask;
pub mod model;
pub mod model_io;
pub mod sampling;
pub mod simd;
pub mod tokenizer;
pub mod train_ops;
pub mod weights_buffer;

pub use cache::KvCache;
pub use config::{Config, EOT_TOKEN};
pub use error::{Error, Result};
pub use grouped::GroupedCache;
pub use mask::LeftPadding;
pub use model::Gpt2;
pub use tokenizer::Tokenizer;
