//! Relayed pushes: a weight stream that a worker forwards to other workers while it
//! receives it, so that the sender's egress per version does not grow with the workers.
//!
//! The sender names the tree in the first chunk's header: `relay_to`, the workers below
//! the one it calls, in order, and `relay_fanout`, how many children each relay feeds.
//! [`tree`] cuts the list into that many runs; the first worker of each run is a child,
//! the rest of the run the child's own `relay_to`. Both ends cut it with this one
//! function, so the learner knows every worker's parent without being told.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rookworld_proto::rollout::v1 as pb;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;

/// Where a streamed push goes beyond the worker it is sent to, and when the workers
/// answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The workers below, in tree order ([`tree`]); empty: none (a plain push).
    pub relay_to: Vec<String>,
    /// Children per relay (at least 1 when `relay_to` is not empty).
    pub fanout: u32,
    /// The time the worker has to answer, its tree included (`None`: not given).
    pub deadline: Option<Duration>,
    /// Each worker answers once the version is staged with its engine, not once it is in
    /// use (the header's `answer_when_staged`).
    pub answer_when_staged: bool,
}

impl Route {
    /// Writes the route into the first chunk's header.
    pub fn stamp(&self, h: &mut pb::WeightSetHeader) {
        h.relay_to.clone_from(&self.relay_to);
        h.relay_fanout = if self.relay_to.is_empty() {
            0
        } else {
            self.fanout.max(1)
        };
        h.deadline_ms = self.deadline.map_or(0, |d| d.as_millis().max(1) as u64);
        h.answer_when_staged = self.answer_when_staged;
    }

    /// `chunks` with the route in the first one's header.
    pub fn apply(
        self,
        chunks: impl Iterator<Item = pb::WeightChunk>,
    ) -> impl Iterator<Item = pb::WeightChunk> {
        chunks.map(move |mut c| {
            if let Some(h) = c.header.as_mut() {
                self.stamp(h);
            }
            c
        })
    }
}

/// The children of a relay whose header names `relay_to` with `fanout`: each child and
/// the workers below it. `relay_to` is cut into `fanout` runs of sizes differing by at
/// most one (longer runs first), in order; a run's first worker is the child.
///
/// ```text
/// tree([a b c d e f g], 2) = [(a, [b c d]), (e, [f g])]
/// ```
pub fn tree(relay_to: &[String], fanout: usize) -> Vec<(String, Vec<String>)> {
    let runs = fanout.max(1).min(relay_to.len());
    let mut out = Vec::with_capacity(runs);
    let mut rest = relay_to;
    for i in 0..runs {
        let len = rest.len().div_ceil(runs - i);
        let (run, after) = rest.split_at(len);
        out.push((run[0].clone(), run[1..].to_vec()));
        rest = after;
    }
    out
}

/// Every worker of the tree under a sender of `fanout` children that calls the roots of
/// `workers` ([`tree`] applied down to the leaves), with its parent (`None` for the
/// sender's own children).
pub fn parents(workers: &[String], fanout: usize) -> Vec<(String, Option<String>)> {
    let mut out = Vec::with_capacity(workers.len());
    let mut todo: Vec<(Option<String>, Vec<String>)> = vec![(None, workers.to_vec())];
    while let Some((parent, below)) = todo.pop() {
        for (child, subtree) in tree(&below, fanout) {
            out.push((child.clone(), parent.clone()));
            if !subtree.is_empty() {
                todo.push((Some(child), subtree));
            }
        }
    }
    out
}

/// How long a stream may take no chunk before its sender gives up on the receiver (a
/// relay on a child, the learner on a worker): the receiver stalls, and a deadline of a
/// minute is no reason to keep a tree of workers waiting. Above TCP's own pauses on a
/// lossy link (its retransmission timer doubles on each loss of the same segment: a link
/// dropping 5% of its packets each way paused a stream for up to 2.1 s in `learner
/// bench-fleet`'s lab), so that a slow, lossy link is no stall.
pub const STALL: Duration = Duration::from_secs(5);

