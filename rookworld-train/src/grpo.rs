//! The GRPO objective as small pure functions (formulas in the book, `docs/concepts/grpo.md`).
//!
//! Token tensors are (C, T): C completions, T token slots, with a (C, T) f32 mask that is 1
//! on a completion's own tokens and 0 on prompt and padding slots.

use candle_core::{D, Result, Tensor};

/// Added to the group's std before dividing (TRL's value).
pub const ADVANTAGE_EPS: f64 = 1e-4;

/// How rewards are normalised within a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum AdvantageNorm {
    /// A = (r − mean) / (std + 1e-4), std with N − 1 (unbiased), as TRL.
    #[default]
    Unbiased,
    /// A = (r − mean) / (std + 1e-4), std with N (population).
    Population,
    /// A = (r − mean) / (std_batch + 1e-4): the group's mean, the std of every reward in
    /// the step's batch (N − 1), as TRL's `scale_rewards="batch"`.
    Batch,
    /// A = r − mean (no division; Dr. GRPO).
    None,
}

impl crate::choice::Choice for AdvantageNorm {
    const NAMES: &'static [(Self, &'static str)] = &[
        (Self::Unbiased, "unbiased"),
        (Self::Population, "population"),
        (Self::Batch, "batch"),
        (Self::None, "none"),
    ];
}

/// What a group's centred rewards are divided by, resolved for one batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// The group's own std (N − 1) + 1e-4.
    GroupUnbiased,
    /// The group's own std (N) + 1e-4.
    GroupPopulation,
    /// One number for every group.
    Fixed(f64),
}

impl AdvantageNorm {
    /// The scale for a batch whose groups' rewards are `rewards`.
    pub fn scale(self, rewards: &[Vec<f32>]) -> Scale {
        match self {
            Self::Unbiased => Scale::GroupUnbiased,
            Self::Population => Scale::GroupPopulation,
            Self::None => Scale::Fixed(1.0),
            Self::Batch => {
                let all: Vec<f64> = rewards.iter().flatten().map(|&r| f64::from(r)).collect();
                let n = all.len();
                let mean = all.iter().sum::<f64>() / n.max(1) as f64;
                let ss: f64 = all.iter().map(|x| (x - mean).powi(2)).sum();
                let std = if n > 1 {
                    (ss / (n - 1) as f64).sqrt()
                } else {
                    0.0
                };
                Scale::Fixed(std + ADVANTAGE_EPS)
            }
        }
    }
}

/// How per-token values become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Aggregation {
    /// Mean over each completion's tokens, then mean over completions.
    #[default]
    Sequence,
    /// Mean over all completion tokens of the batch (DAPO; TRL `loss_type="dapo"`).
    Token,
    /// Sum over all completion tokens of the batch divided by a constant, completions ×
    /// max new tokens (Dr. GRPO; TRL `loss_type="dr_grpo"`): no length bias.
    Constant,
}

impl crate::choice::Choice for Aggregation {
    const NAMES: &'static [(Self, &'static str)] = &[
        (Self::Sequence, "sequence"),
        (Self::Token, "token"),
        (Self::Constant, "constant"),
    ];
}

impl Aggregation {
    /// What [`aggregate`] divides a set of completions' sum by (the constant's before its
    /// `max_new_tokens`), from each completion's counted tokens: the completions with a
    /// counted token (sequence), the counted tokens (token), all the completions
    /// (constant). So the aggregate over a union of disjoint sets is theirs weighted by
    /// `units(set) / units(union)`.
    pub fn units(self, counted_tokens: impl IntoIterator<Item = usize>) -> f64 {
        let counted = counted_tokens.into_iter();
        match self {
            Self::Sequence => counted.filter(|&t| t > 0).count() as f64,
            Self::Token => counted.sum::<usize>() as f64,
            Self::Constant => counted.count() as f64,
        }
    }
}

/// The policy-gradient term of the objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum PolicyLoss {
    /// PPO/GRPO: per-token ratio ρ_t, `−min(ρ_t·A, clip(ρ_t, 1−ε_low, 1+ε_high)·A)`.
    #[default]
    Clip,
    /// GSPO: one ratio per sequence, `s = exp(mean_t(logπθ − logπ_old))`, clipped with its
    /// own small ε (`--gspo-eps`, `--gspo-eps-high`), the same term on every token.
    Gspo,
    /// GSPO-token: `s_t = sg(s) · πθ(y_t) / sg(πθ(y_t))`, the sequence's value with each
    /// token's own gradient, clipped as GSPO.
    GspoToken,
    /// CISPO: `−sg(min(ρ_t, 1+ε_high)) · A · logπθ(y_t)`: the weight is truncated and
    /// detached, so every token keeps a gradient.
    Cispo,
}

