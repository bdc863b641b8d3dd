//! A worker as a relay: the weight stream it receives is forwarded, chunk by chunk as it
//! arrives, to the children its header names ([`rookworld_weights::relay`]), each of which
//! checks the payload itself and may forward it further.
//!
//! Each child is a push of its own: a task streaming from a short queue, bounded by the
//! child's deadline (less than this worker's, so that it can answer its own sender in
//! time). A child that fails, or takes no chunk for the stall limit, is cut off with its
//! subtree, and the rest go on: one slow worker never holds up the stream. The relay
//! answers once every child has, listing how each worker of its tree fared; a worker it
//! never heard from is listed as not reached, and its sender serves it another way.
//!
//! A worker that holds the payload of the version it runs (it was streamed it) also sends
//! it to workers that join, as the root of such a tree (`SendWeights`): the learner's link
//! carries nothing for them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_service::probe::cause_chain;
use rookworld_service::tls::ClientTlsArgs;
use rookworld_weights::relay::{Route, child_deadline, tree};
use rookworld_weights::set::{CHUNK_BYTES, WeightSet};

use super::{Held, RolloutServer};
use crate::error::ServiceError;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How a worker relays pushes to other workers.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// TLS towards `https://` children.
    pub tls: ClientTlsArgs,
    /// A child that takes no chunk for this long is cut off.
    pub stall: Duration,
    /// A child's deadline when the sender gave none.
    pub deadline: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            tls: ClientTlsArgs::default(),
            stall: rookworld_weights::relay::STALL,
            deadline: Duration::from_secs(60),
        }
    }
}

/// The pushes to a relay's children, under way.
pub(super) struct Relay {
    children: Vec<Child>,
    stall: Duration,
}

/// One child's push. Its queue is unbounded so that the relay's own read never waits on a
/// child (what it holds is slices of the chunks this worker received, shared by every
/// child: at most one payload however many children lag); a child that leaves chunks
/// queued and takes none for the stall limit is cut off instead.
struct Child {
    address: String,
    subtree: Vec<String>,
    /// `None` once the stream to it has ended or been cut off.
    tx: Option<mpsc::UnboundedSender<pb::WeightChunk>>,
    /// Chunks queued and taken, and when it last took one.
    progress: Arc<Progress>,
    task: JoinHandle<Result<pb::UpdateWeightsResponse, String>>,
    /// Why it was cut off, when it was.
    cut: Option<String>,
    started: Instant,
}

#[derive(Default)]
struct Progress {
    queued: AtomicUsize,
    taken: AtomicUsize,
    last: std::sync::Mutex<Option<Instant>>,
}

impl Progress {
    /// Whether chunks wait and none was taken for `stall`.
    fn stalled(&self, stall: Duration, since: Instant) -> bool {
        let waiting = self.queued.load(Ordering::Acquire) > self.taken.load(Ordering::Acquire);
        let last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        waiting && last.unwrap_or(since).elapsed() > stall
    }
}

impl Drop for Relay {
    /// A relay dropped before [`Relay::finish`] (its own stream failed) stops feeding its
    /// children: their streams break off, and they keep their weights.
    fn drop(&mut self) {
        for c in &self.children {
            c.task.abort();
        }
    }
}

impl Relay {
    /// Starts a push to each child `first`'s header names (`None` when it names none),
    /// with `token`, within what is left at `arrived` of this worker's own deadline.
    pub fn start(
        first: &pb::WeightChunk,
        token: Option<&str>,
        cfg: &RelayConfig,
        arrived: Instant,
    ) -> Option<Relay> {
        let h = first.header.as_ref()?;
        if h.relay_to.is_empty() {
            return None;
        }
        let own = match h.deadline_ms {
            0 => cfg.deadline,
            ms => Duration::from_millis(ms),
        };
        let left = own.saturating_sub(arrived.elapsed());
        let deadline = child_deadline(left).max(Duration::from_millis(1));
        let children = tree(&h.relay_to, h.relay_fanout as usize)
            .into_iter()
            .map(|(address, subtree)| {
                let mut header = h.clone();
                header.relay_to.clone_from(&subtree);
                header.deadline_ms = deadline.as_millis().max(1) as u64;
                let first = pb::WeightChunk {
                    header: Some(header),
                    offset: first.offset,
                    data: first.data.clone(),
                };
                let (tx, rx) = mpsc::unbounded_channel();
                let progress = Arc::new(Progress::default());
                let push = push_child(
                    address.clone(),
                    (first, rx, progress.clone()),
                    token.unwrap_or_default().to_owned(),
                    cfg.tls.clone(),
                    deadline,
                );
                Child {
                    address,
                    subtree,
                    tx: Some(tx),
                    progress,
                    task: tokio::spawn(push),
                    cut: None,
                    started: Instant::now(),
                }
            })
            .collect();
        Some(Relay {
            children,
            stall: cfg.stall,
        })
    }