/// Sends `chunks` (header first) with the shared `token` as [`crate::set::send`] does,
/// and gives up with DEADLINE_EXCEEDED ("took no chunk for …") when the receiver takes
/// none for `stall` before the last is taken. (Once every chunk is taken the answer is
/// bounded by the caller's deadline alone.)
pub async fn send_watched(
    client: &mut RolloutServiceClient<tonic::transport::Channel>,
    chunks: impl tokio_stream::Stream<Item = pb::WeightChunk> + Send + 'static,
    token: &str,
    stall: Duration,
) -> Result<pb::UpdateWeightsResponse, tonic::Status> {
    let progress = Arc::new(Progress {
        last: Mutex::new(Instant::now()),
        done: AtomicBool::new(false),
    });
    let watched = Watched {
        chunks: Box::pin(chunks),
        progress: progress.clone(),
    };
    let watch = async {
        loop {
            tokio::time::sleep(stall / 4).await;
            let last = *progress.last.lock().unwrap_or_else(PoisonError::into_inner);
            if !progress.done.load(Ordering::Relaxed) && last.elapsed() > stall {
                return tonic::Status::deadline_exceeded(format!(
                    "took no chunk for {stall:?}: the receiver stalls"
                ));
            }
        }
    };
    tokio::select! {
        // The send first: a sender that was itself held up (a busy machine) sees the
        // chunks taken meanwhile before it blames the receiver.
        biased;
        answer = crate::set::send(client, watched, token) => answer,
        stalled = watch => Err(stalled),
    }
}

/// When a watched stream last had a chunk taken, and whether it has no more.
struct Progress {
    last: Mutex<Instant>,
    done: AtomicBool,
}

struct Watched {
    chunks: std::pin::Pin<Box<dyn tokio_stream::Stream<Item = pb::WeightChunk> + Send>>,
    progress: Arc<Progress>,
}

impl tokio_stream::Stream for Watched {
    type Item = pb::WeightChunk;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<pb::WeightChunk>> {
        let std::task::Poll::Ready(next) = self.chunks.as_mut().poll_next(cx) else {
            // A stream made as it is sent (a delta) may have nothing yet; its maker's
            // pauses are far shorter than a stall.
            return std::task::Poll::Pending;
        };
        *self
            .progress
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        if next.is_none() {
            self.progress.done.store(true, Ordering::Relaxed);
        }
        std::task::Poll::Ready(next)
    }
}

/// The relay's deadline for a child: what is left of its own, less a margin (a tenth, at
/// least 100 ms) in which to collect the answers and answer its own sender.
pub fn child_deadline(left: Duration) -> Duration {
    let margin = (left / 10).max(Duration::from_millis(100));
    left.saturating_sub(margin)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_list_is_cut_into_fanout_runs_headed_by_the_children() {
        let t = tree(&names("a b c d e f g"), 2);
        assert_eq!(
            t,
            vec![("a".into(), names("b c d")), ("e".into(), names("f g"))]
        );
        // A chain: one child, the rest below it.
        assert_eq!(tree(&names("a b c"), 1), vec![("a".into(), names("b c"))]);
        // More branches than workers: each a leaf.
        assert_eq!(tree(&names("a b"), 4).len(), 2);
        assert!(tree(&[], 2).is_empty());
    }

    #[test]
    fn every_worker_has_one_parent_and_the_sender_feeds_fanout_of_them() {
        let workers: Vec<String> = (0..32).map(|i| format!("w{i}")).collect();
        for fanout in 1..=4 {
            let p = parents(&workers, fanout);
            assert_eq!(p.len(), 32, "fanout {fanout}");
            let direct = p.iter().filter(|(_, parent)| parent.is_none()).count();
            assert_eq!(direct, fanout, "fanout {fanout}");
            for w in &workers {
                assert_eq!(p.iter().filter(|(c, _)| c == w).count(), 1);
            }
            // No relay feeds more than fanout children.
            for w in &workers {
                let children = p
                    .iter()
                    .filter(|(_, parent)| parent.as_ref() == Some(w))
                    .count();
                assert!(children <= fanout, "{w} feeds {children}");
            }
        }
        assert_eq!(
            child_deadline(Duration::from_secs(10)),
            Duration::from_secs(9)
        );
        assert_eq!(
            child_deadline(Duration::from_millis(500)),
            Duration::from_millis(400)
        );
    }

    #[test]
    fn the_route_rides_in_the_first_header_only() {
        let route = Route {
            relay_to: names("b c"),
            fanout: 0,
            deadline: Some(Duration::from_millis(1500)),
            answer_when_staged: true,
        };
        let set = crate::WeightSet::from_bytes("r", 2, vec![7; 10]);
        let chunks: Vec<_> = route.apply(set.chunks(4)).collect();
        let h = chunks[0].header.as_ref().unwrap();
        assert_eq!((h.relay_to.clone(), h.relay_fanout), (names("b c"), 1));
        assert_eq!(h.deadline_ms, 1500);
        assert!(h.answer_when_staged);
        assert!(chunks[1..].iter().all(|c| c.header.is_none()));
    }
}
