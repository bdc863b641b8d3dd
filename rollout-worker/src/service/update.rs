//! One weight update: the payload received (streamed, or a same-host file mapped), its
//! checksum verified, the model built — into the memory of the model the last update
//! retired, when there is one — and swapped in at a decode step boundary.
//!
//! Built fresh, a gpt2-124m CPU model is about 1 GB of new memory per version, every
//! page faulted in and zeroed first; a retired model's memory is already there. So the
//! service keeps the model each swap retires (only models it built itself: the model
//! the worker started with may share tensors with its caller) and writes the next
//! version over it. A CPU worker thus holds two models' memory at rest, as every update
//! already did while it ran. A GPU worker's model is one device buffer that every weight
//! is a view of; with the trial `weights_in_place` on (`ROOKWORLD_ENABLE_KERNELS`) the
//! next version is copied into the retired one's buffer from page-locked memory in one
//! transfer (`rookworld_weights::refill`), else each version is built afresh. The buffer
//! a streamed payload arrived in is kept for the next stream likewise.
//!
//! That buffer is also the base of deltas ([`rookworld_weights::delta`]): while it holds
//! the payload of the version in use (one streamed, or made from a delta), a push may send
//! only what changed since. The delta is applied to the buffer in place and the result
//! checked against the header's hash, so a delta costs no second payload's memory; a
//! worker without that base, or whose result fails the check, keeps its weights and
//! answers FAILED_PRECONDITION (one log line says why), and the learner streams the whole
//! payload instead.
//!
//! An update answers once its version is in use, or — when the header asks
//! (`answer_when_staged`) — once it is staged with the engine, which swaps it in at its
//! next step boundary (under `drain`, after the sequences in flight). The staged
//! version's ticket is kept ([`Pending`]). A newer update that finds it still staged takes
//! it back from the engine ([`Engine::reclaim`](crate::engine::Engine::reclaim)) and is
//! built into its memory, staged in its place: the drain under way is not waited for
//! twice, the worker never holds more than two models, and the sender's push no longer
//! includes the engine's wait. The staged version is taken back only once the newer
//! payload has been checked (a streamed one, or a delta applied, against its hash; a
//! same-host file's hash runs beside the build, so a file that fails it then leaves the
//! engine on the version in use, as does a build that fails).

use std::time::{Duration, Instant};

use bytes::Bytes;
use rookworld_lm::Gpt2;
use rookworld_proto::rollout::v1 as pb;
use tokio_stream::StreamExt;
use tonic::Streaming;

use super::relay::Relay;
use super::{Held, Pending, RolloutServer, ServedModel};
use crate::engine::Retired;
use crate::error::ServiceError;
use rookworld_weights::set::{self as weights, Assembler, Received, WeightError, WeightSet};

/// Where the payload's body is, once the header has been accepted.
enum Body {
    /// Streamed: the payload, or a delta against the held one.
    Streamed(Box<Assembler>),
    /// A file in the shared directory, named by this header.
    Shared(pb::WeightSetHeader),
}

/// A payload received and, where that needs no model memory, checked: a streamed one
/// (or a delta applied) against its hash; a same-host file read (its hash runs beside the
/// build).
enum Checked {
    Set {
        set: WeightSet,
        verify: Duration,
    },
    Shared {
        h: pb::WeightSetHeader,
        payload: Bytes,
    },
}

/// The longest an update waits for the version staged before it to go into use (a drain
/// ends within one completion's decode; this bounds a stuck engine).
const LANDING_LIMIT: Duration = Duration::from_secs(120);

/// A verified payload's model and how long the steps took.
struct Built {
    set: WeightSet,
    model: Gpt2,
    verify: Duration,
    convert: Duration,
}

