//! Scoring items: the one code path the gRPC service, `score` and `bench` share.
//!
//! The rules work (parsing, legality, the true next state) runs on rayon's thread pool,
//! all cores at once; engine analyses of policy items then run concurrently on the
//! engine pool. A policy item whose engine query fails after every retry is scored on
//! rules alone (`engine_graded` false) and counted, never dropped.

use std::sync::Arc;

use rayon::prelude::*;

use crate::env_task;
use crate::error::RequestError;
use crate::metrics::names;
use crate::policy_task::{self, Checked};
use crate::score::{RewardConfig, Score};
use crate::stockfish::StockfishPool;
use crate::task::{EnvPrompt, PolicyPrompt, Task};

/// One completion to score.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub task: Task,
    pub prompt: String,
    pub completion: String,
}

/// Result of the rules pass of one item.
enum Ruled {
    Done(Score),
    /// A well-formed policy answer awaiting the engine.
    Policy(Box<PendingPolicy>),
}

/// A well-formed policy answer and its rules-only score (the fallback), before
/// engine grading.
struct PendingPolicy {
    prompt: PolicyPrompt,
    checked: Checked,
    rules: Score,
}

/// Scores items with the configured weights and, if present, the engine pool.
#[derive(Debug, Clone)]
pub struct Scorer {
    config: RewardConfig,
    engine: Option<Arc<StockfishPool>>,
}

impl Scorer {
    pub fn new(config: RewardConfig, engine: Option<Arc<StockfishPool>>) -> Self {
        Self { config, engine }
    }

    pub fn config(&self) -> &RewardConfig {
        &self.config
    }

    pub fn engine(&self) -> Option<&Arc<StockfishPool>> {
        self.engine.as_ref()
    }

    fn rules(&self, item: &Item) -> Result<Ruled, RequestError> {
        match item.task {
            Task::Environment => {
                let prompt = EnvPrompt::parse(&item.prompt)?;
                Ok(Ruled::Done(env_task::score(
                    &prompt,
                    &item.completion,
                    &self.config.environment,
                )))
            }
            Task::Policy => {
                let prompt = PolicyPrompt::parse(&item.prompt)?;
                Ok(match policy_task::check(&prompt, &item.completion) {
                    Err(malformed) => Ruled::Done(malformed),
                    Ok(checked) => {
                        let rules = policy_task::score_rules(&checked, &self.config.policy);
                        if self.engine.is_some() {
                            Ruled::Policy(Box::new(PendingPolicy {
                                prompt,
                                checked,
                                rules,
                            }))
                        } else {
                            Ruled::Done(rules)
                        }
                    }
                })
            }
        }
    }

    /// Scores one item on rules alone (the engine is not consulted).
    pub fn score_rules(&self, item: &Item) -> Result<Score, RequestError> {
        Ok(match self.rules(item)? {
            Ruled::Done(score) => score,
            Ruled::Policy(pending) => pending.rules,
        })
    }

    /// Rules-only scores of every item, in parallel on the current rayon pool: what
    /// [`Scorer::score_each`] computes when no engine is configured.
    pub fn rules_batch(&self, items: &[Item]) -> Vec<Result<Score, RequestError>> {
        items.par_iter().map(|i| self.score_rules(i)).collect()
    }

    /// Scores every item, in order, each to its own result: rules in parallel on all
    /// cores, then engine grading concurrently.
    pub async fn score_each(&self, items: &[Item]) -> Vec<Result<Score, RequestError>> {
        let this = self.clone();
        let owned = items.to_vec();
        if self.engine.is_none() {
            return tokio::task::spawn_blocking(move || this.rules_batch(&owned))
                .await
                .expect("rules pass does not panic");
        }
        let ruled: Vec<Result<Ruled, RequestError>> =
            tokio::task::spawn_blocking(move || owned.par_iter().map(|i| this.rules(i)).collect())
                .await
                .expect("rules pass does not panic");
        let engine = self.engine.as_ref().expect("checked above");
        let mut tasks = tokio::task::JoinSet::new();
        let mut out: Vec<Option<Result<Score, RequestError>>> = Vec::with_capacity(ruled.len());
        for (index, r) in ruled.into_iter().enumerate() {
            match r {
                Ok(Ruled::Policy(pending)) => {
                    let PendingPolicy {
                        prompt,
                        checked,
                        rules,
                    } = *pending;
                    let (engine, weights) = (engine.clone(), self.config.policy.clone());
                    tasks.spawn(async move {
                        let score = match engine.analyse(&prompt.position).await {
                            Ok(analysis) => {
                                policy_task::score_engine(&checked, &analysis, &weights)
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "engine failed; scoring on rules alone");
                                metrics::counter!(names::ENGINE_FAILURES_TOTAL).increment(1);
                                rules
                            }
                        };
                        (index, score)
                    });
                    out.push(None);
                }
                Ok(Ruled::Done(s)) => out.push(Some(Ok(s))),
                Err(e) => out.push(Some(Err(e))),
            }
        }
        while let Some(joined) = tasks.join_next().await {
            let (index, score) = joined.expect("engine grading does not panic");
            out[index] = Some(Ok(score));
        }
        out.into_iter()
            .map(|r| r.expect("every item scored"))
            .collect()
    }
}
