//! `learner loss`: the GRPO loss, its parts and the gradient norm of one batch, computed by
//! the code training uses, printed as JSON.

use std::path::PathBuf;

use candle_core::{DType, Device};
use rookworld_lm::checkpoint;

use crate::batch::GrpoBatch;
use crate::grpo::{AdvantageNorm, Aggregation, PolicyLoss, group_advantages};
use crate::loss::{GSPO_EPS_HIGH, GSPO_EPS_LOW, LossConfig, LossReport};
use crate::offpolicy::Correction;
use crate::policy::Trainable;
use crate::step::{StepConfig, accumulate};

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
    /// KL coefficient β.
    #[arg(long, allow_negative_numbers = true, default_value_t = crate::loss::DEFAULT_BETA)]
    pub beta: f64,
    /// Clip ε on both sides (see --clip-eps-high for an asymmetric upper side).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.2)]
    pub clip_eps: f64,
    /// Upper clip ε (default: --clip-eps).
    #[arg(long, allow_negative_numbers = true)]
    pub clip_eps_high: Option<f64>,
    /// Sampling temperature of the completions.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub temperature: f64,
    /// What a group's centred rewards are divided by: its std (unbiased, population),
    /// the batch's std, or nothing.
    #[arg(long, value_enum, default_value_t = AdvantageNorm::Unbiased)]
    pub advantage_norm: AdvantageNorm,
    /// How token terms become the loss: per sequence then mean, over the batch's tokens
    /// (DAPO), or summed over a constant (Dr. GRPO: completions × --max-new-tokens).
    #[arg(long, value_enum, default_value_t = Aggregation::Sequence)]
    pub aggregation: Aggregation,
    /// The policy-gradient term: clip (PPO/GRPO), gspo, gspo-token, cispo.
    #[arg(long, value_enum, default_value_t = PolicyLoss::Clip)]
    pub policy_loss: PolicyLoss,
    /// GSPO's lower clip ε of the sequence ratio.
    #[arg(long, allow_negative_numbers = true, default_value_t = GSPO_EPS_LOW)]
    pub gspo_eps: f64,
    /// GSPO's upper clip ε of the sequence ratio.
    #[arg(long, allow_negative_numbers = true, default_value_t = GSPO_EPS_HIGH)]
    pub gspo_eps_high: f64,
    /// Decoupled off-policy correction: off, or the importance weights π_prox/π_behaviour
    /// truncated or masked above --is-cap, per token or per sequence.
    #[arg(long, value_enum, default_value_t = Correction::Off)]
    pub off_policy_correction: Correction,
    /// C, the bound of the importance weights.
    #[arg(long, allow_negative_numbers = true, default_value_t = 2.0)]
    pub is_cap: f64,
    /// Leave completions that end without end-of-text (cut off at the token budget) out
    /// of the loss.
    #[arg(long)]
    pub mask_truncated: bool,
    /// The completions' token budget (`--aggregation constant` divides by it).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
}

/// Why `learner loss` failed.
#[derive(Debug, thiserror::Error)]
pub enum LossCmdError {
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Batch(#[from] crate::batch::BatchError),
    #[error("{0}")]
    Input(String),
}

impl From<candle_core::Error> for LossCmdError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

impl LossArgs {
    pub fn config(&self) -> Result<LossConfig, LossCmdError> {
        let cfg = LossConfig {
            beta: self.beta,
            eps_low: self.clip_eps,
            eps_high: self.clip_eps_high.unwrap_or(self.clip_eps),
            temperature: self.temperature,
            advantage_norm: self.advantage_norm,
            aggregation: self.aggregation,
            policy_loss: self.policy_loss,
            gspo_eps_low: self.gspo_eps,
            gspo_eps_high: self.gspo_eps_high,
            max_new_tokens: self.max_new_tokens,
            correction: self.off_policy_correction,
            is_cap: self.is_cap,
            mask_truncated: self.mask_truncated,
        };
        cfg.validate().map_err(LossCmdError::Input)?;
        Ok(cfg)
    }
}

/// Computes the report of `batch` under `policy` (gradients included), with the code a
/// training step runs ([`crate::step::accumulate`], the whole batch as one micro-batch).
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
        grad_norm: grads.global_norm()?,
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
    let text = std::fs::read_to_string(&args.batch)
        .map_err(|e| LossCmdError::Input(format!("--batch {}: {e}", args.batch.display())))?;
    let batch: GrpoBatch = serde_json::from_str(&text)
        .map_err(|e| LossCmdError::Input(format!("--batch {}: {e}", args.batch.display())))?;
    let device = Device::Cpu;
    let policy = Trainable::load(&args.policy, &device)?;
    let reference = if cfg.beta > 0.0 {
        Some(checkpoint::load(&args.reference, DType::F32, &device)?)
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
            return Err(LossCmdError::Input(format!(
                "--policy and --reference are different models: {p} vs {r}"
            )));
        }
    }
    let report = evaluate(&policy, reference.as_ref(), &batch, &cfg)?;
    println!(
        "{}",
        serde_json::to_string(&report).expect("report serialises")
    );
    Ok(())
}
