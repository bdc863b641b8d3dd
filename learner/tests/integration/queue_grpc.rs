//! The rollout queue over real gRPC on 127.0.0.1:0: worker calls need the token; leases,
//! submissions and the inspection calls people use with grpcurl; reflection lists it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use learner::prompts::{TaskKind, TaskPrompt};
use learner::queue::{Queue, QueueConfig, QueueHandle};
use learner::queue_service::{self, GroupCheck, GroupSpec, QueueServer};
use rookworld_proto::queue::v1 as pb;
use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
use tonic::Code;
use tonic::transport::Channel;

const TOKEN: &str = "queue-token";

fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_lease_and_submit_and_people_can_look_inside() {
    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    learner::metrics::install_exporter(metrics_addr).unwrap();
    let mut initial = Queue::new(QueueConfig::default());
    initial.set_run("run-a");
    for i in 0..3 {
        initial.add(
            TaskPrompt {
                kind: TaskKind::Environment,
                prompt: format!("A: prompt {i}+"),
                completion: None,
            },
            100 + i,
        );
    }
    let queue = QueueHandle::start(initial);
    let spec = GroupSpec {
        num_completions: 4,
        sampling: rookworld_proto::v1::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 32,
            seed: 0,
        },
        check: GroupCheck::for_model(&rookworld_lm::Config::tiny()),
    };
    let server = QueueServer::new(
        queue.clone(),
        spec,
        Some(TOKEN.into()),
        Arc::new(AtomicU64::new(3)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(queue_service::run(server, listener, async {
        let _ = stopped.await;
    }));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RolloutQueueClient::new(channel.clone());
    let lease = |n| pb::LeaseRequest {
        worker_id: "w1".into(),
        max_prompts: n,
        weight_version: 3,
        push_address: "http://w1:50053".into(),
        weight_run_id: "run-a".into(),
    };

    // No token, wrong token.
    assert_eq!(
        client.lease(lease(2)).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert_eq!(
        client
            .lease(authed(lease(2), "nope"))
            .await
            .unwrap_err()
            .code(),
        Code::PermissionDenied
    );

    let got = client
        .lease(authed(lease(2), TOKEN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (got.prompts.len(), got.num_completions, got.learner_version),
        (2, 4, 3)
    );
    assert_eq!(got.sampling.unwrap().max_new_tokens, 32);
    let first = &got.prompts[0];
    assert_eq!(
        (
            first.task(),
            first.prompt.as_str(),
            first.seed,
            first.attempt
        ),
        (
            rookworld_proto::reward::v1::Task::Environment,
            "A: prompt 0+",
            100,
            1
        )
    );
    assert!(first.deadline_seconds > 100.0);

    let completion = |reward: f32| pb::ScoredCompletion {
        ids: vec![1, 2, 50256],
        text: "x".into(),
        logprobs: vec![-1.0, -2.0, -0.5],
        reward,
        components: HashMap::from([("format".to_owned(), 1.0f32)]),
        token_versions: vec![],
    };
    let check = GroupCheck::for_model(&rookworld_lm::Config::tiny());
    let submit = |lease_id, prompt_id| pb::SubmitRequest {
        worker_id: "w1".into(),
        lease_id,
        prompt_id,
        prompt_ids: check.prompt_ids("A: prompt 0+").unwrap(),
        completions: vec![
            completion(1.0),
            completion(-1.0),
            completion(0.0),
            completion(0.5),
        ],
        weight_version: 3,
        generate_seconds: 0.5,
        score_seconds: 0.1,
        run_id: "run-a".into(),
    };
    // No token, wrong token: refused, nothing taken.
    assert_eq!(
        client
            .submit(submit(first.lease_id, first.prompt_id))
            .await
            .unwrap_err()
            .code(),
        Code::Unauthenticated
    );
    assert_eq!(
        client
            .submit(authed(submit(first.lease_id, first.prompt_id), "nope"))
            .await
            .unwrap_err()
            .code(),
        Code::PermissionDenied
    );
    // Groups the learner could not train on: INVALID_ARGUMENT, and the lease stays.
    type Break = fn(&mut pb::SubmitRequest);
    let broken: Vec<(&str, Break)> = vec![
        ("a completion short", |r| {
            r.completions.pop();
        }),
        ("an id past the vocabulary", |r| {
            r.completions[1].ids[0] = 60_000;
        }),
        ("a positive log-prob", |r| {
            r.completions[2].logprobs[0] = 0.5
        }),
        ("a NaN reward", |r| r.completions[0].reward = f32::NAN),
        ("more tokens than asked", |r| {
            r.completions[0].ids = vec![7; 33];
            r.completions[0].logprobs = vec![-1.0; 33];
        }),
        ("other prompt ids", |r| r.prompt_ids.push(7)),
        ("a huge text", |r| {
            r.completions[3].text = "x".repeat(1 << 20)
        }),
        ("a bad worker id", |r| r.worker_id = "w1\n".into()),
        ("token versions not one per id", |r| {
            r.completions[0].token_versions = vec![r.weight_version; 2]
        }),
        ("a token older than the group", |r| {
            let n = r.completions[1].ids.len();
            r.completions[1].token_versions = vec![r.weight_version; n];
            r.completions[1].token_versions[0] = r.weight_version.wrapping_sub(1);
        }),
    ];
    for (what, breaks) in broken {
        let mut r = submit(first.lease_id, first.prompt_id);
        breaks(&mut r);
        let err = client.submit(authed(r, TOKEN)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
    }
    client
        .submit(authed(submit(first.lease_id, first.prompt_id), TOKEN))
        .await
        .unwrap();
    // The same lease twice, or another worker's lease: refused.
    let again = client
        .submit(authed(submit(first.lease_id, first.prompt_id), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition, "{again:?}");
    let mut bad = submit(got.prompts[1].lease_id, got.prompts[1].prompt_id);
    bad.completions[0].logprobs.pop();
    assert_eq!(
        client.submit(authed(bad, TOKEN)).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let d = client
        .get_depths(pb::GetDepthsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            d.pending,
            d.leased,
            d.scored,
            d.groups_submitted,
            d.submissions_refused
        ),
        (1, 1, 1, 1, 1)
    );
    let w = client
        .list_workers(pb::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(w.workers.len(), 1);
    assert_eq!(
        (
            w.workers[0].submitted,
            w.workers[0].outstanding,
            w.workers[0].weight_version
        ),
        (1, 1, 3)
    );
    assert_eq!(w.workers[0].push_address, "http://w1:50053");
    assert_eq!(w.workers[0].weight_run_id, "run-a");
    assert_eq!(d.run_id, "run-a");
    let peek = client
        .peek_groups(pb::PeekGroupsRequest {
            count: 5,
            newest: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(peek.groups.len(), 1);
    let g = &peek.groups[0];
    assert_eq!(
        (
            g.prompt.as_str(),
            g.worker_id.as_str(),
            g.seed,
            g.completions.len()
        ),
        ("A: prompt 0+", "w1", 100, 4)
    );
    assert_eq!(g.completions[0].components["format"], 1.0);

    // A real Prometheus scrape shows the same depths.
    let body =
        tokio::task::spawn_blocking(move || rookworld_service::probe::scrape_metrics(metrics_addr))
            .await
            .unwrap()
            .unwrap();
    for line in [
        "learner_queue_scored 1",
        "learner_queue_leased 1",
        "learner_queue_groups_submitted_total 1",
        "learner_queue_submissions_refused_total 1",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "{line} missing from\n{body}"
        );
    }
    let build = concat!(
        "learner_build_info{version=\"",
        env!("CARGO_PKG_VERSION"),
        "\""
    );
    assert!(
        body.lines()
            .any(|l| l.starts_with(build) && l.ends_with(" 1")),
        "{build} missing from\n{body}"
    );

    // The learner takes it; the staleness histogram shows lag 0.
    assert_eq!(queue.run(|q| q.take(10, 3).len()).await, 1);
    let s = client
        .get_staleness(pb::GetStalenessRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((s.buckets[0], s.dropped_stale), (1, 0));

    // A group made with another run's weights (a worker left over from an earlier run):
    // its lease is answered, and the group is dropped, counted with the stale ones, even
    // though its version number is the learner's.
    let mut old_run = submit(got.prompts[1].lease_id, got.prompts[1].prompt_id);
    old_run.run_id = "run-old".into();
    old_run.prompt_ids = check.prompt_ids(&got.prompts[1].prompt).unwrap();
    client.submit(authed(old_run, TOKEN)).await.unwrap();
    assert_eq!(queue.run(|q| q.ready(3)).await, 0);
    assert_eq!(queue.run(|q| q.take(10, 3).len()).await, 0);
    let s = client
        .get_staleness(pb::GetStalenessRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.dropped_stale, 1);
    // A lease reporting another run's weights: the worker runs none of the learner's
    // versions (reported as 0), so the weight sync pushes to it.
    let mut other = lease(1);
    other.weight_run_id = "run-old".into();
    client.lease(authed(other, TOKEN)).await.unwrap();
    let reported = queue
        .run(|q| {
            let w = &q.workers()["w1"];
            (w.reported_run.clone(), w.reported_version)
        })
        .await;
    assert_eq!(reported, ("run-old".to_owned(), Some(0)));

    for alpha in [false, true] {
        let mut services = rookworld_service::probe::list_services(channel.clone(), alpha)
            .await
            .unwrap();
        services.sort();
        assert_eq!(
            services,
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "rookworld.queue.v1.RolloutQueue",
            ],
            "only what this server serves (v1alpha: {alpha})"
        );
    }
    stop.send(()).unwrap();
    handle.await.unwrap().unwrap();
}

/// With `--inspect-token`, the inspection calls need it (or the shared token); the
/// inspection token does no worker's work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inspection_token_closes_the_inspection_calls() {
    let queue = QueueHandle::start(Queue::new(QueueConfig::default()));
    let spec = GroupSpec {
        num_completions: 4,
        sampling: rookworld_proto::v1::SamplingParams::default(),
        check: GroupCheck::for_model(&rookworld_lm::Config::tiny()),
    };
    let server = QueueServer::new(queue, spec, Some(TOKEN.into()), Arc::new(AtomicU64::new(0)))
        .with_inspect_token(Some("look".into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(queue_service::run(server, listener, std::future::pending()));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RolloutQueueClient::new(channel);
    let err = client
        .get_depths(pb::GetDepthsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let err = client
        .list_workers(authed(pb::ListWorkersRequest {}, "nope"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    for token in ["look", TOKEN] {
        client
            .get_depths(authed(pb::GetDepthsRequest {}, token))
            .await
            .unwrap();
        client
            .get_staleness(authed(pb::GetStalenessRequest {}, token))
            .await
            .unwrap();
        client
            .peek_groups(authed(pb::PeekGroupsRequest::default(), token))
            .await
            .unwrap();
    }
    let lease = pb::LeaseRequest {
        worker_id: "w1".into(),
        max_prompts: 1,
        ..Default::default()
    };
    let err = client.lease(authed(lease, "look")).await.unwrap_err();
    assert_eq!(
        err.code(),
        Code::PermissionDenied,
        "the inspection token leases nothing"
    );
}
