//! The GRPO loss and gradients of a micro-batch on the fused pass: reference forward (no
//! activations), policy forward, the objective of [`crate::loss::objective`] on the
//! per-token log-probs (small candle tensors, so the maths is the one checked against
//! PyTorch; in f64, since the loss is a small sum of ±A·ρ terms of size ~1 and f32
//! rounding there alone is ~1e-5 of it), its gradient with respect to each token's
//! log-prob, then the fused backward.

use std::ops::{DerefMut, Range};
use std::time::Instant;

use candle_core::{DType, Device, Result as CandleResult, Tensor, Var};
use rookworld_lm::Gpt2;

use crate::{Activations, Backend, Weights};

use crate::batch::GrpoBatch;
use crate::fused::{GroupInput, Packed};
use crate::grpo::{Scale, group_advantages};
use crate::loss::{LossConfig, LossOutput, TokenTensors, objective};

/// A micro-batch's groups with signal, laid out for the fused pass.
#[derive(Debug)]
pub struct MicroBatch {
    pub packed: Packed,
    /// Per completion its advantage; per predicted token (N) the behaviour log-prob,
    /// when the batch has them.
    advantages: Vec<f32>,
    behaviour: Option<Vec<f32>>,
    proximal: Option<Vec<f32>>,
    /// Advantages per kept group, in batch order (for reporting).
    pub group_advantages: Vec<Vec<f32>>,
    /// Completion tokens.
    pub tokens: usize,
    /// Per completion, whether its tokens count in the loss (not cut off, or not masked).
    counted: Vec<bool>,
    /// Per completion, its leading tokens left out of the loss as stale.
    stale: Vec<usize>,
    /// Completion tokens counted in the loss.
    pub counted_tokens: usize,
}

impl MicroBatch {
    /// The groups of `batch` with signal; `None` when none has any.
    /// With `truncated_without`, a completion that does not end with that token (end of
    /// text) is left out of the loss.
    pub fn new(batch: &GrpoBatch, scale: Scale, truncated_without: Option<u32>) -> Option<Self> {
        let mut inputs = Vec::new();
        let (mut advantages, mut behaviour, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        let (mut proximal, mut stale) = (Vec::new(), Vec::new());
        for (p, prompt) in batch.prompts.iter().enumerate() {
            let Some(adv) = group_advantages(&batch.rewards[p], scale) else {
                continue;
            };
            inputs.push(GroupInput {
                prompt,
                completions: &batch.completions[p],
            });
            advantages.extend_from_slice(&adv);
            stale.extend((0..adv.len()).map(|g| batch.stale(p, g)));
            if let Some(old) = &batch.old_logprobs {
                behaviour.extend(old[p].iter().flatten());
            }
            if let Some(prox) = &batch.proximal_logprobs {
                proximal.extend(prox[p].iter().flatten());
            }
            kept.push(adv);
        }
        if inputs.is_empty() {
            return None;
        }
        let packed = Packed::new(&inputs);
        let counted: Vec<bool> = inputs
            .iter()
            .flat_map(|g| g.completions.iter())
            .map(|c| truncated_without.is_none_or(|eot| c.last() == Some(&eot)))
            .collect();
        let mut micro = Self {
            counted,
            stale,
            counted_tokens: 0,
            tokens: packed.targets.len(),
            packed,
            advantages,
            behaviour: batch.old_logprobs.as_ref().map(|_| behaviour),
            proximal: batch.proximal_logprobs.as_ref().map(|_| proximal),
            group_advantages: kept,
        };
        micro.counted_tokens = micro.counted_ranges().map(|r| r.len()).sum();
        Some(micro)
    }

    /// Completions.
    pub fn completions(&self) -> usize {
        self.advantages.len()
    }

    /// Completions left out of the loss as cut off.
    pub fn masked_truncated(&self) -> usize {
        self.counted.iter().filter(|c| !**c).count()
    }

    /// Completions with a token counted in the loss.
    pub fn sequences(&self) -> usize {
        (0..self.counted.len())
            .filter(|&k| self.counted_tokens(k) > 0)
            .count()
    }

    /// Per-token values (N) of completions `ks` as a (K, L) f64 tensor, L the longest of
    /// them, 0 elsewhere.
    fn per_completion(&self, ks: &Range<usize>, values: &[f32]) -> CandleResult<Tensor> {
        let l = self.longest(ks);
        let mut out = vec![0f64; ks.len() * l];
        for (row, range) in out
            .chunks_mut(l.max(1))
            .zip(&self.packed.tokens[ks.clone()])
        {
            row.iter_mut()
                .zip(&values[range.clone()])
                .for_each(|(o, &v)| *o = f64::from(v));
        }
        Tensor::from_vec(out, (ks.len(), l), &Device::Cpu)
    }

    fn longest(&self, ks: &Range<usize>) -> usize {
        self.packed.tokens[ks.clone()]
            .iter()
            .map(|r| r.len())
            .max()
            .unwrap_or(0)
    }

    /// The completions whose tokens are `span` (a run of whole completions of the N
    /// predicted tokens; an empty completion at a boundary goes with the run after it).
    fn completions_in(&self, span: &Range<usize>) -> Range<usize> {
        let t = &self.packed.tokens;
        let first = t.partition_point(|r| r.start < span.start);
        let end = if span.end == self.tokens {
            t.len()
        } else {
            t.partition_point(|r| r.start < span.end)
        };
        first..end.max(first)
    }

    /// Completion k's tokens counted in the loss: those after its stale prefix, unless it
    /// was cut off.
    fn counted_tokens(&self, k: usize) -> usize {
        self.counted_within(k).len()
    }

    /// The token ranges (into the packed targets) counted in the loss, completion by
    /// completion.
    fn counted_ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.packed.tokens.iter().enumerate().map(|(k, r)| {
            let within = self.counted_within(k);
            r.start + within.start..r.start + within.end
        })
    }

