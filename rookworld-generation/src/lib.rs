//! The generation library: continuous batching of G samples per prompt over one model,
//! with the prompt's cache shared by its samples, bounded memory, and model swaps that
//! never mix weight versions inside a completion. It needs only the model crate: the
//! rollout worker serves it over gRPC, the learner's evaluation runs it in-process.
//!
//! - [`scheduler`]: the synchronous core ([`Scheduler`]): admission, prefill, decode.
//! - [`handle`]: the engine thread behind an async handle ([`Engine`]) and weight swaps;
//!   what the rollout worker's service uses.
//! - [`metrics`]: the engine's Prometheus metrics (names, descriptions, recording).
//! - this file: requests, limits ([`EngineConfig`], [`EngineArgs`]), events and errors.

pub mod handle;
pub mod metrics;
pub mod scheduler;
pub mod swap_clock;

pub use handle::{Engine, EngineStatus, Reclaimed, Retired, SwapTicket};
pub use scheduler::Scheduler;
pub use swap_clock::SwapTiming;

use rookworld_lm::Gpt2;
use rookworld_lm::generate::{Completion, validate_prompt};
use rookworld_lm::sampling::SamplingParams;

/// Readies a model for the engine ([`Gpt2::prepare_for_inference`]): on the CPU in f32,
/// its weights are packed for the CPU kernel in the model's panel dtype
/// ([`Gpt2::set_panel_dtype`]) and the panels become their only copy (the dense copies'
/// memory is handed back to the kernel); on CUDA, its LM head is padded to aligned rows.
pub fn prepare_model(mut model: Gpt2) -> Result<Gpt2, EngineError> {
    if model.prepare_for_inference()? {
        if model.packed_only() {
            rookworld_lm::alloc::return_freed_memory();
        }
        tracing::debug!(
            packed_only = model.packed_only(),
            "weights readied for inference on {:?}",
            model.device()
        );
    }
    Ok(model)
}

/// The benchmarks' prompt (`rollout-worker bench`, `learner bench-push`): the start
/// position's policy prompt, 46 tokens.
pub const BENCH_PROMPT: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:";

/// Identifies a request inside one engine.
pub type RequestId = u64;

/// Most samples (prompts × G) one request may ask for.
pub const MAX_SAMPLES_PER_REQUEST: usize = 1 << 16;

/// What happens to sequences in flight when new weights arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SwapPolicy {
    /// Admit nothing new; finish the sequences in flight on the old weights, then swap.
    /// Nothing is wasted; the swap waits at most one completion's length.
    Drain,
    /// Swap at the next step; sequences in flight restart from their prompt on the new
    /// weights (their partial tokens are discarded).
    Restart,
    /// Swap at the next step; sequences in flight go on under the new weights with the
    /// keys and values the old ones cached (PipelineRL's in-flight update). Each token is
    /// tagged with the version that sampled it ([`FinishedSample::token_versions`]).
    Continue,
}

/// Limits of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most sequences decoded together (rows of the batch).
    pub max_seqs: usize,
    /// Most KV-cache tokens reserved: each held prompt's length once, plus each live
    /// sequence's token budget. Admission stops at this bound.
    pub max_kv_tokens: usize,
    /// Most prompt tokens prefilled in one step (one prompt always may be).
    pub max_prefill_tokens: usize,
    pub swap_policy: SwapPolicy,
}

