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

use std::time::{Duration, Instant};

use bytes::Bytes;
use rookworld_lm::Gpt2;
use rookworld_proto::rollout::v1 as pb;
use tokio_stream::StreamExt;
use tonic::Streaming;

use super::{RolloutServer, ServedModel};
use crate::engine::Retired;
use crate::error::ServiceError;
use rookworld_weights::set::{self as weights, Assembler, WeightError, WeightSet};

/// Where the payload's body is, once the header has been accepted.
enum Body {
    /// Streamed in full.
    Streamed(Box<Assembler>),
    /// A file in the shared directory, named by this header.
    Shared(pb::WeightSetHeader),
}

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
        let _one_at_a_time = self.updating.lock().await;
        let started = Instant::now();
        let status = self.engine.status();
        let (current, current_run) = (status.weight_version, status.weight_run);
        // A payload may be somewhat larger than bf16 weights (header, an untied head).
        let expected = self.model.config.num_parameters() * 2;
        let buffer = self.received.lock().expect("buffer lock").take();
        let mut assembler =
            Assembler::with_buffer(expected * 2 + (1 << 20), buffer.unwrap_or_default());
        let mut shared = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|s| stream_error(&s, assembler.received()))?;
            let first = assembler.header().is_none();
            assembler.push(chunk)?;
            if first {
                // The header decides before the body is sent: a stale version is refused,
                // and a retry of a push that landed (its answer was lost) is answered.
                let h = assembler.header().expect("the first chunk's header");
                if h.version == current && h.run_id == current_run {
                    tracing::debug!(version = current, "weights already in use; nothing to swap");
                    return Ok(pb::UpdateWeightsResponse {
                        version: current,
                        bytes: assembler.received() as u64,
                        seconds: started.elapsed().as_secs_f64(),
                        ..Default::default()
                    });
                }
                weights::supersedes(&h.run_id, h.version, &current_run, current)?;
                if !h.shared_file.is_empty() {
                    // The same-host path: the body is a file here, not the stream.
                    shared = Some(h.clone());
                    break;
                }
            }
        }
        let body = match shared {
            Some(h) => Body::Shared(h),
            None => Body::Streamed(Box::new(assembler)),
        };
        let (built, bytes, received) = self.build(body, started).await?;
        let (version, run) = (built.set.version, built.set.run_id.clone());
        let ready = started.elapsed();
        let retired = self.engine.swap(built.model, version, &run).await?;
        self.keep_spare(retired);
        if let Ok(streamed) = built.set.bytes.try_into_mut() {
            // The next stream lands in this memory (a mapped file is not kept).
            *self.received.lock().expect("buffer lock") = Some(streamed.into());
        }
        let seconds = started.elapsed().as_secs_f64();
        if run != current_run {
            tracing::info!(run = %run, previous_run = %current_run, previous_version = current, "weights of a new run replace the previous run's");
        }
        tracing::debug!(
            version,
            bytes,
            seconds = format!("{seconds:.3}"),
            "weights updated"
        );
        Ok(pb::UpdateWeightsResponse {
            version,
            bytes: bytes as u64,
            seconds,
            receive_seconds: received.as_secs_f64(),
            verify_seconds: built.verify.as_secs_f64(),
            convert_seconds: built.convert.as_secs_f64(),
            swap_seconds: (started.elapsed() - ready).as_secs_f64(),
        })
    }

    /// The verified model of `body`, its size and when it had arrived. A streamed body
    /// was hashed as it came; a shared file is hashed while the model is built (two
    /// cores at once; a payload that fails the check is never swapped in).
    async fn build(
        &self,
        body: Body,
        started: Instant,
    ) -> Result<(Built, usize, Duration), ServiceError> {
        let target = self.model.clone();
        let spare = self.spare.lock().expect("spare lock").take();
        let (built, bytes, received) = match body {
            Body::Streamed(assembler) => {
                let (bytes, received) = (assembler.received(), started.elapsed());
                let set = assembler.finish()?;
                let built = blocking(move || {
                    let (model, convert) = target.build(&set.bytes, spare);
                    Ok(Built {
                        model: model?,
                        set,
                        verify: Duration::ZERO,
                        convert,
                    })
                });
                (built.await?, bytes, received)
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
                let checked =
                    blocking(move || Ok(verify_while_building(&target, h, payload, spare)));
                let (built, unverified) = checked.await?;
                if let Some(model) = unverified {
                    // Its memory still serves the next version.
                    *self.spare.lock().expect("spare lock") = Some(model);
                }
                (built?, bytes, received)
            }
        };
        Ok((built, bytes, received))
    }

    /// Keeps a model the engine retired as the memory of the next version, if this
    /// service built it (not the model the worker started with) and it can be refilled.
    fn keep_spare(&self, retired: Option<Retired>) {
        let Some(r) = retired else { return };
        let initial = (r.version == self.initial.1) && (r.run == self.initial.0);
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
