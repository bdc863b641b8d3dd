//! The chess domain of RookWorld: the two tasks' prompt and completion formats, the rules
//! that compute a move's result (shakmaty), the rewards, the scorer that applies them to
//! batches, and a pool of UCI engines (Stockfish) that grades policy answers.
//!
//! The reward server serves it over gRPC; the learner uses it directly to make prompts,
//! warm-up documents and evaluations, so neither depends on the other for the rules.
//!
//! - [`task`]: the two tasks and their prompts, parsed and checked ([`task::Task`]).
//! - [`rules`]: positions as python-chess plays them (a side without a king included).
//! - [`env_task`]: the environment task's true next state (shakmaty) and its scoring.
//! - [`policy_task`]: the policy task's parsing, legality and engine grading.
//! - [`score`]: [`score::Score`], verdicts, the reward range and the weights.
//! - [`stockfish`]: a pool of UCI engines (Stockfish) with a cache, timeouts and restarts
//!   ([`stockfish::StockfishPool`]; not the generation engine of `rookworld-generation`).
//! - [`scorer`]: the one scoring path shared by the service, `score` and `bench`.
//! - [`error`]: why an item cannot be scored.
//! - [`playout`]: random legal games, for generated prompts and tests.

pub mod env_task;
pub mod error;
pub mod metrics;
pub mod playout;
pub mod policy_task;
pub mod rules;
pub mod score;
pub mod scorer;
pub mod stockfish;
pub mod task;
