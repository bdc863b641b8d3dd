//! Deltas of the newest weight set against the one before it: made once per version,
//! sent to every worker known to run the one before ([`rookworld_weights::delta`]).
//!
//! The learner keeps only what that needs: the set the newest replaced (the base), and
//! only while some worker is streamed its weights (workers on this host that read the
//! shared file need no delta). The delta is made by the first push that wants it, on the
//! blocking pool, and streamed while it is made: each push sends its pieces as they come,
//! so making it overlaps sending it. A delta no smaller than the payload is not sent, nor
//! one that would reach its worker later than the payload over the link as last measured
//! ([`Link`]: on loopback the worker's applying and hashing it costs more than the bytes
//! it saves take); until a version's delta is made, its size is taken to be the last
//! one's.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use rookworld_proto::rollout::v1::WeightChunk;
use rookworld_weights::WeightSet;
use rookworld_weights::relay::Route;
use rookworld_weights::set::Chunker;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

/// A version's delta, started by the first push that sends it and shared by every other.
type Made = Arc<OnceLock<Making>>;

/// A delta being made: its pieces so far, in order, and how it ended.
type Making = Arc<watch::Sender<Progress>>;

#[derive(Debug, Default)]
struct Progress {
    pieces: Vec<Bytes>,
    /// `Ok(bytes)` once made, `Err(why)` if it could not be.
    end: Option<Result<usize, String>>,
}

/// The newest set, the one before it and their delta, as the fleet knows them.
#[derive(Debug, Default)]
pub(super) struct Deltas {
    newest: Option<Arc<WeightSet>>,
    base: Option<Arc<WeightSet>>,
    made: Made,
    /// The size of the last delta made: what the next is expected to take until it is made.
    last_bytes: Option<usize>,
}

impl Deltas {
    /// Takes `set` as the newest (nothing changes when it already is). The set it
    /// replaces becomes the base when `keep_base` (some worker is streamed), else none
    /// is kept.
    pub fn advance(&mut self, set: &Arc<WeightSet>, keep_base: bool) {
        let same = |s: &WeightSet| s.run_id == set.run_id && s.version == set.version;
        if self.newest.as_deref().is_some_and(same) {
            return;
        }
        let previous = self.newest.replace(set.clone());
        self.base = previous.filter(|p| {
            keep_base
                && p.run_id == set.run_id
                && p.version < set.version
                && p.bytes.len() == set.bytes.len()
        });
        if let Some(Ok(bytes)) = self.made.get().and_then(|m| m.borrow().end.clone()) {
            self.last_bytes = Some(bytes);
        }
        self.made = Made::default();
    }

    /// What a push of the newest set to a worker known to run `known` may send instead of
    /// the payload: a delta against `known`, when that is the base kept.
    pub fn offer(&self, known: Option<u64>) -> Option<DeltaOffer> {
        let base = self.base.as_ref()?;
        (known == Some(base.version)).then(|| DeltaOffer {
            base: base.clone(),
            made: self.made.clone(),
            last_bytes: self.last_bytes,
        })
    }

    /// Whether a base is kept (its payload's memory held).
    #[cfg(test)]
    pub fn holds_base(&self) -> bool {
        self.base.is_some()
    }
}

/// When a push sends a delta (`learner train --push-deltas`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeltaPolicy {
    /// Where it arrives sooner than the payload over the worker's link as measured
    /// ([`Link::delta_pays`]).
    #[default]
    Auto,
    /// To every worker that holds the base, whatever its link.
    Always,
    /// Never: every push streams the payload.
    Never,
}

impl DeltaPolicy {
    /// Whether a delta of `delta` bytes (as made, or as expected) is sent instead of the
    /// `payload` over `link`.
    pub fn sends(self, link: &Link, delta: usize, payload: usize) -> bool {
        match self {
            Self::Auto => link.delta_pays(delta, payload),
            Self::Always => true,
            Self::Never => false,
        }
    }
}

/// What the pushes to one worker measured: how fast its link carries a push's bytes, and
/// how long the worker takes to apply a delta and hash the result.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Link {
    /// Bytes a second of the last push's receive phase (`None`: not measured yet).
    pub bytes_per_second: Option<f64>,
    /// The last delta's apply and hash, seconds (`None`: no delta reached it yet).
    pub apply_seconds: Option<f64>,
}

