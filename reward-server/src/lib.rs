//! The reward server: verified rewards for RookWorld completions.
//!
//! - [`app`]: the command line; `main.rs` only calls [`app::main`].
//! - the chess domain — tasks, rules, rewards, the scorer, the Stockfish pool — is the
//!   `rookworld-chess` crate, which the learner uses too.
//! - [`service`]: the gRPC service with health and reflection; [`service::run`].
//! - [`metrics`]: every exported metric, described in one place.
//! - [`error`]: request errors and their mapping to gRPC status codes.
//! - [`cli`]: `serve` and `score`; [`bench`]: `bench`.

pub mod app;
pub mod bench;
pub mod cli;
pub mod error;
pub mod metrics;
pub mod service;
