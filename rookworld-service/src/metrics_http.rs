//! The Prometheus endpoint every service serves, read-only: `GET`/`HEAD` on `/metrics` (the
//! scrape) and `/health`; any other method is 405, any other path 404, and no request
//! body is ever read. A request's head must arrive within [`HEAD_TIMEOUT`], a connection
//! lives at most [`CONNECTION_LIFETIME`], and at most [`MAX_CONNECTIONS`] are open at once,
//! so a slow or hostile client cannot hold the port.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{BuildError, PrometheusBuilder, PrometheusHandle};
use tokio::sync::Semaphore;

/// Buckets (seconds) of every service's request-latency histogram (a name ending in
/// [`REQUEST_DURATION_SUFFIX`]): one table, so that a process that records another
/// service's requests (the learner's `--local`) buckets them as that service does.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How every request-latency histogram's name ends.
pub const REQUEST_DURATION_SUFFIX: &str = "_request_duration_seconds";

/// `builder` with [`REQUEST_LATENCY_BUCKETS`] for every request-latency histogram.
pub fn request_latency_buckets(
    builder: PrometheusBuilder,
) -> Result<PrometheusBuilder, BuildError> {
    builder.set_buckets_for_metric(
        metrics_exporter_prometheus::Matcher::Suffix(REQUEST_DURATION_SUFFIX.into()),
        REQUEST_LATENCY_BUCKETS,
    )
}

/// Time a client has to send a request's head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest life of one connection (keep-alive included).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 64;
/// How often histograms are drained into the scrape.
const UPKEEP: Duration = Duration::from_secs(5);

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen: {0}")]
    Bind(#[from] std::io::Error),
    #[error(transparent)]
    Build(#[from] BuildError),
}

/// Installs `builder`'s recorder as the process's and serves it on `addr`; returns the
/// address bound (`addr` may name port 0). Needs a Tokio runtime.
pub fn install(builder: PrometheusBuilder, addr: SocketAddr) -> Result<SocketAddr, MetricsError> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let handle = builder.install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(serve(listener, handle));
    Ok(bound)
}

/// Sets `name` (`<service>_build_info`) to 1, labelled with what runs: the crate
/// `version`, the build `profile` (`release`, `debug`) and the binary's optional
/// `features` (`cuda`, or empty), so a dashboard can tell which build each process runs.
pub fn build_info(name: &'static str, version: &'static str, features: &'static str) {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    metrics::describe_gauge!(
        name,
        "1, labelled with the build: version, profile, features."
    );
    metrics::gauge!(name, "version" => version, "profile" => profile, "features" => features)
        .set(1.0);
}

/// Accepts connections until the process ends.
async fn serve(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            continue; // full: the connection is dropped (closed) at once
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let handle = handle.clone();
                async move { Ok::<_, Infallible>(answer(&req, &handle)) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop(permit);
        });
    }
}

/// The answer to one request (its body, if any, is never read).
fn answer<B>(req: &Request<B>, handle: &PrometheusHandle) -> Response<Full<Bytes>> {
    let body = match req.uri().path() {
        "/metrics" => handle.render(),
        "/health" => "OK\n".to_owned(),
        _ => {
            return plain(
                StatusCode::NOT_FOUND,
                "not found: GET /metrics or /health\n",
            );
        }
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut response = plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "read-only: GET or HEAD only\n",
        );
        response
            .headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let mut response = plain(StatusCode::OK, "");
    *response.body_mut() = Full::new(Bytes::from(body));
    if req.uri().path() == "/metrics" {
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/plain; version=0.0.4"),
        );
    }
    response
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
