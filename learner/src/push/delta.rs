//! Deltas of the newest weight set against the one before it: made once per version,
//! sent to every worker known to run the one before ([`rookworld_weights::delta`]).
//!
//! The learner keeps only what that needs: the set the newest replaced (the base), and
//! only while some worker is streamed its weights (workers on this host that read the
//! shared file need no delta). The delta is made by the first push that wants it, on the
//! blocking pool, and shared by every other; a delta no smaller than the payload is not
//! sent, nor one that would reach its worker later than the payload over the link as last
//! measured ([`Link`]: on loopback the worker's applying and hashing it costs more than
//! the bytes it saves take).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rookworld_weights::WeightSet;
use tokio::sync::OnceCell;

/// A delta made once and shared: `None` when it could not be made, or was no smaller than
/// the payload.
type Made = Arc<OnceCell<Option<Bytes>>>;

/// The newest set, the one before it and their delta, as the fleet knows them.
#[derive(Debug, Default)]
pub(super) struct Deltas {
    newest: Option<Arc<WeightSet>>,
    base: Option<Arc<WeightSet>>,
    made: Made,
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
        self.made = Made::default();
    }

    /// What a push of the newest set to a worker known to run `known` may send instead of
    /// the payload: a delta against `known`, when that is the base kept.
    pub fn offer(&self, known: Option<u64>) -> Option<DeltaOffer> {
        let base = self.base.as_ref()?;
        (known == Some(base.version)).then(|| DeltaOffer {
            base: base.clone(),
            made: self.made.clone(),
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
    /// Whether a delta is worth making for a push of `payload` bytes over `link`: under
    /// `auto`, not where even an empty delta's apply and hash would outlast the payload's
    /// transfer, `payload / rate ≤ apply` (on loopback).
    pub fn worth_making(self, link: &Link, payload: usize) -> bool {
        self.sends(link, 0, payload)
    }

    /// Whether a delta of `delta` bytes, made, is sent instead of the `payload`.
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
}

impl DeltaOffer {
    /// The version the delta is against.
    pub fn base_version(&self) -> u64 {
        self.base.version
    }

    /// The delta that turns the base into `set`, made by the first caller and shared;
    /// `None` when it cannot be made or is no smaller than the payload (the push then
    /// streams the payload).
    pub async fn bytes(&self, set: &WeightSet) -> Option<Bytes> {
        let made = self.made.get_or_init(|| async {
            let (base, target) = (self.base.bytes.clone(), set.bytes.clone());
            let (from, to) = (self.base.version, set.version);
            let clock = Instant::now();
            let encoded =
                tokio::task::spawn_blocking(move || rookworld_weights::delta::encode(&base, &target))
                    .await;
            match encoded {
                Ok(Ok(delta)) if delta.len() < set.bytes.len() => {
                    tracing::debug!(
                        from,
                        to,
                        bytes = delta.len(),
                        share = format!("{:.3}", delta.len() as f64 / set.bytes.len() as f64),
                        seconds = format!("{:.3}", clock.elapsed().as_secs_f64()),
                        "weight delta made"
                    );
                    Some(Bytes::from(delta))
                }
                Ok(Ok(delta)) => {
                    tracing::debug!(from, to, bytes = delta.len(), "the weight delta is no smaller than the payload; the payload is sent");
                    None
                }
                Ok(Err(e)) => {
                    tracing::warn!(from, to, error = %e, "no weight delta; the payload is sent");
                    None
                }
                Err(e) => {
                    tracing::warn!(from, to, error = %e, "making the weight delta failed; the payload is sent");
                    None
                }
            }
        });
        made.await.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(run: &str, version: u64, fill: u8) -> Arc<WeightSet> {
        Arc::new(WeightSet::from_bytes(run, version, vec![fill; 4096]))
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
        let delta = offer
            .bytes(&v2)
            .await
            .expect("nothing changed: a small delta");
        assert!(delta.len() < 100, "{} bytes", delta.len());
        let again = d.offer(Some(1)).unwrap().bytes(&v2).await.unwrap();
        assert_eq!(again.as_ptr(), delta.as_ptr(), "made once, shared");

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
        // Where even an empty delta cannot pay, none is made under `auto`.
        assert!(!DeltaPolicy::Auto.worth_making(&loopback, payload));
        assert!(DeltaPolicy::Auto.worth_making(&gigabit, payload));
        assert!(DeltaPolicy::Always.sends(&loopback, delta, payload));
        assert!(!DeltaPolicy::Never.worth_making(&gigabit, payload));
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
    /// not sent.
    #[tokio::test]
    async fn a_delta_no_smaller_than_the_payload_is_not_sent() {
        let mut d = Deltas::default();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        d.advance(&set("a", 1, 0), true);
        let v2 = Arc::new(WeightSet::from_bytes("a", 2, noise));
        d.advance(&v2, true);
        assert!(d.offer(Some(1)).unwrap().bytes(&v2).await.is_none());
    }
}
