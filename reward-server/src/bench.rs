//! `reward-server bench`: verifications per second through the scoring code path, one
//! thread and all cores, on seeded random positions.
//!
//! Items: environment items whose completion is the true next state (the common case
//! in training, and the most work: the FEN must be built and compared) and policy items
//! with five random legal candidates (format + legality, no engine). `--write-items`
//! saves them so `bench/compare_python_chess.py` times python-chess on the same items.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rookworld_service::logging::Progress;
use shakmaty::uci::UciMove;
use shakmaty::{CastlingMode, Position};

use rookworld_chess::env_task::EnvTruth;
use rookworld_chess::playout::random_position;
use rookworld_chess::rules::fen;
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::task::{EnvPrompt, Task};

/// Options of `reward-server bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Items per task.
    #[arg(long, allow_negative_numbers = true, default_value_t = 20_000)]
    pub items: usize,
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
    /// Timed repetitions; the best is reported.
    #[arg(long, allow_negative_numbers = true, default_value_t = 3)]
    pub repeat: usize,
    /// Write the generated items as JSONL (for the python-chess comparison).
    #[arg(long)]
    pub write_items: Option<PathBuf>,
}

/// Environment items with true completions and policy items with random legal
/// candidates, `n` of each, from `seed`.
pub fn generate_items(n: usize, seed: u64) -> (Vec<Item>, Vec<Item>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut env = Vec::with_capacity(n);
    let mut pol = Vec::with_capacity(n);
    while env.len() < n {
        let (pos, mut history) = random_position(&mut rng, 120);
        let moves = pos.legal_moves();
        let m = *moves.choose(&mut rng).expect("position has a legal move");
        let uci = UciMove::from_move(m, CastlingMode::Standard).to_string();
        history.push(uci.clone());
        let tail = &history[history.len().saturating_sub(10)..];
        let prompt = format!("A: {}+{}+{}+", fen(&pos), uci, tail.join(" "));
        let truth = EnvTruth::of(&EnvPrompt::parse(&prompt).expect("generated prompt is valid"));
        env.push(Item {
            task: Task::Environment,
            prompt,
            completion: truth.completion(),
        });

        let k = moves.len().min(5);
        let cands: Vec<String> = moves
            .choose_multiple(&mut rng, k)
            .map(|m| UciMove::from_move(*m, CastlingMode::Standard).to_string())
            .collect();
        let evals: Vec<String> = (0..k)
            .map(|_| format!("{:.2}", rng.random_range(-5.0..5.0)))
            .collect();
        pol.push(Item {
            task: Task::Policy,
            prompt: format!("P: {:<90}", fen(&pos)),
            completion: format!(
                "M: {:<30}E: {:<40}B: {}",
                cands.join(" "),
                evals.join(" "),
                cands[0]
            ),
        });
    }
    (env, pol)
}

/// Best-of-`repeat` items per second for scoring `items` on a pool of `threads`.
fn rate(
    scorer: &Scorer,
    items: &[Item],
    threads: usize,
    repeat: usize,
    runs: &mut Progress,
) -> f64 {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let mut best = f64::INFINITY;
    for _ in 0..repeat.max(1) {
        let start = Instant::now();
        let scores = pool.install(|| scorer.rules_batch(items));
        let seconds = start.elapsed().as_secs_f64();
        best = best.min(seconds);
        runs.tick(&format!(
            "{} items on {threads} threads: {seconds:.2} s",
            items.len()
        ));
        assert!(
            scores.iter().all(Result::is_ok),
            "bench items are valid requests"
        );
    }
    items.len() as f64 / best
}

/// Runs the benchmark and prints one JSON object.
pub fn run(args: &BenchArgs, out: &mut impl Write) -> std::io::Result<()> {
    rookworld_service::validate::at_least("--items", args.items as u64, 1)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let (env, pol) = generate_items(args.items, args.seed);
    if let Some(path) = &args.write_items {
        let mut text = Vec::new();
        for it in env.iter().chain(&pol) {
            let line = serde_json::json!({"task": it.task.label(), "prompt": it.prompt, "completion": it.completion});
            writeln!(text, "{line}")?;
        }
        rookworld_service::files::write_atomic(path, &text)?;
    }
    let scorer = Scorer::new(RewardConfig::default(), None);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let r = args.repeat;
    let mut runs = Progress::new("bench run", 0, 4 * r.max(1) as u64, true);
    let report = serde_json::json!({
        "items_per_task": args.items,
        "cores": cores,
        "environment_per_second": {"one_thread": rate(&scorer, &env, 1, r, &mut runs), "all_cores": rate(&scorer, &env, cores, r, &mut runs)},
        "policy_per_second": {"one_thread": rate(&scorer, &pol, 1, r, &mut runs), "all_cores": rate(&scorer, &pol, cores, r, &mut runs)},
    });
    writeln!(out, "{report}")
}
