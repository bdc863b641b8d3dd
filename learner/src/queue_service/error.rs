//! Why the queue refused a call, and the one place that says which gRPC status each cause
//! is (as the reward server's and the worker's errors do).

use rookworld_service::auth::TokenError;
use tonic::Status;

use crate::queue::{Backpressure, DuplicateWorker, SubmitError};

/// A refused queue call.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// No token, or the wrong one.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The request is malformed (its lease stays: a corrected call can still come).
    #[error("{0}")]
    Invalid(String),
    /// No push reaches or fits the worker (its push address does not answer, TLS on one
    /// side only, another model); the text says what to do.
    #[error("{0}")]
    PushUnreachable(String),
    /// Another worker holds the caller's worker id: refused for good (the worker stops).
    #[error(transparent)]
    Duplicate(#[from] DuplicateWorker),
    /// A submission under a lease the queue does not hold for this worker and prompt.
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The queue is full for this call (its bounds hold).
    #[error("{0}")]
    Full(Backpressure),
    /// The learner failed at its own work (not the caller's fault).
    #[error("{0}")]
    Internal(String),
}

impl From<QueueError> for Status {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Token(e) => e.into(),
            QueueError::Invalid(m) => Status::invalid_argument(m),
            QueueError::PushUnreachable(m) => Status::failed_precondition(m),
            QueueError::Duplicate(e) => Status::already_exists(e.to_string()),
            QueueError::Submit(e) => Status::failed_precondition(e.to_string()),
            QueueError::Full(b) => Status::resource_exhausted(format!("{b:?}")),
            QueueError::Internal(m) => Status::internal(m),
        }
    }
}
