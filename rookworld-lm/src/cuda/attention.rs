//! The grouped decode attention kernel's launch (`kernels/grouped_attention.cu`).

use candle_core::cuda::WrapErr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{DType, Result, Tensor};
use half::bf16;

use super::{ATTENTION_PTX, cuda_device, output, view, wrap};
pub use crate::launch::AttentionKernel;
use crate::launch::{attention_applies, attention_grid};

/// Where a decode step's rows find their keys, on the device (as `grouped::StepPlan`).
#[derive(Debug)]
pub struct DeviceGeometry {
    /// Whether the split kernel runs where it applies (the device's
    /// `grouped_attention_split`, a trial).
    pub split: bool,
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
/// over 128), so the tensor path runs. The split kernel runs where it is turned on and
/// applies, the warp kernel otherwise.
pub fn grouped_attention(
    q: &Tensor,
    kv_prefix: (&Tensor, &Tensor),
    kv_suffix: (&Tensor, &Tensor),
    geometry: &DeviceGeometry,
) -> Result<Option<Tensor>> {
    if geometry.split
        && let Some(out) =
            grouped_attention_with(AttentionKernel::Split, q, kv_prefix, kv_suffix, geometry)?
    {
        return Ok(Some(out));
    }
    grouped_attention_with(AttentionKernel::Warp, q, kv_prefix, kv_suffix, geometry)
}

/// [`grouped_attention`] with `kernel`; `None` when that kernel does not apply: for the
/// warp kernel a dtype other than f32/bf16 or a head dim not a multiple of 32 or over
/// 128; for the split kernel besides, a head dim whose 16-byte pieces are not a power of
/// two up to 32, or a buffer not 16-byte aligned.
pub fn grouped_attention_with(
    kernel: AttentionKernel,
    q: &Tensor,
    (pk, pv): (&Tensor, &Tensor),
    (sk, sv): (&Tensor, &Tensor),
    geometry: &DeviceGeometry,
) -> Result<Option<Tensor>> {
    let (b, h, _, d) = q.dims4()?;
    let (n, _, l, _) = pk.dims4()?;
    let c = sk.dim(2)?;
    if !matches!(q.dtype(), DType::F32 | DType::BF16) {
        return Ok(None);
    }
    let applies = attention_applies(kernel, q.dtype().size_in_bytes(), d);
    if !applies {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let dims = (b, h, d, n, l, c);
    match q.dtype() {
        DType::F32 => launch::<f32>(kernel, &q, [pk, pv, sk, sv], geometry, dims),
        _ => launch::<bf16>(kernel, &q, [pk, pv, sk, sv], geometry, dims),
    }
}

fn launch<T>(
    kernel: AttentionKernel,
    q: &Tensor,
    kv: [&Tensor; 4],
    geo: &DeviceGeometry,
    (b, h, d, n, l, c): (usize, usize, usize, usize, usize, usize),
) -> Result<Option<Tensor>>
where
    T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr,
{
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let device = cuda_device(q)?;
    let base = match kernel {
        AttentionKernel::Warp => "grouped_attention",
        AttentionKernel::Split => "grouped_attention_split",
    };
    let name = super::kernel(base, q.dtype())?;
    let func =
        device.get_or_load_custom_func(&name, "rookworld_grouped_attention", ATTENTION_PTX)?;
    let mut out = output::<T>(&device, b * h * d)?; // every live row's (head, dims) written
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
        if kernel == AttentionKernel::Split {
            // 16-byte loads: every buffer's start 16-byte aligned (rows of D elements
            // keep it).
            let stream = device.cuda_stream();
            let aligned = [&qv, &pkv, &pvv, &skv, &svv]
                .iter()
                .all(|v| v.device_ptr(&stream).0 % 16 == 0)
                && out.device_ptr(&stream).0 % 16 == 0;
            if !aligned {
                return Ok(None);
            }
        }
        let (scv, rsv, gpv) = (
            view::<u32>(&scs, scl)?,
            view::<u32>(&rss, rsl)?,
            view::<u32>(&gps, gpl)?,
        );
        let ints = [b, h, d, l, c, geo.group_rows, geo.cursor].map(|x| x as i32);
        let scale = 1.0 / (d as f32).sqrt();
        let grid = attention_grid(kernel, n, h, geo.group_rows);
        let cfg = LaunchConfig {
            grid_dim: grid.grid,
            block_dim: grid.block,
            shared_mem_bytes: grid.shared_bytes,
        };
        let mut builder = func.builder();
        builder.arg(&qv).arg(&pkv).arg(&pvv).arg(&skv).arg(&svv);
        builder.arg(&scv).arg(&rsv).arg(&gpv).arg(&mut out);
        for x in &ints {
            builder.arg(x);
        }
        builder.arg(&scale);
        // SAFETY: the argument list matches both kernels' signature (pointers to buffers of
        // the shapes above, then B, H, D, L, C, R, cursor, scale), every index the kernels
        // form stays inside those shapes, and the split kernel's 16-byte loads and stores
        // are on the alignment checked above.
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(Some(wrap(out, &device, (b, h * d))))
}