impl crate::choice::Choice for PolicyLoss {
    const NAMES: &'static [(Self, &'static str)] = &[
        (Self::Clip, "clip"),
        (Self::Gspo, "gspo"),
        (Self::GspoToken, "gspo-token"),
        (Self::Cispo, "cispo"),
    ];
}

/// Group-relative advantages of one group's rewards:
/// `A_i = (r_i − mean(r)) / (std(r) + 1e-4)` (or without the division, see
/// [`AdvantageNorm`]). `None` when every reward is equal: the group carries no signal and
/// is skipped (and counted) rather than trained on with zero advantages.
pub fn group_advantages(rewards: &[f32], scale: Scale) -> Option<Vec<f32>> {
    let n = rewards.len();
    if n == 0 || rewards.iter().all(|&r| r == rewards[0]) {
        return None;
    }
    let r: Vec<f64> = rewards.iter().map(|&x| x as f64).collect();
    let mean = r.iter().sum::<f64>() / n as f64;
    let ss: f64 = r.iter().map(|x| (x - mean).powi(2)).sum();
    let scale = match scale {
        Scale::GroupUnbiased if n > 1 => (ss / (n - 1) as f64).sqrt() + ADVANTAGE_EPS,
        Scale::GroupUnbiased => ADVANTAGE_EPS,
        Scale::GroupPopulation => (ss / n as f64).sqrt() + ADVANTAGE_EPS,
        Scale::Fixed(s) => s,
    };
    Some(r.iter().map(|x| ((x - mean) / scale) as f32).collect())
}

/// Largest |log-difference| put through `exp` (as verl does): e^20 ≈ 5·10⁸, far past any
/// clip range, where e^89 already overflows f32 and one such token makes the loss ∞ or NaN.
pub const MAX_LOG_DIFF: f64 = 20.0;

/// Per-token importance ratio against the behaviour policy:
/// `ρ = exp(clamp(logπθ − logπ_behaviour, ±MAX_LOG_DIFF))` (C, T).
pub fn ratio(logp: &Tensor, behaviour: &Tensor) -> Result<Tensor> {
    (logp - behaviour)?
        .clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?
        .exp()
}

/// GSPO's sequence ratio `s = exp(clamp(Σ_t (logπθ − logπ_old)·m / Σ_t m, ±MAX_LOG_DIFF))`
/// (C, 1): the geometric mean of the token ratios.
pub fn sequence_ratio(logp: &Tensor, behaviour: &Tensor, mask: &Tensor) -> Result<Tensor> {
    sequence_log_ratio(logp, behaviour, mask)?
        .clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?
        .exp()
}

fn sequence_log_ratio(logp: &Tensor, behaviour: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let sum = ((logp - behaviour)? * mask)?.sum_keepdim(D::Minus1)?;
    sum.broadcast_div(&mask.sum_keepdim(D::Minus1)?.maximum(1.0)?)
}

/// GSPO-token's ratio `s_t = exp(sg(log s) + logπθ − sg(logπθ))` (C, T): every token's value
/// is the sequence's ratio, its gradient that of its own log-prob (times s).
pub fn gspo_token_ratio(logp: &Tensor, behaviour: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let seq = sequence_log_ratio(logp, behaviour, mask)?
        .clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?
        .detach();
    (logp - logp.detach())?.broadcast_add(&seq)?.exp()
}

/// CISPO's per-token term `−sg(min(ρ, 1+ε_high)) · A · logπθ` (C, T).
pub fn cispo_surrogate(
    ratio: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    eps_high: f64,
) -> Result<Tensor> {
    let weight = ratio.minimum(1.0 + eps_high)?.detach();
    (weight * logp)?.broadcast_mul(adv)?.neg()
}

