//! Random legal games from the start position: the positions of generated prompts,
//! benchmarks and property tests.

use rand::Rng;
use rand::seq::IndexedRandom;
use shakmaty::uci::UciMove;
use shakmaty::{CastlingMode, Chess, Position};

/// A random legal position: up to `max_plies` random moves from the start, stopping
/// before the game ends, so the position always has a legal move.
pub fn random_position(rng: &mut impl Rng, max_plies: usize) -> (Chess, Vec<String>) {
    let plies = rng.random_range(0..=max_plies);
    random_playout(rng, plies)
}

/// Up to `plies` random legal moves from the start, stopping before the game ends (the
/// position keeps a legal move). Returns the position and the moves in UCI.
pub fn random_playout(rng: &mut impl Rng, plies: usize) -> (Chess, Vec<String>) {
    let mut pos = Chess::default();
    let mut history = Vec::new();
    for _ in 0..plies {
        let moves = pos.legal_moves();
        let Some(m) = moves.choose(rng) else { break };
        let next = pos.clone().play(*m).expect("legal");
        if next.legal_moves().is_empty() {
            break;
        }
        history.push(UciMove::from_move(*m, CastlingMode::Standard).to_string());
        pos = next;
    }
    (pos, history)
}
