//! What every RookWorld gRPC server shares: reflection (v1 and v1alpha, listing the
//! service it serves, health and reflection), the shutdown signal, and the connection
//! rules: HTTP/2 and TCP keep-alive (a vanished client is noticed), a bound on streams per
//! connection, and a bound on how long a shutdown waits for calls in flight.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use crate::http2::endpoint;
use crate::http2::{CONNECTION_WINDOW_BYTES, MAX_FRAME_BYTES, STREAM_WINDOW_BYTES};
use crate::tls::ServerTls;
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};
use tonic_reflection::server::v1alpha::{
    ServerReflection as ServerReflectionAlpha,
    ServerReflectionServer as ServerReflectionAlphaServer,
};

/// The services every server lists besides its own.
pub const COMMON_SERVICES: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// Reflection over every descriptor, listing `served` and [`COMMON_SERVICES`] only (the
/// descriptors of the other RookWorld services stay resolvable, never listed).
fn builder(served: &str) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .include_reflection_service(false)
        .register_encoded_file_descriptor_set(rookworld_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .with_service_name(served);
    for name in COMMON_SERVICES {
        b = b.with_service_name(name);
    }
    b
}

/// Server reflection, v1 and v1alpha (grpcurl and older clients use either), listing the
/// service `served`, health and reflection.
#[allow(clippy::type_complexity)]
pub fn reflection_services(
    served: &str,
) -> Result<
    (
        ServerReflectionServer<impl ServerReflection>,
        ServerReflectionAlphaServer<impl ServerReflectionAlpha>,
    ),
    tonic_reflection::server::Error,
> {
    Ok((
        builder(served).build_v1()?,
        builder(served).build_v1alpha()?,
    ))
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

/// For a command without an async runtime (`learner eval`, `learner sft`, …): a flag that
/// turns true on Ctrl-C or SIGTERM, for the command to ask between its units of work. The
/// handlers are installed before this returns — also over a SIGINT that the launching shell
/// ignores (a background job) — so from then on a signal stops the command through the
/// flag instead of killing it.
pub fn stop_on_signal() -> std::io::Result<Arc<std::sync::atomic::AtomicBool>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    on_signal(move || flag.store(true, Ordering::Relaxed))?;
    Ok(stop)
}

/// For a command whose unfinished work is worth nothing (a benchmark printing its report
/// at the end): on Ctrl-C or SIGTERM, `cleanup` removes what it leaves behind, one line on
/// stderr says that `command` stopped, and the process exits 0 at once.
pub fn exit_on_signal(
    command: &'static str,
    cleanup: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    on_signal(move || {
        cleanup();
        eprintln!("{command}: stopped by a signal; no report (what finished is shown above)");
        std::process::exit(0)
    })
}

/// Installs Ctrl-C and SIGTERM handlers (before it returns) and runs `action` on a thread
/// of its own when the first of them arrives.
fn on_signal(action: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let signalled = {
        let _in = runtime.enter();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let mut interrupt = signal(SignalKind::interrupt())?;
            let mut terminate = signal(SignalKind::terminate())?;
            async move {
                tokio::select! { _ = interrupt.recv() => {}, _ = terminate.recv() => {} }
            }
        }
        #[cfg(not(unix))]
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    };
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            runtime.block_on(signalled);
            tracing::info!("stopping: a signal arrived");
            action();
        })?;
    Ok(())
}

/// Interval of the server's HTTP/2 pings, and how long it waits for the answer.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Concurrent calls on one connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// How long a shutdown waits for calls in flight before it closes them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// One shutdown future for several tasks: a receiver that turns true when `shutdown`
/// completes, for each task to clone and await with [`stopped`].
pub fn fan_out(
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> tokio::sync::watch::Receiver<bool> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    stopped
}

/// Resolves once `rx` says stop (or its sender is gone).
pub async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|&s| s).await;
}

/// Serves `service` with health (marked serving) and reflection v1 and v1alpha on
/// `listener` until `shutdown` completes; calls in flight get [`SHUTDOWN_GRACE`] to finish.
/// With `tls`, every connection is TLS (mutual when it has a client CA) and the
/// certificates are reloaded while it serves ([`crate::tls`]); without it, a listener on
/// an address other than loopback gets one warning line. A client that calls with TLS on
/// one side only is named in a warning (at most one a minute), whichever side it is.
pub async fn serve<S>(
    service: S,
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<S>().await;
    let (reflection_v1, reflection_v1alpha) = reflection_services(S::NAME)?;
    let stopped = fan_out(shutdown);
    let when_stopped = self::stopped;
    let addr = listener.local_addr()?;
    match &tls {
        Some(t) => tracing::info!(%addr, service = S::NAME, mutual = t.mutual(), "serving TLS"),
        None if !addr.ip().is_loopback() => tracing::warn!(
            %addr,
            service = S::NAME,
            "serving plaintext on a non-loopback address: the token, rollouts and weights cross the network readable (see --tls-cert)"
        ),
        None => {}
    }
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(CONNECTION_WINDOW_BYTES))
        .max_frame_size(Some(MAX_FRAME_BYTES))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service);
    let server: std::pin::Pin<
        Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
    > = match tls {
        Some(tls) => {
            tokio::spawn(tls.clone().watch(stopped.clone()));
            Box::pin(router.serve_with_incoming_shutdown(
                crate::tls::incoming(listener, tls),
                when_stopped(stopped.clone()),
            ))
        }
        None => Box::pin(router.serve_with_incoming_shutdown(
            crate::tls::plaintext_incoming(listener),
            when_stopped(stopped.clone()),
        )),
    };
    let overdue = async {
        when_stopped(stopped).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = server => served?,
        () = overdue => tracing::warn!(
            grace_seconds = SHUTDOWN_GRACE.as_secs(),
            "calls still in flight after the shutdown grace; closing them"
        ),
    }
    Ok(())
}
