//! TLS on every gRPC connection, with rustls (the stack under tonic's TLS): a server's
//! certificate and key, optionally a client CA that makes it mutual TLS; a client's CA and,
//! for mutual TLS, its own certificate. Every flag has an environment variable.
//!
//! A server re-reads its files on SIGHUP and when they change (checked every
//! [`RELOAD_POLL`]): new connections get the new certificate, open ones keep theirs, and a
//! file that fails to load leaves the old certificate serving, with a warning. A client
//! reads its files whenever it builds a connection (see [`ClientTlsArgs::endpoint`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

/// The TLS metrics' names (described by [`describe_metrics`]).
pub const TLS_HANDSHAKE_FAILURES_TOTAL: &str = "grpc_tls_handshake_failures_total";
pub const TLS_RELOADS_TOTAL: &str = "grpc_tls_reloads_total";

/// Describes the TLS metrics that every service serving TLS records; each service's own
/// `describe` calls it.
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter};
    describe_counter!(
        TLS_HANDSHAKE_FAILURES_TOTAL,
        Unit::Count,
        "TLS handshakes that failed, by `reason` (refused, timeout, busy; plaintext: a client that spoke plaintext to the TLS port)."
    );
    describe_counter!(
        TLS_RELOADS_TOTAL,
        Unit::Count,
        "Certificate files re-read after SIGHUP or a change, by `result` (ok; error: the old ones still serve)."
    );
}

/// How often a server checks its certificate files for a change.
pub const RELOAD_POLL: Duration = Duration::from_secs(10);
/// How long a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; connections past it are closed at once.
pub const MAX_HANDSHAKES: usize = 256;

/// A server's TLS options (flattened into every `serve` command line).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServerTlsArgs {
    /// Serve TLS with this certificate chain (PEM, leaf first).
    #[arg(long, env = "ROOKWORLD_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "ROOKWORLD_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: require a client certificate signed by this CA (PEM).
    #[arg(long, env = "ROOKWORLD_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

/// A client's TLS options: used for every `https://` address it calls.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientTlsArgs {
    /// Trust servers whose certificate this CA signed (PEM); without it, the system's roots.
    #[arg(long, env = "ROOKWORLD_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Mutual TLS: this client certificate chain (PEM)...
    #[arg(long, env = "ROOKWORLD_TLS_CLIENT_CERT", requires = "tls_client_key")]
    pub tls_client_cert: Option<PathBuf>,
    /// ...and its private key (PEM).
    #[arg(long, env = "ROOKWORLD_TLS_CLIENT_KEY", requires = "tls_client_cert")]
    pub tls_client_key: Option<PathBuf>,
    /// The name servers' certificates are checked against, instead of each URL's host
    /// (set by commands whose peers share one certificate, e.g. the learner's
    /// `--push-tls-name` for workers that advertise IP addresses).
    #[arg(skip)]
    pub server_name: Option<String>,
}

/// Reads `path` for the option `flag`; the error is one line naming both.
fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {}: {e}", path.display()))
}

