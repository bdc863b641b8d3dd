//! `learner bench-push`: the weight push, phase by phase, beside its floor in the same run.
//!
//! A real rollout worker (the service `rollout-worker serve` runs, in this process) listens
//! on loopback with the preset's shape; the learner side turns its own model into the BF16
//! payload and pushes N versions to it over gRPC, per chunk size while the worker is idle,
//! and at the default chunk size while it generates; and through the same-host path (the
//! payload written, as the optimizer writes it, into its file in a directory under
//! /dev/shm that the worker shares; only the header is sent). The floor is a `memcpy` of the same bytes and a
//! raw loopback TCP transfer of them. Beside them, what a delta against the previous
//! version would send instead, after one AdamW step at each of a few learning rates
//! ([`deltas`]), and pushes that send one end to end (the training thread's last payload
//! and the first, each a delta of the other). One JSON line on stdout.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{DType, Device};
use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
use rookworld_lm::config::Config;
use rookworld_lm::device::{DeviceChoice, WeightDtype};
use rookworld_lm::model_io;
use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_service::logging::Progress;
use rookworld_weights::export::{ExportError, Exporter, POOL};
use rookworld_weights::set::{self as weights, CHUNK_BYTES, WeightSet};
use serde::Serialize;

use crate::settings::ConfigError;
use floor::{Floor, floor};
use rookworld_train::optim::{AdamW, AdamWConfig};
use rookworld_train::policy::Trainable;

pub(crate) mod deltas;
mod floor;

/// Options of `learner bench-push`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchPushArgs {
    /// Model shape (seeded random weights): gpt2-124m or tiny.
    #[arg(long, default_value = "gpt2-124m")]
    pub preset: String,
    /// Pushes per measurement; the median is reported.
    #[arg(long, allow_negative_numbers = true, default_value_t = 3)]
    pub pushes: usize,
    /// Chunk sizes to compare on the idle worker, in KiB.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024,4096")]
    pub chunk_kib: Vec<usize>,
    /// Skip the pushes to a generating worker.
    #[arg(long)]
    pub idle_only: bool,
    /// The worker's device (cpu, cuda, cuda:N); on a GPU its weights are bfloat16, and
    /// "convert + pack" is the upload to the device.
    #[arg(long, default_value = "cpu")]
    pub worker_device: String,
    /// The worker's --weight-dtype, as `rollout-worker serve` takes it (auto: BF16 panels on
    /// a CPU the packed kernel runs on, BF16 weights on CUDA; f32, bf16, f16 or int8): on
    /// the CPU, what its panels hold and so what a push is packed into.
    #[arg(long, default_value = "auto")]
    pub rollout_weight_dtype: WeightDtype,
    /// Which CUDA kernels the device runs: the binary's kernel flags, parsed once.
    #[arg(skip)]
    pub kernels: rookworld_lm::kernels::KernelChoice,
}

