//! Decoupled off-policy correction and the sampler/learner mismatch, as small pure functions
//! on (C, T) token tensors under a (C, T) mask (see [`crate::grpo`]).
//!
//! The sampler (a worker, perhaps some versions behind, perhaps in BF16) drew the tokens
//! from π_behaviour; the learner's own policy at the start of the step is the proximal
//! policy π_prox. The decoupled objective (AReaL; verl's and TRL's rollout correction)
//! clips the ratio πθ/π_prox, as PPO does, and weights each token's term by the importance
//! weight π_prox/π_behaviour, bounded by C: truncated (capped at C) or masked (dropped above
//! C), per token or per sequence.

use candle_core::{D, Result, Tensor};
use serde::Serialize;

use crate::grpo::{MAX_LOG_DIFF, scalar};

/// How the behaviour-to-proximal importance weights enter the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Correction {
    /// None: the ratio is taken against the behaviour policy (plain GRPO/PPO).
    #[default]
    Off,
    /// `w_t = min(π_prox/π_behaviour, C)` per token.
    TokenTruncate,
    /// `w_t = π_prox/π_behaviour` per token, 0 where it exceeds C.
    TokenMask,
    /// `w = min(Π_t π_prox/π_behaviour, C)` per sequence, on each of its tokens.
    SequenceTruncate,
    /// `w = Π_t π_prox/π_behaviour` per sequence, 0 where it exceeds C.
    SequenceMask,
}

impl crate::choice::Choice for Correction {
    const NAMES: &'static [(Self, &'static str)] = &[
        (Self::Off, "off"),
        (Self::TokenTruncate, "token-truncate"),
        (Self::TokenMask, "token-mask"),
        (Self::SequenceTruncate, "sequence-truncate"),
        (Self::SequenceMask, "sequence-mask"),
    ];
}

impl Correction {
    pub fn on(self) -> bool {
        self != Self::Off
    }
}

/// The importance weights `π_prox/π_behaviour` (C, T), before any bound: per token
/// `exp(clamp(logπ_prox − logπ_behaviour, ±MAX_LOG_DIFF))`; at sequence level
/// `exp(clamp(Σ_t (logπ_prox − logπ_behaviour)·m, ±MAX_LOG_DIFF))` on each token of the
/// sequence. Never differentiated.
pub fn raw_weights(
    proximal: &Tensor,
    behaviour: &Tensor,
    mask: &Tensor,
    mode: Correction,
) -> Result<Tensor> {
    let diff = ((proximal - behaviour)? * mask)?.detach();
    let log_w = match mode {
        Correction::SequenceTruncate | Correction::SequenceMask => diff
            .sum_keepdim(D::Minus1)?
            .broadcast_as(mask.shape())?
            .contiguous()?,
        _ => diff,
    };
    log_w.clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?.exp()
}

/// The bounded weights: `min(w, C)` (truncate) or `w · [w ≤ C]` (mask) (C, T).
pub fn bounded_weights(raw: &Tensor, mode: Correction, cap: f64) -> Result<Tensor> {
    match mode {
        Correction::Off => raw.ones_like(),
        Correction::TokenTruncate | Correction::SequenceTruncate => raw.minimum(cap),
        Correction::TokenMask | Correction::SequenceMask => {
            raw * raw.le(cap)?.to_dtype(raw.dtype())?
        }
    }
}

/// How far the sampler's log-probs are from the learner's, on a step's tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Mismatch {
    /// Mean and largest |logπ_learner − logπ_sampler| over the tokens.
    pub logp_diff_mean: f64,
    pub logp_diff_max: f64,
    /// k3 estimate of KL(π_sampler ‖ π_learner) per token: with d = logπ_learner −
    /// logπ_sampler, `mean(exp(d) − d − 1)`.
    pub sampler_kl: f64,
    /// The importance weights π_prox/π_behaviour (at the correction's level; per token when
    /// the correction is off) before their bound: smallest, mean, largest.
    pub is_min: f64,
    pub is_mean: f64,
    pub is_max: f64,
    /// Share of tokens whose weight exceeded C (truncated or masked).
    pub is_bounded: f64,
    /// Effective sample size of the weights over the tokens, `(Σw)² / (N Σw²)` in (0, 1].
    pub ess: f64,
    /// Tokens these figures are over.
    pub tokens: f64,
}

