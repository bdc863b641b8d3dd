//! What the containers rely on: `health` asks a running service's gRPC health endpoint
//! (exit 0 when serving, one line and a failure otherwise), and an empty settings
//! variable (compose's `NAME: ${NAME:-}`) counts as unset.

use std::process::{Command, Output};

use reward_server::service::{self, ServiceConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;

const BIN: &str = env!("CARGO_BIN_EXE_reward-server");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("RUST_LOG", "off");
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn health_is_ok_for_a_serving_server_and_one_line_otherwise() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(async move {
        let scorer = Scorer::new(RewardConfig::default(), None);
        service::run(scorer, ServiceConfig::default(), listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });

    let out = run(&["health", &url], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout.is_empty() && out.stderr.is_empty());

    let _ = stop.send(());
    runtime.block_on(server).unwrap();

    // Nobody listens there any more.
    let out = run(&["health", &url, "--timeout", "2"], &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: ") && err.contains(&url), "{err}");

    let out = run(&["health", "not a url"], &[]);
    assert!(!out.status.success());
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}

#[test]
fn empty_settings_variables_count_as_unset() {
    // The port is taken, so `serve` fails after reading its settings: with the empty
    // variables ignored, on the port, not on a value of ''.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(
        &["serve", "--listen", &addr, "--metrics", "127.0.0.1:0"],
        &[
            ("REWARD_ENGINE_DEPTH", ""),
            ("REWARD_ENGINE", ""),
            ("REWARD_MAX_ITEMS_PER_CALL", ""),
        ],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains(&addr), "{err}");

    // A non-empty bad value is still refused.
    let out = run(
        &["serve", "--listen", &addr, "--metrics", "127.0.0.1:0"],
        &[("REWARD_ENGINE_DEPTH", "deep")],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("deep"), "{}", stderr(&out));
}
