//! Where a run starts: a fresh policy after the supervised warm-up, or a checkpoint, with
//! the weight version that goes on from it.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use candle_core::DType;
use rookworld_lm::model_io;
use tokio::sync::watch;

use super::config::ConfigError;
use super::error::TrainError;
use super::plan::Plan;
use super::report::TrainSummary;
use super::settings::{RESUMABLE, TrainSettings};
use super::state::Run;
use crate::checkpoint::{self, Loaded};
use crate::prompts::{self, Generator, Source};
use crate::queue::{Queue, QueueHandle};
use crate::run_dir;
use rookworld_train::optim::AdamW;
use rookworld_train::policy::Trainable;

/// Loads or resumes the policy, the reference and the queue; runs the warm-up on a fresh
/// start. `None` when `stop` came during the warm-up: it ends within one of its steps and
/// leaves no checkpoint (a warm-up is not resumed: the next run starts afresh).
pub(super) fn prepare(
    plan: &Plan,
    summary: &mut TrainSummary,
    stop: &watch::Receiver<bool>,
) -> Result<Option<Run>, TrainError> {
    let (s, model, out) = (&plan.settings, &plan.model, &plan.outputs);
    let settings_json = serde_json::to_value(s).expect("settings serialise");
    let mut source = match &plan.data.prompts {
        Some(path) => Source::File {
            prompts: prompts::load(path)?,
            next: 0,
        },
        None => Source::Generated(Box::new(Generator::new(s.seed, s.policy_fraction))),
    };
    // Configured here, then handed to its own thread (QueueHandle) for the run.
    let mut queue = Queue::new(s.queue_config());
    let reference_dir = out.run_dir.join("reference");
    // Opened once: the policy, the reference, the evaluations and a local worker's
    // kernels are this open's verdict.
    let (device, kernels) = model.start.open()?;
    // A fresh start's context is its model's, known before anything is written; a resumed
    // run's is its checkpoint's, checked once loaded.
    let fresh = !out.start.resume && out.start.resume_from.is_none();
    if fresh {
        check_context(s, &source, model.start.config()?.n_positions)?;
    }
    log_resources(plan, &device)?;
    let opened = run_dir::open(
        &out.run_dir,
        &out.start,
        &device,
        run_dir::Expect {
            settings: &settings_json,
            resumable: RESUMABLE,
            steps: s.steps,
        },
    )?;
    let resumed = opened.loaded.is_some();
    let run_id = run_dir::run_id(&out.run_dir, !resumed)?;
    queue.set_run(&run_id);
    tracing::info!(run = %run_id, "run id");
    let (policy, opt, step, version) = match opened.loaded {
        Some(Loaded {
            dir,
            policy,
            opt,
            state,
        }) => {
            check_context(s, &source, policy.model.config().n_positions)?;
            source.restore(&state.cursor)?;
            if let Some(snapshot) = state.queue {
                queue.restore(snapshot);
            }
            // Checkpoints from before versions were kept: the version was the step.
            let saved = if state.version > 0 {
                state.version
            } else {
                state.step
            };
            let version = resumed_version(&out.run_dir, saved, &mut queue)?;
            tracing::info!(step = state.step, version, dir = %dir.display(), "resumed");
            let mut policy = policy;
            policy.model.set_kernels(kernels.clone());
            model.matmul_precision.apply(&mut policy.model);
            policy
                .set_step_path(model.step_path, &model.start.kernels)
                .map_err(ConfigError::Conflict)?;
            (policy, opt, state.step, version)
        }
        None => {
            let loaded = model.start.load_on((device.clone(), kernels.clone()))?;
            tracing::info!(source = %loaded.source, device = ?loaded.device, "starting weights");
            let mut policy = Trainable::from_model(&loaded.model)?;
            model.matmul_precision.apply(&mut policy.model);
            // Before the warm-up, which runs on the same pass.
            policy
                .set_step_path(model.step_path, &model.start.kernels)
                .map_err(ConfigError::Conflict)?;
            // A fresh start was checked before the run directory was opened; a --resume
            // that found no checkpoint is checked here, on the weights it starts from.
            if !fresh {
                check_context(s, &source, policy.model.config().n_positions)?;
            }
            if s.sft_steps > 0 {
                tracing::info!(steps = s.sft_steps, "supervised warm-up");
                let warm = s.warm_up();
                let engine = plan.data.engine.clone();
                summary.warm_up = std::thread::scope(|scope| {
                    scope
                        .spawn(|| {
                            let stopped = || *stop.borrow();
                            crate::sft::warm_up(&policy, &warm, engine, stopped, |r| {
                                if r.step % 10 == 0 || r.step == warm.steps {
                                    tracing::info!(
                                        step = r.step,
                                        loss = format!("{:.4}", r.loss),
                                        seconds = format!("{:.2}", r.seconds),
                                        "warm-up"
                                    );
                                }
                            })
                        })
                        .join()
                        .expect("warm-up thread")
                })?;
                let done = summary.warm_up.len() as u64;
                if done < warm.steps {
                    tracing::info!(
                        step = done,
                        steps = warm.steps,
                        "stopped during the supervised warm-up: no checkpoint (the next run starts afresh)"
                    );
                    return Ok(None);
                }
            }
            // The reference is the policy GRPO starts from (after any warm-up).
            model_io::save(&policy.model, &reference_dir, DType::F32)?;
            // A new run counts its versions from 1; its run id tells them apart.
            (policy, AdamW::new(s.adamw()), 0, 1)
        }
    };
    tracing::info!(
        matmul_precision = ?model.matmul_precision,
        matmuls = ?policy.model.matmul_dtype().unwrap_or(DType::F32),
        step_path = ?model.step_path,
        pass = ?policy.pass(),
        "learner precision"
    );
    // Version 0 is whatever weights a worker started with, never the learner's.
    queue.retire(0, 0);
    let reference = if s.objective.beta > 0.0 {
        let mut reference = model_io::load(&reference_dir, DType::F32, policy.model.device())?;
        reference.set_kernels(policy.model.kernels().clone());
        model.matmul_precision.apply(&mut reference);
        Some(reference)
    } else {
        None
    };
    Ok(Some(Run {
        policy,
        reference,
        opt,
        step,
        source,
        queue: QueueHandle::start(queue),
        version: Arc::new(AtomicU64::new(version)),
        run_id,
        settings_json,
        resumed,
        eval: None,
        record: None,
        _lock: opened.lock,
    }))
}

