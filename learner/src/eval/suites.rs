//! The evaluation suites: their items (a prompt and what is true of it) and the grading
//! of one completion, with the reward server's own code (shakmaty underneath).

use std::path::Path;

use rookworld_chess::env_task::{EnvTruth, score_against};
use rookworld_chess::policy_task;
use rookworld_chess::score::{EnvWeights, PolicyWeights, Verdict};
use rookworld_chess::task::{EnvPrompt, PolicyPrompt};
use shakmaty::{Chess, Position};

use super::error::{EvalError, Malformed};
use crate::prompts::{policy_prompt, split_line};
use crate::settings::ConfigError;

/// The suites, by their command-line names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// BIG-bench checkmate-in-one as `P:` prompts: solved when `B:` mates.
    CheckmateInOne,
    /// Held-out RookWorld `P:` lines: the best move against Stockfish's ranking.
    Policy,
    /// Held-out `A:` prompts: the next state, field by field.
    Environment,
}

impl Suite {
    pub const ALL: [Suite; 3] = [Self::CheckmateInOne, Self::Policy, Self::Environment];

    pub fn name(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "checkmate-in-one",
            Self::Policy => "policy",
            Self::Environment => "environment",
        }
    }

    /// The suite named `name`; an unknown name lists the known ones.
    pub fn parse(name: &str) -> Result<Self, ConfigError> {
        Self::ALL
            .into_iter()
            .find(|s| s.name() == name.trim())
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                ConfigError::Value(format!(
                    "unknown suite `{name}` (known: {})",
                    known.join(", ")
                ))
            })
    }

    /// The data file of this suite (embedded; `--data-dir` holds replacements).
    pub fn file(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "bigbench_checkmate.json",
            Self::Policy => "rook_val_500.txt",
            Self::Environment => "opening_dataset_eval.json",
        }
    }

    fn embedded(self) -> &'static str {
        match self {
            Self::CheckmateInOne => include_str!("../../data/eval/bigbench_checkmate.json"),
            Self::Policy => include_str!("../../data/eval/rook_val_500.txt"),
            Self::Environment => include_str!("../../data/eval/opening_dataset_eval.json"),
        }
    }

    /// The metric whose pass@1 and pass@K are reported.
    pub fn primary(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "mate",
            Self::Policy => "top1",
            Self::Environment => "exact_fen",
        }
    }

    /// This suite's items, from `dir` when given, else the embedded data; a missing or
    /// malformed file is one clear error naming it.
    pub fn items(self, dir: Option<&Path>) -> Result<Vec<Item>, EvalError> {
        let owned;
        let (text, origin) = match dir {
            Some(dir) => {
                let path = dir.join(self.file());
                owned = std::fs::read_to_string(&path).map_err(|e| EvalError::Data {
                    origin: path.display().to_string(),
                    detail: e.to_string(),
                })?;
                (owned.as_str(), path.display().to_string())
            }
            None => (self.embedded(), format!("embedded {}", self.file())),
        };
        let items = match self {
            Self::CheckmateInOne => checkmate_items(text),
            Self::Policy => policy_items(text),
            Self::Environment => environment_items(text),
        }
        .map_err(|Malformed(detail)| EvalError::Data {
            origin: origin.clone(),
            detail,
        })?;
        if items.is_empty() {
            return Err(EvalError::Data {
                origin,
                detail: "no items".into(),
            });
        }
        Ok(items)
    }
}

/// One thing to evaluate: the prompt the model continues and what is true of it.
#[derive(Debug, Clone)]
pub struct Item {
    pub prompt: String,
    truth: Truth,
}

#[derive(Debug, Clone)]
enum Truth {
    /// A position with a mate in one.
    Mate(Box<PolicyPrompt>),
    /// A position and Stockfish's multipv-5 moves, best first (by their evaluations).
    Ranked(Box<PolicyPrompt>, Vec<(String, f64)>),
    /// The environment's true next state.
    Next(Box<EnvTruth>),
}

