//! Evaluation during `learner train` (`--eval-every N`): the suites run on a thread of
//! their own, on a model built from the BF16 weights the run published (what the workers
//! sample from), while training goes on. They never touch the rollout queue.
//!
//! One evaluation runs at a time. When the next one is due while one still runs, it waits
//! for it; when yet another comes due meanwhile, the newest replaces the waiting one (the
//! skipped evaluation is counted): training never waits for an evaluation, and the
//! evaluations follow the newest weights. After the last step the run waits for the
//! evaluation of its final weights, which goes into the final checkpoint.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::Device;
use rookworld_generation::EngineConfig;
use rookworld_lm::kernels::Kernels;
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Config, Gpt2, Tokenizer};
use rookworld_weights::set::{WeightSet, build_model};
use serde::Serialize;
use tokio::sync::watch;

use super::{EvalError, Evaluation, Item, Suite, SuiteReport};
use crate::metrics::names;
use crate::settings::ConfigError;

/// `learner train`'s evaluation options.
#[derive(Debug, Clone, clap::Args)]
pub struct PeriodicArgs {
    /// Evaluate the weights every N steps and after the last step (0: never), greedily,
    /// on a thread of its own beside training; results go to --log-jsonl and --tensorboard
    /// (`eval/<suite>/<metric>`), Prometheus (`learner_eval`) and, for the final weights,
    /// the last checkpoint's trainer_state.json.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_EVAL_EVERY",
        default_value_t = 0
    )]
    pub eval_every: u64,
    /// Suites evaluated, comma-separated: checkmate-in-one, policy, environment.
    #[arg(
        long,
        env = "LEARNER_EVAL_SUITES",
        value_delimiter = ',',
        default_value = "checkmate-in-one,policy,environment"
    )]
    pub eval_suites: Vec<String>,
    /// Items of each suite per evaluation (its first M).
    #[arg(long, env = "LEARNER_EVAL_LIMIT", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_limit: u64,
    /// A directory with replacements of the suites' data files (`learner eval --data-dir`).
    #[arg(long, env = "LEARNER_EVAL_DATA_DIR")]
    pub eval_data_dir: Option<PathBuf>,
}

impl PeriodicArgs {
    /// Whether the weights after `step` are evaluated (`last`: the run's final step).
    pub fn due(&self, step: u64, last: bool) -> bool {
        self.eval_every > 0 && (last || step.is_multiple_of(self.eval_every))
    }

    /// The suites and their items, when evaluation is on: a bad suite name or data file
    /// fails here, before the run starts.
    pub fn suites(&self) -> Result<Vec<(Suite, Vec<Item>)>, EvalError> {
        if self.eval_every == 0 {
            return Ok(Vec::new());
        }
        self.eval_suites
            .iter()
            .map(|name| {
                let suite = Suite::parse(name)
                    .map_err(|e| ConfigError::Value(format!("--eval-suites: {e}")))?;
                let mut items = suite.items(self.eval_data_dir.as_deref())?;
                items.truncate(usize::try_from(self.eval_limit).unwrap_or(usize::MAX));
                Ok((suite, items))
            })
            .collect()
    }
}

/// The evaluation of one version of the weights.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The step after which the weights were published.
    pub step: u64,
    pub version: u64,
    pub seconds: f64,
    pub suites: Vec<SuiteReport>,
}

impl Outcome {
    /// `eval/<suite>/<metric>` and its value: every metric's mean and the mean reward.
    pub fn flat(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for s in &self.suites {
            for (metric, v) in &s.metrics {
                out.push((format!("eval/{}/{metric}", s.suite), *v));
            }
            out.push((format!("eval/{}/mean_reward", s.suite), s.mean_reward));
        }
        out
    }

    /// The `--log-jsonl` line: the step and version it evaluated, the seconds it took and
    /// every `eval/<suite>/<metric>`.
    pub fn json_line(&self) -> serde_json::Value {
        let mut line = serde_json::Map::new();
        line.insert("step".into(), self.step.into());
        line.insert("version".into(), self.version.into());
        line.insert("eval/seconds".into(), self.seconds.into());
        for (key, v) in self.flat() {
            line.insert(key, v.into());
        }
        serde_json::Value::Object(line)
    }

