//! The two RookWorld tasks and their prompts, parsed and checked against the rules.
//!
//! - Policy (`P: <FEN>`, optionally followed by padding and the start of the answer,
//!   e.g. `    M:`): the model lists candidate moves, their evals and the best move.
//! - Environment (`A: {fen}+{uci}+{history}+`): the model plays the move on the board
//!   and reports the new FEN, reward and flags.
//!
//! A prompt that cannot be scored (no prefix, bad FEN, illegal environment move) is a
//! [`RequestError`], never a low reward.

use std::str::FromStr;

use shakmaty::{Chess, Move};

use crate::error::RequestError;
use crate::rules::{self, EnvBoard};

/// Which task an item belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    Policy,
    Environment,
}

impl Task {
    pub fn label(self) -> &'static str {
        match self {
            Self::Policy => "P",
            Self::Environment => "A",
        }
    }
}

impl FromStr for Task {
    type Err = RequestError;

    fn from_str(s: &str) -> Result<Self, RequestError> {
        match s {
            "P" | "p" | "policy" => Ok(Self::Policy),
            "A" | "a" | "environment" | "env" => Ok(Self::Environment),
            other => Err(RequestError::UnknownTask(other.chars().take(40).collect())),
        }
    }
}

fn bad_fen(fen: &str) -> impl Fn(String) -> RequestError + '_ {
    move |reason| RequestError::Fen {
        fen: fen.chars().take(100).collect(),
        reason,
    }
}

/// Parses a FEN into a playable standard-chess position.
pub fn parse_position(fen: &str) -> Result<Chess, RequestError> {
    rules::standard(fen).map_err(bad_fen(fen))
}

/// A policy prompt: the position to find moves in, and the text after the FEN (which
/// may already hold the start of the answer, e.g. `    M:`).
#[derive(Debug, Clone)]
pub struct PolicyPrompt {
    pub position: Chess,
    pub fen: String,
    /// Prompt text after the FEN, prepended to the completion before parsing sections.
    pub tail: String,
}

impl PolicyPrompt {
    pub fn parse(prompt: &str) -> Result<Self, RequestError> {
        let body = prompt
            .trim_start()
            .strip_prefix("P:")
            .ok_or_else(|| RequestError::Prompt("policy prompt must start with `P: `".into()))?;
        // The FEN ends where the answer's first marker (if any) begins.
        let fen_end = body.find("M:").unwrap_or(body.len());
        let fen = body[..fen_end].trim();
        if fen.is_empty() {
            return Err(RequestError::Prompt("policy prompt has no FEN".into()));
        }
        Ok(Self {
            position: parse_position(fen)?,
            fen: fen.to_owned(),
            tail: body[fen_end..].to_owned(),
        })
    }
}

/// An environment prompt: the position, the move played, and its history.
#[derive(Debug, Clone)]
pub struct EnvPrompt {
    pub board: EnvBoard,
    pub fen: String,
    pub uci: String,
    pub mv: Move,
    /// Moves in the history field (the last ≤ 10, current last). Only counted: the
    /// history cannot decide anything the position does not (see `env_task`).
    pub history_moves: usize,
}

impl EnvPrompt {
    pub fn parse(prompt: &str) -> Result<Self, RequestError> {
        let body = prompt.trim_start().strip_prefix("A:").ok_or_else(|| {
            RequestError::Prompt("environment prompt must start with `A: `".into())
        })?;
        let body = body.trim_start();
        let body = body.strip_suffix('+').unwrap_or(body);
        let fields: Vec<&str> = body.split('+').collect();
        let [fen, uci, history] = fields[..] else {
            return Err(RequestError::Prompt(format!(
                "environment prompt must be `A: fen+uci+history+`, found {} '+'-separated fields",
                fields.len()
            )));
        };
        let (fen, uci) = (fen.trim(), uci.trim());
        let board = EnvBoard::parse(fen).map_err(bad_fen(fen))?;
        let mv = board.legal_move(uci).map_err(|reason| RequestError::Move {
            mv: uci.chars().take(20).collect(),
            fen: fen.to_owned(),
            reason,
        })?;
        Ok(Self {
            board,
            fen: fen.to_owned(),
            uci: uci.to_owned(),
            mv,
            history_moves: history.split_whitespace().count(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_parse_and_bad_ones_are_request_errors() {
        let p = PolicyPrompt::parse(
            "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:",
        )
        .unwrap();
        assert_eq!(
            p.fen,
            "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"
        );
        assert_eq!(p.tail, "M:");
        let a = EnvPrompt::parse(
            "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+",
        )
        .unwrap();
        assert_eq!((a.uci.as_str(), a.history_moves), ("e2e4", 1));

        assert!(matches!(
            PolicyPrompt::parse("Q: x"),
            Err(RequestError::Prompt(_))
        ));
        assert!(matches!(
            PolicyPrompt::parse("P: not a fen"),
            Err(RequestError::Fen { .. })
        ));
        assert!(matches!(
            EnvPrompt::parse("A: 8/8/8/8/8/8/8/8 w - - 0 1+e2e4+e2e4+"),
            Err(RequestError::Fen { .. })
        ));
        let start = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1";
        assert!(matches!(
            EnvPrompt::parse(&format!("A: {start}+e2e5+e2e5+")),
            Err(RequestError::Move { .. })
        ));
        assert!(matches!(
            EnvPrompt::parse(&format!("A: {start}+zz+zz+")),
            Err(RequestError::Move { .. })
        ));
        assert!(matches!(
            EnvPrompt::parse(&format!("A: {start}+e2e4")),
            Err(RequestError::Prompt(_))
        ));
        assert!("X".parse::<Task>().is_err());
    }
}
