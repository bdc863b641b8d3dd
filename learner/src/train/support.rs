//! The loop's helpers: publishing weights, checkpoints, the drain on shutdown, the
//! reward server's reachability at start, and the FLOP count behind MFU.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rookworld_weights::set::WeightSet;
use tokio::sync::watch;

use super::{ConfigError, Run, TrainArgs, TrainError};
use crate::checkpoint::{self, TrainerState};
use crate::queue::QueueHandle;

/// Publishes the policy's weights at the run's current version: recorded first (so a
/// crash never reuses the number), converted to BF16 once, handed to the weight sync.
pub(super) fn publish(
    args: &TrainArgs,
    run: &Run,
    latest: &watch::Sender<Option<Arc<WeightSet>>>,
) -> Result<(), TrainError> {
    let version = run.version.load(Ordering::SeqCst);
    checkpoint::record_published(&args.run_dir, version)?;
    let set = WeightSet::from_model(&run.policy.model, &run.run_id, version)?;
    latest.send_replace(Some(Arc::new(set)));
    Ok(())
}

/// The directory of the same-host weight path: `--shared-dir` (created if missing), or for
/// `--local` a directory of this process under /dev/shm (the system's temporary directory
/// where there is none); `None` when pushes only stream.
pub(super) fn shared_dir(args: &TrainArgs) -> Result<Option<std::path::PathBuf>, TrainError> {
    let dir = match (&args.shared_dir, args.local) {
        (Some(dir), _) => dir.clone(),
        (None, true) => rookworld_weights::export::process_dir("rookworld-weights"),
        (None, false) => return Ok(None),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| ConfigError::Unusable(format!("--shared-dir {}: {e}", dir.display())))?;
    Ok(Some(dir))
}

/// Writes a checkpoint: weights, optimizer, cursor and the queue's unfinished prompts.
pub(super) fn save(args: &TrainArgs, run: &Run) -> Result<std::path::PathBuf, TrainError> {
    let state = TrainerState {
        step: run.step,
        version: run.version.load(Ordering::SeqCst),
        adamw: run.opt.cfg,
        optimizer_steps: run.opt.steps,
        schedule: args.settings.schedule(),
        cursor: run.source.cursor(),
        settings: run.settings_json.clone(),
        record: run.record.clone(),
        // On a blocking thread (`block_in_place`): the snapshot waits for the queue.
        queue: Some(run.queue.call(|q| q.snapshot())),
        eval: run
            .eval
            .as_ref()
            .filter(|e| e.step == run.step)
            .map(|e| serde_json::to_value(e).expect("the evaluation serialises")),
    };
    Ok(checkpoint::save(
        &args.run_dir,
        &run.policy,
        &run.opt,
        &state,
    )?)
}

/// Writes `RUN/config.toml` (when the command line resolved the settings): on a resumed
/// run, each setting that differs from the record of the run's last start is logged first.
pub(super) fn write_record(args: &TrainArgs, run: &Run) -> Result<Option<String>, TrainError> {
    use crate::run_record::{self, Origin};
    let Some(settings) = &args.record else {
        return Ok(None);
    };
    let path = args.run_dir.join(run_record::FILE);
    if run.resumed
        && let Some(old) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| run_record::settings_of(&t))
    {
        for change in run_record::diff(&old, settings) {
            tracing::info!(%change, "setting changed since the run's last start");
        }
    }
    let device = format!("{} ({:?})", args.device, run.policy.model.device());
    let origin = Origin::of(args.model.as_deref(), &args.preset, args.init_seed, &device);
    let text = run_record::render(settings, Some(&origin));
    rookworld_lm::checkpoint::write_atomic(&path, text.as_bytes())?;
    tracing::info!(record = %path.display(), "run settings recorded");
    Ok(Some(text))
}

/// Waits (at most `timeout`) until no lease is outstanding.
pub(super) async fn drain(queue: &QueueHandle, timeout: Duration) {
    let started = Instant::now();
    loop {
        let leased = queue.run(|q| q.depths().leased).await;
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

/// Fails with one line naming `url` and the problem when nothing answers there within
/// `wait`, when what answers is not a reward server (another service's port), or when it
/// refuses `token` (none configured there, or another one): its `Info` and a trial `Score`.
pub(super) async fn check_reward(
    url: &str,
    token: &str,
    tls: &rookworld_service::tls::ClientTlsArgs,
    wait: Duration,
) -> Result<(), TrainError> {
    let endpoint = tls
        .endpoint(url)
        .map_err(|e| ConfigError::Unusable(format!("--reward {url}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10));
    use rookworld_service::tls::TlsProblem;
    // TLS on one side only does not cure itself: named at once.
    let tls_problem = |why: &str| {
        TlsProblem::classify(url, why).map(|p| {
            TrainError::from(ConfigError::Unusable(format!(
                "reward server: {}",
                p.at(url)
            )))
        })
    };
    let started = Instant::now();
    let channel = loop {
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(e) => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                if let Some(e) = tls_problem(&rookworld_service::probe::error_chain(&e)) {
                    return Err(e);
                }
                if started.elapsed() >= wait {
                    return Err(ConfigError::Unusable(format!(
                        "reward server {url} unreachable for {:.0} s: {why}",
                        wait.as_secs_f64()
                    ))
                    .into());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    match rookworld_service::probe::reward_server(channel, token).await {
        Ok(what) => {
            tracing::info!(reward = url, %what, "reward server answers and takes the token");
            Ok(())
        }
        Err(problem) => Err(tls_problem(&problem.to_string()).unwrap_or_else(|| {
            ConfigError::Unusable(format!("reward server {url} {problem}")).into()
        })),
    }
}

/// `--peak-tflops`, or the device's estimate ([`rookworld_train::step::device_peak_flops`]): on
/// the CPU 64 (AVX-512) or 32 f32 FLOPs per cycle per core at 3 GHz, twice that for BF16
/// products; on CUDA the H100/H200
/// dense peak in the policy's matmul dtype (BF16 989, TF32 495 TFLOP/s).
pub(super) fn peak_flops(args: &TrainArgs, model: &rookworld_lm::Gpt2) -> f64 {
    match args.peak_tflops {
        Some(t) => t * 1e12,
        None => rookworld_train::step::device_peak_flops(model.device(), model.matmul_dtype()),
    }
}
