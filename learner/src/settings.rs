//! The settings the learner's commands share, one type per concept so that a default or a
//! rule cannot differ between commands: the objective ([`ObjectiveArgs`]: `train`, `loss`,
//! `bench`) and the shape of a step's batch ([`BatchArgs`]: `train`, `bench`). Sampling
//! is [`rookworld_lm::cli::SamplingArgs`], shared with the rollout worker.
//!
//! Both are also serialised into `learner train`'s checkpoints (flat keys, as the flags
//! are named); a setting added after runs were checkpointed is left out at its default
//! so that those runs resume unchanged.

use serde::{Deserialize, Serialize};

use rookworld_train::choice::Choice;

use rookworld_train::grpo::{AdvantageNorm, Aggregation, PolicyLoss};
use rookworld_train::loss::{
    DEFAULT_BETA, DEFAULT_CLIP_EPS, DEFAULT_IS_CAP, GSPO_EPS_HIGH, GSPO_EPS_LOW, LossConfig,
};
use rookworld_train::offpolicy::Correction;

/// Groups per micro-batch that `auto` picks on a GPU: the composed step's time falls up
/// to eight groups at 32 × 8 × (46 + 64) and no further on an H200 (1.37 s at one, 0.85 s
/// at four, 0.80 s at eight, 0.79 s at sixteen).
pub const GPU_MICRO_BATCH_GROUPS: usize = 8;

/// The command line's parser of a [`Choice`]: its names are the possible values.
pub fn choice<T: Choice + Clone>() -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(T::NAMES.iter().map(|&(_, name)| name))
        .try_map(|name: String| T::named(&name).ok_or("not one of the possible values"))
}

pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
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
fn is_cap() -> f64 {
    DEFAULT_IS_CAP
}
fn is_default_cap(v: &f64) -> bool {
    *v == DEFAULT_IS_CAP
}

/// The objective: what the policy-gradient term is, how advantages are normalised and
/// token terms aggregated, the KL term and the off-policy correction.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct ObjectiveArgs {
    /// KL coefficient β (0: no reference forward).
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_BETA", default_value_t = DEFAULT_BETA)]
    pub beta: f64,
    /// Clip ε of the token ratio, lower side.
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_CLIP_EPS", default_value_t = DEFAULT_CLIP_EPS)]
    pub clip_eps: f64,
    /// Clip ε of the token ratio, upper side (DAPO's clip-higher raises it).
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_CLIP_EPS_HIGH", default_value_t = DEFAULT_CLIP_EPS)]
    pub clip_eps_high: f64,
    /// What a group's centred rewards are divided by: its std (unbiased, population),
    /// the batch's std (batch), or nothing (none).
    #[arg(long, env = "LEARNER_ADVANTAGE_NORM", value_parser = choice::<AdvantageNorm>(), default_value = AdvantageNorm::Unbiased.name())]
    pub advantage_norm: AdvantageNorm,
    /// How token terms become the loss: sequence (mean per completion, then mean), token
    /// (over the batch's tokens; DAPO), constant (sum / (completions × --max-new-tokens);
    /// Dr. GRPO).
    #[arg(long, env = "LEARNER_AGGREGATION", value_parser = choice::<Aggregation>(), default_value = Aggregation::Sequence.name())]
    pub aggregation: Aggregation,
    /// The policy-gradient term: clip (PPO/GRPO token ratios), gspo (sequence ratio),
    /// gspo-token, cispo (truncated, detached weights).
    #[arg(long, env = "LEARNER_POLICY_LOSS", value_parser = choice::<PolicyLoss>(), default_value = PolicyLoss::Clip.name())]
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
    #[arg(long, env = "LEARNER_OFF_POLICY_CORRECTION", value_parser = choice::<Correction>(), default_value = Correction::Off.name())]
    #[serde(default, skip_serializing_if = "is_default")]
    pub off_policy_correction: Correction,
    /// C, the bound of the importance weights (at least 1).
    #[arg(long, allow_negative_numbers = true, env = "LEARNER_IS_CAP", default_value_t = DEFAULT_IS_CAP)]
    #[serde(default = "is_cap", skip_serializing_if = "is_default_cap")]
    pub is_cap: f64,
    /// Leave completions cut off at --max-new-tokens (no end-of-text) out of the loss
    /// (DAPO's overlong filtering); their rewards still shape their groups' advantages.
    #[arg(long, env = "LEARNER_MASK_TRUNCATED")]
    #[serde(default, skip_serializing_if = "is_default")]
    pub mask_truncated: bool,
}

