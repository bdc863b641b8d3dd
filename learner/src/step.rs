//! One optimizer step on a batch of groups, in micro-batches whose gradients add up to
//! the full batch's.

use std::time::Instant;

use candle_core::Result as CandleResult;
use rookworld_lm::Gpt2;
use serde::Serialize;

use crate::batch::{GrpoBatch, Layout};
use crate::fused::step::{MicroBatch, micro_step, reference_logprobs};
use crate::fused::{self, Params};
use crate::grpo::Aggregation;
use crate::loss::{LossConfig, grpo_loss};
use crate::optim::{AdamW, Gradients, Schedule};
use crate::policy::Trainable;
use rookworld_weights::export::Payload;

/// How a step is run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConfig {
    pub loss: LossConfig,
    /// Prompts (groups) per micro-batch; the step's gradient is their weighted sum.
    pub micro_batch_groups: usize,
    /// Global gradient-norm bound.
    pub max_grad_norm: f64,
}

/// What one step did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepReport {
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    /// Before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    pub clip_frac: f64,
    /// Shares of tokens clipped below 1 − ε (A < 0) and above 1 + ε (A > 0).
    pub clip_low: f64,
    pub clip_high: f64,
    /// The sampler against the learner over the step's tokens (batches with the sampler's
    /// log-probs).
    pub mismatch: Option<crate::offpolicy::Mismatch>,
    /// Completions left out of the loss as cut off at the token budget.
    pub masked_truncated: usize,
    /// The policy's mean entropy per counted token, nats (fused pass only).
    pub entropy: Option<f64>,
    pub tokens: usize,
    pub skipped_groups: usize,
    pub forward_backward_seconds: f64,
    pub optimizer_seconds: f64,
    /// The fused pass's split of `forward_backward_seconds` (0 on the candle path):
    /// reference forward, policy forward, loss + backward.
    pub reference_seconds: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    /// Largest activation plan of a micro-batch (bytes; fused pass only).
    pub activation_bytes: usize,
}

/// Gradients of the whole batch, accumulated over micro-batches: micro-batch k's loss is
/// weighted by its share of the batch (completions for sequence aggregation, tokens for
/// token aggregation), so the sum is the full batch's loss and gradient.
pub fn accumulate(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    if policy.fused_pass_applies() {
        return accumulate_fused(policy, reference, batch, cfg);
    }
    accumulate_autograd(policy, reference, batch, cfg)
}

/// [`accumulate`] through candle's autograd on the plain model (every device and dtype;
/// the fused pass is checked against it).
pub fn accumulate_autograd(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    let pad = policy.model.config().eos_token_id;
    let device = policy.model.device();
    let micro = cfg.micro_batch_groups.max(1);
    let scale = cfg.loss.advantage_norm.scale(&batch.rewards);
    let layouts: Vec<Layout> = (0..batch.prompts.len())
        .step_by(micro)
        .map(|start| {
            Layout::new(
                &slice(batch, start, micro),
                scale,
                pad,
                cfg.loss.mask_truncated,
                device,
            )
        })
        .collect::<CandleResult<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let mut report = StepReport {
        skipped_groups: batch.prompts.len()
            - layouts
                .iter()
                .map(|l| l.group_advantages.len())
                .sum::<usize>(),
        ..StepReport::default()
    };
    let weight_of = |l: &Layout| -> CandleResult<f64> {
        Ok(match cfg.loss.aggregation {
            Aggregation::Sequence => (l.advantages.dim(0)? - l.masked_truncated) as f64,
            Aggregation::Constant => l.advantages.dim(0)? as f64,
            Aggregation::Token => l.tokens as f64,
        })
    };
    let total: f64 = layouts.iter().map(weight_of).sum::<CandleResult<f64>>()?;
    let mut grads = Gradients::default();
    let started = Instant::now();
    for layout in &layouts {
        // Nothing counted (every completion cut off and masked): no gradient.
        let w = if total > 0.0 {
            weight_of(layout)? / total
        } else {
            0.0
        };
        let out = grpo_loss(&policy.model, reference, layout, &cfg.loss)?;
        let store = (out.loss * w)?.backward()?;
        grads.accumulate(&store, &policy.vars)?;
        report.policy_loss += w * out.policy_loss;
        report.kl += w * out.kl;
        report.clip_low += out.clip_low * layout.tokens as f64;
        report.clip_high += out.clip_high * layout.tokens as f64;
        merge(&mut report.mismatch, out.mismatch);
        report.masked_truncated += layout.masked_truncated;
        report.tokens += layout.tokens;
    }
    report.close(cfg.loss.beta);
    report.forward_backward_seconds = started.elapsed().as_secs_f64();
    Ok((grads, report))
}

impl StepReport {
    /// Makes the sums over micro-batches the step's: the loss from its parts, the clip
    /// shares and the entropy per counted token.
    fn close(&mut self, beta: f64) {
        self.loss = self.policy_loss + beta * self.kl;
        let n = self.tokens.max(1) as f64;
        self.clip_low /= n;
        self.clip_high /= n;
        self.clip_frac = self.clip_low + self.clip_high;
        if let Some(h) = self.entropy.as_mut() {
            *h /= n;
        }
    }
}

