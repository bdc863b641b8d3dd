//! The GRPO loss of a batch, assembled from the pure functions of [`crate::grpo`]: exactly
//! what training minimises and what `learner loss` prints.

use candle_core::{Result as CandleResult, Tensor};
use rookworld_lm::Gpt2;
use serde::Serialize;

use crate::batch::Layout;
use crate::grpo::{self, AdvantageNorm, Aggregation, PolicyLoss};
use crate::offpolicy::{self, Correction, Mismatch};
use crate::policy::token_logprobs;

/// Hyper-parameters of the objective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    /// KL coefficient β; 0 skips the reference forward.
    pub beta: f64,
    pub eps_low: f64,
    pub eps_high: f64,
    /// Sampling temperature: log-probs are `log softmax(logits / T)`, as the worker's.
    pub temperature: f64,
    pub advantage_norm: AdvantageNorm,
    pub aggregation: Aggregation,
    pub policy_loss: PolicyLoss,
    /// GSPO's clip range of the sequence ratio: [1 − low, 1 + high].
    pub gspo_eps_low: f64,
    pub gspo_eps_high: f64,
    /// The token budget of a completion: [`Aggregation::Constant`] divides by it.
    pub max_new_tokens: usize,
    /// Decoupled off-policy correction (off: the ratio is against the sampler's log-probs).
    pub correction: Correction,
    /// C, the bound of the importance weights π_prox/π_behaviour.
    pub is_cap: f64,
    /// Leave out of the loss every completion that hit its token budget without
    /// end-of-text (DAPO's overlong filtering); its reward still counts in its group's
    /// advantages.
    pub mask_truncated: bool,
}

/// The KL coefficient β by default: small, for a tiny model that must first learn the
/// format.
pub const DEFAULT_BETA: f64 = 0.01;
/// The clip ε of the token ratio by default, on both sides (PPO's and GRPO's 0.2).
pub const DEFAULT_CLIP_EPS: f64 = 0.2;
/// GSPO's clip range by default, as the paper's (3e-4, 4e-4): sequence ratios stay far
/// closer to 1 than token ratios.
pub const GSPO_EPS_LOW: f64 = 3e-4;
pub const GSPO_EPS_HIGH: f64 = 4e-4;
/// C, the bound of the importance weights, by default.
pub const DEFAULT_IS_CAP: f64 = 2.0;

impl Default for LossConfig {
    /// The objective's defaults, at sampling's default temperature and token budget.
    fn default() -> Self {
        Self {
            beta: DEFAULT_BETA,
            eps_low: DEFAULT_CLIP_EPS,
            eps_high: DEFAULT_CLIP_EPS,
            temperature: rookworld_lm::cli::DEFAULT_TEMPERATURE,
            advantage_norm: AdvantageNorm::default(),
            aggregation: Aggregation::default(),
            policy_loss: PolicyLoss::default(),
            gspo_eps_low: GSPO_EPS_LOW,
            gspo_eps_high: GSPO_EPS_HIGH,
            max_new_tokens: rookworld_lm::cli::DEFAULT_MAX_NEW_TOKENS as usize,
            correction: Correction::default(),
            is_cap: DEFAULT_IS_CAP,
            mask_truncated: false,
        }
    }
}

/// The loss and what to report about it.
#[derive(Debug)]
pub struct LossOutput {
    /// policy_loss + β·kl, differentiable.
    pub loss: Tensor,
    pub policy_loss: f64,
    /// Unscaled k3 KL (0 when β = 0: the reference is not run).
    pub kl: f64,
    /// Shares of tokens whose ratio was clipped below and above.
    pub clip_low: f64,
    pub clip_high: f64,
    /// The sampler against the learner, when the batch has the sampler's log-probs.
    pub mismatch: Option<Mismatch>,
}

/// Numbers of one loss evaluation (`learner loss` prints this).
#[derive(Debug, Clone, Serialize)]
pub struct LossReport {
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    pub grad_norm: f64,
    pub advantages: Vec<Vec<f32>>,
    pub clip_frac: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<Mismatch>,
    /// The policy's mean entropy per counted token (nats), where measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy: Option<f64>,
    pub skipped_groups: usize,
    pub tokens: usize,
}

/// `loss = aggregate(−min(ρA, clip(ρ)A)) + β · aggregate(k3(ref, logπθ))` over the
/// completion tokens of `layout`.
pub fn grpo_loss(
    policy: &Gpt2,
    reference: Option<&Gpt2>,
    layout: &Layout,
    cfg: &LossConfig,
) -> CandleResult<LossOutput> {
    let logp = token_logprobs(policy, layout, cfg.temperature)?; // (C, T−1)
    let ref_logp = match reference {
        Some(reference) if cfg.beta > 0.0 => {
            Some(token_logprobs(reference, layout, cfg.temperature)?.detach())
        }
        _ => None,
    };
    let tokens = TokenTensors {
        logp: &logp,
        reference: ref_logp.as_ref(),
        behaviour: layout.behaviour.as_ref(),
        proximal: layout.proximal.as_ref(),
        mask: &layout.mask,
        advantages: &layout.advantages,
    };
    objective(&tokens, cfg)
}

