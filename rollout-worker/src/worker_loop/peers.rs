//! The worker loop's peers: connections with deadlines and keep-alive, retries with
//! back-off while a peer is away (and one log line when it goes and one when it is back),
//! the start-up check of the learner and the reward server, and the reports that tell the
//! learner's queue why this worker cannot deliver groups.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rookworld_proto::queue::v1 as queue;
use rookworld_proto::queue::v1::ProblemCause as Cause;
use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
use rookworld_service::tls::TlsProblem;
use tonic::transport::Channel;

use super::config::LoopConfig;
use crate::metrics::names;

/// At start: whether the learner takes this worker's token and the reward server scores
/// with it, each logged with its URL (a peer that is not up yet is retried by the loop;
/// TLS on one side only is named once, by this check or the loop's first call).
pub(super) async fn check_peers(cfg: Arc<LoopConfig>, peers: Arc<Peers>) {
    use rookworld_service::probe::{http1_instead, learner_queue, reward_server, speaks_http1};
    // How long a peer that failed a gRPC call may take to show it is an HTTP/1 port.
    const HTTP1_PROBE: Duration = Duration::from_secs(2);
    let (Ok(learner), Ok(reward)) = (
        channel(&cfg.learner, cfg.call_timeout, &cfg.tls),
        channel(&cfg.reward, cfg.call_timeout, &cfg.tls),
    ) else {
        return;
    };
    match learner_queue(learner, &cfg.token, &cfg.worker_id).await {
        Ok(()) => {
            tracing::info!(learner = %cfg.learner, "learner queue answers and takes the token")
        }
        // An HTTP/1 port (the learner's metrics, say) fails a gRPC call as a TLS port
        // would: asked first, it is named as what it is.
        Err(p) if p.is_unreachable() && speaks_http1(&cfg.learner, HTTP1_PROBE).await => {
            peers
                .learner
                .not_grpc(http1_instead("--learner", &cfg.learner, "learner queue"));
        }
        Err(p) => match peers.learner.tls_problem("start-up check", &p.to_string()) {
            Some(_) => {}
            None if p.is_unreachable() => {
                tracing::warn!(learner = %cfg.learner, problem = %p, "learner queue not reachable yet; the loop retries")
            }
            None => tracing::error!(learner = %cfg.learner, "learner queue {p}"),
        },
    }
    match reward_server(reward, &cfg.token).await {
        Ok(what) => {
            tracing::info!(reward = %cfg.reward, %what, "reward server answers and takes the token")
        }
        Err(p) if p.is_unreachable() && speaks_http1(&cfg.reward, HTTP1_PROBE).await => {
            peers
                .reward
                .not_grpc(http1_instead("--reward", &cfg.reward, "reward server"));
        }
        Err(p) => match peers.reward.tls_problem("start-up check", &p.to_string()) {
            Some(_) => {}
            None if p.is_unreachable() => {
                tracing::warn!(reward = %cfg.reward, problem = %p, "reward server not reachable yet; the loop retries")
            }
            None => tracing::error!(reward = %cfg.reward, "reward server {p}"),
        },
    }
}

/// A peer the loop calls, and since when it has been unreachable.
#[derive(Debug)]
pub(super) struct Peer {
    name: &'static str,
    url: String,
    down_since: Mutex<Option<Instant>>,
    /// Whether TLS on one side only was named since it last answered.
    tls_said: AtomicBool,
    /// The start-up check found an HTTP/1 port there, not gRPC: the line naming it, which
    /// every later failure reports instead of its guess.
    not_grpc: std::sync::OnceLock<String>,
    /// Whether a call has ever been answered: a peer that goes away after answering has
    /// stopped; one that never answered is not up yet, or not there.
    ever_answered: AtomicBool,
    /// Tells the learner when this peer cannot be reached (the reward server's).
    reporter: Option<Arc<Reporter>>,
}

impl Peer {
    pub(super) fn new(name: &'static str, url: &str, reporter: Option<Arc<Reporter>>) -> Self {
        metrics::gauge!(names::PEER_REACHABLE, "peer" => name).set(1.0);
        Self {
            name,
            url: url.to_owned(),
            down_since: Mutex::new(None),
            tls_said: AtomicBool::new(false),
            not_grpc: std::sync::OnceLock::new(),
            ever_answered: AtomicBool::new(false),
            reporter,
        }
    }

    fn down_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.down_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The line naming TLS on one side only, if `error` (of `call`) shows it; logged as
    /// an error the first time since the peer last answered.
    pub(super) fn tls_problem(&self, call: &str, error: &str) -> Option<String> {
        if let Some(line) = self.not_grpc.get() {
            return Some(line.clone());
        }
        let line = TlsProblem::classify(&self.url, error)?.at(&self.url);
        if !self.tls_said.swap(true, Ordering::Relaxed) {
            tracing::error!(peer = self.name, url = %self.url, call, "{line}; retrying with back-off");
        }
        Some(line)
    }