/// Engine options shared by `generate`, `bench` and `serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Most sequences decoded together.
    #[arg(long, env = "ROLLOUT_MAX_SEQS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_seqs: u32,
    /// Most KV-cache tokens reserved (prompt once + each sequence's token budget).
    #[arg(long, env = "ROLLOUT_MAX_KV_TOKENS", default_value_t = 65_536, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_kv_tokens: u32,
    /// Most prompt tokens prefilled in one step.
    #[arg(long, env = "ROLLOUT_MAX_PREFILL_TOKENS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_prefill_tokens: u32,
    /// What a weight swap does to sequences in flight.
    #[arg(long, env = "ROLLOUT_SWAP_POLICY", value_enum, default_value_t = SwapPolicy::Drain)]
    pub swap_policy: SwapPolicy,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            max_seqs: self.max_seqs as usize,
            max_kv_tokens: self.max_kv_tokens as usize,
            max_prefill_tokens: self.max_prefill_tokens as usize,
            swap_policy: self.swap_policy,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_seqs: 64,
            max_kv_tokens: 64 * 1024,
            max_prefill_tokens: 4096,
            swap_policy: SwapPolicy::Drain,
        }
    }
}

/// P prompts × `n` samples each.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Token ids of each prompt (BOS included when wanted).
    pub prompts: Vec<Vec<u32>>,
    /// Samples per prompt (G).
    pub n: usize,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Keep sampling after end-of-text (benchmarks: every row runs full length).
    pub ignore_eos: bool,
}

impl Request {
    /// Everything that would make the request fail later is refused here.
    pub fn validate(&self, model: &Gpt2, cfg: &EngineConfig) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if self.prompts.is_empty() {
            return bad("no prompts".into());
        }
        if self.n == 0 {
            return bad("n (completions per prompt) must be at least 1".into());
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens must be at least 1".into());
        }
        let samples = self.prompts.len().saturating_mul(self.n);
        if samples > MAX_SAMPLES_PER_REQUEST {
            return bad(format!(
                "{} prompts × {} completions = {samples} samples; one request may ask for at most {MAX_SAMPLES_PER_REQUEST}",
                self.prompts.len(),
                self.n
            ));
        }
        self.sampling
            .validate()
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        let context = model.config().n_positions;
        for (i, p) in self.prompts.iter().enumerate() {
            validate_prompt(model, p)
                .map_err(|e| EngineError::InvalidRequest(format!("prompt {i}: {e}")))?;
            let need = p.len() + self.max_new_tokens.min(context + 1 - p.len());
            if need > cfg.max_kv_tokens {
                return bad(format!(
                    "prompt {i} needs {need} KV tokens (prompt + max_new_tokens) but the engine holds at most {}",
                    cfg.max_kv_tokens
                ));
            }
        }
        Ok(())
    }
}

/// A finished sample.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedSample {
    pub request: RequestId,
    pub prompt_index: u32,
    pub sample_index: u32,
    pub completion: Completion,
    /// The weights that sampled the completion's first token: its oldest.
    pub weight_version: u64,
    /// The version that sampled each token, where they differ (a swap under
    /// [`SwapPolicy::Continue`] came mid-completion); empty when `weight_version` sampled
    /// them all.
    pub token_versions: Vec<u64>,
}

/// What the engine reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Sample(FinishedSample),
    /// Every sample of the request has been reported.
    Done(RequestId),
    /// The request failed; nothing more comes for it.
    Failed(RequestId, String),
}

/// Work and time of one scheduling step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    pub prefill_tokens: usize,
    pub prefill_seconds: f64,
    /// Samples started: each drew its first token from its prompt's prefill logits.
    pub first_tokens: usize,
    /// Rows decoded (= tokens sampled by the decode step).
    pub decode_rows: usize,
    pub decode_seconds: f64,
    /// Of `decode_seconds`: the forward's host time (on CUDA the launches: the device
    /// runs behind), and sampling (on CUDA the wait for the device, then the draw).
    pub decode_forward_seconds: f64,
    pub decode_sample_seconds: f64,
}

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as asked (empty, too long, bad parameters).
    #[error("{0}")]
    InvalidRequest(String),
    /// The model failed (device, numerics).
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    /// Generation failed after the request was accepted.
    #[error("generation failed: {0}")]
    Failed(String),
    /// The engine thread has stopped.
    #[error("the generation engine has stopped")]
    Stopped,
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}
