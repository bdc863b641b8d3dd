//! The engine pool against a real Stockfish: analyses, cache, crash and hang recovery.
//! Skipped, with a visible message, where Stockfish is not installed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rookworld_chess::score::{RewardConfig, Verdict};
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::stockfish::{SearchLimit, StockfishConfig, StockfishPool};
use rookworld_chess::task::Task;

fn position(fen: &str) -> Option<shakmaty::Chess> {
    rookworld_chess::rules::standard(fen).ok()
}

fn stockfish() -> Option<PathBuf> {
    rookworld_chess::stockfish::stockfish_for_tests()
}

fn config(path: PathBuf) -> StockfishConfig {
    StockfishConfig {
        limit: SearchLimit::Depth(8),
        timeout: Duration::from_secs(5),
        ..StockfishConfig::new(path)
    }
}

fn signal(pid: u32, sig: &str) {
    assert!(
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

#[tokio::test]
async fn multipv_analysis_and_the_cache() {
    let Some(sf) = stockfish() else { return };
    let pool = StockfishPool::start(config(sf)).await.unwrap();
    let start = position("rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1").unwrap();
    let a = pool.analyse(&start).await.unwrap();
    assert_eq!(a.lines.len(), 5);
    assert!(
        a.lines.iter().all(|l| l.eval_pawns.abs() < 2.0),
        "{:?}",
        a.lines
    );
    let b = pool.analyse(&start).await.unwrap();
    assert!(Arc::ptr_eq(&a, &b), "second query is a cache hit");
    // Fewer lines where fewer moves are legal; mate scores near ±1000.
    let mate_in_one = position("6k1/5ppp/8/8/8/8/8/R5K1 w - - 0 1").unwrap();
    let m = pool.analyse(&mate_in_one).await.unwrap();
    assert_eq!(m.lines[0].uci, "a1a8");
    assert!(m.lines[0].eval_pawns > 999.0);
    let two_moves = position("k7/8/1Q6/8/8/8/8/7K b - - 0 1").unwrap();
    assert!(pool.analyse(&two_moves).await.unwrap().lines.len() <= 2);
}

#[tokio::test]
async fn a_killed_engine_is_replaced_and_the_query_answered() {
    let Some(sf) = stockfish() else { return };
    let pool = StockfishPool::start(config(sf)).await.unwrap();
    let before = pool.idle_pids().await;
    signal(before[0], "-9");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let pos = position("r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3").unwrap();
    let a = pool.analyse(&pos).await.unwrap();
    assert!(!a.lines.is_empty());
    let after = pool.idle_pids().await;
    assert_eq!(after.len(), 1);
    assert_ne!(after, before, "the dead engine was replaced");
}

#[tokio::test]
async fn a_hung_engine_times_out_and_is_replaced() {
    let Some(sf) = stockfish() else { return };
    let mut cfg = config(sf);
    // The search deadline only: starts keep their own (longer) one, so a loaded CI
    // machine's slow start is not mistaken for the hang under test.
    cfg.timeout = Duration::from_millis(3000);
    let pool = StockfishPool::start(cfg).await.unwrap();
    let before = pool.idle_pids().await;
    signal(before[0], "-STOP");
    let pos = position("rnbqkb1r/pppppppp/5n2/8/3P4/8/PPP1PPPP/RNBQKBNR w KQkq - 1 2").unwrap();
    let a = pool.analyse(&pos).await.unwrap();
    assert!(!a.lines.is_empty());
    assert_ne!(pool.idle_pids().await, before);
}

#[tokio::test]
async fn a_missing_engine_binary_is_a_start_error() {
    let err = StockfishPool::start(StockfishConfig::new("/nonexistent/stockfish"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/stockfish"), "{err}");
}

#[tokio::test]
async fn policy_answers_are_graded_against_the_engine() {
    let Some(sf) = stockfish() else { return };
    let pool = Arc::new(StockfishPool::start(config(sf)).await.unwrap());
    let scorer = Scorer::new(RewardConfig::default(), Some(pool.clone()));
    let prompt =
        "P: r1bqkbnr/pppp1ppp/2n5/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 2 3    ".to_string();
    let best = pool
        .analyse(&position(prompt[3..].trim()).unwrap())
        .await
        .unwrap();
    let engine_moves: Vec<String> = best.lines.iter().map(|l| l.uci.clone()).collect();
    let evals: Vec<String> = best
        .lines
        .iter()
        .map(|l| format!("{:.2}", l.eval_pawns))
        .collect();
    let perfect = format!(
        "M: {}  E: {}  B: {}",
        engine_moves.join(" "),
        evals.join(" "),
        engine_moves[0]
    );
    let poor = "M: a2a3 h2h4  E: 5.0 -5.0  B: h2h4".to_string();
    let scores = scorer
        .score_each(&[
            Item {
                task: Task::Policy,
                prompt: prompt.clone(),
                completion: perfect,
            },
            Item {
                task: Task::Policy,
                prompt: prompt.clone(),
                completion: poor,
            },
        ])
        .await;
    let (perfect, poor) = (scores[0].as_ref().unwrap(), scores[1].as_ref().unwrap());
    assert!(perfect.engine_graded && poor.engine_graded);
    assert_eq!(perfect.verdict, Verdict::Exact, "{perfect:?}");
    assert!(poor.reward < 0.6, "{poor:?}");
    let component = |s: &rookworld_chess::score::Score, k: &str| {
        s.components.iter().find(|(n, _)| *n == k).unwrap().1
    };
    assert_eq!(component(perfect, "best_rank"), 1.0);
    assert!(component(poor, "candidate_overlap") < 1.0);
}
