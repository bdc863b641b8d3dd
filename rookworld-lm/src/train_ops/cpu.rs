//! The training ops' CPU implementations on plain slices: what the ops run on the CPU and
//! the reference their CUDA kernels (`kernels/train_ops.cu`) are checked against. f32 in
//! and out, row statistics and sums in f64, rows in parallel. Letters: M rows, E width, S
//! keys, V vocabulary.

use rayon::prelude::*;

pub use super::layer_norm::PARAM_CHUNK;
use super::{gelu, layer_norm as ln};

/// `y = (x − μ)/√(σ² + eps) · w + b` per row of x (M, E) ([`ln::forward`]).
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let rows = x.len() / w.len().max(1);
    let mut y = vec![0f32; x.len()];
    let (mut mean, mut rstd) = (vec![0f32; rows], vec![0f32; rows]);
    ln::forward(&mut y, &mut mean, &mut rstd, x, w, b, eps);
    y
}

/// The layer norm's input gradient ([`ln::backward_dx`]), the statistics recomputed.
pub fn layer_norm_dx(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> Vec<f32> {
    let (mean, rstd) = ln::row_stats(x, w.len(), eps);
    let mut dx = vec![0f32; x.len()];
    ln::backward_dx(&mut dx, dy, x, &mean, &rstd, w);
    dx
}

/// Partial sums of the layer norm's parameter gradients over blocks of [`PARAM_CHUNK`]
/// rows, (C, 2, E) ([`ln::param_partials`]); summed over C by the caller, in order.
pub fn layer_norm_params(x: &[f32], dy: &[f32], e: usize, eps: f32) -> Vec<f32> {
    let (mean, rstd) = ln::row_stats(x, e, eps);
    ln::param_partials(dy, x, &mean, &rstd, e)
}

/// The gradient of `gelu_new(x + b)` with respect to z = x + b ([`gelu::bias_backward`]).
pub fn bias_gelu_bwd(x: &[f32], b: &[f32], dy: &[f32]) -> Vec<f32> {
    gelu::bias_backward(x, b, dy)
}

/// Shape of a masked softmax: scores (B, H, T, S), additive bias (B or 1, 1, T, S).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxGeometry {
    pub heads: usize,
    pub queries: usize,
    pub keys: usize,
    /// 1 when one bias serves every batch row, else B.
    pub bias_batch: usize,
}

impl SoftmaxGeometry {
    /// The bias row that score row r (of B·H·T) adds.
    pub fn bias_row(&self, r: usize) -> usize {
        (r / (self.heads * self.queries) % self.bias_batch) * self.queries + r % self.queries
    }
}

/// `p = softmax(scale · s + bias)` per row of S keys; a row whose every key is masked
/// (−∞) gets zeros.
pub fn masked_softmax(s: &[f32], bias: &[f32], geom: SoftmaxGeometry, scale: f32) -> Vec<f32> {
    let n = geom.keys;
    let mut p = vec![0f32; s.len()];
    let rows = s.par_chunks(n).zip(p.par_chunks_mut(n)).enumerate();
    rows.for_each(|(r, (row, out))| {
        let bias = &bias[geom.bias_row(r) * n..][..n];
        let z = |j: usize| f64::from(scale * row[j] + bias[j]);
        let max = (0..n).map(z).fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return;
        }
        let sum = (0..n).map(|j| (z(j) - max).exp()).sum::<f64>();
        for (j, o) in out.iter_mut().enumerate() {
            *o = ((z(j) - max).exp() / sum) as f32;
        }
    });
    p
}

/// The softmax's backward to the raw scores: `ds = scale · p ⊙ (dp − Σ p ⊙ dp)` per row.
pub fn softmax_bwd(p: &[f32], dp: &[f32], keys: usize, scale: f32) -> Vec<f32> {
    let mut ds = vec![0f32; p.len()];
    let rows = p.par_chunks(keys).zip(dp.par_chunks(keys));
    rows.zip(ds.par_chunks_mut(keys))
        .for_each(|((p, dp), out)| {
            let dot = p
                .iter()
                .zip(dp)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>();
            for (j, o) in out.iter_mut().enumerate() {
                *o = (f64::from(scale) * f64::from(p[j]) * (f64::from(dp[j]) - dot)) as f32;
            }
        });
    ds
}

/// `log softmax(logits_n / τ)[y_n]` per row of logits (N, V); `inv_t` = 1/τ.
pub fn target_logsoftmax(logits: &[f32], targets: &[u32], v: usize, inv_t: f32) -> Vec<f32> {
    logits
        .par_chunks(v)
        .zip(targets)
        .map(|(row, &y)| {
            let z = |j: usize| f64::from(row[j]) * f64::from(inv_t);
            let max = (0..v).map(z).fold(f64::NEG_INFINITY, f64::max);
            let lse = max + (0..v).map(|j| (z(j) - max).exp()).sum::<f64>().ln();
            (z(y as usize) - lse) as f32
        })
        .collect()
}

/// Its backward, given each row's result ℓ_n and incoming gradient g_n as (N, 2):
/// `dlogits_{n,v} = g_n/τ · (1[v = y_n] − p_{n,v})`, with p recovered from ℓ as
/// `p_{n,v} = exp(logits_{n,v}/τ − lse_n)`, `lse_n = logits_{n,y_n}/τ − ℓ_n`.
pub fn target_logsoftmax_bwd(
    logits: &[f32],
    targets: &[u32],
    result_grad: &[f32],
    v: usize,
    inv_t: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; logits.len()];
    let rows = logits.par_chunks(v).zip(out.par_chunks_mut(v)).enumerate();
    rows.for_each(|(n, (row, o))| {
        let (y, lp, g) = (
            targets[n] as usize,
            result_grad[2 * n],
            result_grad[2 * n + 1],
        );
        let inv_t = f64::from(inv_t);
        let lse = f64::from(row[y]) * inv_t - f64::from(lp);
        let scale = f64::from(g) * inv_t;
        for (j, o) in o.iter_mut().enumerate() {
            let p = (f64::from(row[j]) * inv_t - lse).exp();
            *o = (scale * (f64::from(u8::from(j == y)) - p)) as f32;
        }
    });
    out
}
