//! Faults survived with nothing lost. Each test runs a small training cluster of real
//! processes on loopback (reward server, two rollout workers, learner; the launchers in
//! `tests/src/bin` run the services' own command line), breaks it one way while it trains,
//! checks that training goes on and the fault was seen and handled, then stops the learner
//! with SIGTERM and checks the books (`ledger`): every prompt consumed exactly once,
//! dropped and counted, or kept in the final checkpoint; every consumed group fully scored.
//!
//! - `cluster`: the processes, their addresses and probes; `proxy`: the network between
//!   them (partitions, cut transfers); `ledger`: the books.

mod ledger;
mod proxy;

use crate::cluster;

use std::time::Duration;

use cluster::{
    Cluster, LEASE_SECONDS, Proc, SERIAL, WorkerAddrs, metric, worker_version, worker_weights,
};
use proxy::{Mode, Proxy};

const START: Duration = Duration::from_secs(180);
const PROGRESS: Duration = Duration::from_secs(180);

/// Steps in the step log, at least `n` more than `from`.
async fn trains_on(c: &Cluster, from: u64, n: u64, what: &str) {
    c.wait_until(PROGRESS, &format!("{n} more steps {what}"), || async {
        c.steps() >= from + n
    })
    .await;
}

/// Stops the learner with SIGTERM (it must exit 0, after its final checkpoint) and checks
/// the books.
fn stop_and_check(c: &Cluster, learner: &mut Proc) -> ledger::Ledger {
    assert!(
        learner.terminate(Duration::from_secs(60)),
        "the learner did not exit 0 on SIGTERM\n{}",
        c.log_tails()
    );
    ledger::check(c)
}

