//! One push of a weight set to one worker: the same-host file first where it may work,
//! else (or then) a delta against the version the worker runs where one is offered, else
//! (or then) the payload streamed; bounded by a deadline, logged and counted.

use std::time::{Duration, Instant};

use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_proto::rollout::v1::{RelayedPush, SendWeightsRequest, StatusRequest};
use rookworld_service::probe::{cause_chain, error_chain};
use rookworld_service::tls::{ClientTlsArgs, TlsProblem};
use rookworld_weights::relay::{self, Route};
use rookworld_weights::set::{self as weights, CHUNK_BYTES, WeightSet};

use super::delta::{DeltaOffer, DeltaPolicy, Link};
use super::outcome::{Blocked, LearnerModel, PushOutcome};
use crate::metrics::names;
use crate::queue::{Queue, QueueHandle};

/// One push of `set` to the worker at `address`, bounded by `deadline`, logged and
/// counted; through the shared file first when `shared` and the set has one. Plaintext
/// unless `address` is `https://` (then with the system's roots); see [`push_over`].
#[tracing::instrument(name = "push", skip_all, fields(worker = %address, version = set.version))]
pub async fn push_to(
    address: String,
    set: WeightSet,
    token: String,
    deadline: Duration,
    shared: bool,
) -> PushOutcome {
    let via = Via {
        shared,
        ..Via::default()
    };
    push_over(
        address,
        set,
        token,
        deadline,
        via,
        &ClientTlsArgs::default(),
    )
    .await
}

/// The ways a push may take before streaming the payload.
#[derive(Debug, Clone, Default)]
pub struct Via {
    /// Try the same-host file first (when the set has one).
    pub shared: bool,
    /// Send this delta against the version the worker runs, where `policy` says (by
    /// default where it arrives sooner than the payload over the link as last measured,
    /// [`Link::delta_pays`]).
    pub delta: Option<DeltaOffer>,
    pub link: Link,
    /// When a delta is sent (`--push-deltas`).
    pub policy: DeltaPolicy,
    /// The workers the worker relays a streamed push to (none: a push of its own).
    pub route: Route,
    /// Not a push to the worker: it sends the payload it holds to the workers of
    /// `route` (`SendWeights`), which join.
    pub peer: bool,
}

/// [`push_to`] through `via` (see [`Via`]), with the client TLS `tls` for `https://`
/// workers (its files are read for each push, so a rotated client certificate is used from
/// the next push on).
pub async fn push_over(
    address: String,
    set: WeightSet,
    token: String,
    deadline: Duration,
    via: Via,
    tls: &ClientTlsArgs,
) -> PushOutcome {
    let started = Instant::now();
    let mut how = How {
        path: "stream",
        bytes: set.bytes.len() as u64,
        shared_refused: false,
        delta_refused: None,
        receive_seconds: 0.0,
        verify_seconds: 0.0,
        ends_unix_ns: (0, 0),
        relayed: Vec::new(),
    };
    let route = via.route.clone();
    let push = push_one(&address, &set, &token, (deadline, via, tls), &mut how);
    let result = tokio::time::timeout(deadline, push).await;
    let (error, blocked) = match result {
        Ok(Ok(())) => (None, None),
        Ok(Err(PushError { blocked, why })) => (Some(why), blocked),
        Err(_) => (Some(format!("no answer within {deadline:?}")), None),
    };
    let o = PushOutcome {
        worker: address,
        version: set.version,
        seconds: started.elapsed().as_secs_f64(),
        bytes: if error.is_none() { how.bytes } else { 0 },
        error,
        blocked,
        path: how.path,
        shared_refused: how.shared_refused,
        delta_refused: how.delta_refused,
        receive_seconds: how.receive_seconds,
        verify_seconds: how.verify_seconds,
        received_unix_ns: how.ends_unix_ns.0,
        in_use_unix_ns: how.ends_unix_ns.1,
        parent: None,
        unreached: false,
        relayed: Vec::new(),
    };
    let o = PushOutcome {
        relayed: relayed_outcomes(&o, &route, how.relayed),
        ..o
    };
    // No per-worker label: worker addresses come and go (pods, replicas); each worker's
    // own metrics carry its view, and the push logs name it.
    metrics::histogram!(names::WEIGHT_PUSH_SECONDS, "path" => o.path).record(o.seconds);
    metrics::counter!(names::WEIGHT_PUSH_BYTES_TOTAL, "path" => o.path).increment(o.bytes);
    let result = if o.error.is_none() { "ok" } else { "failed" };
    metrics::counter!(names::WEIGHT_PUSHES_TOTAL, "result" => result, "path" => o.path)
        .increment(1);
    match &o.error {
        None => {
            tracing::debug!(worker = %o.worker, version = o.version, seconds = format!("{:.3}", o.seconds), relayed = o.relayed.len(), "weights pushed")
        }
        Some(e) if o.path == "peer" => {
            tracing::info!(peer = %o.worker, version = o.version, error = %e, joining = o.relayed.len(), "a peer could not send joining workers the weights; they are served another way")
        }
        Some(e) if o.relayed.is_empty() => {
            tracing::warn!(worker = %o.worker, version = o.version, error = %e, "weight push failed; worker marked stale, retried after a back-off")
        }
        Some(e) => {
            tracing::warn!(worker = %o.worker, version = o.version, error = %e, below = o.relayed.len(), "a relayed weight push failed; the relay is retried after a back-off, the workers below it are served again at once")
        }
    }
    for r in &o.relayed {
        metrics::counter!(names::WEIGHT_PUSH_BYTES_TOTAL, "path" => "relayed").increment(r.bytes);
        let result = if r.error.is_none() { "ok" } else { "failed" };
        metrics::counter!(names::WEIGHT_PUSHES_TOTAL, "result" => result, "path" => "relayed")
            .increment(1);
    }
    o
}

