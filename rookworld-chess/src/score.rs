//! A reward with its named components, its verdict, and the configurable weights.
//!
//! Range: a malformed completion scores [`MIN_REWARD`] (−1). Any well-formed completion
//! scores the weighted mean of its components, each in [0, 1], so it lies in [0, 1] and
//! reaches [`MAX_REWARD`] (1) exactly when every component is 1. The gap between −1 and
//! 0 makes "follow the format" the first thing a policy learns; partial credit inside
//! [0, 1] keeps a group's rewards apart (GRPO learns nothing from a group whose
//! rewards are all equal).

use serde::{Deserialize, Serialize};

/// Reward of a malformed completion.
pub const MIN_REWARD: f64 = -1.0;
/// Reward of a completion whose every component is right.
pub const MAX_REWARD: f64 = 1.0;

/// How a completion fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Exact,
    Partial,
    Malformed,
}

impl Verdict {
    pub fn label(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Partial => "partial",
            Self::Malformed => "malformed",
        }
    }
}

/// Why a completion is malformed: a bounded set (metric label) plus detail text.
#[derive(Debug, Clone, PartialEq)]
pub struct Malformed {
    /// Stable label, e.g. `field_count`, `missing_marker`.
    pub kind: &'static str,
    /// Human-readable detail.
    pub detail: String,
}

/// The score of one completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    pub reward: f64,
    pub verdict: Verdict,
    /// Named components in [0, 1], in a fixed order per task.
    pub components: Vec<(&'static str, f64)>,
    /// Set when the verdict is [`Verdict::Malformed`].
    pub malformed: Option<Malformed>,
    /// True when a UCI engine graded move quality.
    pub engine_graded: bool,
}

impl Score {
    /// The minimum reward, with the reason.
    pub fn malformed(kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            reward: MIN_REWARD,
            verdict: Verdict::Malformed,
            components: vec![("format", 0.0)],
            malformed: Some(Malformed {
                kind,
                detail: detail.into(),
            }),
            engine_graded: false,
        }
    }

    /// reward = Σ wᵢ·cᵢ / Σ wᵢ over the weighted components; components without a weight
    /// are reported but not counted. Exact when every weighted component is 1.
    pub fn weighted(
        components: Vec<(&'static str, f64)>,
        weights: &[(&'static str, f64)],
        engine_graded: bool,
    ) -> Self {
        let mut total = 0.0;
        let mut sum = 0.0;
        let mut exact = true;
        for (name, w) in weights {
            let c = components
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, c)| *c);
            debug_assert!((0.0..=1.0).contains(&c), "{name} = {c}");
            total += w;
            sum += w * c;
            exact &= c >= 1.0;
        }
        let reward = if total > 0.0 { sum / total } else { 0.0 };
        Self {
            reward: if exact {
                MAX_REWARD
            } else {
                reward.clamp(0.0, MAX_REWARD)
            },
            verdict: if exact {
                Verdict::Exact
            } else {
                Verdict::Partial
            },
            components,
            malformed: None,
            engine_graded,
        }
    }

    /// Metric label: `exact`, `partial`, or the malformed kind.
    pub fn reason_label(&self) -> &'static str {
        self.malformed
            .as_ref()
            .map_or(self.verdict.label(), |m| m.kind)
    }
}

/// Weights of the environment task's components (see the README for the reasoning).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvWeights {
    pub placement: f64,
    pub side: f64,
    pub castling: f64,
    pub en_passant: f64,
    pub halfmove: f64,
    pub fullmove: f64,
    pub reward: f64,
    pub terminated: f64,
    pub truncated: f64,
}

impl Default for EnvWeights {
    fn default() -> Self {
        Self {
            placement: 0.40,
            side: 0.05,
            castling: 0.05,
            en_passant: 0.05,
            halfmove: 0.05,
            fullmove: 0.05,
            reward: 0.15,
            terminated: 0.10,
            truncated: 0.10,
        }
    }
}

impl EnvWeights {
    pub fn table(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("placement", self.placement),
            ("side", self.side),
            ("castling", self.castling),
            ("en_passant", self.en_passant),
            ("halfmove", self.halfmove),
            ("fullmove", self.fullmove),
            ("reward", self.reward),
            ("terminated", self.terminated),
            ("truncated", self.truncated),
        ]
    }
}

/// Weights of the policy task's components. Without an engine only `format`,
/// `candidates_legal` and `best_legal` count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyWeights {
    pub format: f64,
    pub candidates_legal: f64,
    pub best_legal: f64,
    pub best_rank: f64,
    pub candidate_overlap: f64,
    pub eval_accuracy: f64,
    /// Eval error (pawns) at which `eval_accuracy` falls to 1/e.
    pub eval_scale_pawns: f64,
    /// Evals are clipped to ±this many pawns before comparing (mates are ±999.9).
    pub eval_clip_pawns: f64,
}

impl Default for PolicyWeights {
    fn default() -> Self {
        Self {
            format: 0.10,
            candidates_legal: 0.15,
            best_legal: 0.15,
            best_rank: 0.35,
            candidate_overlap: 0.15,
            eval_accuracy: 0.10,
            eval_scale_pawns: 1.0,
            eval_clip_pawns: 15.0,
        }
    }
}

impl PolicyWeights {
    pub fn table(&self, engine: bool) -> Vec<(&'static str, f64)> {
        let mut t = vec![
            ("format", self.format),
            ("candidates_legal", self.candidates_legal),
            ("best_legal", self.best_legal),
        ];
        if engine {
            t.extend([
                ("best_rank", self.best_rank),
                ("candidate_overlap", self.candidate_overlap),
                ("eval_accuracy", self.eval_accuracy),
            ]);
        }
        t
    }
}

/// All scoring weights; loadable from a JSON file (`--weights FILE`), missing keys default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    pub environment: EnvWeights,
    pub policy: PolicyWeights,
}

impl RewardConfig {
    /// Rejects negative or non-finite weights and an all-zero table.
    pub fn validate(&self) -> Result<(), String> {
        let env = self.environment.table();
        let pol = self.policy.table(true);
        for (name, w) in env.iter().chain(&pol) {
            if !w.is_finite() || *w < 0.0 {
                return Err(format!(
                    "weight `{name}` must be a finite number ≥ 0, got {w}"
                ));
            }
        }
        if env.iter().all(|(_, w)| *w == 0.0)
            || self.policy.table(false).iter().all(|(_, w)| *w == 0.0)
        {
            return Err("every task needs at least one positive weight".into());
        }
        for (name, v) in [
            ("eval_scale_pawns", self.policy.eval_scale_pawns),
            ("eval_clip_pawns", self.policy.eval_clip_pawns),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("`{name}` must be positive, got {v}"));
            }
        }
        Ok(())
    }
}
