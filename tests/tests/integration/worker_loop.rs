//! A rollout worker's loop against a real learner queue and a real reward server on
//! loopback: it leases, generates, scores and submits every prompt, and waits out a reward
//! server that comes up late.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use learner::prompts::{Generator, TaskKind};
use learner::queue::{Queue, QueueConfig, QueueHandle};
use learner::queue_service::{self, GroupCheck, GroupSpec, QueueServer};
use rollout_worker::{LoopConfig, Worker, WorkerConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_scores_and_submits_every_leased_prompt() {
    // The queue, with four environment prompts of three completions each.
    let mut initial = Queue::new(QueueConfig::default());
    let mut prompts = Generator::new(1, 0.0);
    for i in 0..4 {
        let p = prompts.next_prompt();
        assert_eq!(p.kind, TaskKind::Environment);
        initial.add(p, i);
    }
    let queue = QueueHandle::start(initial);
    let spec = GroupSpec {
        num_completions: 3,
        sampling: rookworld_proto::v1::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 12,
            seed: 0,
        },
        check: GroupCheck::for_model(&Config::tiny()),
    };
    let server = QueueServer::new(
        queue.clone(),
        spec,
        Some("t".into()),
        Arc::new(AtomicU64::new(0)),
    );
    let queue_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let queue_addr = queue_listener.local_addr().unwrap();
    tokio::spawn(queue_service::run(
        server,
        queue_listener,
        std::future::pending(),
    ));

    // The reward server's port is taken now but served only after a while.
    let reward_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let reward_addr = reward_listener.local_addr().unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let scorer = Scorer::new(RewardConfig::default(), None);
        reward_server::service::run(
            scorer,
            reward_server::service::ServiceConfig {
                guard: rookworld_service::auth::Guard::shared("t"),
                ..Default::default()
            },
            reward_listener,
            std::future::pending(),
        )
        .await
    });

    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let push_address = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cfg = LoopConfig {
        learner: format!("http://{queue_addr}"),
        reward: format!("http://{reward_addr}"),
        token: "t".into(),
        worker_id: "worker-a".into(),
        push_address: push_address.clone(),
        max_in_flight: 3,
        call_timeout: Duration::from_millis(500),
        max_backoff: Duration::from_millis(400),
        tls: Default::default(),
    };
    let config = WorkerConfig {
        pull: Some(cfg),
        ..WorkerConfig::new(model)
    };
    let worker = Worker::start(config, listener, async {
        let _ = stopped.await;
    })
    .await
    .unwrap();

    let started = Instant::now();
    loop {
        let depths = queue.run(|q| q.depths()).await;
        if depths.scored >= 4 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{depths:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(()).unwrap();
    worker.wait().await.unwrap();

    let groups = queue.run(|q| q.take(10, 0)).await;
    assert_eq!(groups.len(), 4);
    let mut ids: Vec<u64> = groups.iter().map(|g| g.prompt_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2, 3], "each prompt once");
    for g in &groups {
        assert_eq!(
            (g.completions.len(), g.worker.as_str(), g.weight_version),
            (3, "worker-a", 0)
        );
        assert!(g.prompt.starts_with("A: ") && g.prompt_ids[0] == 50256);
        assert!(g.score_seconds > 0.0 && g.generate_seconds > 0.0);
        for c in &g.completions {
            assert_eq!(c.logprobs.len(), c.ids.len());
            assert!((-1.0..=1.0).contains(&c.reward));
        }
    }
    assert_eq!(
        queue
            .run(|q| q.workers()["worker-a"].push_address.clone())
            .await,
        push_address
    );
    let d = queue.run(|q| q.depths()).await;
    assert_eq!(
        (
            d.counters.groups_submitted,
            d.counters.submissions_refused,
            d.counters.leases_expired
        ),
        (4, 0, 0)
    );
}