/// The outcome of each worker below `root` on its `route`, from the relays' answers
/// (`listed`): a worker no answer lists (the root failed, or a relay above it did) was
/// not reached.
fn relayed_outcomes(
    root: &PushOutcome,
    route: &Route,
    listed: Vec<RelayedPush>,
) -> Vec<PushOutcome> {
    let parents = relay::parents(&route.relay_to, route.fanout as usize);
    let mut listed: std::collections::HashMap<String, RelayedPush> =
        listed.into_iter().map(|r| (r.worker.clone(), r)).collect();
    parents
        .into_iter()
        .map(|(worker, parent)| {
            let parent = parent.unwrap_or_else(|| root.worker.clone());
            let r = listed.remove(&worker).unwrap_or_else(|| RelayedPush {
                error: match &root.error {
                    Some(e) => format!("not reached: its relay {} failed: {e}", root.worker),
                    None => format!("not reached: its relay {} did not list it", root.worker),
                },
                ..Default::default()
            });
            let error = (!r.error.is_empty()).then_some(r.error);
            PushOutcome {
                worker,
                version: root.version,
                seconds: r.seconds,
                bytes: if error.is_none() { r.bytes } else { 0 },
                unreached: error.as_ref().is_some_and(|e| e.starts_with("not reached")),
                error,
                // A peer's send is a payload streamed.
                path: if root.path == "peer" {
                    "stream"
                } else {
                    root.path
                },
                receive_seconds: r.receive_seconds,
                verify_seconds: r.verify_seconds,
                received_unix_ns: r.received_unix_ns,
                in_use_unix_ns: r.in_use_unix_ns,
                parent: Some(parent),
                ..Default::default()
            }
        })
        .collect()
}

/// Why a push failed, and what blocks every push to that worker until something changes.
struct PushError {
    blocked: Option<Blocked>,
    why: String,
}

impl PushError {
    /// Nothing answered at the address, or TLS is on one side only.
    fn unreachable(address: &str, why: String) -> Self {
        let blocked = match TlsProblem::classify(address, &why) {
            Some(tls) => Blocked::Tls(tls.at(address)),
            None => Blocked::Unreachable(why.clone()),
        };
        Self {
            blocked: Some(blocked),
            why,
        }
    }
}

/// Which path a push took, the bytes it sent, what refused another path, and the
/// worker's receive and verify phases.
struct How {
    path: &'static str,
    bytes: u64,
    shared_refused: bool,
    delta_refused: Option<String>,
    receive_seconds: f64,
    verify_seconds: f64,
    /// The worker's clock when its last chunk arrived and when the version went into use.
    ends_unix_ns: (u64, u64),
    /// The relays' answers for the workers below.
    relayed: Vec<RelayedPush>,
}

