//! Relayed weight pushes between real rollout workers on loopback: the learner streams each
//! version to `fanout` workers, which forward it down a tree while they receive it; a
//! relay that fails or hangs is bypassed and the workers below it are served at once.

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use learner::push::{DeltaPolicy, Fleet, PushOutcome, SyncState};
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;
use rookworld_proto::rollout::v1::StatusRequest;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_weights::relay;
use rookworld_weights::set::WeightSet;

use super::push::{TOKEN, moved, serve};

/// A worker served on loopback address `ip`; its push address.
async fn worker_at(ip: &str) -> String {
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    serve(listener).await;
    url
}

/// The version the worker at `url` reports.
async fn version_of(url: &str) -> u64 {
    let mut client = RolloutServiceClient::connect(url.to_owned()).await.unwrap();
    let status = client.status(StatusRequest {}).await.unwrap().into_inner();
    status.weight_version
}

/// Every outcome of a round: the learner's pushes and the ones they relayed.
fn every(outcomes: &[PushOutcome]) -> Vec<&PushOutcome> {
    outcomes
        .iter()
        .flat_map(|o| std::iter::once(o).chain(&o.relayed))
        .collect()
}

/// Seven workers at a fan-out of 2: the learner streams each version to two of them, the
/// rest get it through relays (each worker's parent as the tree says), every worker runs
/// it, and the bytes count the learner's two streams apart from what the relays
/// forwarded — the payload first, then a delta down the same tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_tree_brings_every_worker_the_version_from_two_learner_streams() {
    let mut fleet = Fleet::new(Duration::from_secs(1))
        .with_fanout(2)
        .with_deltas(DeltaPolicy::Always);
    for _ in 0..7 {
        fleet.register(&worker_at("127.0.0.1").await);
    }
    let workers = fleet.addresses();
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();
    let full = v1.bytes.len() as u64;

    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(20)).await;
    assert_eq!(
        outcomes.len(),
        2,
        "the learner calls two roots: {outcomes:?}"
    );
    let all = every(&outcomes);
    assert_eq!(all.len(), 7);
    for o in &all {
        assert_eq!((o.error.as_deref(), o.bytes), (None, full), "{o:?}");
    }
    for (worker, parent) in relay::parents(&workers, 2) {
        let o = all.iter().find(|o| o.worker == worker).unwrap();
        assert_eq!(o.parent, parent, "{worker}");
    }
    let pushed = fleet.take_pushed();
    assert_eq!(
        (pushed.pushes, pushed.full, pushed.relayed),
        (7, 2 * full, 5 * full)
    );
    assert!(fleet.stale(1).is_empty());
    for w in &workers {
        assert_eq!(version_of(w).await, 1, "{w}");
    }

    // The next version as a delta: the relays pass on what changed, nothing more.
    let v2 = moved(&v1, "run", 2, 20, 1);
    let outcomes = fleet.push(&v2, TOKEN, Duration::from_secs(20)).await;
    let all = every(&outcomes);
    assert_eq!(all.len(), 7);
    let delta = outcomes[0].bytes;
    assert!(delta < full / 4, "a delta of {delta} bytes of {full}");
    for o in &all {
        assert_eq!(
            (o.path, o.error.as_deref(), o.bytes),
            ("delta", None, delta),
            "{o:?}"
        );
    }
    let pushed = fleet.take_pushed();
    assert_eq!(
        (pushed.full, pushed.delta, pushed.relayed),
        (0, 2 * delta, 5 * delta)
    );
    for w in &workers {
        assert_eq!(version_of(w).await, 2, "{w}");
    }
}

