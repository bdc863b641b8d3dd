//! Sampling G completions of each of a batch of prompts with the KV cache: the simple
//! static-batch path, kept as the reference the rollout worker's engine is tested and
//! benchmarked against.
//!
//! The prompts are prefilled once, together (left-padded), and each prompt's cache row is
//! repeated to its G sample rows; every decode step then feeds one token per unfinished
//! row of every prompt, and rows that finish leave the batch. Sample j of prompt i draws
//! from stream `(i << 32) | j` of the request's seed, so the same seed, weights and device
//! give the same completions whatever else is batched with them.

use std::time::Instant;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::mask::LeftPadding;
use crate::model::Gpt2;
use crate::sampling::{Sampler, SamplingParams};

/// What to generate for each prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerationConfig {
    /// Completions per prompt (G).
    pub n: usize,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Keep sampling after end-of-text (benchmarks: every row runs full length).
    pub ignore_eos: bool,
}

/// Why a completion stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model's end-of-text (`eos_token_id`, 50256 for RookWorld) was sampled; it is
    /// the completion's last id.
    Eos,
    /// `max_new_tokens` reached, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Eos => "eos",
            Self::Length => "length",
        }
    }
}

/// One sampled completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Sampled ids, end-of-text included when sampled.
    pub ids: Vec<u32>,
    /// `logprobs[i]`: log-probability of `ids[i]` under the distribution it was drawn from.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// The G completions of one prompt and where the time went.
#[derive(Debug, Clone)]
pub struct GroupOutput {
    pub completions: Vec<Completion>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl GroupOutput {
    /// Tokens sampled over all completions.
    pub fn new_tokens(&self) -> usize {
        self.completions.iter().map(|c| c.ids.len()).sum()
    }
}

/// Checks a prompt against the model before any work: non-empty, ids in the vocabulary,
/// and no longer than the context.
pub fn validate_prompt(model: &Gpt2, prompt: &[u32]) -> Result<()> {
    let cfg = model.config();
    if prompt.is_empty() {
        return Err(Error::InvalidArgument("empty prompt".into()));
    }
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        return Err(Error::InvalidArgument(format!(
            "token id {bad} is outside the vocabulary of {}",
            cfg.vocab_size
        )));
    }
    if prompt.len() > cfg.n_positions {
        return Err(Error::PromptTooLong {
            prompt_tokens: prompt.len(),
            context: cfg.n_positions,
        });
    }
    Ok(())
}