fn merge(into: &mut Option<crate::offpolicy::Mismatch>, part: Option<crate::offpolicy::Mismatch>) {
    if let Some(part) = part {
        into.get_or_insert_with(Default::default).merge(&part);
    }
}

/// Groups per reference forward of the fused pass (it keeps no activations, so it can
/// take more rows than a training micro-batch).
const REFERENCE_GROUPS: usize = 4;

/// [`accumulate`] on the fused pass ([`crate::fused`]): the same micro-batches and
/// weights, each group's prompt computed once.
fn accumulate_fused(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<(Gradients, StepReport)> {
    let micro = cfg.micro_batch_groups.max(1);
    let scale = cfg.loss.advantage_norm.scale(&batch.rewards);
    let eot = policy.model.config().eos_token_id;
    let truncated_without = cfg.loss.mask_truncated.then_some(eot);
    let micros: Vec<MicroBatch> = (0..batch.prompts.len())
        .step_by(micro)
        .filter_map(|start| MicroBatch::new(&slice(batch, start, micro), scale, truncated_without))
        .collect();
    let kept: usize = micros.iter().map(|m| m.group_advantages.len()).sum();
    let mut report = StepReport {
        skipped_groups: batch.prompts.len() - kept,
        ..StepReport::default()
    };
    let weight_of = |m: &MicroBatch| match cfg.loss.aggregation {
        Aggregation::Sequence => (m.completions() - m.masked_truncated()) as f64,
        Aggregation::Constant => m.completions() as f64,
        Aggregation::Token => m.counted_tokens as f64,
    };
    let total: f64 = micros.iter().map(weight_of).sum();
    let started = Instant::now();
    let policy_tensors = policy.tensors();
    let ref_tensors = reference.map(fused::step::model_tensors);
    let model_cfg = policy.model.config();
    let grads = {
        let params = Params::new(&policy_tensors, model_cfg)?;
        let ref_params = match &ref_tensors {
            Some(t) => Some(Params::new(t, model_cfg)?),
            None => None,
        };
        let mut work = policy.workspace.lock().expect("workspace lock");
        let mut grads = work.zeroed_grads(&params);
        // The reference over several micro-batches at once, then split by micro-batch.
        let t = Instant::now();
        let ref_logp = match (&ref_params, cfg.loss.beta > 0.0) {
            (Some(r), true) => {
                let mut all = Vec::new();
                for start in (0..batch.prompts.len()).step_by(REFERENCE_GROUPS.max(micro)) {
                    let chunk = slice(batch, start, REFERENCE_GROUPS.max(micro));
                    if let Some(m) = MicroBatch::new(&chunk, scale, None) {
                        all.extend(reference_logprobs(r, &m, &cfg.loss, &mut work));
                    }
                }
                Some(all)
            }
            _ => None,
        };
        report.reference_seconds = t.elapsed().as_secs_f64();
        let mut offset = 0;
        for m in &micros {
            let w = if total > 0.0 {
                weight_of(m) / total
            } else {
                0.0
            };
            let r_logp = ref_logp.as_ref().map(|r| &r[offset..offset + m.tokens]);
            offset += m.tokens;
            let r = micro_step(&params, r_logp, m, &cfg.loss, w, &mut grads, &mut work)?;
            report.policy_loss += w * r.policy_loss;
            report.kl += w * r.kl;
            report.clip_low += r.clip_low * m.counted_tokens as f64;
            report.clip_high += r.clip_high * m.counted_tokens as f64;
            merge(&mut report.mismatch, r.mismatch);
            report.masked_truncated += m.masked_truncated();
            *report.entropy.get_or_insert(0.0) += r.entropy_sum;
            report.tokens += m.counted_tokens;
            report.forward_seconds += r.forward_seconds;
            report.backward_seconds += r.backward_seconds;
            report.activation_bytes = report.activation_bytes.max(r.activation_bytes);
        }
        grads
    };
    let out = if micros.is_empty() {
        Gradients::default()
    } else {
        policy.host_gradients(grads)
    };
    report.close(cfg.loss.beta);
    report.forward_backward_seconds = started.elapsed().as_secs_f64();
    Ok((out, report))
}

/// A full step: gradients, clipping, AdamW at the schedule's rate for `step`; with
/// `export`, the updated weights are also written into it as bfloat16 (see
/// [`rookworld_weights::export`]).
#[allow(clippy::too_many_arguments)]
pub fn train_step(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    opt: &mut AdamW,
    schedule: &Schedule,
    step: u64,
    batch: &GrpoBatch,
    cfg: &StepConfig,
    mut export: Option<&mut Payload>,
) -> CandleResult<StepReport> {
    let (mut grads, mut report) = accumulate(policy, reference, batch, cfg)?;
    let started = Instant::now();
    report.grad_norm = grads.clip(cfg.max_grad_norm)?;
    report.lr = schedule.lr_at(step);
    if report.tokens > 0 {
        opt.step_exporting(&policy.vars, &grads, report.lr, export.as_deref_mut())?;
    }
    if let Some(payload) = export {
        payload.fill_rest(&policy.vars)?;
    }
    policy.recycle(grads);
    report.optimizer_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// `updates` optimizer steps on one batch (PPO's epochs, `--updates-per-batch`): π_old
/// stays the sampler's log-probs throughout; under the off-policy correction the proximal
/// log-probs are the policy's own before the first update. Only the last update writes
/// `export`. Reports the first update's loss parts and gradient norm, and the time of all.
#[allow(clippy::too_many_arguments)]
pub fn train_updates(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    opt: &mut AdamW,
    schedule: &Schedule,
    step: u64,
    batch: &GrpoBatch,
    cfg: &StepConfig,
    updates: u32,
    mut export: Option<&mut Payload>,
) -> CandleResult<StepReport> {
    let owned;
    let batch = if updates > 1 && cfg.loss.correction.on() && batch.proximal_logprobs.is_none() {
        let own = crate::policy::own_logprobs(&policy.model, batch, cfg.loss.temperature)?;
        owned = GrpoBatch {
            proximal_logprobs: Some(own),
            ..batch.clone()
        };
        &owned
    } else {
        batch
    };
    let mut first: Option<StepReport> = None;
    for k in 0..updates.max(1) {
        let out = if k + 1 == updates.max(1) {
            export.take()
        } else {
            None
        };
        let r = train_step(policy, reference, opt, schedule, step, batch, cfg, out)?;
        match first.as_mut() {
            None => first = Some(r),
            Some(f) => {
                f.forward_backward_seconds += r.forward_backward_seconds;
                f.optimizer_seconds += r.optimizer_seconds;
                f.reference_seconds += r.reference_seconds;
                f.forward_seconds += r.forward_seconds;
                f.backward_seconds += r.backward_seconds;
            }
        }
    }
    Ok(first.expect("at least one update"))
}

/// Groups `start..start + len` of `batch`.
fn slice(batch: &GrpoBatch, start: usize, len: usize) -> GrpoBatch {
    let end = (start + len).min(batch.prompts.len());
    GrpoBatch {
        prompts: batch.prompts[start..end].to_vec(),
        completions: batch.completions[start..end].to_vec(),
        rewards: batch.rewards[start..end].to_vec(),
        old_logprobs: batch.old_logprobs.as_ref().map(|o| o[start..end].to_vec()),
        proximal_logprobs: batch
            .proximal_logprobs
            .as_ref()
            .map(|o| o[start..end].to_vec()),
    }
}

/// Model FLOPs of one step's forward and backward: 6 per weight per token for the policy
/// (2 forward, 4 backward) and 2 more for the reference forward — the transformer's
/// matmul weights for every sequence token, the LM head's only for the completion tokens
/// (the only positions that go through it); groups without signal are not run.
pub fn step_flops(model: &Gpt2, batch: &GrpoBatch, reference: bool) -> f64 {
    let c = model.config();
    let body = (c.n_layer * 12 * c.n_embd * c.n_embd) as f64;
    let head = (c.vocab_size * c.n_embd) as f64;
    let (mut seq, mut completion) = (0usize, 0usize);
    for ((p, group), rewards) in batch
        .prompts
        .iter()
        .zip(&batch.completions)
        .zip(&batch.rewards)
    {
        if rewards.iter().all(|r| *r == rewards[0]) {
            continue; // no signal: not forwarded
        }
        for g in group {
            seq += p.len() + g.len();
            completion += g.len();
        }
    }
    let per_weight_token = if reference { 8.0 } else { 6.0 };
    per_weight_token * (body * seq as f64 + head * completion as f64)
}

/// The peak a step's MFU is measured against: on the CPU [`cpu_peak_flops`]; on CUDA the
/// dense peak of an H100/H200 SXM in the matmuls' dtype — 989 TFLOP/s in BF16, 495 in
/// TF32 (f32 matmuls).
pub fn device_peak_flops(
    device: &candle_core::Device,
    matmul_dtype: Option<candle_core::DType>,
) -> f64 {
    match (device.is_cpu(), matmul_dtype) {
        (true, _) => cpu_peak_flops(),
        (false, Some(candle_core::DType::BF16 | candle_core::DType::F16)) => 989e12,
        (false, _) => 495e12,
    }
}

/// An estimate of this CPU's f32 peak at 3 GHz: two FMA units per core, each 16 f32 wide
/// with AVX-512 (64 FLOPs per cycle, the kernels `gemm` picks there) or 8 wide with AVX2
/// (32 FLOPs per cycle).
pub fn cpu_peak_flops() -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores as f64 * cpu_flops_per_cycle() * 3e9
}

fn cpu_flops_per_cycle() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return 64.0;
    }
    32.0
}