/// A relay the learner cannot reach (the root of a chain) fails alone: the workers below
/// it are not reached, are no failures of their own, and the next round — at once, not
/// after a back-off — brings them the version through a new chain; the dead relay backs
/// off and is then pushed to alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_relay_is_bypassed_and_the_workers_below_it_served_at_once() {
    let mut fleet = Fleet::new(Duration::from_secs(1)).with_fanout(1);
    // Sorted first, so the root: bound, then closed (connections refused).
    let dead = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    fleet.register(&dead);
    let mut live = Vec::new();
    for _ in 0..3 {
        live.push(worker_at("127.0.0.2").await);
        fleet.register(live.last().unwrap());
    }
    live.sort();
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();

    let started = Instant::now();
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert_eq!(outcomes.len(), 1);
    let root = &outcomes[0];
    assert_eq!(root.worker, dead);
    assert!(root.error.is_some(), "{root:?}");
    assert_eq!(root.relayed.len(), 3);
    for o in &root.relayed {
        assert!(o.unreached, "{o:?}");
        let why = o.error.as_deref().unwrap();
        assert!(
            why.starts_with(&format!("not reached: its relay {dead} failed")),
            "{why}"
        );
        assert_eq!(fleet.state(&o.worker, 1), Some(SyncState::Stale));
    }
    assert_eq!(fleet.state(&dead, 1), Some(SyncState::Failing));

    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the bypass took {:?}",
        started.elapsed()
    );
    let all = every(&outcomes);
    assert_eq!(outcomes.len(), 1, "a new chain: {outcomes:?}");
    assert_eq!(all.len(), 3);
    assert!(all.iter().all(|o| o.error.is_none()), "{outcomes:?}");
    assert_eq!(
        all.iter().map(|o| o.parent.clone()).collect::<Vec<_>>(),
        vec![None, Some(live[0].clone()), Some(live[1].clone())],
        "re-parented"
    );
    assert_eq!(fleet.stale(1), vec![dead.clone()]);
    for w in &live {
        assert_eq!(version_of(w).await, 1, "{w}");
    }
}

/// A relay whose child hangs (its port takes connections and never answers) gives up on
/// it within the child's deadline, answers for the rest of its tree, and names the cause:
/// the hung worker is a failure of its own, the workers below it are not reached, and the
/// next round serves them without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_gives_up_on_a_hung_child_and_its_subtree_is_served_next() {
    let mut fleet = Fleet::new(Duration::from_secs(8)).with_fanout(1);
    let first = worker_at("127.0.0.1").await;
    // Bound and never served: a connection is taken, nothing answers.
    let hung_listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let hung = format!("http://{}", hung_listener.local_addr().unwrap());
    let below = [worker_at("127.0.0.3").await, worker_at("127.0.0.3").await];
    for w in [&first, &hung, &below[0], &below[1]] {
        fleet.register(w);
    }
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();

    let started = Instant::now();
    let deadline = relay::STALL + Duration::from_secs(1);
    let outcomes = fleet.push(&v1, TOKEN, deadline).await;
    let took = started.elapsed();
    assert!(took < deadline, "the relay answered in {took:?}");
    let all = every(&outcomes);
    assert_eq!(all.len(), 4);
    let of = |w: &str| *all.iter().find(|o| o.worker == w).unwrap();
    assert_eq!(of(&first).error, None);
    let why = of(&hung).error.clone().unwrap();
    let cut = format!("took no chunk for {:?}: cut off", relay::STALL);
    assert!(why.contains(&cut), "{why}");
    assert!(!of(&hung).unreached);
    for w in &below {
        assert!(of(w).unreached, "{:?}", of(w));
    }
    // Not a failure with a back-off (its relay might have been the cause): due again.
    assert_eq!(fleet.state(&hung, 1), Some(SyncState::Stale));

    // They never ran a version: joiners, sent it by the peer that has it, the hung worker
    // last in the chain (a leaf) after its failure.
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(3)).await;
    assert_eq!(
        (outcomes.len(), outcomes[0].path),
        (1, "peer"),
        "{outcomes:?}"
    );
    let all = every(&outcomes);
    assert_eq!(all.len(), 4, "{outcomes:?}");
    let failed: Vec<_> = all.iter().filter(|o| o.error.is_some()).collect();
    assert_eq!(failed.len(), 1, "{outcomes:?}");
    assert_eq!(failed[0].worker, hung);
    // Twice in a row: from now on it is pushed alone, and fails there with a back-off.
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(3)).await;
    assert_eq!(
        (outcomes.len(), outcomes[0].worker.as_str()),
        (1, hung.as_str())
    );
    assert!(outcomes[0].relayed.is_empty());
    assert_eq!(fleet.state(&hung, 1), Some(SyncState::Failing));
    for w in [&first, &below[0], &below[1]] {
        assert_eq!(version_of(w).await, 1, "{w}");
    }
    drop(hung_listener);
}