async fn push_one(
    address: &str,
    set: &WeightSet,
    token: &str,
    (deadline, via, tls): (Duration, Via, &ClientTlsArgs),
    how: &mut How,
) -> Result<(), PushError> {
    let began = Instant::now();
    // Each attempt tells a relay the time that is left of the push's deadline.
    let route = |r: &Route| Route {
        deadline: (!r.relay_to.is_empty()).then(|| deadline.saturating_sub(began.elapsed())),
        ..r.clone()
    };
    let endpoint = match tls.endpoint(address) {
        Ok(endpoint) => endpoint,
        Err(e) if tls.enabled() && address.starts_with("http://") => {
            return Err(PushError {
                blocked: Some(Blocked::Tls(format!(
                    "TLS on one side only: this learner calls workers with TLS (--tls-ca, \
                     --tls-client-cert) but the worker advertises the plaintext {address}; \
                     serve TLS on the worker (--tls-cert, --tls-key: it then advertises \
                     https://), or run the learner without client TLS options"
                ))),
                why: e,
            });
        }
        Err(e) => {
            return Err(PushError::unreachable(
                address,
                format!("bad address {address}: {e}"),
            ));
        }
    };
    let channel = endpoint
        .connect_timeout(deadline)
        .timeout(deadline)
        .connect()
        .await
        .map_err(|e| PushError::unreachable(address, format!("connect: {}", error_chain(&e))))?;
    let mut client = RolloutServiceClient::new(channel);
    if via.peer {
        how.path = "peer";
        let r = route(&via.route);
        let mut request = tonic::Request::new(SendWeightsRequest {
            version: set.version,
            run_id: set.run_id.clone(),
            relay_to: r.relay_to,
            relay_fanout: r.fanout,
            deadline_ms: r.deadline.map_or(0, |d| d.as_millis() as u64),
        });
        let _ = rookworld_service::auth::set_token(request.metadata_mut(), token);
        return match client.send_weights(request).await {
            Ok(answer) => {
                let answer = answer.into_inner();
                how.bytes = 0; // the learner's link carried none of it
                check_answer(&answer, set, how)
            }
            Err(s) => Err(PushError {
                blocked: None,
                why: format!("{:?}: {}", s.code(), cause_chain(&s)),
            }),
        };
    }
    if via.shared && set.shared_file.is_some() {
        match weights::push_shared(&mut client, set, token, via.route.answer_when_staged).await {
            Ok(answer) => {
                how.path = "shared";
                return check_answer(&answer, set, how);
            }
            Err(s)
                if s.code() == tonic::Code::FailedPrecondition
                    && s.message().contains("shared payload unreadable") =>
            {
                tracing::info!(worker = %address, why = %s.message(), "the worker cannot read the shared payload; it is streamed the weights from now on");
                how.shared_refused = true;
            }
            Err(s)
                if s.code() == tonic::Code::Unavailable
                    && s.message().contains("shared payload busy") =>
            {
                tracing::debug!(worker = %address, why = %s.message(), "the shared payload is busy; this push is streamed");
            }
            Err(s) => return Err(refused(&mut client, address, token, s).await),
        }
    }
    let payload = set.bytes.len();
    if let Some(offer) = via.delta.filter(|o| o.sent(via.policy, &via.link, payload)) {
        let base = offer.base_version();
        let chunks = offer.chunks(set, &route(&via.route), CHUNK_BYTES);
        match send(&mut client, chunks, token, &via.route).await {
            Ok(answer) => {
                // The worker took the whole delta, so it is made.
                how.path = "delta";
                how.bytes = offer.made_bytes().unwrap_or_default() as u64;
                return check_answer(&answer, set, how);
            }
            Err(s)
                if s.code() == tonic::Code::FailedPrecondition
                    && s.message().contains("delta base unusable") =>
            {
                tracing::info!(worker = %address, why = %s.message(), "the worker cannot apply the delta against version {base}; the payload is streamed");
                how.delta_refused = Some(s.message().to_owned());
            }
            Err(s) => return Err(refused(&mut client, address, token, s).await),
        }
    }
    let chunks = route(&via.route).apply(set.chunks(CHUNK_BYTES));
    match send(&mut client, tokio_stream::iter(chunks), token, &via.route).await {
        Ok(answer) => check_answer(&answer, set, how),
        Err(s) => Err(refused(&mut client, address, token, s).await),
    }
}

