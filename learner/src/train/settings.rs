//! The settings that define a run of `learner train`: kept in its checkpoints and
//! checked on resume (all but [`RESUMABLE`]), with their ranges and what they become
//! (loss, step, queue, schedule, warm-up configurations).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::ConfigError;
use crate::grpo::PolicyLoss;
use crate::grpo::{AdvantageNorm, Aggregation};
use crate::loss::{GSPO_EPS_HIGH, GSPO_EPS_LOW, LossConfig};
use crate::offpolicy::Correction;
use crate::optim::{AdamWConfig, Schedule};
use crate::queue::QueueConfig;
use crate::sft::SftSettings;
use crate::step::StepConfig;

// Settings added later are left out of a checkpoint's settings at their defaults, so that
// runs checkpointed before they existed resume unchanged.
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}
fn gspo_eps_low() -> f64 {
    GSPO_EPS_LOW
}
fn gspo_eps_high() -> f64 {
    GSPO_EPS_HIGH
}
fn is_gspo_eps_low(v: &f64) -> bool {
    *v == GSPO_EPS_LOW
}
fn is_gspo_eps_high(v: &f64) -> bool {
    *v == GSPO_EPS_HIGH
}
fn one() -> u32 {
    1
}
fn is_one(v: &u32) -> bool {
    *v == 1
}
fn is_cap() -> f64 {
    2.0
}
fn is_default_cap(v: &f64) -> bool {
    *v == is_cap()
}
/// The settings of [`TrainSettings`] a resumed run may change: the length of the run (the
/// learning-rate schedule stretches to the new total), how gradients are split into
/// micro-batches (the same sums), how long leases and stale groups are tolerated, and the
/// warm-up's, which a resumed run does not repeat.
pub const RESUMABLE: &[&str] = &[
    "steps",
    "micro_batch_groups",
    "lease_timeout",
    "max_version_lag",
    "sft_steps",
    "sft_batch_size",
    "sft_lr",
];

