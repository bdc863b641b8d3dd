//! `learner train`: the GRPO loop against the rollout queue.
//!
//! Each step takes P scored groups from the queue (waiting for workers as needed; groups
//! too many versions behind are dropped and counted), trains on them in micro-batches,
//! bumps the weight version and publishes the new BF16 weights (the optimizer writes them
//! as it updates each parameter; they are hashed off this thread, [`rookworld_weights::export`]), which
//! the weight sync ([`crate::push`]) brings to every registered worker in the background
//! (each push has its own deadline, so a slow worker holds up nobody).
//!
//! Weight versions never repeat within a run: the learner's first weights are version 1
//! (0 is whatever a worker started with), every published version is recorded before it
//! goes out, and a run resumed after a crash numbers its weights past every version the
//! crashed process may have published, retiring those (their groups are dropped and
//! counted). Checkpoints keep the model, optimizer, prompt cursor, weight version and the
//! queue's unfinished prompts and counters, so `--resume` loses nothing. On shutdown the
//! queue stops leasing, groups in flight are waited for (bounded), a checkpoint is written
//! and the run returns.

mod config;
mod gather;
mod local;
mod prepare;
mod report;
mod services;
mod settings;
mod support;
mod trainer;
mod watchdog;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use rookworld_lm::Gpt2;
use rookworld_service::serve::stopped as until;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{ConfigError, TrainArgs};
pub use report::{StepRecord, StepSeconds, print_summary, reward_trend};
pub use settings::{RESUMABLE, TrainSettings};

