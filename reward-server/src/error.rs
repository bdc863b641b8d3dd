//! Errors of a scoring request, and their one mapping to gRPC status codes.
//!
//! A malformed *completion* is not an error (it scores the minimum); these are for
//! requests the server cannot score at all.

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

/// Errors of a whole batch call.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Item `index` of the batch is a malformed request.
    #[error("item {index}: {source}")]
    BadItem {
        index: usize,
        #[source]
        source: RequestError,
    },
    /// More items in flight than the server accepts.
    #[error(
        "overloaded: {requested} items asked, {available} of {limit} item slots free; retry later"
    )]
    Overloaded {
        requested: usize,
        available: usize,
        limit: usize,
    },
    /// The request itself exceeds the per-call limit.
    #[error("batch of {requested} items exceeds the limit of {limit} per call")]
    TooLarge { requested: usize, limit: usize },
    /// The call lacks the token it needs.
    #[error(transparent)]
    Token(#[from] rookworld_proto::auth::TokenError),
}

impl ServiceError {
    /// The `status` label of `reward_requests_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Overloaded { .. } => "resource_exhausted",
            Self::Token(rookworld_proto::auth::TokenError::Missing) => "unauthenticated",
            Self::Token(_) => "permission_denied",
            Self::BadItem { .. } | Self::TooLarge { .. } => "invalid_argument",
        }
    }
}

impl From<ServiceError> for tonic::Status {
    fn from(e: ServiceError) -> Self {
        let code = match e {
            ServiceError::Token(t) => return t.into(),
            ServiceError::BadItem { .. } | ServiceError::TooLarge { .. } => {
                tonic::Code::InvalidArgument
            }
            ServiceError::Overloaded { .. } => tonic::Code::ResourceExhausted,
        };
        // The message may quote the request (a FEN): bounded.
        rookworld_proto::status::status(code, e.to_string())
    }
}