/// The settings that define a run; a resumed run must keep them, except [`RESUMABLE`].
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct TrainSettings {
    /// GRPO steps in total.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_STEPS",
        default_value_t = 100
    )]
    pub steps: u64,
    /// Prompts (groups) per step (P).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_PROMPTS_PER_STEP",
        default_value_t = 6
    )]
    pub prompts_per_step: usize,
    /// Completions per prompt (G).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_GROUP_SIZE",
        default_value_t = 8
    )]
    pub group_size: u32,
    /// Groups per forward/backward (gradients accumulate to the step's).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MICRO_BATCH_GROUPS",
        default_value_t = crate::loss::DEFAULT_MICRO_BATCH_GROUPS
    )]
    pub micro_batch_groups: usize,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_LR",
        default_value_t = 1e-3
    )]
    pub lr: f64,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MIN_LR",
        default_value_t = 1e-4
    )]
    pub min_lr: f64,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_WARMUP_STEPS",
        default_value_t = 5
    )]
    pub warmup_steps: u64,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_WEIGHT_DECAY",
        default_value_t = 0.0
    )]
    pub weight_decay: f64,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MAX_GRAD_NORM",
        default_value_t = 1.0
    )]
    pub max_grad_norm: f64,
    /// KL coefficient β (0: no reference forward). The local default run uses 0.01:
    /// a tiny model that must first learn the format.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_BETA",
        default_value_t = crate::loss::DEFAULT_BETA
    )]
    pub beta: f64,
    /// Clip ε, lower side.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_CLIP_EPS",
        default_value_t = 0.2
    )]
    pub clip_eps: f64,
    /// Clip ε, upper side.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_CLIP_EPS_HIGH",
        default_value_t = 0.2
    )]
    pub clip_eps_high: f64,
    /// What a group's centred rewards are divided by: its std (unbiased, population),
    /// the batch's std (batch), or nothing (none).
    #[arg(long, env = "LEARNER_ADVANTAGE_NORM", value_enum, default_value_t = AdvantageNorm::Unbiased)]
    pub advantage_norm: AdvantageNorm,
    /// How token terms become the loss: sequence (mean per completion, then mean), token
    /// (over the batch's tokens; DAPO), constant (sum / (completions × --max-new-tokens);
    /// Dr. GRPO).
    #[arg(long, env = "LEARNER_AGGREGATION", value_enum, default_value_t = Aggregation::Sequence)]
    pub aggregation: Aggregation,
    /// The policy-gradient term: clip (PPO/GRPO token ratios), gspo (sequence ratio),
    /// gspo-token, cispo (truncated, detached weights).
    #[arg(long, env = "LEARNER_POLICY_LOSS", value_enum, default_value_t = PolicyLoss::Clip)]
    #[serde(default, skip_serializing_if = "is_default")]
    pub policy_loss: PolicyLoss,
    /// GSPO's clip ε of the sequence ratio, lower side.
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_GSPO_EPS", default_value_t = GSPO_EPS_LOW)]
    #[serde(default = "gspo_eps_low", skip_serializing_if = "is_gspo_eps_low")]
    pub gspo_eps: f64,
    /// GSPO's clip ε of the sequence ratio, upper side.
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_GSPO_EPS_HIGH", default_value_t = GSPO_EPS_HIGH)]
    #[serde(default = "gspo_eps_high", skip_serializing_if = "is_gspo_eps_high")]
    pub gspo_eps_high: f64,
    /// Decoupled off-policy correction: off, or the clipped ratio against the proximal
    /// policy with each token weighted by π_prox/π_behaviour bounded by --is-cap —
    /// token-truncate, token-mask, sequence-truncate, sequence-mask. Stale groups (up to
    /// --max-version-lag) are then corrected rather than trained on as if fresh.
    #[arg(long, env = "LEARNER_OFF_POLICY_CORRECTION", value_enum, default_value_t = Correction::Off)]
    #[serde(default, skip_serializing_if = "is_default")]
    pub off_policy_correction: Correction,
    /// C, the bound of the importance weights (at least 1).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_IS_CAP",
        default_value_t = 2.0
    )]
    #[serde(default = "is_cap", skip_serializing_if = "is_default_cap")]
    pub is_cap: f64,
    /// Leave completions cut off at --max-new-tokens (no end-of-text) out of the loss
    /// (DAPO's overlong filtering); their rewards still shape their groups' advantages.
    #[arg(long, env = "LEARNER_MASK_TRUNCATED")]
    #[serde(default, skip_serializing_if = "is_default")]
    pub mask_truncated: bool,
    /// DAPO's dynamic sampling: groups without signal (equal rewards) are consumed and
    /// skipped as they arrive, and a step waits for P groups with signal.
    #[arg(long, env = "LEARNER_DYNAMIC_SAMPLING")]
    #[serde(default, skip_serializing_if = "is_default")]
    pub dynamic_sampling: bool,
    /// Optimizer updates on each step's batch (PPO epochs, μ); π_old stays the sampler's,
    /// and under --off-policy-correction the proximal policy is the learner's own before
    /// the first update. The weight version advances once per step.
    #[arg(long, env = "LEARNER_UPDATES_PER_BATCH", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub updates_per_batch: u32,
    /// Sampling temperature (the loss uses the same).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_TEMPERATURE",
        default_value_t = 1.0
    )]
    pub temperature: f64,
    /// Top-k (0: off).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_TOP_K",
        default_value_t = 0
    )]
    pub top_k: u32,
    /// Top-p (1: off).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_TOP_P",
        default_value_t = 1.0
    )]
    pub top_p: f64,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MAX_NEW_TOKENS",
        default_value_t = 64
    )]
    pub max_new_tokens: u32,
    /// Seed of the prompt generator and of the groups' sampling seeds.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_SEED",
        default_value_t = 0
    )]
    pub seed: u64,
    /// Fraction of policy-task (`P:`) prompts among generated ones.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_POLICY_FRACTION",
        default_value_t = 0.0
    )]
    pub policy_fraction: f64,
    /// Groups sampled more than this many weight versions behind are dropped (counted).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MAX_VERSION_LAG",
        default_value_t = 2
    )]
    pub max_version_lag: u64,
    /// Seconds a worker has to submit a leased prompt before it is re-issued.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_LEASE_TIMEOUT",
        default_value_t = 300.0
    )]
    pub lease_timeout: f64,
    /// Supervised warm-up steps before GRPO (0: none), on generated documents.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_SFT_STEPS",
        default_value_t = 250
    )]
    pub sft_steps: u64,
    /// Documents per warm-up step.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_SFT_BATCH_SIZE",
        default_value_t = 16
    )]
    pub sft_batch_size: usize,
    /// Warm-up learning rate (peak).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_SFT_LR",
        default_value_t = 3e-3
    )]
    pub sft_lr: f64,
}

