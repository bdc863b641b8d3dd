//! `learner eval --engine PATH`: the policy suite graded against the user's own UCI engine
//! (Stockfish), which re-analyses every position (multipv 5, a fixed depth) instead of
//! the evaluations written on the data lines.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rookworld_chess::stockfish::{SearchLimit, StockfishConfig, StockfishPool};

use super::error::EvalError;
use super::suites::Item;

/// How the policy suite's positions are re-analysed.
#[derive(Debug, Clone, Copy)]
pub struct Reanalysis {
    /// Search depth of each position.
    pub depth: u32,
    /// Engine processes searching at once.
    pub processes: usize,
}

impl Reanalysis {
    /// How a report names the ranking `path` gives.
    pub fn describe(&self, path: &Path) -> String {
        format!("{} (multipv 5, depth {})", path.display(), self.depth)
    }

    /// Re-ranks every policy item of `items` by `path`'s analysis, best first; other items
    /// are left alone. A path that is no UCI engine, or an engine that keeps failing, is
    /// one clear error.
    /// A signal (`stop`) ends it within a tenth of a second with [`EvalError::Stopped`].
    pub fn rerank(
        &self,
        items: &mut [Item],
        path: &Path,
        stop: &AtomicBool,
    ) -> Result<(), EvalError> {
        let positions: Vec<_> = items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| item.ranked_position().map(|p| (i, p.clone())))
            .collect();
        if positions.is_empty() {
            return Ok(());
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(reanalysis)?;
        let cfg = StockfishConfig {
            processes: self.processes.max(1),
            limit: SearchLimit::Depth(self.depth),
            multipv: 5,
            timeout: Duration::from_secs(120),
            ..StockfishConfig::new(path)
        };
        runtime.block_on(async {
            let pool = Arc::new(StockfishPool::start(cfg).await.map_err(reanalysis)?);
            let mut searches = tokio::task::JoinSet::new();
            for (i, position) in positions {
                let pool = pool.clone();
                searches.spawn(async move { (i, pool.analyse(&position).await) });
            }
            let mut watch = tokio::time::interval(Duration::from_millis(100));
            loop {
                let done = tokio::select! {
                    done = searches.join_next() => done,
                    _ = watch.tick() => {
                        if stop.load(Ordering::Relaxed) {
                            searches.abort_all();
                            return Err(EvalError::Stopped);
                        }
                        continue;
                    }
                };
                let Some(done) = done else { break };
                let (i, analysis) = done.map_err(reanalysis)?;
                let analysis = analysis.map_err(reanalysis)?;
                let ranking = analysis
                    .lines
                    .iter()
                    .map(|l| (l.uci.clone(), l.eval_pawns))
                    .collect();
                items[i].rerank(ranking);
            }
            Ok(())
        })
    }
}

/// The engine's failure, as the evaluation's.
fn reanalysis(e: impl std::error::Error + Send + Sync + 'static) -> EvalError {
    EvalError::Reanalysis(Box::new(e))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::eval::Suite;

    fn stockfish() -> Option<PathBuf> {
        rookworld_chess::stockfish::stockfish_for_tests()
    }

    #[test]
    fn the_engine_ranks_the_policy_positions_and_its_best_move_is_top_1() {
        let Some(sf) = stockfish() else { return };
        let mut items = Suite::Policy.items(None).unwrap();
        items.truncate(4);
        let before: Vec<_> = items.iter().map(|i| i.grade("B:")).collect();
        let r = Reanalysis {
            depth: 6,
            processes: 2,
        };
        r.rerank(&mut items, &sf, &AtomicBool::new(false)).unwrap();
        assert!(r.describe(&sf).contains("depth 6"));
        for (item, before) in items.iter().zip(before) {
            let position = item.ranked_position().unwrap().clone();
            let legal = shakmaty::Position::legal_moves(&position);
            // The engine's moves, best first, each legal, five where there are five.
            let lines = item.ranking().unwrap().to_vec();
            assert_eq!(lines.len(), legal.len().min(5), "{}", item.prompt);
            let all: Vec<&str> = lines.iter().map(|(m, _)| m.as_str()).collect();
            let evals = vec!["0.0"; all.len()].join(" ");
            let g = item.grade(&format!("M: {}  E: {evals}  B: {}", all.join(" "), all[0]));
            let metric = |n: &str| g.metrics.iter().find(|(m, _)| *m == n).unwrap().1;
            assert_eq!((metric("top1"), metric("top5_overlap")), (1.0, 1.0));
            assert!(lines.windows(2).all(|w| w[0].1 >= w[1].1), "{lines:?}");
            // A malformed answer grades as before.
            assert_eq!(item.grade("B:"), before);
        }
    }

    #[test]
    fn a_path_that_is_no_engine_is_one_clear_error() {
        let mut items = Suite::Policy.items(None).unwrap();
        items.truncate(1);
        let r = Reanalysis {
            depth: 1,
            processes: 1,
        };
        let err = r
            .rerank(
                &mut items,
                Path::new("/nonexistent/stockfish"),
                &AtomicBool::new(false),
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--engine") && err.contains("/nonexistent/stockfish"),
            "{err}"
        );
        assert!(!err.contains('\n'));
    }
}
