//! `rollout-worker serve` misconfigured: one clear line on stderr and a non-zero exit.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_rollout-worker");

fn serve(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .arg("serve")
        .args(args)
        .env("RUST_LOG", "off")
        .env_remove("ROOKWORLD_TOKEN")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_configuration_is_one_line_and_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-token");
    let (ok, err) = serve(&[
        "--preset",
        "tiny",
        "--token-file",
        missing.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: --token-file") && err.contains("no-such-token"),
        "{err}"
    );

    let (ok, err) = serve(&[
        "--model",
        dir.path().join("no-model").to_str().unwrap(),
        "--token",
        "t",
    ]);
    assert!(!ok);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("does not exist"), "{err}");

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let (ok, err) = serve(&[
        "--preset",
        "tiny",
        "--token",
        "t",
        "--listen",
        &addr,
        "--metrics",
        &metrics,
    ]);
    assert!(!ok);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot listen on"), "{err}");
}
