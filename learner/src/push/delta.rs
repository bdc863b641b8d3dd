//! Deltas of the newest weight set against the one before it: made once per version,
//! sent to every worker known to run the one before ([`rookworld_weights::delta`]).
//!
//! The learner keeps only what that needs: the set the newest replaced (the base), and
//! only while some worker is streamed its weights (workers on this host that read the
//! shared file need no delta). The delta is made by the first push that wants it, on the
//! blocking pool, and shared by every other; a delta no smaller than the payload is not
//! sent.

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