    /// Every worker below this relay.
    pub fn workers(&self) -> usize {
        self.children.iter().map(|c| 1 + c.subtree.len()).sum()
    }

    /// Queues `chunk` for every child still fed, without waiting for any; one that has
    /// taken nothing for the stall limit while chunks waited is cut off (its push
    /// aborted: it keeps its weights).
    pub fn forward(&mut self, chunk: &pb::WeightChunk) {
        for c in &mut self.children {
            let Some(tx) = &c.tx else { continue };
            if tx.send(chunk.clone()).is_err() {
                // Its push ended (it failed): the answer says why.
                c.tx = None;
                continue;
            }
            c.progress.queued.fetch_add(1, Ordering::AcqRel);
            c.cut_if_stalled(self.stall);
        }
    }

    /// Ends the children's streams (every chunk has been queued): each answers once it has
    /// checked and swapped in what it got.
    pub fn close(&mut self) {
        for c in &mut self.children {
            c.tx = None;
        }
    }

    /// Ends the children's streams, waits for their answers (each within its deadline,
    /// and cut off if it stalls meanwhile) and lists how every worker of the tree fared.
    pub async fn finish(mut self) -> Vec<pb::RelayedPush> {
        self.close();
        let mut out = Vec::with_capacity(self.workers());
        let stall = self.stall;
        for c in &mut self.children {
            let answer = loop {
                if let Some(why) = c.cut.take() {
                    break Err(why);
                }
                let tick = tokio::time::sleep(stall / 4);
                tokio::select! {
                    done = &mut c.task => {
                        break done.unwrap_or_else(|e| Err(format!("its push task ended: {e}")));
                    }
                    _ = tick => c.cut_if_stalled(stall),
                }
            };
            let seconds = c.started.elapsed().as_secs_f64();
            match answer {
                Ok(a) => {
                    out.push(pb::RelayedPush {
                        worker: c.address.clone(),
                        error: String::new(),
                        seconds,
                        bytes: a.bytes,
                        receive_seconds: a.receive_seconds,
                        verify_seconds: a.verify_seconds,
                        received_unix_ns: a.received_unix_ns,
                        in_use_unix_ns: a.in_use_unix_ns,
                    });
                    let why = format!("not reached: its relay {} did not list it", c.address);
                    let missing: Vec<_> = (c.subtree.iter())
                        .filter(|w| !a.relayed.iter().any(|r| &r.worker == *w))
                        .map(|w| unreached(w, &why))
                        .collect();
                    out.extend(a.relayed);
                    out.extend(missing);
                }
                Err(why) => {
                    tracing::info!(child = %c.address, below = c.subtree.len(), error = %why, "a relayed push failed; its workers are left to the sender");
                    out.push(pb::RelayedPush {
                        worker: c.address.clone(),
                        error: why.clone(),
                        seconds,
                        ..Default::default()
                    });
                    let why = format!("not reached: its relay {} failed: {why}", c.address);
                    out.extend(c.subtree.iter().map(|w| unreached(w, &why)));
                }
            }
        }
        out
    }
}

impl Child {
    fn cut_if_stalled(&mut self, stall: Duration) {
        if self.cut.is_none() && self.progress.stalled(stall, self.started) {
            let why = format!("took no chunk for {stall:?}: cut off");
            tracing::warn!(child = %self.address, below = self.subtree.len(), "a relayed push stalls; {why}, and its workers are left to the sender");
            self.task.abort();
            self.tx = None;
            self.cut = Some(why);
        }
    }
}

fn unreached(worker: &str, why: &str) -> pb::RelayedPush {
    pb::RelayedPush {
        worker: worker.to_owned(),
        error: why.to_owned(),
        ..Default::default()
    }
}