/// One measurement: the median push and where the worker spent it.
#[derive(Debug, Serialize)]
struct Pushes {
    /// "stream" (gRPC chunks), "shared" (the same-host file) or "delta" (gRPC chunks of a
    /// delta against the worker's version).
    path: &'static str,
    chunk_kib: usize,
    /// End to end, as the learner sees it: first chunk sent to the worker's answer.
    seconds: f64,
    gb_per_second: f64,
    /// The worker's phases of that push.
    receive_seconds: f64,
    verify_seconds: f64,
    convert_seconds: f64,
    swap_seconds: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    preset: String,
    worker_device: String,
    /// What the worker's CPU panels hold (f32 on CUDA, where nothing is packed).
    worker_panels: String,
    bytes: usize,
    /// Learner: the model to the BF16 safetensors payload, and its BLAKE3 hash.
    export_seconds: f64,
    /// The same payload by the generic path (`to_dtype`, `safetensors::serialize`), the
    /// in-run baseline of the export.
    export_generic_seconds: f64,
    hash_seconds: f64,
    /// One AdamW step over the model's parameters (median), as training runs it.
    optimizer_seconds: f64,
    /// The same step writing the BF16 payload as it goes and handing it to the exporter
    /// (median) — what a publishing step runs.
    optimizer_exporting_seconds: f64,
    /// What publishing costs the training thread per step: the difference of the two.
    training_thread_seconds: f64,
    /// From the hand-off to the set being published (hashed on the export thread).
    publish_seconds: f64,
    floor: Floor,
    idle: Vec<Pushes>,
    /// Idle worker, the same-host path.
    shared: Pushes,
    generating: Option<Pushes>,
    /// A push of a version the worker already passed: refused on its header.
    stale_refusal_seconds: f64,
    /// One AdamW step's delta against the payload before it, by learning rate.
    deltas: Vec<deltas::Delta>,
    /// Idle worker, deltas between the first payload and the training thread's last
    /// (2 × (pushes + 1) AdamW steps at lr 1e-5 apart): the push's payload bytes a second
    /// in `gb_per_second`, the delta's size in `delta_push_bytes`, and the worker's
    /// applying and hashing it in `verify_seconds`.
    delta_push: Pushes,
    delta_push_bytes: usize,
}

const TOKEN: &str = "bench-push";