/// Sends `chunks`: to a relay watched for stalls ([`relay::send_watched`]: a hung relay
/// must not hold its tree for the whole deadline); to a worker alone bounded by the
/// deadline only, so that a slow link (many pushes at once on a thin one) is no failure.
async fn send(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    chunks: impl tokio_stream::Stream<Item = rookworld_proto::rollout::v1::WeightChunk> + Send + 'static,
    token: &str,
    route: &Route,
) -> Result<rookworld_proto::rollout::v1::UpdateWeightsResponse, tonic::Status> {
    if route.relay_to.is_empty() {
        weights::send(client, chunks, token).await
    } else {
        relay::send_watched(client, chunks, token, relay::STALL).await
    }
}

/// A push the worker at `address` answered with `s`: TLS on one side only (a plaintext
/// call at a TLS port gets this far), a worker of another model (its `Status` says
/// which), or a refusal.
async fn refused(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    address: &str,
    token: &str,
    s: tonic::Status,
) -> PushError {
    let why = format!("{:?}: {}", s.code(), cause_chain(&s));
    if let Some(tls) = TlsProblem::classify(address, &why) {
        return PushError {
            blocked: Some(Blocked::Tls(tls.at(address))),
            why,
        };
    }
    let other_model = s.code() == tonic::Code::InvalidArgument && s.message().contains(OTHER_MODEL);
    if !other_model {
        return PushError { blocked: None, why };
    }
    let mut request = tonic::Request::new(StatusRequest {});
    let _ = rookworld_service::auth::set_token(request.metadata_mut(), token);
    let model = match client.status(request).await {
        Ok(answer) => {
            let a = answer.into_inner();
            if a.model_source.is_empty() {
                a.model
            } else {
                format!("{} ({})", a.model, a.model_source)
            }
        }
        Err(e) => format!("not known (its Status: {})", e.message()),
    };
    PushError {
        blocked: Some(Blocked::OtherModel(model)),
        why,
    }
}

/// Whether a worker's service answers at `address` within `within` (its `Status`: any
/// answer counts, a refusal too); `false` when nothing does (it is gone, or never was).
pub async fn worker_answers(
    address: &str,
    token: &str,
    tls: &ClientTlsArgs,
    within: Duration,
) -> bool {
    let Ok(endpoint) = tls.endpoint(address) else {
        return false;
    };
    let ask = async {
        let channel = endpoint.connect_timeout(within).connect().await.ok()?;
        let mut request = tonic::Request::new(StatusRequest {});
        let _ = rookworld_service::auth::set_token(request.metadata_mut(), token);
        match RolloutServiceClient::new(channel).status(request).await {
            Ok(_) => Some(()),
            // A status with a cause is the connection's failure, not the worker's answer.
            Err(s) if std::error::Error::source(&s).is_some() => None,
            Err(s) if s.code() == tonic::Code::Unavailable => None,
            Err(_) => Some(()),
        }
    };
    matches!(tokio::time::timeout(within, ask).await, Ok(Some(())))
}

/// How a worker words a payload that is not a model of its shape
/// ([`rookworld_weights::set::WeightError::Model`]).
const OTHER_MODEL: &str = "not a model of this worker's shape";

/// A push answered: the worker must now report the pushed version.
fn check_answer(
    answer: &rookworld_proto::rollout::v1::UpdateWeightsResponse,
    set: &WeightSet,
    how: &mut How,
) -> Result<(), PushError> {
    (how.receive_seconds, how.verify_seconds) = (answer.receive_seconds, answer.verify_seconds);
    how.ends_unix_ns = (answer.received_unix_ns, answer.in_use_unix_ns);
    how.relayed.clone_from(&answer.relayed);
    if answer.version != set.version {
        return Err(PushError {
            blocked: None,
            why: format!("worker reports version {} after the push", answer.version),
        });
    }
    Ok(())
}

/// Tells the queue whether pushes reach and fit the worker at `o.worker`: the first time
/// something blocks them, one ERROR naming the address, the cause and what to change
/// ([`Blocked`]; `model` is this learner's); the queue then answers that worker's leases
/// with the same text until a push reaches it.
pub(super) async fn note_reachability(queue: &QueueHandle, o: PushOutcome, model: &LearnerModel) {
    let model = model.clone();
    queue
        .run(move |q| {
            // A peer's send says nothing of the peer's own weights.
            let own = Some(&o).filter(|o| o.path != "peer");
            for o in own.into_iter().chain(&o.relayed) {
                note(q, o, &model);
            }
        })
        .await;
}

