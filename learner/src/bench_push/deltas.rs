//! What a delta ([`rookworld_weights::delta`]) sends in place of the full payload, after
//! one AdamW step at each learning rate of [`LRS`] on the benchmark's model shape: a
//! fresh optimizer's first step moves every weight by about `lr` (m̂ / √v̂ = ±1), the
//! largest change a step of that rate makes — later steps move less. A step that changes
//! nothing (lr 0: every group scored alike) is the first row.

use std::time::Instant;

use candle_core::{DType, Device};
use rookworld_lm::config::Config;
use rookworld_lm::model_io;
use rookworld_train::optim::{AdamW, AdamWConfig, Gradients};
use rookworld_train::policy::Trainable;
use rookworld_weights::delta;
use serde::Serialize;

/// Why the measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum DeltaBenchError {
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error("a delta of two payloads of one model: {0}")]
    Delta(#[from] delta::DeltaError),
    #[error("a delta applied to its base is not the payload")]
    Mismatch,
}

impl From<candle_core::Error> for DeltaBenchError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

/// The learning rates measured: none, and the three the weight-sync goals name.
pub const LRS: [f64; 4] = [0.0, 1e-6, 1e-5, 1e-4];

/// One step's delta against the payload before it.
#[derive(Debug, Serialize)]
pub struct Delta {
    pub lr: f64,
    /// Share of the BF16 values the step changed.
    pub changed: f64,
    pub bytes: usize,
    /// The delta's size over the full payload's.
    pub fraction: f64,
    /// Making it from the two payloads (the learner, once per version), and applying it
    /// to a copy of the base (a worker).
    pub encode_seconds: f64,
    pub apply_seconds: f64,
}

/// One delta per rate of [`LRS`], each from a fresh model of `cfg` (seed 1).
pub fn measure(cfg: &Config) -> Result<Vec<Delta>, DeltaBenchError> {
    LRS.iter().map(|&lr| one(cfg, lr)).collect()
}

/// Fixed pseudo-random gradients for every parameter of `policy` (the benchmark's steps).
pub fn gradients(policy: &Trainable) -> Gradients {
    policy.host_gradients(
        policy
            .vars
            .iter()
            .map(|(_, v)| {
                (0..v.elem_count())
                    .map(|i| (i % 97) as f32 * 1e-3 - 0.05)
                    .collect()
            })
            .collect(),
    )
}

/// The BF16 payload of a fresh model of `cfg` (seed 1), and the payload after one AdamW
/// step at `lr` on [`gradients`].
pub fn stepped(cfg: &Config, lr: f64) -> Result<(Vec<u8>, Vec<u8>), DeltaBenchError> {
    let model = model_io::init_random(cfg, 1, DType::F32, &Device::Cpu)?;
    let base = model_io::to_bf16_payload(&model)?;
    let policy = Trainable::from_model(&model)?;
    drop(model);
    let grads = gradients(&policy);
    let mut opt = AdamW::new(AdamWConfig::default());
    opt.step(&policy.vars, &grads, lr, policy.model.kernels())?;
    let payload = model_io::to_bf16_payload(&policy.model)?;
    Ok((base, payload))
}

fn one(cfg: &Config, lr: f64) -> Result<Delta, DeltaBenchError> {
    let (base, payload) = stepped(cfg, lr)?;
    let changed = base
        .chunks_exact(2)
        .zip(payload.chunks_exact(2))
        .filter(|(a, b)| a != b)
        .count() as f64
        / (base.len() / 2) as f64;
    let t = Instant::now();
    let made = delta::encode(&base, &payload)?;
    let encode_seconds = t.elapsed().as_secs_f64();
    let mut applied = base;
    let t = Instant::now();
    delta::apply(&mut applied, &made)?;
    let apply_seconds = t.elapsed().as_secs_f64();
    if applied != payload {
        return Err(DeltaBenchError::Mismatch);
    }
    Ok(Delta {
        lr,
        changed,
        bytes: made.len(),
        fraction: made.len() as f64 / payload.len() as f64,
        encode_seconds,
        apply_seconds,
    })
}

#[cfg(test)]
mod tests {
    /// On the tiny shape: a step that changes nothing sends almost nothing, and a larger
    /// rate changes more values and sends more, always less than the full payload.
    #[test]
    fn a_delta_grows_with_the_rate_and_stays_under_the_payload() {
        let d = super::measure(&rookworld_lm::Config::tiny()).unwrap();
        assert_eq!(d[0].changed, 0.0);
        assert!(d[0].fraction < 0.01, "{:?}", d[0]);
        for w in d.windows(2) {
            assert!(w[1].changed > w[0].changed, "{w:?}");
            assert!(w[1].bytes > w[0].bytes, "{w:?}");
        }
        assert!(d.iter().all(|x| x.fraction < 1.0), "{d:?}");
    }
}
