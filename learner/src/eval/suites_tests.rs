//! The suites' data and grading.

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
    let data: serde_json::Value = serde_json::from_str(Suite::CheckmateInOne.embedded()).unwrap();
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
    let err = Suite::CheckmateInOne
        .items(Some(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("bigbench_checkmate.json"), "{err}");
    std::fs::write(
        dir.path().join("bigbench_checkmate.json"),
        "{\"positions\": [",
    )
    .unwrap();
    let err = Suite::CheckmateInOne
        .items(Some(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bigbench_checkmate.json") && !err.contains('\n'),
        "{err}"
    );
    std::fs::write(
        dir.path().join("rook_val_500.txt"),
        "P: not a fen M: a B: b\n",
    )
    .unwrap();
    let err = Suite::Policy
        .items(Some(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 1"), "{err}");
    let err = Suite::parse("chess960").unwrap_err().to_string();
    assert!(err.contains("checkmate-in-one"), "{err}");
}
