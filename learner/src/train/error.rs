//! Why `learner train` stopped early: one error type for the run, each variant the line a
//! user reads.

use super::config::ConfigError;
use super::report::ReportError;
use crate::checkpoint;
use crate::prompts;

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    RunDir(#[from] crate::run_dir::RunDirError),
    #[error(transparent)]
    Prompts(#[from] prompts::PromptError),
    #[error("supervised warm-up: {0}")]
    WarmUp(#[from] crate::sft::SftError),
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    #[error("the queue's listener: {0}")]
    Listener(#[source] std::io::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("metrics on {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: rookworld_service::metrics_http::MetricsError,
    },
    #[error("local services: {0}")]
    LocalServices(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Export(#[from] rookworld_weights::export::ExportError),
    /// No step for `--stall-timeout`; the message says what the run was waiting on.
    #[error("{0}")]
    Stalled(String),
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}
