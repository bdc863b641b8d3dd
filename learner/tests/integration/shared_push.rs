//! The same-host weight path against real rollout workers on loopback: the payload file in
//! a shared directory delivers exactly what the stream delivers; a worker that cannot read
//! it is streamed the weights; a damaged or misnamed file is refused and the old weights
//! keep serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device};
use learner::push::{Fleet, push_to};
use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
use rookworld_lm::model_io::init_random;
use rookworld_lm::{Config, Gpt2, model_io};
use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_train::policy::Trainable;
use rookworld_weights::export::{Exporter, POOL};
use rookworld_weights::set::{self as weights, WeightSet};
use tonic::transport::Channel;

const TOKEN: &str = "shared-token";

/// A worker with `shared_dir` (or none) serving `model` (default: seeded random weights)
/// on loopback; its URL.
async fn worker(shared_dir: Option<PathBuf>) -> String {
    let model = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
    worker_of(model, shared_dir).await
}

async fn worker_of(model: Gpt2, shared_dir: Option<PathBuf>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let config = WorkerConfig {
        service: ServiceConfig {
            guard: rookworld_service::auth::Guard::shared(TOKEN),
            shared_dir,
            ..ServiceConfig::default()
        },
        ..WorkerConfig::new(model)
    };
    // Served until the test ends.
    let worker = Worker::start(config, listener, std::future::pending());
    drop(worker.await.unwrap());
    url
}

