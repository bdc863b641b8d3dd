//! Weight push to real rollout workers on loopback: all in parallel with a deadline; a worker
//! that is not serving fails alone, is marked stale, and is re-synced when it comes back.

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use learner::push::{DeltaPolicy, Fleet, SyncState};
use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;
use rookworld_weights::set::WeightSet;

pub(crate) const TOKEN: &str = "push-token";

/// A worker on `listener`, served until the test ends.
pub(crate) async fn serve(listener: tokio::net::TcpListener) {
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

/// Version `version` of run `run`: `base`'s payload with every `every`-th value of its
/// tensors moved in its last bit (`salt` picks which bit pattern).
pub(crate) fn moved(
    base: &WeightSet,
    run: &str,
    version: u64,
    every: usize,
    salt: u8,
) -> WeightSet {
    let mut bytes = base.bytes.to_vec();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for w in bytes[header..].chunks_exact_mut(2).step_by(every) {
        w[0] ^= salt;
    }
    WeightSet::from_bytes(run, version, bytes)
}

/// A worker known to run the version before the newest is sent only what changed; one
/// that holds another base, or a copy of the base that differs from the learner's, is
/// sent the payload in the same push, the refusal named; the bytes of each kind are
/// counted for the step log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_the_version_before_is_sent_only_what_changed() {
    // `always`: on loopback `auto` would measure the link and stream payloads instead
    // (push::delta::tests::a_delta_goes_only_where_it_arrives_sooner).
    let mut fleet = Fleet::new(Duration::from_secs(1)).with_deltas(DeltaPolicy::Always);
    let mut workers = Vec::new();
    for _ in 0..2 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        fleet.register(&url);
        serve(listener).await;
        workers.push(url);
    }
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();
    let full = v1.bytes.len() as u64;
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert!(
        outcomes
            .iter()
            .all(|o| o.path == "stream" && o.bytes == full),
        "{outcomes:?}"
    );

    let v2 = moved(&v1, "run", 2, 20, 1);
    let outcomes = fleet.push(&v2, TOKEN, Duration::from_secs(10)).await;
    for o in &outcomes {
        assert_eq!((o.path, o.error.as_deref()), ("delta", None), "{o:?}");
        assert!(o.bytes < full / 4, "a delta of {} bytes of {full}", o.bytes);
    }
    let delta = outcomes[0].bytes;
    let pushed = fleet.take_pushed();
    assert_eq!(
        (pushed.pushes, pushed.full, pushed.delta),
        (4, 2 * full, 2 * delta)
    );
    assert_eq!(fleet.take_pushed(), learner::push::PushBytes::default());
    let link = fleet.via(&workers[0]).link;
    assert!(
        link.bytes_per_second.is_some() && link.apply_seconds.is_some(),
        "the pushes measured the link and the delta's apply: {link:?}"
    );

    // The first worker is given another version 3 behind the fleet's back: it holds no
    // base for a delta against version 2, and is streamed version 4 whole.
    let (a, b) = (workers[0].clone(), workers[1].clone());
    let aside = moved(&v2, "run", 3, 7, 2);
    let o = learner::push::push_to(
        a.clone(),
        aside,
        TOKEN.into(),
        Duration::from_secs(10),
        false,
    )
    .await;
    assert_eq!(o.error, None);
    let v4 = moved(&v2, "run", 4, 30, 4);
    let outcomes = fleet.push(&v4, TOKEN, Duration::from_secs(10)).await;
    let of = |w: &str| outcomes.iter().find(|o| o.worker == w).unwrap().clone();
    let (oa, ob) = (of(&a), of(&b));
    assert_eq!(
        (oa.path, oa.bytes, oa.error.as_deref()),
        ("stream", full, None)
    );
    let why = oa.delta_refused.expect("the refusal named");
    assert!(
        why.contains("delta against version 2") && why.contains("holds the payload of version 3"),
        "{why}"
    );
    assert_eq!(
        (ob.path, ob.error.as_deref(), ob.delta_refused.as_deref()),
        ("delta", None, None),
        "{ob:?}"
    );

    // A learner that knows the second worker runs version 4, but whose version 4 is not
    // the one it holds (a learner restarted from another history): the payload the delta
    // makes fails the hash, the worker keeps its weights, and is streamed version 5 whole.
    let mut other = Fleet::new(Duration::from_secs(1)).with_deltas(DeltaPolicy::Always);
    other.mark(&b, 4, Instant::now());
    let v4_elsewhere = moved(&v1, "run", 4, 11, 8);
    assert!(
        other
            .push(&v4_elsewhere, TOKEN, Duration::from_secs(5))
            .await
            .is_empty()
    );
    let v5 = moved(&v4_elsewhere, "run", 5, 40, 1);
    let o = other
        .push(&v5, TOKEN, Duration::from_secs(10))
        .await
        .remove(0);
    assert_eq!((o.path, o.error.as_deref()), ("stream", None), "{o:?}");
    let why = o.delta_refused.expect("the refusal named");
    assert!(why.contains("differs from the sender's"), "{why}");
    assert_eq!(other.state(&b, 5), Some(SyncState::Current));
}
