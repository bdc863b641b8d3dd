//! Wiring mistakes and stops, as a user meets them: real processes on loopback (the
//! launchers in `tests/src/bin` run the services' own command line). Each mistake must end
//! in a line that names its cause, and a stop must not wait on a peer.

use crate::cluster;

use std::time::{Duration, Instant};

use cluster::{Cluster, SERIAL};

const START: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_reward_server_is_gone_stops_within_10_s_of_sigterm() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let mut reward = c.reward_server();
    let _learner = c.learner(false);
    // The learner checked the reward server at start; now it is gone for good.
    c.wait_until(START, "the learner's queue", || async {
        c.depths().await.is_some()
    })
    .await;
    reward.kill9();
    let addrs = c.direct();
    let mut worker = c.worker("worker-a", &addrs);
    c.wait_until(START, "worker-a holding leases", || async {
        c.workers()
            .await
            .iter()
            .any(|w| w.worker_id == "worker-a" && w.outstanding > 0)
    })
    .await;
    // Its groups are generated and now retry scoring against a closed port.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let exited = worker.terminate(Duration::from_secs(10));
    let took = started.elapsed();
    let log = worker.log();
    assert!(
        exited,
        "the worker did not exit 0 within 10 s of SIGTERM ({took:?})\n{}",
        c.log_tails()
    );
    assert!(
        log.contains("abandoned"),
        "the worker's stop did not say how many groups it abandoned\n{log}"
    );
}

/// Waits until `proc`'s log has a line with every one of `words`; returns that line.
async fn line_naming(
    c: &Cluster,
    proc: &cluster::Proc,
    within: Duration,
    words: &[&str],
) -> String {
    let mut found = String::new();
    c.wait_until(within, &format!("a line naming {words:?}"), || {
        found = proc
            .log()
            .lines()
            .find(|l| words.iter().all(|w| l.contains(w)))
            .unwrap_or_default()
            .to_owned();
        let ok = !found.is_empty();
        async move { ok }
    })
    .await;
    found
}

