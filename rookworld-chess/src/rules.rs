//! Chess positions as the RookWorld data's generator (python-chess) treats them.
//!
//! Standard positions are shakmaty's `Chess`. A few data positions lack one side's
//! king (the environment example in the task description is one). python-chess still
//! plays them: a side without a king has no check to respect, so its pseudo-legal
//! moves are legal. shakmaty's standard chess rejects such a board, but its Horde
//! variant has exactly those rules for a king-less White. So a board whose Black has
//! no king is mirrored (colours swapped, ranks flipped) and played as Horde, and the
//! result mirrored back, with the fullmove number corrected (mirroring swaps whose
//! move increments it).

use shakmaty::fen::Fen;
use shakmaty::uci::UciMove;
use shakmaty::variant::Horde;
use shakmaty::{
    Bitboard, Board, CastlingMode, Chess, Color, EnPassantMode, FromSetup, Move, Position,
    PositionError, PositionErrorKinds, Setup,
};

/// Why a FEN is not a playable position.
pub type PositionProblem = String;

fn relaxed<P>(r: Result<P, PositionError<P>>) -> Result<P, PositionError<P>> {
    r.or_else(PositionError::ignore_too_much_material)
        .or_else(PositionError::ignore_impossible_check)
}

/// The FEN of a position, en passant square written only when a capture is legal (what
/// python-chess's `board.fen()` writes).
pub fn fen<P: Position>(pos: &P) -> String {
    Fen::from_position(pos, EnPassantMode::Legal).to_string()
}

/// A standard position (lenient about material counts and impossible checks, which
/// python-chess plays).
pub fn standard(fen: &str) -> Result<Chess, PositionProblem> {
    let setup: Setup = Fen::from_ascii(fen.as_bytes())
        .map_err(|e| e.to_string())?
        .into();
    relaxed(Chess::from_setup(setup, CastlingMode::Standard)).map_err(|e| e.to_string())
}

/// A position the environment task can play.
#[derive(Debug, Clone)]
pub enum EnvBoard {
    Standard(Chess),
    /// One side has no king: Horde rules, mirrored when that side is Black.
    Kingless {
        pos: Horde,
        mirrored: bool,
    },
}

/// How a move ended the game, if it did (python-chess's order of precedence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    None,
    Checkmate,
    Stalemate,
    InsufficientMaterial,
    SeventyFiveMoves,
}

impl EnvBoard {
    pub fn parse(fen: &str) -> Result<Self, PositionProblem> {
        let setup: Setup = Fen::from_ascii(fen.as_bytes())
            .map_err(|e| e.to_string())?
            .into();
        let err = match relaxed(Chess::from_setup(setup.clone(), CastlingMode::Standard)) {
            Ok(pos) => return Ok(Self::Standard(pos)),
            Err(e) => e,
        };
        let kings = |c: Color| (setup.board.kings() & setup.board.by_color(c)).count();
        let (white, black) = (kings(Color::White), kings(Color::Black));
        if err.kinds() != PositionErrorKinds::MISSING_KING || white + black != 1 {
            return Err(err.to_string());
        }
        let mirrored = black == 0;
        let mut s = setup;
        if mirrored {
            s.mirror();
        }
        let pos =
            relaxed(Horde::from_setup(s, CastlingMode::Standard)).map_err(|e| e.to_string())?;
        Ok(Self::Kingless { pos, mirrored })
    }

    /// Parses a UCI move and checks it is legal here.
    pub fn legal_move(&self, uci: &str) -> Result<Move, String> {
        let m = UciMove::from_ascii(uci.as_bytes()).map_err(|e| e.to_string())?;
        match self {
            Self::Standard(pos) => m.to_move(pos).map_err(|e| e.to_string()),
            Self::Kingless { pos, mirrored } => {
                let m = if *mirrored { flip(m) } else { m };
                m.to_move(pos).map_err(|e| e.to_string())
            }
        }
    }

    /// Plays a legal move: the new FEN (en passant square only when a capture is legal)
    /// and how the game ended.
    pub fn play(&self, m: Move) -> (String, Ending) {
        match self {
            Self::Standard(pos) => {
                let mut pos = pos.clone();
                pos.play_unchecked(m);
                let ending = ending(&pos, pos.is_insufficient_material());
                (fen(&pos), ending)
            }
            Self::Kingless { pos, mirrored } => {
                let black_moved = (pos.turn() == Color::Black) != *mirrored;
                let mut after = pos.clone();
                after.play_unchecked(m);
                let board = after.board();
                let insufficient =
                    insufficient(board, Color::White) && insufficient(board, Color::Black);
                let ending = ending(&after, insufficient);
                let mut setup = after.to_setup(EnPassantMode::Legal);
                if *mirrored {
                    setup.mirror();
                    // Horde counted the mirrored side's move; count the real one.
                    let before = pos.fullmoves().get();
                    setup.fullmoves = std::num::NonZeroU32::new(before + u32::from(black_moved))
                        .expect("positive");
                }
                // Lossy only for variant data (pockets, promoted pieces) that Horde never has.
                let fen =
                    Fen::try_from_setup(setup).unwrap_or_else(shakmaty::fen::LossyFenError::ignore);
                (fen.to_string(), ending)
            }
        }
    }
}

fn ending<P: Position>(pos: &P, insufficient_material: bool) -> Ending {
    // One move generation decides both checkmate and stalemate.
    if pos.legal_moves().is_empty() {
        if pos.is_check() {
            Ending::Checkmate
        } else {
            Ending::Stalemate
        }
    } else if insufficient_material {
        Ending::InsufficientMaterial
    } else if pos.halfmoves() >= 150 {
        Ending::SeventyFiveMoves
    } else {
        Ending::None
    }
}

fn flip(m: UciMove) -> UciMove {
    match m {
        UciMove::Normal {
            from,
            to,
            promotion,
        } => UciMove::Normal {
            from: from.flip_vertical(),
            to: to.flip_vertical(),
            promotion,
        },
        UciMove::Put { role, to } => UciMove::Put {
            role,
            to: to.flip_vertical(),
        },
        UciMove::Null => UciMove::Null,
    }
}

/// python-chess's `has_insufficient_material(color)` for standard chess, on a bare
/// board (Horde's own rule differs).
fn insufficient(board: &Board, color: Color) -> bool {
    let ours = board.by_color(color);
    if (ours & (board.pawns() | board.rooks_and_queens())).any() {
        return false;
    }
    if (ours & board.knights()).any() {
        return ours.count() <= 2
            && (board.by_color(!color) & !board.kings() & !board.queens()).is_empty();
    }
    if (ours & board.bishops()).any() {
        let one_colour = (board.bishops() & Bitboard::DARK_SQUARES).is_empty()
            || (board.bishops() & Bitboard::LIGHT_SQUARES).is_empty();
        return one_colour && board.knights().is_empty() && board.pawns().is_empty();
    }
    true
}