impl RolloutServer {
    /// Receives, checks, builds and swaps in one weight set (one update at a time).
    pub(super) async fn receive_weights(
        &self,
        mut stream: Streaming<pb::WeightChunk>,
    ) -> Result<pb::UpdateWeightsResponse, ServiceError> {
        let arrived = Instant::now();
        let mut pending = self.updating.lock().await;
        let started = Instant::now();
        let started_wall = std::time::SystemTime::now();
        if let Some(p) = pending.as_mut()
            && let Some(landed) = p.ticket.try_landed()
        {
            *pending = None;
            self.keep_spare(landed?);
        }
        let status = self.engine.status();
        // The newest version held: a staged one counts.
        let (current, current_run) = {
            let (version, run) = status.held();
            (version, run.to_owned())
        };
        // A payload may be somewhat larger than bf16 weights (header, an untied head).
        let max_bytes = self.model.config.num_parameters() * 4 + (1 << 20);
        let Some(first) = stream.next().await else {
            return Err(WeightError::Malformed("empty stream: no chunks".into()).into());
        };
        let first = first.map_err(|s| stream_error(&s, 0))?;
        let Some(h) = first.header.clone() else {
            return Err(WeightError::Malformed("the first chunk carries no header".into()).into());
        };
        // The header decides before the body is sent: a retry of a push that landed (its
        // answer was lost) is answered, a stale version is refused, and a delta needs its
        // base here.
        if !h.relay_to.is_empty() && !h.shared_file.is_empty() {
            return Err(WeightError::Malformed(
                "relay_to with shared_file: a same-host push is not relayed".into(),
            )
            .into());
        }
        if h.version == current && h.run_id == current_run {
            tracing::debug!(version = current, "weights already held; nothing to swap");
            // A relay still passes the stream on to the workers below it.
            let relayed = match Relay::start(&first, self.guard.token(), &self.cfg.relay, arrived) {
                Some(relay) => self.relay_only(relay, &first, stream).await?,
                None => Vec::new(),
            };
            // Staged by an update answered before it went into use: a sender that asks for
            // the version in use waits for it.
            let mut in_use = status.staged.is_none();
            if !in_use && !h.answer_when_staged && pending.is_some() {
                self.land(&mut pending).await?;
                in_use = true;
            }
            return Ok(pb::UpdateWeightsResponse {
                version: current,
                bytes: first.data.len() as u64,
                seconds: started.elapsed().as_secs_f64(),
                relayed,
                in_use,
                ..Default::default()
            });
        }
        weights::supersedes(&h.run_id, h.version, &current_run, current)?;
        if weights::is_delta(&h) {
            self.check_base(&h)?;
        }
        // The version and the delta's base are checked: the children are fed from here on.
        // (The header's form is checked with the first chunk below, after they started;
        // each child checks it again itself.)
        let mut relay = Relay::start(&first, self.guard.token(), &self.cfg.relay, arrived);
        let whole_payload = h.shared_file.is_empty() && !weights::is_delta(&h);
        let (answer_when_staged, h_version) = (h.answer_when_staged, h.version);
        let mut assembler = if whole_payload {
            // The payload lands in the last one's memory.
            let held = std::mem::take(&mut *self.received.lock().expect("buffer lock"));
            Assembler::with_buffer(max_bytes, held.bytes)
        } else {
            Assembler::new(max_bytes)
        };
        assembler.push(first)?;
        let body = if !h.shared_file.is_empty() {
            // The same-host path: the body is a file here, not the stream.
            Body::Shared(h)
        } else {
            while let Some(chunk) = next_chunk(&mut stream, assembler.received()).await? {
                if let Some(relay) = relay.as_mut() {
                    relay.forward(&chunk);
                }
                assembler.push(chunk)?;
            }
            // The children have it all: they check and swap while this worker does.
            if let Some(relay) = relay.as_mut() {
                relay.close();
            }
            Body::Streamed(Box::new(assembler))
        };
        let (checked, bytes, received) = self.check(body, started).await?;
        // A version staged before this one and not yet in use is taken back — only now,
        // with this payload checked — and this one goes in its place (the engine stays
        // held meanwhile, as for it), built into its memory. One that went into use
        // meanwhile retired the model before it instead. Either lands within the engine's
        // step in flight.
        let landing_clock = Instant::now();
        let mut reclaimed = None;
        if let Some(staged) = pending.as_ref().map(|p| p.version) {
            reclaimed = Some(self.engine.reclaim(staged)?);
            if self.land(&mut pending).await? == Some(staged) {
                tracing::debug!(
                    version = staged,
                    by = h_version,
                    "a staged version is replaced before it went into use"
                );
            }
        }
        let landing = landing_clock.elapsed();
        let built = self.build(checked).await?;
        let (version, run) = (built.set.version, built.set.run_id.clone());
        let ready = started.elapsed();
        let ticket = match reclaimed {
            Some(reclaimed) => {
                self.engine
                    .stage_reclaimed(reclaimed, built.model, version, &run)?
            }
            None => self.engine.stage(built.model, version, &run)?,
        };
        // Kept before any wait: an update cancelled while it waits leaves its version
        // for the next to take back.
        *pending = Some(Pending { version, ticket });
        if !answer_when_staged {
            self.land(&mut pending).await?;
        }
        let in_use = !answer_when_staged;
        if let Ok(streamed) = built.set.bytes.try_into_mut() {
            // The next stream lands in this memory (a mapped file is not kept), and the
            // next delta is made against it.
            *self.received.lock().expect("buffer lock") = Held {
                bytes: streamed.into(),
                of: Some((run.clone(), version)),
                blake3: built.set.blake3,
            };
        }
        let swapped = started.elapsed();
        let relayed = match relay {
            Some(relay) => relay.finish().await,
            None => Vec::new(),
        };
        let seconds = started.elapsed().as_secs_f64();
        if run != current_run {
            tracing::info!(run = %run, previous_run = %current_run, previous_version = current, "weights of a new run replace the previous run's");
        }
        let swap = if in_use {
            swapped - ready
        } else {
            Duration::ZERO
        };
        tracing::debug!(
            version,
            bytes,
            seconds = format!("{seconds:.3}"),
            landing = format!("{:.3}", landing.as_secs_f64()),
            received = format!("{:.3}", received.as_secs_f64()),
            verify = format!("{:.3}", built.verify.as_secs_f64()),
            convert = format!("{:.3}", built.convert.as_secs_f64()),
            swap = if in_use {
                format!("{:.3}", swap.as_secs_f64())
            } else {
                "staged".into()
            },
            "weights updated"
        );
        Ok(pb::UpdateWeightsResponse {
            version,
            bytes: bytes as u64,
            seconds,
            receive_seconds: received.as_secs_f64(),
            verify_seconds: built.verify.as_secs_f64(),
            convert_seconds: built.convert.as_secs_f64(),
            swap_seconds: swap.as_secs_f64(),
            relayed,
            received_unix_ns: unix_ns(started_wall + received),
            in_use_unix_ns: if in_use {
                unix_ns(started_wall + swapped)
            } else {
                0
            },
            in_use,
        })
    }