/// The worker `id` as the learner lists it.
async fn worker_info(c: &Cluster, id: &str) -> Option<rookworld_proto::queue::v1::WorkerInfo> {
    c.workers().await.into_iter().find(|w| w.worker_id == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_leases_expire_and_are_reissued() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut learner = c.learner(false);
    let (a, b) = (c.direct(), c.direct());
    let _worker_a = c.worker("worker-a", &a);
    trains_on(&c, 0, 2, "at start").await;

    // Kill a worker (kill -9) while it holds leases, in the middle of generating; a lease
    // lives a fraction of a second, so until a kill catches one, another worker is started
    // and killed.
    let (victim, held, expired_before) = 'caught: {
        for attempt in 0..20 {
            let id = format!("worker-b{attempt}");
            let mut worker = c.worker(&id, &b);
            c.wait_until(START, &format!("{id} holding a lease"), || async {
                worker_info(&c, &id)
                    .await
                    .is_some_and(|w| w.outstanding > 0)
            })
            .await;
            let expired_before = c.depths().await.unwrap().leases_expired;
            worker.kill9();
            // Dead: what it holds now stays until its leases expire.
            let held = worker_info(&c, &id).await.unwrap().outstanding;
            if held > 0 {
                break 'caught (id, held, expired_before);
            }
        }
        panic!("no kill caught a worker holding a lease");
    };
    let at = c.steps();

    c.wait_until(
        Duration::from_secs_f64(LEASE_SECONDS + 30.0),
        &format!("{victim}'s {held} leases to expire and be re-issued"),
        || async {
            worker_info(&c, &victim)
                .await
                .is_some_and(|w| w.outstanding == 0 && w.expired >= u64::from(held))
                && c.depths()
                    .await
                    .is_some_and(|d| d.leases_expired >= expired_before + u64::from(held))
        },
    )
    .await;
    trains_on(&c, at, 3, "with worker-a alone").await;

    let books = stop_and_check(&c, &mut learner);
    assert!(books.consumed >= 2 * 5, "{books:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_reward_server_is_waited_for_and_nothing_goes_unscored() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let mut reward = c.reward_server();
    let mut learner = c.learner(false);
    let (a, b) = (c.direct(), c.direct());
    let _worker_a = c.worker("worker-a", &a);
    let _worker_b = c.worker("worker-b", &b);
    trains_on(&c, 0, 2, "at start").await;

    reward.kill9();
    let reachable = |addrs: &WorkerAddrs| {
        metric(
            addrs.metrics,
            "rollout_peer_reachable",
            &["peer=\"reward\""],
        )
    };
    c.wait_until(
        Duration::from_secs(60),
        "a worker to see the reward server gone",
        || async { reachable(&a) == Some(0.0) || reachable(&b) == Some(0.0) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let at = c.steps();
    let _reward = c.reward_server(); // the same port
    c.wait_until(
        Duration::from_secs(60),
        "both workers to reach it again",
        || async { reachable(&a) == Some(1.0) && reachable(&b) == Some(1.0) },
    )
    .await;
    let retries = metric(a.metrics, "rollout_call_retries_total", &["call=\"score\""])
        .unwrap_or(0.0)
        + metric(b.metrics, "rollout_call_retries_total", &["call=\"score\""]).unwrap_or(0.0);
    assert!(retries >= 1.0, "the score calls were retried");
    trains_on(&c, at, 3, "after the restart").await;

    // Every consumed group has its G completions scored by the reward server, once.
    stop_and_check(&c, &mut learner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_learner_resumes_and_the_workers_get_its_weights() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut learner = c.learner(false);
    let (a, b) = (c.direct(), c.direct());
    let _worker_a = c.worker("worker-a", &a);
    let _worker_b = c.worker("worker-b", &b);
    trains_on(&c, 0, 5, "at start").await;

    learner.kill9();
    let (mut learner, step) = resume_on(&c, [&a, &b]).await;

    let books = stop_and_check(&c, &mut learner);
    assert!(books.steps >= step + 3, "{books:?}");
}

/// Restarts a killed learner with `--resume` and waits until it says it resumed, every
/// worker of `workers` runs its weights, and it has trained 3 more steps: the learner and
/// the step of its last checkpoint.
async fn resume_on(c: &Cluster, workers: [&WorkerAddrs; 2]) -> (Proc, u64) {
    let (learner, step, resumed) = resume(c).await;
    c.wait_until(
        Duration::from_secs(60),
        "both workers on the resumed weights",
        || async {
            for w in workers {
                if worker_version(w.listen).await < Some(resumed) {
                    return false;
                }
            }
            true
        },
    )
    .await;
    trains_on(c, step, 3, "after the resume").await;
    (learner, step)
}

/// Restarts a killed learner with `--resume` and waits for its `resumed` line: the
/// learner, the step of its last checkpoint and the version the resumed weights take —
/// past any version it published after that checkpoint, which workers may hold.
async fn resume(c: &Cluster) -> (Proc, u64, u64) {
    let published: u64 = std::fs::read_to_string(c.path("run/published_version"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let latest = std::fs::read_to_string(c.path("run/checkpoints/latest")).unwrap();
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            c.path("run/checkpoints")
                .join(latest.trim())
                .join("trainer_state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let (step, saved) = (
        state["step"].as_u64().unwrap(),
        state["version"].as_u64().unwrap(),
    );
    assert!(
        published >= saved,
        "published {published}, checkpoint {saved}"
    );
    let resumed = if published > saved {
        published + 1
    } else {
        saved
    };
    let learner = c.learner(true);
    c.wait_until(
        Duration::from_secs(60),
        "the learner's 'resumed' line",
        || async {
            learner.log().lines().any(|l| {
                l.contains("resumed")
                    && l.contains(&format!("step={step} "))
                    && l.contains(&format!("version={resumed} "))
            })
        },
    )
    .await;
    (learner, step, resumed)
}

/// A training cluster whose worker-a takes its pushes through a proxy (`to_a`) and
/// worker-b directly (fields drop in order: the processes before their directory; a test
/// that takes it apart binds every field, the cluster first).
struct PushedThroughAProxy {
    learner: Proc,
    worker_a: Proc,
    _worker_b: Proc,
    _reward: Proc,
    a: WorkerAddrs,
    b: WorkerAddrs,
    to_a: Proxy,
    c: Cluster,
}

impl PushedThroughAProxy {
    async fn start() -> Self {
        let c = Cluster::new();
        let _reward = c.reward_server();
        let learner = c.learner(false);
        let mut a = c.direct();
        let to_a = Proxy::start(a.listen).await;
        a.advertise = to_a.url();
        let b = c.direct();
        let worker_a = c.worker("worker-a", &a);
        let _worker_b = c.worker("worker-b", &b);
        Self {
            learner,
            worker_a,
            _worker_b,
            _reward,
            a,
            b,
            to_a,
            c,
        }
    }
}

/// Holds the pushes through `to_a` after their first 256 KiB, and waits until one is
/// under way.
async fn hold_a_push(c: &Cluster, to_a: &Proxy) {
    to_a.set(Mode::HoldAfter(256 << 10));
    c.wait_until(PROGRESS, "a push to worker-a under way", || async {
        to_a.holds() >= 1
    })
    .await;
}

/// The learner killed (kill -9) while a push to worker-a is under way — its first
/// 256 KiB through, the rest stuck on the link: worker-a keeps the weights it ran and
/// names the broken push in one log line, and the resumed learner brings both workers
/// its weights; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_killed_mid_push_resumes_and_the_half_pushed_worker_gets_its_weights() {
    let _serial = SERIAL.lock().await;
    // Every field bound (none dropped here), the cluster first so that it is dropped
    // last.
    let PushedThroughAProxy {
        c,
        to_a,
        a,
        b,
        _reward,
        _worker_b,
        worker_a,
        mut learner,
    } = PushedThroughAProxy::start().await;
    // Past the first checkpoint (every 2 steps), with worker-a on trained weights.
    trains_on(&c, 0, 3, "at start").await;
    c.wait_until(PROGRESS, "worker-a on trained weights", || async {
        worker_version(a.listen).await >= Some(2)
    })
    .await;
    hold_a_push(&c, &to_a).await;
    let before = worker_version(a.listen).await;
    learner.kill9();
    c.wait_until(
        Duration::from_secs(30),
        "worker-a to name the broken push",
        || async {
            worker_a.log().lines().any(|l| {
                l.contains("weight update refused; the old weights stay")
                    && l.contains("weight update interrupted")
            })
        },
    )
    .await;
    assert_eq!(worker_version(a.listen).await, before, "worker-a's weights");

    to_a.set(Mode::Pass);
    let (mut learner, _) = resume_on(&c, [&a, &b]).await;
    stop_and_check(&c, &mut learner);
}

/// A worker that joins while a push to another is stuck halfway is served the learner's
/// weights at once, not after the stuck push; that push ends at its deadline, named in
/// the learner's log, and the stuck worker catches up once its link heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_joins_during_a_stuck_push_is_served_at_once() {
    let _serial = SERIAL.lock().await;
    let PushedThroughAProxy {
        c,
        to_a,
        a,
        b: _b,
        _reward,
        _worker_b,
        worker_a: _worker_a,
        mut learner,
    } = PushedThroughAProxy::start().await;
    trains_on(&c, 0, 2, "at start").await;
    hold_a_push(&c, &to_a).await;
    let at_join = c.depths().await.unwrap().learner_version;
    let joiner = c.direct();
    let _worker_c = c.worker("worker-c", &joiner);
    c.wait_until(
        Duration::from_secs(60),
        "worker-c on the learner's weights",
        || async { worker_version(joiner.listen).await >= Some(at_join) },
    )
    .await;
    c.wait_until(
        Duration::from_secs(30),
        "the stuck push to worker-a given up at its deadline",
        || async {
            learner
                .log()
                .lines()
                .any(|l| l.contains("weight push failed") && l.contains(&to_a.addr.to_string()))
        },
    )
    .await;

    to_a.set(Mode::Pass);
    let now = c.depths().await.unwrap().learner_version;
    c.wait_until(
        Duration::from_secs(60),
        "worker-a caught up once its link healed",
        || async { worker_version(a.listen).await >= Some(now) },
    )
    .await;
    let at = c.steps();
    trains_on(&c, at, 2, "with three workers").await;
    stop_and_check(&c, &mut learner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_catches_up_after_the_heal() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut learner = c.learner(false);
    // Worker a reaches the learner, and the learner reaches it, only through proxies.
    let mut a = c.direct();
    let to_learner = Proxy::start(c.learner_addr).await;
    let to_a = Proxy::start(a.listen).await;
    a.learner_url = to_learner.url();
    a.advertise = to_a.url();
    let b = c.direct();
    let _worker_a = c.worker("worker-a", &a);
    let _worker_b = c.worker("worker-b", &b);
    // Cut it off while it holds a lease (after it has submitted at least once): a lease
    // lives a fraction of a second, so until a cut catches one, heal and cut again. What
    // it holds once cut off stays until the leases expire.
    let mut held = 0;
    for _ in 0..20 {
        c.wait_until(START, "worker-a to submit and hold a lease", || async {
            worker_info(&c, "worker-a")
                .await
                .is_some_and(|w| w.submitted > 0 && w.outstanding > 0)
        })
        .await;
        to_learner.set(Mode::Partition);
        to_a.set(Mode::Partition);
        tokio::time::sleep(Duration::from_millis(300)).await;
        held = worker_info(&c, "worker-a").await.unwrap().outstanding;
        if held > 0 {
            break;
        }
        to_learner.set(Mode::Pass);
        to_a.set(Mode::Pass);
    }
    assert!(held > 0, "no cut caught worker-a holding a lease");
    let at = c.steps();
    trains_on(&c, at, 3, "with worker-a cut off").await;
    c.wait_until(
        Duration::from_secs(60),
        "worker-a's leases to expire",
        || async {
            worker_info(&c, "worker-a")
                .await
                .is_some_and(|w| w.expired >= u64::from(held) && w.outstanding == 0)
        },
    )
    .await;
    let submitted = worker_info(&c, "worker-a").await.unwrap().submitted;
    c.wait_until(
        Duration::from_secs(30),
        "worker-a to see the learner gone",
        || async {
            metric(a.metrics, "rollout_peer_reachable", &["peer=\"learner\""]) == Some(0.0)
        },
    )
    .await;

    to_learner.set(Mode::Pass);
    to_a.set(Mode::Pass);
    let version = c.depths().await.unwrap().learner_version;
    c.wait_until(
        Duration::from_secs(90),
        "worker-a on the learner's weights again",
        || async { worker_version(a.listen).await >= Some(version) },
    )
    .await;
    c.wait_until(
        Duration::from_secs(90),
        "worker-a to submit again",
        || async {
            worker_info(&c, "worker-a")
                .await
                .is_some_and(|w| w.submitted > submitted)
        },
    )
    .await;
    assert_eq!(
        metric(a.metrics, "rollout_peer_reachable", &["peer=\"learner\""]),
        Some(1.0)
    );

    stop_and_check(&c, &mut learner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_weight_push_keeps_the_old_weights_and_the_next_one_lands() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut learner = c.learner(false);
    // Pushes to worker a break off after 1 MiB of the ~6.5 MB weight set.
    let mut a = c.direct();
    let to_a = Proxy::start(a.listen).await;
    to_a.set(Mode::CutAfter(1 << 20));
    a.advertise = to_a.url();
    let b = c.direct();
    let _worker_a = c.worker("worker-a", &a);
    let _worker_b = c.worker("worker-b", &b);

    c.wait_until(START, "two interrupted pushes to worker-a", || async {
        to_a.cuts() >= 2
            && metric(
                a.metrics,
                "rollout_weight_updates_total",
                &["result=\"interrupted\""],
            )
            .is_some_and(|n| n >= 2.0)
    })
    .await;
    // It kept its old weights (version 0, its own), went on generating, and the learner
    // says so.
    assert_eq!(worker_version(a.listen).await, Some(0));
    // (The learner counts pushes by result and path, not by worker: worker-b's all
    // succeed, so the failures are worker-a's.) The learner counts a push once its call
    // ends, which can come after the worker has counted the interruption: waited for.
    c.wait_until(
        Duration::from_secs(30),
        "the learner counting two failed pushes",
        || async {
            metric(
                c.learner_metrics,
                "learner_weight_pushes_total",
                &["result=\"failed\""],
            )
            .is_some_and(|n| n >= 2.0)
        },
    )
    .await;
    c.wait_until(
        Duration::from_secs(30),
        "worker-a generating on its old weights",
        || async {
            metric(a.metrics, "rollout_tokens_generated_total", &[]).is_some_and(|n| n > 0.0)
        },
    )
    .await;

    to_a.set(Mode::Pass);
    c.wait_until(Duration::from_secs(60), "the next push to land", || async {
        let version = c.depths().await.map_or(u64::MAX, |d| d.learner_version);
        worker_version(a.listen)
            .await
            .is_some_and(|v| v >= 1 && v + 1 >= version)
    })
    .await;
    // The worker reports the new version from the swap on; it counts the update when the
    // call returns, a moment later.
    c.wait_until(
        Duration::from_secs(10),
        "the landed push counted",
        || async {
            metric(
                a.metrics,
                "rollout_weight_updates_total",
                &["result=\"ok\""],
            )
            .is_some_and(|n| n >= 1.0)
        },
    )
    .await;
    assert!(
        metric(
            a.metrics,
            "rollout_weight_updates_total",
            &["result=\"ok\""]
        ) >= Some(1.0)
    );
    let at = c.steps();
    trains_on(&c, at, 2, "after the push landed").await;

    stop_and_check(&c, &mut learner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_run_takes_over_workers_left_from_an_earlier_run() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut first = c.learner(false);
    let a = c.direct();
    let _worker = c.worker("worker-a", &a);
    trains_on(&c, 0, 3, "in the first run").await;
    assert!(
        first.terminate(Duration::from_secs(60)),
        "{}",
        c.log_tails()
    );
    let run_id = || std::fs::read_to_string(c.path("run/run_id")).unwrap();
    let (first_run, held) = worker_weights(a.listen).await.unwrap();
    assert_eq!(first_run, run_id());
    assert!(
        held >= 2,
        "the worker holds version {held} of the first run"
    );

    // A new run (--overwrite: a new run id, versions from 1 again) with the worker that is
    // still up: the worker takes its first push, logs the switch, and the run trains.
    let mut second = c.learner_with(&["--overwrite"]);
    c.wait_until(
        Duration::from_secs(60),
        "the worker on the new run's weights",
        || async {
            let now = worker_weights(a.listen).await;
            now.is_some_and(|(run, _)| run != first_run && run == run_id())
        },
    )
    .await;
    trains_on(&c, 0, 3, "in the new run, on the worker of the old one").await;
    let books = stop_and_check(&c, &mut second);
    assert!(books.steps >= 3, "{books:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_the_learner_cannot_reach_is_told_why_and_its_default_address_works() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let mut learner = c.learner(false);
    // Advertised where nothing listens (as `http://worker:PORT` outside Docker was).
    let nowhere = format!("http://{}", cluster::free_addr());
    let bad = WorkerAddrs {
        advertise: nowhere.clone(),
        ..c.direct()
    };
    let mut worker = c.worker("worker-a", &bad);
    c.wait_until(
        Duration::from_secs(60),
        "the learner's ERROR and the worker's refused lease",
        || async {
            let told = |log: String| {
                log.lines().any(|l| {
                    l.contains("cannot reach") && l.contains(&nowhere) && l.contains("--advertise")
                })
            };
            told(learner.log()) && told(worker.log()) && worker.log().contains("FailedPrecondition")
        },
    )
    .await;
    let errors = learner
        .log()
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("cannot reach"))
        .count();
    assert_eq!(errors, 1, "one ERROR for the address\n{}", learner.log());
    worker.kill9();

    // Restarted without --advertise: the default follows its listen address (loopback).
    let mut fixed = WorkerAddrs {
        advertise: String::new(),
        ..bad
    };
    fixed.metrics = cluster::free_addr();
    let _worker = c.worker("worker-a", &fixed);
    trains_on(&c, 0, 3, "once the worker advertises its listen address").await;
    let books = stop_and_check(&c, &mut learner);
    assert!(books.steps >= 3, "{books:?}");
}
