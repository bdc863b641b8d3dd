//! The settings that define a run of `learner train`: kept in its checkpoints and
//! checked on resume (all but [`RESUMABLE`]), with their ranges and what they become
//! (loss, step, queue, schedule, warm-up configurations).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::settings::ConfigError;
use rookworld_lm::cli::SamplingArgs;

use crate::queue::QueueConfig;
use crate::settings::{BatchArgs, ObjectiveArgs, is_default};
use crate::sft::SftSettings;
use rookworld_train::optim::{AdamWConfig, Schedule};
use rookworld_train::step::StepConfig;

// Settings added later are left out of a checkpoint's settings at their defaults, so that
// runs checkpointed before they existed resume unchanged.
fn one() -> u32 {
    1
}
fn is_one(v: &u32) -> bool {
    *v == 1
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
    #[command(flatten)]
    #[serde(flatten)]
    pub batch: BatchArgs,
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
    #[command(flatten)]
    #[serde(flatten)]
    pub objective: ObjectiveArgs,
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
    /// How the workers sample (the loss computes log-probs at the same temperature).
    #[command(flatten)]
    #[serde(flatten)]
    pub sampling: SamplingArgs,
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
    /// Tokens sampled more than this many weight versions behind are left out of the loss
    /// (counted); a group whose every token is, is dropped (counted).
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
        use rookworld_service::validate::{at_least, fraction, non_negative, positive};
        self.sampling.validate().map_err(ConfigError::Value)?;
        self.batch.validate()?;
        self.loss_config()?;
        let checks = [
            at_least("--steps", self.steps, 1),
            at_least("--sft-batch-size", self.sft_batch_size as u64, 1),
            positive("--lr", self.lr),
            positive("--sft-lr", self.sft_lr),
            positive("--lease-timeout", self.lease_timeout),
            non_negative("--min-lr", self.min_lr),
            non_negative("--weight-decay", self.weight_decay),
            non_negative("--max-grad-norm", self.max_grad_norm),
            fraction("--policy-fraction", self.policy_fraction),
        ];
        checks.into_iter().collect::<Result<(), _>>()?;
        if self.min_lr > self.lr {
            return Err(ConfigError::Value(format!(
                "--min-lr {} is above --lr {}: the cosine schedule would raise the rate over \
                 the run; give --min-lr at most --lr (equal for a constant rate)",
                self.min_lr, self.lr
            )));
        }
        Ok(())
    }

    /// The objective at the workers' temperature and token budget, checked.
    pub fn loss_config(&self) -> Result<rookworld_train::loss::LossConfig, ConfigError> {
        self.objective
            .loss_config(self.sampling.temperature, self.sampling.max_new_tokens)
    }

    /// The step's configuration for a policy on `device` (which resolves
    /// `--micro-batch-groups auto`).
    pub fn step_config(&self, device: &candle_core::Device) -> StepConfig {
        StepConfig {
            loss: self
                .objective
                .loss_config_unchecked(self.sampling.temperature, self.sampling.max_new_tokens),
            micro_batch_groups: self.batch.micro_batch_groups.resolve(device),
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
        let p = self.batch.prompts_per_step;
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
            temperature: self.sampling.temperature as f32,
            top_k: self.sampling.top_k,
            top_p: self.sampling.top_p as f32,
            max_new_tokens: self.sampling.max_new_tokens,
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