use crate::checkpoint;
use crate::eval::periodic::Outcome;
use crate::prompts::{self, Source};
use crate::queue::QueueHandle;
use gather::rand_seed_stream;
use prepare::prepare;
use report::Reporter;
use rookworld_train::optim::AdamW;
use rookworld_train::policy::Trainable;
use services::Services;
use support::{drain, peak_flops, save};
use trainer::{Stepped, Trainer};
use watchdog::Watchdog;

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    RunDir(#[from] crate::run_dir::RunDirError),
    #[error(transparent)]
    Prompts(#[from] prompts::PromptError),
    #[error("supervised warm-up: {0}")]
    WarmUp(#[from] crate::sft::SftError),
    #[error(transparent)]
    Report(#[from] report::ReportError),
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    #[error("the queue's listener: {0}")]
    Listener(#[source] std::io::Error),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("metrics on {addr}: {source}")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: rookworld_service::metrics_http::MetricsError,
    },
    #[error("local services: {0}")]
    LocalServices(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Export(#[from] rookworld_weights::export::ExportError),
    /// No step for `--stall-timeout`; the message says what the run was waiting on.
    #[error("{0}")]
    Stalled(String),
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

/// What a run did in this process.
#[derive(Debug, Default)]
pub struct TrainSummary {
    pub warm_up: Vec<crate::sft::SftStep>,
    pub steps: Vec<StepRecord>,
    /// Whether it stopped on the shutdown signal before its last step.
    pub interrupted: bool,
    /// The checkpoint written last.
    pub checkpoint: Option<std::path::PathBuf>,
    /// The evaluations (`--eval-every`), in the order they finished.
    pub evals: Vec<Outcome>,
    /// A resumed run had done all its steps already: what to do instead.
    pub already_done: Option<String>,
}

/// Where the run stands.
struct Run {
    policy: Trainable,
    reference: Option<Gpt2>,
    opt: AdamW,
    step: u64,
    source: Source,
    queue: QueueHandle,
    version: Arc<AtomicU64>,
    /// The run's id ([`crate::run_dir::run_id`]), carried by every push.
    run_id: String,
    settings_json: serde_json::Value,
    /// Whether it continues from a checkpoint.
    resumed: bool,
    /// The newest evaluation (`--eval-every`).
    eval: Option<Outcome>,
    /// `RUN/config.toml`'s text ([`crate::run_record`]), kept in every checkpoint.
    record: Option<String>,
    /// The run directory's lock, held until the run ends.
    _lock: crate::run_lock::RunLock,
}

/// What a resume of `learner train` does with each of its options (the run-directories
/// page's lists).
pub fn resume_rules() -> crate::run_dir::ResumeRules {
    use clap::Args;
    crate::run_dir::ResumeRules::of(
        &TrainArgs::augment_args(clap::Command::new("train")),
        &TrainSettings::augment_args(clap::Command::new("settings")),
        RESUMABLE,
    )
}

/// Runs `learner train` with the queue on `listener` until the last step or `shutdown`.
pub async fn run(
    args: TrainArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<TrainSummary, TrainError> {
    let s = args.settings.clone();
    let checked = services::check(&args).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let mut summary = TrainSummary::default();
    let prepared = tokio::task::block_in_place(|| prepare(&args, &mut summary, &stop_rx))?;
    let Some(mut run) = prepared else {
        summary.interrupted = true;
        return Ok(summary);
    };
    crate::metrics::record_kernel_fallbacks(); // the device is open: its kernels are checked
    run.record = support::write_record(&args, &run)?;
    if run.resumed && run.step >= s.steps {
        let line = format!(
            "all {} steps of {} are done: nothing to train; to train on, resume with more steps (--resume --steps {})",
            s.steps,
            args.run_dir.display(),
            s.steps * 2
        );
        tracing::info!("{line}");
        summary.already_done = Some(line);
        return Ok(summary);
    }
    let services = Services::start(&args, &run, checked, listener).await?;
    let mut reporter = Reporter::new(
        args.log_jsonl.as_deref(),
        args.rollout_dump.as_deref(),
        args.tensorboard_dir().as_deref(),
        !args.no_progress,
        s.steps,
        run.step,
        // A resumed run redoes the steps after its checkpoint; one started over, all.
        run.resumed || args.start.overwrite,
    )?;
    let step_cfg = s.step_config(run.policy.model.device());
    let mut trainer = Trainer {
        args: &args,
        s: &s,
        peak: peak_flops(&args, &run.policy.model),
        seeds: rand_seed_stream(s.seed, run.step),
        run: &mut run,
        exporter: &services.exporter,
        evaluator: services.evaluator.as_ref(),
        fleet: &services.fleet,
        reporter: &mut reporter,
        schedule: s.schedule(),
        step_cfg,
        stop: stop_rx.clone(),
        watchdog: Watchdog::new(args.stall_timeout(), Instant::now()),
    };
    let mut stalled = None;
    while trainer.run.step < s.steps {
        let record = match trainer.step().await? {
            Stepped::Trained(record) => record,
            Stepped::Stopped => {
                summary.interrupted = true;
                break;
            }
            Stepped::Stalled(why) => {
                summary.interrupted = true;
                stalled = Some(why);
                break;
            }
        };
        trainer.reporter.step(&record)?;
        summary.steps.push(*record);
        for outcome in trainer.evaluator.iter().flat_map(|ev| ev.finished()) {
            trainer.reporter.eval(&outcome)?;
            summary.evals.push(outcome.clone());
            trainer.run.eval = Some(outcome);
        }
        let step = trainer.run.step;
        if step.is_multiple_of(args.checkpoint_every.max(1)) && step < s.steps {
            let run = &*trainer.run;
            summary.checkpoint = Some(tokio::task::block_in_place(|| save(&args, run))?);
        }
    }
    reporter.finish();
    // The last version reaches the weight sync before it stops.
    services.exporter.flush()?;

    // Stop leasing, let groups in flight come in, keep everything unfinished.
    run.queue.run(|q| q.close()).await;
    drain(&run.queue, args.drain_timeout()).await;
    if let Some(ev) = &services.evaluator
        && !summary.interrupted
    {
        // A finished run waits for its final weights' evaluation; a stopped one does not.
        ev.close();
        let mut stop = stop_rx.clone();
        while !ev.done() && !*stop.borrow() {
            tokio::select! {
                _ = stop.wait_for(|&s| s) => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        for outcome in ev.finished() {
            reporter.eval(&outcome)?;
            summary.evals.push(outcome.clone());
            run.eval = Some(outcome);
        }
    }
    summary.checkpoint = Some(tokio::task::block_in_place(|| save(&args, &run))?);
    tracing::info!(
        step = run.step,
        checkpoint = %summary.checkpoint.as_ref().expect("just written").display(),
        interrupted = summary.interrupted,
        "checkpoint written; stopping"
    );
    services.stop(&args).await;
    match stalled {
        Some(why) => Err(TrainError::Stalled(why)),
        None => Ok(summary),
    }
}
