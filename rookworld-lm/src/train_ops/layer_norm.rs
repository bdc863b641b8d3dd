//! Layer norm, the op in one place: [`layer_norm`] (a candle op with its backward: the
//! input gradient [`LayerNormDx`] and the parameters' partial sums [`LayerNormParams`]),
//! its CPU implementation — one for both training paths: the learner's fused pass calls
//! [`forward`] and [`backward`] with the statistics the forward saved, the candle ops
//! recompute them — and, with the `cuda` feature, its kernels' launches, checked against
//! the CPU (`cuda::self_check`; tests in `tests/train_ops.rs`). R rows of width E, f32
//! row-major; statistics in f64 (rows are short, and they set every output's scale).
//!
//! With x̂ = (x − μ)·σ̂, σ̂ = 1/√(var + eps) (population variance) and g = dy ⊙ w:
//! - forward: `y = x̂ ⊙ w + b`;
//! - input gradient: `dx = σ̂ (g − mean(g) − x̂ · mean(g ⊙ x̂))`;
//! - parameter gradients: `dw = Σ_rows dy ⊙ x̂`, `db = Σ_rows dy`.

use std::ops::Range;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::fwd_impls;
use super::{Cpu, f32s, out, rows_of};

/// Rows per block of the parameter gradients' sums: each block is summed in order on one
/// thread, then the blocks' sums (the CUDA kernel's rows per block likewise).
pub const PARAM_CHUNK: usize = 32;

/// μ and σ̂ of one row.
pub fn stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
}

/// `out = x̂ ⊙ w + b` per row of x (R, E); saves μ and σ̂ per row (R).
pub fn forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
) {
    let e = w.len();
    out.par_chunks_mut(e)
        .zip(x.par_chunks(e))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|((o, x), (mu, rs))| {
            let (m, s) = stats(x, eps);
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                *o = (x - m) * s * w + b;
            }
            (*mu, *rs) = (m, s);
        });
}

/// `dx += σ̂ (g − mean(g) − x̂ · mean(g ⊙ x̂))` per row, g = dout ⊙ w.
pub fn backward_dx(dx: &mut [f32], dout: &[f32], x: &[f32], mean: &[f32], rstd: &[f32], w: &[f32]) {
    let e = w.len();
    dx.par_chunks_mut(e)
        .zip(dout.par_chunks(e).zip(x.par_chunks(e)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((dx, (dy, x)), (&m, &s))| {
            let (mut sum_g, mut sum_gx) = (0f32, 0f32);
            for ((&dy, &x), &w) in dy.iter().zip(x).zip(w) {
                let g = dy * w;
                sum_g += g;
                sum_gx += g * (x - m) * s;
            }
            let (mean_g, mean_gx) = (sum_g / e as f32, sum_gx / e as f32);
            for (((dx, &dy), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                let xhat = (x - m) * s;
                *dx += s * (dy * w - mean_g - xhat * mean_gx);
            }
        });
}

/// `dw += Σ dout ⊙ x̂`, `db += Σ dout` over `rows`, in order.
fn param_rows(
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rows: Range<usize>,
) {
    let e = dw.len();
    for r in rows {
        let (m, s) = (mean[r], rstd[r]);
        let (dy, x) = (&dout[r * e..(r + 1) * e], &x[r * e..(r + 1) * e]);
        for (((gw, gb), &dy), &x) in dw.iter_mut().zip(db.iter_mut()).zip(dy).zip(x) {
            *gw += dy * (x - m) * s;
            *gb += dy;
        }
    }
}

/// The parameters' gradients as partial sums over blocks of [`PARAM_CHUNK`] rows:
/// (C, 2, E) with `[c][0]` the weight's and `[c][1]` the bias's over block c's rows.
pub fn param_partials(dout: &[f32], x: &[f32], mean: &[f32], rstd: &[f32], e: usize) -> Vec<f32> {
    let rows = mean.len();
    let mut out = vec![0f32; rows.div_ceil(PARAM_CHUNK) * 2 * e];
    out.par_chunks_mut(2 * e).enumerate().for_each(|(c, part)| {
        let (dw, db) = part.split_at_mut(e);
        let block = c * PARAM_CHUNK..((c + 1) * PARAM_CHUNK).min(rows);
        param_rows(dw, db, dout, x, mean, rstd, block);
    });
    out
}

/// The whole backward, as the fused pass runs it: `dx +=` the input gradient, and
/// `dw`, `db +=` the parameters' (the blocks' partial sums added in order).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    w: &[f32],
) {
    let e = w.len();
    backward_dx(dx, dout, x, mean, rstd, w);
    let partials = param_partials(dout, x, mean, rstd, e);
    for part in partials.chunks(2 * e) {
        let (pw, pb) = part.split_at(e);
        dw.iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
}

/// μ and σ̂ of every row of x (R, E).
pub fn row_stats(x: &[f32], e: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    x.par_chunks(e).map(|row| stats(row, eps)).unzip()
}

/// Layer norm over the last dimension of x (…, E), differentiable in x, w and b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let eps = eps as f32;
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

/// Layer norm (x, w, b) → y.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    pub eps: f32,
}

/// Its input gradient (x, w, dy) → dx.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormDx {
    pub eps: f32,
}