impl Mismatch {
    /// The mismatch of `learner` (the proximal policy's log-probs) against `sampler`
    /// under `mask`, with the raw weights `raw` and bound `cap`.
    pub fn of(
        learner: &Tensor,
        sampler: &Tensor,
        mask: &Tensor,
        raw: &Tensor,
        cap: f64,
    ) -> Result<Self> {
        let n = scalar(&mask.sum_all()?)?;
        if n <= 0.0 {
            return Ok(Self::default());
        }
        let d = ((learner - sampler)? * mask)?.detach();
        let mean = |x: &Tensor| -> Result<f64> { Ok(scalar(&(x * mask)?.sum_all()?)? / n) };
        let counted = |x: &Tensor, empty: f64| -> Result<Tensor> {
            // Masked slots set to `empty`, so they never win a min or a max.
            let off = ((mask.ones_like()? - mask)? * empty)?;
            (x * mask)? + off
        };
        let big = f64::from(f32::MAX);
        let k3 = ((d.clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?.exp()? - &d)? - 1.0)?.relu()?;
        let w = raw.detach();
        let sum_w = scalar(&(&w * mask)?.sum_all()?)?;
        let sum_w2 = scalar(&(w.sqr()? * mask)?.sum_all()?)?;
        Ok(Self {
            logp_diff_mean: mean(&d.abs()?)?,
            logp_diff_max: scalar(&d.abs()?.max_keepdim(D::Minus1)?.max_all()?)?,
            sampler_kl: mean(&k3)?,
            is_min: scalar(&counted(&w, big)?.min_all()?)?,
            is_mean: sum_w / n,
            is_max: scalar(&counted(&w, 0.0)?.max_all()?)?,
            is_bounded: mean(&w.gt(cap)?.to_dtype(mask.dtype())?)?,
            ess: if sum_w2 > 0.0 {
                sum_w * sum_w / (n * sum_w2)
            } else {
                1.0
            },
            tokens: n,
        })
    }

    /// Folds `other` (another micro-batch's) into `self`: means weighted by tokens.
    pub fn merge(&mut self, other: &Self) {
        if other.tokens <= 0.0 {
            return;
        }
        if self.tokens <= 0.0 {
            *self = *other;
            return;
        }
        let (a, b) = (self.tokens, other.tokens);
        let mix = |x: f64, y: f64| (x * a + y * b) / (a + b);
        self.logp_diff_mean = mix(self.logp_diff_mean, other.logp_diff_mean);
        self.sampler_kl = mix(self.sampler_kl, other.sampler_kl);
        self.is_mean = mix(self.is_mean, other.is_mean);
        self.is_bounded = mix(self.is_bounded, other.is_bounded);
        self.ess = mix(self.ess, other.ess);
        self.logp_diff_max = self.logp_diff_max.max(other.logp_diff_max);
        self.is_min = self.is_min.min(other.is_min);
        self.is_max = self.is_max.max(other.is_max);
        self.tokens = a + b;
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn t(rows: &[&[f32]]) -> Tensor {
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (rows.len(), rows[0].len()), &Device::Cpu).unwrap()
    }

    #[test]
    fn weights_at_token_and_sequence_level_truncated_or_masked() {
        let ln2 = 2f32.ln();
        let prox = t(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let behaviour = t(&[&[-ln2, ln2, -3.0 * ln2], &[ln2, 0.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        let close = |x: Tensor, want: [[f32; 3]; 2]| {
            let got = x.to_vec2::<f32>().unwrap();
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
            }
        };
        let raw = raw_weights(&prox, &behaviour, &mask, Correction::TokenTruncate).unwrap();
        // Masked slots are weight 1 (log-weight 0) and never count.
        close(raw.clone(), [[2.0, 0.5, 1.0], [0.5, 1.0, 1.0]]);
        let cap = 1.5;
        close(
            bounded_weights(&raw, Correction::TokenTruncate, cap).unwrap(),
            [[1.5, 0.5, 1.0], [0.5, 1.0, 1.0]],
        );
        close(
            bounded_weights(&raw, Correction::TokenMask, cap).unwrap(),
            [[0.0, 0.5, 1.0], [0.5, 1.0, 1.0]],
        );
        // Sequence level: the product over the sequence's own tokens, 2 · 0.5 = 1 and 0.5.
        let raw = raw_weights(&prox, &behaviour, &mask, Correction::SequenceMask).unwrap();
        close(raw, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]]);
    }

    #[test]
    fn the_mismatch_figures_count_only_masked_tokens_and_merge_by_tokens() {
        let ln2 = 2f32.ln();
        let learner = t(&[&[0.0, 0.0, 5.0]]);
        let sampler = t(&[&[-ln2, ln2, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 0.0]]);
        let raw = raw_weights(&learner, &sampler, &mask, Correction::TokenMask).unwrap();
        let m = Mismatch::of(&learner, &sampler, &mask, &raw, 1.5).unwrap();
        let ln2 = f64::from(ln2);
        assert!((m.logp_diff_mean - ln2).abs() < 1e-6 && (m.logp_diff_max - ln2).abs() < 1e-6);
        let k3 = |d: f64| d.exp() - d - 1.0;
        assert!((m.sampler_kl - (k3(ln2) + k3(-ln2)) / 2.0).abs() < 1e-6);
        assert!((m.is_min - 0.5).abs() < 1e-6 && (m.is_max - 2.0).abs() < 1e-6);
        assert!((m.is_mean - 1.25).abs() < 1e-6);
        assert!((m.is_bounded - 0.5).abs() < 1e-9);
        assert!((m.ess - 2.5 * 2.5 / (2.0 * 4.25)).abs() < 1e-6);
        let mut all = m;
        let other = Mismatch {
            is_mean: 1.0,
            is_min: 0.9,
            is_max: 1.1,
            tokens: 6.0,
            ess: 1.0,
            ..Mismatch::default()
        };
        all.merge(&other);
        assert_eq!((all.tokens, all.is_min, all.is_max), (8.0, 0.5, 2.0));
        assert!((all.is_mean - (1.25 * 2.0 + 6.0) / 8.0).abs() < 1e-12);
    }
}