    /// Sets the `learner_eval{suite,metric}` gauges and `learner_eval_step`.
    pub fn record_metrics(&self) {
        for s in &self.suites {
            for (metric, v) in s
                .metrics
                .iter()
                .map(|(m, v)| (*m, *v))
                .chain([("mean_reward", s.mean_reward)])
            {
                metrics::gauge!(names::EVAL, "suite" => s.suite, "metric" => metric).set(v);
            }
        }
        metrics::gauge!(names::EVAL_STEP).set(self.step as f64);
        metrics::histogram!(names::EVAL_SECONDS).record(self.seconds);
    }
}

/// Which weights to evaluate: those published as `version` after `step`.
#[derive(Debug, Clone, Copy)]
struct Job {
    step: u64,
    version: u64,
}

/// The thread's jobs: the one it runs next (asked for while it was idle, so never
/// replaced) and the one waiting behind it (replaced by a newer request).
#[derive(Debug)]
struct State {
    next: Option<Job>,
    waiting: Option<Job>,
    /// The thread has nothing to run: neither running, nor a job taken.
    idle: bool,
    closed: bool,
}

impl Default for State {
    fn default() -> Self {
        Self {
            next: None,
            waiting: None,
            idle: true,
            closed: false,
        }
    }
}

impl State {
    /// Adds `job`: the next to run when the thread is idle (even before it has started),
    /// else the waiting one; returns the waiting job it replaced.
    fn push(&mut self, job: Job) -> Option<Job> {
        if self.idle {
            self.idle = false;
            self.next = Some(job);
            None
        } else {
            self.waiting.replace(job)
        }
    }

    /// The job to run now, or `None` (and the thread idle) when there is none.
    fn take(&mut self) -> Option<Job> {
        let job = self.next.take().or_else(|| self.waiting.take());
        self.idle = job.is_none();
        job
    }
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
}

/// The evaluation thread of a training run.
pub struct Evaluator {
    shared: Arc<Shared>,
    results: mpsc::Receiver<Result<Outcome, EvalError>>,
    thread: Option<JoinHandle<()>>,
}

impl Evaluator {
    /// Starts the thread: it evaluates `suites` on the weights `published` carries, built
    /// like `cfg` on `device` (f32 on the CPU, BF16 on CUDA) with its `kernels`.
    pub fn start(
        suites: Vec<(Suite, Vec<Item>)>,
        cfg: Config,
        (device, kernels): (Device, Kernels),
        published: watch::Receiver<Option<Arc<WeightSet>>>,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let (tx, results) = mpsc::channel();
        metrics::counter!(names::EVALS_SKIPPED_TOTAL).increment(0);
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("eval".into())
            .spawn(move || {
                let mut worker = Worker {
                    suites,
                    cfg,
                    device,
                    kernels,
                    published,
                    tokenizer: Tokenizer::gpt2(),
                    spare: None,
                };
                while let Some(job) = next_job(&thread_shared) {
                    let outcome = worker.evaluate(job, &thread_shared.stop);
                    if tx.send(outcome).is_err() {
                        return;
                    }
                }
            })
            .expect("the evaluation thread starts");
        Self {
            shared,
            results,
            thread: Some(thread),
        }
    }

    /// Asks for the evaluation of `version`, published after `step`: it runs next when
    /// the thread is idle, else waits, replacing a request still waiting (counted as
    /// skipped).
    pub fn request(&self, step: u64, version: u64) {
        let mut state = lock(&self.shared.state);
        if let Some(old) = state.push(Job { step, version }) {
            tracing::warn!(
                step = old.step,
                "evaluation skipped: the one before it still runs (raise --eval-every or lower --eval-limit)"
            );
            metrics::counter!(names::EVALS_SKIPPED_TOTAL).increment(1);
        }
        self.shared.wake.notify_all();
    }

    /// The evaluations finished since the last call (failures are logged and left out).
    pub fn finished(&self) -> Vec<Outcome> {
        self.results.try_iter().filter_map(keep).collect()
    }

    /// No more requests: the thread finishes what was asked for, then ends.
    pub fn close(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_all();
    }

