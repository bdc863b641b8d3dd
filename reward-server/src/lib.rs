//! The reward server: verified rewards for RookWorld completions.
//!
//! - [`app`]: the command line; `main.rs` only calls [`app::main`].
//! - [`task`]: the two tasks and their prompts, parsed and checked ([`task::Task`]).
//! - [`rules`]: positions as python-chess plays them (a side without a king included).
//! - [`env_task`]: the environment task's true next state (shakmaty) and its scoring.
//! - [`policy_task`]: the policy task's parsing, legality and engine grading.
//! - [`score`]: [`score::Score`], verdicts, the reward range and the weights.
//! - [`engine`]: a pool of UCI engines (Stockfish) with a cache, timeouts and restarts.
//! - [`scorer`]: the one scoring path shared by the service, `score` and `bench`.
//! - [`service`]: the gRPC service with health and reflection; [`service::run`].
//! - [`metrics`]: every exported metric, described in one place.
//! - [`error`]: request errors and their mapping to gRPC status codes.
//! - [`cli`]: `serve` and `score`; [`bench`]: `bench`.

pub mod app;
pub mod bench;
pub mod cli;
pub mod engine;
pub mod env_task;
pub mod error;
pub mod metrics;
pub mod policy_task;
pub mod rules;
pub mod score;
pub mod scorer;
pub mod service;
pub mod task;