    /// Passes a stream this worker needs nothing of (it runs that version) on to the
    /// workers below it, and lists how they fared.
    async fn relay_only(
        &self,
        mut relay: Relay,
        first: &pb::WeightChunk,
        mut stream: Streaming<pb::WeightChunk>,
    ) -> Result<Vec<pb::RelayedPush>, ServiceError> {
        let mut received = first.data.len();
        while let Some(chunk) = next_chunk(&mut stream, received).await? {
            received += chunk.data.len();
            relay.forward(&chunk);
        }
        Ok(relay.finish().await)
    }

    /// Takes the body in: a streamed payload (or a delta applied to the held one) checked
    /// against its hash; a same-host file read. The payload's bytes and when it was in.
    async fn check(
        &self,
        body: Body,
        started: Instant,
    ) -> Result<(Checked, usize, Duration), ServiceError> {
        Ok(match body {
            Body::Streamed(assembler) => {
                let (bytes, received) = (assembler.received(), started.elapsed());
                let (set, verify) = match assembler.finish()? {
                    Received::Payload(set) => (set, Duration::ZERO),
                    Received::Delta { header, delta } => self.apply_delta(header, delta).await?,
                };
                (Checked::Set { set, verify }, bytes, received)
            }
            Body::Shared(h) => {
                let dir = self.cfg.shared_dir.clone().ok_or_else(|| {
                    WeightError::Shared(
                        "this worker has no shared directory (--shared-dir, ROLLOUT_SHARED_DIR)"
                            .into(),
                    )
                })?;
                let read = {
                    let h = h.clone();
                    blocking(move || weights::read_shared(&dir, &h))
                };
                let payload = read.await?;
                let (bytes, received) = (payload.len(), started.elapsed());
                (Checked::Shared { h, payload }, bytes, received)
            }
        })
    }