/// The sync loop relays through the workers the queue knows (a chain, at a fan-out of 1),
/// and `ListWorkers` names each one's parent: the learner for the first, then the worker
/// before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sync_loop_relays_and_list_workers_names_each_parent() {
    use learner::queue::{Queue, QueueConfig, QueueHandle};
    use learner::queue_service::{self, GroupCheck, GroupSpec, QueueServer};
    use rookworld_proto::queue::v1 as qpb;
    use std::sync::{Arc, Mutex};

    let mut initial = Queue::new(QueueConfig::default());
    initial.set_run("run");
    let queue = QueueHandle::start(initial);
    let spec = GroupSpec {
        num_completions: 2,
        sampling: rookworld_proto::v1::SamplingParams {
            temperature: 1.0,
            max_new_tokens: 8,
            ..Default::default()
        },
        check: GroupCheck::for_model(&Config::tiny()),
    };
    let version = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let server = QueueServer::new(queue.clone(), spec, Some(TOKEN.into()), version);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(queue_service::run(server, listener, std::future::pending()));
    let mut client = qpb::rollout_queue_client::RolloutQueueClient::connect(url)
        .await
        .unwrap();
    let mut workers = Vec::new();
    for i in 0..3 {
        let address = worker_at("127.0.0.1").await;
        let mut lease = tonic::Request::new(qpb::LeaseRequest {
            worker_id: format!("w{i}"),
            max_prompts: 1,
            weight_version: 0,
            push_address: address.clone(),
            weight_run_id: String::new(),
        });
        rookworld_service::auth::set_token(lease.metadata_mut(), TOKEN).unwrap();
        client.lease(lease).await.unwrap();
        workers.push(address);
    }
    workers.sort();

    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = Arc::new(WeightSet::from_model(&model, "run", 1).unwrap());
    let (_latest, latest_rx) = tokio::sync::watch::channel(Some(v1));
    let fleet = Arc::new(Mutex::new(
        Fleet::new(Duration::from_secs(1)).with_fanout(1),
    ));
    let cfg = learner::push::SyncConfig {
        deadline: Duration::from_secs(10),
        forget_after: Duration::from_secs(600),
        tick: Duration::from_millis(50),
        tls: Default::default(),
        model: Default::default(),
    };
    let sync = learner::push::run(
        queue,
        fleet,
        latest_rx,
        TOKEN.into(),
        cfg,
        std::future::pending(),
    );
    tokio::spawn(sync);

    let want: Vec<String> = ["learner", &workers[0], &workers[1]]
        .map(String::from)
        .into();
    let started = Instant::now();
    loop {
        let listed = client
            .list_workers(qpb::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner();
        let parent = |w: &str| {
            let info = listed.workers.iter().find(|i| i.push_address == w);
            info.map(|i| i.weight_parent.clone()).unwrap_or_default()
        };
        let parents: Vec<String> = workers.iter().map(|w| parent(w)).collect();
        if parents == want {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "parents {parents:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in &workers {
        assert_eq!(version_of(w).await, 1, "{w}");
    }
}

/// A relay that hangs (it takes the connection and no chunks) is given up on after the
/// stall limit, not the push's minute-long deadline, and the workers below it are served
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_relay_is_given_up_on_after_the_stall_limit() {
    let mut fleet = Fleet::new(Duration::from_secs(8)).with_fanout(1);
    // Sorted first, so the root: bound and never served.
    let hung_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung = format!("http://{}", hung_listener.local_addr().unwrap());
    fleet.register(&hung);
    let live = [worker_at("127.0.0.2").await, worker_at("127.0.0.2").await];
    for w in &live {
        fleet.register(w);
    }
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();

    let started = Instant::now();
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(60)).await;
    let took = started.elapsed();
    assert!(
        took < relay::STALL + Duration::from_secs(2),
        "given up after {took:?}"
    );
    let why = outcomes[0].error.clone().unwrap();
    let stalled = format!("took no chunk for {:?}", relay::STALL);
    assert!(why.contains(&stalled), "{why}");
    assert!(outcomes[0].relayed.iter().all(|o| o.unreached));

    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(60)).await;
    assert!(
        every(&outcomes).iter().all(|o| o.error.is_none()),
        "{outcomes:?}"
    );
    for w in &live {
        assert_eq!(version_of(w).await, 1, "{w}");
    }
    drop(hung_listener);
}

