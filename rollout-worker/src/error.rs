//! Errors of the gRPC service, and their one mapping to gRPC status codes.

use rookworld_service::auth::TokenError;
use tonic::Status;

use crate::engine::EngineError;
use rookworld_weights::set::WeightError;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The request is malformed or cannot be served as asked.
    #[error("{0}")]
    InvalidArgument(String),
    /// Too much work is queued; retry later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// A control call without the right token.
    #[error("control call refused: {0}")]
    Token(#[from] TokenError),
    /// A weight set was refused; the old weights stay.
    #[error("weight update refused: {0}")]
    Weights(#[from] WeightError),
    /// The weight stream broke off before its end (the sender went away, the network
    /// failed); the old weights stay.
    #[error("weight update interrupted: {0}")]
    Interrupted(String),
    /// A peer was asked to send weights it does not hold.
    #[error("no payload to send: {0}")]
    NothingToSend(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("internal: {0}")]
    Internal(String),
}

impl ServiceError {
    /// Short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "invalid",
            Self::Overloaded(_) => "overloaded",
            Self::Token(TokenError::Missing) => "unauthenticated",
            Self::Token(_) => "permission_denied",
            Self::Weights(WeightError::Checksum { .. }) => "checksum",
            Self::Weights(WeightError::Stale { .. }) => "stale",
            Self::Weights(WeightError::Shared(_)) => "shared_unreadable",
            Self::Weights(WeightError::SharedBusy(_)) => "shared_busy",
            Self::Weights(WeightError::DeltaBase(_)) => "delta_base",
            Self::Weights(_) => "invalid",
            Self::Interrupted(_) => "interrupted",
            Self::NothingToSend(_) => "nothing_to_send",
            Self::Engine(_) | Self::Internal(_) => "failed",
        }
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Self {
        // The message may quote the request: bounded.
        let message = rookworld_service::status::bounded(e.to_string());
        match e {
            ServiceError::InvalidArgument(_) => Status::invalid_argument(message),
            ServiceError::Overloaded(_) => Status::resource_exhausted(message),
            ServiceError::Token(e) => e.into(),
            ServiceError::Weights(WeightError::Checksum { .. }) => Status::data_loss(message),
            ServiceError::Weights(
                WeightError::Stale { .. } | WeightError::Shared(_) | WeightError::DeltaBase(_),
            ) => Status::failed_precondition(message),
            ServiceError::Weights(WeightError::SharedBusy(_)) => Status::unavailable(message),
            ServiceError::Weights(_) => Status::invalid_argument(message),
            ServiceError::Interrupted(_) => Status::aborted(message),
            ServiceError::NothingToSend(_) => Status::failed_precondition(message),
            ServiceError::Engine(EngineError::InvalidRequest(_)) => {
                Status::invalid_argument(message)
            }
            ServiceError::Engine(EngineError::Stopped) => Status::unavailable(message),
            ServiceError::Engine(_) | ServiceError::Internal(_) => Status::internal(message),
        }
    }
}