    /// The start-up check found that the peer's URL is an HTTP/1 port, not gRPC (`line`
    /// says so): one ERROR, and every later failure names it.
    pub(super) fn not_grpc(&self, line: String) {
        tracing::error!(peer = self.name, url = %self.url, "{line}");
        let _ = self.not_grpc.set(line);
        self.tls_said.store(true, Ordering::Relaxed);
    }

    /// It answered: back if it was away.
    pub(super) fn answered(&self) {
        self.tls_said.store(false, Ordering::Relaxed);
        self.ever_answered.store(true, Ordering::Relaxed);
        if let Some(since) = self.down_since().take() {
            metrics::gauge!(names::PEER_REACHABLE, "peer" => self.name).set(1.0);
            tracing::info!(
                peer = self.name,
                url = %self.url,
                after_seconds = format!("{:.1}", since.elapsed().as_secs_f64()),
                "reachable again"
            );
        }
    }

    /// It could not be reached: said once, when it goes away; TLS on one side only
    /// ([`TlsProblem`]) as an error naming it, once, even when it was away already (it
    /// was not up yet, say).
    pub(super) fn unreachable(&self, call: &str, error: &str) {
        metrics::counter!(names::CALL_RETRIES_TOTAL, "call" => call.to_owned()).increment(1);
        let tls = self.tls_problem(call, error);
        let error = tls.as_deref().unwrap_or(error);
        if let Some(r) = &self.reporter {
            r.problem(Cause::RewardUnreachable, &self.url, "", error);
        }
        let mut since = self.down_since();
        let went = since.is_none();
        if went {
            *since = Some(Instant::now());
            metrics::gauge!(names::PEER_REACHABLE, "peer" => self.name).set(0.0);
        }
        if went && tls.is_none() {
            let why = away_line(self.name, self.ever_answered.load(Ordering::Relaxed), error);
            tracing::warn!(peer = self.name, url = %self.url, call, error, "{why}");
        }
    }
}

/// The line for a peer (`name`) that a call could not reach with `error`: a learner that
/// answered before and no longer does has stopped or finished its run (the worker waits
/// for the next); one that never answered is not up yet; a connection whose keep-alive
/// ping went unanswered reached a peer too busy to answer, or lost its network.
fn away_line(name: &str, ever_answered: bool, error: &str) -> String {
    let what = if error.contains("keep-alive timed out") {
        "did not answer the connection's keep-alive ping within 10 s (busy, or the network dropped)"
    } else if name == "learner" && ever_answered {
        "unreachable (it stopped, or its run ended)"
    } else if name == "learner" {
        "unreachable (not up yet, or not at this URL)"
    } else {
        "unreachable"
    };
    let until = if name == "learner" {
        " until it answers (Ctrl-C stops this worker)"
    } else {
        ""
    };
    format!("{what}; retrying with back-off{until}")
}

#[cfg(test)]
mod tests {
    use super::away_line;

    #[test]
    fn a_peer_that_went_away_is_told_from_one_not_up_yet_and_from_a_busy_one() {
        let refused = "transport error: tcp connect error: Connection refused (os error 111)";
        assert_eq!(
            away_line("learner", true, refused),
            "unreachable (it stopped, or its run ended); retrying with back-off until it answers (Ctrl-C stops this worker)"
        );
        assert!(
            away_line("learner", false, refused)
                .starts_with("unreachable (not up yet, or not at this URL);")
        );
        assert_eq!(
            away_line("reward", true, refused),
            "unreachable; retrying with back-off"
        );
        let ping = "transport error: http2 error: keep-alive timed out";
        assert!(
            away_line("learner", true, ping)
                .starts_with("did not answer the connection's keep-alive ping within 10 s")
        );
    }
}

/// Tells the learner's queue what keeps this worker from delivering groups (`Report`),
/// each problem once and again every [`REPORT_EVERY`] while it lasts, and when it is over;
/// best effort (a learner that cannot be reached learns nothing, and says so itself).
#[derive(Debug)]
pub(super) struct Reporter {
    client: RolloutQueueClient<Channel>,
    token: String,
    worker_id: String,
    /// The last report sent: cause, message, when.
    last: Mutex<Option<(Cause, String, Instant)>>,
}

/// How often a lasting problem is reported again.
const REPORT_EVERY: Duration = Duration::from_secs(5);