/// Every certificate in a PEM file; an error when it holds none.
fn certificates(
    flag: &str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

fn private_key(flag: &str, path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| format!("{flag} {}: no usable PEM private key: {e}", path.display()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The bytes of a server's files, as last read (no `Debug`: the key is among them).
#[derive(Clone, PartialEq, Eq)]
struct ServerFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl ServerTlsArgs {
    /// Whether TLS is asked for.
    pub fn enabled(&self) -> bool {
        self.tls_cert.is_some()
    }

    /// The server's TLS, loaded and checked now; `None` when it serves plaintext.
    pub fn load(&self) -> Result<Option<Arc<ServerTls>>, String> {
        if !self.enabled() {
            return Ok(None);
        }
        let files = self.read()?;
        let config = server_config(self, &files)?;
        Ok(Some(Arc::new(ServerTls {
            args: self.clone(),
            files: Mutex::new(files),
            config: RwLock::new(Arc::new(config)),
        })))
    }

    fn read(&self) -> Result<ServerFiles, String> {
        let (cert, key) = match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => (c, k),
            _ => return Err("--tls-cert and --tls-key go together".into()),
        };
        Ok(ServerFiles {
            cert: read("--tls-cert", cert)?,
            key: read("--tls-key", key)?,
            client_ca: match &self.tls_client_ca {
                Some(p) => Some(read("--tls-client-ca", p)?),
                None => None,
            },
        })
    }
}

/// A rustls server configuration from `files`: TLS 1.2 and 1.3, HTTP/2 by ALPN, and a
/// client certificate required and verified against the client CA when one is set.
fn server_config(args: &ServerTlsArgs, files: &ServerFiles) -> Result<ServerConfig, String> {
    let cert_path = args.tls_cert.as_deref().unwrap_or(Path::new(""));
    let key_path = args.tls_key.as_deref().unwrap_or(Path::new(""));
    let certs = certificates("--tls-cert", cert_path, &files.cert)?;
    let key = private_key("--tls-key", key_path, &files.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match (&files.client_ca, &args.tls_client_ca) {
        (Some(pem), Some(path)) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates("--tls-client-ca", path, pem)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("--tls-client-ca {}: {e}", path.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| format!("--tls-client-ca {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "--tls-cert {} with --tls-key {}: {e}",
            cert_path.display(),
            key_path.display()
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// A serving TLS configuration that can be swapped while the server runs.
pub struct ServerTls {
    args: ServerTlsArgs,
    files: Mutex<ServerFiles>,
    config: RwLock<Arc<ServerConfig>>,
}

impl std::fmt::Debug for ServerTls {
    /// The file paths, never their contents (the private key is among them).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("args", &self.args)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Whether clients must present a certificate.
    pub fn mutual(&self) -> bool {
        self.args.tls_client_ca.is_some()
    }

    /// The acceptor for the next connection, with the newest configuration.
    fn acceptor(&self) -> TlsAcceptor {
        let config = self
            .config
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        TlsAcceptor::from(config)
    }

    /// Re-reads the files: `Ok(true)` when they changed and the new configuration serves
    /// from now on; an error (the old configuration stays) when they no longer load.
    pub fn reload(&self) -> Result<bool, String> {
        let files = self.args.read()?;
        let mut held = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *held == files {
            return Ok(false);
        }
        let config = server_config(&self.args, &files)?;
        *self
            .config
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(config);
        *held = files;
        Ok(true)
    }

    /// Reloads on SIGHUP and when the files change, until `stopped` says so.
    pub(crate) async fn watch(self: Arc<Self>, mut stopped: tokio::sync::watch::Receiver<bool>) {
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            #[cfg(unix)]
            let hup = async {
                match hangup.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hup = std::future::pending::<()>();
            let why = tokio::select! {
                _ = stopped.wait_for(|&s| s) => return,
                () = hup => "SIGHUP",
                () = tokio::time::sleep(RELOAD_POLL) => "a file changed",
            };
            let this = self.clone();
            let result = tokio::task::spawn_blocking(move || this.reload())
                .await
                .unwrap_or_else(|e| Err(format!("reload task: {e}")));
            match result {
                Ok(true) => {
                    metrics::counter!(TLS_RELOADS_TOTAL, "result" => "ok").increment(1);
                    tracing::info!(trigger = why, "TLS certificates reloaded");
                }
                Ok(false) if why == "SIGHUP" => {
                    tracing::info!("SIGHUP: the TLS files are unchanged")
                }
                Ok(false) => {}
                Err(e) => {
                    metrics::counter!(TLS_RELOADS_TOTAL, "result" => "error").increment(1);
                    tracing::warn!(trigger = why, error = %e, "TLS certificates not reloaded; the previous ones still serve");
                }
            }
        }
    }
}

/// TLS connections from `listener`, each handshake on a task of its own (a slow client
/// never holds the others up) and bounded by [`HANDSHAKE_TIMEOUT`] and [`MAX_HANDSHAKES`].
/// A client that speaks plaintext to the port is named in one warning a minute (rustls
/// answers it with a TLS alert); failed handshakes are counted and
/// logged at most once a minute. Ends when the receiver is dropped.
pub(crate) fn incoming(
    listener: TcpListener,
    tls: Arc<ServerTls>,
) -> tokio_stream::wrappers::ReceiverStream<
    std::io::Result<tokio_rustls::server::TlsStream<TcpStream>>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let local = listener.local_addr().ok();
        let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let said = Arc::new(Throttle::default());
        let plaintext_said = Arc::new(Throttle::default());
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                handshake_failed(
                    &said,
                    peer,
                    local,
                    "too many handshakes in progress",
                    "busy",
                );
                continue;
            };
            let (acceptor, tx, said) = (tls.acceptor(), tx.clone(), said.clone());
            let plaintext_said = plaintext_said.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
                let Some(first) = first_bytes(&tcp, deadline).await else {
                    handshake_failed(&said, peer, local, "no handshake in time", "timeout");
                    return;
                };
                let opening = Opening::of(&first);
                if opening == Opening::Http2 || opening == Opening::Other {
                    metrics::counter!(TLS_HANDSHAKE_FAILURES_TOTAL, "reason" => "plaintext")
                        .increment(1);
                    if plaintext_said.due() {
                        let port = local.map_or_else(|| "?".to_owned(), |a| a.to_string());
                        tracing::warn!(
                            %peer,
                            "a client at {peer} called this TLS port in plaintext (http://{port}): \
                             call it with https://{port} (and --tls-ca, the CA that signed \
                             this port's certificate), or serve this port in plaintext (no \
                             --tls-cert); further ones this minute are only counted in \
                             grpc_tls_handshake_failures_total{{reason=\"plaintext\"}}"
                        );
                    }
                    // rustls answers it with a TLS alert, which an HTTP/2 client reads as a
                    // frame of invalid size (TlsProblem::classify names it from that).
                    let _ = tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await;
                    return;
                }
                match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => handshake_failed(&said, peer, local, &e.to_string(), "refused"),
                    Err(_) => {
                        handshake_failed(&said, peer, local, "no handshake in time", "timeout")
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Plaintext connections from `listener`, as they come. A client that opens with a TLS
/// handshake (it calls `https://`) is named in one warning a minute, and its connection
/// goes on to the server, which answers in plaintext (the client then says so). Ends when
/// the receiver is dropped.
pub(crate) fn plaintext_incoming(
    listener: TcpListener,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<TcpStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let local = listener.local_addr().ok();
        let said = Arc::new(Throttle::default());
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (tx, said) = (tx.clone(), said.clone());
            tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
                let first = first_bytes(&tcp, deadline).await.unwrap_or_default();
                if Opening::of(&first) == Opening::Tls && said.due() {
                    let port = local.map_or_else(|| "?".to_owned(), |a| a.to_string());
                    tracing::warn!(
                        %peer,
                        "a client at {peer} called this plaintext port with TLS \
                         (https://{port}): call it with http://{port}, or serve TLS here \
                         (--tls-cert, --tls-key); further ones this minute are not logged"
                    );
                }
                let _ = tx.send(Ok(tcp)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// What the first bytes of a connection say its client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// A TLS handshake record (content type 22, then a 3.x version).
    Tls,
    /// The HTTP/2 preface of a plaintext client (`PRI * HTTP/2.0`): gRPC over `http://`.
    Http2,
    /// Something else: HTTP/1, another protocol.
    Other,
    /// Nothing: the client closed without a byte.
    Nothing,
}

impl Opening {
    fn of(first: &[u8]) -> Self {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0";
        match first {
            [] => Opening::Nothing,
            [0x16] | [0x16, 0x03, ..] => Opening::Tls,
            b if PREFACE.starts_with(&b[..b.len().min(PREFACE.len())]) => Opening::Http2,
            _ => Opening::Other,
        }
    }
}

/// The first bytes a client sent on `tcp` (left in the socket for the server): empty when
/// it closed without one, `None` when none came before `deadline`.
async fn first_bytes(tcp: &TcpStream, deadline: tokio::time::Instant) -> Option<Vec<u8>> {
    let mut buf = [0u8; 16];
    match tokio::time::timeout_at(deadline, tcp.peek(&mut buf)).await {
        Ok(Ok(n)) => Some(buf[..n].to_vec()),
        Ok(Err(_)) => Some(Vec::new()),
        Err(_) => None,
    }
}

/// At most one log line a minute.
#[derive(Debug, Default)]
struct Throttle(Mutex<Option<std::time::Instant>>);

impl Throttle {
    /// Whether a line may be logged now (then none for a minute).
    fn due(&self) -> bool {
        let mut last = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(std::time::Instant::now());
            return true;
        }
        false
    }
}

/// Counts a failed handshake at the port `local`; logs it, with what to change where the
/// error says, unless one was logged in the last minute.
fn handshake_failed(
    said: &Throttle,
    peer: std::net::SocketAddr,
    local: Option<std::net::SocketAddr>,
    why: &str,
    reason: &'static str,
) {
    metrics::counter!(TLS_HANDSHAKE_FAILURES_TOTAL, "reason" => reason).increment(1);
    if said.due() {
        let port = local.map_or_else(|| "?".to_owned(), |a| a.to_string());
        let hint = handshake_hint(why);
        tracing::warn!(%peer, error = why, "TLS handshake failed at {port}{hint} (further failures this minute are only counted in grpc_tls_handshake_failures_total)");
    }
}

/// What a server's handshake error means for the client, where it is clear.
fn handshake_hint(error: &str) -> &'static str {
    if ["UnknownCA", "BadCertificate", "CertificateUnknown"]
        .iter()
        .any(|a| error.contains(a))
    {
        ": the client does not trust this port's certificate; give it --tls-ca with the CA \
         that signed --tls-cert"
    } else if error.contains("peer sent no certificates") {
        ": mutual TLS, and the client sent no certificate; give it --tls-client-cert and \
         --tls-client-key signed by this port's --tls-client-ca"
    } else if error.contains("UnknownIssuer") {
        ": the client's certificate is not signed by this port's --tls-client-ca"
    } else {
        ""
    }
}

/// TLS on one side of a call only, or a server certificate the client does not trust:
/// what a client's failed call means ([`TlsProblem::classify`]), named with what to
/// change ([`TlsProblem::at`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsProblem {
    /// The call was TLS (`https://`) and the port answered in plaintext.
    PortIsPlaintext,
    /// The call was plaintext (`http://`) and the port serves TLS.
    PortIsTls,
    /// The server's certificate is not trusted here (the handshake's words).
    Untrusted(String),
}

impl TlsProblem {
    /// The TLS problem a call to `url` that failed with `error` (its message with its
    /// causes, [`crate::probe::cause_chain`]) shows, if any.
    pub fn classify(url: &str, error: &str) -> Option<Self> {
        if url.starts_with("https://") {
            if [
                "InvalidContentType",
                "corrupt message",
                "wrong version number",
            ]
            .iter()
            .any(|m| error.contains(m))
            {
                return Some(TlsProblem::PortIsPlaintext);
            }
            if let Some(at) = error.find("invalid peer certificate") {
                let detail = error[at..].split([':', ')']).take(2).collect::<Vec<_>>();
                return Some(TlsProblem::Untrusted(detail.join(":").trim().to_owned()));
            }
        } else if url.starts_with("http://")
            && [
                // A TLS alert record read as an HTTP/2 frame header.
                "frame with invalid size",
            ]
            .iter()
            .any(|m| error.contains(m))
        {
            return Some(TlsProblem::PortIsTls);
        }
        None
    }

    /// One line naming `url`, what is wrong and what to change.
    pub fn at(&self, url: &str) -> String {
        let rest = url
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        match self {
            TlsProblem::PortIsPlaintext => format!(
                "TLS on one side only: {url} answers in plaintext, but it is called with TLS; \
                 call it with http://{rest}, or serve TLS there (--tls-cert, --tls-key)"
            ),
            TlsProblem::PortIsTls => format!(
                "TLS on one side only: {url} serves TLS, but it is called in plaintext; call \
                 it with https://{rest} (and --tls-ca, the CA that signed its certificate), \
                 or serve plaintext there"
            ),
            TlsProblem::Untrusted(detail) => format!(
                "TLS: the certificate of {url} is not trusted here ({detail}); give --tls-ca \
                 the CA that signed it"
            ),
        }
    }
}

impl ClientTlsArgs {
    /// Whether any client TLS option is set.
    pub fn enabled(&self) -> bool {
        self.tls_ca.is_some() || self.tls_client_cert.is_some()
    }

    /// The contents of the files as they are now (empty without TLS options; an unreadable
    /// file counts as empty): a change means connections built from now on differ.
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        [&self.tls_ca, &self.tls_client_cert, &self.tls_client_key]
            .into_iter()
            .flatten()
            .map(|p| std::fs::read(p).unwrap_or_default())
            .collect()
    }

    /// Checks that the files load (at start, so a bad path is one line before any call).
    pub fn check(&self) -> Result<(), String> {
        if self.enabled() {
            self.config()?;
        }
        Ok(())
    }

    /// tonic's client TLS from the files as they are now.
    fn config(&self) -> Result<tonic::transport::ClientTlsConfig, String> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let mut config = ClientTlsConfig::new();
        config = match &self.tls_ca {
            Some(path) => {
                let pem = read("--tls-ca", path)?;
                certificates("--tls-ca", path, &pem)?;
                config.ca_certificate(Certificate::from_pem(pem))
            }
            None => config.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&self.tls_client_cert, &self.tls_client_key) {
            let (c, k) = (
                read("--tls-client-cert", cert)?,
                read("--tls-client-key", key)?,
            );
            certificates("--tls-client-cert", cert, &c)?;
            private_key("--tls-client-key", key, &k)?;
            config = config.identity(Identity::from_pem(c, k));
        }
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        Ok(config.timeout(HANDSHAKE_TIMEOUT))
    }

    /// A client endpoint for `url` ([`crate::http2::endpoint`]), with TLS when the URL is
    /// `https://` (the files are read now). A plaintext `http://` URL while TLS options are
    /// set is refused: the call would cross unprotected.
    pub fn endpoint(&self, url: &str) -> Result<tonic::transport::Endpoint, String> {
        let endpoint = crate::http2::endpoint(url).map_err(|e| format!("{url}: {e}"))?;
        if url.starts_with("https://") {
            return endpoint
                .tls_config(self.config()?)
                .map_err(|e| format!("{url}: {e}"));
        }
        if self.enabled() {
            return Err(format!(
                "{url} is plaintext but TLS options (--tls-ca / --tls-client-cert) are set: use https://"
            ));
        }
        Ok(endpoint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_s_first_bytes_say_what_its_client_speaks() {
        assert_eq!(Opening::of(&[0x16, 0x03, 0x01, 0x02, 0x00]), Opening::Tls);
        assert_eq!(Opening::of(&[0x16]), Opening::Tls);
        assert_eq!(Opening::of(b"PRI * HTTP/2.0\r\n\r\nSM"), Opening::Http2);
        assert_eq!(Opening::of(b"PR"), Opening::Http2);
        assert_eq!(Opening::of(b"GET / HTTP/1.1\r\n"), Opening::Other);
        assert_eq!(Opening::of(&[0x16, 0x01]), Opening::Other);
        assert_eq!(Opening::of(&[]), Opening::Nothing);
    }

    #[test]
    fn tls_on_one_side_only_is_told_from_the_client_s_error() {
        let plain = "transport error: received corrupt message of type InvalidContentType";
        let (https, http) = ("https://h:1", "http://h:1");
        assert_eq!(
            TlsProblem::classify(https, plain),
            Some(TlsProblem::PortIsPlaintext)
        );
        assert_eq!(TlsProblem::classify(http, plain), None);
        let alert = "h2 protocol error: frame with invalid size";
        assert_eq!(
            TlsProblem::classify(http, alert),
            Some(TlsProblem::PortIsTls)
        );
        let untrusted = "connect: transport error: invalid peer certificate: UnknownIssuer";
        assert_eq!(
            TlsProblem::classify(https, untrusted),
            Some(TlsProblem::Untrusted(
                "invalid peer certificate: UnknownIssuer".into()
            ))
        );
        assert_eq!(TlsProblem::classify(http, "Connection refused"), None);
        for (problem, fix) in [
            (TlsProblem::PortIsTls, "call it with https://h:1"),
            (TlsProblem::PortIsPlaintext, "call it with http://h:1"),
        ] {
            let line = problem.at(if fix.contains("https") { http } else { https });
            assert!(line.contains("TLS") && line.contains(fix), "{line}");
        }
    }
}
