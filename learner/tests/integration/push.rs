//! Weight push to real rollout workers on loopback: all in parallel with a deadline; a worker
//! that is not serving fails alone, is marked stale, and is re-synced when it comes back.

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use learner::push::{Fleet, SyncState};
use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;
use rookworld_weights::set::WeightSet;

const TOKEN: &str = "push-token";

/// A worker on `listener`, served until the test ends.
async fn serve(listener: tokio::net::TcpListener) {
    let model = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
    let config = WorkerConfig {
        service: ServiceConfig {
            guard: rookworld_service::auth::Guard::shared(TOKEN),
            ..ServiceConfig::default()
        },
        ..WorkerConfig::new(model)
    };
    let worker = Worker::start(config, listener, std::future::pending());
    drop(worker.await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_never_blocks_the_others_and_is_resynced() {
    let mut fleet = Fleet::new(Duration::from_secs(1));
    let mut late = None;
    for i in 0..3 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        fleet.register(&format!("http://{}", listener.local_addr().unwrap()));
        if i < 2 {
            serve(listener).await;
        } else {
            late = Some(listener); // bound, not served: connections hang
        }
    }
    let next = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let set = WeightSet::from_model(&next, "", 1).unwrap();

    let started = Instant::now();
    let outcomes = fleet.push(&set, TOKEN, Duration::from_secs(2)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the push waited on the dead worker"
    );
    assert_eq!(outcomes.len(), 3);
    let failed: Vec<_> = outcomes.iter().filter(|o| o.error.is_some()).collect();
    assert_eq!(failed.len(), 1, "{outcomes:?}");
    assert!(
        outcomes
            .iter()
            .filter(|o| o.error.is_none())
            .all(|o| o.bytes == set.bytes.len() as u64)
    );
    let dead = failed[0].worker.clone();
    assert_eq!(fleet.stale(1), vec![dead.clone()]);
    assert_eq!(fleet.state(&dead, 1), Some(SyncState::Failing));

    // Backing off: an immediate second round leaves it alone (the others are current).
    assert!(
        fleet
            .push(&set, TOKEN, Duration::from_secs(2))
            .await
            .is_empty()
    );

    // It comes back: after the back-off the next round reaches only it.
    serve(late.take().unwrap()).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let outcomes = fleet.push(&set, TOKEN, Duration::from_secs(10)).await;
    assert_eq!(outcomes.len(), 1);
    assert_eq!(
        (outcomes[0].worker.as_str(), outcomes[0].error.as_deref()),
        (dead.as_str(), None)
    );
    assert!(fleet.stale(1).is_empty());
    assert_eq!(fleet.state(&dead, 1), Some(SyncState::Current));

    // The same version again is nothing to do; pushed anyway, a worker answers it is in
    // use (a retry after a lost answer succeeds).
    assert!(
        fleet
            .push(&set, TOKEN, Duration::from_secs(2))
            .await
            .is_empty()
    );
    let again = learner::push::push_to(
        dead.clone(),
        set.clone(),
        TOKEN.into(),
        Duration::from_secs(5),
        true,
    )
    .await;
    assert_eq!(again.error, None, "{again:?}");

    // A wrong token is a failure for every worker, and they stay on version 1.
    let v2 = WeightSet::from_model(&next, "", 2).unwrap();
    let outcomes = fleet.push(&v2, "wrong", Duration::from_secs(5)).await;
    assert!(
        outcomes.iter().all(|o| o
            .error
            .as_deref()
            .is_some_and(|e| e.contains("PermissionDenied"))),
        "{outcomes:?}"
    );
    assert_eq!(fleet.stale(2).len(), 3);
}