/// One child's push: `first`, then what the relay queues, within `deadline`.
async fn push_child(
    address: String,
    (first, rx, progress): (
        pb::WeightChunk,
        mpsc::UnboundedReceiver<pb::WeightChunk>,
        Arc<Progress>,
    ),
    token: String,
    tls: ClientTlsArgs,
    deadline: Duration,
) -> Result<pb::UpdateWeightsResponse, String> {
    let push = async {
        let endpoint = (tls.endpoint(&address)).map_err(|e| format!("bad address: {e}"))?;
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| format!("connect: {}", rookworld_service::probe::error_chain(&e)))?;
        let queued = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            move |chunk| {
                progress.taken.fetch_add(1, Ordering::AcqRel);
                *progress.last.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Instant::now());
                chunk
            },
        );
        let chunks = tokio_stream::StreamExt::chain(tokio_stream::once(first), queued);
        let mut request = tonic::Request::new(chunks);
        rookworld_service::auth::set_token(request.metadata_mut(), &token)
            .map_err(|s| s.message().to_owned())?;
        RolloutServiceClient::new(channel)
            .update_weights(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| format!("{:?}: {}", s.code(), cause_chain(&s)))
    };
    tokio::time::timeout(deadline, push)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {deadline:?}")))
}

impl RolloutServer {
    /// Sends the held payload of the version in use to the workers `r` names, as the root
    /// of their tree, and lists how each fared. Weight updates wait meanwhile (the payload
    /// is the buffer the next one would land in).
    pub(super) async fn send_held(
        &self,
        r: pb::SendWeightsRequest,
    ) -> Result<pb::UpdateWeightsResponse, ServiceError> {
        let started = Instant::now();
        if r.relay_to.is_empty() {
            return Err(ServiceError::InvalidArgument(
                "relay_to names no worker to send to".into(),
            ));
        }
        let _one_at_a_time = self.updating.lock().await;
        let status = self.engine.status();
        let held = std::mem::take(&mut *self.received.lock().expect("buffer lock"));
        let holds = held.of.clone();
        let (version, run) = status.held();
        let runs = (run, version);
        if holds.as_ref().map(|(run, v)| (run.as_str(), *v)) != Some((&r.run_id, r.version))
            || runs != (r.run_id.as_str(), r.version)
        {
            let what = match &holds {
                Some((run, v)) => format!("the payload of version {v} of run `{run}`"),
                None => "no streamed payload of the version in use".into(),
            };
            *self.received.lock().expect("buffer lock") = held;
            return Err(ServiceError::NothingToSend(format!(
                "asked for version {} of run `{}`; this worker runs version {} of run `{}` and holds {what}",
                r.version, r.run_id, runs.1, runs.0
            )));
        }
        let set = WeightSet {
            run_id: r.run_id.clone(),
            version: r.version,
            bytes: held.bytes.into(),
            blake3: held.blake3,
            shared_file: None,
        };
        let route = Route {
            relay_to: r.relay_to,
            fanout: r.relay_fanout,
            deadline: (r.deadline_ms > 0).then(|| Duration::from_millis(r.deadline_ms)),
            ..Route::default()
        };
        let mut chunks = route.apply(set.chunks(CHUNK_BYTES));
        let first = chunks.next().expect("a first chunk");
        let token = self.guard.token();
        let mut relay =
            Relay::start(&first, token, &self.cfg.relay, started).expect("workers named");
        // The header is the children's own; this worker only feeds them.
        for chunk in chunks.by_ref() {
            relay.forward(&chunk);
        }
        let relayed = relay.finish().await;
        drop((chunks, first)); // their slices of the payload
        // The payload stays the next stream's memory and the next delta's base.
        let bytes = set.bytes.len();
        let memory = match set.bytes.try_into_mut() {
            Ok(unique) => unique.into(),
            Err(shared) => shared.to_vec(),
        };
        *self.received.lock().expect("buffer lock") = Held {
            bytes: memory,
            of: holds,
            blake3: set.blake3,
        };
        Ok(pb::UpdateWeightsResponse {
            version: r.version,
            bytes: bytes as u64,
            seconds: started.elapsed().as_secs_f64(),
            relayed,
            in_use: status.staged.is_none(),
            ..Default::default()
        })
    }
}