/// Its parameters' partial gradients (x, dy) → (C, 2, E).
#[derive(Debug, Clone, Copy)]
pub struct LayerNormParams {
    pub eps: f32,
}

impl LayerNorm {
    fn cpu(&self, (x, xl): Cpu, (w, wl): Cpu, (b, bl): Cpu) -> Result<(CpuStorage, Shape)> {
        let (w, b) = (f32s(w, wl, "layer-norm")?, f32s(b, bl, "layer-norm")?);
        rows_of(xl, w.len(), "layer-norm")?;
        let x = f32s(x, xl, "layer-norm")?;
        let rows = x.len() / w.len();
        let (mut y, mut mean, mut rstd) = (vec![0f32; x.len()], vec![0f32; rows], vec![0f32; rows]);
        forward(&mut y, &mut mean, &mut rstd, x, w, b, self.eps);
        out(y, xl.shape().clone())
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fwd_impls!(3, cpu, cuda::layer_norm);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let eps = self.eps;
        let dy = dy.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &dy, &LayerNormDx { eps })?;
        let parts = x.apply_op2_no_bwd(&dy, &LayerNormParams { eps })?.sum(0)?; // (2, E)
        Ok((Some(dx), Some(parts.get(0)?), Some(parts.get(1)?)))
    }
}

impl LayerNormDx {
    fn cpu(&self, (x, xl): Cpu, (w, wl): Cpu, (dy, dyl): Cpu) -> Result<(CpuStorage, Shape)> {
        let w = f32s(w, wl, "layer-norm-dx")?;
        rows_of(xl, w.len(), "layer-norm-dx")?;
        let (x, dy) = (
            f32s(x, xl, "layer-norm-dx")?,
            f32s(dy, dyl, "layer-norm-dx")?,
        );
        let (mean, rstd) = row_stats(x, w.len(), self.eps);
        let mut dx = vec![0f32; x.len()];
        backward_dx(&mut dx, dy, x, &mean, &rstd, w);
        out(dx, xl.shape().clone())
    }
}

impl CustomOp3 for LayerNormDx {
    fn name(&self) -> &'static str {
        "layer-norm-dx"
    }

    fwd_impls!(3, cpu, cuda::layer_norm_dx);
}

impl LayerNormParams {
    fn cpu(&self, (x, xl): Cpu, (dy, dyl): Cpu) -> Result<(CpuStorage, Shape)> {
        let e = *xl.dims().last().unwrap_or(&0);
        let rows = rows_of(xl, e, "layer-norm-params")?;
        let (x, dy) = (
            f32s(x, xl, "layer-norm-params")?,
            f32s(dy, dyl, "layer-norm-params")?,
        );
        let chunks = rows.div_ceil(PARAM_CHUNK);
        let (mean, rstd) = row_stats(x, e, self.eps);
        out(param_partials(dy, x, &mean, &rstd, e), (chunks, 2, e))
    }
}