impl TrainSettings {
    /// Checks ranges so that a bad value is one clear line, not a failure mid-run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_proto::check::{at_least, fraction, non_negative, positive};
        self.step_config().loss.validate().map_err(ConfigError)?;
        let checks = [
            at_least("--steps", self.steps, 1),
            at_least("--prompts-per-step", self.prompts_per_step as u64, 1),
            at_least("--group-size", self.group_size.into(), 2),
            at_least("--micro-batch-groups", self.micro_batch_groups as u64, 1),
            at_least("--sft-batch-size", self.sft_batch_size as u64, 1),
            at_least("--max-new-tokens", self.max_new_tokens.into(), 1),
            positive("--lr", self.lr),
            positive("--sft-lr", self.sft_lr),
            positive("--lease-timeout", self.lease_timeout),
            non_negative("--min-lr", self.min_lr),
            non_negative("--weight-decay", self.weight_decay),
            non_negative("--max-grad-norm", self.max_grad_norm),
            fraction("--policy-fraction", self.policy_fraction),
            rookworld_lm::sampling::check_top_p("--top-p", self.top_p),
        ];
        checks
            .into_iter()
            .collect::<Result<(), _>>()
            .map_err(ConfigError)
    }

    pub fn step_config(&self) -> StepConfig {
        StepConfig {
            loss: LossConfig {
                beta: self.beta,
                eps_low: self.clip_eps,
                eps_high: self.clip_eps_high,
                temperature: self.temperature,
                advantage_norm: self.advantage_norm,
                aggregation: self.aggregation,
                policy_loss: self.policy_loss,
                gspo_eps_low: self.gspo_eps,
                gspo_eps_high: self.gspo_eps_high,
                max_new_tokens: self.max_new_tokens as usize,
                correction: self.off_policy_correction,
                is_cap: self.is_cap,
                mask_truncated: self.mask_truncated,
            },
            micro_batch_groups: self.micro_batch_groups,
            max_grad_norm: self.max_grad_norm,
        }
    }

    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            weight_decay: self.weight_decay,
            ..AdamWConfig::default()
        }
    }

    pub fn schedule(&self) -> Schedule {
        Schedule {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.steps,
        }
    }

    /// The queue holds a few steps of prompts ahead and stops leasing when a step's worth
    /// of scored groups waits: workers stay about one version behind, not more (a deeper
    /// buffer only ages the groups until they are dropped as stale).
    pub fn queue_config(&self) -> QueueConfig {
        let p = self.prompts_per_step;
        QueueConfig {
            max_pending: (4 * p).max(16),
            max_scored: p,
            max_leased: (4 * p).max(16),
            lease_timeout: Duration::from_secs_f64(self.lease_timeout),
            max_version_lag: self.max_version_lag,
            ..QueueConfig::default()
        }
    }

    pub fn sampling(&self) -> rookworld_proto::v1::SamplingParams {
        rookworld_proto::v1::SamplingParams {
            temperature: self.temperature as f32,
            top_k: self.top_k,
            top_p: self.top_p as f32,
            max_new_tokens: self.max_new_tokens,
            seed: 0,
        }
    }

    /// The supervised warm-up's settings (environment and, with an engine, policy lines).
    pub fn warm_up(&self) -> SftSettings {
        SftSettings {
            steps: self.sft_steps,
            batch_size: self.sft_batch_size,
            micro_batch_size: self.sft_batch_size,
            lr: self.sft_lr,
            min_lr: self.sft_lr / 10.0,
            warmup_steps: (self.sft_steps / 20).max(1),
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            seed: self.seed ^ 0x5f7,
            policy_fraction: self.policy_fraction,
            completion_only: true,
        }
    }
}
