//! The real gRPC service on 127.0.0.1:0: streaming generation, weight updates (refused
//! without the token, rejected when corrupted, old weights kept), a swap in the middle of
//! generation, status, health, reflection and a Prometheus scrape.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use candle_core::{DType, Device};
use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
use rookworld_generation::{
    EngineConfig, Request as EngineRequest, Scheduler, SwapPolicy, prepare_model,
};
use rookworld_lm::model_io::{self, init_random};
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Config, Gpt2, Tokenizer};
use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_proto::v1::SamplingParams as PbSampling;
use rookworld_service::probe::{list_services, scrape_metrics};
use rookworld_weights::relay::Route;
use rookworld_weights::set::{self as weights, WeightSet};
use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

const TOKEN: &str = "s3cret-token";
const PROMPTS: [&str; 2] = [
    "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:",
    "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+e2e4+",
];

fn model(seed: u64) -> Gpt2 {
    init_random(&Config::tiny(), seed, DType::F32, &Device::Cpu).unwrap()
}

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    worker: Worker,
}

impl Server {
    async fn start(engine_cfg: EngineConfig) -> Self {
        Self::start_with(engine_cfg, None).await
    }

    /// The worker behind [`TOKEN`], and `inspect` for Status when given.
    async fn start_with(engine_cfg: EngineConfig, inspect: Option<&str>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let config = WorkerConfig {
            engine: engine_cfg,
            service: ServiceConfig {
                guard: rookworld_service::auth::Guard::new(
                    Some(TOKEN.into()),
                    inspect.map(str::to_owned),
                ),
                ..ServiceConfig::default()
            },
            ..WorkerConfig::new(model(1))
        };
        let worker = Worker::start(config, listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
        Self {
            addr: worker.local_addr(),
            stop: Some(tx),
            worker,
        }
    }

    async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    async fn client(&self) -> RolloutServiceClient<Channel> {
        RolloutServiceClient::new(self.channel().await)
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.worker.wait().await.unwrap();
    }
}

fn generate_request(n: u32, max_new_tokens: u32, seed: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompts: PROMPTS
            .iter()
            .map(|t| pb::Prompt {
                text: (*t).into(),
                ids: vec![],
            })
            .collect(),
        num_completions: n,
        sampling: Some(PbSampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens,
            seed,
        }),
    }
}

/// Every response of a Generate call, by (prompt, sample).
/// `msg` carrying [`TOKEN`].
fn authed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    rookworld_service::auth::set_token(r.metadata_mut(), TOKEN).unwrap();
    r
}

async fn generate(
    client: &mut RolloutServiceClient<Channel>,
    r: pb::GenerateRequest,
) -> BTreeMap<(u32, u32), pb::GenerateResponse> {
    let mut stream = client.generate(authed(r)).await.unwrap().into_inner();
    let mut out = BTreeMap::new();
    while let Some(item) = stream.next().await {
        let item = item.unwrap();
        assert!(
            out.insert((item.prompt_index, item.sample_index), item)
                .is_none(),
            "a sample came twice"
        );
    }
    out
}

/// What the engine alone makes of the same request with `m`, readied for generation as
/// the worker readies its models.
fn expected(m: Gpt2, n: usize, max_new_tokens: usize, seed: u64) -> Vec<Vec<u32>> {
    let m = prepare_model(m).unwrap();
    let tok = Tokenizer::gpt2();
    let prompts = PROMPTS
        .iter()
        .map(|t| {
            let mut ids = vec![m.config().bos_token_id];
            ids.extend(tok.encode(t).unwrap());
            ids
        })
        .collect();
    let mut s = Scheduler::new(Arc::new(m), 0, EngineConfig::default());
    s.submit(EngineRequest {
        prompts,
        n,
        max_new_tokens,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        seed,
        ignore_eos: false,
    })
    .unwrap();
    s.run_to_completion()
        .unwrap()
        .0
        .into_iter()
        .map(|x| x.completion.ids)
        .collect()
}