/// How one completion fared: named metrics in [0, 1], the verdict and its reward.
#[derive(Debug, Clone, PartialEq)]
pub struct Graded {
    pub metrics: Vec<(&'static str, f64)>,
    pub verdict: &'static str,
    pub reward: f64,
    /// Why it is malformed, when it is.
    pub detail: Option<String>,
}

/// One item's graded completions, in sample order: the text and its grading.
pub type Completions = Vec<(String, Graded)>;

impl Item {
    /// The position whose moves are ranked (policy items).
    pub fn ranked_position(&self) -> Option<&Chess> {
        match &self.truth {
            Truth::Ranked(prompt, _) => Some(&prompt.position),
            _ => None,
        }
    }

    /// A policy item's ranking: moves (UCI) and evaluations, best first.
    pub fn ranking(&self) -> Option<&[(String, f64)]> {
        match &self.truth {
            Truth::Ranked(_, ranking) => Some(ranking),
            _ => None,
        }
    }

    /// Replaces a policy item's ranking (moves in UCI with their evaluations in pawns
    /// from the side to move, best first); other items are left as they are.
    pub fn rerank(&mut self, ranking: Vec<(String, f64)>) {
        if let Truth::Ranked(_, old) = &mut self.truth {
            *old = ranking;
        }
    }

