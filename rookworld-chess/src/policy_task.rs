//! The policy task (`P:`): parse `M: moves  E: evals  B: best`, check every move
//! against the rules, and, when an engine analysed the position, grade the answer
//! against its multipv ranking.
//!
//! Sections are found by their markers, never by column (padding varies). Parsing is
//! separate from legality: a move token that is not UCI is simply not a legal move.

use shakmaty::uci::UciMove;
use shakmaty::{Chess, Move};

use crate::score::{PolicyWeights, Score};
use crate::stockfish::Analysis;
use crate::task::PolicyPrompt;

/// Candidates the data lists at most (Stockfish multipv 5).
pub const MAX_CANDIDATES: usize = 5;

/// The three sections of a policy answer, as text tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyAnswer {
    pub moves: Vec<String>,
    pub evals: Vec<String>,
    pub best: String,
}

/// Why a policy answer is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    /// A section marker (`M:`, `E:`, `B:`, in that order) is missing.
    #[error("no `{0}` section")]
    MissingMarker(&'static str),
    /// The `M:` section lists no move.
    #[error("the `M:` section lists no move")]
    EmptyMoves,
    /// The `B:` section does not hold exactly one move.
    #[error("the `B:` section must hold exactly one move, found {0}")]
    BestMoveCount(usize),
}

impl AnswerError {
    /// Short stable label (the malformed score's kind, a metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingMarker(_) => "missing_marker",
            Self::EmptyMoves => "empty_moves",
            Self::BestMoveCount(_) => "best_move_count",
        }
    }
}

/// Finds `M:`, `E:`, `B:` in order in `text`.
pub fn parse_answer(text: &str) -> Result<PolicyAnswer, AnswerError> {
    let m = text.find("M:").ok_or(AnswerError::MissingMarker("M:"))?;
    let e = m
        + 2
        + text[m + 2..]
            .find("E:")
            .ok_or(AnswerError::MissingMarker("E:"))?;
    let b = e
        + 2
        + text[e + 2..]
            .find("B:")
            .ok_or(AnswerError::MissingMarker("B:"))?;
    let tokens = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let moves = tokens(&text[m + 2..e]);
    let evals = tokens(&text[e + 2..b]);
    let best = tokens(&text[b + 2..]);
    if moves.is_empty() {
        return Err(AnswerError::EmptyMoves);
    }
    let [best] = &best[..] else {
        return Err(AnswerError::BestMoveCount(best.len()));
    };
    Ok(PolicyAnswer {
        moves,
        evals,
        best: best.clone(),
    })
}

/// Parses a UCI token into a legal move of `pos`.
pub fn legal_move(pos: &Chess, token: &str) -> Option<Move> {
    UciMove::from_ascii(token.as_bytes())
        .ok()?
        .to_move(pos)
        .ok()
}

/// Legality of an answer's moves in its position.
#[derive(Debug, Clone)]
pub struct Checked {
    pub answer: PolicyAnswer,
    /// `Some(move)` for each legal candidate token.
    pub candidates: Vec<Option<Move>>,
    pub best: Option<Move>,
    /// Evals parsed as pawns, `None` where a token is no number.
    pub evals: Vec<Option<f64>>,
}

impl Checked {
    pub fn new(pos: &Chess, answer: PolicyAnswer) -> Self {
        Self {
            candidates: answer.moves.iter().map(|t| legal_move(pos, t)).collect(),
            best: legal_move(pos, &answer.best),
            evals: answer
                .evals
                .iter()
                .map(|t| t.parse::<f64>().ok().filter(|v| v.is_finite()))
                .collect(),
            answer,
        }
    }

    /// 1 when there are 1–5 distinct candidates and exactly one numeric eval per
    /// candidate, else 0.
    fn format(&self) -> f64 {
        let moves = &self.answer.moves;
        let n = moves.len();
        let distinct = moves
            .iter()
            .enumerate()
            .all(|(i, m)| !moves[..i].contains(m));
        let ok = n <= MAX_CANDIDATES
            && distinct
            && self.evals.len() == n
            && self.evals.iter().all(Option::is_some);
        f64::from(ok)
    }