impl Default for ObjectiveArgs {
    fn default() -> Self {
        Self {
            beta: DEFAULT_BETA,
            clip_eps: DEFAULT_CLIP_EPS,
            clip_eps_high: DEFAULT_CLIP_EPS,
            advantage_norm: AdvantageNorm::Unbiased,
            aggregation: Aggregation::Sequence,
            policy_loss: PolicyLoss::Clip,
            gspo_eps: GSPO_EPS_LOW,
            gspo_eps_high: GSPO_EPS_HIGH,
            off_policy_correction: Correction::Off,
            is_cap: DEFAULT_IS_CAP,
            mask_truncated: false,
        }
    }
}

/// A setting out of its range, or settings that contradict each other: one line naming
/// the flag (the rule lives beside the setting, [`rookworld_service::validate`]).
pub use rookworld_service::validate::ConfigError;

impl ObjectiveArgs {
    /// The loss configuration of completions sampled at `temperature` with a budget of
    /// `max_new_tokens`, checked ([`check_loss`]).
    pub fn loss_config(
        &self,
        temperature: f64,
        max_new_tokens: u32,
    ) -> Result<LossConfig, ConfigError> {
        let cfg = self.loss_config_unchecked(temperature, max_new_tokens);
        check_loss(&cfg)?;
        Ok(cfg)
    }

    /// [`Self::loss_config`] without the range checks.
    pub fn loss_config_unchecked(&self, temperature: f64, max_new_tokens: u32) -> LossConfig {
        LossConfig {
            beta: self.beta,
            eps_low: self.clip_eps,
            eps_high: self.clip_eps_high,
            temperature,
            advantage_norm: self.advantage_norm,
            aggregation: self.aggregation,
            policy_loss: self.policy_loss,
            gspo_eps_low: self.gspo_eps,
            gspo_eps_high: self.gspo_eps_high,
            max_new_tokens: max_new_tokens as usize,
            correction: self.off_policy_correction,
            is_cap: self.is_cap,
            mask_truncated: self.mask_truncated,
        }
    }
}

/// The objective's ranges, one rule per flag for `train`, `loss` and `bench`: β ≥ 0,
/// both clip ε in [0, 1], temperature > 0.
pub fn check_loss(cfg: &LossConfig) -> Result<(), ConfigError> {
    use rookworld_service::validate::{fraction, non_negative};
    non_negative("--beta", cfg.beta)?;
    fraction("--clip-eps", cfg.eps_low)?;
    fraction("--clip-eps-high", cfg.eps_high)?;
    fraction("--gspo-eps", cfg.gspo_eps_low)?;
    fraction("--gspo-eps-high", cfg.gspo_eps_high)?;
    if cfg.is_cap.is_nan() || cfg.is_cap < 1.0 {
        return Err(ConfigError::OutOfRange {
            flag: "--is-cap".into(),
            rule: "be ≥ 1".into(),
            value: cfg.is_cap.to_string(),
        });
    }
    if cfg.aggregation == Aggregation::Constant && cfg.max_new_tokens == 0 {
        return Err(ConfigError::Conflict(
            "--aggregation constant divides by --max-new-tokens: give one above 0".into(),
        ));
    }
    rookworld_lm::sampling::check_temperature("--temperature", cfg.temperature)
        .map_err(ConfigError::Value)?;
    if cfg.temperature == 0.0 {
        return Err(ConfigError::Conflict("--temperature 0 is greedy: every completion of a group would be the same, with no advantage to learn from; GRPO needs a temperature > 0".into()));
    }
    Ok(())
}

/// The shape of a step's batch: P prompts (groups) of G completions, split into
/// micro-batches of groups whose gradients accumulate to the step's.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct BatchArgs {
    /// Prompts (groups) per step (P).
    #[arg(
        long,
        short = 'p',
        allow_negative_numbers = true,
        env = "LEARNER_PROMPTS_PER_STEP",
        default_value_t = 6
    )]
    pub prompts_per_step: usize,
    /// Completions per prompt (G, at least 2: advantages compare a group's completions).
    #[arg(
        long,
        short = 'n',
        allow_negative_numbers = true,
        env = "LEARNER_GROUP_SIZE",
        default_value_t = 8
    )]
    pub group_size: u32,
    /// Groups per forward/backward (gradients accumulate to the step's): a count, or
    /// `auto` (1 on the CPU, 8 on a GPU).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_MICRO_BATCH_GROUPS",
        default_value_t = MicroBatchGroups::Auto
    )]
    pub micro_batch_groups: MicroBatchGroups,
}