/// The bfloat16 weight set of `m` and the model a worker builds from it.
fn bf16_set(m: &Gpt2, version: u64) -> (WeightSet, Gpt2) {
    let set = WeightSet::from_model(m, "run-a", version).unwrap();
    let received =
        model_io::from_bytes(&set.bytes, &Config::tiny(), DType::F32, &Device::Cpu).unwrap();
    (set, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_streams_every_completion_with_logprobs_and_version() {
    let server = Server::start(EngineConfig::default()).await;
    let mut client = server.client().await;
    let got = generate(&mut client, generate_request(3, 10, 4)).await;
    assert_eq!(got.len(), 6);
    let want = expected(model(1), 3, 10, 4);
    for (k, ((p, _), r)) in got.iter().enumerate() {
        let c = r.completion.as_ref().unwrap();
        assert_eq!(c.ids, want[k]);
        assert_eq!(c.logprobs.len(), c.ids.len());
        assert!(c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        assert_eq!(c.weight_version, 0);
        assert!(
            r.prompt_ids.is_empty() || r.prompt_ids[0] == 50256,
            "prompt {p} fed with BOS"
        );
    }
    // Prompt ids come once per prompt.
    assert_eq!(got.values().filter(|r| !r.prompt_ids.is_empty()).count(), 2);

    // Bad requests fail before anything is generated.
    let mut bad = generate_request(0, 10, 4);
    let err = client.generate(authed(bad.clone())).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    bad.num_completions = 1;
    bad.prompts[0].ids = vec![1, 2];
    let err = client.generate(authed(bad.clone())).await.unwrap_err();
    assert!(err.message().contains("exactly one"), "{err:?}");
    bad.prompts[0].text.clear();
    bad.prompts[0].ids = vec![70_000];
    let err = client.generate(authed(bad)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("vocabulary"), "{err:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_updates_need_the_token_and_a_valid_payload_and_keep_old_weights_otherwise() {
    let server = Server::start(EngineConfig::default()).await;
    let mut client = server.client().await;
    let status = |c: &mut RolloutServiceClient<Channel>| {
        let mut c = c.clone();
        async move { c.status(pb::StatusRequest {}).await.unwrap().into_inner() }
    };
    let before = generate(&mut client, generate_request(2, 8, 1)).await;
    let (set, received) = bf16_set(&model(2), 1);

    // No token, wrong token: refused before any byte is read.
    let err = client
        .update_weights(tokio_stream::iter(set.chunks(64 * 1024)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = weights::push(&mut client, &set, "wrong", 64 * 1024)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // A corrupted chunk: rejected by the checksum.
    let mut corrupted = set.clone();
    let mut flipped = set.bytes.to_vec();
    flipped[1000] ^= 1;
    corrupted.bytes = flipped.into();
    corrupted.blake3 = set.blake3;
    let err = weights::push(&mut client, &corrupted, TOKEN, 64 * 1024)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert_eq!(status(&mut client).await.weight_version, 0);
    // The old weights are still in use: same output as before.
    assert_eq!(
        generate(&mut client, generate_request(2, 8, 1)).await,
        before
    );

    // A valid update lands and is used.
    let answer = weights::push(&mut client, &set, TOKEN, 64 * 1024)
        .await
        .unwrap();
    assert_eq!((answer.version, answer.bytes), (1, set.bytes.len() as u64));
    let s = status(&mut client).await;
    assert_eq!(
        (s.weight_version, s.device.as_str(), s.dtype.as_str()),
        (1, "cpu", "f32")
    );
    let after = generate(&mut client, generate_request(2, 8, 1)).await;
    let want = expected(received, 2, 8, 1);
    for (k, r) in after.values().enumerate() {
        let c = r.completion.as_ref().unwrap();
        assert_eq!((c.weight_version, &c.ids), (1, &want[k]));
    }
    // The same version again (a retry whose answer was lost) is answered, nothing swapped.
    let again = weights::push(&mut client, &set, TOKEN, 64 * 1024)
        .await
        .unwrap();
    assert_eq!(again.version, 1);
    assert_eq!(status(&mut client).await.weight_version, 1);
    // An older version than the one in use is stale.
    let newer = WeightSet {
        version: 2,
        ..set.clone()
    };
    weights::push(&mut client, &newer, TOKEN, 64 * 1024)
        .await
        .unwrap();
    let err = weights::push(&mut client, &set, TOKEN, 64 * 1024)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("run `run-a`"), "{err:?}");
    // ... refused on its header, before the body: a stream that sends the first chunk and
    // then nothing more is answered all the same (it would hang if the body were awaited).
    let first = set.chunks(64 * 1024).next().unwrap();
    let mut request =
        tonic::Request::new(tokio_stream::iter([first]).chain(tokio_stream::pending()));
    rookworld_service::auth::set_token(request.metadata_mut(), TOKEN).unwrap();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        client.update_weights(request),
    )
    .await
    .expect("a stale header is answered without the body")
    .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let now = status(&mut client).await;
    assert_eq!(
        (now.weight_version, now.weight_run_id.as_str()),
        (2, "run-a")
    );
    // A new run counts from 1 again: its first push replaces another run's weights.
    let next_run = WeightSet {
        run_id: "run-b".into(),
        version: 1,
        ..set.clone()
    };
    let took = weights::push(&mut client, &next_run, TOKEN, 64 * 1024)
        .await
        .unwrap();
    assert_eq!(took.version, 1);
    let now = status(&mut client).await;
    assert_eq!(
        (now.weight_version, now.weight_run_id.as_str()),
        (1, "run-b")
    );
    // ... and within that run a version must still rise.
    let err = weights::push(&mut client, &next_run, TOKEN, 64 * 1024).await;
    assert_eq!(
        err.unwrap().version,
        1,
        "the same version again: answered, not swapped"
    );
    let older_of_a = WeightSet {
        version: 3,
        ..set.clone()
    };
    weights::push(&mut client, &older_of_a, TOKEN, 64 * 1024)
        .await
        .unwrap();
    assert_eq!(status(&mut client).await.weight_run_id, "run-a");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_during_generation_never_mixes_versions_in_a_completion() {
    for policy in [SwapPolicy::Drain, SwapPolicy::Restart] {
        // Two rows for eight samples: most samples wait while the swap arrives.
        let server = Server::start(EngineConfig {
            max_seqs: 2,
            swap_policy: policy,
            ..EngineConfig::default()
        })
        .await;
        let mut client = server.client().await;
        let (set, received) = bf16_set(&model(3), 7);
        let mut stream = client
            .generate(authed(generate_request(4, 40, 9)))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        let mut pusher = client.clone();
        let push =
            tokio::spawn(async move { weights::push(&mut pusher, &set, TOKEN, 64 * 1024).await });
        let mut got = BTreeMap::from([((first.prompt_index, first.sample_index), first)]);
        while let Some(item) = stream.next().await {
            let item = item.unwrap();
            got.insert((item.prompt_index, item.sample_index), item);
        }
        assert_eq!(push.await.unwrap().unwrap().version, 7);
        assert_eq!(got.len(), 8);
        let old = expected(model(1), 4, 40, 9);
        let new = expected(received.clone(), 4, 40, 9);
        let mut versions = std::collections::BTreeSet::new();
        for (k, r) in got.values().enumerate() {
            let c = r.completion.as_ref().unwrap();
            versions.insert(c.weight_version);
            let want = if c.weight_version == 0 {
                &old[k]
            } else {
                &new[k]
            };
            assert_eq!(
                &c.ids, want,
                "{policy:?}: sample {k} is not all version {}",
                c.weight_version
            );
        }
        assert_eq!(versions.len(), 2, "{policy:?}: the swap landed mid-request");
        server.stop().await;
    }
}

/// Pushes that ask to be answered once staged, during a drain: each answer says whether
/// its version was in use (and gives no in-use time when not), a second push takes the
/// first's place while that one is still staged, the same version again is answered as
/// held, a corrupted third is refused without costing the staged one its place, no
/// completion mixes versions, and the staged version goes into use once the sequences in
/// flight are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_answered_once_staged_leave_the_drain_to_the_worker() {
    let server = Server::start(EngineConfig {
        max_seqs: 2,
        swap_policy: SwapPolicy::Drain,
        ..EngineConfig::default()
    })
    .await;
    let mut client = server.client().await;
    let staged = Route {
        answer_when_staged: true,
        ..Route::default()
    };
    let push = |client: &RolloutServiceClient<Channel>, version: u64| {
        let (set, _) = bf16_set(&model(version), version);
        let chunks = tokio_stream::iter(
            staged
                .clone()
                .apply(set.chunks(64 * 1024))
                .collect::<Vec<_>>(),
        );
        let mut c = client.clone();
        async move { weights::send(&mut c, chunks, TOKEN).await.unwrap() }
    };
    let in_use = |client: &RolloutServiceClient<Channel>| {
        let mut c = client.clone();
        async move {
            c.status(pb::StatusRequest {})
                .await
                .unwrap()
                .into_inner()
                .weight_version
        }
    };
    let mut stream = client
        .generate(authed(generate_request(4, 40, 9)))
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    // Version 8 takes 7's place if 7 is still staged: it may never run.
    for (before, version) in [(0, 7), (0, 8)] {
        let answer = push(&client, version).await;
        assert_eq!(answer.version, version);
        if !answer.in_use {
            assert_eq!((answer.in_use_unix_ns, answer.swap_seconds), (0, 0.0));
        }
        let running = in_use(&client).await;
        assert!(
            running == before || running == 7 || running == version,
            "{running}"
        );
    }
    assert_eq!(push(&client, 8).await.version, 8, "the version held");
    // A corrupted version 9 is refused before version 8 is taken back from the engine:
    // 8 stays staged and goes into use after the drain.
    let (set, _) = bf16_set(&model(9), 9);
    let mut corrupted = set.bytes.to_vec();
    corrupted[1000] ^= 1;
    let corrupted = WeightSet {
        bytes: corrupted.into(),
        ..set
    };
    let chunks = staged.clone().apply(corrupted.chunks(64 * 1024));
    let err = weights::send(
        &mut client,
        tokio_stream::iter(chunks.collect::<Vec<_>>()),
        TOKEN,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    let mut completions = vec![first.completion.unwrap()];
    while let Some(item) = stream.next().await {
        completions.push(item.unwrap().completion.unwrap());
    }
    assert_eq!(completions.len(), 8);
    assert!(completions.iter().all(|c| c.token_versions.is_empty()));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while in_use(&client).await != 8 {
        assert!(
            std::time::Instant::now() < deadline,
            "version 8 never went into use"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reflection_and_metrics_are_served() {
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    rollout_worker::metrics::install_exporter(metrics_addr).unwrap();
    let server = Server::start(EngineConfig::default()).await;
    let mut client = server.client().await;
    generate(&mut client, generate_request(2, 6, 0)).await;

    let mut health = tonic_health::pb::health_client::HealthClient::new(server.channel().await);
    let reply = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "rookworld.rollout.v1.RolloutService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        reply.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Exactly what this server serves: its service, health and reflection (v1, v1alpha).
    for alpha in [false, true] {
        let mut services = list_services(server.channel().await, alpha).await.unwrap();
        services.sort();
        assert_eq!(
            services,
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "rookworld.rollout.v1.RolloutService",
            ],
            "v1alpha: {alpha}"
        );
    }

    let body = tokio::task::spawn_blocking(move || scrape_metrics(metrics_addr))
        .await
        .unwrap()
        .unwrap();
    for name in [
        "rollout_tokens_generated_total",
        "rollout_weight_version",
        "rollout_batch_occupancy_ratio",
        "rollout_pending_requests",
        "rollout_decode_step_seconds_bucket",
        "rollout_prefill_seconds_sum",
        "rollout_completions_total{finish_reason=",
        concat!(
            "rollout_build_info{version=\"",
            env!("CARGO_PKG_VERSION"),
            "\""
        ),
    ] {
        assert!(body.contains(name), "{name} missing from\n{body}");
    }
    let tokens: f64 = body
        .lines()
        .find(|l| l.starts_with("rollout_tokens_generated_total "))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap();
    assert!(tokens >= 12.0, "{tokens}");
    server.stop().await;
}

/// Generate spends the GPU: it needs the shared token. Status is open unless the worker
/// has an inspection token; then it (or the shared token) is needed, and it does no work.
#[tokio::test]
async fn generate_needs_the_token_and_status_the_inspection_token_when_one_is_set() {
    let server = Server::start_with(EngineConfig::default(), Some("look")).await;
    let mut client = server.client().await;
    let err = client
        .generate(generate_request(1, 4, 1))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let mut wrong = tonic::Request::new(generate_request(1, 4, 1));
    rookworld_service::auth::set_token(wrong.metadata_mut(), "look").unwrap();
    let err = client.generate(wrong).await.expect_err("refused");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = client.status(pb::StatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let mut look = tonic::Request::new(pb::StatusRequest {});
    rookworld_service::auth::set_token(look.metadata_mut(), "look").unwrap();
    client.status(look).await.unwrap();
    client.status(authed(pb::StatusRequest {})).await.unwrap();
    assert_eq!(
        generate(&mut client, generate_request(1, 4, 1)).await.len(),
        2
    );
    server.stop().await;

    let open = Server::start(EngineConfig::default()).await;
    open.client()
        .await
        .status(pb::StatusRequest {})
        .await
        .unwrap();
    open.stop().await;
}
