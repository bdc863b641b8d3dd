//! Errors of a scoring request, and their one mapping to gRPC status codes.
//!
//! A malformed *completion* is not an error (it scores the minimum); these are for
//! requests the server cannot score at all.

pub use rookworld_chess::error::RequestError;

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
    Token(#[from] rookworld_service::auth::TokenError),
}

impl ServiceError {
    /// The `status` label of `reward_requests_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Overloaded { .. } => "resource_exhausted",
            Self::Token(rookworld_service::auth::TokenError::Missing) => "unauthenticated",
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
        rookworld_service::status::status(code, e.to_string())
    }
}