/// Per-token tensors of the objective, all (C, T) f32 but the advantages (C, 1). Only the
/// masked slots count; what the others hold does not matter as long as it is finite.
#[derive(Debug, Clone, Copy)]
pub struct TokenTensors<'a> {
    /// log πθ, differentiable.
    pub logp: &'a Tensor,
    /// log π_ref (detached); `None`: no KL term.
    pub reference: Option<&'a Tensor>,
    /// log π_old of the sampler; `None`: the policy's own detached log-probs (ratio 1).
    pub behaviour: Option<&'a Tensor>,
    /// log π_prox, the learner's own at the start of the step (detached); `None`: the
    /// policy's detached log-probs (the same, for one update per batch).
    pub proximal: Option<&'a Tensor>,
    pub mask: &'a Tensor,
    pub advantages: &'a Tensor,
}

/// The objective from per-token log-probs, however they were computed:
/// `aggregate(pg) + β · aggregate(k3(ref, logπθ))`, the policy-gradient term `pg` by
/// [`PolicyLoss`]: PPO/GRPO's `−min(ρA, clip(ρ)A)` on token ratios, GSPO's on the
/// sequence ratio (each token carrying its sequence's term), GSPO-token's, or CISPO's
/// `−sg(min(ρ, 1+ε_high))·A·logπθ`.
pub fn objective(t: &TokenTensors, cfg: &LossConfig) -> CandleResult<LossOutput> {
    let mask = t.mask;
    let adv = t.advantages;
    let logp = (t.logp * mask)?;
    let sampler = t.behaviour.map(|b| b * mask).transpose()?;
    let proximal = match t.proximal {
        Some(p) => (p * mask)?.detach(),
        None => logp.detach(),
    };
    // The importance weights π_prox/π_behaviour at the correction's level (per token when
    // it is off): reported always, bounded into the loss under the correction.
    let cap = cfg.is_cap;
    let level = match cfg.correction {
        Correction::Off => Correction::TokenTruncate,
        c => c,
    };
    let raw = sampler
        .as_ref()
        .map(|s| offpolicy::raw_weights(&proximal, s, mask, level))
        .transpose()?;
    let mismatch = match (&sampler, &raw) {
        (Some(s), Some(raw)) => Some(Mismatch::of(&proximal, s, mask, raw, cap)?),
        _ => None,
    };
    // The ratio's denominator: the proximal policy under the correction (whose weights
    // then carry the sampler's gap), else the sampler's log-probs.
    let (behaviour, weights) = match (&sampler, &raw) {
        (Some(_), Some(raw)) if cfg.correction.on() => (
            proximal.clone(),
            Some(offpolicy::bounded_weights(raw, cfg.correction, cap)?),
        ),
        (Some(s), _) => (s.clone(), None),
        _ => (logp.detach(), None),
    };
    let (lo, hi) = (cfg.eps_low, cfg.eps_high);
    let (glo, ghi) = (cfg.gspo_eps_low, cfg.gspo_eps_high);
    let (surrogate, clipped) = match cfg.policy_loss {
        PolicyLoss::Clip => {
            let ratio = grpo::ratio(&logp, &behaviour)?;
            let clipped = grpo::clip_fractions(&ratio, adv, mask, lo, hi)?;
            (grpo::clipped_surrogate(&ratio, adv, lo, hi)?, clipped)
        }
        PolicyLoss::Gspo => {
            let ratio = grpo::sequence_ratio(&logp, &behaviour, mask)?; // (C, 1)
            let surrogate = grpo::clipped_surrogate(&ratio, adv, glo, ghi)?;
            let per_token = ratio.broadcast_as(mask.shape())?;
            let clipped = grpo::clip_fractions(&per_token, adv, mask, glo, ghi)?;
            (surrogate.broadcast_as(mask.shape())?, clipped)
        }
        PolicyLoss::GspoToken => {
            let ratio = grpo::gspo_token_ratio(&logp, &behaviour, mask)?;
            let clipped = grpo::clip_fractions(&ratio, adv, mask, glo, ghi)?;
            (grpo::clipped_surrogate(&ratio, adv, glo, ghi)?, clipped)
        }
        PolicyLoss::Cispo => {
            let ratio = grpo::ratio(&logp, &behaviour)?;
            // Truncated weights, whatever the advantage's sign.
            let ones = adv.ones_like()?;
            let (_, high) = grpo::clip_fractions(&ratio, &ones, mask, f64::INFINITY, hi)?;
            (grpo::cispo_surrogate(&ratio, &logp, adv, hi)?, (0.0, high))
        }
    };
    let surrogate = match &weights {
        Some(w) => (surrogate * w)?,
        None => surrogate,
    };
    let aggregate = |x: &Tensor| grpo::aggregate(x, mask, cfg.aggregation, cfg.max_new_tokens);
    let policy_loss = aggregate(&surrogate)?;
    let (loss, kl) = match t.reference {
        Some(reference) if cfg.beta > 0.0 => {
            let ref_logp = (reference * mask)?;
            let kl = aggregate(&grpo::k3_kl(&ref_logp, &logp)?)?;
            let value = grpo::scalar(&kl)?;
            ((&policy_loss + (kl * cfg.beta)?)?, value)
        }
        _ => (policy_loss.clone(), 0.0),
    };
    Ok(LossOutput {
        policy_loss: grpo::scalar(&policy_loss)?,
        loss,
        kl,
        clip_low: clipped.0,
        clip_high: clipped.1,
        mismatch,
    })
}