    /// Builds the checked payload's model, into the spare model's memory when there is
    /// one (a same-host file's hash is checked beside it, on the same cores at once).
    async fn build(&self, checked: Checked) -> Result<Built, ServiceError> {
        let target = self.model.clone();
        let spare = self.spare.lock().expect("spare lock").take();
        match checked {
            Checked::Set { set, verify } => {
                blocking(move || {
                    let (model, convert) = target.build(&set.bytes, spare);
                    Ok(Built {
                        model: model?,
                        set,
                        verify,
                        convert,
                    })
                })
                .await
            }
            Checked::Shared { h, payload } => {
                let checked =
                    blocking(move || Ok(verify_while_building(&target, h, payload, spare)));
                let (built, unverified) = checked.await?;
                if let Some(model) = unverified {
                    // Its memory still serves the next version.
                    *self.spare.lock().expect("spare lock") = Some(model);
                }
                Ok(built?)
            }
        }
    }

    /// Refuses a delta whose base this worker does not hold.
    fn check_base(&self, h: &pb::WeightSetHeader) -> Result<(), WeightError> {
        let held = self.received.lock().expect("buffer lock");
        if held.is(&h.run_id, h.base_version, h.total_bytes) {
            return Ok(());
        }
        let holds = match &held.of {
            Some((run, version)) => format!("the payload of version {version} of run `{run}`"),
            None => "no streamed payload of the version in use".into(),
        };
        Err(WeightError::DeltaBase(format!(
            "a delta against version {} of run `{}`, and this worker holds {holds}",
            h.base_version, h.run_id
        )))
    }

    /// The payload `delta` makes of the held one (in its memory), its hash checked, and
    /// how long that took. On a result that fails the check the held memory serves the
    /// next stream, no longer as a base.
    async fn apply_delta(
        &self,
        header: pb::WeightSetHeader,
        delta: Vec<u8>,
    ) -> Result<(WeightSet, Duration), ServiceError> {
        let held = std::mem::take(&mut *self.received.lock().expect("buffer lock"));
        let clock = Instant::now();
        let applied =
            tokio::task::spawn_blocking(move || weights::apply_delta(held.bytes, header, &delta))
                .await
                .map_err(|e| {
                    ServiceError::Internal(format!("applying a weight delta panicked: {e}"))
                })?;
        match applied {
            Ok(set) => Ok((set, clock.elapsed())),
            Err((e, memory)) => {
                *self.received.lock().expect("buffer lock") = Held {
                    bytes: memory,
                    ..Held::default()
                };
                Err(e.into())
            }
        }
    }

    /// Waits (up to [`LANDING_LIMIT`]) for the pending staged version, if any, to land —
    /// in use, or taken back — and keeps the model that left as the next version's
    /// memory; the version that model held. The slot is cleared only once it has landed
    /// (a wait cut short leaves it for the next update).
    async fn land(&self, pending: &mut Option<Pending>) -> Result<Option<u64>, ServiceError> {
        let Some(p) = pending.as_mut() else {
            return Ok(None);
        };
        let retired = match tokio::time::timeout(LANDING_LIMIT, p.ticket.wait()).await {
            Ok(landed) => landed?,
            Err(_) => {
                return Err(ServiceError::Internal(format!(
                    "version {} staged before this update did not go into use within {}s",
                    p.version,
                    LANDING_LIMIT.as_secs()
                )));
            }
        };
        *pending = None;
        let version = retired.as_ref().map(|r| r.version);
        self.keep_spare(retired);
        Ok(version)
    }