fn note(q: &mut Queue, o: &PushOutcome, model: &LearnerModel) {
    match &o.blocked {
        Some(blocked) => {
            let reached = q.push_reached(&o.worker);
            let problem = blocked.describe(&o.worker, model, reached);
            if q.set_push_problem(&o.worker, Some(problem.clone())) {
                match blocked {
                    // A worker that stopped: ordinary, and nothing to change here.
                    Blocked::Unreachable(_) if reached => tracing::warn!("{problem}"),
                    _ => tracing::error!("{problem}"),
                }
            }
        }
        None if o.error.is_none() => {
            q.set_push_problem(&o.worker, None);
            let parent = o.parent.as_deref().unwrap_or("learner");
            match q.set_weight_parent(&o.worker, parent) {
                // The first push, straight from the learner: nothing to say.
                Some(None) if o.parent.is_none() => {}
                Some(None) => {
                    tracing::info!(worker = %o.worker, parent, "worker takes its weights from a relay")
                }
                Some(Some(before)) => {
                    tracing::info!(worker = %o.worker, parent, was = %before, "worker takes its weights from another parent")
                }
                None => {}
            }
        }
        None => {}
    }
}

impl Blocked {
    /// One line: the worker at `address`, what blocks its pushes and what to change
    /// (`model` is this learner's). A worker no push has reached (`reached` false) is
    /// likely advertised at an address the learner cannot reach; one that took pushes
    /// before has stopped (or the way to it has), which no flag changes.
    pub fn describe(&self, address: &str, model: &LearnerModel, reached: bool) -> String {
        match self {
            Blocked::Unreachable(why) if reached => format!(
                "the worker at {address} no longer answers weight pushes ({why}): it stopped, or the way to it did; its leases return to the queue as they expire, and pushes resume when it answers again"
            ),
            Blocked::Unreachable(why) => format!(
                "the learner cannot reach {address} for weight pushes ({why}); start the worker with --advertise URL (ROLLOUT_ADVERTISE) at which the learner reaches its service"
            ),
            Blocked::Tls(line) => format!("weight pushes to the worker at {address} fail: {line}"),
            Blocked::OtherModel(theirs) => format!(
                "the worker at {address} serves another model than this learner, so no weight push fits it: the worker's is {theirs}, the learner's {} ({}); start the worker with the learner's model ({}) and the learner pushes its weights to it",
                model.shape, model.flag, model.flag
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(worker: &str, blocked: Option<Blocked>) -> PushOutcome {
        PushOutcome {
            worker: worker.into(),
            version: 2,
            seconds: 0.0,
            bytes: 0,
            error: blocked.as_ref().map(|_| "no answer".into()),
            blocked,
            path: "stream",
            shared_refused: false,
            delta_refused: None,
            ..Default::default()
        }
    }

    /// A worker no push has reached is likely advertised wrongly (the advice names
    /// --advertise); one that took pushes and then stops answering has stopped, and the
    /// line says so instead of advising a flag.
    #[test]
    fn a_worker_that_stops_answering_is_told_apart_from_one_advertised_wrongly() {
        let model = LearnerModel {
            shape: "tiny".into(),
            flag: "--preset tiny".into(),
        };
        let refused = Blocked::Unreachable("connection refused".into());
        let mut q = Queue::new(crate::queue::QueueConfig::default());
        let (never, stopped) = ("http://10.0.0.9:50051", "http://127.0.0.1:50051");
        note(&mut q, &outcome(never, Some(refused.clone())), &model);
        assert!(!q.push_reached(never));
        let wrong = refused.describe(never, &model, q.push_reached(never));
        assert!(
            wrong.contains("cannot reach http://10.0.0.9:50051")
                && wrong.contains("--advertise URL"),
            "{wrong}"
        );

        note(&mut q, &outcome(stopped, None), &model); // a push reached it
        assert!(q.push_reached(stopped));
        note(&mut q, &outcome(stopped, Some(refused.clone())), &model);
        let gone = refused.describe(stopped, &model, q.push_reached(stopped));
        assert!(
            gone.starts_with("the worker at http://127.0.0.1:50051 no longer answers weight pushes (connection refused): it stopped"),
            "{gone}"
        );
        assert!(!gone.contains("--advertise"), "{gone}");
    }
}
