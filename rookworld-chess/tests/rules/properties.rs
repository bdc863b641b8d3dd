//! Property tests: no input panics; the truth scores the maximum and every
//! single-character corruption of its FEN scores less.

use proptest::prelude::*;
use rand::SeedableRng;
use rookworld_chess::env_task::EnvTruth;
use rookworld_chess::playout::random_position;
use rookworld_chess::score::{MAX_REWARD, RewardConfig};
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::task::{EnvPrompt, Task};
use shakmaty::uci::UciMove;
use shakmaty::{CastlingMode, Position};

const START_A: &str = "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+";
const START_P: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    ";

fn scorer() -> Scorer {
    Scorer::new(RewardConfig::default(), None)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_completion_scores_without_panicking(completion in any::<String>(), task in prop::bool::ANY) {
        let (task, prompt) = if task { (Task::Environment, START_A) } else { (Task::Policy, START_P) };
        let score = scorer().score_rules(&Item { task, prompt: prompt.into(), completion }).unwrap();
        prop_assert!((-1.0..=1.0).contains(&score.reward));
    }

    #[test]
    fn chess_shaped_garbage_scores_without_panicking(completion in "[a-hKQRBNPkqrbnp1-8/ +.0-9MEB:-]{0,120}") {
        for (task, prompt) in [(Task::Environment, START_A), (Task::Policy, START_P)] {
            let score = scorer().score_rules(&Item { task, prompt: prompt.into(), completion: completion.clone() }).unwrap();
            prop_assert!((-1.0..=1.0).contains(&score.reward));
        }
    }

    #[test]
    fn any_prompt_is_scored_or_refused_without_panicking(prompt in any::<String>(), completion in any::<String>()) {
        for task in [Task::Environment, Task::Policy] {
            let _ = scorer().score_rules(&Item { task, prompt: format!("A: {prompt}"), completion: completion.clone() });
            let _ = scorer().score_rules(&Item { task, prompt: prompt.clone(), completion: completion.clone() });
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_legal_move_s_truth_scores_max_and_fen_corruptions_less(seed in any::<u64>()) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let (pos, history) = random_position(&mut rng, 120);
        let fen = rookworld_chess::rules::fen(&pos);
        for m in pos.legal_moves() {
            let uci = UciMove::from_move(m, CastlingMode::Standard).to_string();
            let mut h = history.clone();
            h.push(uci.clone());
            let prompt = format!("A: {fen}+{uci}+{}+", h[h.len().saturating_sub(10)..].join(" "));
            let truth = EnvTruth::of(&EnvPrompt::parse(&prompt).unwrap()).completion();
            let item = Item { task: Task::Environment, prompt: prompt.clone(), completion: truth.clone() };
            prop_assert_eq!(scorer().score_rules(&item).unwrap().reward, MAX_REWARD);

            let fen_len = truth.find('+').unwrap();
            for i in 0..fen_len {
                let original = truth.as_bytes()[i];
                for replacement in [b'1', b'p', b'K', b' ', b'w', b'-', b'x'] {
                    if replacement == original { continue; }
                    let mut bytes = truth.clone().into_bytes();
                    bytes[i] = replacement;
                    let corrupted = String::from_utf8(bytes).unwrap();
                    let score = scorer().score_rules(&Item { completion: corrupted.clone(), ..item.clone() }).unwrap();
                    prop_assert!(score.reward < MAX_REWARD, "{} scored {}", corrupted, score.reward);
                }
            }
        }
    }
}
