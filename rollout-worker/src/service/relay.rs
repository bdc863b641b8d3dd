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

use std::time::{Duration, Instant};

use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_service::probe::cause_chain;
use rookworld_service::tls::ClientTlsArgs;
use rookworld_weights::relay::{child_deadline, tree};
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

/// Chunks a child may lag behind before the relay waits for it.
const QUEUE_CHUNKS: usize = 16;

/// The pushes to a relay's children, under way.
pub(super) struct Relay {
    children: Vec<Child>,
    stall: Duration,
}

struct Child {
    address: String,
    subtree: Vec<String>,
    /// `None` once the stream to it has ended or been cut off.
    tx: Option<mpsc::Sender<pb::WeightChunk>>,
    task: JoinHandle<Result<pb::UpdateWeightsResponse, String>>,
    /// Why it was cut off, when it was.
    cut: Option<String>,
    started: Instant,
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
    /// with `token`, within what is left of this worker's own deadline.
    pub fn start(first: &pb::WeightChunk, token: Option<&str>, cfg: &RelayConfig) -> Option<Relay> {
        let h = first.header.as_ref()?;
        if h.relay_to.is_empty() {
            return None;
        }
        let own = match h.deadline_ms {
            0 => cfg.deadline,
            ms => Duration::from_millis(ms),
        };
        let deadline = child_deadline(own);
        let children = tree(&h.relay_to, h.relay_fanout as usize)
            .into_iter()
            .map(|(address, subtree)| {
                let mut header = h.clone();
                header.relay_to.clone_from(&subtree);
                header.deadline_ms = deadline.as_millis() as u64;
                let first = pb::WeightChunk {
                    header: Some(header),
                    offset: first.offset,
                    data: first.data.clone(),
                };
                let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
                let push = push_child(
                    address.clone(),
                    (first, rx),
                    token.unwrap_or_default().to_owned(),
                    cfg.tls.clone(),
                    deadline,
                );
                Child {
                    address,
                    subtree,
                    tx: Some(tx),
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

    /// Passes `chunk` on to every child still fed; one that takes nothing for the stall
    /// limit is cut off (its push aborted: it keeps its weights).
    pub async fn forward(&mut self, chunk: &pb::WeightChunk) {
        let stall = self.stall;
        for c in &mut self.children {
            let Some(tx) = &c.tx else { continue };
            match tokio::time::timeout(stall, tx.send(chunk.clone())).await {
                Ok(Ok(())) => {}
                // Its push ended (it failed): the answer says why.
                Ok(Err(_)) => c.tx = None,
                Err(_) => {
                    let why = format!("took no chunk for {stall:?}: cut off");
                    tracing::warn!(child = %c.address, below = c.subtree.len(), "a relayed push stalls; {why}, and its workers are left to the sender");
                    c.task.abort();
                    c.tx = None;
                    c.cut = Some(why);
                }
            }
        }
    }

    /// Ends the children's streams, waits for their answers (each within its deadline)
    /// and lists how every worker of the tree fared.
    pub async fn finish(mut self) -> Vec<pb::RelayedPush> {
        let mut out = Vec::with_capacity(self.workers());
        for c in &mut self.children {
            c.tx = None;
            let answer = match c.cut.take() {
                Some(why) => Err(why),
                None => (&mut c.task)
                    .await
                    .unwrap_or_else(|e| Err(format!("its push task ended: {e}"))),
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
    (first, rx): (pb::WeightChunk, mpsc::Receiver<pb::WeightChunk>),
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
        let chunks = tokio_stream::StreamExt::chain(
            tokio_stream::once(first),
            tokio_stream::wrappers::ReceiverStream::new(rx),
        );
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
