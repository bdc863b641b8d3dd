//! Target log-probs through the LM head without materialising the logits.
//!
//! Training needs, per predicted slot n, `log softmax(h_n·Wᵀ / τ)[y_n]`. Computed the
//! plain way this builds several (N, V) tensors (logits, scaled logits, exponentials, …)
//! and keeps them for the backward — with V = 50257 that is most of a training step's
//! memory traffic on a CPU. [`head_logprobs`] is one custom op instead: the forward walks
//! the rows in blocks whose logits fit in cache-sized buffers and keeps only the result;
//! the backward recomputes each block's logits and forms
//!
//! ```text
//! ∂ℓ_n/∂logits_{n,v} = g_n · (1[v = y_n] − p_{n,v}) / τ,   p_n = softmax(h_n·Wᵀ / τ)
//! ∂/∂h_n = Σ_v ∂ℓ_n/∂logits_{n,v} · W_v       ∂/∂W_v = Σ_n ∂ℓ_n/∂logits_{n,v} · h_n
//! ```
//!
//! block by block. Off the CPU (or in another dtype) the plain graph is used.

use candle_core::{CpuStorage, CustomOp3, D, DType, Layout, Result as CandleResult, Shape, Tensor};

use rayon::prelude::*;

use crate::fused::ops::{Matmuls, Rhs, gemm, gemm_rhs};

/// Logit elements per block (64 MiB of f32): rows per block = this / V.
const BLOCK_ELEMENTS: usize = 16 << 20;

/// `log softmax(hidden · headᵀ / temperature)[target]` for every row: hidden (N, E),
/// head (V, E), targets (N) u32 → (N) f32. Differentiable in `hidden` and `head`.
pub fn head_logprobs(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let (n, e) = hidden.dims2()?;
    let (_, e2) = head.dims2()?;
    if e != e2 || targets.dims1()? != n {
        candle_core::bail!(
            "head_logprobs: hidden {:?}, head {:?}, targets {:?}",
            hidden.shape(),
            head.shape(),
            targets.shape()
        );
    }
    let fused = hidden.device().is_cpu()
        && hidden.dtype() == DType::F32
        && head.dtype() == DType::F32
        && targets.dtype() == DType::U32;
    if !fused {
        return plain_head_logprobs(hidden, head, targets, temperature);
    }
    hidden.contiguous()?.apply_op3(
        &head.contiguous()?,
        &targets.contiguous()?,
        HeadLogprobs { temperature },
    )
}

/// The same through candle's own ops, materialising the (N, V) logits.
pub fn plain_head_logprobs(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let logits = (hidden.matmul(&head.t()?)?.to_dtype(DType::F32)? / temperature)?; // (N, V)
    let picked = logits
        .gather(&targets.unsqueeze(1)?, D::Minus1)?
        .squeeze(D::Minus1)?; // (N)
    picked - logits.log_sum_exp(D::Minus1)? // (N)
}

struct HeadLogprobs {
    temperature: f64,
}

/// Rows of a block so that its logits hold at most [`BLOCK_ELEMENTS`].
fn block_rows(vocab: usize) -> usize {
    (BLOCK_ELEMENTS / vocab.max(1)).max(1)
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> CandleResult<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("head_logprobs: {what} must be contiguous f32"),
    }
}

