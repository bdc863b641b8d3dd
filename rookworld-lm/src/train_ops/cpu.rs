//! The training ops' CPU implementations on plain slices: what the ops run on the CPU and
//! the reference their CUDA kernels (`kernels/train_ops.cu`) are checked against. f32 in
//! and out, row statistics and sums in f64, rows in parallel. Letters: M rows, E width, S
//! keys, V vocabulary.

use rayon::prelude::*;

/// Rows per partial sum of [`layer_norm_params`] (the CUDA kernel's rows per block).
pub const PARAM_CHUNK: usize = 32;

/// Mean and 1/√(var + eps) of one row.
fn stats(row: &[f32], eps: f32) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

/// `y = (x − μ)/√(σ² + eps) · w + b` per row of x (M, E).
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let e = w.len();
    let mut y = vec![0f32; x.len()];
    x.par_chunks(e)
        .zip(y.par_chunks_mut(e))
        .for_each(|(row, out)| {
            let (mean, rstd) = stats(row, eps);
            for (i, o) in out.iter_mut().enumerate() {
                *o = ((f64::from(row[i]) - mean) * rstd) as f32 * w[i] + b[i];
            }
        });
    y
}

/// The layer norm's input gradient, per row with x̂ = (x − μ)·r and g = dy ⊙ w:
/// `dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))`.
pub fn layer_norm_dx(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> Vec<f32> {
    let e = w.len();
    let mut dx = vec![0f32; x.len()];
    let rows = x.par_chunks(e).zip(dy.par_chunks(e));
    rows.zip(dx.par_chunks_mut(e)).for_each(|((row, dy), out)| {
        let (mean, rstd) = stats(row, eps);
        let xhat = |i: usize| (f64::from(row[i]) - mean) * rstd;
        let g = |i: usize| f64::from(dy[i]) * f64::from(w[i]);
        let mean_g = (0..e).map(g).sum::<f64>() / e as f64;
        let mean_gx = (0..e).map(|i| g(i) * xhat(i)).sum::<f64>() / e as f64;
        for (i, o) in out.iter_mut().enumerate() {
            *o = (rstd * (g(i) - mean_g - xhat(i) * mean_gx)) as f32;
        }
    });
    dx
}

/// Partial sums of the layer norm's parameter gradients over chunks of [`PARAM_CHUNK`]
/// rows: (C, 2, E) with `[c][0] = Σ dy ⊙ x̂` (the weight's) and `[c][1] = Σ dy` (the
/// bias's) over chunk c's rows. Summed over C by the caller, in a fixed order.
pub fn layer_norm_params(x: &[f32], dy: &[f32], e: usize, eps: f32) -> Vec<f32> {
    let rows = x.len() / e;
    let chunks = rows.div_ceil(PARAM_CHUNK);
    let mut out = vec![0f32; chunks * 2 * e];
    out.par_chunks_mut(2 * e).enumerate().for_each(|(c, part)| {
        let (mut dw, mut db) = (vec![0f64; e], vec![0f64; e]);
        for r in c * PARAM_CHUNK..((c + 1) * PARAM_CHUNK).min(rows) {
            let (row, dy) = (&x[r * e..(r + 1) * e], &dy[r * e..(r + 1) * e]);
            let (mean, rstd) = stats(row, eps);
            for i in 0..e {
                dw[i] += f64::from(dy[i]) * (f64::from(row[i]) - mean) * rstd;
                db[i] += f64::from(dy[i]);
            }
        }
        let (w_part, b_part) = part.split_at_mut(e);
        w_part.iter_mut().zip(&dw).for_each(|(o, v)| *o = *v as f32);
        b_part.iter_mut().zip(&db).for_each(|(o, v)| *o = *v as f32);
    });
    out
}

/// √(2/π) and the cubic coefficient of `gelu_new`.
const GELU_A: f64 = 0.797_884_560_802_865_4;
const GELU_B: f64 = 0.044_715;

/// `gelu_new`'s derivative at z: with u = a(z + b z³), t = tanh u,
/// `½(1 + t) + ½ z (1 − t²) a (1 + 3b z²)`.
pub fn gelu_new_grad(z: f32) -> f32 {
    let z = f64::from(z);
    let t = (GELU_A * (z + GELU_B * z * z * z)).tanh();
    (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * GELU_A * (1.0 + 3.0 * GELU_B * z * z)) as f32
}

/// The gradient of `gelu_new(x + b)` with respect to its argument z = x + b:
/// `dz = dy · gelu_new'(z)`, x and dy (M, I), b (I).
pub fn bias_gelu_bwd(x: &[f32], b: &[f32], dy: &[f32]) -> Vec<f32> {
    let i = b.len();
    let mut dz = vec![0f32; x.len()];
    let rows = x.par_chunks(i).zip(dy.par_chunks(i));
    rows.zip(dz.par_chunks_mut(i)).for_each(|((x, dy), out)| {
        for (k, o) in out.iter_mut().enumerate() {
            *o = dy[k] * gelu_new_grad(x[k] + b[k]);
        }
    });
    dz
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
