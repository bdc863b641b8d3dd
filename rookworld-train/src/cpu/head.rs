//! The LM head's log-probs on the CPU without materialising the logits: the rows go
//! through the head in blocks whose logits fit in cache-sized buffers, and only each
//! row's log-prob (and entropy) is kept; the backward recomputes each block's logits,
//! unless the forward kept the probabilities, and forms
//!
//! ```text
//! ∂ℓ_n/∂logits_{n,v} = g_n · (1[v = y_n] − p_{n,v}) / τ,   p_n = softmax(h_n·Wᵀ / τ)
//! ∂/∂h_n = Σ_v ∂ℓ_n/∂logits_{n,v} · W_v       ∂/∂W_v = Σ_n ∂ℓ_n/∂logits_{n,v} · h_n
//! ```

use rayon::prelude::*;

use crate::cpu::ops::{Matmuls, Rhs, gemm, gemm_rhs};

/// Logit elements per block (64 MiB of f32): rows per block = this / V.
const BLOCK_ELEMENTS: usize = 16 << 20;

/// Probabilities kept from a chunk's forward for its backward (128 MiB of f32): rows per
/// chunk of [`crate::pass::train`] = this / V.
const KEEP_ELEMENTS: usize = 32 << 20;

/// Rows of a block so that its logits hold at most [`BLOCK_ELEMENTS`].
pub fn block_rows(vocab: usize) -> usize {
    (BLOCK_ELEMENTS / vocab.max(1)).max(1)
}

/// Rows of a chunk whose probabilities are kept: at most [`KEEP_ELEMENTS`].
pub fn keep_rows(vocab: usize) -> usize {
    (KEEP_ELEMENTS / vocab.max(1)).max(1)
}

/// `log softmax(h_n · Wᵀ / τ)[y_n]` of every row n of `hidden` (N, E) for head W
/// (V, E), block by block in `buf` (reused from call to call). With `keeping`, the
/// probabilities `softmax(h_n · Wᵀ / τ)` are left in `buf` (N, V) for [`backward_rows`].
/// With `entropy`, it gets each row's entropy `H_n = −Σ_v p_v log p_v =
/// max + ln Σ exp(z − max) − Σ_v p_v z_v` (z the row's logits / τ), at the cost of one
/// copy and one dot product of the row.
#[allow(clippy::too_many_arguments)]
pub fn logprobs_rows(
    hidden: &[f32],
    head: &[f32],
    targets: &[u32],
    e: usize,
    temperature: f64,
    buf: &mut Vec<f32>,
    keeping: bool,
    mut entropy: Option<&mut Vec<f32>>,
    how: Matmuls,
) -> Vec<f32> {
    let (n, v) = (targets.len(), head.len() / e);
    let inv_t = (1.0 / temperature) as f32;
    // Kept probabilities are one block: the whole (N, V) product at once.
    let rows = if keeping { n.max(1) } else { block_rows(v) };
    buf.resize(rows.min(n) * v, 0.0); // every element used is overwritten below
    let mut out = Vec::with_capacity(n);
    let want_entropy = entropy.is_some();
    if let Some(h) = entropy.as_deref_mut() {
        h.clear();
    }
    // Wᵀ (E, V): element (k, j) is w[j·E + k].
    let wt = Rhs::new((head, 1, e), (e, v), how);
    for start in (0..n).step_by(rows) {
        let m = rows.min(n - start);
        let block = if keeping {
            &mut buf[start * v..(start + m) * v]
        } else {
            &mut buf[..m * v]
        };
        block_logits(
            block,
            &hidden[start * e..(start + m) * e],
            &wt,
            (m, e, v),
            inv_t,
            how,
        );
        // Rows in parallel, each (log-prob, entropy) computed alone: the same bits whatever
        // the thread count.
        let picked = &targets[start..start + m];
        let rows_out: Vec<(f32, f32)> = block
            .par_chunks_exact_mut(v)
            .zip(picked.par_iter())
            .map_init(Vec::new, |logits, (row, &y)| {
                row_logprob(row, y, keeping, want_entropy.then_some(logits))
            })
            .collect();
        out.extend(rows_out.iter().map(|&(lp, _)| lp));
        if let Some(h) = entropy.as_deref_mut() {
            h.extend(rows_out.iter().map(|&(_, ent)| ent));
        }
    }
    out
}

/// One row of [`logprobs_rows`]: turns the logits `row` into `exp(z − max)` (divided by
/// their sum when `keeping`, i.e. the softmax) and returns the target's log-prob and, with
/// a scratch buffer for the logits, the entropy `max + ln Σ − E_p[z]` (else 0).
fn row_logprob(
    row: &mut [f32],
    target: u32,
    keeping: bool,
    entropy_scratch: Option<&mut Vec<f32>>,
) -> (f32, f32) {
    let picked = row[target as usize];
    let logits = entropy_scratch.map(|l| {
        l.clear();
        l.extend_from_slice(row);
        &*l
    });
    let (max, sum) = exp_shifted(row);
    // In f64 until the one final rounding.
    let logprob = (f64::from(picked - max) - sum.ln()) as f32;
    let entropy = logits.map_or(0.0, |logits| {
        let mut partial = [0f64; 8];
        for (p, z) in row.chunks(8).zip(logits.chunks(8)) {
            for ((acc, &p), &z) in partial.iter_mut().zip(p).zip(z) {
                *acc += f64::from(p) * f64::from(z);
            }
        }
        let mean_z = partial.iter().sum::<f64>() / sum;
        (f64::from(max) + sum.ln() - mean_z) as f32
    });
    if keeping {
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|x| *x *= inv);
    }
    (logprob, entropy)
}

