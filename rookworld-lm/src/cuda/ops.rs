//! Launches of the decode step's small fused ops (`kernels/decode_ops.cu`); the ops
//! themselves, with their CPU implementations, are in [`crate::decode_ops`].

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDType, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Result, Shape};
use half::bf16;

use super::{DECODE_OPS_PTX, elementwise, kernel, output, slice, view};
use crate::decode_ops::params::{AddLayerNorm, QkvSplit};

const MODULE: &str = "rookworld_decode_ops";

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// Writes part `op.part` of qkv (B, 3E) plus bias into column `op.col` of `dst`.
pub(crate) fn qkv_split(
    op: QkvSplit,
    (dst, dst_l): (&mut CudaStorage, &Layout),
    qkv: Arg,
    bias: Arg,
) -> Result<()> {
    match qkv.0.dtype() {
        DType::F32 => split_into::<f32>(op, dst, dst_l, qkv, bias),
        _ => split_into::<bf16>(op, dst, dst_l, qkv, bias),
    }
}

fn split_into<T: CudaDType + DeviceRepr>(
    op: QkvSplit,
    dst: &mut CudaStorage,
    dst_l: &Layout,
    (qkv, ql): Arg,
    (bias, bl): Arg,
) -> Result<()> {
    let (b, e, h, d) = op.dims(ql)?;
    let c = dst_l.dims()[2];
    let Some((start, _)) = dst_l.contiguous_offsets() else {
        candle_core::bail!("qkv-split writes into a contiguous buffer");
    };
    let device = qkv.device().clone();
    let func = device.get_or_load_custom_func(
        &kernel("qkv_split", qkv.dtype())?,
        MODULE,
        DECODE_OPS_PTX,
    )?;
    let (x, bias) = (slice::<T>(qkv, ql)?, slice::<T>(bias, bl)?);
    let mut out = dst.as_cuda_slice_mut::<T>()?.slice_mut(start..);
    let ints = [op.part, h, d, c, op.col].map(|v| v as i32);
    let b_arg = b as i32;
    let mut builder = func.builder();
    builder
        .arg(&x)
        .arg(&bias)
        .arg(&mut out)
        .arg(&ints[0])
        .arg(&b_arg);
    for v in &ints[1..] {
        builder.arg(v);
    }
    // SAFETY: the kernel's signature (qkv, bias, dst, part, B, H, D, C, col); it writes
    // rows < B of column col of dst, inside its (≥ B, H, C, D) shape.
    unsafe { builder.launch(elementwise(b * e)) }.w()?;
    Ok(())
}

/// Part `op.part` of qkv (B, 3E) plus bias as a new (B, H, 1, D).
pub(crate) fn qkv_extract(op: QkvSplit, qkv: Arg, bias: Arg) -> Result<(CudaStorage, Shape)> {
    let (b, e, h, d) = op.dims(qkv.1)?;
    let device = qkv.0.device().clone();
    // The split writes all B·E elements (column 0 of C = 1).
    let mut dst = match qkv.0.dtype() {
        DType::F32 => CudaStorage::wrap_cuda_slice(output::<f32>(&device, b * e)?, device.clone()),
        _ => CudaStorage::wrap_cuda_slice(output::<bf16>(&device, b * e)?, device.clone()),
    };
    let shape = Shape::from((b, h, 1, d));
    qkv_split(op, (&mut dst, &Layout::contiguous(&shape)), qkv, bias)?;
    Ok((dst, shape))
}

/// gelu_new(x + bias) of x (M, N).
pub(crate) fn bias_gelu(x: Arg, bias: Arg) -> Result<(CudaStorage, Shape)> {
    match x.0.dtype() {
        DType::F32 => bias_gelu_t::<f32>(x, bias),
        _ => bias_gelu_t::<bf16>(x, bias),
    }
}

fn bias_gelu_t<T: CudaDType + DeviceRepr>(
    (x, xl): Arg,
    (bias, bl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let n = bl.shape().elem_count();
    let total = xl.shape().elem_count();
    let device = x.device().clone();
    let func =
        device.get_or_load_custom_func(&kernel("bias_gelu", x.dtype())?, MODULE, DECODE_OPS_PTX)?;
    let mut out = output::<T>(&device, total)?; // the grid-stride loop covers M·N
    {
        let (xv, bv) = (slice::<T>(x, xl)?, slice::<T>(bias, bl)?);
        let (m, n_arg) = ((total / n) as i32, n as i32);
        let mut builder = func.builder();
        builder.arg(&xv).arg(&bv).arg(&mut out).arg(&m).arg(&n_arg);
        // SAFETY: the kernel's signature (x, bias, out, M, N) over M·N elements.
        unsafe { builder.launch(elementwise(total)) }.w()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, device),
        xl.shape().clone(),
    ))
}

/// (s, layer_norm(s)) for s = x + (y + c), x and y (M, E), as (2, M, E).
pub(crate) fn add_layer_norm(op: &AddLayerNorm, x: Arg, y: Arg) -> Result<(CudaStorage, Shape)> {
    match x.0.dtype() {
        DType::F32 => add_layer_norm_t::<f32>(op, x, y),
        _ => add_layer_norm_t::<bf16>(op, x, y),
    }
}

fn add_layer_norm_t<T: CudaDType + DeviceRepr>(
    op: &AddLayerNorm,
    (x, xl): Arg,
    (y, yl): Arg,
) -> Result<(CudaStorage, Shape)> {
    let (m, e) = xl.shape().dims2()?;
    let device = x.device().clone();
    let func = device.get_or_load_custom_func(
        &kernel("add_layer_norm", x.dtype())?,
        MODULE,
        DECODE_OPS_PTX,
    )?;
    let mut out = output::<T>(&device, 2 * m * e)?; // block r writes row r of both halves
    {
        let (cs, cl) = op.y_bias.storage_and_layout();
        let (ws, wl) = op.weight.storage_and_layout();
        let (bs, bl) = op.bias.storage_and_layout();
        let (cv, wv, bv) = (
            view::<T>(&cs, cl)?,
            view::<T>(&ws, wl)?,
            view::<T>(&bs, bl)?,
        );
        let (xv, yv) = (slice::<T>(x, xl)?, slice::<T>(y, yl)?);
        let (m_arg, e_arg) = (m as i32, e as i32);
        let mut builder = func.builder();
        builder
            .arg(&xv)
            .arg(&yv)
            .arg(&cv)
            .arg(&wv)
            .arg(&bv)
            .arg(&mut out);
        builder.arg(&m_arg).arg(&e_arg).arg(&op.eps);
        let grid = crate::launch::add_layer_norm_grid(m, e).map_err(candle_core::Error::msg)?;
        let cfg = LaunchConfig {
            grid_dim: grid.grid,
            block_dim: grid.block,
            shared_mem_bytes: grid.shared_bytes,
        };
        // SAFETY: the kernel's signature (x, y, c, w, b, out, M, E, eps); block r reads row r
        // of x and y and writes row r of both halves of out; shared memory holds E + 32
        // floats.
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, device),
        Shape::from((2, m, e)),
    ))
}