/// How many groups one forward/backward takes. The step's gradient is the same sum
/// whatever the split ([`rookworld_train::step::accumulate`]); the split sets the memory the
/// activations take and how full each product is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "MicroBatchRepr", into = "MicroBatchRepr")]
pub enum MicroBatchGroups {
    /// By device: one group on the CPU, where a group's rows (G × (prompt + completion),
    /// 880 at 8 × (46 + 64)) already keep the products at full speed and every further
    /// group adds its activations (about 280 MB for gpt2-124m at that shape);
    /// [`GPU_MICRO_BATCH_GROUPS`] on a GPU, where products need many rows to fill it.
    Auto,
    /// This many groups (at least 1).
    Groups(usize),
}

impl MicroBatchGroups {
    /// The groups per micro-batch on `device`.
    pub fn resolve(self, device: &candle_core::Device) -> usize {
        match self {
            Self::Groups(n) => n,
            Self::Auto if device.is_cpu() => 1,
            Self::Auto => GPU_MICRO_BATCH_GROUPS,
        }
    }
}

impl std::fmt::Display for MicroBatchGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Groups(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for MicroBatchGroups {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            n => n
                .parse()
                .map(Self::Groups)
                .map_err(|_| format!("expected a count of groups or `auto`, got `{s}`")),
        }
    }
}

/// As a checkpoint stores it: a number (every checkpoint before `auto` existed) or
/// `"auto"`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum MicroBatchRepr {
    Groups(usize),
    Word(String),
}

impl TryFrom<MicroBatchRepr> for MicroBatchGroups {
    type Error = String;

    fn try_from(r: MicroBatchRepr) -> Result<Self, Self::Error> {
        match r {
            MicroBatchRepr::Groups(n) => Ok(Self::Groups(n)),
            MicroBatchRepr::Word(w) => w.parse(),
        }
    }
}

impl From<MicroBatchGroups> for MicroBatchRepr {
    fn from(m: MicroBatchGroups) -> Self {
        match m {
            MicroBatchGroups::Auto => Self::Word("auto".into()),
            MicroBatchGroups::Groups(n) => Self::Groups(n),
        }
    }
}

impl BatchArgs {
    /// Every count at least 1, groups at least 2.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_service::validate::at_least;
        at_least("--prompts-per-step", self.prompts_per_step as u64, 1)?;
        at_least("--group-size", self.group_size.into(), 2)?;
        match self.micro_batch_groups {
            MicroBatchGroups::Groups(n) => at_least("--micro-batch-groups", n as u64, 1),
            MicroBatchGroups::Auto => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batch_groups_are_a_count_or_auto_resolved_by_device() {
        assert_eq!("auto".parse(), Ok(MicroBatchGroups::Auto));
        assert_eq!("3".parse(), Ok(MicroBatchGroups::Groups(3)));
        let err = "four".parse::<MicroBatchGroups>().unwrap_err();
        assert!(err.contains("`auto`") && err.contains("`four`"), "{err}");
        assert_eq!(MicroBatchGroups::Auto.to_string(), "auto");
        assert_eq!(MicroBatchGroups::Groups(5).to_string(), "5");
        let cpu = candle_core::Device::Cpu;
        assert_eq!(MicroBatchGroups::Auto.resolve(&cpu), 1);
        assert_eq!(MicroBatchGroups::Groups(5).resolve(&cpu), 5);
    }

    #[test]
    fn a_checkpoint_s_count_of_groups_reads_back_and_auto_is_stored_as_a_word() {
        #[derive(Serialize, Deserialize)]
        struct S {
            m: MicroBatchGroups,
        }
        // Checkpoints written before `auto` existed hold a number.
        let old: S = serde_json::from_str(r#"{"m":4}"#).unwrap();
        assert_eq!(old.m, MicroBatchGroups::Groups(4));
        let auto = serde_json::to_string(&S {
            m: MicroBatchGroups::Auto,
        })
        .unwrap();
        assert_eq!(auto, r#"{"m":"auto"}"#);
        let back: S = serde_json::from_str(&auto).unwrap();
        assert_eq!(back.m, MicroBatchGroups::Auto);
        assert!(serde_json::from_str::<S>(r#"{"m":"many"}"#).is_err());
    }
}
