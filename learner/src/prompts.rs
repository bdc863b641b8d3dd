//! Training prompts: generated from random legal positions, or read from RookWorld text
//! lines or JSONL; deterministic from a seed, with a cursor a checkpoint stores.

use std::io::BufRead;
use std::path::Path;

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rookworld_chess::env_task::EnvTruth;
use rookworld_chess::playout::random_playout;
use rookworld_chess::rules::fen;
use rookworld_chess::task::EnvPrompt;
use serde::{Deserialize, Serialize};
use shakmaty::uci::UciMove;
use shakmaty::{CastlingMode, Chess, Position};

/// Which RookWorld task a prompt belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    /// `P: <FEN>`: the model writes candidate moves, evals and a best move.
    Policy,
    /// `A: fen+uci+history+`: the model writes the next state.
    Environment,
}

/// A prompt, and its exact completion when one is known (environment prompts always;
/// policy lines read from data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskPrompt {
    pub kind: TaskKind,
    pub prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<String>,
}

/// Where a prompt source stands: enough to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cursor {
    /// The generator's seed and its ChaCha8 word position (a u128, as text).
    Generated { seed: u64, word_pos: String },
    /// Index of the next line of a file source.
    File { next: usize },
}

/// Why prompts could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PromptError(pub String);

/// Plies of a generated game: the sum of two uniform draws in 0..=60, so positions
/// spread over opening, middlegame and endgame (mean 60 plies, move 30) rather than
/// piling up near the start.
const PLY_HALF_RANGE: usize = 60;

/// Prompts from random legal positions (seeded random playouts).
#[derive(Debug, Clone)]
pub struct Generator {
    seed: u64,
    rng: ChaCha8Rng,
    /// Fraction of policy prompts (the rest are environment prompts).
    policy_fraction: f64,
}

impl Generator {
    pub fn new(seed: u64, policy_fraction: f64) -> Self {
        Self {
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            policy_fraction: policy_fraction.clamp(0.0, 1.0),
        }
    }

    pub fn cursor(&self) -> Cursor {
        Cursor::Generated {
            seed: self.seed,
            word_pos: self.rng.get_word_pos().to_string(),
        }
    }

    /// The next prompt: a random position reached by a random playout, then a policy
    /// prompt for it, or an environment prompt for one random legal move (history: the
    /// last ≤ 10 moves, the current one last), with its exact completion.
    pub fn next_prompt(&mut self) -> TaskPrompt {
        loop {
            let plies = self.rng.random_range(0..=PLY_HALF_RANGE)
                + self.rng.random_range(0..=PLY_HALF_RANGE);
            let (pos, mut history) = random_playout(&mut self.rng, plies);
            let policy = self.rng.random_bool(self.policy_fraction);
            if policy {
                return TaskPrompt {
                    kind: TaskKind::Policy,
                    prompt: policy_prompt(&pos),
                    completion: None,
                };
            }
            let moves = pos.legal_moves();
            let Some(m) = moves.choose(&mut self.rng) else {
                continue;
            };
            let uci = UciMove::from_move(*m, CastlingMode::Standard).to_string();
            history.push(uci.clone());
            let tail = &history[history.len().saturating_sub(10)..];
            let prompt = format!("A: {}+{}+{}+", fen(&pos), uci, tail.join(" "));
            let truth =
                EnvTruth::of(&EnvPrompt::parse(&prompt).expect("a generated prompt is valid"));
            return TaskPrompt {
                kind: TaskKind::Environment,
                prompt,
                completion: Some(truth.completion()),
            };
        }
    }
}

/// The policy prompt of a position: `P: ` + FEN left-justified to 90 columns, as the
/// training text; the model continues with `M: …`.
pub fn policy_prompt(pos: &Chess) -> String {
    format!("P: {:<90}", fen(pos))
}

/// Splits one line of RookWorld text into prompt and completion: a policy line at `M:`,
/// an environment line after its third `+`. A bare prompt has no completion.
pub fn split_line(line: &str) -> Result<TaskPrompt, PromptError> {
    let line = line.trim_end_matches(['\n', '\r']);
    if let Some(rest) = line.strip_prefix("P: ") {
        return Ok(match rest.find("M:") {
            Some(i) => TaskPrompt {
                kind: TaskKind::Policy,
                prompt: line[..3 + i].to_owned(),
                completion: Some(rest[i..].to_owned()),
            },
            None => TaskPrompt {
                kind: TaskKind::Policy,
                prompt: line.to_owned(),
                completion: None,
            },
        });
    }
    if line.starts_with("A: ") {
        let cut = line.match_indices('+').nth(2).map(|(i, _)| i + 1);
        return match cut {
            Some(i) => Ok(TaskPrompt {
                kind: TaskKind::Environment,
                prompt: line[..i].to_owned(),
                completion: Some(line[i..].to_owned()).filter(|c| !c.is_empty()),
            }),
            None => Err(PromptError(format!(
                "environment line without `fen+move+history+`: {line:?}"
            ))),
        };
    }
    Err(PromptError(format!(
        "a line must start with `P: ` or `A: `: {line:?}"
    )))
}

/// One JSONL record: `{"text": "<full line>"}`, or `{"prompt": …, "completion": …}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRecord {
    text: Option<String>,
    prompt: Option<String>,
    completion: Option<String>,
}

