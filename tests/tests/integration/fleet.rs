//! Weight pushes between real processes over shaped links: `learner bench-fleet` (worker
//! processes, each in a network namespace behind a `tc`-shaped link) and the faults a
//! push must survive there. Namespaces need root and iproute2: without them each test
//! says SKIPPED, unless `ROOKWORLD_REQUIRE_NETNS` is set (CI sets it where it runs as
//! root). Each test holds [`SERIAL`], as the clusters do.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::cluster::{LEARNER, SERIAL, WORKER};
use candle_core::{DType, Device};
use learner::bench_fleet::Worker;
use learner::bench_fleet::lab::{Lab, Shape};
use learner::push::{DeltaPolicy, Fleet};
use rookworld_lm::Config;
use rookworld_lm::model_io::init_random;
use rookworld_proto::rollout::v1::StatusRequest;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_weights::relay;
use rookworld_weights::set::WeightSet;

/// Whether this machine can make namespaces; a reason to skip, or a failure where they
/// are required.
fn netns_usable(test: &str) -> bool {
    match Lab::check() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var_os("ROOKWORLD_REQUIRE_NETNS").is_none(),
                "network namespaces are required (ROOKWORLD_REQUIRE_NETNS is set): {e}"
            );
            eprintln!("SKIPPED: {test}: {e}");
            false
        }
    }
}

/// The lock held by a test that makes namespaces — one cluster or lab at a time: the
/// machine has few cores, and the timings count — or `None` (skip) where namespaces
/// cannot be made.
fn lab_lock(test: &str) -> Option<tokio::sync::MutexGuard<'static, ()>> {
    netns_usable(test).then(|| SERIAL.blocking_lock())
}

fn bench_fleet(args: &[&str]) -> serde_json::Value {
    let out = Command::new(LEARNER)
        .arg("bench-fleet")
        .args(["--preset", "tiny", "--worker-bin"])
        .arg(WORKER)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-fleet failed:\n{stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)))
}

fn run<'a>(report: &'a serde_json::Value, fanout: u64, kind: &str) -> &'a serde_json::Value {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["fanout"] == fanout && r["kind"] == kind)
        .unwrap_or_else(|| panic!("no run of fan-out {fanout}, {kind}: {report}"))
}

/// Four workers behind 200 Mbit/s links: the star sends the learner's link a copy per
/// worker, relays at a fan-out of 2 two copies, each worker's push comes from the tree's
/// parent, and a delta is smaller than the payload — every worker runs every version.
#[test]
fn relays_take_the_copies_off_the_learners_link() {
    let Some(_serial) = lab_lock("relays_take_the_copies_off_the_learners_link") else {
        return;
    };
    let report = bench_fleet(&[
        "--workers",
        "4",
        "--rate",
        "200mbit",
        "--fanouts",
        "0,2",
        "--pushes",
        "1",
    ]);
    let (payload, delta) = (
        report["payload_bytes"].as_f64().unwrap(),
        report["delta_bytes"].as_f64().unwrap(),
    );
    assert!(delta < payload / 2.0, "{report}");
    for fanout in [0, 2] {
        for (kind, bytes) in [("full", payload), ("delta", delta)] {
            let r = run(&report, fanout, kind);
            assert_eq!(r["bytes"].as_f64().unwrap(), bytes, "{r}");
            let hops = r["hops"].as_array().unwrap();
            assert_eq!(hops.len(), 4, "{r}");
            let relayed = hops.iter().filter(|h| !h["parent"].is_null()).count();
            assert_eq!(relayed, if fanout == 0 { 0 } else { 2 }, "{r}");
            let sends = r["learner_sends"].as_f64().unwrap();
            let copies = if fanout == 0 { 4.0 } else { 2.0 };
            // Frames and gRPC add a few percent; a delta of a tiny model is small enough
            // for the connection's own bytes to count.
            let slack = if kind == "full" { 1.15 } else { 2.0 };
            assert!(
                sends >= copies * 0.98 && sends <= copies * slack,
                "fan-out {fanout}, {kind}: {sends} copies left the learner's link: {r}"
            );
            // The workers' clocks (this host's): the last chunk arrives, then the version
            // goes into use, before the learner hears the last answer.
            let at = |k: &str| r[k].as_f64().unwrap();
            assert!(
                0.0 < at("last_received_seconds")
                    && at("last_received_seconds") <= at("last_in_use_seconds")
                    && at("last_in_use_seconds") <= at("seconds"),
                "{r}"
            );
        }
    }
}

