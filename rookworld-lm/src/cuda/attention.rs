//! The grouped decode attention kernel's launch (`kernels/grouped_attention.cu`).

use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Result, Tensor};
use half::bf16;

use super::{ATTENTION_PTX, cuda_device, kernel, output, view, wrap};

/// Rows of a group one block serves (one warp each): `ROWS_PER_BLOCK` in the kernel.
const ROWS_PER_BLOCK: usize = 16;
/// Largest head dim the kernel holds (`MAX_D`); it must also be a multiple of 32.
const MAX_HEAD_DIM: usize = 128;

/// Where a decode step's rows find their keys, on the device (as `grouped::StepPlan`).
#[derive(Debug)]
pub struct DeviceGeometry {
    /// (N·R) u32: row of slot (g, k), B for an empty slot.
    pub scatter: Tensor,
    /// (B) u32: first suffix column of each row.
    pub row_start: Tensor,
    /// (N) u32: padded columns at the start of each group's prefix.
    pub group_pad: Tensor,
    /// Max rows of one group (R).
    pub group_rows: usize,
    /// The column this step wrote.
    pub cursor: usize,
}

/// The step's attention output (B, H·D) from `q` (B, H, 1, D), the prefix pool (N, H, L,
/// D) and the suffix buffers (rows capacity, H, C, D), in one launch; `None` when the
/// kernel does not apply (dtype other than f32/bf16, head dim not a multiple of 32 or
/// over 128), so the tensor path runs.
pub fn grouped_attention(
    q: &Tensor,
    (pk, pv): (&Tensor, &Tensor),
    (sk, sv): (&Tensor, &Tensor),
    geometry: &DeviceGeometry,
) -> Result<Option<Tensor>> {
    let (b, h, _, d) = q.dims4()?;
    let (n, _, l, _) = pk.dims4()?;
    let c = sk.dim(2)?;
    if !d.is_multiple_of(32) || d > MAX_HEAD_DIM || !matches!(q.dtype(), DType::F32 | DType::BF16) {
        return Ok(None);
    }
    let q = q.contiguous()?;
    match q.dtype() {
        DType::F32 => launch::<f32>(&q, [pk, pv, sk, sv], geometry, (b, h, d, n, l, c)),
        _ => launch::<bf16>(&q, [pk, pv, sk, sv], geometry, (b, h, d, n, l, c)),
    }
    .map(Some)
}

fn launch<T>(
    q: &Tensor,
    kv: [&Tensor; 4],
    geo: &DeviceGeometry,
    (b, h, d, n, l, c): (usize, usize, usize, usize, usize, usize),
) -> Result<Tensor>
where
    T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr,
{
    let device = cuda_device(q)?;
    let name = kernel("grouped_attention", q.dtype())?;
    let func =
        device.get_or_load_custom_func(&name, "rookworld_grouped_attention", ATTENTION_PTX)?;
    let mut out = output::<T>(&device, b * h * d)?; // every live row is one slot's warp
    {
        let (qs, ql) = q.storage_and_layout();
        let [(pks, pkl), (pvs, pvl), (sks, skl), (svs, svl)] = kv.map(|t| t.storage_and_layout());
        let (scs, scl) = geo.scatter.storage_and_layout();
        let (rss, rsl) = geo.row_start.storage_and_layout();
        let (gps, gpl) = geo.group_pad.storage_and_layout();
        let (qv, pkv, pvv) = (
            view::<T>(&qs, ql)?,
            view::<T>(&pks, pkl)?,
            view::<T>(&pvs, pvl)?,
        );
        let (skv, svv) = (view::<T>(&sks, skl)?, view::<T>(&svs, svl)?);
        let (scv, rsv, gpv) = (
            view::<u32>(&scs, scl)?,
            view::<u32>(&rss, rsl)?,
            view::<u32>(&gps, gpl)?,
        );
        let ints = [b, h, d, l, c, geo.group_rows, geo.cursor].map(|x| x as i32);
        let scale = 1.0 / (d as f32).sqrt();
        let warps = geo.group_rows.clamp(1, ROWS_PER_BLOCK);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, h as u32, geo.group_rows.div_ceil(warps) as u32),
            block_dim: (32, warps as u32, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = func.builder();
        builder.arg(&qv).arg(&pkv).arg(&pvv).arg(&skv).arg(&svv);
        builder.arg(&scv).arg(&rsv).arg(&gpv).arg(&mut out);
        for x in &ints {
            builder.arg(x);
        }
        builder.arg(&scale);
        // SAFETY: the argument list matches the kernel's signature (pointers to buffers of the
        // shapes above, then B, H, D, L, C, R, cursor, scale), and every index the kernel
        // forms stays inside those shapes.
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(wrap(out, &device, (b, h * d)))
}
