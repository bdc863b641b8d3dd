//! Why an evaluation could not run or finish.

use std::path::PathBuf;

use crate::settings::ConfigError;

/// A failed evaluation: one line naming the flag, file or part that failed.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A setting out of range, or a suite name that is not one.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A suite's data file is missing or malformed: which one (or the embedded copy), and
    /// where in it.
    #[error("{origin}: {detail}")]
    Data { origin: String, detail: String },
    /// An output file (`--out`, `--dump`) could not be written.
    #[error("{flag} {}: {source}", path.display())]
    Write {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The engine given by `--engine` could not re-rank the policy items.
    #[error("--engine: {0}")]
    Reanalysis(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Generation(#[from] rookworld_generation::EngineError),
    /// The weights a periodic evaluation was asked for.
    #[error("evaluation model: {0}")]
    Weights(#[from] rookworld_weights::WeightError),
    #[error("version {0} was never published")]
    NeverPublished(u64),
    /// The signal handlers could not be installed.
    #[error("cannot watch for Ctrl-C and SIGTERM: {0}")]
    Signals(#[source] std::io::Error),
    /// A signal stopped the work (`learner eval` ends with exit code 0 on it).
    #[error("stopped by a signal")]
    Stopped,
}

/// What is wrong with a data item, before the file it is in is known.
#[derive(Debug)]
pub(super) struct Malformed(pub String);

impl<E: std::fmt::Display> From<E> for Malformed {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}
