//! The environment task (`A:`): the true next state, computed with shakmaty, and the
//! score of a completion `{new_fen}+{reward}+{terminated}+{truncated}` against it.
//!
//! # What the ≤ 10-move history can and cannot decide
//! Checkmate, stalemate, insufficient material and the 75-move rule (halfmove clock ≥ 150
//! after the move, unless the move mates) follow from the position alone, so they are
//! decided exactly, in python-chess's order of precedence. Fivefold repetition needs the
//! position to have occurred five times, at least 16 plies apart in total; a history of
//! at most 10 moves can never show that, and the positions before the move cannot be
//! recovered from moves alone. So repetition is never decided: the truth assumes no
//! repetition, every time, and a completion claiming a repetition draw on an otherwise
//! ordinary move is scored against that truth. Threefold repetition and the 50-move rule
//! are claims, not game ends, and play no part.

use shakmaty::Board;

pub use crate::rules::Ending;
use crate::score::{EnvWeights, Score};
use crate::task::EnvPrompt;

/// Reward value of a legal move that does not end the game.
pub const REWARD_LEGAL: f64 = 0.001;
/// Reward value of a move that wins (mates).
pub const REWARD_WIN: f64 = 1.0;
/// Reward value of a move ending the game in a draw.
pub const REWARD_DRAW: f64 = 0.5;
/// Reward value of an unparseable action (cannot occur for a valid request: the
/// prompt's move is checked before scoring).
pub const REWARD_INVALID: f64 = -1.0;

/// The true next state of an environment prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvTruth {
    pub new_fen: String,
    pub reward: f64,
    pub terminated: bool,
    pub truncated: bool,
    pub ending: Ending,
}

impl EnvTruth {
    /// Plays the prompt's (legal) move and classifies the result.
    pub fn of(prompt: &EnvPrompt) -> Self {
        let (new_fen, ending) = prompt.board.play(prompt.mv);
        let reward = match ending {
            Ending::None => REWARD_LEGAL,
            Ending::Checkmate => REWARD_WIN,
            _ => REWARD_DRAW,
        };
        Self {
            new_fen,
            reward,
            terminated: ending != Ending::None,
            truncated: false,
            ending,
        }
    }

    /// The completion the model should write: `new_fen+reward+terminated+truncated`,
    /// numbers formatted as the training data writes them (`0.001`, `1.0`, `0.5`).
    pub fn completion(&self) -> String {
        format!(
            "{}+{}+{}+{}",
            self.new_fen,
            python_float(self.reward),
            u8::from(self.terminated),
            u8::from(self.truncated)
        )
    }
}

/// Formats like Python's `str(float)` for the values used here (`1.0`, `0.001`).
fn python_float(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// Scores `completion` against the truth of `prompt`.
///
/// Malformed unless it has exactly four `+`-separated fields. Otherwise each FEN field
/// scores 1 when its text equals the truth's; a wrong placement that still parses earns
/// half the fraction of the 64 squares it gets right (so only the exact text scores 1);
/// the reward value scores 1 when it parses to the true number; each flag when it is the
/// true `0`/`1`.
pub fn score(prompt: &EnvPrompt, completion: &str, weights: &EnvWeights) -> Score {
    score_against(&EnvTruth::of(prompt), completion, weights)
}

/// [`score`] with the truth already computed.
pub fn score_against(truth: &EnvTruth, completion: &str, weights: &EnvWeights) -> Score {
    let text = completion.trim_end_matches(['\n', '\r', ' ']);
    let fields: Vec<&str> = text.split('+').collect();
    let [fen, reward, terminated, truncated] = fields[..] else {
        return Score::malformed(
            "field_count",
            format!(
                "expected `new_fen+reward+terminated+truncated`, found {} '+'-separated fields",
                fields.len()
            ),
        );
    };
    // Fields split on single spaces, strictly: stray whitespace is a wrong field. The
    // last field must also be the last one (no extra fields).
    let got: Vec<&str> = fen.split(' ').collect();
    let want: Vec<&str> = truth.new_fen.split(' ').collect();
    let field = |i: usize| {
        f64::from(got.get(i) == want.get(i) && (i + 1 < want.len() || got.len() == want.len()))
    };
    let placement = if got.first() == want.first() {
        1.0
    } else {
        got.first()
            .map_or(0.0, |g| 0.5 * square_agreement(g, want[0]))
    };
    let reward_ok = reward
        .trim()
        .parse::<f64>()
        .is_ok_and(|r| (r - truth.reward).abs() < 1e-9);
    let flag = |text: &str, truth: bool| f64::from(text.trim() == if truth { "1" } else { "0" });
    let components = vec![
        ("format", 1.0),
        ("placement", placement),
        ("side", field(1)),
        ("castling", field(2)),
        ("en_passant", field(3)),
        ("halfmove", field(4)),
        ("fullmove", field(5)),
        ("reward", f64::from(reward_ok)),
        ("terminated", flag(terminated, truth.terminated)),
        ("truncated", flag(truncated, truth.truncated)),
    ];
    Score::weighted(components, &weights.table(), false)
}

/// Fraction of the 64 squares on which two board FENs agree (0 if either does not parse).
fn square_agreement(got: &str, want: &str) -> f64 {
    let (Ok(a), Ok(b)) = (
        Board::from_ascii_board_fen(got.as_bytes()),
        Board::from_ascii_board_fen(want.as_bytes()),
    ) else {
        return 0.0;
    };
    let same = shakmaty::Square::ALL
        .iter()
        .filter(|&&sq| a.piece_at(sq) == b.piece_at(sq))
        .count();
    same as f64 / 64.0
}
