//! `learner train`: the GRPO loop against the rollout queue.
//!
//! The command line becomes a typed plan first (`plan`: the model, the data, the
//! schedule, the settings, the services, the outputs), checked before any work; the run
//! reads only the plan. Where it starts is `prepare`'s, what it serves beside training
//! `services`', one step `trainer`'s; the state between steps and its checkpoint are
//! `state`'s.
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
mod error;
mod gather;
mod local;
mod plan;
mod prepare;
mod report;
mod resources;
mod services;
mod settings;
mod state;
mod trainer;
mod watchdog;

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{ConfigError, TrainArgs};
pub use error::TrainError;
use plan::Plan;
pub use report::{StepRecord, StepSeconds, TrainSummary, print_summary, reward_trend};
pub use settings::{RESUMABLE, TrainSettings};

use gather::rand_seed_stream;
use prepare::prepare;
use report::Reporter;
use services::Services;
use trainer::{Stepped, Trainer, peak_flops};
use watchdog::Watchdog;

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
    let plan = Plan::of(&args)?;
    let s = &plan.settings;
    services::check(&plan).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let mut summary = TrainSummary::default();
    let prepared = tokio::task::block_in_place(|| prepare(&plan, &mut summary, &stop_rx))?;
    let Some(mut run) = prepared else {
        summary.interrupted = true;
        return Ok(summary);
    };
    {
        // The device is open and its kernels checked: the model's and the step's verdicts.
        use rookworld_lm::kernels::Family;
        let model = run.policy.model.kernels().disabled();
        let step = run.policy.step_kernels().disabled();
        crate::metrics::record_kernel_fallbacks(
            model
                .into_iter()
                .map(|k| k.name())
                .chain(step.into_iter().map(|k| k.name())),
        );
    }
    if let Some(settings) = &plan.outputs.record {
        let origin = plan.model.origin(run.policy.model.device());
        run.record = Some(crate::run_record::write(
            &plan.outputs.run_dir,
            settings,
            &origin,
            run.resumed,
        )?);
    }
    if run.resumed && run.step >= s.steps {
        let line = format!(
            "all {} steps of {} are done: nothing to train; to train on, resume with more steps (--resume --steps {})",
            s.steps,
            plan.outputs.run_dir.display(),
            s.steps * 2
        );
        tracing::info!("{line}");
        summary.already_done = Some(line);
        return Ok(summary);
    }
    let services = Services::start(&plan, &run, listener).await?;
    let mut reporter = Reporter::new(
        plan.outputs.log_jsonl.as_deref(),
        plan.outputs.rollout_dump.as_deref(),
        plan.outputs.tensorboard.as_deref(),
        plan.outputs.progress,
        s.steps,
        run.step,
        // A resumed run redoes the steps after its checkpoint; one started over, all.
        run.resumed || plan.outputs.start.overwrite,
    )?;
    let step_cfg = s.step_config(run.policy.model.device());
    let mut trainer = Trainer {
        plan: &plan,
        peak: peak_flops(&plan, &run.policy.model),
        seeds: rand_seed_stream(s.seed, run.step),
        run: &mut run,
        exporter: &services.exporter,
        evaluator: services.evaluator.as_ref(),
        fleet: &services.fleet,
        reporter: &mut reporter,
        schedule: s.schedule(),
        step_cfg,
        stop: stop_rx.clone(),
        watchdog: Watchdog::new(plan.schedule.stall, Instant::now()),
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
        if step.is_multiple_of(plan.schedule.checkpoint_every) && step < s.steps {
            let run = &*trainer.run;
            summary.checkpoint = Some(tokio::task::block_in_place(|| {
                run.save(&plan.outputs.run_dir, s.schedule())
            })?);
        }
    }
    reporter.finish();
    // The last version reaches the weight sync before it stops.
    services.exporter.flush()?;

    // Stop leasing, let groups in flight come in, keep everything unfinished.
    run.queue.run(|q| q.close()).await;
    run.queue.drain(plan.schedule.drain).await;
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
    summary.checkpoint = Some(tokio::task::block_in_place(|| {
        run.save(&plan.outputs.run_dir, s.schedule())
    })?);
    tracing::info!(
        step = run.step,
        checkpoint = %summary.checkpoint.as_ref().expect("just written").display(),
        interrupted = summary.interrupted,
        "checkpoint written; stopping"
    );
    services.stop(&plan).await;
    match stalled {
        Some(why) => Err(TrainError::Stalled(why)),
        None => Ok(summary),
    }
}
