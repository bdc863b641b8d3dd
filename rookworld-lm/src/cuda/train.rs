//! Launches of the training ops' kernels (`kernels/train_ops.cu`); the ops, with their CPU
//! implementations and backwards, are in [`crate::train_ops`]. f32 only.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{CudaDevice, Layout, Result, Shape};

use super::{TRAIN_OPS_PTX, elementwise, output, slice};
use crate::train_ops::adamw::AdamWStep;
use crate::train_ops::rows_of as rows;
use crate::train_ops::{
    BiasGeluBwd, LayerNorm, LayerNormDx, LayerNormParams, MaskedSoftmax, SoftmaxBwd,
    TargetLogprobs, TargetLogprobsBwd, cpu::PARAM_CHUNK,
};

const MODULE: &str = "rookworld_train_ops";
/// Rows per block of the warp-per-row kernels (`ROWS_PER_BLOCK` in the kernel).
const ROWS_PER_BLOCK: u32 = 8;
/// Threads of the block-per-row log-softmax (`REDUCE_THREADS`).
const REDUCE_THREADS: u32 = 512;
/// Threads per block of the (V, N)-grid log-softmax backward.
const THREADS: u32 = 256;

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// A warp per row, eight rows per block.
fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(ROWS_PER_BLOCK).max(1), 1, 1),
        block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn done(
    out: candle_core::cuda::cudarc::driver::CudaSlice<f32>,
    device: CudaDevice,
    shape: impl Into<Shape>,
) -> Result<(CudaStorage, Shape)> {
    Ok((CudaStorage::wrap_cuda_slice(out, device), shape.into()))
}

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

pub(crate) fn layer_norm(op: &LayerNorm, x: Arg, w: Arg, b: Arg) -> Result<(CudaStorage, Shape)> {
    norm_rows("layer_norm_fwd", op.eps, x, w, b)
}

pub(crate) fn layer_norm_dx(
    op: &LayerNormDx,
    x: Arg,
    w: Arg,
    dy: Arg,
) -> Result<(CudaStorage, Shape)> {
    norm_rows("layer_norm_dx", op.eps, x, w, dy)
}

pub(crate) fn layer_norm_params(
    op: &LayerNormParams,
    (x, xl): Arg,
    (dy, dyl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let e = *xl.dims().last().unwrap_or(&0);
    let m = rows(xl, e, "layer-norm-params")?;
    let chunks = m.div_ceil(PARAM_CHUNK);
    let device = x.device().clone();
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
            grid_dim: (chunks.max(1) as u32, 1, 1),
            block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (x, dy, out, M, E, eps); block c reads rows [32c, 32c + 32) ∩ [0, M) and
        // writes the (2, E) part c.
        unsafe { b.launch(cfg) }.w()?;
    }
    done(out, device, (chunks, 2, e))
}