    /// The positions within completion k of its tokens counted in the loss.
    fn counted_within(&self, k: usize) -> Range<usize> {
        let len = self.packed.tokens[k].len();
        if self.counted[k] {
            self.stale[k].min(len)..len
        } else {
            0..0
        }
    }

    /// The objective over completions `ks`, from the log-probs `logp` of the micro-batch's
    /// tokens (N; those of `ks` are read) and the reference's; with `grad`, also its
    /// gradient scaled by `weight` with respect to the log-probs of `ks`'s tokens, in
    /// token order.
    fn loss(
        &self,
        ks: Range<usize>,
        (logp, ref_logp): (&[f32], Option<&[f32]>),
        cfg: &LossConfig,
        grad: Option<f64>,
    ) -> CandleResult<(LossOutput, Vec<f32>)> {
        let (c, l) = (ks.len(), self.longest(&ks));
        let logp_var = Var::from_tensor(&self.per_completion(&ks, logp)?)?;
        let mut mask = vec![0f64; c * l];
        for (j, k) in ks.clone().enumerate() {
            let within = self.counted_within(k);
            mask[j * l + within.start..j * l + within.end].fill(1.0);
        }
        let mask = Tensor::from_vec(mask, (c, l), &Device::Cpu)?;
        let of = |v: Option<&[f32]>| v.map(|v| self.per_completion(&ks, v)).transpose();
        let reference = of(ref_logp)?;
        let behaviour = of(self.behaviour.as_deref())?;
        let proximal = of(self.proximal.as_deref())?;
        let advantages: Vec<f64> = self.advantages[ks.clone()]
            .iter()
            .map(|&a| f64::from(a))
            .collect();
        let advantages = Tensor::from_vec(advantages, (c, 1), &Device::Cpu)?;
        let out = objective(
            &TokenTensors {
                logp: logp_var.as_tensor(),
                reference: reference.as_ref(),
                behaviour: behaviour.as_ref(),
                proximal: proximal.as_ref(),
                mask: &mask,
                advantages: &advantages,
            },
            cfg,
        )?;
        let Some(weight) = grad else {
            return Ok((out, Vec::new()));
        };
        let store = (&out.loss * weight)?.backward()?;
        let g = match store.get(logp_var.as_tensor()) {
            Some(g) => g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            None => vec![0f32; c * l],
        };
        let tokens = &self.packed.tokens[ks];
        let dlogp = tokens
            .iter()
            .enumerate()
            .flat_map(|(j, r)| g[j * l..j * l + r.len()].iter().copied())
            .collect();
        Ok((out, dlogp))
    }
}

/// What one micro-batch contributed.
#[derive(Debug, Default, Clone, Copy)]
pub struct MicroReport {
    pub policy_loss: f64,
    pub kl: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub mismatch: Option<crate::offpolicy::Mismatch>,
    /// The policy's entropy summed over the counted tokens.
    pub entropy_sum: f64,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    /// Activation bytes the policy forward planned.
    pub activation_bytes: usize,
}

