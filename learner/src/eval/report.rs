//! What an evaluation reports: per suite the mean of every metric over all completions,
//! pass@1 and pass@K of its primary metric, verdict counts and speed; the table a terminal
//! shows, and the JSONL dump of every graded completion.

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

use super::suites::{Completions, Graded, Item, Suite};

/// The whole evaluation: one JSON object (`--out`, or stdout off a terminal).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub samples: usize,
    pub temperature: f32,
    /// What ranks the policy suite's moves: the data lines' evaluations or `--engine`.
    pub policy_ranking: String,
    pub suites: Vec<SuiteReport>,
}

/// One suite's results.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    pub suite: &'static str,
    pub items: usize,
    pub completions: usize,
    /// Each metric's mean over all completions (each in [0, 1]).
    pub metrics: BTreeMap<&'static str, f64>,
    /// The metric pass@k is of (`mate`, `top1`, `exact_fen`).
    pub primary: &'static str,
    /// pass@1 = mean over items of c/n (c of the item's n completions pass).
    pub pass_at_1: f64,
    /// pass@K = the fraction of items with at least one passing completion (K = n).
    pub pass_at_k: f64,
    pub k: usize,
    /// The reward server's mean reward in [−1, 1].
    pub mean_reward: f64,
    pub verdicts: BTreeMap<&'static str, usize>,
    pub seconds: f64,
    pub items_per_second: f64,
}

impl SuiteReport {
    /// The report of `graded` completions (by item, then sample) of `suite`.
    pub fn of(suite: Suite, graded: &[Completions], seconds: f64) -> Self {
        let primary = suite.primary();
        let all: Vec<&Graded> = graded.iter().flatten().map(|(_, g)| g).collect();
        let n = all.len().max(1) as f64;
        let mut metrics = BTreeMap::new();
        let mut verdicts = BTreeMap::new();
        for g in &all {
            for (name, value) in &g.metrics {
                *metrics.entry(*name).or_insert(0.0) += value / n;
            }
            *verdicts.entry(g.verdict).or_insert(0) += 1;
        }
        let passes = |samples: &Completions| {
            samples
                .iter()
                .filter(|(_, g)| g.metrics.iter().any(|(m, v)| *m == primary && *v >= 1.0))
                .count()
        };
        let items = graded.len().max(1) as f64;
        let pass_at_1 = graded
            .iter()
            .map(|s| passes(s) as f64 / s.len().max(1) as f64)
            .sum::<f64>()
            / items;
        let pass_at_k = graded.iter().filter(|s| passes(s) > 0).count() as f64 / items;
        Self {
            suite: suite.name(),
            items: graded.len(),
            completions: all.len(),
            metrics,
            primary,
            pass_at_1,
            pass_at_k,
            k: graded.iter().map(Vec::len).max().unwrap_or(0),
            mean_reward: all.iter().map(|g| g.reward).sum::<f64>() / n,
            verdicts,
            seconds,
            items_per_second: graded.len() as f64 / seconds.max(1e-9),
        }
    }
}

impl Report {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "model: {}   samples per item: {}   temperature: {}\npolicy moves ranked by: {}\n",
            self.model, self.samples, self.temperature, self.policy_ranking
        );
        for s in &self.suites {
            out += &format!(
                "\n{} — {} items, {:.1} items/s\n  {:<14} {:>7.1}%   pass@{}: {:.1}%\n",
                s.suite,
                s.items,
                s.items_per_second,
                format!("pass@1 {}", s.primary),
                100.0 * s.pass_at_1,
                s.k,
                100.0 * s.pass_at_k,
            );
            for (name, value) in &s.metrics {
                out += &format!("  {name:<14} {:>7.1}%\n", 100.0 * value);
            }
            out += &format!("  {:<14} {:>8.3}\n", "mean reward", s.mean_reward);
        }
        out
    }
}

/// One JSON line per graded completion of `suite`.
pub fn dump(
    out: &mut impl Write,
    suite: Suite,
    items: &[Item],
    graded: &[Completions],
) -> std::io::Result<()> {
    for (i, (item, samples)) in items.iter().zip(graded).enumerate() {
        for (k, (completion, g)) in samples.iter().enumerate() {
            let metrics: BTreeMap<&str, f64> = g.metrics.iter().copied().collect();
            let line = serde_json::json!({
                "suite": suite.name(),
                "item": i,
                "sample": k,
                "prompt": item.prompt,
                "completion": completion,
                "verdict": g.verdict,
                "reward": g.reward,
                "metrics": metrics,
                "detail": g.detail,
            });
            writeln!(out, "{line}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graded(mate: bool) -> (String, Graded) {
        (
            String::new(),
            Graded {
                metrics: vec![("mate", f64::from(mate)), ("legal_best", 1.0)],
                verdict: "partial",
                reward: 0.5,
                detail: None,
            },
        )
    }

    #[test]
    fn pass_at_1_averages_each_items_rate_and_pass_at_k_counts_any_pass() {
        // Item 0: 1 of 4 pass; item 1: 0 of 4; item 2: 4 of 4.
        let g = vec![
            vec![graded(true), graded(false), graded(false), graded(false)],
            vec![graded(false); 4],
            vec![graded(true); 4],
        ];
        let r = SuiteReport::of(Suite::CheckmateInOne, &g, 2.0);
        assert!((r.pass_at_1 - (0.25 + 0.0 + 1.0) / 3.0).abs() < 1e-12);
        assert!((r.pass_at_k - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!((r.k, r.items, r.completions), (4, 3, 12));
        assert!((r.metrics["mate"] - 5.0 / 12.0).abs() < 1e-12);
        assert_eq!(r.verdicts["partial"], 12);
        assert!((r.items_per_second - 1.5).abs() < 1e-12);
    }
}