pub(crate) fn bias_gelu_bwd(
    _: &BiasGeluBwd,
    (x, xl): Arg,
    (bias, bl): Arg,
    (dy, dyl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let n = bl.shape().elem_count();
    let m = rows(xl, n, "bias-gelu-bwd")?;
    let device = x.device().clone();
    let func = device.get_or_load_custom_func("bias_gelu_bwd", MODULE, TRAIN_OPS_PTX)?;
    let mut out = output::<f32>(&device, m * n)?; // the grid-stride loop covers M·N
    {
        let (xv, bv, dv) = (
            slice::<f32>(x, xl)?,
            slice::<f32>(bias, bl)?,
            slice::<f32>(dy, dyl)?,
        );
        let (m_arg, n_arg) = (m as i32, n as i32);
        let mut b = func.builder();
        b.arg(&xv)
            .arg(&bv)
            .arg(&dv)
            .arg(&mut out)
            .arg(&m_arg)
            .arg(&n_arg);
        // SAFETY: (x, b, dy, dz, M, N) over M·N elements.
        unsafe { b.launch(elementwise(m * n)) }.w()?;
    }
    done(out, device, xl.shape().clone())
}

pub(crate) fn masked_softmax(
    op: &MaskedSoftmax,
    (s, sl): Arg,
    (bias, bl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let geom = MaskedSoftmax::geometry(sl, bl)?;
    let total = sl.shape().elem_count();
    let r = total / geom.keys.max(1);
    let device = s.device().clone();
    let func = device.get_or_load_custom_func("masked_softmax_fwd", MODULE, TRAIN_OPS_PTX)?;
    let mut out = output::<f32>(&device, total)?; // warp r writes row r
    {
        let (sv, bv) = (slice::<f32>(s, sl)?, slice::<f32>(bias, bl)?);
        let ints = [r, geom.heads, geom.queries, geom.keys, geom.bias_batch].map(|v| v as i32);
        let mut b = func.builder();
        b.arg(&sv).arg(&bv).arg(&mut out);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&op.scale);
        // SAFETY: (s, bias, p, rows, H, T, S, BB, scale); warp r reads row r of s and its
        // bias row (geometry checked), writes row r of p.
        unsafe { b.launch(warp_rows(r)) }.w()?;
    }
    done(out, device, sl.shape().clone())
}

pub(crate) fn softmax_bwd(
    op: &SoftmaxBwd,
    (p, pl): Arg,
    (dp, dpl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let keys = *pl.dims().last().unwrap_or(&1);
    if pl.dims() != dpl.dims() {
        candle_core::bail!("softmax-bwd: p {:?}, dp {:?}", pl.dims(), dpl.dims());
    }
    let total = pl.shape().elem_count();
    let r = total / keys.max(1);
    let device = p.device().clone();
    let func = device.get_or_load_custom_func("softmax_bwd", MODULE, TRAIN_OPS_PTX)?;
    let mut out = output::<f32>(&device, total)?; // warp r writes row r
    {
        let (pv, dv) = (slice::<f32>(p, pl)?, slice::<f32>(dp, dpl)?);
        let (r_arg, s_arg) = (r as i32, keys as i32);
        let mut b = func.builder();
        b.arg(&pv)
            .arg(&dv)
            .arg(&mut out)
            .arg(&r_arg)
            .arg(&s_arg)
            .arg(&op.scale);
        // SAFETY: (p, dp, ds, rows, S, scale); warp r reads and writes row r.
        unsafe { b.launch(warp_rows(r)) }.w()?;
    }
    done(out, device, pl.shape().clone())
}

pub(crate) fn target_logprobs(
    op: &TargetLogprobs,
    (l, ll): Arg,
    (t, tl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let (n, v) = crate::train_ops::target_dims(ll, tl)?;
    let device = l.device().clone();
    let func = device.get_or_load_custom_func("target_logprobs_fwd", MODULE, TRAIN_OPS_PTX)?;
    let mut out = output::<f32>(&device, n)?; // block n writes out[n]
    {
        let (lv, tv) = (slice::<f32>(l, ll)?, slice::<u32>(t, tl)?);
        let (n_arg, v_arg) = (n as i32, v as i32);
        let mut b = func.builder();
        b.arg(&lv)
            .arg(&tv)
            .arg(&mut out)
            .arg(&n_arg)
            .arg(&v_arg)
            .arg(&op.inv_t);
        let cfg = LaunchConfig {
            grid_dim: (n.max(1) as u32, 1, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (logits, targets, out, N, V, inv_t); block n reads row n (targets clamped
        // into the row), writes out[n].
        unsafe { b.launch(cfg) }.w()?;
    }
    done(out, device, n)
}

pub(crate) fn target_logprobs_bwd(
    op: &TargetLogprobsBwd,
    (l, ll): Arg,
    (t, tl): Arg,
    (rg, rgl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let (n, v) = crate::train_ops::target_dims(ll, tl)?;
    if rgl.shape().elem_count() != 2 * n {
        candle_core::bail!(
            "target-logprobs-bwd: result/gradient {:?} for {n} rows",
            rgl.dims()
        );
    }
    let device = l.device().clone();
    let func = device.get_or_load_custom_func("target_logprobs_bwd", MODULE, TRAIN_OPS_PTX)?;
    let mut out = output::<f32>(&device, n * v)?; // thread (v, n) writes d[n, v]
    {
        let (lv, tv, rv) = (
            slice::<f32>(l, ll)?,
            slice::<u32>(t, tl)?,
            slice::<f32>(rg, rgl)?,
        );
        let (n_arg, v_arg) = (n as i32, v as i32);
        let mut b = func.builder();
        b.arg(&lv)
            .arg(&tv)
            .arg(&rv)
            .arg(&mut out)
            .arg(&n_arg)
            .arg(&v_arg)
            .arg(&op.inv_t);
        let cfg = LaunchConfig {
            grid_dim: (
                (v as u32).div_ceil(THREADS).max(1),
                n.clamp(1, 65_535) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: (logits, targets, rg, d, N, V, inv_t); the grid covers V and strides over
        // N, each thread writing its own elements.
        unsafe { b.launch(cfg) }.w()?;
    }
    done(out, device, (n, v))
}

/// The in-place element-wise AdamW passes: `dst` updated from `src`, n elements.
fn adamw_pass(
    name: &str,
    (dst, dl): (&mut CudaStorage, &Layout),
    (src, sl): Arg,
    n: usize,
    scalars: &[f32],
) -> Result<()> {
    let Some((start, end)) = dl.contiguous_offsets() else {
        candle_core::bail!("{name}: the updated tensor must be contiguous");
    };
    let device = src.device().clone();
    let func = device.get_or_load_custom_func(name, MODULE, TRAIN_OPS_PTX)?;
    let sv = slice::<f32>(src, sl)?;
    let mut dv = dst.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
    let n_arg = n;
    let mut b = func.builder();
    b.arg(&mut dv).arg(&sv).arg(&n_arg);
    for v in scalars {
        b.arg(v);
    }
    // SAFETY: adamw_moments (mv, g, n, b1, b2, gs) over 2n and n elements, or adamw_param
    // (p, mv, n, lr, eps, shrink, s1, s2) over n and 2n (sizes checked by `adamw_step`).
    unsafe { b.launch(elementwise(n)) }.w()?;
    Ok(())
}

pub(crate) fn adamw_moments(
    step: &AdamWStep,
    mv: (&mut CudaStorage, &Layout),
    g: Arg,
) -> Result<()> {
    let n = g.1.shape().elem_count();
    let scalars = [step.beta1, step.beta2, step.grad_scale];
    adamw_pass("adamw_moments", mv, g, n, &scalars)
}

pub(crate) fn adamw_param(step: &AdamWStep, p: (&mut CudaStorage, &Layout), mv: Arg) -> Result<()> {
    let n = p.1.shape().elem_count();
    let scalars = [step.lr, step.eps, step.shrink, step.s1, step.s2];
    adamw_pass("adamw_param", p, mv, n, &scalars)
}
