//! Client-side probes of a running RookWorld service: what reflection lists, and a
//! scrape of its Prometheus endpoint. Used by the tests and by tools that check a
//! deployment.

use std::io::{Read, Write};
use std::net::SocketAddr;

use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// Asks one reflection version for its service list.
macro_rules! list_with {
    ($version:ident, $channel:expr) => {{
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut client = ServerReflectionClient::new($channel);
        let mut stream = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await?
            .into_inner();
        match stream
            .next()
            .await
            .transpose()?
            .and_then(|r| r.message_response)
        {
            Some(MessageResponse::ListServicesResponse(list)) => {
                Ok(list.service.into_iter().map(|s| s.name).collect())
            }
            other => Err(tonic::Status::internal(format!(
                "unexpected reflection answer {other:?}"
            ))),
        }
    }};
}

/// The services that server reflection lists, through the v1 or the v1alpha protocol.
pub async fn list_services(channel: Channel, v1alpha: bool) -> Result<Vec<String>, tonic::Status> {
    if v1alpha {
        list_with!(v1alpha, channel)
    } else {
        list_with!(v1, channel)
    }
}

/// The body of `GET /metrics` on `addr` (blocking); an error unless the answer is 200.
pub fn scrape_metrics(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    if !response.starts_with("HTTP/1.1 200") {
        let status = response.lines().next().unwrap_or("no answer").to_owned();
        return Err(std::io::Error::other(format!(
            "GET /metrics on {addr}: {status}"
        )));
    }
    Ok(response)
}

/// Resident memory of process `pid` now and at its peak, in bytes (`VmRSS`, `VmHWM` of
/// `/proc/PID/status`, Linux).
pub fn memory(pid: u32) -> std::io::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    Ok((kb("VmRSS:"), kb("VmHWM:")))
}

/// Options of the `health` command every service binary has: asks a running service's
/// gRPC health endpoint, for container health checks (exit 0 only when serving).
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// The service, e.g. `http://127.0.0.1:50051`.
    pub addr: String,
    /// Seconds before the check fails.
    #[arg(long, default_value_t = 3.0)]
    pub timeout: f64,
    /// TLS for an `https://` address.
    #[command(flatten)]
    pub tls: crate::tls::ClientTlsArgs,
}

impl HealthArgs {
    /// Runs the check on a small runtime of its own; the error is one line.
    pub fn run(&self) -> Result<(), String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        runtime.block_on(self.check())
    }

    /// The check, on the caller's runtime.
    pub async fn check(&self) -> Result<(), String> {
        let timeout = std::time::Duration::from_secs_f64(self.timeout.clamp(0.1, 3600.0));
        check_health(&self.addr, &self.tls, timeout).await
    }
}

/// `Ok` when the server at `addr` answers the overall health check with SERVING within
/// `timeout`; otherwise one line saying what it answered, or why it did not.
pub async fn check_health(
    addr: &str,
    tls: &crate::tls::ClientTlsArgs,
    timeout: std::time::Duration,
) -> Result<(), String> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let ask = async {
        let channel = tls
            .endpoint(addr)?
            .connect()
            .await
            .map_err(|e| format!("{addr}: cannot connect: {e}"))?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest::default())
            .await
            .map_err(|s| format!("{addr}: {}: {}", s.code(), s.message()))?;
        match answer.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(format!("{addr}: {}", other.as_str_name())),
        }
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| format!("{addr}: no answer within {:.1} s", timeout.as_secs_f64()))?
}

/// A codec whose messages are raw bytes: a probe sends a message as is (the hostile-input
/// tests: bytes no generated client would write) and reads the answer undecoded.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

/// What is wrong with a peer a service depends on, as found by [`reward_server`] or
/// [`learner_queue`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerProblem {
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// It answers, but not as that service (another service's port).
    #[error("not a {0}: it does not serve {1} (is it another service's port?)")]
    NotThatService(&'static str, &'static str),
    /// It refuses the token (none configured there, or another one).
    #[error("refuses the token ({code}): {message}")]
    Refused { code: String, message: String },
    #[error("{call} failed ({code}): {message}")]
    Failed {
        call: &'static str,
        code: String,
        message: String,
    },
}

impl PeerProblem {
    /// Whether waiting may cure it (the peer is not up yet, or away).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, PeerProblem::Unreachable(_))
    }

    fn of(call: &'static str, service: (&'static str, &'static str), s: tonic::Status) -> Self {
        use tonic::Code;
        // A status with a cause is the connection's failure, not the peer's answer (an
        // HTTP/2 GOAWAY reads as PERMISSION_DENIED or INTERNAL).
        if std::error::Error::source(&s).is_some() {
            return PeerProblem::Unreachable(cause_chain(&s));
        }
        let message = s.message().to_owned();
        match s.code() {
            Code::Unimplemented => PeerProblem::NotThatService(service.0, service.1),
            Code::Unauthenticated | Code::PermissionDenied => PeerProblem::Refused {
                code: format!("{:?}", s.code()),
                message,
            },
            Code::Unknown if message.contains("transport") || message.contains("connect") => {
                PeerProblem::Unreachable(cause_chain(&s))
            }
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                PeerProblem::Unreachable(cause_chain(&s))
            }
            code => PeerProblem::Failed {
                call,
                code: format!("{code:?}"),
                message,
            },
        }
    }
}