/// A worker that joins is sent the current version by a peer that holds it, not by the
/// learner: the learner's link carries none of it. A peer that no longer holds it says so,
/// and the next round serves the joiner through another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_worker_is_sent_the_version_by_a_peer() {
    let mut fleet = Fleet::new(Duration::from_secs(1)).with_fanout(2);
    for _ in 0..2 {
        fleet.register(&worker_at("127.0.0.1").await);
    }
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();
    let full = v1.bytes.len() as u64;
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert!(every(&outcomes).iter().all(|o| o.error.is_none()));
    fleet.take_pushed();

    let joiner = worker_at("127.0.0.1").await;
    let peers = fleet.addresses();
    fleet.register(&joiner);
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    let send = &outcomes[0];
    assert_eq!(
        (send.path, send.error.as_deref()),
        ("peer", None),
        "{send:?}"
    );
    assert_eq!(send.worker, peers[0]);
    let o = &send.relayed[0];
    assert_eq!(
        (
            o.worker.as_str(),
            o.parent.as_deref(),
            o.error.as_deref(),
            o.bytes
        ),
        (joiner.as_str(), Some(peers[0].as_str()), None, full)
    );
    let pushed = fleet.take_pushed();
    assert_eq!(
        (pushed.pushes, pushed.full, pushed.relayed),
        (1, 0, full),
        "the learner sent nothing"
    );
    assert_eq!(version_of(&joiner).await, 1);
    assert_eq!(fleet.state(&peers[0], 1), Some(SyncState::Current));

    // The peer the learner would ask is given another version behind its back: it holds
    // no payload of version 1, says so, and the next round serves the joiner otherwise.
    let holders = fleet.addresses();
    let aside = moved(&v1, "run", 3, 7, 2);
    let o = learner::push::push_to(
        holders[0].clone(),
        aside,
        TOKEN.into(),
        Duration::from_secs(10),
        false,
    )
    .await;
    assert_eq!(o.error, None);
    let late = worker_at("127.0.0.1").await;
    fleet.register(&late);
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    assert_eq!(outcomes[0].worker, holders[0]);
    let why = outcomes[0].error.clone().unwrap();
    assert!(
        why.contains("no payload to send") && why.contains("runs version 3"),
        "{why}"
    );
    assert!(outcomes[0].relayed[0].unreached);
    let outcomes = fleet.push(&v1, TOKEN, Duration::from_secs(10)).await;
    let o = &outcomes[0].relayed[0];
    assert_eq!(
        (o.worker.as_str(), o.error.as_deref()),
        (late.as_str(), None)
    );
    assert_ne!(o.parent.as_deref(), Some(holders[0].as_str()));
    assert_eq!(version_of(&late).await, 1);
}