    /// Keeps a model the engine retired as the memory of the next version, if this
    /// service built it (not the model the worker started with) and it can be refilled.
    fn keep_spare(&self, retired: Option<Retired>) {
        let Some(r) = retired else { return };
        let initial = self
            .initial
            .as_ref()
            .is_some_and(|(run, version)| r.version == *version && r.run == *run);
        if !initial && rookworld_weights::refill::refillable(&r.model) {
            *self.spare.lock().expect("spare lock") = Some(r.model);
        }
    }
}

/// A payload is built into the served model's shape, dtype, panels and device.
impl ServedModel {
    /// The model of verified `bytes`, into `spare`'s memory when it can take it.
    fn build(&self, bytes: &[u8], spare: Option<Gpt2>) -> (Result<Gpt2, WeightError>, Duration) {
        let clock = Instant::now();
        let model = weights::build_model(
            bytes,
            &self.config,
            (self.dtype, self.panels),
            (&self.device, &self.kernels),
            spare,
        );
        (model, clock.elapsed())
    }
}

/// Hashes the shared `payload` on its own thread while its model is built into `spare`.
/// Returns the model when the hash is the header's; else the error, and the model built
/// (its values not to be used, only its memory).
fn verify_while_building(
    target: &ServedModel,
    h: pb::WeightSetHeader,
    payload: Bytes,
    spare: Option<Gpt2>,
) -> (Result<Built, WeightError>, Option<Gpt2>) {
    std::thread::scope(|s| {
        let hashed = payload.clone();
        let hash = s.spawn(move || {
            let clock = Instant::now();
            (weights::verify_shared(h, hashed), clock.elapsed())
        });
        let (model, convert) = target.build(&payload, spare);
        let (set, verify) = hash.join().expect("hashing does not panic");
        match (set, model) {
            (Ok(set), Ok(model)) => (
                Ok(Built {
                    set,
                    model,
                    verify,
                    convert,
                }),
                None,
            ),
            (Err(e), Ok(model)) => (Err(e), Some(model)),
            (_, Err(e)) => (Err(e), None),
        }
    })
}

/// Runs `f` on tokio's blocking pool; a panic becomes an internal error.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, WeightError> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServiceError::Internal(format!("a weight update task panicked: {e}")))?
        .map_err(ServiceError::from)
}

/// The stream's next chunk; a sender that sends none for twice the stall limit
/// ([`rookworld_weights::relay::STALL`]) has stalled (a relay above that hangs), and the
/// update is given up (ABORTED) rather than hold the worker until the connection dies.
async fn next_chunk(
    stream: &mut Streaming<pb::WeightChunk>,
    received: usize,
) -> Result<Option<pb::WeightChunk>, ServiceError> {
    let limit = 2 * rookworld_weights::relay::STALL;
    match tokio::time::timeout(limit, stream.next()).await {
        Ok(Some(chunk)) => chunk.map(Some).map_err(|s| stream_error(&s, received)),
        Ok(None) => Ok(None),
        Err(_) => Err(ServiceError::Interrupted(format!(
            "after {received} bytes: the sender sent nothing for {limit:?}"
        ))),
    }
}

/// A failed read of the weight stream: a chunk that does not decode, or is past the message
/// limit, is the sender's malformed input (INVALID_ARGUMENT); anything else broke the
/// stream off (ABORTED: the sender may retry).
fn stream_error(s: &tonic::Status, received: usize) -> ServiceError {
    let malformed = s.code() == tonic::Code::OutOfRange
        || (s.code() == tonic::Code::Internal && s.message().contains("decode"));
    if malformed {
        ServiceError::InvalidArgument(format!(
            "a malformed chunk after {received} bytes: {}",
            s.message()
        ))
    } else {
        ServiceError::Interrupted(format!("after {received} bytes: {}", s.message()))
    }
}

/// Nanoseconds since the Unix epoch at `t` (0 before it).
fn unix_ns(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
