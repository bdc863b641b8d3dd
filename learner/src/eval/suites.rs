//! The evaluation suites: their items (a prompt and what is true of it) and the grading
//! of one completion, with the reward server's own code (shakmaty underneath).

use std::path::Path;

use reward_server::env_task::{EnvTruth, score_against};
use reward_server::policy_task;
use reward_server::score::{EnvWeights, PolicyWeights, Verdict};
use reward_server::task::{EnvPrompt, PolicyPrompt};
use shakmaty::{Chess, Position};

use crate::prompts::{policy_prompt, split_line};

/// The suites, by their command-line names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// BIG-bench checkmate-in-one as `P:` prompts: solved when `B:` mates.
    CheckmateInOne,
    /// Held-out RookWorld `P:` lines: the best move against Stockfish's ranking.
    Policy,
    /// Held-out `A:` prompts: the next state, field by field.
    Environment,
}

impl Suite {
    pub const ALL: [Suite; 3] = [Self::CheckmateInOne, Self::Policy, Self::Environment];

    pub fn name(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "checkmate-in-one",
            Self::Policy => "policy",
            Self::Environment => "environment",
        }
    }

    /// The suite named `name`; an unknown name lists the known ones.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|s| s.name() == name.trim())
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                format!("unknown suite `{name}` (known: {})", known.join(", "))
            })
    }

    /// The data file of this suite (embedded; `--data-dir` holds replacements).
    pub fn file(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "bigbench_checkmate.json",
            Self::Policy => "rook_val_500.txt",
            Self::Environment => "opening_dataset_eval.json",
        }
    }

    fn embedded(self) -> &'static str {
        match self {
            Self::CheckmateInOne => include_str!("../../data/eval/bigbench_checkmate.json"),
            Self::Policy => include_str!("../../data/eval/rook_val_500.txt"),
            Self::Environment => include_str!("../../data/eval/opening_dataset_eval.json"),
        }
    }

    /// The metric whose pass@1 and pass@K are reported.
    pub fn primary(self) -> &'static str {
        match self {
            Self::CheckmateInOne => "mate",
            Self::Policy => "top1",
            Self::Environment => "exact_fen",
        }
    }

    /// This suite's items, from `dir` when given, else the embedded data; a missing or
    /// malformed file is one clear error naming it.
    pub fn items(self, dir: Option<&Path>) -> Result<Vec<Item>, String> {
        let owned;
        let (text, origin) = match dir {
            Some(dir) => {
                let path = dir.join(self.file());
                owned = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                (owned.as_str(), path.display().to_string())
            }
            None => (self.embedded(), format!("embedded {}", self.file())),
        };
        let items = match self {
            Self::CheckmateInOne => checkmate_items(text),
            Self::Policy => policy_items(text),
            Self::Environment => environment_items(text),
        }
        .map_err(|e| format!("{origin}: {e}"))?;
        if items.is_empty() {
            return Err(format!("{origin}: no items"));
        }
        Ok(items)
    }
}

/// One thing to evaluate: the prompt the model continues and what is true of it.
#[derive(Debug, Clone)]
pub struct Item {
    pub prompt: String,
    truth: Truth,
}

#[derive(Debug, Clone)]
enum Truth {
    /// A position with a mate in one.
    Mate(Box<PolicyPrompt>),
    /// A position and Stockfish's multipv-5 moves, best first (by their evaluations).
    Ranked(Box<PolicyPrompt>, Vec<(String, f64)>),
    /// The environment's true next state.
    Next(Box<EnvTruth>),
}

