//! One push of a weight set to one worker: the same-host file first where it may work,
//! else (or then) the stream; bounded by a deadline, logged and counted.

use std::time::{Duration, Instant};

use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_service::tls::ClientTlsArgs;
use rookworld_weights::set::{self as weights, CHUNK_BYTES, WeightSet};

use super::PushOutcome;
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
    push_over(
        address,
        set,
        token,
        deadline,
        shared,
        &ClientTlsArgs::default(),
    )
    .await
}

/// [`push_to`] with the client TLS `tls` for `https://` workers (its files are read for
/// each push, so a rotated client certificate is used from the next push on).
pub async fn push_over(
    address: String,
    set: WeightSet,
    token: String,
    deadline: Duration,
    shared: bool,
    tls: &ClientTlsArgs,
) -> PushOutcome {
    let started = Instant::now();
    let mut how = How {
        path: "stream",
        shared_refused: false,
    };
    let push = push_one(&address, &set, &token, (deadline, shared, tls), &mut how);
    let result = tokio::time::timeout(deadline, push).await;
    let (error, unreachable) = match result {
        Ok(Ok(())) => (None, false),
        Ok(Err(PushError { unreachable, why })) => (Some(why), unreachable),
        Err(_) => (Some(format!("no answer within {deadline:?}")), false),
    };
    let o = PushOutcome {
        worker: address,
        version: set.version,
        seconds: started.elapsed().as_secs_f64(),
        bytes: if error.is_none() {
            set.bytes.len() as u64
        } else {
            0
        },
        error,
        unreachable,
        path: how.path,
        shared_refused: how.shared_refused,
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
            tracing::debug!(worker = %o.worker, version = o.version, seconds = o.seconds, "weights pushed")
        }
        Some(e) => {
            tracing::warn!(worker = %o.worker, version = o.version, error = %e, "weight push failed; worker marked stale, retried after a back-off")
        }
    }
    o
}

/// Why a push failed, and whether anything answered at the address at all.
struct PushError {
    unreachable: bool,
    why: String,
}

/// Which path a push took.
struct How {
    path: &'static str,
    shared_refused: bool,
}

async fn push_one(
    address: &str,
    set: &WeightSet,
    token: &str,
    (deadline, shared, tls): (Duration, bool, &ClientTlsArgs),
    how: &mut How,
) -> Result<(), PushError> {
    let unreachable = |why: String| PushError {
        unreachable: true,
        why,
    };
    let channel = tls
        .endpoint(address)
        .map_err(|e| unreachable(format!("bad address {address}: {e}")))?
        .connect_timeout(deadline)
        .timeout(deadline)
        .connect()
        .await
        .map_err(|e| unreachable(format!("connect: {e}: {}", source_chain(&e))))?;
    let mut client = RolloutServiceClient::new(channel);
    let refused = |why: String| PushError {
        unreachable: false,
        why,
    };
    let refusal = |s: tonic::Status| refused(format!("{:?}: {}", s.code(), s.message()));
    if shared && set.shared_file.is_some() {
        match weights::push_shared(&mut client, set, token).await {
            Ok(answer) => {
                how.path = "shared";
                return check_answer(&answer, set);
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
            Err(s) => return Err(refusal(s)),
        }
    }
    let answer = weights::push(&mut client, set, token, CHUNK_BYTES)
        .await
        .map_err(refusal)?;
    check_answer(&answer, set)
}

/// A push answered: the worker must now report the pushed version.
fn check_answer(
    answer: &rookworld_proto::rollout::v1::UpdateWeightsResponse,
    set: &WeightSet,
) -> Result<(), PushError> {
    if answer.version != set.version {
        return Err(PushError {
            unreachable: false,
            why: format!("worker reports version {} after the push", answer.version),
        });
    }
    Ok(())
}

/// The causes under an error (tonic's transport error says only "transport error").
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push(c.to_string());
        cause = c.source();
    }
    out.join(": ")
}

/// Tells the queue whether the worker at `o.worker` can be reached for pushes: the first
/// time it cannot, one ERROR naming the address and `--advertise`; the queue then answers
/// that worker's leases with the same text until a push reaches it.
pub(super) async fn note_reachability(queue: &QueueHandle, o: PushOutcome) {
    queue.run(move |q| note(q, &o)).await;
}

fn note(q: &mut Queue, o: &PushOutcome) {
    if o.unreachable {
        let problem = format!(
            "the learner cannot reach {} for weight pushes ({}); start the worker with --advertise URL (ROLLOUT_ADVERTISE) at which the learner reaches its service",
            o.worker,
            o.error.as_deref().unwrap_or("no answer")
        );
        if q.set_push_problem(&o.worker, Some(problem.clone())) {
            tracing::error!("{problem}");
        }
    } else if o.error.is_none() {
        q.set_push_problem(&o.worker, None);
    }
}