/// Where [`backward_rows`] accumulates: ∂/∂hidden (N, E) and ∂/∂W (V, E).
pub struct HeadGrads<'a> {
    pub hidden: &'a mut [f32],
    pub head: &'a mut [f32],
}

/// Backward of [`logprobs_rows`] for upstream gradients `g` (N): accumulates
/// `∂/∂h_n = Σ_v d_{n,v} W_v` and `∂/∂W_v = Σ_n d_{n,v} h_n` with
/// `d_{n,v} = g_n (1[v = y_n] − p_{n,v}) / τ`. `probs` are the forward's kept
/// probabilities (consumed); without them each block's logits are recomputed.
pub fn backward_rows(
    grads: HeadGrads,
    (hidden, head, targets, g): (&[f32], &[f32], &[u32], &[f32]),
    e: usize,
    temperature: f64,
    mut probs: Option<&mut [f32]>,
    how: Matmuls,
) {
    let (n, v) = (targets.len(), head.len() / e);
    let inv_t = (1.0 / temperature) as f32;
    // With the forward's probabilities, one block: (N, V)·(V, E) and (V, N)·(N, E) as
    // two large products instead of one pass over ∂W per small block.
    let rows = if probs.is_some() {
        n.max(1)
    } else {
        block_rows(v)
    };
    let mut scratch = Vec::new();
    if probs.is_none() {
        scratch.resize(rows.min(n) * v, 0.0);
    }
    // W (V, E) for ∂/∂h, and Wᵀ (E, V) to recompute the logits: each packed once where the
    // products are BF16.
    let w = Rhs::new((head, e, 1), (v, e), how);
    let wt = match probs {
        Some(_) => Rhs::Plain((head, 1, e)), // not used: the logits are not recomputed
        None => Rhs::new((head, 1, e), (e, v), how),
    };
    for start in (0..n).step_by(rows) {
        let m = rows.min(n - start);
        let hb = &hidden[start * e..(start + m) * e];
        let block = match probs.as_deref_mut() {
            Some(p) => &mut p[start * v..(start + m) * v],
            None => {
                let block = &mut scratch[..m * v];
                block_logits(block, hb, &wt, (m, e, v), inv_t, how);
                block.par_chunks_exact_mut(v).for_each(|row| {
                    let (_, sum) = exp_shifted(row);
                    let inv = (1.0 / sum) as f32;
                    row.iter_mut().for_each(|x| *x *= inv);
                });
                block
            }
        };
        // Each row becomes g·(onehot(y) − softmax)/τ.
        let (gb, yb) = (&g[start..start + m], &targets[start..start + m]);
        block
            .par_chunks_exact_mut(v)
            .zip(gb.par_iter().zip(yb.par_iter()))
            .for_each(|(row, (&g, &y))| {
                let scale = -g * inv_t;
                row.iter_mut().for_each(|x| *x *= scale);
                row[y as usize] += g * inv_t;
            });
        // grad_h[block] += d · W: (m, V)·(V, E).
        gemm_rhs(
            &mut grads.hidden[start * e..(start + m) * e],
            (m, e, v),
            true,
            (block, v, 1),
            &w,
            how,
        );
        // grad_W += dᵀ · h[block]: (V, m)·(m, E).
        gemm(grads.head, (v, e, m), true, (block, 1, v), (hb, e, 1), how);
    }
}

/// `out` (m, V) = h (m, E) · Wᵀ / τ for head W (V, E) given as `wt` = Wᵀ (E, V), all
/// row-major.
fn block_logits(
    out: &mut [f32],
    h: &[f32],
    wt: &Rhs,
    (m, e, v): (usize, usize, usize),
    inv_t: f32,
    how: Matmuls,
) {
    gemm_rhs(out, (m, v, e), false, (h, e, 1), wt, how);
    if inv_t != 1.0 {
        out.par_chunks_mut(v.max(1))
            .for_each(|row| row.iter_mut().for_each(|x| *x *= inv_t));
    }
}

/// Replaces `x` with `exp(x − max x)` and returns `(max x, Σ exp(x − max x))`, so that
/// `log Σ exp(x) = max + ln(sum)` and `softmax(x) = x' / sum`.
fn exp_shifted(x: &mut [f32]) -> (f32, f64) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    x.iter_mut().for_each(|a| *a -= max);
    rookworld_lm::simd::exp_inplace(x);
    (max, rookworld_lm::simd::sum_f64(x))
}
