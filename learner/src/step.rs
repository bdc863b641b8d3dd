//! One optimizer step on a batch of groups, in micro-batches whose gradients add up to
//! the full batch's.

use std::time::Instant;

use candle_core::Result as CandleResult;
use rookworld_lm::Gpt2;
use serde::Serialize;

use crate::batch::{GrpoBatch, Layout};
use crate::grpo::Aggregation;
use crate::loss::{LossConfig, grpo_loss};
use crate::optim::{AdamW, Gradients, Schedule};
use crate::policy::Trainable;

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
    pub tokens: usize,
    pub skipped_groups: usize,
    pub forward_backward_seconds: f64,
    pub optimizer_seconds: f64,
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
    let pad = policy.model.config().eos_token_id;
    let device = policy.model.device();
    let micro = cfg.micro_batch_groups.max(1);
    let layouts: Vec<Layout> = (0..batch.prompts.len())
        .step_by(micro)
        .map(|start| {
            Layout::new(
                &slice(batch, start, micro),
                cfg.loss.advantage_norm,
                pad,
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
            Aggregation::Sequence => l.advantages.dim(0)? as f64,
            Aggregation::Token => l.tokens as f64,
        })
    };
    let total: f64 = layouts.iter().map(weight_of).sum::<CandleResult<f64>>()?;
    let mut grads = Gradients::default();
    let started = Instant::now();
    for layout in &layouts {
        let w = weight_of(layout)? / total;
        let out = grpo_loss(&policy.model, reference, layout, &cfg.loss)?;
        let store = (out.loss * w)?.backward()?;
        grads.accumulate(&store, &policy.vars)?;
        report.policy_loss += w * out.policy_loss;
        report.kl += w * out.kl;
        report.clip_frac += out.clip_frac * layout.tokens as f64;
        report.tokens += layout.tokens;
    }
    report.loss = report.policy_loss + cfg.loss.beta * report.kl;
    report.clip_frac /= report.tokens.max(1) as f64;
    report.forward_backward_seconds = started.elapsed().as_secs_f64();
    Ok((grads, report))
}

/// A full step: gradients, clipping, AdamW at the schedule's rate for `step`.
pub fn train_step(
    policy: &Trainable,
    reference: Option<&Gpt2>,
    opt: &mut AdamW,
    schedule: &Schedule,
    step: u64,
    batch: &GrpoBatch,
    cfg: &StepConfig,
) -> CandleResult<StepReport> {
    let (mut grads, mut report) = accumulate(policy, reference, batch, cfg)?;
    let started = Instant::now();
    report.grad_norm = grads.clip(cfg.max_grad_norm)?;
    report.lr = schedule.lr_at(step);
    if report.tokens > 0 {
        opt.step(&policy.vars, &grads, report.lr)?;
    }
    report.optimizer_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Groups `start..start + len` of `batch`.
fn slice(batch: &GrpoBatch, start: usize, len: usize) -> GrpoBatch {
    let end = (start + len).min(batch.prompts.len());
    GrpoBatch {
        prompts: batch.prompts[start..end].to_vec(),
        completions: batch.completions[start..end].to_vec(),
        rewards: batch.rewards[start..end].to_vec(),
        old_logprobs: batch.old_logprobs.as_ref().map(|o| o[start..end].to_vec()),
    }
}