/// A failed call's message with its causes (`transport error: … Connection refused`).
pub fn cause_chain(s: &tonic::Status) -> String {
    let mut out = s.message().to_owned();
    append_causes(&mut out, std::error::Error::source(s));
    out
}

/// An error's message with its causes, each once (tonic's transport error alone says
/// only `transport error`).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    append_causes(&mut out, e.source());
    out
}

fn append_causes(out: &mut String, mut source: Option<&(dyn std::error::Error + 'static)>) {
    while let Some(e) = source {
        let text = e.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = e.source();
    }
}

/// `msg` with the shared token (a token that is not a valid header value goes without, and
/// the peer refuses the call).
fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let _ = crate::auth::set_token(r.metadata_mut(), token);
    r
}

/// Checks that `channel` reaches a reward server that scores with `token`: its `Info`, then
/// a trial `Score` of one malformed policy completion (no engine work). Returns a short
/// description of the server.
pub async fn reward_server(channel: Channel, token: &str) -> Result<String, PeerProblem> {
    use rookworld_proto::reward::v1 as pb;
    use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
    const SERVICE: (&str, &str) = ("reward server", "rookworld.reward.v1.RewardService");
    let mut client = RewardServiceClient::new(channel);
    let info = client
        .info(with_token(pb::InfoRequest {}, token))
        .await
        .map_err(|s| PeerProblem::of("Info", SERVICE, s))?
        .into_inner();
    let trial = pb::ScoreRequest {
        items: vec![pb::ScoreItem {
            task: pb::Task::Policy as i32,
            prompt: "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1".into(),
            completion: String::new(),
        }],
    };
    client
        .score(with_token(trial, token))
        .await
        .map_err(|s| PeerProblem::of("Score", SERVICE, s))?;
    Ok(format!(
        "engine {}",
        if info.engine_configured {
            "configured"
        } else {
            "not configured"
        }
    ))
}

/// Checks that `channel` reaches a learner's queue that takes `token` from `worker_id`: a
/// `Report` that nothing is wrong (it also registers the worker).
pub async fn learner_queue(
    channel: Channel,
    token: &str,
    worker_id: &str,
) -> Result<(), PeerProblem> {
    use rookworld_proto::queue::v1 as pb;
    use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
    const SERVICE: (&str, &str) = ("learner queue", "rookworld.queue.v1.RolloutQueue");
    let report = pb::ReportRequest {
        worker_id: worker_id.to_owned(),
        ..Default::default()
    };
    RolloutQueueClient::new(channel)
        .report(with_token(report, token))
        .await
        .map_err(|s| PeerProblem::of("Report", SERVICE, s))?;
    Ok(())
}

/// Whether the plaintext `url` (`http://host:port`) answers an HTTP/1.1 request as an
/// HTTP/1 server does — a metrics or web port, where a gRPC call fails with no more than a
/// broken pipe or a reset connection. Asked only after such a failure; `false` for an
/// `https://` URL, or when nothing answers within `within`.
pub async fn speaks_http1(url: &str, within: std::time::Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or(rest).to_owned();
    let ask = async move {
        let mut stream = tokio::net::TcpStream::connect(&authority).await.ok()?;
        let request = format!("GET / HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut head = [0u8; 7];
        stream.read_exact(&mut head).await.ok()?;
        Some(&head == b"HTTP/1.")
    };
    matches!(tokio::time::timeout(within, ask).await, Ok(Some(true)))
}

/// The line for a peer at `url` that answers HTTP/1.1 instead of gRPC ([`speaks_http1`]):
/// `flag` is the option that named it, `service` what it should reach.
pub fn http1_instead(flag: &str, url: &str, service: &str) -> String {
    format!(
        "{flag} {url} answers HTTP/1.1, not gRPC: it is another kind of port (a metrics or \
         web port?); point {flag} at the {service}'s gRPC port"
    )
}

#[cfg(test)]
mod http1_tests {
    use super::*;
    use std::time::Duration;

    /// A metrics-like HTTP/1.1 port is recognised; a port that closes at once, or nothing
    /// listening, is not; nor is an https URL.
    #[tokio::test]
    async fn an_http1_port_is_told_from_one_that_is_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let http1 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = http1.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = http1.accept().await {
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_at = closing.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((s, _)) = closing.accept().await {
                drop(s);
            }
        });
        let nothing = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let within = Duration::from_secs(2);
        assert!(speaks_http1(&format!("http://{at}"), within).await);
        assert!(speaks_http1(&format!("http://{at}/path"), within).await);
        assert!(!speaks_http1(&format!("http://{closed_at}"), within).await);
        assert!(!speaks_http1(&format!("http://{nothing}"), within).await);
        assert!(!speaks_http1(&format!("https://{at}"), within).await);
        let line = http1_instead("--learner", &format!("http://{at}"), "learner queue");
        assert!(
            line.contains("answers HTTP/1.1, not gRPC")
                && line.ends_with("point --learner at the learner queue's gRPC port"),
            "{line}"
        );
    }
}
