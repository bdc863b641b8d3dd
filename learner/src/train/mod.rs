//! `learner train`: the GRPO loop against the rollout queue.
//!
//! Each step takes P scored groups from the queue (waiting for workers as needed; groups
//! too many versions behind are dropped and counted), trains on them in micro-batches,
//! bumps the weight version and hands the new BF16 weights to every registered worker in
//! the background (each push has its own deadline, so a slow worker holds up nobody).
//! Checkpoints keep the model, optimizer, prompt cursor and the queue's unfinished
//! prompts, so `--resume` loses nothing. On shutdown the queue stops leasing, groups in
//! flight are waited for (bounded), a checkpoint is written and the run returns.

mod config;
mod local;
mod report;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use rollout_worker::weights::WeightSet;
use rookworld_lm::{Gpt2, checkpoint as model_checkpoint};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::{ConfigError, TrainArgs, TrainSettings};
pub use report::{StepRecord, StepSeconds};

use crate::batch::GrpoBatch;
use crate::checkpoint::{self, TrainerState};
use crate::optim::AdamW;
use crate::policy::Trainable;
use crate::prompts::{self, Generator, Source};
use crate::push::Fleet;
use crate::queue::{Queue, ScoredGroup};
use crate::queue_service::{self, GroupSpec, QueueServer};
use crate::step::train_step;
use report::Reporter;

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
    Prompts(#[from] prompts::PromptError),
    #[error("supervised warm-up: {0}")]
    WarmUp(#[from] crate::sft::SftError),
    #[error("{0}")]
    Service(String),
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
}

/// Where the run stands.
struct Run {
    policy: Trainable,
    reference: Option<Gpt2>,
    opt: AdamW,
    step: u64,
    source: Source,
    queue: Arc<Mutex<Queue>>,
    version: Arc<AtomicU64>,
    settings_json: serde_json::Value,
}

fn lock(q: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    q.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `learner train` with the queue on `listener` until the last step or `shutdown`.
pub async fn run(
    args: TrainArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<TrainSummary, TrainError> {
    let s = args.settings.clone();
    s.validate()?;
    let token = args.token()?;
    let token = match (token, args.local) {
        (Some(t), _) => t,
        // One process on loopback: a fresh random token guards it.
        (None, true) => format!("local-{:016x}", rand::random::<u64>()),
        (None, false) => {
            return Err(ConfigError(
                "the learner needs the shared token (--token, --token-file or ROOKWORLD_TOKEN)"
                    .into(),
            )
            .into());
        }
    };
    if let Some(reward) = args.reward.as_ref().filter(|_| !args.local) {
        check_reachable(reward, Duration::from_secs_f64(args.reward_wait.max(0.0))).await?;
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let mut summary = TrainSummary::default();
    let mut run = tokio::task::block_in_place(|| prepare(&args, &mut summary))?;
    let queue_addr = listener
        .local_addr()
        .map_err(|e| TrainError::Service(e.to_string()))?;
    let spec = GroupSpec {
        num_completions: s.group_size,
        sampling: s.sampling(),
    };
    let server = QueueServer::new(
        run.queue.clone(),
        spec,
        Some(token.clone()),
        run.version.clone(),
    );
    let (server_stop, server_stopped) = watch::channel(false);
    let queue_task = tokio::spawn(queue_service::run(server, listener, until(server_stopped)));
    tracing::info!(queue = %queue_addr, step = run.step, version = run.version.load(Ordering::SeqCst), "learner ready");

    let local = if args.local {
        let weights = WeightSet::from_model(&run.policy.model, run.version.load(Ordering::SeqCst))?;
        Some(
            local::LocalServices::start(queue_addr, &weights, run.policy.model.config(), &token)
                .await
                .map_err(|e| TrainError::Service(format!("local services: {e}")))?,
        )
    } else {
        None
    };
    let fleet = Arc::new(tokio::sync::Mutex::new(Fleet::default()));
    if let Some(l) = &local {
        // It already runs the current version.
        let mut f = fleet.lock().await;
        f.register(&l.worker);
        f.mark(&l.worker, run.version.load(Ordering::SeqCst));
    }
    let mut reporter = Reporter::new(
        args.log_jsonl.as_deref(),
        args.rollout_dump.as_deref(),
        !args.no_progress,
        s.steps,
        run.step,
    )
    .map_err(ConfigError)?;
    let peak = peak_flops(&args, run.policy.model.device());
    let step_cfg = s.step_config();
    let schedule = s.schedule();
    let mut seeds = rand_seed_stream(s.seed, run.step);

    let mut stop = stop_rx.clone();
    while run.step < s.steps {
        let started = Instant::now();
        let Some(groups) = gather(&mut run, &s, &mut seeds, &mut stop).await else {
            summary.interrupted = true;
            break;
        };
        let wait = started.elapsed().as_secs_f64();
        reporter.dump(run.step + 1, &groups).map_err(ConfigError)?;
        let version = run.version.load(Ordering::SeqCst);
        let batch = to_batch(&groups);
        let report = tokio::task::block_in_place(|| {
            train_step(
                &run.policy,
                run.reference.as_ref(),
                &mut run.opt,
                &schedule,
                run.step,
                &batch,
                &step_cfg,
            )
        })?;
        run.step += 1;
        let new_version = version + 1;
        run.version.store(new_version, Ordering::SeqCst);

        let push_started = Instant::now();
        if run.step % args.push_every.max(1) == 0 || run.step == s.steps {
            push(&run, &fleet, &token, args.push_timeout(), new_version)?;
        }
        let push = push_started.elapsed().as_secs_f64();

        let mut record = StepRecord {
            step: run.step,
            version: new_version,
            loss: report.loss,
            policy_loss: report.policy_loss,
            kl: report.kl,
            grad_norm: report.grad_norm,
            lr: report.lr,
            clip_frac: report.clip_frac,
            tokens: report.tokens,
            groups: groups.len(),
            skipped_groups: report.skipped_groups,
            dropped_stale_total: lock(&run.queue).depths().counters.groups_dropped_stale,
            staleness_mean: groups
                .iter()
                .map(|g| version.saturating_sub(g.weight_version) as f64)
                .sum::<f64>()
                / groups.len() as f64,
            ..StepRecord::default()
        };
        record.rewards_of(&groups);
        record.step_seconds = StepSeconds {
            total: started.elapsed().as_secs_f64(),
            wait,
            forward_backward: report.forward_backward_seconds,
            optimizer: report.optimizer_seconds,
            push,
        };
        let flops = step_flops(
            &run.policy.model,
            &batch,
            run.reference.is_some() && s.beta > 0.0,
        );
        record.mfu =
            flops / (report.forward_backward_seconds + report.optimizer_seconds).max(1e-9) / peak;
        record.tokens_per_second = batch
            .completions
            .iter()
            .flatten()
            .map(Vec::len)
            .sum::<usize>() as f64
            / record.step_seconds.total.max(1e-9);
        reporter.step(&record).map_err(ConfigError)?;
        summary.steps.push(record);

        if run.step % args.checkpoint_every.max(1) == 0 && run.step < s.steps {
            summary.checkpoint = Some(tokio::task::block_in_place(|| save(&args, &run))?);
        }
    }
    reporter.finish();

    // Stop leasing, let groups in flight come in, keep everything unfinished.
    lock(&run.queue).close();
    drain(&run.queue, args.drain_timeout()).await;
    summary.checkpoint = Some(tokio::task::block_in_place(|| save(&args, &run))?);
    tracing::info!(
        step = run.step,
        checkpoint = %summary.checkpoint.as_ref().expect("just written").display(),
        interrupted = summary.interrupted,
        "checkpoint written; stopping"
    );
    // Pushes still in flight get their deadline, then the services stop.
    let _ = tokio::time::timeout(args.push_timeout(), fleet.lock()).await;
    if let Some(local) = local {
        local.stop().await;
    }
    let _ = server_stop.send(true);
    if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), queue_task).await {
        tracing::warn!(error = %e, "queue server");
    }
    Ok(summary)
}

/// Resolves once `rx` says stop.
async fn until(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|&s| s).await;
}

/// Loads or resumes the policy, the reference and the queue; runs the warm-up on a fresh
/// start.
fn prepare(args: &TrainArgs, summary: &mut TrainSummary) -> Result<Run, TrainError> {
    let s = &args.settings;
    let settings_json = serde_json::to_value(s).expect("settings serialise");
    let mut source = match &args.prompts {
        Some(path) => Source::File {
            prompts: prompts::load(path)?,
            next: 0,
        },
        None => Source::Generated(Box::new(Generator::new(s.seed, s.policy_fraction))),
    };
    let queue = Arc::new(Mutex::new(Queue::new(s.queue_config())));
    let reference_dir = args.run_dir.join("reference");
    let latest = if args.resume {
        checkpoint::latest(&args.run_dir)?
    } else {
        None
    };
    let (policy, opt, step) = match latest {
        Some(dir) => {
            let device = args
                .device
                .parse::<rookworld_lm::device::DeviceChoice>()?
                .open()?;
            let (policy, opt, state) = checkpoint::load(&dir, &device)?;
            if state.settings != settings_json {
                return Err(ConfigError(format!(
                    "--resume with different settings: the checkpoint has {}, this run {}",
                    state.settings, settings_json
                ))
                .into());
            }
            source.restore(&state.cursor)?;
            if let Some(snapshot) = state.queue {
                lock(&queue).restore(snapshot);
            }
            tracing::info!(step = state.step, dir = %dir.display(), "resumed");
            (policy, opt, state.step)
        }
        None => {
            let loaded = args.model_args().load()?;
            tracing::info!(source = %loaded.source, device = ?loaded.device, "starting weights");
            let policy = Trainable::from_model(&loaded.model)?;
            if s.sft_steps > 0 {
                tracing::info!(steps = s.sft_steps, "supervised warm-up");
                let warm = s.warm_up();
                let engine = args.engine.clone();
                summary.warm_up = std::thread::scope(|scope| {
                    scope
                        .spawn(|| {
                            crate::sft::warm_up(&policy, &warm, engine, |r| {
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
            }
            // The reference is the policy GRPO starts from (after any warm-up).
            model_checkpoint::save(&policy.model, &reference_dir, DType::F32)?;
            (policy, AdamW::new(s.adamw()), 0)
        }
    };
    let reference = if s.beta > 0.0 {
        Some(model_checkpoint::load(
            &reference_dir,
            DType::F32,
            policy.model.device(),
        )?)
    } else {
        None
    };
    Ok(Run {
        policy,
        reference,
        opt,
        step,
        source,
        queue,
        version: Arc::new(AtomicU64::new(step)),
        settings_json,
    })
}

/// Seeds of the groups' sampling, one stream per run (continued on resume).
fn rand_seed_stream(seed: u64, step: u64) -> rand_chacha::ChaCha8Rng {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    rng.set_stream(step);
    rng
}

/// Keeps the queue topped up and waits until P groups are taken; `None` on shutdown.
async fn gather(
    run: &mut Run,
    s: &TrainSettings,
    seeds: &mut rand_chacha::ChaCha8Rng,
    stop: &mut watch::Receiver<bool>,
) -> Option<Vec<ScoredGroup>> {
    use rand::RngCore;
    let version = run.version.load(Ordering::SeqCst);
    loop {
        {
            let mut q = lock(&run.queue);
            for _ in 0..q.pending_room() {
                let p = run.source.next_prompt();
                q.add(p, seeds.next_u64());
            }
            q.expire(Instant::now());
            // Take only a full step's worth, so a shutdown never strands taken groups.
            if q.ready(version) >= s.prompts_per_step {
                let groups = q.take(s.prompts_per_step, version);
                crate::metrics::record_queue(&q);
                return Some(groups);
            }
            crate::metrics::record_queue(&q);
        }
        tokio::select! {
            _ = stop.wait_for(|&s| s) => return None,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// The groups as a batch: the worker's prompt ids, sampled ids, rewards and behaviour
/// log-probs.
fn to_batch(groups: &[ScoredGroup]) -> GrpoBatch {
    GrpoBatch {
        prompts: groups.iter().map(|g| g.prompt_ids.clone()).collect(),
        completions: groups
            .iter()
            .map(|g| g.completions.iter().map(|c| c.ids.clone()).collect())
            .collect(),
        rewards: groups
            .iter()
            .map(|g| g.completions.iter().map(|c| c.reward).collect())
            .collect(),
        old_logprobs: Some(
            groups
                .iter()
                .map(|g| g.completions.iter().map(|c| c.logprobs.clone()).collect())
                .collect(),
        ),
    }
}

/// Registers the workers that advertised a push address and sends them `version` in the
/// background. The BF16 conversion happens here; when the previous push is still under
/// way this one is skipped (its stale workers are caught up by the next).
fn push(
    run: &Run,
    fleet: &Arc<tokio::sync::Mutex<Fleet>>,
    token: &str,
    deadline: Duration,
    version: u64,
) -> Result<(), TrainError> {
    let Ok(mut guard) = fleet.clone().try_lock_owned() else {
        tracing::debug!(version, "previous weight push still under way; skipped");
        return Ok(());
    };
    for w in lock(&run.queue).workers().values() {
        if !w.push_address.is_empty() {
            guard.register(&w.push_address);
        }
    }
    if guard.stale(version).is_empty() {
        return Ok(());
    }
    let set = WeightSet::from_model(&run.policy.model, version)?;
    let token = token.to_owned();
    tokio::spawn(async move {
        guard.push(&set, &token, deadline).await;
    });
    Ok(())
}

/// Writes a checkpoint: weights, optimizer, cursor and the queue's unfinished prompts.
fn save(args: &TrainArgs, run: &Run) -> Result<std::path::PathBuf, TrainError> {
    let state = TrainerState {
        step: run.step,
        adamw: run.opt.cfg,
        optimizer_steps: run.opt.steps,
        schedule: args.settings.schedule(),
        cursor: run.source.cursor(),
        settings: run.settings_json.clone(),
        queue: Some(lock(&run.queue).snapshot()),
    };
    Ok(checkpoint::save(
        &args.run_dir,
        &run.policy,
        &run.opt,
        &state,
    )?)
}

/// Waits (at most `timeout`) until no lease is outstanding.
async fn drain(queue: &Mutex<Queue>, timeout: Duration) {
    let started = Instant::now();
    loop {
        let leased = lock(queue).depths().leased;
        if leased == 0 {
            return;
        }
        if started.elapsed() >= timeout {
            tracing::warn!(
                leased,
                "drain timed out; those prompts are kept for the next run"
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fails with one line when nothing answers at `url` within `wait`.
async fn check_reachable(url: &str, wait: Duration) -> Result<(), TrainError> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| ConfigError(format!("--reward {url}: {e}")))?
        .connect_timeout(Duration::from_secs(2));
    let started = Instant::now();
    loop {
        match endpoint.connect().await {
            Ok(_) => return Ok(()),
            Err(e) if started.elapsed() >= wait => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                return Err(ConfigError(format!(
                    "reward server {url} unreachable for {:.0} s: {why}",
                    wait.as_secs_f64()
                ))
                .into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// Model FLOPs of one step's forward and backward: 6 per weight per token for the policy
/// (2 forward, 4 backward) and 2 more for the reference forward — the transformer's
/// matmul weights for every sequence token, the LM head's only for the completion tokens
/// (the only positions that go through it); groups without signal are not run.
fn step_flops(model: &Gpt2, batch: &GrpoBatch, reference: bool) -> f64 {
    let c = model.config();
    let body = (c.n_layer * 12 * c.n_embd * c.n_embd) as f64;
    let head = (c.vocab_size * c.n_embd) as f64;
    let (mut seq, mut completion) = (0usize, 0usize);
    for ((p, group), rewards) in batch
        .prompts
        .iter()
        .zip(&batch.completions)
        .zip(&batch.rewards)
    {
        if rewards.iter().all(|r| *r == rewards[0]) {
            continue; // no signal: not forwarded
        }
        for g in group {
            seq += p.len() + g.len();
            completion += g.len();
        }
    }
    let per_weight_token = if reference { 8.0 } else { 6.0 };
    per_weight_token * (body * seq as f64 + head * completion as f64)
}

/// `--peak-tflops`, or an estimate: on the CPU, 32 f32 FLOPs per cycle per core (AVX2,
/// two FMA units) at 3 GHz; on CUDA, dense TF32 of an H100/H200 (495 TFLOP/s).
fn peak_flops(args: &TrainArgs, device: &Device) -> f64 {
    if let Some(t) = args.peak_tflops {
        return t * 1e12;
    }
    if device.is_cpu() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cores as f64 * 32.0 * 3e9
    } else {
        495e12
    }
}

/// The run's outcome on stdout: warm-up loss, first and last 20% of steps' mean reward.
pub fn print_summary(summary: &TrainSummary) {
    if let (Some(first), Some(last)) = (summary.warm_up.first(), summary.warm_up.last()) {
        println!(
            "warm-up: {} steps, loss {:.3} -> {:.3}",
            summary.warm_up.len(),
            first.loss,
            last.loss
        );
    }
    if let Some((early, late)) = reward_trend(&summary.steps) {
        println!(
            "GRPO: {} steps, mean reward first 20% {early:.4}, last 20% {late:.4} ({:+.4})",
            summary.steps.len(),
            late - early
        );
    }
    if let Some(dir) = &summary.checkpoint {
        println!("checkpoint: {}", dir.display());
    }
}

/// Mean reward over the first and the last 20% of `steps` (at least one step each).
pub fn reward_trend(steps: &[StepRecord]) -> Option<(f64, f64)> {
    if steps.is_empty() {
        return None;
    }
    let k = (steps.len() / 5).max(1);
    let mean = |s: &[StepRecord]| s.iter().map(|r| r.reward_mean).sum::<f64>() / s.len() as f64;
    Some((mean(&steps[..k]), mean(&steps[steps.len() - k..])))
}
