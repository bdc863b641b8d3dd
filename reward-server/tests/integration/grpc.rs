//! The real gRPC service on 127.0.0.1:0: scoring, typed errors, health and reflection.

use std::net::SocketAddr;

use reward_server::service::{self, ServiceConfig};
use rookworld_chess::score::RewardConfig;
use rookworld_chess::scorer::Scorer;
use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
use rookworld_proto::reward::v1::{InfoRequest, ScoreItem, ScoreRequest, Task, Verdict};
use rookworld_service::auth::Bearer;
use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::codegen::InterceptedService;
use tonic::transport::Channel;

const TOKEN: &str = "reward-test-token";
const START: &str = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1";

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<()>,
}

impl Server {
    /// The service with `cfg`, guarded by [`TOKEN`] unless `cfg` has a token.
    async fn start(mut cfg: ServiceConfig) -> Self {
        if cfg.guard.token().is_none() {
            cfg.guard = rookworld_service::auth::Guard::shared(TOKEN);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let scorer = Scorer::new(RewardConfig::default(), None);
        let handle = tokio::spawn(async move {
            service::run(scorer, cfg, listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Self {
            addr,
            stop: Some(tx),
            handle,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Channel::from_shared(self.url())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A client that sends [`TOKEN`].
    async fn client(&self) -> RewardServiceClient<InterceptedService<Channel, Bearer>> {
        RewardServiceClient::with_interceptor(self.channel().await, Bearer::new(TOKEN).unwrap())
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.handle.await.unwrap();
    }
}

fn env_item(uci: &str, completion: &str) -> ScoreItem {
    ScoreItem {
        task: Task::Environment as i32,
        prompt: format!("A: {START}+{uci}+{uci}+"),
        completion: completion.into(),
    }
}

#[tokio::test]
async fn scores_a_batch_in_order() {
    let server = Server::start(ServiceConfig::default()).await;
    let mut client = server.client().await;
    let items = vec![
        env_item(
            "e2e4",
            "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0",
        ),
        env_item("e2e4", "nonsense"),
        env_item(
            "g1f3",
            "rnbqkbnr/pppppppp/8/8/8/5N2/PPPPPPPP/RNBQKB1R b KQkq - 1 1+0.001+0+0",
        ),
        ScoreItem {
            task: Task::Policy as i32,
            prompt: format!("P: {START}"),
            completion: "M: e2e4 d2d4 E: 0.3 0.3 B: e2e4".into(),
        },
    ];
    let results = client
        .score(ScoreRequest { items })
        .await
        .unwrap()
        .into_inner()
        .results;
    let verdicts: Vec<Verdict> = results.iter().map(|r| r.verdict()).collect();
    assert_eq!(
        verdicts,
        [
            Verdict::Exact,
            Verdict::Malformed,
            Verdict::Exact,
            Verdict::Exact
        ]
    );
    assert_eq!(results[1].reward, -1.0);
    assert!(
        results[1].reason.contains("fields"),
        "{}",
        results[1].reason
    );
    assert_eq!(results[0].components["placement"], 1.0);
    assert!(!results[3].engine_graded);

    let info = client.info(InfoRequest {}).await.unwrap().into_inner();
    assert!(!info.engine_configured);
    assert_eq!(info.weights["A.placement"], 0.4);
    server.stop().await;
}

#[tokio::test]
async fn bad_items_are_invalid_argument_naming_the_index() {
    let server = Server::start(ServiceConfig::default()).await;
    let mut client = server.client().await;
    let ok = env_item("e2e4", "x");
    let cases = [
        (vec![ok.clone(), env_item("e2e5", "x")], "item 1", "e2e5"),
        (
            vec![ScoreItem {
                task: 0,
                ..ok.clone()
            }],
            "item 0",
            "unknown task",
        ),
        (
            vec![
                ok.clone(),
                ok.clone(),
                ScoreItem {
                    prompt: "A: not a fen+e2e4+e2e4+".into(),
                    ..ok.clone()
                },
            ],
            "item 2",
            "FEN",
        ),
        (
            vec![ScoreItem {
                task: Task::Policy as i32,
                prompt: "Q: nope".into(),
                ..ok.clone()
            }],
            "item 0",
            "P: ",
        ),
    ];
    for (items, index, reason) in cases {
        let status = client.score(ScoreRequest { items }).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains(index) && status.message().contains(reason),
            "{}",
            status.message()
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn overload_is_resource_exhausted_and_oversize_is_invalid() {
    let server = Server::start(ServiceConfig {
        max_items_in_flight: 4,
        max_items_per_call: 8,
        ..ServiceConfig::default()
    })
    .await;
    let mut client = server.client().await;
    let item = env_item("e2e4", "x");
    let status = client
        .score(ScoreRequest {
            items: vec![item.clone(); 5],
        })
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::ResourceExhausted,
        "{}",
        status.message()
    );
    let status = client
        .score(ScoreRequest {
            items: vec![item.clone(); 9],
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    // Within the limits it serves, and the slots come back.
    for _ in 0..3 {
        assert_eq!(
            client
                .score(ScoreRequest {
                    items: vec![item.clone(); 4]
                })
                .await
                .unwrap()
                .into_inner()
                .results
                .len(),
            4
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn health_reports_serving() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let server = Server::start(ServiceConfig::default()).await;
    let mut health = HealthClient::new(server.channel().await);
    for service in ["", "rookworld.reward.v1.RewardService"] {
        let resp = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            resp.status(),
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service:?}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn reflection_v1_and_v1alpha_list_and_describe_the_services() {
    let server = Server::start(ServiceConfig::default()).await;
    {
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut client = ServerReflectionClient::new(server.channel().await);
        let requests = [
            MessageRequest::ListServices(String::new()),
            MessageRequest::FileContainingSymbol("rookworld.reward.v1.RewardService".into()),
        ]
        .map(|m| ServerReflectionRequest {
            host: String::new(),
            message_request: Some(m),
        });
        let mut stream = client
            .server_reflection_info(tokio_stream::iter(requests))
            .await
            .unwrap()
            .into_inner();
        match stream
            .next()
            .await
            .unwrap()
            .unwrap()
            .message_response
            .unwrap()
        {
            MessageResponse::ListServicesResponse(list) => {
                let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
                for want in ["rookworld.reward.v1.RewardService", "grpc.health.v1.Health"] {
                    assert!(names.iter().any(|n| n == want), "v1 lists {names:?}");
                }
            }
            other => panic!("unexpected {other:?}"),
        }
        match stream
            .next()
            .await
            .unwrap()
            .unwrap()
            .message_response
            .unwrap()
        {
            MessageResponse::FileDescriptorResponse(files) => {
                assert!(!files.file_descriptor_proto.is_empty())
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for alpha in [false, true] {
        let mut services = rookworld_service::probe::list_services(server.channel().await, alpha)
            .await
            .unwrap();
        services.sort();
        assert_eq!(
            services,
            [
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection",
                "rookworld.reward.v1.RewardService",
            ],
            "only what this server serves (v1alpha: {alpha})"
        );
    }
    server.stop().await;
}

/// Score spends compute: it needs the shared token (missing: UNAUTHENTICATED; wrong:
/// PERMISSION_DENIED; none configured: refused). Info is open unless an inspection token
/// is set; then it, or the shared token, is needed.
#[tokio::test]
async fn score_needs_the_token_and_info_the_inspection_token_when_one_is_set() {
    let items = || ScoreRequest {
        items: vec![env_item("e2e4", "x")],
    };
    let server = Server::start(ServiceConfig {
        guard: rookworld_service::auth::Guard::new(Some(TOKEN.into()), Some("look".into())),
        ..ServiceConfig::default()
    })
    .await;
    let mut bare = RewardServiceClient::new(server.channel().await);
    let status = bare.score(items()).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let status = bare.info(InfoRequest {}).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let mut wrong =
        RewardServiceClient::with_interceptor(server.channel().await, Bearer::new("nope").unwrap());
    assert_eq!(
        wrong.score(items()).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    let mut inspector =
        RewardServiceClient::with_interceptor(server.channel().await, Bearer::new("look").unwrap());
    inspector.info(InfoRequest {}).await.unwrap();
    assert_eq!(
        inspector.score(items()).await.unwrap_err().code(),
        Code::PermissionDenied,
        "the inspection token does no work"
    );
    let mut client = server.client().await;
    client.info(InfoRequest {}).await.unwrap();
    assert_eq!(
        client
            .score(items())
            .await
            .unwrap()
            .into_inner()
            .results
            .len(),
        1
    );
    server.stop().await;

    // Without an inspection token Info is open; with no token at all, Score is refused.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(service::run(
        Scorer::new(RewardConfig::default(), None),
        ServiceConfig::default(),
        listener,
        std::future::pending(),
    ));
    let mut open = RewardServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    open.info(InfoRequest {}).await.unwrap();
    let status = open.score(items()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("no token is configured"),
        "{status:?}"
    );
}