/// Within a minute of the mistake.
const NAMED: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reward_server_without_a_token_is_named_by_the_learner() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server_with(None);
    // With --reward, the learner's start-up check says it and exits 1.
    let mut checked = c.learner_with(&["--reward-wait", "20"]);
    let line = line_naming(&c, &checked, NAMED, &["error:", &c.reward_url()]).await;
    assert!(
        line.contains("refuses the token") && line.contains("no token is configured"),
        "{line}"
    );
    assert!(!checked.terminate(Duration::from_secs(10)), "exit 1, not 0");
    // Without it, the worker tells the learner, and the learner names it while it waits.
    let learner = c.learner_args(&["--overwrite"], false);
    let _worker = c.worker("worker-a", &c.direct());
    let line = line_naming(&c, &learner, NAMED, &["cannot score", &c.reward_url()]).await;
    assert!(line.contains("1 of 1 workers"), "{line}");
    assert!(line.contains("no token is configured"), "{line}");
    // ListWorkers shows it too.
    let w = c.workers().await;
    assert!(w[0].last_error.contains("refuses"), "{:?}", w[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_reward_port_is_named_by_the_learner_and_the_worker() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    // Nothing listens at the reward address.
    let learner = c.learner_args(&[], false);
    let worker = c.worker("worker-a", &c.direct());
    let line = line_naming(&c, &learner, NAMED, &["cannot score", &c.reward_url()]).await;
    assert!(line.contains("unreachable"), "{line}");
    let line = line_naming(&c, &worker, NAMED, &["unreachable", &c.reward_url()]).await;
    assert!(line.contains("WARN"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_pointed_at_the_learner_s_metrics_port_is_told_so() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let learner = c.learner_args(&[], false);
    learner_ready(&c, &learner).await;
    // `--learner` at the learner's metrics port (HTTP/1.1), not its queue.
    let metrics = format!("http://{}", c.learner_metrics);
    let addrs = cluster::WorkerAddrs {
        learner_url: metrics.clone(),
        ..c.direct()
    };
    let worker = c.worker("worker-a", &addrs);
    let line = line_naming(
        &c,
        &worker,
        AT_ONCE,
        &["answers HTTP/1.1, not gRPC", &metrics],
    )
    .await;
    assert!(
        line.contains("ERROR") && line.contains("point --learner at the learner queue's gRPC port"),
        "{line}"
    );
    assert!(
        !worker.log().contains("broken pipe") && !worker.log().contains("serves TLS"),
        "{}",
        worker.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_another_token_is_named_with_its_address() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let mut reward = c.reward_server();
    let mut learner = c.learner(false);
    let other = c.path("other-token");
    std::fs::write(&other, "not-the-learner-s\n").unwrap();
    let worker = c.worker_with("worker-a", &c.direct(), &other);
    let line = line_naming(
        &c,
        &learner,
        NAMED,
        &["Lease calls from 127.0.0.1:", "wrong token"],
    )
    .await;
    assert!(line.contains("--token differs"), "{line}");
    // The worker's own start-up check names the learner's URL.
    let line = line_naming(
        &c,
        &worker,
        NAMED,
        &["learner queue refuses the token", &c.learner_url()],
    )
    .await;
    assert!(line.contains("ERROR"), "{line}");
    // The queue counts the refused calls by cause and caller.
    let refused = c.depths().await.unwrap().refused_calls;
    assert!(
        refused
            .iter()
            .any(|r| r.call == "Lease" && r.cause == "wrong token" && r.count > 0),
        "{refused:?}"
    );
    // A learner waiting for groups and a reward server stop within 10 s of SIGTERM, exit 0.
    assert!(
        learner.terminate(Duration::from_secs(10)),
        "{}",
        c.log_tails()
    );
    assert!(
        reward.terminate(Duration::from_secs(10)),
        "{}",
        c.log_tails()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reward_url_at_a_worker_s_port_is_refused_at_start() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let addrs = c.direct();
    let _worker = c.worker("worker-a", &addrs);
    c.wait_until(START, "worker-a's service", || async {
        cluster::worker_version(addrs.listen).await.is_some()
    })
    .await;
    // A learner whose --reward is the worker's port.
    let wrong = format!("http://{}", addrs.listen);
    let mut second = c.learner_args(&["--reward", &wrong], false);
    let line = line_naming(&c, &second, NAMED, &["error:", &wrong]).await;
    assert!(line.contains("not a reward server"), "{line}");
    assert!(!second.terminate(Duration::from_secs(10)), "exit 1, not 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_before_its_learner_names_the_url_then_trains() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let worker = c.worker("worker-a", &c.direct());
    let line = line_naming(&c, &worker, NAMED, &["not reachable yet", &c.learner_url()]).await;
    assert!(line.contains("WARN"), "{line}");
    let _learner = c.learner(false);
    c.wait_until(START, "a step", || async { c.steps() >= 1 })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_run_describes_every_metric_and_stops_within_10_s() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let metrics = cluster::free_addr();
    let args: Vec<String> = [
        "train",
        "--local",
        "--preset",
        "tiny",
        "--run-dir",
        c.path("run").to_str().unwrap(),
        "--metrics",
        &metrics.to_string(),
        "--steps",
        "100000",
        "--sft-steps",
        "0",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "8",
        "--log-jsonl",
        c.path("steps.jsonl").to_str().unwrap(),
        // In a directory the run makes.
        "--rollout-dump",
        c.path("new/groups.jsonl").to_str().unwrap(),
        "--no-progress",
    ]
    .map(String::from)
    .to_vec();
    let mut learner = cluster::Proc::spawn("learner", cluster::LEARNER, &args, c.dir.path());
    c.wait_until(START, "two steps", || async { c.steps() >= 2 })
        .await;
    assert!(c.path("new/groups.jsonl").is_file());
    let text = rookworld_service::probe::scrape_metrics(metrics).unwrap();
    let family = |line: &str| {
        line.split_whitespace()
            .nth(2)
            .unwrap_or_default()
            .to_owned()
    };
    let helped: std::collections::BTreeSet<String> = text
        .lines()
        .filter(|l| l.starts_with("# HELP"))
        .map(family)
        .collect();
    let typed: Vec<(String, String)> = text
        .lines()
        .filter(|l| l.starts_with("# TYPE"))
        .map(|l| (family(l), l.split_whitespace().nth(3).unwrap().to_owned()))
        .collect();
    // The learner's, and the in-process worker's and reward server's.
    for prefix in ["learner_", "rollout_", "reward_"] {
        assert!(
            typed.iter().any(|(n, _)| n.starts_with(prefix)),
            "no {prefix} metric\n{text}"
        );
    }
    for (name, kind) in &typed {
        assert!(helped.contains(name), "{name} has no HELP");
        assert_ne!(
            kind, "summary",
            "{name} is a summary, not a histogram with buckets"
        );
    }
    assert!(
        learner.terminate(Duration::from_secs(10)),
        "{}",
        c.log_tails()
    );
    // Numbers in the log are rounded to what they mean (`lr=6.000e-4`, not
    // `lr=0.0006000000000000001`); the timestamps' microseconds are the longest fraction.
    let log = learner.log();
    let long: Vec<&str> = log.lines().filter(|l| has_long_fraction(l)).collect();
    assert!(long.is_empty(), "unrounded numbers:\n{}", long.join("\n"));
}

/// Whether `line` holds a number with more than six digits after its decimal point.
fn has_long_fraction(line: &str) -> bool {
    let b = line.as_bytes();
    (1..b.len()).any(|i| {
        b[i] == b'.'
            && b[i - 1].is_ascii_digit()
            && b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count() > 6
    })
}

#[test]
fn a_long_fraction_is_told_from_a_timestamp() {
    assert!(has_long_fraction("step=3 lr=0.0006000000000000001"));
    assert!(!has_long_fraction(
        "2026-12-06T02:01:17.801154Z  INFO step lr=6.000e-4 seconds=\"0.02\""
    ));
}

/// Within 30 s of the mistake (of the second process's start).
const AT_ONCE: Duration = Duration::from_secs(30);

/// Waits for the learner's queue to serve (its log says so; plaintext or TLS alike).
async fn learner_ready(c: &Cluster, learner: &cluster::Proc) {
    line_naming(c, learner, START, &["learner ready"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_calling_https_at_a_plaintext_learner_is_named_on_both_sides() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let learner = c.learner_args(&[], false);
    learner_ready(&c, &learner).await;
    let mut addrs = c.direct();
    addrs.learner_url = format!("https://{}", c.learner_addr);
    let worker = c.worker("worker-a", &addrs);
    let line = line_naming(&c, &worker, AT_ONCE, &["TLS", &addrs.learner_url]).await;
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains(&format!("http://{}", c.learner_addr)),
        "{line}"
    );
    // The learner names the client that spoke TLS to its plaintext port.
    let https = format!("https://{}", c.learner_addr);
    let line = line_naming(&c, &learner, AT_ONCE, &["TLS", "plaintext port", &https]).await;
    assert!(
        line.contains(&format!("http://{}", c.learner_addr)),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_calling_http_at_a_tls_learner_is_named_on_both_sides() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let certs = c.certs();
    let _reward = c.reward_server();
    let tls = Cluster::serving_tls(&certs, "learner");
    let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    let learner = c.learner_args(&tls, false);
    learner_ready(&c, &learner).await;
    // The worker calls http://, the learner serves TLS.
    let addrs = c.direct();
    let worker = c.worker("worker-a", &addrs);
    let line = line_naming(&c, &worker, AT_ONCE, &["TLS", &c.learner_url()]).await;
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains(&format!("https://{}", c.learner_addr)),
        "{line}"
    );
    let line = line_naming(
        &c,
        &learner,
        AT_ONCE,
        &["TLS port in plaintext", &c.learner_url()],
    )
    .await;
    assert!(
        line.contains(&format!("https://{}", c.learner_addr)),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_worker_among_tls_services_is_named_on_both_sides() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::with_tls();
    let _reward = c.reward_server();
    let learner = c.learner_args(&[], false);
    learner_ready(&c, &learner).await;
    // The worker calls out over mutual TLS but serves (and advertises) plaintext.
    let addrs = c.direct();
    let plain = format!("http://{}", addrs.listen);
    let addrs = cluster::WorkerAddrs {
        advertise: plain.clone(),
        ..addrs
    };
    let worker = c.worker_args("worker-a", &addrs, &[], false);
    let line = line_naming(&c, &learner, AT_ONCE, &["TLS on one side only", &plain]).await;
    assert!(
        line.contains("ERROR") && line.contains("--tls-cert"),
        "{line}"
    );
    assert!(!line.contains("--advertise URL"), "{line}");
    // The learner answers the worker's leases with the same words.
    let line = line_naming(&c, &worker, AT_ONCE, &["lease refused", "TLS", &plain]).await;
    assert!(line.contains("FailedPrecondition"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_worker_among_plaintext_services_is_named_on_both_sides() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let certs = c.certs();
    let _reward = c.reward_server();
    let learner = c.learner_args(&[], false);
    learner_ready(&c, &learner).await;
    // The worker serves TLS (its certificate of a CA the learner does not know).
    let addrs = c.direct();
    let tls_url = format!("https://{}", addrs.listen);
    let addrs = cluster::WorkerAddrs {
        advertise: tls_url.clone(),
        ..addrs
    };
    let worker = c.worker_args(
        "worker-a",
        &addrs,
        &Cluster::serving_tls(&certs, "worker"),
        false,
    );
    let line = line_naming(&c, &learner, AT_ONCE, &["TLS", &tls_url, "--tls-ca"]).await;
    assert!(
        line.contains("ERROR") && line.contains("not trusted"),
        "{line}"
    );
    assert!(!line.contains("--advertise URL"), "{line}");
    // The worker's port names the handshake the learner broke off.
    let port = addrs.listen.to_string();
    let line = line_naming(&c, &worker, AT_ONCE, &["TLS handshake failed at", &port]).await;
    assert!(line.contains("does not trust"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_with_a_worker_s_id_is_refused_and_named() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let learner = c.learner(false);
    let first = c.direct();
    let mut worker_a = c.worker("worker-a", &first);
    c.wait_until(START, "worker-a leasing", || async {
        c.workers().await.iter().any(|w| w.worker_id == "worker-a")
    })
    .await;
    let second = c.direct();
    let mut twin = c.worker("worker-a", &second);
    // The learner names the id and both addresses.
    let line = line_naming(
        &c,
        &learner,
        AT_ONCE,
        &["worker-a", &first.advertise, &second.advertise],
    )
    .await;
    assert!(
        line.contains("ERROR") && line.contains("--worker-id"),
        "{line}"
    );
    // The second worker says why and exits 1.
    assert_eq!(twin.exit_code(AT_ONCE), Some(1), "{}", twin.log());
    let log = twin.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line\n{log}"));
    assert!(
        line.contains("worker-a") && line.contains(&first.advertise),
        "{line}"
    );
    // The first keeps its id and its push address; nobody was forgotten or registered
    // again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let workers = c.workers().await;
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0].push_address, first.advertise);
    let log = learner.log();
    assert!(!log.contains("worker forgotten"), "{log}");
    assert_eq!(log.matches("worker registered").count(), 1, "{log}");
    // The first one gone, its id restarted at another address is let in: nothing answers
    // at the old one.
    worker_a.kill9();
    let third = c.direct();
    let _restarted = c.worker("worker-a", &third);
    c.wait_until(AT_ONCE, "worker-a at its new address", || async {
        c.workers()
            .await
            .iter()
            .any(|w| w.worker_id == "worker-a" && w.push_address == third.advertise)
    })
    .await;
    let log = learner.log();
    assert!(log.contains("worker id moves to a new address"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_another_model_is_named_with_both_models() {
    let _serial = SERIAL.lock().await;
    let c = Cluster::new();
    let _reward = c.reward_server();
    let learner = c.learner(false);
    learner_ready(&c, &learner).await;
    let addrs = c.direct();
    let preset = ["--preset", "gpt2-124m"].map(String::from);
    let worker = c.worker_args("worker-a", &addrs, &preset, false);
    let line = line_naming(&c, &learner, AT_ONCE, &["another model", &addrs.advertise]).await;
    for want in [
        "ERROR",
        "n_layer=12 n_embd=768",
        "gpt2-124m",
        "n_layer=2 n_embd=64",
        "--preset tiny",
    ] {
        assert!(line.contains(want), "{want}: {line}");
    }
    assert!(!line.contains("--advertise"), "{line}");
    let line = line_naming(&c, &worker, AT_ONCE, &["lease refused", "another model"]).await;
    assert!(line.contains("--preset tiny"), "{line}");
}