async fn client(url: &str) -> RolloutServiceClient<Channel> {
    for _ in 0..50 {
        if let Ok(c) = RolloutServiceClient::connect(url.to_owned()).await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("worker at {url} never answered");
}

/// The worker's greedy completion of a fixed prompt: ids, log-probs, weight version.
async fn greedy(c: &mut RolloutServiceClient<Channel>) -> (Vec<u32>, Vec<f32>, u64) {
    let request = pb::GenerateRequest {
        prompts: vec![pb::Prompt {
            text: "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1 ".into(),
            ..Default::default()
        }],
        num_completions: 1,
        sampling: Some(rookworld_proto::v1::SamplingParams {
            temperature: 0.0,
            max_new_tokens: 12,
            ..Default::default()
        }),
    };
    let mut request = tonic::Request::new(request);
    rookworld_service::auth::set_token(request.metadata_mut(), TOKEN).unwrap();
    let mut stream = c.generate(request).await.unwrap().into_inner();
    let answer = stream.message().await.unwrap().expect("one completion");
    let done = answer.completion.unwrap();
    (done.ids, done.logprobs, done.weight_version)
}

/// A directory for shared payloads, on tmpfs where there is one.
fn shared_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// The learner's publishing path with a shared directory: a model's weights as the
/// exporter publishes them, each version in its file.
struct Publisher {
    policy: Trainable,
    exporter: Exporter,
    latest: tokio::sync::watch::Receiver<Option<Arc<WeightSet>>>,
}

impl Publisher {
    fn new(model: &Gpt2, dir: &Path) -> Self {
        let policy = Trainable::from_model(model).unwrap();
        let (tx, latest) = tokio::sync::watch::channel(None);
        let exporter = Exporter::new(&policy.vars, Arc::new(tx), Some(dir.to_owned()));
        Self {
            policy,
            exporter,
            latest,
        }
    }

    /// Version `v` of run `run`, its file published.
    fn set(&mut self, run: &str, v: u64) -> WeightSet {
        let mut payload = self.exporter.payload();
        payload.fill_rest(&self.policy.vars).unwrap();
        self.exporter.publish(run, v, payload).unwrap();
        self.exporter.flush().unwrap();
        let set = WeightSet::clone(self.latest.borrow_and_update().as_ref().unwrap());
        assert!(set.shared_file.is_some(), "the file was written");
        set
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_file_delivers_what_the_stream_delivers() {
    let dir = shared_dir();
    let url = worker(Some(dir.path().to_owned())).await;
    let mut c = client(&url).await;
    let learner_model = init_random(&Config::tiny(), 7, DType::F32, &Device::Cpu).unwrap();
    let base = WeightSet::from_model(&learner_model, "run-s", 1).unwrap();
    let mut files = Publisher::new(&learner_model, dir.path());

    // Version 1 over the stream, version 2 (the same weights) through the file.
    let answer = weights::push(&mut c, &base, TOKEN, 1 << 16).await.unwrap();
    assert_eq!(answer.version, 1);
    let streamed = greedy(&mut c).await;
    let v2 = files.set(&base.run_id, 2);
    let o = push_to(url.clone(), v2, TOKEN.into(), Duration::from_secs(10), true).await;
    assert_eq!((o.error.as_deref(), o.path), (None, "shared"), "{o:?}");
    let shared = greedy(&mut c).await;
    assert_eq!(streamed.2, 1);
    assert_eq!(shared.2, 2);
    // Bit-identical: the same tokens and the same log-probs to the last bit.
    assert_eq!(streamed.0, shared.0);
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&streamed.1), bits(&shared.1));
    // And they are the learner's weights: a worker started from the payload itself
    // generates the same.
    let direct = model_io::from_bytes(&base.bytes, &Config::tiny(), DType::F32, &Device::Cpu);
    let direct_url = worker_of(direct.unwrap(), None).await;
    let started = greedy(&mut client(&direct_url).await).await;
    assert_eq!(started.0, shared.0);
    assert_eq!(bits(&started.1), bits(&shared.1));
    let status = c
        .status(pb::StatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (status.weight_version, status.weight_run_id.as_str()),
        (2, "run-s")
    );

    // The newest version's file is kept, and the pool's to write the next ones into;
    // every one goes with the exporter.
    for v in 3..=6 {
        let set = files.set(&base.run_id, v);
        let o = push_to(
            url.clone(),
            set,
            TOKEN.into(),
            Duration::from_secs(10),
            true,
        )
        .await;
        assert_eq!((o.error.as_deref(), o.path), (None, "shared"), "{o:?}");
    }
    let left = std::fs::read_dir(dir.path()).unwrap().count();
    assert!((1..=POOL + 1).contains(&left), "{left} files");
    drop(files);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_read_the_file_is_streamed_the_weights() {
    let dir = shared_dir();
    let model = init_random(&Config::tiny(), 8, DType::F32, &Device::Cpu).unwrap();
    let base = WeightSet::from_model(&model, "run-f", 1).unwrap();
    let mut files = Publisher::new(&model, dir.path());

    // No shared directory at the worker (another host): refused, streamed, and streamed
    // from then on without asking again (the next version as a delta: the same weights,
    // nothing changed).
    let elsewhere = worker(None).await;
    client(&elsewhere).await;
    let mut fleet = Fleet::new(Duration::from_secs(1));
    fleet.register(&elsewhere);
    let set = files.set(&base.run_id, 1);
    let outcomes = fleet.push(&set, TOKEN, Duration::from_secs(10)).await;
    let o = &outcomes[0];
    assert_eq!(
        (o.error.as_deref(), o.path, o.shared_refused),
        (None, "stream", true),
        "{o:?}"
    );
    assert!(!fleet.shared(&elsewhere));
    let set = files.set(&base.run_id, 2);
    let o = &fleet.push(&set, TOKEN, Duration::from_secs(10)).await[0];
    assert_eq!(
        (o.error.as_deref(), o.path, o.shared_refused),
        (None, "delta", false),
        "{o:?}"
    );
    assert!(o.bytes < 1000, "{o:?}");

    // A shared directory without the file (another directory; or the file was removed
    // before the worker opened it).
    let other_dir = shared_dir();
    let here = worker(Some(other_dir.path().to_owned())).await;
    client(&here).await;
    let set = files.set(&base.run_id, 3);
    let o = push_to(here, set, TOKEN.into(), Duration::from_secs(10), true).await;
    assert_eq!(
        (o.error.as_deref(), o.path, o.shared_refused),
        (None, "stream", true),
        "{o:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_misnamed_file_is_refused_and_the_old_weights_serve() {
    let dir = shared_dir();
    let url = worker(Some(dir.path().to_owned())).await;
    let mut c = client(&url).await;
    let model = init_random(&Config::tiny(), 9, DType::F32, &Device::Cpu).unwrap();
    let base = WeightSet::from_model(&model, "run-d", 1).unwrap();
    let mut files = Publisher::new(&model, dir.path());
    let good = files.set(&base.run_id, 1);
    weights::push_shared(&mut c, &good, TOKEN, false)
        .await
        .unwrap();
    let before = greedy(&mut c).await;
    let path = |s: &WeightSet| dir.path().join(s.shared_file.as_ref().unwrap());

    // A flipped byte: the hash says so (DATA_LOSS).
    let set = files.set(&base.run_id, 2);
    let mut bytes = std::fs::read(path(&set)).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(path(&set), &bytes).unwrap();
    let err = weights::push_shared(&mut c, &set, TOKEN, false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");

    // A short file: the size says so.
    let set = files.set(&base.run_id, 3);
    std::fs::write(path(&set), &bytes[..at]).unwrap();
    let err = weights::push_shared(&mut c, &set, TOKEN, false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("bytes"), "{err:?}");

    // A name that leaves the directory is refused before anything is opened.
    let mut set = files.set(&base.run_id, 4);
    set.shared_file = Some("../outside.safetensors".into());
    let err = weights::push_shared(&mut c, &set, TOKEN, false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("bare file name"), "{err:?}");

    // A stale version is refused on the header, the file never read (the version in use
    // itself is answered as in use: a retry of a push that landed).
    let stale = WeightSet {
        version: 0,
        ..files.set(&base.run_id, 5)
    };
    let err = weights::push_shared(&mut c, &stale, TOKEN, false)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("not above"), "{err:?}");

    // Through all of it, version 1 served, unchanged.
    assert_eq!(greedy(&mut c).await, before);
}

/// From its third version on, a worker writes each new version into the memory of the
/// model the last swap retired; every version must still generate exactly what a worker
/// started from its payload does, whichever path brought it and whatever a refused,
/// damaged payload left in that memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_built_into_retired_memory_serve_exactly_their_weights() {
    let dir = shared_dir();
    let url = worker(Some(dir.path().to_owned())).await;
    let mut c = client(&url).await;
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for v in 1..=6u64 {
        let model = init_random(&Config::tiny(), 100 + v, DType::F32, &Device::Cpu).unwrap();
        let base = WeightSet::from_model(&model, "run-m", v).unwrap();
        let mut files = Publisher::new(&model, dir.path());
        if v == 4 {
            // A damaged file: refused on its hash after it was written into the spare.
            let set = files.set(&base.run_id, v);
            let path = dir.path().join(set.shared_file.as_ref().unwrap());
            let mut bytes = std::fs::read(&path).unwrap();
            let at = bytes.len() - 7;
            bytes[at] ^= 0x40;
            std::fs::write(&path, &bytes).unwrap();
            let err = weights::push_shared(&mut c, &set, TOKEN, false)
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");
        }
        if v % 2 == 0 {
            weights::push(&mut c, &base, TOKEN, 1 << 16).await.unwrap();
        } else {
            let set = files.set(&base.run_id, v);
            weights::push_shared(&mut c, &set, TOKEN, false)
                .await
                .unwrap();
        }
        let served = greedy(&mut c).await;
        let direct = model_io::from_bytes(&base.bytes, &Config::tiny(), DType::F32, &Device::Cpu);
        let want = greedy(&mut client(&worker_of(direct.unwrap(), None).await).await).await;
        assert_eq!(served.2, v);
        assert_eq!(served.0, want.0, "version {v}: tokens");
        assert_eq!(bits(&served.1), bits(&want.1), "version {v}: log-probs");
    }
}

/// A file the learner is writing over (it holds the exclusive lock) is not read: the
/// worker says it is busy, this push goes over the stream, and the next through a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_being_written_over_is_streamed_instead() {
    let dir = shared_dir();
    let url = worker(Some(dir.path().to_owned())).await;
    let model = init_random(&Config::tiny(), 5, DType::F32, &Device::Cpu).unwrap();
    let base = WeightSet::from_model(&model, "run-l", 1).unwrap();
    let mut files = Publisher::new(&model, dir.path());
    let set = files.set(&base.run_id, 1);
    let path = dir.path().join(set.shared_file.as_ref().unwrap());
    let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    writer.lock().unwrap();
    let o = push_to(
        url.clone(),
        set,
        TOKEN.into(),
        Duration::from_secs(10),
        true,
    )
    .await;
    assert_eq!((o.error.as_deref(), o.path), (None, "stream"), "{o:?}");
    assert!(
        !o.shared_refused,
        "a busy file is no reason to stream from now on: {o:?}"
    );
    drop(writer);
    let mut c = client(&url).await;
    assert_eq!(greedy(&mut c).await.2, 1);
    let set = files.set(&base.run_id, 2);
    let o = push_to(
        url.clone(),
        set,
        TOKEN.into(),
        Duration::from_secs(10),
        true,
    )
    .await;
    assert_eq!((o.error.as_deref(), o.path), (None, "shared"), "{o:?}");
}
