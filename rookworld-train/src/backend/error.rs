//! How a backend fails: a kernel or a buffer, named with its backend and operation, or a
//! shape (the products' checks in [`crate::gemm`] report these too).

/// A kernel or a buffer that failed, named with its backend and operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{backend} backend: {op}: {message}")]
    Kernel {
        backend: &'static str,
        op: &'static str,
        message: String,
    },
    #[error("{0}")]
    Shape(String),
    /// The caller's objective, asked for a chunk's upstream gradients by
    /// [`crate::pass::train`], failed.
    #[error("the objective: {0}")]
    Objective(Box<dyn std::error::Error + Send + Sync>),
}

pub type Result<T> = std::result::Result<T, Error>;
