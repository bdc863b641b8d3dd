//! Real RookWorld data through the scorer.

use rookworld_chess::env_task::EnvTruth;
use rookworld_chess::score::{MAX_REWARD, MIN_REWARD, RewardConfig, Verdict};
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::task::{EnvPrompt, Task};

fn fixture(rel: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/rookworld")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn scorer() -> Scorer {
    Scorer::new(RewardConfig::default(), None)
}

#[test]
fn every_validation_line_is_a_well_formed_legal_policy_answer() {
    let text = fixture("rook_val_500.txt");
    let mut n = 0;
    for line in text.lines() {
        let m = line.find("M:").expect("line has M:");
        let item = Item {
            task: Task::Policy,
            prompt: line[..m].to_owned(),
            completion: line[m..].to_owned(),
        };
        let score = scorer()
            .score_rules(&item)
            .unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(score.verdict, Verdict::Exact, "{line}: {score:?}");
        assert_eq!(score.reward, MAX_REWARD);
        // The same answer split after the prompt's padding and `M:` scores the same.
        let split = Item {
            task: Task::Policy,
            prompt: line[..m + 2].to_owned(),
            completion: line[m + 2..].to_owned(),
        };
        assert_eq!(scorer().score_rules(&split).unwrap().reward, MAX_REWARD);
        n += 1;
    }
    assert_eq!(n, 500);
}

const EXAMPLE_PROMPT: &str = "A: 5R2/6R1/8/3P4/p7/1b2R2P/2p3P1/6K1 b - - 0 58+b3d5+e1e3 a2b3 f7f2 b5b4 g5g7 b4c3 f2f8 c3c2 d4d5 b3d5+";
const EXAMPLE_COMPLETION: &str = "5R2/6R1/8/3b4/p7/4R2P/2p3P1/6K1 w - - 0 59+0.001+0+0";

#[test]
fn the_documented_environment_example_scores_the_maximum() {
    // The example's Black has no king; python-chess, which made the data, plays it anyway.
    let item = Item {
        task: Task::Environment,
        prompt: EXAMPLE_PROMPT.into(),
        completion: EXAMPLE_COMPLETION.into(),
    };
    let score = scorer().score_rules(&item).unwrap();
    assert_eq!(
        (score.reward, score.verdict),
        (MAX_REWARD, Verdict::Exact),
        "{score:?}"
    );
    let truth = EnvTruth::of(&EnvPrompt::parse(EXAMPLE_PROMPT).unwrap());
    assert_eq!(truth.completion(), EXAMPLE_COMPLETION);
    // With a trailing newline (the model's end of line) it is still exact.
    let item = Item {
        completion: format!("{EXAMPLE_COMPLETION}\n"),
        ..item
    };
    assert_eq!(scorer().score_rules(&item).unwrap().reward, MAX_REWARD);
}

#[test]
fn the_opening_set_expected_fens_are_the_truth() {
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&fixture("opening_dataset_eval.json")).unwrap();
    assert_eq!(cases.len(), 221);
    for case in cases {
        let prompt = EnvPrompt::parse(case["prompt"].as_str().unwrap()).unwrap();
        assert_eq!(
            EnvTruth::of(&prompt).new_fen,
            case["expected_fen"].as_str().unwrap()
        );
    }
}

#[test]
fn real_model_outputs_score_by_field_and_malformed_ones_score_the_minimum() {
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&fixture("exact_match_eval_results.json")).unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let generated = case["generated"].as_str().unwrap();
        let item = Item {
            task: Task::Environment,
            prompt: case["prompt"].as_str().unwrap().into(),
            completion: generated.into(),
        };
        let score = scorer().score_rules(&item).unwrap();
        let fen_right = generated.split('+').next() == case["expected"].as_str();
        match score.verdict {
            Verdict::Malformed => assert_eq!(score.reward, MIN_REWARD),
            Verdict::Exact => assert!(fen_right, "{generated}"),
            Verdict::Partial => assert!((0.0..MAX_REWARD).contains(&score.reward)),
        }
        if fen_right && generated.ends_with("+0.001+0+0") {
            assert_eq!(score.verdict, Verdict::Exact, "{generated}");
        }
    }
}
