//! A real scrape of `/metrics` after scoring calls (own test binary: the recorder is global).

use reward_server::service::{self, ServiceConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;
use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
use rookworld_proto::reward::v1::{ScoreItem, ScoreRequest, Task};

fn scrape(addr: std::net::SocketAddr) -> String {
    rookworld_service::probe::scrape_metrics(addr).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_items_verdicts_and_latency() {
    let metrics_addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    reward_server::metrics::install_exporter(metrics_addr).unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scorer = Scorer::new(RewardConfig::default(), None);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(service::run(
        scorer,
        ServiceConfig {
            guard: rookworld_service::auth::Guard::shared("t"),
            ..ServiceConfig::default()
        },
        listener,
        async {
            let _ = rx.await;
        },
    ));
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RewardServiceClient::with_interceptor(
        channel,
        rookworld_service::auth::Bearer::new("t").unwrap(),
    );
    let start = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1";
    let item = |c: &str| ScoreItem {
        task: Task::Environment as i32,
        prompt: format!("A: {start}+e2e4+e2e4+"),
        completion: c.into(),
    };
    client
        .score(ScoreRequest {
            items: vec![item("junk"), item("a+b+c+d")],
        })
        .await
        .unwrap();
    let _ = client
        .score(ScoreRequest {
            items: vec![ScoreItem {
                task: 0,
                ..item("")
            }],
        })
        .await;

    // The exporter runs on this runtime: scrape from a blocking thread, as Prometheus would
    // from another process.
    let body = tokio::task::spawn_blocking(move || scrape(metrics_addr))
        .await
        .unwrap();
    for needle in [
        r#"reward_requests_total{status="ok"} 1"#,
        r#"reward_requests_total{status="invalid_argument"} 1"#,
        r#"reward_items_total{task="A"} 2"#,
        r#"reward_verdicts_total{task="A",verdict="malformed",reason="field_count"} 1"#,
        r#"reward_verdicts_total{task="A",verdict="partial",reason="partial"} 1"#,
        "reward_request_duration_seconds_bucket",
        "# HELP reward_items_total",
        concat!(
            "reward_build_info{version=\"",
            env!("CARGO_PKG_VERSION"),
            "\""
        ),
    ] {
        assert!(body.contains(needle), "missing {needle}\n{body}");
    }
    let _ = tx.send(());
    server.await.unwrap().unwrap();
}