    /// Whether the thread has ended (after [`Self::close`], once everything asked for is
    /// evaluated; collect the last results with [`Self::finished`]).
    pub fn done(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Abandons whatever runs or waits (within a decode step) and stops the thread.
    fn abandon(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Evaluator {
    fn drop(&mut self) {
        self.abandon();
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn keep(r: Result<Outcome, EvalError>) -> Option<Outcome> {
    r.map_err(|e| tracing::warn!(error = %e, "evaluation failed"))
        .ok()
}

/// The next job, or `None` once closed with nothing waiting (or stopped).
fn next_job(shared: &Shared) -> Option<Job> {
    let mut state = lock(&shared.state);
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(job) = state.take() {
            return Some(job);
        }
        if state.closed {
            return None;
        }
        state = shared
            .wake
            .wait(state)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }
}

/// What the thread holds.
struct Worker {
    suites: Vec<(Suite, Vec<Item>)>,
    cfg: Config,
    device: Device,
    kernels: Kernels,
    published: watch::Receiver<Option<Arc<WeightSet>>>,
    tokenizer: Tokenizer,
    /// The last evaluation's model, whose memory the next one is built into.
    spare: Option<Gpt2>,
}

impl Worker {
    fn evaluate(&mut self, job: Job, stop: &AtomicBool) -> Result<Outcome, EvalError> {
        let started = Instant::now();
        let weights = self.weights(job.version, stop)?;
        // A newer version may have replaced the one asked for: the newer is evaluated.
        let job = Job {
            step: job.step + (weights.version - job.version),
            version: weights.version,
        };
        let dtype = rookworld_lm::device::default_dtype(&self.device);
        let model = build_model(
            &weights.bytes,
            &self.cfg,
            (dtype, Default::default()),
            (&self.device, &self.kernels),
            self.spare.take(),
        )?;
        drop(weights);
        let model = Arc::new(model);
        let mut suites = Vec::new();
        for (suite, items) in &self.suites {
            let eval = Evaluation {
                model: model.clone(),
                tokenizer: &self.tokenizer,
                engine: EngineConfig::default(),
                sampling: SamplingParams::greedy(),
                samples: 1,
                max_new_tokens: rookworld_lm::cli::DEFAULT_MAX_NEW_TOKENS as usize,
                seed: 0,
                stop: Some(stop),
                progress: None,
            };
            let (report, _) = eval.suite(*suite, items)?;
            suites.push(report);
        }
        self.spare = Arc::into_inner(model);
        let outcome = Outcome {
            step: job.step,
            version: job.version,
            seconds: started.elapsed().as_secs_f64(),
            suites,
        };
        tracing::info!(
            step = outcome.step,
            seconds = format!("{:.1}", outcome.seconds),
            "{}",
            outcome
                .suites
                .iter()
                .map(|s| format!("{} {} {:.3}", s.suite, s.primary, s.pass_at_1))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(outcome)
    }

    /// The published weights of `version` or newer, once the exporter has them.
    fn weights(&self, version: u64, stop: &AtomicBool) -> Result<Arc<WeightSet>, EvalError> {
        loop {
            if let Some(set) = self.published.borrow().as_ref()
                && set.version >= version
            {
                return Ok(set.clone());
            }
            if stop.load(Ordering::Relaxed) || self.published.has_changed().is_err() {
                return Err(EvalError::NeverPublished(version));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: PeriodicArgs,
    }

    #[test]
    fn a_request_made_while_idle_runs_and_only_the_waiting_one_is_replaced() {
        let job = |step| Job {
            step,
            version: step + 1,
        };
        let mut state = State::default();
        // Asked before the thread took anything (it may not have started): it runs.
        assert!(state.push(job(0)).is_none());
        assert!(state.push(job(2)).is_none());
        // A third while the first has not even been taken replaces only the second.
        assert_eq!(state.push(job(4)).map(|j| j.step), Some(2));
        assert_eq!(state.take().map(|j| j.step), Some(0));
        assert_eq!(state.take().map(|j| j.step), Some(4));
        assert!(state.take().is_none());
        // Idle again: the next request runs next.
        assert!(state.push(job(6)).is_none());
        assert_eq!(state.take().map(|j| j.step), Some(6));
    }

    #[test]
    fn evaluations_are_due_every_n_steps_and_after_the_last_and_never_when_off() {
        let every3 = Cli::parse_from(["x", "--eval-every", "3"]).args;
        let due: Vec<u64> = (1..=10).filter(|&s| every3.due(s, s == 10)).collect();
        assert_eq!(due, [3, 6, 9, 10]);
        let off = Cli::parse_from(["x"]).args;
        assert!(!(1..=10).any(|s| off.due(s, s == 10)));
        assert!(off.suites().unwrap().is_empty());
        let some = Cli::parse_from(["x", "--eval-every", "1", "--eval-limit", "2"]).args;
        let suites = some.suites().unwrap();
        assert_eq!(suites.len(), 3);
        assert!(suites.iter().all(|(_, items)| items.len() == 2));
    }
}
