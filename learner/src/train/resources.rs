//! What a run takes besides time, estimated from its model's shape before any work: the
//! memory the learner holds for the whole run and what the run directory grows to. The
//! step's activations and a local worker's KV caches come on top; the real-model guide
//! gives measured peaks.

/// Bytes a run holds and writes, estimated from its model's parameter count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    /// Held for the whole run, before the step's activations and the KV caches.
    pub memory: u64,
    /// `RUN/reference/`: the starting weights in f32.
    pub reference: u64,
    /// One checkpoint: the f32 weights and AdamW's two moments.
    pub checkpoint: u64,
    /// Checkpoints the run writes (every one is kept).
    pub checkpoints: u64,
}

impl Resources {
    /// For a model of `n` parameters, a run of `steps` checkpointing every
    /// `checkpoint_every` (and at its end), a frozen reference when `reference` (β > 0) and
    /// an in-process worker holding `worker_bytes` per parameter when `Some`:
    ///
    /// memory ≈ n · (4 + 4 + 8 + 2 + 4·[reference] + worker_bytes)
    /// — the policy's f32 weights, its gradients, AdamW's two f32 moments, the BF16 copy
    /// a push sends, the f32 reference and the worker's model;
    ///
    /// disk ≈ 4n + ⌈steps / checkpoint_every⌉ · 12n.
    pub fn estimate(
        n: u64,
        reference: bool,
        worker_bytes: Option<u64>,
        steps: u64,
        checkpoint_every: u64,
    ) -> Self {
        let per_parameter = 4 + 4 + 8 + 2 + 4 * u64::from(reference) + worker_bytes.unwrap_or(0);
        Self {
            memory: n * per_parameter,
            reference: 4 * n,
            checkpoint: 12 * n,
            checkpoints: steps.div_ceil(checkpoint_every.max(1)),
        }
    }

    /// The run directory's size at the end of the run.
    pub fn disk(&self) -> u64 {
        self.reference + self.checkpoints * self.checkpoint
    }
}

/// `bytes` in decimal gigabytes (`1.5 GB`) or, under one, megabytes (`12 MB`).
pub fn size(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.1} GB", bytes as f64 / 1e9)
    } else {
        format!("{} MB", (bytes as f64 / 1e6).ceil() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gpt2-124m shape of a `train --local` run on the CPU (BF16 panels beside the
    /// worker's f32 weights): the figures the real-model guide states.
    #[test]
    fn a_124m_local_run_is_estimated_as_the_guide_states() {
        let n = rookworld_lm::Config::gpt2_124m().num_parameters() as u64;
        let r = Resources::estimate(n, true, Some(4 + 2), 200, 25);
        assert_eq!(size(r.memory), "3.5 GB");
        assert_eq!(size(r.reference), "498 MB");
        assert_eq!(size(r.checkpoint), "1.5 GB");
        assert_eq!(r.checkpoints, 8);
        assert_eq!(size(r.disk()), "12.4 GB");
        // β 0 and a worker elsewhere: the policy and its optimizer alone.
        let alone = Resources::estimate(n, false, None, 200, 200);
        assert_eq!(alone.memory, 18 * n);
        assert_eq!(alone.checkpoints, 1);
    }

    #[test]
    fn sizes_are_rounded_to_what_they_mean() {
        assert_eq!(size(1_499_000_000), "1.5 GB");
        assert_eq!(size(12_300_000), "13 MB");
        assert_eq!(size(0), "0 MB");
    }
}