impl Reporter {
    /// Reports of `cfg`'s worker, sent on `client` (the learner's queue).
    pub(super) fn new(client: RolloutQueueClient<Channel>, cfg: &LoopConfig) -> Self {
        Self {
            client,
            token: cfg.token.clone(),
            worker_id: cfg.worker_id.clone(),
            last: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Cause, String, Instant)>> {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `cause` at `peer` (the gRPC `code` of the failed call, if any): `message`.
    pub(super) fn problem(&self, cause: Cause, peer: &str, code: &str, message: &str) {
        {
            let mut last = self.lock();
            if let Some((c, m, at)) = last.as_ref()
                && *c == cause
                && m == message
                && at.elapsed() < REPORT_EVERY
            {
                return;
            }
            *last = Some((cause, message.to_owned(), Instant::now()));
        }
        self.send(queue::ReportRequest {
            worker_id: self.worker_id.clone(),
            cause: cause as i32,
            peer: peer.to_owned(),
            code: code.to_owned(),
            message: message.chars().take(500).collect(),
        });
    }

    /// Groups are delivered again.
    pub(super) fn resolved(&self) {
        if self.lock().take().is_some() {
            self.send(queue::ReportRequest {
                worker_id: self.worker_id.clone(),
                ..Default::default()
            });
        }
    }

    fn send(&self, report: queue::ReportRequest) {
        let mut client = self.client.clone();
        let request = authed(report, &self.token);
        tokio::spawn(async move {
            if let Err(s) = client.report(request).await {
                tracing::debug!(code = ?s.code(), error = %s.message(), "report not delivered");
            }
        });
    }
}

pub(super) fn channel(
    url: &str,
    timeout: Duration,
    tls: &rookworld_service::tls::ClientTlsArgs,
) -> Result<Channel, String> {
    Ok(tls
        .endpoint(url)?
        .connect_timeout(timeout)
        .timeout(timeout)
        // A peer whose host vanished never resets the connection: pings notice it.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(Duration::from_secs(30)))
        .connect_lazy())
}

/// `msg` with the shared token (a token that cannot be a header value is left out, and
/// the learner refuses the call as unauthenticated).
pub(super) fn authed<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let _ = rookworld_service::auth::set_token(r.metadata_mut(), token);
    r
}

/// Whether a failed call means the peer could not be reached (or answered too late), as
/// opposed to an answer: tonic reports connection failures as UNAVAILABLE (or UNKNOWN with a
/// transport error) and its client timeout as CANCELLED.
fn unreachable(s: &tonic::Status) -> bool {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => true,
        tonic::Code::Unknown => {
            s.message().contains("transport") || s.message().contains("connect")
        }
        _ => false,
    }
}

/// Retries `call` with exponential back-off (100 ms doubling to `max`) while `peer` is
/// unreachable, or answers in a way that shows TLS on one side only; other errors return
/// at once.
pub(super) async fn with_backoff<T, F, Fut>(
    peer: &Peer,
    what: &str,
    max: Duration,
    mut call: F,
) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut wait = Duration::from_millis(100);
    loop {
        let result = call().await;
        let away = match &result {
            Err(s) => {
                let chain = rookworld_service::probe::cause_chain(s);
                (unreachable(s) || TlsProblem::classify(&peer.url, &chain).is_some())
                    .then_some(chain)
            }
            Ok(_) => None,
        };
        let Some(chain) = away else {
            peer.answered();
            return result;
        };
        peer.unreachable(what, &chain);
        tracing::debug!(call = what, error = %chain, retry_in = format!("{:.1} s", wait.as_secs_f64()), "retrying");
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(max);
    }
}

/// The peers of one loop, and what tells the learner about problems.
#[derive(Debug)]
pub(super) struct Peers {
    pub(super) learner: Peer,
    pub(super) reward: Peer,
    pub(super) reporter: Arc<Reporter>,
}

/// How often the loop looks at its client TLS files for a rotated certificate.
const TLS_RECHECK: Duration = Duration::from_secs(10);

/// The loop's clients of the learner and the reward server, rebuilt when the client TLS
/// files change (a rotated certificate or CA is used from the next connection on).
pub(super) struct Clients {
    pub(super) learner: RolloutQueueClient<Channel>,
    pub(super) scorer: RewardServiceClient<Channel>,
    files: Vec<Vec<u8>>,
    checked: Instant,
}

impl Clients {
    pub(super) fn connect(cfg: &LoopConfig) -> Result<Self, String> {
        Ok(Self {
            learner: RolloutQueueClient::new(channel(&cfg.learner, cfg.call_timeout, &cfg.tls)?),
            scorer: RewardServiceClient::new(channel(&cfg.reward, cfg.call_timeout, &cfg.tls)?),
            files: cfg.tls.snapshot(),
            checked: Instant::now(),
        })
    }

    /// Rebuilds the clients when the TLS files changed (checked every [`TLS_RECHECK`]);
    /// files that no longer load keep the old clients, with a warning.
    pub(super) fn refresh(&mut self, cfg: &LoopConfig) {
        if !cfg.tls.enabled() || self.checked.elapsed() < TLS_RECHECK {
            return;
        }
        self.checked = Instant::now();
        let files = cfg.tls.snapshot();
        if files == self.files {
            return;
        }
        match Self::connect(cfg) {
            Ok(new) => {
                *self = new;
                tracing::info!("client TLS files changed: new connections use them");
            }
            Err(e) => {
                self.files = files;
                tracing::warn!(error = %e, "client TLS files changed but do not load; the old ones stay in use");
            }
        }
    }
}