impl CustomOp2 for LayerNormParams {
    fn name(&self) -> &'static str {
        "layer-norm-params"
    }

    fwd_impls!(2, cpu, cuda::layer_norm_params);
}

/// The kernels' launches (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::{BackendDevice, BackendStorage};
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{DType, Result, Shape};

    use super::{LayerNorm, LayerNormDx, LayerNormParams, PARAM_CHUNK};
    use crate::cuda::train::{Arg, MODULE, ROWS_PER_BLOCK, done, empty, warp_rows};
    use crate::cuda::{TRAIN_OPS_PTX, output, slice};
    use crate::train_ops::rows_of as rows;

    /// The three-operand row kernels (layer norm forward and input gradient): (x, w, ·) → (M, E).
    fn norm_rows(
        name: &str,
        eps: f32,
        (x, xl): Arg,
        (w, wl): Arg,
        (c, cl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let e = wl.shape().elem_count();
        let m = rows(xl, e, name)?;
        let device = x.device().clone();
        if m * e == 0 {
            return empty(device, xl.shape().clone());
        }
        let func = device.get_or_load_custom_func(name, MODULE, TRAIN_OPS_PTX)?;
        let mut out = output::<f32>(&device, m * e)?; // warp r writes row r
        {
            let (xv, wv, cv) = (
                slice::<f32>(x, xl)?,
                slice::<f32>(w, wl)?,
                slice::<f32>(c, cl)?,
            );
            let (m_arg, e_arg) = (m as i32, e as i32);
            let mut b = func.builder();
            b.arg(&xv)
                .arg(&wv)
                .arg(&cv)
                .arg(&mut out)
                .arg(&m_arg)
                .arg(&e_arg)
                .arg(&eps);
            // SAFETY: (x, w, b|dy, out, M, E, eps); warp r reads and writes row r < M.
            unsafe { b.launch(warp_rows(m)) }.w()?;
        }
        done(out, device, xl.shape().clone())
    }

    pub(in crate::train_ops) fn layer_norm(
        op: &LayerNorm,
        x: Arg,
        w: Arg,
        b: Arg,
    ) -> Result<(CudaStorage, Shape)> {
        norm_rows("layer_norm_fwd", op.eps, x, w, b)
    }

    pub(in crate::train_ops) fn layer_norm_dx(
        op: &LayerNormDx,
        x: Arg,
        w: Arg,
        dy: Arg,
    ) -> Result<(CudaStorage, Shape)> {
        norm_rows("layer_norm_dx", op.eps, x, w, dy)
    }

    pub(in crate::train_ops) fn layer_norm_params(
        op: &LayerNormParams,
        (x, xl): Arg,
        (dy, dyl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let e = *xl.dims().last().unwrap_or(&0);
        let m = rows(xl, e, "layer-norm-params")?;
        let chunks = m.div_ceil(PARAM_CHUNK);
        let device = x.device().clone();
        if chunks == 0 {
            // No rows: one part of zeros (the sums over no rows), without a launch.
            let shape = Shape::from((1, 2, e));
            return Ok((device.zeros_impl(&shape, DType::F32)?, shape));
        }
        let func = device.get_or_load_custom_func("layer_norm_params", MODULE, TRAIN_OPS_PTX)?;
        let mut out = output::<f32>(&device, chunks * 2 * e)?; // block c writes part c
        {
            let (xv, dv) = (slice::<f32>(x, xl)?, slice::<f32>(dy, dyl)?);
            let (m_arg, e_arg) = (m as i32, e as i32);
            let mut b = func.builder();
            b.arg(&xv)
                .arg(&dv)
                .arg(&mut out)
                .arg(&m_arg)
                .arg(&e_arg)
                .arg(&op.eps);
            let cfg = LaunchConfig {
                grid_dim: (chunks as u32, 1, 1),
                block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (x, dy, out, M, E, eps); block c reads rows [32c, 32c + 32) ∩ [0, M) and
            // writes the (2, E) part c.
            unsafe { b.launch(cfg) }.w()?;
        }
        done(out, device, (chunks, 2, e))
    }
}