/// Reads prompts from RookWorld text lines (`P: …` / `A: …`, blank lines skipped) or, for
/// a `.jsonl` file, JSON records. Errors name the file and line.
pub fn load(path: &Path) -> Result<Vec<TaskPrompt>, PromptError> {
    let file =
        std::fs::File::open(path).map_err(|e| PromptError(format!("{}: {e}", path.display())))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let at = |m: String| PromptError(format!("{}:{}: {m}", path.display(), n + 1));
        let line = line.map_err(|e| at(e.to_string()))?;
        if line.trim().is_empty() {
            continue;
        }
        let prompt = if jsonl {
            let r: JsonRecord = serde_json::from_str(&line).map_err(|e| at(e.to_string()))?;
            match (r.text, r.prompt) {
                (Some(text), None) => split_line(&text),
                (None, Some(prompt)) => split_line(&prompt).map(|p| TaskPrompt {
                    completion: r.completion.or(p.completion),
                    ..p
                }),
                _ => Err(PromptError(
                    "give exactly one of `text` and `prompt`".into(),
                )),
            }
        } else {
            split_line(&line)
        };
        out.push(prompt.map_err(|e| at(e.0))?);
    }
    if out.is_empty() {
        return Err(PromptError(format!("{}: no prompts", path.display())));
    }
    Ok(out)
}

/// Where prompts come from.
#[derive(Debug, Clone)]
pub enum Source {
    Generated(Box<Generator>),
    /// Read prompts, taken in order and cycled.
    File {
        prompts: Vec<TaskPrompt>,
        next: usize,
    },
}

impl Source {
    pub fn next_prompt(&mut self) -> TaskPrompt {
        match self {
            Self::Generated(g) => g.next_prompt(),
            Self::File { prompts, next } => {
                let p = prompts[*next % prompts.len()].clone();
                *next += 1;
                p
            }
        }
    }

    pub fn cursor(&self) -> Cursor {
        match self {
            Self::Generated(g) => g.cursor(),
            Self::File { next, .. } => Cursor::File { next: *next },
        }
    }

    /// Continues from `cursor` (which must come from a source of the same kind).
    pub fn restore(&mut self, cursor: &Cursor) -> Result<(), PromptError> {
        match (self, cursor) {
            (Self::Generated(g), Cursor::Generated { seed, word_pos }) => {
                let pos: u128 = word_pos
                    .parse()
                    .map_err(|_| PromptError(format!("bad cursor {word_pos}")))?;
                **g = Generator::new(*seed, g.policy_fraction);
                g.rng.set_word_pos(pos);
                Ok(())
            }
            (Self::File { next, .. }, Cursor::File { next: n }) => {
                *next = *n;
                Ok(())
            }
            (_, c) => Err(PromptError(format!(
                "checkpoint cursor {c:?} does not fit this prompt source"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_seeded_mixed_and_resumable() {
        let mut a = Source::Generated(Box::new(Generator::new(5, 0.5)));
        let first: Vec<TaskPrompt> = (0..40).map(|_| a.next_prompt()).collect();
        let policy = first.iter().filter(|p| p.kind == TaskKind::Policy).count();
        assert!((10..=30).contains(&policy), "{policy} policy prompts of 40");
        for p in &first {
            match p.kind {
                TaskKind::Policy => assert!(p.prompt.starts_with("P: ") && p.prompt.len() == 93),
                TaskKind::Environment => {
                    let history = p.prompt.split('+').nth(2).unwrap();
                    let uci = p.prompt.split('+').nth(1).unwrap();
                    assert!(
                        history.split(' ').count() <= 10 && history.ends_with(uci),
                        "{}",
                        p.prompt
                    );
                    assert!(
                        p.completion.as_ref().unwrap().ends_with("+0")
                            || p.completion.as_ref().unwrap().ends_with("+1")
                    );
                }
            }
        }
        // A cursor taken mid-way continues exactly.
        let mut b = Source::Generated(Box::new(Generator::new(5, 0.5)));
        for _ in 0..17 {
            b.next_prompt();
        }
        let cursor = b.cursor();
        let mut c = Source::Generated(Box::new(Generator::new(999, 0.5)));
        c.restore(&cursor).unwrap();
        assert_eq!(c.next_prompt(), first[17]);
        assert_eq!(b.next_prompt(), first[17]);
    }

    #[test]
    fn lines_split_at_their_markers() {
        let p = split_line("P: 8/8/8/8/8/8/8/K6k w - - 0 1     M: a1a2 a1b1  E: 0.0 0.0  B: a1a2")
            .unwrap();
        assert_eq!(p.prompt, "P: 8/8/8/8/8/8/8/K6k w - - 0 1     ");
        assert_eq!(
            p.completion.as_deref(),
            Some("M: a1a2 a1b1  E: 0.0 0.0  B: a1a2")
        );
        let a = split_line(
            "A: 8/8/8/8/8/8/8/K6k w - - 0 1+a1a2+a1a2+8/8/8/8/8/8/K7/7k b - - 1 1+0.001+0+0",
        )
        .unwrap();
        assert_eq!(a.prompt, "A: 8/8/8/8/8/8/8/K6k w - - 0 1+a1a2+a1a2+");
        assert_eq!(
            a.completion.as_deref(),
            Some("8/8/8/8/8/8/K7/7k b - - 1 1+0.001+0+0")
        );
        assert!(split_line("Q: nothing").is_err());
        assert!(split_line("A: no plus signs").is_err());
    }
}