/// Links that drop 5% of their packets in each direction: the pushes are slower, and
/// every worker still runs every version, relayed and as deltas.
#[test]
fn links_that_drop_five_percent_still_bring_every_worker_each_version() {
    let Some(_serial) =
        lab_lock("links_that_drop_five_percent_still_bring_every_worker_each_version")
    else {
        return;
    };
    let report = bench_fleet(&[
        "--workers",
        "3",
        "--rate",
        "200mbit",
        "--loss",
        "0.05",
        "--fanouts",
        "1",
        "--pushes",
        "1",
    ]);
    assert_eq!(report["link"]["loss"], 0.05, "{report}");
    for kind in ["full", "delta"] {
        let r = run(&report, 1, kind);
        assert_eq!(r["hops"].as_array().unwrap().len(), 3, "{r}");
    }
}

/// A relay process killed (SIGKILL) while it forwards a push: the push names it, the
/// workers below it are not reached (no failure of their own), and the next round brings
/// them the version straight away — within 2 s of the kill, over 100 Mbit/s links.
#[test]
fn a_relay_killed_mid_push_is_bypassed_within_two_seconds() {
    let Some(_serial) = lab_lock("a_relay_killed_mid_push_is_bypassed_within_two_seconds") else {
        return;
    };
    let shape = Shape {
        rate_bits: 100_000_000,
        delay_ms: 0.0,
        loss: 0.0,
    };
    let mut lab = Lab::new().unwrap();
    let learner_at = lab.endpoint("l", &shape).unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut workers = Vec::new();
    for i in 0..3 {
        let at = lab.endpoint(&format!("w{i}"), &shape).unwrap();
        let log = logs.path().join(format!("w{i}.log"));
        let worker = Worker::spawn(&lab, at, Path::new(WORKER), ("tiny", &[]), TOKEN, log);
        workers.push(worker.unwrap());
    }
    let lab = lab;
    std::thread::scope(|s| {
        s.spawn(|| {
            Lab::enter(&learner_at).unwrap();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(kill_a_relay(&lab, &workers));
        })
        .join()
        .unwrap_or_else(|_| panic!("worker logs in {}", logs.path().display()));
    });
}

const TOKEN: &str = "fleet-faults";

async fn kill_a_relay(lab: &Lab, workers: &[Worker]) {
    for w in workers {
        w.ready(lab).await.unwrap();
    }
    // The payload each time, so that the push lasts long enough to be cut.
    let mut fleet = Fleet::new(Duration::from_secs(1))
        .with_fanout(1)
        .with_deltas(DeltaPolicy::Never);
    for w in workers {
        fleet.register(&w.url());
    }
    let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
    let v1 = WeightSet::from_model(&model, "run", 1).unwrap();
    let deadline = Duration::from_secs(20);
    for o in fleet.push(&v1, TOKEN, deadline).await {
        assert!(o.error.is_none(), "{o:?}");
    }
    // The chain's root, as the tree cuts the sorted list.
    let urls: Vec<String> = workers.iter().map(Worker::url).collect();
    let (root, _) = relay::parents(&urls, 1)
        .into_iter()
        .find(|(_, parent)| parent.is_none())
        .unwrap();
    let root_pid = workers.iter().find(|w| w.url() == root).unwrap().pid;

    let v2 = WeightSet {
        version: 2,
        ..v1.clone()
    };
    let (outcomes, killed) = tokio::join!(fleet.push(&v2, TOKEN, deadline), async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        lab.kill(root_pid);
        Instant::now()
    });
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    let o = &outcomes[0];
    assert_eq!(o.worker, root);
    assert!(
        o.error.is_some(),
        "the root finished its push before it was killed (the link is too fast): {o:?}"
    );
    assert_eq!(o.relayed.len(), 2, "{o:?}");
    assert!(o.relayed.iter().all(|r| r.unreached), "{o:?}");

    // The next round, as the sync loop runs it at once: the children from a new tree.
    let outcomes = fleet.push(&v2, TOKEN, deadline).await;
    let served = killed.elapsed();
    for url in urls.iter().filter(|u| **u != root) {
        assert_eq!(version_of(url).await, 2, "{url}: {outcomes:?}");
    }
    assert!(
        served < Duration::from_secs(2),
        "the workers below the killed relay ran the version {served:?} after the kill: {outcomes:?}"
    );
}

async fn version_reported(url: &str) -> Option<u64> {
    let mut client = RolloutServiceClient::connect(url.to_owned()).await.ok()?;
    let status = client.status(StatusRequest {}).await.ok()?;
    Some(status.into_inner().weight_version)
}

async fn version_of(url: &str) -> u64 {
    version_reported(url)
        .await
        .unwrap_or_else(|| panic!("{url} does not answer"))
}