/// How one completion fared: named metrics in [0, 1], the verdict and its reward.
#[derive(Debug, Clone, PartialEq)]
pub struct Graded {
    pub metrics: Vec<(&'static str, f64)>,
    pub verdict: &'static str,
    pub reward: f64,
    /// Why it is malformed, when it is.
    pub detail: Option<String>,
}

/// One item's graded completions, in sample order: the text and its grading.
pub type Completions = Vec<(String, Graded)>;

impl Item {
    /// Grades `completion` (the text the model wrote after the prompt).
    pub fn grade(&self, completion: &str) -> Graded {
        match &self.truth {
            Truth::Mate(prompt) => grade_mate(prompt, completion),
            Truth::Ranked(prompt, ranking) => grade_ranked(prompt, ranking, completion),
            Truth::Next(truth) => grade_next(truth, completion),
        }
    }
}

fn grade_mate(prompt: &PolicyPrompt, completion: &str) -> Graded {
    let checked = policy_task::check(prompt, completion);
    let score = match &checked {
        Ok(c) => policy_task::score_rules(c, &PolicyWeights::default()),
        Err(s) => s.clone(),
    };
    let best = checked.as_ref().ok().and_then(|c| c.best);
    let mates = best.is_some_and(|m| {
        prompt
            .position
            .clone()
            .play(m)
            .is_ok_and(|p| p.is_checkmate())
    });
    Graded {
        metrics: vec![
            ("well_formed", f64::from(checked.is_ok())),
            ("legal_best", f64::from(best.is_some())),
            ("mate", f64::from(mates)),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn grade_ranked(prompt: &PolicyPrompt, ranking: &[(String, f64)], completion: &str) -> Graded {
    let checked = policy_task::check(prompt, completion);
    let score = match &checked {
        Ok(c) => policy_task::score_rules(c, &PolicyWeights::default()),
        Err(s) => s.clone(),
    };
    let (legal_best, top1, top5) = match &checked {
        Ok(c) => {
            let ranked = |m: &String| ranking.iter().any(|(r, _)| r == m);
            let listed = c.answer.moves.iter().filter(|m| ranked(m));
            let overlap = listed.count() as f64 / ranking.len().max(1) as f64;
            // The best move, or one evaluated as well (ties are common: 0.0 in draws).
            let top = ranking.first().map_or(f64::NAN, |(_, v)| *v);
            let top1 = c.best.is_some()
                && ranking
                    .iter()
                    .any(|(m, v)| *v == top && *m == c.answer.best);
            (c.best.is_some(), top1, overlap.min(1.0))
        }
        Err(_) => (false, false, 0.0),
    };
    Graded {
        metrics: vec![
            ("well_formed", f64::from(checked.is_ok())),
            ("legal_best", f64::from(legal_best)),
            ("top1", f64::from(top1)),
            ("top5_overlap", top5),
            ("reward", (score.reward + 1.0) / 2.0),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn grade_next(truth: &EnvTruth, completion: &str) -> Graded {
    let score = score_against(truth, completion, &EnvWeights::default());
    let component = |name: &str| {
        score
            .components
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0.0, |(_, c)| f64::from(*c >= 1.0))
    };
    let fen = completion.split('+').next().unwrap_or("");
    let well_formed = score.verdict != Verdict::Malformed;
    let clocks = component("halfmove") * component("fullmove");
    let flags = component("reward") * component("terminated") * component("truncated");
    Graded {
        metrics: vec![
            ("well_formed", f64::from(well_formed)),
            ("exact_fen", f64::from(well_formed && fen == truth.new_fen)),
            ("placement", component("placement")),
            ("side", component("side")),
            ("castling", component("castling")),
            ("en_passant", component("en_passant")),
            ("clocks", clocks),
            ("flags", flags),
        ],
        verdict: score.verdict.label(),
        reward: score.reward,
        detail: score.malformed.map(|m| m.detail),
    }
}

fn policy_of(fen: &str) -> Result<(Chess, PolicyPrompt), String> {
    let position = reward_server::task::parse_position(fen).map_err(|e| e.to_string())?;
    let prompt = policy_prompt(&position);
    let parsed = PolicyPrompt::parse(&prompt).map_err(|e| e.to_string())?;
    Ok((position, parsed))
}

#[derive(serde::Deserialize)]
struct Checkmates {
    positions: Vec<Checkmate>,
}

#[derive(serde::Deserialize)]
struct Checkmate {
    fen: String,
}

fn checkmate_items(text: &str) -> Result<Vec<Item>, String> {
    let data: Checkmates = serde_json::from_str(text).map_err(|e| e.to_string())?;
    data.positions
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let (_, prompt) = policy_of(&p.fen).map_err(|e| format!("position {i}: {e}"))?;
            Ok(Item {
                prompt: policy_prompt(&prompt.position),
                truth: Truth::Mate(Box::new(prompt)),
            })
        })
        .collect()
}

fn policy_items(text: &str) -> Result<Vec<Item>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let bad = |e: String| format!("line {}: {e}", i + 1);
            let split = split_line(line).map_err(|e| bad(e.to_string()))?;
            let answer = split
                .completion
                .as_deref()
                .ok_or_else(|| bad("a `P:` line without its answer".into()))?;
            let listed = policy_task::parse_answer(answer).map_err(|(_, d)| bad(d))?;
            let ranking = ranking(&listed.moves, &listed.evals).map_err(bad)?;
            let prompt = PolicyPrompt::parse(&split.prompt).map_err(|e| bad(e.to_string()))?;
            Ok(Item {
                prompt: split.prompt,
                truth: Truth::Ranked(Box::new(prompt), ranking),
            })
        })
        .collect()
}

/// The moves of a data line best first: by their evaluations (pawns, side to move),
/// highest first — the data lists them in another order, and its `B:` is not always the
/// best (docs/rookworld.md).
fn ranking(moves: &[String], evals: &[String]) -> Result<Vec<(String, f64)>, String> {
    if moves.len() != evals.len() {
        return Err(format!(
            "{} moves but {} evaluations",
            moves.len(),
            evals.len()
        ));
    }
    let mut ranked = moves
        .iter()
        .zip(evals)
        .map(|(m, e)| {
            let v: f64 = e
                .parse()
                .map_err(|_| format!("evaluation `{e}` is no number"))?;
            Ok((m.clone(), v))
        })
        .collect::<Result<Vec<_>, String>>()?;
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(ranked)
}

#[derive(serde::Deserialize)]
struct EnvLine {
    prompt: String,
    expected_fen: String,
}

fn environment_items(text: &str) -> Result<Vec<Item>, String> {
    let lines: Vec<EnvLine> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    lines
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let prompt = EnvPrompt::parse(&l.prompt).map_err(|e| format!("item {i}: {e}"))?;
            let truth = EnvTruth::of(&prompt);
            if truth.new_fen != l.expected_fen {
                return Err(format!(
                    "item {i}: the file expects {} but the move gives {}",
                    l.expected_fen, truth.new_fen
                ));
            }
            Ok(Item {
                prompt: l.prompt,
                truth: Truth::Next(Box::new(truth)),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(g: &Graded, name: &str) -> f64 {
        g.metrics.iter().find(|(n, _)| *n == name).unwrap().1
    }

    #[test]
    fn every_embedded_suite_loads_in_full() {
        assert_eq!(Suite::CheckmateInOne.items(None).unwrap().len(), 3500);
        assert_eq!(Suite::Policy.items(None).unwrap().len(), 500);
        assert_eq!(Suite::Environment.items(None).unwrap().len(), 221);
    }

    #[test]
    fn the_data_s_own_answers_grade_as_right() {
        // Every listed checkmate-in-one answer mates (3,500 of 3,500).
        let data: serde_json::Value =
            serde_json::from_str(Suite::CheckmateInOne.embedded()).unwrap();
        let items = Suite::CheckmateInOne.items(None).unwrap();
        for (item, p) in items.iter().zip(data["positions"].as_array().unwrap()) {
            let m = p["correct_move"].as_str().unwrap();
            let g = item.grade(&format!("M: {m}  E: 99.9  B: {m}"));
            assert_eq!(metric(&g, "mate"), 1.0, "{} {m}", item.prompt);
        }
        // Every real policy line's own answer is well formed, legal, and lists the
        // ranking in full; its `B:` is the engine's best on about half the lines: for
        // Black to move the data's `B:` is the 5th-ranked (docs/rookworld.md).
        let lines: Vec<&str> = Suite::Policy.embedded().lines().collect();
        let items = Suite::Policy.items(None).unwrap();
        let mut top1 = 0.0;
        for (item, line) in items.iter().zip(&lines) {
            let answer = &line[item.prompt.len()..];
            let g = item.grade(answer);
            assert_eq!(metric(&g, "well_formed"), 1.0, "{line}");
            assert_eq!(metric(&g, "legal_best"), 1.0, "{line}");
            assert_eq!(metric(&g, "top5_overlap"), 1.0, "{line}");
            top1 += metric(&g, "top1") / items.len() as f64;
        }
        assert!((0.45..0.7).contains(&top1), "{top1}");
        // Every environment item's true next state is exact in every field.
        for item in Suite::Environment.items(None).unwrap() {
            let Truth::Next(truth) = &item.truth else {
                panic!("an environment item")
            };
            let g = item.grade(&truth.completion());
            assert!(g.metrics.iter().all(|(_, v)| *v == 1.0), "{g:?}");
        }
    }

    #[test]
    fn a_mate_is_solved_whatever_mate_it_is_and_nothing_else_is() {
        // White to move: Qh5xf7# (scholar's mate); Qxf7 is the only mate here.
        let fen = "r1bqkb1r/pppp1ppp/2n2n2/4p2Q/2B1P3/8/PPPP1PPP/RNB1K1NR w KQkq - 4 4";
        let (_, prompt) = policy_of(fen).unwrap();
        let item = Item {
            prompt: policy_prompt(&prompt.position),
            truth: Truth::Mate(Box::new(prompt)),
        };
        let mate = item.grade("M: h5f7 c4f7  E: 99.9 1.0  B: h5f7");
        assert_eq!(
            (metric(&mate, "mate"), metric(&mate, "legal_best")),
            (1.0, 1.0)
        );
        let legal = item.grade("M: c4f7  E: 1.0  B: c4f7");
        assert_eq!(
            (metric(&legal, "mate"), metric(&legal, "legal_best")),
            (0.0, 1.0)
        );
        let illegal = item.grade("M: h5h8  E: 1.0  B: h5h8");
        assert_eq!(
            (metric(&illegal, "mate"), metric(&illegal, "legal_best")),
            (0.0, 0.0)
        );
        let malformed = item.grade("M: h5f7 E: 9");
        assert_eq!(malformed.verdict, "malformed");
        assert_eq!(metric(&malformed, "well_formed"), 0.0);
        assert!(malformed.detail.is_some());
        // Two mates in one: either solves (a listed answer is not the only mate).
        let fen = "6k1/5ppp/8/8/8/8/8/R3R1K1 w - - 0 1";
        let (_, prompt) = policy_of(fen).unwrap();
        let item = Item {
            prompt: String::new(),
            truth: Truth::Mate(Box::new(prompt)),
        };
        for m in ["a1a8", "e1e8"] {
            let g = item.grade(&format!("M: {m}  E: 99.9  B: {m}"));
            assert_eq!(metric(&g, "mate"), 1.0, "{m}");
        }
    }

    #[test]
    fn the_policy_suite_ranks_against_the_listed_engine_moves() {
        let items = Suite::Policy.items(None).unwrap();
        let Truth::Ranked(_, ranking) = &items[0].truth else {
            panic!("a ranked item")
        };
        let best = &ranking[0].0;
        let moves: Vec<&str> = ranking.iter().map(|(m, _)| m.as_str()).collect();
        let all = moves.join(" ");
        let g = items[0].grade(&format!(
            "M: {all}  E: {}  B: {best}",
            vec!["0.1"; ranking.len()].join(" ")
        ));
        assert_eq!((metric(&g, "top1"), metric(&g, "top5_overlap")), (1.0, 1.0));
        let (other, eval) = &ranking[ranking.len() - 1];
        let g = items[0].grade(&format!("M: {other}  E: 0.1  B: {other}"));
        assert_eq!(
            metric(&g, "top1"),
            f64::from(other == best || *eval == ranking[0].1)
        );
        assert!((metric(&g, "top5_overlap") - 1.0 / ranking.len() as f64).abs() < 1e-12);
        assert_eq!(metric(&items[0].grade("B:"), "well_formed"), 0.0);
    }

    #[test]
    fn the_environment_suite_grades_field_by_field() {
        let items = Suite::Environment.items(None).unwrap();
        let Truth::Next(truth) = &items[0].truth else {
            panic!("an environment item")
        };
        let right = items[0].grade(&truth.completion());
        assert!(right.metrics.iter().all(|(_, v)| *v == 1.0), "{right:?}");
        let mut fields: Vec<&str> = truth.new_fen.split(' ').collect();
        fields[1] = if fields[1] == "w" { "b" } else { "w" };
        let flipped = EnvTruth {
            new_fen: fields.join(" "),
            ..(**truth).clone()
        };
        let g = items[0].grade(&flipped.completion());
        assert_eq!((metric(&g, "exact_fen"), metric(&g, "side")), (0.0, 0.0));
        assert_eq!(metric(&g, "placement"), 1.0);
        let g = items[0].grade("not a state");
        assert_eq!((g.verdict, metric(&g, "well_formed")), ("malformed", 0.0));
    }

    #[test]
    fn bad_data_and_unknown_suites_are_one_clear_line() {
        let dir = tempfile::tempdir().unwrap();
        let err = Suite::CheckmateInOne.items(Some(dir.path())).unwrap_err();
        assert!(err.contains("bigbench_checkmate.json"), "{err}");
        std::fs::write(
            dir.path().join("bigbench_checkmate.json"),
            "{\"positions\": [",
        )
        .unwrap();
        let err = Suite::CheckmateInOne.items(Some(dir.path())).unwrap_err();
        assert!(
            err.contains("bigbench_checkmate.json") && !err.contains('\n'),
            "{err}"
        );
        std::fs::write(
            dir.path().join("rook_val_500.txt"),
            "P: not a fen M: a B: b\n",
        )
        .unwrap();
        let err = Suite::Policy.items(Some(dir.path())).unwrap_err();
        assert!(err.contains("line 1"), "{err}");
        let err = Suite::parse("chess960").unwrap_err();
        assert!(err.contains("checkmate-in-one"), "{err}");
    }
}
