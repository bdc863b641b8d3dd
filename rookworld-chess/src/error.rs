//! Why an item cannot be scored: a request the rules cannot judge (a malformed
//! *completion* is no error: it scores the minimum).

/// Why an item cannot be scored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The task is missing or unknown.
    #[error("unknown task `{0}` (use P or A)")]
    UnknownTask(String),
    /// The prompt lacks its task prefix or its structure.
    #[error("malformed prompt: {0}")]
    Prompt(String),
    /// The prompt's FEN does not parse or is not a legal position.
    #[error("invalid FEN in prompt `{fen}`: {reason}")]
    Fen { fen: String, reason: String },
    /// The environment prompt's move is not a legal move of its position.
    #[error("move `{mv}` in prompt is not legal in `{fen}`: {reason}")]
    Move {
        mv: String,
        fen: String,
        reason: String,
    },
}

impl RequestError {
    /// Short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::UnknownTask(_) => "unknown_task",
            Self::Prompt(_) => "malformed_prompt",
            Self::Fen { .. } => "invalid_fen",
            Self::Move { .. } => "illegal_prompt_move",
        }
    }
}
