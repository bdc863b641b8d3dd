//! The crate's error type: every failure names what was wrong (file, tensor, option).

use std::path::PathBuf;

/// Errors of model loading, saving, tokenisation and generation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint directory lacks a file the loader needs.
    #[error("{0}")]
    MissingFile(String),
    /// `config.json` is not a GPT-2 configuration this crate can run.
    #[error("invalid model config {path}: {reason}")]
    Config { path: PathBuf, reason: String },
    /// A tensor the model needs is absent from the checkpoint.
    #[error("checkpoint has no tensor `{0}`")]
    MissingTensor(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// An unknown preset, dtype or device name.
    #[error("{0}")]
    InvalidArgument(String),
    /// The prompt does not fit in the model's context.
    #[error(
        "prompt has {prompt_tokens} tokens but the model's context holds {context} (n_positions)"
    )]
    PromptTooLong {
        prompt_tokens: usize,
        context: usize,
    },
    /// The tokenizer failed or could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed (device, dtype or shape problem inside candle).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A safetensors file could not be written or parsed.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// A JSON file could not be parsed or written.
    #[error("{path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
