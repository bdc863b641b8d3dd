//! The chess rules and rewards against independent truths, in one test binary:
//!
//! - `data`: the real RookWorld lines (`tests/fixtures/rookworld`) score as their targets;
//! - `python_chess_golden`: case by case, what python-chess printed for the same moves;
//! - `properties`: property tests over random legal positions;
//! - `stockfish`: the Stockfish pool against a real Stockfish.

mod data;
mod properties;
mod python_chess_golden;
mod stockfish;