    fn rules_components(&self) -> Vec<(&'static str, f64)> {
        let legal = self.candidates.iter().filter(|m| m.is_some()).count();
        vec![
            ("format", self.format()),
            (
                "candidates_legal",
                legal as f64 / self.candidates.len() as f64,
            ),
            ("best_legal", f64::from(self.best.is_some())),
        ]
    }
}

/// Parses and checks `completion` for `prompt`; a malformed answer is already its score.
pub fn check(prompt: &PolicyPrompt, completion: &str) -> Result<Checked, Score> {
    let text = format!("{}{}", prompt.tail, completion);
    let answer = parse_answer(&text).map_err(|e| Score::malformed(e.kind(), e.to_string()))?;
    Ok(Checked::new(&prompt.position, answer))
}

/// Score from format and legality alone (no engine): `engine_graded` is false and the
/// engine components are absent.
pub fn score_rules(checked: &Checked, weights: &PolicyWeights) -> Score {
    Score::weighted(checked.rules_components(), &weights.table(false), false)
}

/// Score graded against an engine's multipv analysis of the position:
/// - `best_rank`: (6 − r)/5 when the best move is the engine's r-th line (r ≤ 5), else 0;
/// - `candidate_overlap`: |legal candidates ∩ engine lines| / number of engine lines;
/// - `eval_accuracy`: exp(−mean |eval − engine eval| / scale) over the candidates the
///   engine also lists, evals clipped to ±clip pawns; 0 when none is listed.
pub fn score_engine(checked: &Checked, analysis: &Analysis, weights: &PolicyWeights) -> Score {
    let lines = &analysis.lines;
    let rank = checked
        .best
        .and_then(|b| lines.iter().position(|l| l.mv == b))
        .map_or(0.0, |r| (MAX_CANDIDATES - r) as f64 / MAX_CANDIDATES as f64);
    let mut matched = 0usize;
    let mut error_sum = 0.0;
    let mut error_n = 0usize;
    let clip = |v: f64| v.clamp(-weights.eval_clip_pawns, weights.eval_clip_pawns);
    for (cand, eval) in checked
        .candidates
        .iter()
        .zip(checked.evals.iter().chain(std::iter::repeat(&None)))
    {
        let Some(line) = cand.and_then(|c| lines.iter().find(|l| l.mv == c)) else {
            continue;
        };
        matched += 1;
        if let Some(e) = eval {
            error_sum += (clip(*e) - clip(line.eval_pawns)).abs();
            error_n += 1;
        }
    }
    let overlap = if lines.is_empty() {
        0.0
    } else {
        (matched as f64 / lines.len() as f64).min(1.0)
    };
    let accuracy = if error_n == 0 {
        0.0
    } else {
        (-(error_sum / error_n as f64) / weights.eval_scale_pawns).exp()
    };
    let mut components = checked.rules_components();
    components.extend([
        ("best_rank", rank),
        ("candidate_overlap", overlap),
        ("eval_accuracy", accuracy),
    ]);
    Score::weighted(components, &weights.table(true), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = "P: 2b3k1/Q4rqn/p2p4/4p3/p6p/2PP3P/BP3PP1/R5K1 b - - 0 34                                    M: a4a3 c8f5 h7f6 h7g5 h7f8      E: -3.06 -2.82 -3.21 -3.16 -2.3            B: h7f6";

    #[test]
    fn a_real_line_parses_and_is_legal() {
        let m = LINE.find("M:").unwrap();
        let prompt = PolicyPrompt::parse(&LINE[..m]).unwrap();
        let checked = check(&prompt, &LINE[m..]).unwrap();
        assert_eq!(checked.answer.moves.len(), 5);
        assert_eq!(score_rules(&checked, &PolicyWeights::default()).reward, 1.0);
    }

    #[test]
    fn malformed_answers_name_their_reason() {
        for (text, kind) in [
            ("M: e2e4 E: 0.3", "missing_marker"),
            ("M: E: 0.1 B: e2e4", "empty_moves"),
            ("M: e2e4 E: 1 B: e2e4 d2d4", "best_move_count"),
            ("", "missing_marker"),
        ] {
            assert_eq!(parse_answer(text).unwrap_err().kind(), kind, "{text:?}");
        }
    }
}