impl Link {
    /// Whether a delta of `delta` bytes reaches the worker sooner than the `payload`:
    /// it saves `(payload − delta) / rate` of transfer and costs the worker its apply and
    /// hash,
    ///
    /// ```text
    /// (payload − delta) / bytes_per_second  >  apply_seconds
    /// ```
    ///
    /// Unmeasured (no rate, or no delta applied there yet), a delta is sent: that push
    /// measures it.
    pub fn delta_pays(&self, delta: usize, payload: usize) -> bool {
        match (self.bytes_per_second, self.apply_seconds) {
            (Some(rate), Some(apply)) if rate > 0.0 => {
                payload.saturating_sub(delta) as f64 / rate > apply
            }
            _ => true,
        }
    }

    /// Takes in a push that reached the worker, `bytes` of it received in
    /// `receive_seconds`; a delta's apply and hash took `verify_seconds`. A push too short
    /// to time (a same-host file's header) leaves the rate as it was.
    pub fn measured(&mut self, path: &str, bytes: u64, receive_seconds: f64, verify_seconds: f64) {
        if path != "shared" && bytes >= 1 << 20 && receive_seconds > 0.0 {
            self.bytes_per_second = Some(bytes as f64 / receive_seconds);
        }
        if path == "delta" {
            self.apply_seconds = Some(verify_seconds);
        }
    }
}

/// A delta one push may send: against the base, made on first use.
#[derive(Debug, Clone)]
pub struct DeltaOffer {
    base: Arc<WeightSet>,
    made: Made,
    last_bytes: Option<usize>,
}

impl DeltaOffer {
    /// The version the delta is against.
    pub fn base_version(&self) -> u64 {
        self.base.version
    }

    /// Whether a push of a `payload`-byte set over `link` sends this delta under
    /// `policy`: not once it failed or turned out no smaller than the payload; else as
    /// [`DeltaPolicy::sends`] says of its size (made, or expected from the last one's;
    /// unknown counts as empty).
    pub fn sent(&self, policy: DeltaPolicy, link: &Link, payload: usize) -> bool {
        let expected = match self.made.get().map(|m| m.borrow().end.clone()) {
            Some(Some(Err(_))) => return false,
            Some(Some(Ok(bytes))) => Some(bytes),
            _ => self.last_bytes,
        };
        if expected.is_some_and(|bytes| bytes >= payload) {
            return false;
        }
        policy.sends(link, expected.unwrap_or(0), payload)
    }

