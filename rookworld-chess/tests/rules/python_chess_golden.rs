//! The rules python-chess applied when it generated the data, case by case: each true
//! completion below is what python-chess 1.11.2 printed for its (FEN, move) with
//! `board.push`, `board.fen()` and `board.outcome()`, written the way
//! `bench/compare_python_chess.py` writes its truths. The bulk check (20,000 random
//! games) is that script's agreement run.

use rookworld_chess::env_task::EnvTruth;
use rookworld_chess::task::EnvPrompt;

const CASES: &[(&str, &str, &str, &str)] = &[
    (
        "pinned en passant capture: no ep square",
        "7k/2p5/8/KP5r/8/8/8/8 b - - 0 1",
        "c7c5",
        "7k/8/8/KPp4r/8/8/8/8 w - - 0 2+0.001+0+0",
    ),
    (
        "legal en passant capture: ep square written",
        "7k/2p5/8/1P6/8/8/8/K7 b - - 0 1",
        "c7c5",
        "7k/8/8/1Pp5/8/8/8/K7 w - c6 0 2+0.001+0+0",
    ),
    (
        "no capturing pawn: no ep square",
        "7k/2p5/8/8/8/8/8/K7 b - - 0 1",
        "c7c5",
        "7k/8/8/2p5/8/8/8/K7 w - - 0 2+0.001+0+0",
    ),
    (
        "castling drops both rights",
        "r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 5 10",
        "e1g1",
        "r3k2r/8/8/8/8/8/8/R4RK1 b kq - 6 10+0.001+0+0",
    ),
    (
        "rook captures rook: both queenside rights",
        "r3k2r/8/8/8/8/8/8/R3K2R w KQkq - 5 10",
        "a1a8",
        "R3k2r/8/8/8/8/8/8/4K2R b Kk - 0 10+0.001+0+0",
    ),
    (
        "black capture: fullmove increments",
        "r3k2r/8/8/8/8/8/8/R3K2R b KQkq - 5 10",
        "h8h1",
        "r3k3/8/8/8/8/8/8/R3K2r w Qq - 0 11+0.001+0+0",
    ),
    (
        "queen promotion resets the clock",
        "8/P6k/8/8/8/8/8/K7 w - - 7 40",
        "a7a8q",
        "Q7/7k/8/8/8/8/8/K7 b - - 0 40+0.001+0+0",
    ),
    (
        "knight promotion: insufficient material",
        "8/P6k/8/8/8/8/8/K7 w - - 7 40",
        "a7a8n",
        "N7/7k/8/8/8/8/8/K7 b - - 0 40+0.5+1+0",
    ),
    (
        "not stalemate",
        "k7/8/1Q6/8/8/8/8/7K w - - 0 1",
        "b6b1",
        "k7/8/8/8/8/8/8/1Q5K b - - 1 1+0.001+0+0",
    ),
    (
        "stalemate",
        "k7/8/1K6/8/8/8/8/2Q5 w - - 0 1",
        "c1c7",
        "k7/2Q5/1K6/8/8/8/8/8 b - - 1 1+0.5+1+0",
    ),
    (
        "75-move rule",
        "7k/8/8/8/8/8/5q2/7K b - - 149 120",
        "f2g2",
        "7k/8/8/8/8/8/6q1/7K w - - 150 121+0.5+1+0",
    ),
    (
        "capture at clock 149 resets it",
        "7k/8/8/8/8/8/5q2/6RK b - - 149 120",
        "f2g1",
        "7k/8/8/8/8/8/8/6qK w - - 0 121+0.001+0+0",
    ),
    (
        "checkmate",
        "6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1",
        "a1a8",
        "R5k1/5ppp/8/8/8/8/8/6K1 b - - 1 1+1.0+1+0",
    ),
    (
        "king and knight against king",
        "8/8/8/8/8/5k2/8/4K1n1 w - - 0 1",
        "e1f1",
        "8/8/8/8/8/5k2/8/5Kn1 b - - 1 1+0.5+1+0",
    ),
];

#[test]
fn truths_match_python_chess_rule_by_rule() {
    for (what, fen, uci, want) in CASES {
        let prompt = EnvPrompt::parse(&format!("A: {fen}+{uci}+{uci}+")).unwrap();
        assert_eq!(&EnvTruth::of(&prompt).completion(), want, "{what}");
    }
}