impl CustomOp3 for HeadLogprobs {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CandleResult<(CpuStorage, Shape)> {
        let hidden = f32_slice(s1, l1, "hidden")?;
        let head = f32_slice(s2, l2, "head")?;
        let (n, e) = l1.shape().dims2()?;
        let (v, _) = l2.shape().dims2()?;
        let targets = match (s3, l3.contiguous_offsets()) {
            (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
            _ => candle_core::bail!("head_logprobs: targets must be contiguous u32"),
        };
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("head_logprobs: target {bad} outside the vocabulary of {v}");
        }
        let out = logprobs_rows(
            hidden,
            head,
            targets,
            e,
            self.temperature,
            &mut Vec::new(),
            false,
            None,
            Matmuls::F32,
        );
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> CandleResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, e) = hidden.dims2()?;
        let (v, _) = head.dims2()?;
        let h = hidden.flatten_all()?.to_vec1::<f32>()?;
        let w = head.flatten_all()?.to_vec1::<f32>()?;
        let y = targets.to_vec1::<u32>()?;
        let g = grad_res.to_vec1::<f32>()?;
        let mut grad_h = vec![0f32; n * e];
        let mut grad_w = vec![0f32; v * e];
        backward_rows(
            HeadGrads {
                hidden: &mut grad_h,
                head: &mut grad_w,
            },
            (&h, &w, &y, &g),
            e,
            self.temperature,
            None,
            Matmuls::F32,
        );
        let device = hidden.device();
        Ok((
            Some(Tensor::from_vec(grad_h, (n, e), device)?),
            Some(Tensor::from_vec(grad_w, (v, e), device)?),
            None,
        ))
    }
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
    // Summed in f64 lanes of eight partial sums: stable over 50k terms.
    let mut partial = [0f64; 8];
    for chunk in x.chunks(8) {
        for (p, &a) in partial.iter_mut().zip(chunk) {
            *p += f64::from(a);
        }
    }
    (max, partial.iter().sum::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Deterministic pseudo-random values in [−scale, scale].
    fn values(len: usize, salt: f32, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|i| scale * ((i as f32 * 12.9898 + salt).sin() * 43758.547).fract())
            .collect()
    }

    fn inputs(n: usize, e: usize, v: usize) -> (Var, Var, Tensor) {
        let cpu = Device::Cpu;
        let h = Tensor::from_vec(values(n * e, 0.3, 2.0), (n, e), &cpu).unwrap();
        let w = Tensor::from_vec(values(v * e, 1.7, 1.0), (v, e), &cpu).unwrap();
        let y: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 3) % v as u32).collect();
        (
            Var::from_tensor(&h).unwrap(),
            Var::from_tensor(&w).unwrap(),
            Tensor::new(y, &cpu).unwrap(),
        )
    }

    fn max_abs(a: &Tensor) -> f32 {
        a.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Largest difference relative to the largest magnitude.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        max_abs(&(a - b).unwrap()) / max_abs(b).max(1e-12)
    }

    #[test]
    fn row_entropies_equal_the_softmax_s_own() {
        let (n, e, v) = (5, 8, 3000);
        let (h, w, y) = inputs(n, e, v);
        for (temperature, keeping) in [(1.0, false), (0.7, true)] {
            let (hv, wv) = (
                h.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                w.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            let mut entropy = Vec::new();
            let targets = y.to_vec1::<u32>().unwrap();
            let (mut buf, rows) = (Vec::new(), n);
            let _ = logprobs_rows(
                &hv,
                &wv,
                &targets,
                e,
                temperature,
                &mut buf,
                keeping,
                Some(&mut entropy),
                Matmuls::F32,
            );
            assert_eq!(entropy.len(), rows);
            let logits =
                (h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() / temperature).unwrap();
            let logp = candle_nn::ops::log_softmax(&logits, 1).unwrap();
            let want = (logp.exp().unwrap() * &logp)
                .unwrap()
                .sum(1)
                .unwrap()
                .neg()
                .unwrap();
            for (got, want) in entropy.iter().zip(want.to_vec1::<f32>().unwrap()) {
                assert!(
                    (got - want).abs() < 1e-4 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn fused_values_and_gradients_equal_the_plain_graph() {
        // V large enough that the rows span several blocks.
        let (n, e, v) = (37, 8, 300_000);
        let (h, w, y) = inputs(n, e, v);
        let weights = Tensor::from_vec(values(n, 5.1, 1.0), n, &Device::Cpu).unwrap();
        for temperature in [1.0, 0.7] {
            let fused = head_logprobs(&h, &w, &y, temperature).unwrap();
            let plain = plain_head_logprobs(&h, &w, &y, temperature).unwrap();
            assert!(rel_diff(&fused, &plain) < 1e-5, "values");
            let gf = (&fused * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gp = (&plain * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for var in [&h, &w] {
                let (a, b) = (gf.get(var).unwrap(), gp.get(var).unwrap());
                assert!(rel_diff(a, b) < 1e-4, "gradient {}", rel_diff(a, b));
            }
        }
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() {
        let (h, w, _) = inputs(2, 4, 10);
        let y = Tensor::new(&[1u32, 10], &Device::Cpu).unwrap();
        let err = head_logprobs(&h, &w, &y, 1.0).unwrap_err().to_string();
        assert!(err.contains("outside the vocabulary"), "{err}");
    }
}