/// Per-token clipped surrogate `−min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A)` (C, T), with the
/// advantage `A` (C, 1) of each completion broadcast over its tokens.
pub fn clipped_surrogate(
    ratio: &Tensor,
    adv: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Result<Tensor> {
    let unclipped = ratio.broadcast_mul(adv)?;
    let clipped = ratio
        .clamp(1.0 - eps_low, 1.0 + eps_high)?
        .broadcast_mul(adv)?;
    unclipped.minimum(&clipped)?.neg()
}

/// Per-token k3 estimator of KL(πθ ‖ π_ref): with `d = clamp(ref − logπθ, ±MAX_LOG_DIFF)`,
/// `max(0, exp(d) − d − 1)` (C, T).
///
/// The clamp of `d` keeps `exp` finite; the expression is ≥ 0 in exact arithmetic, and the
/// `max` keeps rounding (a fast `exp` on a GPU) from taking it below.
pub fn k3_kl(reference: &Tensor, logp: &Tensor) -> Result<Tensor> {
    let d = (reference - logp)?.clamp(-MAX_LOG_DIFF, MAX_LOG_DIFF)?;
    ((d.exp()? - d)? - 1.0)?.relu()
}

/// Fractions of counted tokens whose ratio (C, T) was clipped, (low, high): below
/// 1 − ε_low with A < 0, above 1 + ε_high with A > 0 (where the clipped term was taken).
pub fn clip_fractions(
    ratio: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Result<(f64, f64)> {
    let dtype = mask.dtype();
    let low = ratio
        .lt(1.0 - eps_low)?
        .to_dtype(dtype)?
        .broadcast_mul(&adv.lt(0.0)?.to_dtype(dtype)?)?;
    let high = ratio
        .gt(1.0 + eps_high)?
        .to_dtype(dtype)?
        .broadcast_mul(&adv.gt(0.0)?.to_dtype(dtype)?)?;
    let total = scalar(&mask.sum_all()?)?;
    if total <= 0.0 {
        return Ok((0.0, 0.0));
    }
    let share = |x: Tensor| -> Result<f64> { Ok(scalar(&(x * mask)?.sum_all()?)? / total) };
    Ok((share(low)?, share(high)?))
}

/// A one-element tensor of any float dtype as f64.
pub fn scalar(t: &Tensor) -> Result<f64> {
    t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()
}

/// One number from per-token values (C, T) under `mask` (C, T):
/// - [`Aggregation::Sequence`]: `mean_c( Σ_t x·m / Σ_t m )`;
/// - [`Aggregation::Token`]: `Σ x·m / Σ m`;
/// - [`Aggregation::Constant`]: `Σ x·m / (C · max_new_tokens)`.
///
/// Completions with no token count as empty and are left out of the sequence mean.
pub fn aggregate(
    values: &Tensor,
    mask: &Tensor,
    how: Aggregation,
    max_new_tokens: usize,
) -> Result<Tensor> {
    let masked = (values * mask)?;
    match how {
        Aggregation::Constant => {
            let c = mask.dim(0)?;
            masked.sum_all()? / (c * max_new_tokens).max(1) as f64
        }
        Aggregation::Token => masked
            .sum_all()?
            .broadcast_div(&mask.sum_all()?.maximum(1.0)?),
        Aggregation::Sequence => {
            let per = masked
                .sum(D::Minus1)?
                .broadcast_div(&mask.sum(D::Minus1)?.maximum(1.0)?)?; // (C)
            let present = mask.sum(D::Minus1)?.gt(0.0)?.to_dtype(values.dtype())?; // (C)
            (per * &present)?
                .sum_all()?
                .broadcast_div(&present.sum_all()?.maximum(1.0)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn t(rows: &[&[f32]]) -> Tensor {
        let c = rows.len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (c, rows[0].len()), &Device::Cpu).unwrap()
    }

    fn scalar(x: Tensor) -> f32 {
        x.to_scalar::<f32>().unwrap()
    }

    #[test]
    fn advantages_follow_trl_and_equal_rewards_carry_no_signal() {
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], Scale::GroupUnbiased).unwrap();
        let std = (1.0f64 / 3.0).sqrt(); // unbiased std of [1, 0, 0, 1]
        let want = (0.5 / (std + 1e-4)) as f32;
        assert!(
            (a[0] - want).abs() < 1e-6 && (a[1] + want).abs() < 1e-6,
            "{a:?}"
        );
        let p = group_advantages(&[1.0, 0.0, 0.0, 1.0], Scale::GroupPopulation).unwrap();
        assert!((p[0] - (0.5 / (0.5 + 1e-4)) as f32).abs() < 1e-6);
        assert_eq!(
            group_advantages(&[2.0, 0.0], Scale::Fixed(1.0)).unwrap(),
            vec![1.0, -1.0]
        );
        assert_eq!(group_advantages(&[0.3; 8], Scale::GroupUnbiased), None);
        assert_eq!(group_advantages(&[], Scale::GroupUnbiased), None);
    }

    #[test]
    fn surrogate_clips_only_in_the_direction_of_the_advantage() {
        let r = t(&[&[0.5, 1.0, 1.5]]);
        let pos = clipped_surrogate(&r, &t(&[&[2.0]]), 0.2, 0.2)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(pos, vec![vec![-1.0, -2.0, -2.4]]); // min(ρA, clip(ρ)A) with A > 0
        let neg = clipped_surrogate(&r, &t(&[&[-2.0]]), 0.2, 0.2)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(neg, vec![vec![1.6, 2.0, 3.0]]); // A < 0: the larger ratio term wins
        let mask = t(&[&[1.0, 1.0, 1.0]]);
        let (lo, hi) = clip_fractions(&r, &t(&[&[2.0]]), &mask, 0.2, 0.2).unwrap();
        assert!(lo == 0.0 && (hi - 1.0 / 3.0).abs() < 1e-9);
        let (lo, hi) = clip_fractions(&r, &t(&[&[-2.0]]), &mask, 0.2, 0.2).unwrap();
        assert!((lo - 1.0 / 3.0).abs() < 1e-9 && hi == 0.0);
    }

    #[test]
    fn k3_is_zero_at_equality_and_positive_elsewhere() {
        let logp = t(&[&[-1.0, -2.0, -0.5]]);
        let same = k3_kl(&logp, &logp).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(same, vec![vec![0.0, 0.0, 0.0]]);
        let other = k3_kl(&t(&[&[-1.5, -1.0, -0.5]]), &logp)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let k = |d: f32| d.exp() - d - 1.0;
        assert!((other[0][0] - k(-0.5)).abs() < 1e-6 && (other[0][1] - k(1.0)).abs() < 1e-6);
        // A policy far below the reference on a token (d = 150: e^150 overflows f32)
        // stays finite, at the clamp's value.
        let far = k3_kl(&t(&[&[-0.1]]), &t(&[&[-150.1]]))
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!((far[0][0] - k(20.0)).abs() / k(20.0) < 1e-6, "{far:?}");
    }

    #[test]
    fn ratios_stay_finite_for_far_apart_log_probs() {
        let r = ratio(&t(&[&[-0.5, -200.0, -1.0]]), &t(&[&[-200.0, -0.5, -1.0]]))
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let bound = MAX_LOG_DIFF.exp() as f32;
        assert!((r[0][0] - bound).abs() / bound < 1e-6, "{r:?}");
        assert!((r[0][1] - 1.0 / bound).abs() * bound < 1e-6, "{r:?}");
        assert_eq!(r[0][2], 1.0);
    }

    #[test]
    fn aggregation_ignores_masked_tokens_and_weights_completions_or_tokens() {
        let x = t(&[&[1.0, 3.0, 100.0], &[4.0, 100.0, 100.0]]);
        let m = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        assert_eq!(
            scalar(aggregate(&x, &m, Aggregation::Sequence, 0).unwrap()),
            3.0
        ); // (2 + 4) / 2
        assert!(
            (scalar(aggregate(&x, &m, Aggregation::Token, 0).unwrap()) - 8.0 / 3.0).abs() < 1e-6
        );
        let empty = t(&[&[1.0, 3.0], &[5.0, 5.0]]);
        let m2 = t(&[&[1.0, 1.0], &[0.0, 0.0]]);
        assert_eq!(
            scalar(aggregate(&empty, &m2, Aggregation::Sequence, 0).unwrap()),
            2.0
        );
        // Dr. GRPO: the sum over 2 completions × 4 max new tokens.
        assert!((scalar(aggregate(&x, &m, Aggregation::Constant, 4).unwrap()) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn batch_scale_is_the_std_of_every_reward_in_the_batch() {
        let rewards = vec![vec![1.0, 0.0], vec![0.5, 0.5]];
        let Scale::Fixed(s) = AdvantageNorm::Batch.scale(&rewards) else {
            panic!("a fixed scale")
        };
        // Unbiased std of [1, 0, 0.5, 0.5]: sqrt(0.5 / 3).
        assert!((s - ((0.5f64 / 3.0).sqrt() + ADVANTAGE_EPS)).abs() < 1e-12);
        let a = group_advantages(&rewards[0], Scale::Fixed(s)).unwrap();
        assert!((f64::from(a[0]) - 0.5 / s).abs() < 1e-6);
        assert_eq!(group_advantages(&rewards[1], Scale::Fixed(s)), None);
    }

    #[test]
    fn sequence_ratios_are_the_geometric_mean_of_the_token_ratios() {
        let logp = t(&[&[-1.0, -2.0, 0.0], &[-0.5, 0.0, 0.0]]);
        let old = t(&[&[-1.5, -1.5, 9.0], &[-1.0, 0.0, 0.0]]);
        let m = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        let s = sequence_ratio(&logp, &old, &m)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(s, vec![vec![1.0], vec![0.5f32.exp()]]);
        let st = gspo_token_ratio(&logp, &old, &m)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(
            st.iter()
                .zip(&s)
                .all(|(row, s)| row.iter().all(|v| (v - s[0]).abs() < 1e-6))
        );
    }

    #[test]
    fn cispo_weights_each_log_prob_by_the_truncated_ratio() {
        let r = t(&[&[0.5, 1.0, 3.0]]);
        let logp = t(&[&[-1.0, -2.0, -3.0]]);
        let v = cispo_surrogate(&r, &logp, &t(&[&[2.0]]), 0.2)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        // −w·A·logp, w = min(ρ, 1.2).
        for (got, want) in v[0].iter().zip([1.0, 4.0, 7.2]) {
            assert!((got - want).abs() < 1e-5, "{v:?}");
        }
    }
}
