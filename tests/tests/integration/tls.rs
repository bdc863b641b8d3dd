//! TLS and mutual TLS, checked with an independent client: Python grpcio
//! (`tests/scripts/grpc_probe.py`) against the real service binaries, with certificates
//! from `deploy/tls/make-certs.sh`. The right CA connects; plaintext to a TLS port, a wrong
//! CA, and under mutual TLS no client certificate or one from another CA are refused; a
//! rotated certificate serves after SIGHUP and after a plain file change; a cluster
//! (learner, worker, reward server) trains and pushes weights over mutual TLS; no token is
//! ever written to a log. Without Python grpcio the tests say SKIPPED, unless
//! `ROOKWORLD_REQUIRE_GRPCIO` is set (CI sets it and installs grpcio).

use crate::cluster;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use cluster::{Cluster, Proc, free_addr};

const HEALTH: &str = "/grpc.health.v1.Health/Check";
const SCORE: &str = "/rookworld.reward.v1.RewardService/Score";
const DEPTHS: &str = "/rookworld.queue.v1.RolloutQueue/GetDepths";
const TOKEN: &str = "tls-test-token-5f2c";
const WRONG: &str = "tls-test-wrong-9d1e";

/// A Python with grpcio: `$ROOKWORLD_PYTHON`, else `python3`; `None` (SKIPPED) without.
fn python() -> Option<PathBuf> {
    let py = std::env::var_os("ROOKWORLD_PYTHON").map_or_else(|| "python3".into(), PathBuf::from);
    let ok = Command::new(&py)
        .args(["-c", "import grpc"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    assert!(
        std::env::var_os("ROOKWORLD_REQUIRE_GRPCIO").is_none(),
        "Python grpcio is required (pip install grpcio; ROOKWORLD_PYTHON=that python)"
    );
    eprintln!("SKIPPED: no Python grpcio (pip install grpcio)");
    None
}

/// One call by grpc_probe.py: `Ok` with its line, or `Err` with the status line.
fn probe(py: &Path, addr: &str, method: &str, args: &[&str]) -> Result<String, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/grpc_probe.py");
    let out = Command::new(py)
        .arg(script)
        .args([addr, method])
        .args(args)
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() && line.starts_with("OK") {
        Ok(line)
    } else {
        Err(format!(
            "{line} {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Retries `probe` until it answers OK (certificates reload within seconds).
fn probe_until_ok(
    py: &Path,
    addr: &str,
    args: &[&str],
    within: Duration,
) -> Result<String, String> {
    let started = Instant::now();
    loop {
        match probe(py, addr, HEALTH, args) {
            Ok(line) => return Ok(line),
            Err(e) if started.elapsed() > within => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// A CA and certificates for `names` in `dir`.
fn certs(dir: &Path, names: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/tls/make-certs.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(dir)
        .args(names)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// A reward server with the token, serving TLS with `cert`/`key` (and `client_ca`).
fn reward_server(dir: &Path, name: &str, tls: &[String]) -> (Proc, String) {
    let addr = free_addr();
    let mut args: Vec<String> = ["serve", "--listen", &addr.to_string()]
        .map(String::from)
        .to_vec();
    args.extend(["--metrics".into(), free_addr().to_string()]);
    args.extend(["--token".into(), TOKEN.into()]);
    args.extend(tls.iter().cloned());
    let proc = Proc::spawn_logging(name, cluster::REWARD, &args, dir, "debug");
    (proc, addr.to_string())
}

fn ok(r: Result<String, String>, what: &str) {
    if let Err(e) = r {
        panic!("{what}: refused: {e}");
    }
}

fn refused(r: Result<String, String>, what: &str) -> String {
    match r {
        Ok(line) => panic!("{what}: answered: {line}"),
        Err(e) => e,
    }
}

#[test]
fn tls_and_mutual_tls_refuse_what_they_must_and_rotate_without_a_restart() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    certs(&a, &["server", "client"]);
    certs(&b, &["server", "client"]);
    let served = tmp.path().join("served");
    std::fs::create_dir(&served).unwrap();
    let (crt, key) = (served.join("server.crt"), served.join("server.key"));
    let install = |from: &Path| {
        std::fs::copy(from.join("server.crt"), &crt).unwrap();
        std::fs::copy(from.join("server.key"), &key).unwrap();
    };
    install(&a);
    let (ca_a, ca_b) = (s(&a.join("ca.crt")), s(&b.join("ca.crt")));

    // TLS: the right CA connects; plaintext and a wrong CA do not.
    let tls = ["--tls-cert", &s(&crt), "--tls-key", &s(&key)].map(String::from);
    let (server, addr) = reward_server(tmp.path(), "tls", &tls);
    ok(
        probe_until_ok(&py, &addr, &["--ca", &ca_a], Duration::from_secs(30)),
        "right CA",
    );
    let e = refused(probe(&py, &addr, HEALTH, &["--plaintext"]), "plaintext");
    assert!(e.contains("UNAVAILABLE"), "{e}");
    refused(probe(&py, &addr, HEALTH, &["--ca", &ca_b]), "wrong CA");
    // Over TLS, Score still needs the token.
    let e = refused(
        probe(&py, &addr, SCORE, &["--ca", &ca_a]),
        "Score without a token",
    );
    assert!(e.contains("UNAUTHENTICATED"), "{e}");
    let e = refused(
        probe(&py, &addr, SCORE, &["--ca", &ca_a, "--token", WRONG]),
        "Score with a wrong token",
    );
    assert!(e.contains("PERMISSION_DENIED"), "{e}");
    ok(
        probe(&py, &addr, SCORE, &["--ca", &ca_a, "--token", TOKEN]),
        "Score with the token",
    );

    // Rotation by SIGHUP: CA b's certificate serves, CA a's no longer does.
    install(&b);
    let pid = server.pid().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    ok(
        probe_until_ok(&py, &addr, &["--ca", &ca_b], Duration::from_secs(10)),
        "after SIGHUP",
    );
    refused(
        probe(&py, &addr, HEALTH, &["--ca", &ca_a]),
        "the old CA after SIGHUP",
    );
    // Rotation by a file change alone (checked every 10 s).
    install(&a);
    ok(
        probe_until_ok(&py, &addr, &["--ca", &ca_a], Duration::from_secs(30)),
        "after a change",
    );
    // A broken file is not loaded: the last good certificate keeps serving.
    std::fs::write(&key, "not a key").unwrap();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    std::thread::sleep(Duration::from_millis(500));
    ok(
        probe(&py, &addr, HEALTH, &["--ca", &ca_a]),
        "a broken key file is not loaded",
    );
    let log = server.log();
    assert!(log.contains("TLS certificates reloaded"), "{log}");
    assert!(log.contains("not reloaded"), "{log}");

    // Mutual TLS: no client certificate, or one of another CA, is refused.
    let mtls = [
        "--tls-cert",
        &s(&a.join("server.crt")),
        "--tls-key",
        &s(&a.join("server.key")),
        "--tls-client-ca",
        &ca_a,
    ]
    .map(String::from);
    let (mutual, maddr) = reward_server(tmp.path(), "mtls", &mtls);
    let (mine_crt, mine_key) = (s(&a.join("client.crt")), s(&a.join("client.key")));
    let (other_crt, other_key) = (s(&b.join("client.crt")), s(&b.join("client.key")));
    let mine = ["--ca", &ca_a, "--cert", &mine_crt, "--key", &mine_key];
    let other = ["--ca", &ca_a, "--cert", &other_crt, "--key", &other_key];
    ok(
        probe_until_ok(&py, &maddr, &mine, Duration::from_secs(30)),
        "mTLS, own CA",
    );
    refused(
        probe(&py, &maddr, HEALTH, &["--ca", &ca_a]),
        "mTLS without a client certificate",
    );
    refused(
        probe(&py, &maddr, HEALTH, &other),
        "mTLS with another CA's certificate",
    );
    let scored = [&mine[..], &["--token", TOKEN]].concat();
    ok(
        probe(&py, &maddr, SCORE, &scored),
        "mTLS Score with the token",
    );

    // No token in any log line, at debug level, right or wrong.
    for (name, log) in [("tls", server.log()), ("mtls", mutual.log())] {
        assert!(
            !log.contains(TOKEN) && !log.contains(WRONG),
            "{name} logged a token:\n{log}"
        );
    }
}

#[test]
fn a_plaintext_port_off_loopback_says_so_once() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_addr().port();
    let args = [
        "serve",
        "--listen",
        &format!("0.0.0.0:{port}"),
        "--metrics",
        &free_addr().to_string(),
    ]
    .map(String::from);
    let proc = Proc::spawn("open", cluster::REWARD, &args, tmp.path());
    let started = Instant::now();
    while !proc.log().contains("reward server ready") {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{}",
            proc.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    let log = proc.log();
    assert_eq!(
        log.matches("serving plaintext on a non-loopback address")
            .count(),
        1,
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_trains_and_pushes_weights_over_mutual_tls() {
    let Some(py) = python() else { return };
    let c = Cluster::with_tls();
    let _reward = c.reward_server();
    let learner = c.learner(false);
    let addrs = c.direct();
    let worker = c.worker("worker-a", &addrs);
    c.wait_until(
        Duration::from_secs(240),
        "two steps over mutual TLS",
        || async { c.steps() >= 2 },
    )
    .await;
    c.wait_until(
        Duration::from_secs(60),
        "a weight push over TLS",
        || async {
            c.worker_version_tls(addrs.listen)
                .await
                .is_some_and(|v| v >= 1)
        },
    )
    .await;

    // The queue answers the operator's certificate, and nothing without one.
    let tls = c.tls.clone().unwrap();
    let learner_addr = c.learner_addr.to_string();
    let ca = s(&tls.join("ca.crt"));
    let operator = [
        "--ca",
        &ca,
        "--cert",
        &s(&tls.join("operator.crt")),
        "--key",
        &s(&tls.join("operator.key")),
    ];
    ok(
        probe(&py, &learner_addr, DEPTHS, &operator),
        "GetDepths with the operator's certificate",
    );
    refused(
        probe(&py, &learner_addr, DEPTHS, &["--ca", &ca]),
        "GetDepths without a certificate",
    );
    refused(
        probe(&py, &learner_addr, DEPTHS, &["--plaintext"]),
        "GetDepths in plaintext",
    );

    for (name, log) in [("learner", learner.log()), ("worker", worker.log())] {
        assert!(
            !log.contains("fault-token"),
            "{name} logged the token:\n{log}"
        );
        assert!(log.contains("serving TLS"), "{name}:\n{log}");
    }
}

/// `learner train --local` over TLS when asked: the in-process worker and reward server
/// serve the learner's certificate and every call between them is mutual TLS.
#[test]
fn a_local_run_over_mutual_tls_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let certs_dir = tmp.path().join("tls");
    certs(&certs_dir, &["local"]);
    let f = |name: &str| s(&certs_dir.join(name));
    let out = Command::new(cluster::LEARNER)
        .args([
            "train",
            "--local",
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--sft-steps",
            "0",
        ])
        .args([
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "12",
        ])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--no-progress",
        ])
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .args(["--tls-cert", &f("local.crt"), "--tls-key", &f("local.key")])
        .args(["--tls-client-ca", &f("ca.crt"), "--tls-ca", &f("ca.crt")])
        .args([
            "--tls-client-cert",
            &f("local.crt"),
            "--tls-client-key",
            &f("local.key"),
        ])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{log}");
    // The queue, the worker and the reward server.
    assert_eq!(log.matches("serving TLS").count(), 3, "{log}");
    assert!(!log.contains("handshake failed"), "{log}");
}