/// The completions of a batch of prompts, in prompt order, and where the time went.
#[derive(Debug, Clone)]
pub struct BatchOutput {
    /// `groups[i]`: the `n` completions of prompt i.
    pub groups: Vec<Vec<Completion>>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl BatchOutput {
    /// Tokens sampled over all completions.
    pub fn new_tokens(&self) -> usize {
        self.groups.iter().flatten().map(|c| c.ids.len()).sum()
    }
}

/// Samples `cfg.n` completions of every prompt in one batch: all prompts are prefilled
/// once, together (left-padded); each prompt's cache row is repeated to its `n` sample
/// rows; every decode step then feeds one token for every unfinished row of every
/// prompt, so the weights are read once per step for the whole batch. Prompt i uses the
/// random streams of prompt index `first_index + i`, so each completion is exactly the one
/// [`generate_group`] gives for that prompt alone.
pub fn generate_batch(
    model: &Gpt2,
    prompts: &[Vec<u32>],
    cfg: &GenerationConfig,
    first_index: u32,
) -> Result<BatchOutput> {
    for p in prompts {
        validate_prompt(model, p)?;
    }
    cfg.sampling.validate()?;
    let device = model.device();
    let context = model.config().n_positions;
    let eos = model.config().eos_token_id;
    let n = cfg.n;
    let mut groups: Vec<Vec<Completion>> = prompts
        .iter()
        .map(|_| {
            (0..n)
                .map(|_| Completion {
                    ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish_reason: FinishReason::Length,
                })
                .collect()
        })
        .collect();
    if prompts.is_empty() || n == 0 || cfg.max_new_tokens == 0 {
        return Ok(BatchOutput {
            groups,
            prefill_seconds: 0.0,
            decode_seconds: 0.0,
        });
    }
    // Row r = p * n + j is sample j of prompt p.
    let budget: Vec<usize> = prompts
        .iter()
        .map(|p| cfg.max_new_tokens.min(context + 1 - p.len()))
        .collect();
    let mut samplers: Vec<Sampler> = (0..prompts.len() * n)
        .map(|r| {
            let (p, j) = ((r / n) as u64, (r % n) as u64);
            Sampler::new(
                cfg.sampling,
                cfg.seed,
                ((u64::from(first_index) + p) << 32) | j,
            )
        })
        .collect();

    let start = Instant::now();
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let padding = LeftPadding::for_lengths(&lengths);
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let mut flat = Vec::with_capacity(prompts.len() * longest);
    for p in prompts {
        flat.extend(std::iter::repeat_n(eos, longest - p.len()));
        flat.extend(p);
    }
    let ids = Tensor::from_vec(flat, (prompts.len(), longest), device)?; // (P, L)
    let mut cache = model.new_cache();
    let logits = model
        .forward_last(&ids, &padding, &mut cache)?
        .to_vec2::<f32>()?; // (P, V)
    for r in 0..prompts.len() * n {
        let s = samplers[r].sample(&logits[r / n])?;
        let c = &mut groups[r / n][r % n];
        c.ids.push(s.token);
        c.logprobs.push(s.logprob);
    }
    let prefill_seconds = start.elapsed().as_secs_f64();

    let start = Instant::now();
    let mut cache = cache.repeat_rows(n)?; // (P·n, H, L, D) per layer
    let mut padding = padding.repeat_rows(n);
    let mut active: Vec<usize> = (0..prompts.len() * n).collect();
    loop {
        let mut kept = Vec::with_capacity(active.len());
        let mut still = Vec::with_capacity(active.len());
        for (k, &r) in active.iter().enumerate() {
            let c = &mut groups[r / n][r % n];
            if !cfg.ignore_eos && c.ids.last() == Some(&eos) {
                c.finish_reason = FinishReason::Eos;
            } else if c.ids.len() < budget[r / n] {
                kept.push(k);
                still.push(r);
            }
        }
        if still.is_empty() {
            break;
        }
        if still.len() != active.len() {
            let rows: Vec<u32> = kept.iter().map(|&k| k as u32).collect();
            cache = cache.select_rows(&Tensor::new(rows.as_slice(), device)?)?;
            padding = padding.select(&kept);
        }
        active = still;
        let last: Vec<u32> = active
            .iter()
            .map(|&r| *groups[r / n][r % n].ids.last().expect("sampled"))
            .collect();
        let ids = Tensor::new(last.as_slice(), device)?.unsqueeze(1)?; // (A, 1)
        let logits = model
            .forward_last(&ids, &padding, &mut cache)?
            .to_vec2::<f32>()?; // (A, V)
        for (&r, row) in active.iter().zip(&logits) {
            let s = samplers[r].sample(row)?;
            let c = &mut groups[r / n][r % n];
            c.ids.push(s.token);
            c.logprobs.push(s.logprob);
        }
    }
    Ok(BatchOutput {
        groups,
        prefill_seconds,
        decode_seconds: start.elapsed().as_secs_f64(),
    })
}

/// Samples `cfg.n` completions of `prompt` (token ids, BOS included if wanted): a batch
/// of one prompt. `prompt_index` selects the prompt's random streams.
pub fn generate_group(
    model: &Gpt2,
    prompt: &[u32],
    cfg: &GenerationConfig,
    prompt_index: u32,
) -> Result<GroupOutput> {
    let mut batch = generate_batch(model, &[prompt.to_vec()], cfg, prompt_index)?;
    Ok(GroupOutput {
        completions: batch.groups.pop().expect("one group per prompt"),
        prefill_seconds: batch.prefill_seconds,
        decode_seconds: batch.decode_seconds,
    })
}