/// The reference's log-probs of every predicted token of `micro` (N), in one forward
/// without activations (one pass over several micro-batches is cheaper than one each:
/// its products are larger and it keeps nothing).
pub fn reference_logprobs<B: Backend>(
    b: &B,
    reference: &Weights<B>,
    micro: &MicroBatch,
    cfg: &LossConfig,
    acts: &mut Activations<B>,
) -> CandleResult<Vec<f32>> {
    crate::forward(b, reference, &micro.packed, cfg.temperature, acts, false)
        .map_err(candle_core::Error::wrap)
}

/// The micro-batch's loss, scaled by `weight`, and its gradients added to `grads`
/// (indexed as [`Weights`]), given the reference's log-probs of its tokens (`None`: no KL
/// term), on backend `b`. Reports the unscaled loss parts.
///
/// The objective runs between the head's forward and backward of each chunk of
/// completions ([`crate::train`]): chunk s's gradient is that of its own loss
/// weighted by `weight · units(s) / units(micro-batch)` ([`crate::grpo::Aggregation::units`]), which
/// adds up to the micro-batch's. The reported parts are the objective's over the whole
/// micro-batch once its log-probs are in.
#[allow(clippy::too_many_arguments)]
pub fn micro_step<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    policy: &Weights<B>,
    ref_logp: Option<&[f32]>,
    micro: &MicroBatch,
    cfg: &LossConfig,
    weight: f64,
    grads: &mut [G],
    acts: &mut Activations<B>,
) -> CandleResult<MicroReport> {
    let wrap = candle_core::Error::wrap;
    let mut report = MicroReport::default();
    let started = Instant::now();
    let units = |ks: Range<usize>| cfg.aggregation.units(ks.map(|k| micro.counted_tokens(k)));
    let whole = units(0..micro.completions());
    // The chunks' log-probs so far (N): a chunk's objective reads its own.
    let mut logp = vec![0f32; micro.tokens];
    let trained = crate::train(
        b,
        policy,
        &micro.packed,
        cfg.temperature,
        (acts, grads),
        |span, chunk| {
            logp[span.clone()].copy_from_slice(chunk);
            let ks = micro.completions_in(&span);
            let share = units(ks.clone());
            if whole == 0.0 || share == 0.0 {
                return Ok(vec![0f32; span.len()]);
            }
            let w = weight * share / whole;
            let (_, dlogp) = micro
                .loss(ks, (&logp, ref_logp), cfg, Some(w))
                .map_err(|e| crate::Error::Objective(Box::new(e)))?;
            Ok(dlogp)
        },
    )
    .map_err(wrap)?;
    // The backward's kernels end before its time is taken (a no-op on the CPU).
    b.synchronize().map_err(wrap)?;
    report.forward_seconds = trained.forward_seconds;
    report.backward_seconds = started.elapsed().as_secs_f64() - trained.forward_seconds;
    report.activation_bytes = acts.bytes(b);
    let entropy = b.read(acts.entropy()).map_err(wrap)?;
    report.entropy_sum = micro
        .counted_ranges()
        .flat_map(|r| &entropy[r])
        .map(|&h| f64::from(h))
        .sum();
    let all = 0..micro.completions();
    let (out, _) = micro.loss(all, (&trained.logp, ref_logp), cfg, None)?;
    report.policy_loss = out.policy_loss;
    report.kl = out.kl;
    report.clip_low = out.clip_low;
    report.clip_high = out.clip_high;
    report.mismatch = out.mismatch;
    Ok(report)
}

/// Supervised micro-batch on backend `b`: `groups` each one document split at its first
/// predicted token (the prompt, then a single completion: the tokens trained on). Adds
/// the gradient of `−weight · mean(log p)` over the predicted tokens to `grads`; returns
/// that mean's negative (the cross-entropy).
pub fn nll_micro<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    policy: &Weights<B>,
    groups: &[GroupInput],
    weight: f64,
    grads: &mut [G],
    acts: &mut Activations<B>,
) -> CandleResult<f64> {
    let packed = Packed::new(groups);
    let n = packed.targets.len().max(1);
    let g = (-weight / n as f64) as f32;
    let logp = crate::train(b, policy, &packed, 1.0, (acts, grads), |span, _| {
        Ok(vec![g; span.len()])
    })
    .map_err(candle_core::Error::wrap)?
    .logp;
    Ok(-logp.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64)
}

/// The tensors of `model` in [`crate::fused::Params`] order.
pub fn model_tensors(model: &Gpt2) -> Vec<Tensor> {
    model.named_tensors().into_iter().map(|(_, t)| t).collect()
}