    /// Grades `completion` (the text the model wrote after the prompt).
    pub fn grade(&self, completion: &str) -> Graded {
        match &self.truth {
            Truth::Mate(prompt) => grade_mate(prompt, completion),
            Truth::Ranked(prompt, ranking) => grade_ranked(prompt, ranking, completion),
            Truth::Next(truth) => grade_next(truth, completion),
        }
    }
}

fn grade_mate(prompt: &PolicyPrompt, completion: &str) -> Graded {
    let checked = policy_task::check(prompt, completion);
    let score = match &checked {
        Ok(c) => policy_task::score_rules(c, &PolicyWeights::default()),
        Err(s) => s.clone(),
    };
    let best = checked.as_ref().ok().and_then(|c| c.best);
    let mates = best.is_some_and(|m| {
        prompt
            .position
            .clone()
            .play(m)
            .is_ok_and(|p| p.is_checkmate())
    });
    Graded {
        metrics: vec![
            ("well_formed", f64::from(checked.is_ok())),
            ("legal_best", f64::from(best.is_some())),
            ("mate", f64::from(mates)),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn grade_ranked(prompt: &PolicyPrompt, ranking: &[(String, f64)], completion: &str) -> Graded {
    let checked = policy_task::check(prompt, completion);
    let score = match &checked {
        Ok(c) => policy_task::score_rules(c, &PolicyWeights::default()),
        Err(s) => s.clone(),
    };
    let (legal_best, top1, top5) = match &checked {
        Ok(c) => {
            let ranked = |m: &String| ranking.iter().any(|(r, _)| r == m);
            let listed = c.answer.moves.iter().filter(|m| ranked(m));
            let overlap = listed.count() as f64 / ranking.len().max(1) as f64;
            // The best move, or one evaluated as well (ties are common: 0.0 in draws).
            let top = ranking.first().map_or(f64::NAN, |(_, v)| *v);
            let top1 = c.best.is_some()
                && ranking
                    .iter()
                    .any(|(m, v)| *v == top && *m == c.answer.best);
            (c.best.is_some(), top1, overlap.min(1.0))
        }
        Err(_) => (false, false, 0.0),
    };
    Graded {
        metrics: vec![
            ("well_formed", f64::from(checked.is_ok())),
            ("legal_best", f64::from(legal_best)),
            ("top1", f64::from(top1)),
            ("top5_overlap", top5),
            ("reward", (score.reward + 1.0) / 2.0),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn grade_next(truth: &EnvTruth, completion: &str) -> Graded {
    let score = score_against(truth, completion, &EnvWeights::default());
    let component = |name: &str| {
        score
            .components
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0.0, |(_, c)| f64::from(*c >= 1.0))
    };
    let fen = completion.split('+').next().unwrap_or("");
    let well_formed = score.verdict != Verdict::Malformed;
    let clocks = component("halfmove") * component("fullmove");
    let flags = component("reward") * component("terminated") * component("truncated");
    Graded {
        metrics: vec![
            ("well_formed", f64::from(well_formed)),
            ("exact_fen", f64::from(well_formed && fen == truth.new_fen)),
            ("placement", component("placement")),
            ("side", component("side")),
            ("castling", component("castling")),
            ("en_passant", component("en_passant")),
            ("clocks", clocks),
            ("flags", flags),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn policy_of(fen: &str) -> Result<(Chess, PolicyPrompt), Malformed> {
    let position = rookworld_chess::task::parse_position(fen)?;
    let prompt = policy_prompt(&position);
    let parsed = PolicyPrompt::parse(&prompt)?;
    Ok((position, parsed))
}

#[derive(serde::Deserialize)]
struct Checkmates {
    positions: Vec<Checkmate>,
}

#[derive(serde::Deserialize)]
struct Checkmate {
    fen: String,
}

fn checkmate_items(text: &str) -> Result<Vec<Item>, Malformed> {
    let data: Checkmates = serde_json::from_str(text)?;
    data.positions
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let (_, prompt) =
                policy_of(&p.fen).map_err(|e| Malformed(format!("position {i}: {}", e.0)))?;
            Ok(Item {
                prompt: policy_prompt(&prompt.position),
                truth: Truth::Mate(Box::new(prompt)),
            })
        })
        .collect()
}

fn policy_items(text: &str) -> Result<Vec<Item>, Malformed> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let bad = |e: String| Malformed(format!("line {}: {e}", i + 1));
            let split = split_line(line).map_err(|e| bad(e.to_string()))?;
            let answer = split
                .completion
                .as_deref()
                .ok_or_else(|| bad("a `P:` line without its answer".into()))?;
            let listed = policy_task::parse_answer(answer).map_err(|e| bad(e.to_string()))?;
            let ranking = ranking(&listed.moves, &listed.evals).map_err(|e| bad(e.0))?;
            let prompt = PolicyPrompt::parse(&split.prompt).map_err(|e| bad(e.to_string()))?;
            Ok(Item {
                prompt: split.prompt,
                truth: Truth::Ranked(Box::new(prompt), ranking),
            })
        })
        .collect()
}

/// The moves of a data line best first: by their evaluations (pawns, side to move),
/// highest first — the data lists them in another order, and its `B:` is not always the
/// best (docs/rookworld.md).
fn ranking(moves: &[String], evals: &[String]) -> Result<Vec<(String, f64)>, Malformed> {
    if moves.len() != evals.len() {
        return Err(Malformed(format!(
            "{} moves but {} evaluations",
            moves.len(),
            evals.len()
        )));
    }
    let mut ranked = moves
        .iter()
        .zip(evals)
        .map(|(m, e)| {
            let v: f64 = e
                .parse()
                .map_err(|_| Malformed(format!("evaluation `{e}` is no number")))?;
            Ok((m.clone(), v))
        })
        .collect::<Result<Vec<_>, Malformed>>()?;
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(ranked)
}

#[derive(serde::Deserialize)]
struct EnvLine {
    prompt: String,
    expected_fen: String,
}

fn environment_items(text: &str) -> Result<Vec<Item>, Malformed> {
    let lines: Vec<EnvLine> = serde_json::from_str(text)?;
    lines
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let prompt =
                EnvPrompt::parse(&l.prompt).map_err(|e| Malformed(format!("item {i}: {e}")))?;
            let truth = EnvTruth::of(&prompt);
            if truth.new_fen != l.expected_fen {
                return Err(Malformed(format!(
                    "item {i}: the file expects {} but the move gives {}",
                    l.expected_fen, truth.new_fen
                )));
            }
            Ok(Item {
                prompt: l.prompt,
                truth: Truth::Next(Box::new(truth)),
            })
        })
        .collect()
}

#[cfg(test)]
#[path = "suites_tests.rs"]
mod tests;
