//! Every parser the reward server runs on untrusted text (the chess rules'): prompts of both tasks, and
//! completions of both tasks against a fixed valid prompt. None may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::task::Task;

const START_A: &str = "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+";
const START_P: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data).into_owned();
    let scorer = Scorer::new(RewardConfig::default(), None);
    for (task, prompt) in [(Task::Environment, START_A), (Task::Policy, START_P)] {
        let _ = scorer.score_rules(&Item { task, prompt: prompt.into(), completion: text.clone() });
        let _ = scorer.score_rules(&Item { task, prompt: text.clone(), completion: String::new() });
    }
});