/// Why `learner bench-push` could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchPushError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Worker(#[from] rollout_worker::StartError),
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("connecting to the worker: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("{what}: {:?}: {}", status.code(), status.message())]
    Push {
        what: &'static str,
        status: tonic::Status,
    },
    #[error(transparent)]
    Deltas(#[from] deltas::DeltaBenchError),
    /// What the benchmark measures did not happen as it must.
    #[error("{0}")]
    Unexpected(&'static str),
}

impl From<candle_core::Error> for BenchPushError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

/// The push's refusal, as `what`.
fn refused(what: &'static str) -> impl Fn(tonic::Status) -> BenchPushError {
    move |status| BenchPushError::Push { what, status }
}

/// Runs the benchmark and prints its JSON line.
pub fn run(args: &BenchPushArgs) -> Result<(), BenchPushError> {
    rookworld_service::validate::at_least("--pushes", args.pushes as u64, 1)?;
    if args.chunk_kib.contains(&0) {
        return Err(ConfigError::Value("--chunk-kib: every size must be ≥ 1".into()).into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The pushes' files go into a directory of this process's: a signal removes it and ends
    // the benchmark at once, exit 0.
    let shared_dir = rookworld_weights::export::process_dir("rookworld-bench-push");
    let left = shared_dir.clone();
    rookworld_service::serve::exit_on_signal("learner bench-push", move || {
        let _ = std::fs::remove_dir_all(left);
    })?;
    let report = runtime.block_on(bench(args, shared_dir))?;
    println!(
        "{}",
        serde_json::to_string(&report).expect("report serialises")
    );
    Ok(())
}

async fn bench(args: &BenchPushArgs, shared_dir: PathBuf) -> Result<Report, BenchPushError> {
    let cfg = Config::preset(&args.preset)?;
    let deltas = deltas::measure(&cfg)?;
    let learner_model = model_io::init_random(&cfg, 1, DType::F32, &Device::Cpu)?;
    let t = Instant::now();
    let generic = model_io::to_bytes(&learner_model, DType::BF16)?;
    let export_generic_seconds = t.elapsed().as_secs_f64();
    drop(generic);
    let t = Instant::now();
    let payload = model_io::to_bf16_payload(&learner_model)?;
    let export_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let set = WeightSet::from_bytes("bench", 1, payload);
    let hash_seconds = t.elapsed().as_secs_f64();
    let bytes = set.bytes.len();
    let policy = Trainable::from_model(&learner_model)?;
    drop(learner_model);
    let training = training_thread(&policy, args.pushes)?;
    if training.set.blake3 == set.blake3 || training.set.bytes.len() != bytes {
        return Err(BenchPushError::Unexpected(
            "the optimizer's payload is not an updated model of the same size",
        ));
    }
    let floor = floor(&set.bytes).await?;

    // The worker, as `rollout-worker serve` runs it.
    std::fs::create_dir_all(&shared_dir)?;
    let (device, kernels) = args
        .worker_device
        .parse::<DeviceChoice>()
        .and_then(|d| d.open(&args.kernels))
        .map_err(|e| ConfigError::Value(format!("--worker-device: {e}")))?;
    let (dtype, panels) = args.rollout_weight_dtype.resolve(&device)?;
    let mut worker_model = model_io::init_random(&cfg, 2, dtype, &device)?;
    worker_model.set_panel_dtype(panels);
    worker_model.set_kernels(kernels);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::start(
        WorkerConfig {
            service: ServiceConfig {
                guard: rookworld_service::auth::Guard::shared(TOKEN),
                shared_dir: Some(shared_dir.clone()),
                ..ServiceConfig::default()
            },
            ..WorkerConfig::new(worker_model)
        },
        listener,
        async {
            let _ = stopped.await;
        },
    )
    .await?;
    let url = format!("http://{}", worker.local_addr());
    let channel = rookworld_service::serve::endpoint(&url)?.connect().await?;
    let mut client = RolloutServiceClient::new(channel);

    let generating_runs = usize::from(!args.idle_only);
    let total = (args.chunk_kib.len() + 2 + generating_runs) * args.pushes;
    let mut progress = Progress::new("bench push", 0, total as u64, true);
    // The first two versions a worker receives are built in fresh memory (the model it
    // started with is never written over); from then on each goes into the memory of the
    // one its last swap retired. Measure that steady state.
    let mut version = 1;
    for _ in 0..2 {
        version += 1;
        let warm_up = WeightSet {
            version,
            ..set.clone()
        };
        weights::push(&mut client, &warm_up, TOKEN, CHUNK_BYTES)
            .await
            .map_err(refused("warm-up push"))?;
    }
    let mut idle = vec![];
    for &kib in &args.chunk_kib {
        idle.push(
            pushes(
                &mut client,
                &set,
                &mut version,
                kib,
                args.pushes,
                &mut progress,
            )
            .await?,
        );
    }
    let (delta_push, delta_push_bytes) = delta_pushes(
        &mut client,
        (&set, &training.set),
        &mut version,
        args.pushes,
        &mut progress,
    )
    .await?;
    let shared = shared_pushes(
        &mut client,
        &policy,
        &shared_dir,
        &mut version,
        args.pushes,
        &mut progress,
    )
    .await;
    drop(policy);
    let _ = std::fs::remove_dir(&shared_dir);
    let shared = shared?;
    let generating = if args.idle_only {
        None
    } else {
        let busy = Arc::new(AtomicBool::new(true));
        let load = tokio::spawn(generate_until(client.clone(), busy.clone()));
        let kib = CHUNK_BYTES >> 10;
        let p = pushes(
            &mut client,
            &set,
            &mut version,
            kib,
            args.pushes,
            &mut progress,
        )
        .await;
        busy.store(false, Ordering::SeqCst);
        let _ = load.await;
        Some(p?)
    };
    progress.finish();
    let stale = WeightSet {
        version: 1,
        ..set.clone()
    };
    let t = Instant::now();
    let refused = weights::push(&mut client, &stale, TOKEN, CHUNK_BYTES).await;
    let stale_refusal_seconds = t.elapsed().as_secs_f64();
    if refused.is_ok() {
        return Err(BenchPushError::Unexpected(
            "the worker took a stale version",
        ));
    }
    let _ = stop.send(());
    let _ = worker.wait().await;
    Ok(Report {
        preset: args.preset.clone(),
        worker_device: args.worker_device.clone(),
        worker_panels: format!("{panels:?}").to_lowercase(),
        bytes,
        export_seconds,
        export_generic_seconds,
        hash_seconds,
        optimizer_seconds: training.plain,
        optimizer_exporting_seconds: training.exporting,
        training_thread_seconds: (training.exporting - training.plain).max(0.0),
        publish_seconds: training.publish,
        floor,
        idle,
        shared,
        generating,
        stale_refusal_seconds,
        deltas,
        delta_push,
        delta_push_bytes,
    })
}

/// The optimizer's cost with and without writing the payload, and the publish latency.
struct TrainingThread {
    plain: f64,
    exporting: f64,
    publish: f64,
    /// The last set published.
    set: Arc<WeightSet>,
}

/// `n` AdamW steps of `policy`'s parameters (fixed pseudo-random gradients) without
/// export, then `n` writing the payload and publishing it; the medians.
fn training_thread(policy: &Trainable, n: usize) -> Result<TrainingThread, BenchPushError> {
    let (grads, mut opt) = (
        deltas::gradients(policy),
        AdamW::new(AdamWConfig::default()),
    );
    let (tx, rx) = tokio::sync::watch::channel(None);
    let exporter = Exporter::new(&policy.vars, Arc::new(tx), None);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // One of each first: moments and payload buffers allocated.
    let (mut plain, mut exporting, mut publish) = (vec![], vec![], vec![]);
    for i in 0..=n {
        let t = Instant::now();
        opt.step(&policy.vars, &grads, 1e-5, policy.model.kernels())?;
        plain.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut payload = exporter.payload();
        opt.step_exporting(
            &policy.vars,
            &grads,
            1e-5,
            Some(&mut payload),
            policy.model.kernels(),
        )?;
        payload.fill_rest(&policy.vars)?;
        exporter.publish("bench", 1000 + i as u64, payload)?;
        exporting.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        exporter.flush()?;
        publish.push(t.elapsed().as_secs_f64());
        if i == 0 {
            (plain, exporting, publish) = (vec![], vec![], vec![]);
        }
    }
    let set = rx.borrow().clone().expect("published");
    Ok(TrainingThread {
        plain: median(plain),
        exporting: median(exporting),
        publish: median(publish),
        set,
    })
}

/// `n` pushes of new versions in `kib`-KiB chunks; the median one.
async fn pushes(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    set: &WeightSet,
    version: &mut u64,
    kib: usize,
    n: usize,
    progress: &mut Progress,
) -> Result<Pushes, BenchPushError> {
    let mut all = vec![];
    for _ in 0..n {
        *version += 1;
        let next = WeightSet {
            version: *version,
            ..set.clone()
        };
        let t = Instant::now();
        let answer = weights::push(client, &next, TOKEN, kib << 10).await;
        let answer = answer.map_err(refused("push"))?;
        let seconds = t.elapsed().as_secs_f64();
        progress.tick(&format!("{kib} KiB chunks: {seconds:.3} s"));
        all.push((seconds, answer));
    }
    Ok(median_push(all, "stream", kib, set.bytes.len()))
}

/// `n` pushes of new versions that alternate between the payloads of `a` and `b`, each sent
/// as a delta against the one before (an XOR delta turns either into the other), the
/// median one, and the delta's size. The worker's last streamed payload must be `a`'s,
/// at `version`; after an even `n` it holds `a`'s again.
async fn delta_pushes(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    (a, b): (&WeightSet, &WeightSet),
    version: &mut u64,
    n: usize,
    progress: &mut Progress,
) -> Result<(Pushes, usize), BenchPushError> {
    let delta = rookworld_weights::delta::encode(&a.bytes, &b.bytes)
        .map_err(|e| BenchPushError::Deltas(e.into()))?;
    let delta = bytes::Bytes::from(delta);
    let mut all = vec![];
    for i in 0..n.max(2).next_multiple_of(2) {
        let base = *version;
        *version += 1;
        let next = WeightSet {
            run_id: a.run_id.clone(),
            version: *version,
            ..(if i % 2 == 0 { b } else { a }).clone()
        };
        let t = Instant::now();
        let answer = weights::push_delta(client, (&next, base, delta.clone()), TOKEN, CHUNK_BYTES);
        let answer = answer.await.map_err(refused("delta push"))?;
        let seconds = t.elapsed().as_secs_f64();
        if i < n {
            progress.tick(&format!("delta of {} bytes: {seconds:.3} s", delta.len()));
            all.push((seconds, answer));
        }
    }
    let kib = CHUNK_BYTES >> 10;
    Ok((median_push(all, "delta", kib, a.bytes.len()), delta.len()))
}

/// `n` pushes of new versions through the same-host path, the median one: each version's
/// payload is written into its file by the exporter's path (as the optimizer writes it,
/// into a pooled file in `dir`), hashed and named, and only its header sent.
async fn shared_pushes(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    policy: &Trainable,
    dir: &std::path::Path,
    version: &mut u64,
    n: usize,
    progress: &mut Progress,
) -> Result<Pushes, BenchPushError> {
    let (tx, mut rx) = tokio::sync::watch::channel(None);
    let exporter = Exporter::new(&policy.vars, Arc::new(tx), Some(dir.to_owned()));
    // The pool's files are made on the export thread at its start, and a published one
    // comes back when its push is done: from the pool's size on, every version is written
    // into a file already made. Measure that steady state.
    let warm_up = POOL + 1;
    let mut all = vec![];
    for i in 0..warm_up + n {
        *version += 1;
        let set = tokio::task::block_in_place(|| {
            let mut payload = exporter.payload();
            payload.fill_rest(&policy.vars)?;
            exporter.publish("bench", *version, payload)?;
            exporter.flush()?;
            rx.borrow_and_update()
                .clone()
                .ok_or(BenchPushError::Unexpected("nothing was published"))
        })?;
        if set.shared_file.is_none() {
            return Err(BenchPushError::Unexpected(
                "the shared payload file could not be written",
            ));
        }
        let t = Instant::now();
        let answer = weights::push_shared(client, &set, TOKEN, false).await;
        let answer = answer.map_err(refused("push"))?;
        let seconds = t.elapsed().as_secs_f64();
        if i >= warm_up {
            progress.tick(&format!("shared file: {seconds:.3} s"));
            all.push((seconds, answer));
        }
    }
    let bytes = rx.borrow().as_ref().map_or(0, |s| s.bytes.len());
    Ok(median_push(all, "shared", 0, bytes))
}

/// The median of `all` (end-to-end seconds, the worker's answer) as a measurement.
fn median_push(
    mut all: Vec<(f64, pb::UpdateWeightsResponse)>,
    path: &'static str,
    chunk_kib: usize,
    bytes: usize,
) -> Pushes {
    all.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (seconds, a) = all.swap_remove(all.len() / 2);
    Pushes {
        path,
        chunk_kib,
        seconds,
        gb_per_second: bytes as f64 / seconds / 1e9,
        receive_seconds: a.receive_seconds,
        verify_seconds: a.verify_seconds,
        convert_seconds: a.convert_seconds,
        swap_seconds: a.swap_seconds,
    }
}

/// Keeps the worker generating (4 prompts × 8 completions of 64 tokens) until `busy` ends.
async fn generate_until(
    mut client: RolloutServiceClient<tonic::transport::Channel>,
    busy: Arc<AtomicBool>,
) {
    while busy.load(Ordering::SeqCst) {
        let request = pb::GenerateRequest {
            prompts: vec![
                pb::Prompt {
                    text: rookworld_generation::BENCH_PROMPT.into(),
                    ..Default::default()
                };
                4
            ],
            num_completions: 8,
            sampling: Some(rookworld_proto::v1::SamplingParams {
                temperature: 1.0,
                max_new_tokens: 64,
                ..Default::default()
            }),
        };
        let mut request = tonic::Request::new(request);
        if rookworld_service::auth::set_token(request.metadata_mut(), TOKEN).is_err() {
            return;
        }
        let answer = match client.generate(request).await {
            Ok(a) => a,
            Err(s) => {
                tracing::warn!(error = %s.message(), "bench push: Generate refused; the pushes run idle");
                return;
            }
        };
        let mut stream = answer.into_inner();
        while let Ok(Some(_)) = stream.message().await {}
    }
}
