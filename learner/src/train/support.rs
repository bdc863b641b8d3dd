//! The loop's helpers: publishing weights, checkpoints, the drain on shutdown, the
//! reward server's reachability at start, and the FLOP count behind MFU.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rollout_worker::weights::WeightSet;
use tokio::sync::watch;

use super::{ConfigError, Run, TrainArgs, TrainError, lock};
use crate::checkpoint::{self, TrainerState};
use crate::queue::Queue;

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
        (None, true) => crate::export::process_dir("rookworld-weights"),
        (None, false) => return Ok(None),
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| ConfigError(format!("--shared-dir {}: {e}", dir.display())))?;
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
        queue: Some(lock(&run.queue).snapshot()),
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

/// Waits (at most `timeout`) until no lease is outstanding.
pub(super) async fn drain(queue: &Mutex<Queue>, timeout: Duration) {
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
pub(super) async fn check_reachable(
    url: &str,
    tls: &rookworld_proto::tls::ClientTlsArgs,
    wait: Duration,
) -> Result<(), TrainError> {
    let endpoint = tls
        .endpoint(url)
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

/// `--peak-tflops`, or the device's estimate ([`crate::step::device_peak_flops`]): on
/// the CPU 64 (AVX-512) or 32 f32 FLOPs per cycle per core at 3 GHz; on CUDA the H100/H200
/// dense peak in the policy's matmul dtype (BF16 989, TF32 495 TFLOP/s).
pub(super) fn peak_flops(args: &TrainArgs, model: &rookworld_lm::Gpt2) -> f64 {
    match args.peak_tflops {
        Some(t) => t * 1e12,
        None => crate::step::device_peak_flops(model.device(), model.matmul_dtype()),
    }
}