    /// The delta that turns the base into `set` as chunks of at most `chunk_bytes` with
    /// `route` in the header, each sent as soon as its piece is made (the delta is made by
    /// the first caller, and every other reads the same pieces). Its size is not known
    /// before its end, so the header announces none. If making it fails, the stream ends
    /// where it is; the worker refuses the delta as cut short, and later pushes send the
    /// payload ([`Self::sent`]).
    pub fn chunks(
        &self,
        set: &WeightSet,
        route: &Route,
        chunk_bytes: usize,
    ) -> ReceiverStream<WeightChunk> {
        let making = self.made.get_or_init(|| self.start(set)).clone();
        let mut header = set.streamed_delta_header(self.base.version);
        route.stamp(&mut header);
        let mut chunker = Chunker::new(header, chunk_bytes);
        let mut progress = making.subscribe();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut at = 0;
            loop {
                let (pieces, ended) = {
                    let p = progress.borrow_and_update();
                    (p.pieces[at..].to_vec(), p.end.is_some())
                };
                at += pieces.len();
                for chunk in pieces.into_iter().flat_map(|p| chunker.cut(p)) {
                    if tx.send(chunk).await.is_err() {
                        return; // the push ended
                    }
                }
                if ended || progress.changed().await.is_err() {
                    return;
                }
            }
        });
        ReceiverStream::new(rx)
    }

    /// The delta's size, once made.
    pub fn made_bytes(&self) -> Option<usize> {
        match self.made.get()?.borrow().end {
            Some(Ok(bytes)) => Some(bytes),
            _ => None,
        }
    }

    /// Makes the delta that turns the base into `set` on the blocking pool, each piece
    /// published as it is made.
    fn start(&self, set: &WeightSet) -> Making {
        let making: Making = Arc::new(watch::Sender::new(Progress::default()));
        let (base, target) = (self.base.bytes.clone(), set.bytes.clone());
        let (from, to) = (self.base.version, set.version);
        let out = making.clone();
        tokio::task::spawn_blocking(move || {
            let clock = Instant::now();
            let publish = |piece: Vec<u8>| out.send_modify(|p| p.pieces.push(piece.into()));
            let end = rookworld_weights::delta::encode_streamed(&base, &target, publish);
            let end = match end {
                Ok(bytes) => {
                    tracing::debug!(
                        from,
                        to,
                        bytes,
                        share = format!("{:.3}", bytes as f64 / target.len() as f64),
                        seconds = format!("{:.3}", clock.elapsed().as_secs_f64()),
                        "weight delta made"
                    );
                    Ok(bytes)
                }
                Err(e) => {
                    tracing::warn!(from, to, error = %e, "no weight delta; the payload is sent");
                    Err(e.to_string())
                }
            };
            out.send_modify(|p| p.end = Some(end));
        });
        making
    }

    /// Waits until the delta is made (starting it if no push has): its size, or `None`
    /// when it failed.
    #[cfg(test)]
    pub async fn made(&self, set: &WeightSet) -> Option<usize> {
        let making = self.made.get_or_init(|| self.start(set)).clone();
        let mut progress = making.subscribe();
        let end = progress
            .wait_for(|p| p.end.is_some())
            .await
            .ok()?
            .end
            .clone();
        end?.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(run: &str, version: u64, fill: u8) -> Arc<WeightSet> {
        Arc::new(WeightSet::from_bytes(run, version, vec![fill; 4096]))
    }

    /// The delta an offer streams for `set` in chunks of `chunk_bytes`, checked as a
    /// receiver checks it: a header announcing a streamed delta against the offer's base
    /// on the first chunk only, every chunk at its offset.
    async fn streamed(offer: &DeltaOffer, set: &WeightSet, chunk_bytes: usize) -> Vec<u8> {
        use tokio_stream::StreamExt;
        let route = Route {
            relay_to: vec!["http://w:1".into()],
            fanout: 1,
            ..Route::default()
        };
        let chunks: Vec<WeightChunk> = offer.chunks(set, &route, chunk_bytes).collect().await;
        let h = chunks[0].header.as_ref().expect("a header first");
        assert_eq!((h.delta_bytes, h.base_version), (0, offer.base_version()));
        assert_eq!((h.version, h.relay_to.len()), (set.version, 1));
        let mut delta = Vec::new();
        for c in &chunks {
            assert_eq!(c.offset, delta.len() as u64);
            assert!(c.data.len() <= chunk_bytes);
            delta.extend_from_slice(&c.data);
        }
        assert!(chunks[1..].iter().all(|c| c.header.is_none()));
        delta
    }

    /// A delta of several blocks streams, in any chunk size, as the delta of the two
    /// payloads that the worker's apply turns the base into the payload with.
    #[tokio::test]
    async fn a_streamed_delta_is_the_delta_of_the_two_payloads() {
        let words = 2 * rookworld_weights::delta::BLOCK_WORDS + 99;
        let base: Vec<u8> = (0..2 * words).map(|i| (i % 251) as u8).collect();
        let mut next = base.clone();
        for b in next.iter_mut().step_by(13) {
            *b ^= 1;
        }
        let mut d = Deltas::default();
        d.advance(&Arc::new(WeightSet::from_bytes("a", 1, base.clone())), true);
        let v2 = Arc::new(WeightSet::from_bytes("a", 2, next.clone()));
        d.advance(&v2, true);
        let offer = d.offer(Some(1)).unwrap();
        let delta = streamed(&offer, &v2, 64 << 10).await;
        assert_eq!(
            delta,
            rookworld_weights::delta::encode(&base, &next).unwrap()
        );
        let mut out = base;
        rookworld_weights::delta::apply(&mut out, &delta).unwrap();
        assert_eq!(out, next);
    }

    /// The base is the set the newest replaced, of the same run and size, kept only when
    /// asked; a delta is offered only to a worker known to run it, made once.
    #[tokio::test]
    async fn a_delta_is_offered_against_the_set_before_only() {
        let mut d = Deltas::default();
        d.advance(&set("a", 1, 0), true);
        assert!(
            d.offer(Some(1)).is_none(),
            "no base before a second version"
        );
        let v2 = set("a", 2, 0);
        d.advance(&v2, true);
        d.advance(&v2, true); // the same set again changes nothing
        assert!(d.holds_base());
        assert!(d.offer(None).is_none() && d.offer(Some(0)).is_none());
        let offer = d.offer(Some(1)).expect("a worker on version 1");
        assert_eq!(offer.base_version(), 1);
        let delta = streamed(&offer, &v2, 1000).await;
        assert!(delta.len() < 100, "nothing changed: {} bytes", delta.len());
        assert_eq!(offer.made_bytes(), Some(delta.len()));
        let again = d.offer(Some(1)).unwrap();
        assert_eq!(again.made_bytes(), Some(delta.len()), "made once, shared");
        assert_eq!(streamed(&again, &v2, 7).await, delta);

        d.advance(&set("a", 3, 0), false);
        assert!(!d.holds_base(), "no streamed worker: no base kept");
        d.advance(&set("b", 4, 0), true);
        assert!(!d.holds_base(), "another run's set is no base");
        d.advance(&Arc::new(WeightSet::from_bytes("b", 5, vec![0; 10])), true);
        assert!(!d.holds_base(), "a set of another size is no base");
    }

    /// On loopback (2.8 GB/s) a 78 MB delta of a 249 MB payload saves 0.061 s, less than
    /// the 0.128 s its apply and hash took: the payload goes. Over 1 Gbit/s it saves 1.4 s.
    /// Unmeasured, a delta is tried; a header-only or tiny push measures no rate.
    #[test]
    fn a_delta_goes_only_where_it_arrives_sooner() {
        let (payload, delta) = (248_894_808, 78_545_229);
        let loopback = Link {
            bytes_per_second: Some(2.8e9),
            apply_seconds: Some(0.128),
        };
        assert!(!loopback.delta_pays(delta, payload));
        let gigabit = Link {
            bytes_per_second: Some(125e6),
            ..loopback
        };
        assert!(gigabit.delta_pays(delta, payload));
        assert!(Link::default().delta_pays(delta, payload));
        // Where even an empty delta cannot pay, none is sent under `auto`.
        assert!(!DeltaPolicy::Auto.sends(&loopback, 0, payload));
        assert!(DeltaPolicy::Auto.sends(&gigabit, 0, payload));
        assert!(DeltaPolicy::Always.sends(&loopback, delta, payload));
        assert!(!DeltaPolicy::Never.sends(&gigabit, 0, payload));
        let mut l = Link::default();
        l.measured("stream", payload as u64, 0.089, 0.0);
        assert!(l.delta_pays(delta, payload), "no delta applied there yet");
        l.measured("delta", delta as u64, 0.047, 0.128);
        assert!(!l.delta_pays(delta, payload));
        let before = l;
        l.measured("shared", payload as u64, 0.013, 0.036);
        l.measured("stream", 1000, 0.0001, 0.0);
        assert_eq!(l, before);
    }

    /// A delta no smaller than the payload (every byte changed, nothing compresses) is
    /// not sent once it is known to be, and the next version's is expected to be as large
    /// until it is made, so it is not sent either.
    #[tokio::test]
    async fn a_delta_no_smaller_than_the_payload_is_not_sent() {
        let mut d = Deltas::default();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = || -> Vec<u8> {
            (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 32) as u8
                })
                .collect()
        };
        let (anywhere, payload) = (Link::default(), 4096);
        d.advance(&set("a", 1, 0), true);
        let v2 = Arc::new(WeightSet::from_bytes("a", 2, noise()));
        d.advance(&v2, true);
        let offer = d.offer(Some(1)).unwrap();
        assert!(
            offer.sent(DeltaPolicy::Always, &anywhere, payload),
            "size unknown"
        );
        assert!(offer.made(&v2).await.unwrap() >= payload);
        assert!(!offer.sent(DeltaPolicy::Always, &anywhere, payload));
        d.advance(&Arc::new(WeightSet::from_bytes("a", 3, noise())), true);
        let next = d.offer(Some(2)).unwrap();
        assert!(
            !next.sent(DeltaPolicy::Always, &anywhere, payload),
            "expected as large"
        );
    }
}
