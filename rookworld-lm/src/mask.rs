//! Position ids and attention bias for left-padded batches.
//!
//! Rows of different lengths share a batch by padding on the left. Row b's first
//! `pad[b]` slots hold padding: its position ids start at 0 on its first real token and
//! no real token attends to a padded slot, so each row computes exactly what it would
//! alone. A padded slot attends only to itself, which keeps its softmax finite; its
//! output is never used. Right padding needs none of this: causal attention already
//! keeps real tokens from seeing later pads.

use candle_core::{Device, Result, Tensor};

/// Leading padding per row of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftPadding {
    pad: Vec<usize>,
}

impl LeftPadding {
    /// `batch` rows with no padding.
    pub fn none(batch: usize) -> Self {
        Self {
            pad: vec![0; batch],
        }
    }

    /// Row b starts with `pad[b]` padding slots.
    pub fn new(pad: Vec<usize>) -> Self {
        Self { pad }
    }

    /// For rows of `lengths` real tokens padded to the longest.
    pub fn for_lengths(lengths: &[usize]) -> Self {
        let longest = lengths.iter().copied().max().unwrap_or(0);
        Self::new(lengths.iter().map(|&l| longest - l).collect())
    }

    pub fn pads(&self) -> &[usize] {
        &self.pad
    }

    /// Keeps the rows `rows` (indices into this batch), in that order.
    pub fn select(&self, rows: &[usize]) -> Self {
        Self::new(rows.iter().map(|&r| self.pad[r]).collect())
    }

    /// Repeats every row `n` times, row-major.
    pub fn repeat_rows(&self, n: usize) -> Self {
        Self::new(
            self.pad
                .iter()
                .flat_map(|&p| std::iter::repeat_n(p, n))
                .collect(),
        )
    }

    /// Position ids (B, T) u32 of T new tokens after `past` cached slots.
    pub fn positions(&self, past: usize, t: usize, device: &Device) -> Result<Tensor> {
        let b = self.pad.len();
        let ids: Vec<u32> = self
            .pad
            .iter()
            .flat_map(|&p| (past..past + t).map(move |i| i.saturating_sub(p) as u32))
            .collect();
        Tensor::from_vec(ids, (b, t), device)
    }

    /// Additive attention bias (B, 1, T, S) in f32, S = past + T: 0 where query
    /// `past + i` may attend to key j (causal, key not padding, or the query itself),
    /// −∞ elsewhere. `None` when nothing needs hiding (one new token, no padding).
    pub fn attention_bias(&self, past: usize, t: usize, device: &Device) -> Result<Option<Tensor>> {
        if t == 1 && self.pad.iter().all(|&p| p == 0) {
            return Ok(None);
        }
        let b = self.pad.len();
        let s = past + t;
        let mut bias = vec![f32::NEG_INFINITY; b * t * s];
        for (row, &p) in self.pad.iter().enumerate() {
            for i in 0..t {
                let q = past + i;
                let line = &mut bias[(row * t + i) * s..(row * t + i + 1) * s];
                for (j, v) in line.iter_mut().enumerate().take(q + 1) {
                    if j >= p || j == q {
                        *v = 0.0;
                    }
                }
            }
        }
        Tensor::from_vec(bias, (b, 1, t, s), device).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_start_at_each_rows_first_real_token() {
        let pad = LeftPadding::for_lengths(&[3, 1]);
        let pos = pad.positions(0, 3, &Device::Cpu).unwrap();
        assert_eq!(
            pos.to_vec2::<u32>().unwrap(),
            vec![vec![0, 1, 2], vec![0, 0, 0]]
        );
        let next = pad.positions(3, 1, &Device::Cpu).unwrap();
        assert_eq!(next.to_vec2::<u32>().unwrap(), vec![vec![3], vec![1]]);
    }

    #[test]
    fn padded_keys_are_hidden_and_rows_stay_finite() {
        let pad = LeftPadding::new(vec![2]);
        let bias = pad.attention_bias(0, 3, &Device::Cpu).unwrap().unwrap();
        let rows = bias
            .squeeze(0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(
            rows,
            vec![
                vec![0.0, inf, inf],
                vec![inf, 0.0, inf],
                vec![inf, inf, 0.0]
            ]
        );
    }

    #[test]
    fn single_unpadded_step_needs_no_bias() {
        assert!(
            LeftPadding::none(4)
                .attention_bias(7, 1, &Device::Cpu)
                .unwrap()
                .is_none()
        );
    }
}
