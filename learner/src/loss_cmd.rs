//! `learner loss`: the GRPO loss, its parts and the gradient norm of one batch, computed by
//! the code training uses, printed as JSON.

use std::path::PathBuf;

use candle_core::{DType, Device};
use rookworld_lm::model_io;

use rookworld_lm::cli::{DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE};
use rookworld_train::batch::GrpoBatch;

use crate::settings::ObjectiveArgs;
use rookworld_train::grpo::group_advantages;
use rookworld_train::loss::{LossConfig, LossReport};
use rookworld_train::policy::Trainable;
use rookworld_train::step::{StepConfig, accumulate};

/// Options of `learner loss`.
#[derive(Debug, Clone, clap::Args)]
pub struct LossArgs {
    /// Policy checkpoint (Hugging Face layout).
    #[arg(long)]
    pub policy: PathBuf,
    /// Frozen reference checkpoint (not read when --beta is 0).
    #[arg(long)]
    pub reference: PathBuf,
    /// JSON batch: {"prompts", "completions", "rewards", "old_logprobs"?}.
    #[arg(long)]
    pub batch: PathBuf,
    #[command(flatten)]
    pub objective: ObjectiveArgs,
    /// The temperature the completions were sampled at (log-probs are computed at it).
    #[arg(long, allow_negative_numbers = true, env = "ROOKWORLD_TEMPERATURE", default_value_t = DEFAULT_TEMPERATURE)]
    pub temperature: f64,
    /// The completions' token budget (`--aggregation constant` divides by it).
    #[arg(long, allow_negative_numbers = true, env = "ROOKWORLD_MAX_NEW_TOKENS", default_value_t = DEFAULT_MAX_NEW_TOKENS)]
    pub max_new_tokens: u32,
}

/// Why `learner loss` failed.
#[derive(Debug, thiserror::Error)]
pub enum LossCmdError {
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Batch(#[from] rookworld_train::batch::BatchError),
    #[error(transparent)]
    Config(#[from] crate::settings::ConfigError),
    #[error("--batch {}: {source}", path.display())]
    BatchFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--batch {}: {source}", path.display())]
    BatchJson {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("--policy and --reference are different models: {policy} vs {reference}")]
    DifferentModels { policy: String, reference: String },
}

impl From<candle_core::Error> for LossCmdError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

impl LossArgs {
    /// The objective at the batch's temperature and token budget, checked with the rules
    /// `train` applies.
    pub fn config(&self) -> Result<LossConfig, LossCmdError> {
        self.objective
            .loss_config(self.temperature, self.max_new_tokens)
            .map_err(LossCmdError::Config)
    }
}

/// Computes the report of `batch` under `policy` (gradients included), with the code a
/// training step runs ([`rookworld_train::step::accumulate`], the whole batch as one micro-batch).
pub fn evaluate(
    policy: &Trainable,
    reference: Option<&rookworld_lm::Gpt2>,
    batch: &GrpoBatch,
    cfg: &LossConfig,
) -> Result<LossReport, LossCmdError> {
    let model_cfg = policy.model.config();
    batch.validate(model_cfg.vocab_size, model_cfg.n_positions)?;
    let step = StepConfig {
        loss: *cfg,
        micro_batch_groups: batch.prompts.len(),
        max_grad_norm: f64::INFINITY,
    };
    let (grads, report) = accumulate(policy, reference, batch, &step)?;
    let scale = cfg.advantage_norm.scale(&batch.rewards);
    let advantages = batch
        .rewards
        .iter()
        .filter_map(|r| group_advantages(r, scale))
        .collect();
    Ok(LossReport {
        loss: report.loss,
        policy_loss: report.policy_loss,
        kl: report.kl,
        grad_norm: grads.global_norm(policy.model.kernels())?,
        advantages,
        clip_frac: report.clip_frac,
        clip_low: report.clip_low,
        clip_high: report.clip_high,
        mismatch: report.mismatch,
        entropy: report.entropy,
        skipped_groups: report.skipped_groups,
        tokens: report.tokens,
    })
}

/// Runs the command, printing one JSON object.
pub fn run(args: &LossArgs) -> Result<(), LossCmdError> {
    let cfg = args.config()?;
    let path = || args.batch.clone();
    let text = std::fs::read_to_string(&args.batch).map_err(|source| LossCmdError::BatchFile {
        path: path(),
        source,
    })?;
    let batch: GrpoBatch =
        serde_json::from_str(&text).map_err(|source| LossCmdError::BatchJson {
            path: path(),
            source,
        })?;
    let device = Device::Cpu;
    let policy = Trainable::load(&args.policy, &device)?;
    let reference = if cfg.beta > 0.0 {
        Some(model_io::load(&args.reference, DType::F32, &device)?)
    } else {
        None
    };
    if let Some(r) = &reference {
        let shape = |c: &rookworld_lm::Config| {
            format!(
                "vocab {} context {} width {} layers {} heads {}",
                c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head
            )
        };
        let (p, r) = (shape(policy.model.config()), shape(r.config()));
        if p != r {
            return Err(LossCmdError::DifferentModels {
                policy: p,
                reference: r,
            });
        }
    }
    let report = evaluate(&policy, reference.as_ref(), &batch, &cfg)?;
    println!(
        "{}",
        serde_json::to_string(&report).expect("report serialises")
    );
    Ok(())
}