/// Logs what the run will hold in memory and write to disk ([`Resources::estimate`]).
fn log_resources(plan: &Plan, device: &candle_core::Device) -> Result<(), TrainError> {
    use super::resources::{Resources, size};
    use rookworld_lm::cpu_gemm::PanelDtype;
    let n = plan.model.start.config()?.num_parameters() as u64;
    let worker = if plan.services.local {
        let (dtype, panels) = plan.services.rollout_weight_dtype.resolve(device)?;
        let panels = match panels {
            PanelDtype::F32 => 0,
            PanelDtype::Bf16 => 2,
            PanelDtype::Int8 => 1,
        };
        Some(dtype.size_in_bytes() as u64 + panels)
    } else {
        None
    };
    let s = &plan.settings;
    let r = Resources::estimate(
        n,
        s.objective.beta > 0.0,
        worker,
        s.steps,
        plan.schedule.checkpoint_every,
    );
    tracing::info!(
        memory = %size(r.memory),
        disk = %size(r.disk()),
        checkpoint = %size(r.checkpoint),
        checkpoints = r.checkpoints,
        "resources, estimated (memory before the step's activations and KV caches; disk at \
         the run's end, every checkpoint kept)"
    );
    Ok(())
}

/// The weight version a run resumed from weights of version `saved` goes on with. When the
/// run had published later versions before it stopped (it crashed between checkpoints),
/// workers may hold those: the resumed weights take the version after the highest one
/// published, and the versions in between are retired in `queue` (their groups dropped).
fn resumed_version(
    run_dir: &std::path::Path,
    saved: u64,
    queue: &mut Queue,
) -> Result<u64, TrainError> {
    let published = checkpoint::published(run_dir)?.unwrap_or(saved);
    if published <= saved {
        return Ok(saved);
    }
    tracing::warn!(
        checkpoint_version = saved,
        published,
        "the run published weights after its last checkpoint; those versions are retired and the resumed weights are version {}",
        published + 1
    );
    queue.retire(saved + 1, published);
    Ok(published + 1)
}

/// Prompts measured for the context check when they are generated.
const CONTEXT_SAMPLE: usize = 256;

/// Refuses, before any work, a `--max-new-tokens` that leaves the prompts no room in the
/// model's context (every completion would overflow it and be refused at submission, and
/// the run would never step). Prompts from a file are all measured; generated ones, the
/// first [`CONTEXT_SAMPLE`] the run will lease.
fn check_context(s: &TrainSettings, source: &Source, context: usize) -> Result<(), ConfigError> {
    let tokenizer = rookworld_lm::Tokenizer::gpt2();
    let tokens = |p: &prompts::TaskPrompt| {
        tokenizer
            .encode(&p.prompt)
            .map(|ids| ids.len() + 1) // BOS
            .map_err(|e| ConfigError::Value(format!("tokenising a prompt: {e}")))
    };
    let mut longest = 0;
    match source {
        Source::File { prompts, .. } => {
            for p in prompts {
                longest = longest.max(tokens(p)?);
            }
        }
        Source::Generated(g) => {
            let mut g = g.clone();
            for _ in 0..CONTEXT_SAMPLE {
                longest = longest.max(tokens(&g.next_prompt())?);
            }
        }
    }
    rookworld_service::validate::fits_context(
        s.sampling.max_new_tokens as usize,
        longest,
        "the longest prompt",
        context,
    )
}
