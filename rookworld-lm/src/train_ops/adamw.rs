//! AdamW on the parameter's device: its moments stay there as one (2, n) tensor (first
//! moments, then second) and a step is two in-place passes, no host round trip — what the
//! learner runs on CUDA (`kernels/train_ops.cu`: `adamw_moments`, `adamw_param`). The CPU
//! implementation is the reference, the same f32 arithmetic in the same order as the
//! learner's host pass:
//!
//! ```text
//! g' = s_g · g      m = β1 m + (1 − β1) g'      v = β2 v + (1 − β2) g'²
//! p = p · (1 − lr·λ) − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + ε)
//! ```

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};

use crate::kernels::{Kernel, Kernels};

/// One step's constants, in f32 as the kernels use them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// 1 − lr·λ (decoupled weight decay).
    pub shrink: f32,
    /// 1 / (1 − β1ᵗ) and 1 / (1 − β2ᵗ).
    pub s1: f32,
    pub s2: f32,
    /// The gradient's scale (clipping).
    pub grad_scale: f32,
}

/// Updates `param` (n) in place from `grad` (n) and `moments` (2, n), all contiguous f32
/// on one device; the moments are updated in place too.
/// On CUDA the kernels run where the device's `train_ops` are on (`kernels`, its
/// verdict), else candle's composed ops.
pub fn adamw_step(
    param: &Tensor,
    grad: &Tensor,
    moments: &Tensor,
    step: &AdamWStep,
    kernels: &Kernels,
) -> Result<()> {
    let n = check_sizes(param, grad, moments)?;
    if n == 0 {
        return Ok(()); // nothing to update (candle refuses in-place ops on empty tensors)
    }
    if param.device().is_cuda() && !kernels.enabled(Kernel::TrainOps) {
        return composed(param, grad, moments, step);
    }
    moments.inplace_op2(&grad.contiguous()?, &AdamWMoments(*step))?;
    param.inplace_op2(moments, &AdamWParam(*step))
}

/// A parameter's element count n, after checking that its gradient has n elements and
/// its moments are (2, n).
fn check_sizes(param: &Tensor, grad: &Tensor, moments: &Tensor) -> Result<usize> {
    let n = param.elem_count();
    if grad.elem_count() != n || moments.dims() != [2, n] {
        candle_core::bail!(
            "adamw: parameter {:?}, gradient {:?}, moments {:?}",
            param.dims(),
            grad.dims(),
            moments.dims()
        );
    }
    Ok(n)
}

/// One parameter of [`adamw_step_many`]: the parameter (n), its gradient (n) and moments
/// (2, n), contiguous f32 on one device, its decay factor (1 − lr·λ, or 1 where it does
/// not decay), and where its updated values go as bfloat16 (2n bytes, little-endian) in
/// the step's `bits` (a weight push's data section), if anywhere.
pub struct ManyItem<'a> {
    pub param: &'a Tensor,
    pub grad: &'a Tensor,
    pub moments: &'a Tensor,
    pub shrink: f32,
    pub out: Option<std::ops::Range<usize>>,
}

/// [`adamw_step`] of every item, each with its own `shrink` (`step.shrink` is not used),
/// and each updated parameter's bfloat16 bits into its `out` range of `bits` (ranges
/// that do not overlap, at even offsets). On CUDA with the training ops on
/// ([`crate::kernels`]), when every item is on one device: one launch for all of them
/// (`adamw_many`: the moments and the parameter in one pass, the bits written beside them
/// into a device copy of `bits`) and, when the ranges cover `bits`, one transfer of it
/// through page-locked memory (`cuda::download`), else one copy per range; instead of two
/// launches a parameter and a conversion and a synchronised download each. Elsewhere
/// item by item, the same values.
pub fn adamw_step_many(
    items: &[ManyItem],
    step: &AdamWStep,
    bits: &mut [u8],
    kernels: &Kernels,
) -> Result<()> {
    let mut ranges = Vec::with_capacity(items.len());
    for it in items {
        let n = check_sizes(it.param, it.grad, it.moments)?;
        if let Some(out) = &it.out {
            if out.len() != 2 * n || out.end > bits.len() || out.start % 2 != 0 {
                candle_core::bail!(
                    "adamw: a bfloat16 slot of the wrong size or place for {n} values ({out:?} of {} bytes)",
                    bits.len()
                );
            }
            ranges.push(out.clone());
        }
    }
    ranges.sort_by_key(|r| r.start);
    if ranges.windows(2).any(|w| w[0].end > w[1].start) {
        candle_core::bail!("adamw: two parameters' bfloat16 slots overlap");
    }
    #[cfg(feature = "cuda")]
    if let Some(device) = many::one_cuda_device(items.iter().map(|it| it.param))
        && kernels.enabled(Kernel::TrainOps)
    {
        let covered = ranges.iter().map(|r| r.len()).sum::<usize>() == bits.len();
        return many::adamw(&device, items, step, bits, covered);
    }
    for it in items {
        adamw_step(
            it.param,
            it.grad,
            it.moments,
            &AdamWStep {
                shrink: it.shrink,
                ..*step
            },
            kernels,
        )?;
        if let Some(out) = &it.out {
            write_bf16_bits(it.param, &mut bits[out.clone()])?;
        }
    }
    Ok(())
}

/// `param`'s values as bfloat16 bits into `out` (2 bytes a value, little-endian),
/// converted where the tensor lives (on a GPU half the bytes cross to the host).
pub fn write_bf16_bits(param: &Tensor, out: &mut [u8]) -> Result<()> {
    let bits = param
        .flatten_all()?
        .to_dtype(candle_core::DType::BF16)?
        .to_vec1::<half::bf16>()?;
    for (d, b) in out.chunks_exact_mut(2).zip(bits) {
        d.copy_from_slice(&b.to_bits().to_le_bytes());
    }
    Ok(())
}

/// `Σ_k Σ_i g_k[i]²` over `grads` (contiguous f32), in f64. On CUDA with the training ops
/// on, when every tensor is on one device: one launch (`square_sums_many`: f32 sums over
/// fixed chunks, the same bits every run) and one read of the chunks' sums, added in f64
/// in order; elsewhere tensor by tensor on the host.
pub fn square_sum_many(grads: &[&Tensor], kernels: &Kernels) -> Result<f64> {
    #[cfg(not(feature = "cuda"))]
    let _ = kernels; // no kernel to run
    #[cfg(feature = "cuda")]
    if let Some(device) = many::one_cuda_device(grads.iter().copied())
        && kernels.enabled(Kernel::TrainOps)
    {
        return many::square_sums(&device, grads);
    }
    let mut total = 0f64;
    for g in grads {
        let values = g
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        total += values
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>();
    }
    Ok(total)
}

/// The same step in candle's ops, written back in place: where the kernels failed their
/// start-up check ([`crate::kernels`]). Several passes instead of two; the same values
/// up to rounding.
fn composed(param: &Tensor, grad: &Tensor, moments: &Tensor, c: &AdamWStep) -> Result<()> {
    let f = f64::from;
    let g = (grad.flatten_all()? * f(c.grad_scale))?; // (n)
    let m = ((moments.get(0)? * f(c.beta1))? + (&g * f(1.0 - c.beta1))?)?;
    let v = ((moments.get(1)? * f(c.beta2))? + (g.sqr()? * f(1.0 - c.beta2))?)?;
    let denom = ((&v * f(c.s2))?.sqrt()? + f(c.eps))?;
    let update = ((&m * f(c.s1))? / denom)?;
    let p = ((param.flatten_all()? * f(c.shrink))? - (update * f(c.lr))?)?;
    moments.slice_set(&Tensor::stack(&[m, v], 0)?, 0, 0)?;
    param.slice_set(&p.reshape(param.shape())?, 0, 0)
}

/// The moments' pass: (2, n) in place, from the gradient.
#[derive(Debug, Clone, Copy)]
pub struct AdamWMoments(pub AdamWStep);

/// The parameter's pass: (n) in place, from the moments.
#[derive(Debug, Clone, Copy)]
pub struct AdamWParam(pub AdamWStep);

fn f32s_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("adamw: tensors must be contiguous f32"),
    }
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("adamw: tensors must be contiguous f32"),
    }
}

impl InplaceOp2 for AdamWMoments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let c = self.0;
        let (mv, g) = (f32s_mut(s, l)?, f32s(g, gl)?);
        let (m, v) = mv.split_at_mut(g.len());
        for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(g) {
            let g = g * c.grad_scale;
            *m = c.beta1 * *m + (1.0 - c.beta1) * g;
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        l: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        cuda::adamw_moments(&self.0, (s, l), (g, gl))
    }
}

impl InplaceOp2 for AdamWParam {
    fn name(&self) -> &'static str {
        "adamw-param"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout, mv: &CpuStorage, ml: &Layout) -> Result<()> {
        let c = self.0;
        let (p, mv) = (f32s_mut(s, l)?, f32s(mv, ml)?);
        let (m, v) = mv.split_at(p.len());
        for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
            let update = (m * c.s1) / ((v * c.s2).sqrt() + c.eps);
            *p = *p * c.shrink - c.lr * update;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        l: &Layout,
        mv: &candle_core::CudaStorage,
        ml: &Layout,
    ) -> Result<()> {
        cuda::adamw_param(&self.0, (s, l), (mv, ml))
    }
}

/// The kernels' launches (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{Layout, Result};

    use super::AdamWStep;
    use crate::cuda::train::{Arg, MODULE};
    use crate::cuda::{TRAIN_OPS_PTX, elementwise, slice};

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
        if n == 0 {
            return Ok(()); // nothing to update, and no launch of an empty grid
        }
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

    pub(in crate::train_ops) fn adamw_moments(
        step: &AdamWStep,
        mv: (&mut CudaStorage, &Layout),
        g: Arg,
    ) -> Result<()> {
        let n = g.1.shape().elem_count();
        let scalars = [step.beta1, step.beta2, step.grad_scale];
        adamw_pass("adamw_moments", mv, g, n, &scalars)
    }

    pub(in crate::train_ops) fn adamw_param(
        step: &AdamWStep,
        p: (&mut CudaStorage, &Layout),
        mv: Arg,
    ) -> Result<()> {
        let n = p.1.shape().elem_count();
        let scalars = [step.lr, step.eps, step.shrink, step.s1, step.s2];
        adamw_pass("adamw_param", p, mv, n, &scalars)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// The multi-tensor step is each item's own step (its own decay) with its bfloat16
    /// copy, a slot of the wrong size is refused, and the sum of squares is the f64 sum.
    #[test]
    fn the_multi_tensor_step_is_each_items_step() {
        let sizes = [70_000usize, 10, 5_000];
        let values = |n: usize, k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7919 + k * 104_729) % 997) as f32 / 997.0 - 0.5)
                .collect()
        };
        let step = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            shrink: 0.5, // not used: each item has its own
            s1: 10.0,
            s2: 1000.0,
            grad_scale: 0.5,
        };
        let tensors = |k: usize| -> Vec<Tensor> {
            sizes
                .iter()
                .map(|&n| Tensor::from_vec(values(n, k), n, &Device::Cpu).unwrap())
                .collect()
        };
        let (params, grads) = (tensors(0), tensors(1));
        let (want_p, want_g) = (tensors(0), tensors(1));
        let zeros = || -> Vec<Tensor> {
            sizes
                .iter()
                .map(|&n| Tensor::zeros((2, n), DType::F32, &Device::Cpu).unwrap())
                .collect()
        };
        let (moments, want_mv) = (zeros(), zeros());
        let shrink = [1.0 - 1e-4, 1.0, 1.0 - 2e-4];
        // One buffer, each parameter's bits at its range (a payload's data section).
        let ranges: Vec<std::ops::Range<usize>> = sizes
            .iter()
            .scan(0, |at, &n| {
                *at += 2 * n;
                Some(*at - 2 * n..*at)
            })
            .collect();
        let mut bits = vec![0u8; ranges[2].end];
        for _ in 0..2 {
            let items: Vec<ManyItem> = params
                .iter()
                .zip(&grads)
                .zip(&moments)
                .zip(&ranges)
                .zip(shrink)
                .map(|((((param, grad), moments), out), shrink)| ManyItem {
                    param,
                    grad,
                    moments,
                    shrink,
                    out: Some(out.clone()),
                })
                .collect();
            adamw_step_many(&items, &step, &mut bits, &Kernels::every()).unwrap();
            for k in 0..3 {
                let own = AdamWStep {
                    shrink: shrink[k],
                    ..step
                };
                adamw_step(&want_p[k], &want_g[k], &want_mv[k], &own, &Kernels::every()).unwrap();
            }
        }
        for k in 0..3 {
            let (got, want) = (
                params[k].to_vec1::<f32>().unwrap(),
                want_p[k].to_vec1::<f32>().unwrap(),
            );
            assert_eq!(got, want, "parameter {k}");
            let rounded: Vec<u8> = want
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                .collect();
            assert_eq!(bits[ranges[k].clone()], rounded, "bfloat16 copy {k}");
        }
        let one = |out: std::ops::Range<usize>| ManyItem {
            param: &params[1],
            grad: &grads[1],
            moments: &moments[1],
            shrink: 1.0,
            out: Some(out),
        };
        let err = adamw_step_many(&[one(0..3)], &step, &mut bits, &Kernels::every()).unwrap_err();
        assert!(err.to_string().contains("wrong size"), "{err}");
        let past = bits.len() - 2 * sizes[1] + 2;
        let err = adamw_step_many(
            &[one(past..past + 2 * sizes[1])],
            &step,
            &mut bits,
            &Kernels::every(),
        );
        assert!(err.unwrap_err().to_string().contains("wrong size or place"));
        let twice = [one(0..2 * sizes[1]), one(2..2 + 2 * sizes[1])];
        let err = adamw_step_many(&twice, &step, &mut bits, &Kernels::every()).unwrap_err();
        assert!(err.to_string().contains("overlap"), "{err}");
        let want: f64 = (0..3)
            .flat_map(|k| values(sizes[k], 1))
            .map(|x| f64::from(x) * f64::from(x))
            .sum();
        let got = square_sum_many(&grads.iter().collect::<Vec<_>>(), &Kernels::every()).unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{got} against {want}");
    }

    /// The composed fallback against the two-pass op (the reference), three steps.
    #[test]
    fn the_composed_fallback_takes_the_same_step() {
        let n = 1000;
        let values = |k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7919 + k * 104_729) % 997) as f32 / 997.0 - 0.5)
                .collect()
        };
        let step = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            shrink: 1.0 - 1e-4,
            s1: 10.0,
            s2: 1000.0,
            grad_scale: 0.5,
        };
        let run = |composed_path: bool| -> Result<(Vec<f32>, Vec<f32>)> {
            let p = Tensor::from_vec(values(0), (10, 100), &Device::Cpu)?;
            let mv = Tensor::zeros((2, n), DType::F32, &Device::Cpu)?;
            for k in 1..=3 {
                let g = Tensor::from_vec(values(k), (10, 100), &Device::Cpu)?;
                if composed_path {
                    composed(&p, &g, &mv, &step)?;
                } else {
                    adamw_step(&p, &g, &mv, &step, &Kernels::every())?;
                }
            }
            Ok((p.flatten_all()?.to_vec1()?, mv.flatten_all()?.to_vec1()?))
        };
        let (want, got) = (run(false).unwrap(), run(true).unwrap());
        let worst =
            |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |w, (x, y)| w.max((x - y).abs()));
        assert!(worst(&want.0, &got.0) < 1e-6, "{}", worst(&want.0, &got.0));
        assert!(worst(&want.1, &got.1) < 1e-6, "{}", worst(&want.1, &got.1));
        assert_ne!(want.0, values(0), "the parameters moved");
    }
}

/// The multi-tensor launches (`kernels/train_ops.cu`: `adamw_many`, `square_sums_many`).
#[cfg(feature = "cuda")]
mod many {
    use candle_core::cuda::WrapErr;
    use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
    use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::{CudaDevice, Device, Result, Storage, Tensor};

    use super::{AdamWStep, ManyItem};
    use crate::cuda::TRAIN_OPS_PTX;
    use crate::cuda::train::MODULE;

    /// Elements of a chunk (`MANY_CHUNK`) and threads of a block (`MANY_THREADS`).
    const MANY_CHUNK: usize = 65_536;
    const MANY_THREADS: u32 = 256;

    /// The CUDA device every tensor is on, if they are all on one.
    pub(super) fn one_cuda_device<'a>(
        mut tensors: impl Iterator<Item = &'a Tensor>,
    ) -> Option<CudaDevice> {
        let first = tensors.next()?;
        let Device::Cuda(d) = first.device() else {
            return None;
        };
        tensors
            .all(|t| t.device().same_device(first.device()))
            .then(|| d.clone())
    }

    /// The device address of a contiguous f32 tensor's first element, on `device`.
    fn address(t: &Tensor, device: &CudaDevice) -> Result<CUdeviceptr> {
        if !t.device().same_device(&Device::Cuda(device.clone())) {
            candle_core::bail!("adamw: tensors on more than one device");
        }
        let (storage, layout) = t.storage_and_layout();
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("adamw: tensors must be contiguous");
        };
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("adamw: a tensor off the GPU");
        };
        let stream = device.cuda_stream();
        let (ptr, _record) = s.as_cuda_slice::<f32>()?.device_ptr(&stream);
        Ok(ptr + (start * std::mem::size_of::<f32>()) as CUdeviceptr)
    }

    /// The table of `ManyTensor`s (48 bytes each, the kernel's layout) and the chunks
    /// ((tensor, chunk) pairs) of tensors of `n[k]` elements, on the device.
    fn tables(
        device: &CudaDevice,
        rows: &[[CUdeviceptr; 4]],
        n: &[usize],
        shrink: &[f32],
    ) -> Result<(CudaSlice<u8>, CudaSlice<i32>, i32)> {
        let mut table = Vec::with_capacity(rows.len() * 48);
        let mut chunks = Vec::new();
        for (k, (ptrs, (&len, &sh))) in rows.iter().zip(n.iter().zip(shrink)).enumerate() {
            for p in ptrs {
                table.extend_from_slice(&p.to_le_bytes());
            }
            table.extend_from_slice(&(len as u64).to_le_bytes());
            table.extend_from_slice(&sh.to_le_bytes());
            table.extend_from_slice(&0f32.to_le_bytes());
            for c in 0..len.div_ceil(MANY_CHUNK) {
                chunks.extend([k as i32, c as i32]);
            }
        }
        let count = i32::try_from(chunks.len() / 2)
            .map_err(|_| candle_core::Error::Msg("adamw: too many chunks".into()))?;
        chunks.extend([0, 0]); // never empty: CUDA refuses a zero-byte allocation
        table.extend_from_slice(&[0u8; 48]);
        let stream = device.cuda_stream();
        Ok((
            stream.clone_htod(&table).w()?,
            stream.clone_htod(&chunks).w()?,
            count,
        ))
    }

    /// The multi-tensor step of `items`, the bits into `host` (one transfer when the items'
    /// ranges `cover` it, else a copy per range).
    pub(super) fn adamw(
        device: &CudaDevice,
        items: &[ManyItem],
        c: &AdamWStep,
        host: &mut [u8],
        cover: bool,
    ) -> Result<()> {
        let n: Vec<usize> = items.iter().map(|it| it.param.elem_count()).collect();
        let stream = device.cuda_stream();
        let exports = items.iter().any(|it| it.out.is_some());
        // A device copy of `host`'s bytes: each exported parameter's bits at its range.
        let bits: CudaSlice<u16> = stream
            .alloc_zeros(if exports { (host.len() / 2).max(1) } else { 1 })
            .w()?;
        let (bits_at, _record) = bits.device_ptr(&stream);
        let mut rows = Vec::with_capacity(items.len());
        for it in items {
            let out = match &it.out {
                Some(r) => bits_at + r.start as CUdeviceptr,
                None => 0,
            };
            rows.push([
                address(it.param, device)?,
                address(it.grad, device)?,
                address(it.moments, device)?,
                out,
            ]);
        }
        let shrink: Vec<f32> = items.iter().map(|it| it.shrink).collect();
        let (table, chunks, count) = tables(device, &rows, &n, &shrink)?;
        if count > 0 {
            let func = device.get_or_load_custom_func("adamw_many", MODULE, TRAIN_OPS_PTX)?;
            let scalars = [c.beta1, c.beta2, c.grad_scale, c.lr, c.eps, c.s1, c.s2];
            let mut b = func.builder();
            b.arg(&table).arg(&chunks).arg(&count);
            for v in &scalars {
                b.arg(v);
            }
            let cfg = LaunchConfig {
                grid_dim: ((count as u32).min(65_535), 1, 1),
                block_dim: (MANY_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: adamw_many (tensors, chunks, n_chunks, b1, b2, gs, lr, eps, s1, s2):
            // the table holds each item's parameter, gradient and (2, n) moments addresses
            // (sizes checked by `adamw_step_many`) and its range of `bits` (2n bytes inside
            // it, checked there too), which outlives the launch; every chunk lies inside
            // its tensor.
            unsafe { b.launch(cfg) }.w()?;
        }
        if !exports {
            return Ok(());
        }
        if cover {
            // SAFETY: `bits` holds host.len() bytes (rounded up to whole values: the
            // ranges are 2n bytes at even offsets and cover `host`) and lives until the
            // download, which waits for the launch on the same stream, has returned.
            return unsafe { crate::cuda::download(device, bits_at, host) };
        }
        stream.context().bind_to_thread().w()?;
        for it in items {
            if let Some(r) = &it.out {
                // SAFETY: the range is inside `host` and holds this item's 2n bytes
                // (checked), which are the same range of `bits`; the copy is on the
                // kernels' stream, after the launch, and ends before `synchronize`
                // returns below.
                unsafe {
                    candle_core::cuda::cudarc::driver::result::memcpy_dtoh_async(
                        &mut host[r.clone()],
                        bits_at + r.start as CUdeviceptr,
                        stream.cu_stream(),
                    )
                }
                .w()?;
            }
        }
        stream.synchronize().w()
    }

    pub(super) fn square_sums(device: &CudaDevice, grads: &[&Tensor]) -> Result<f64> {
        let n: Vec<usize> = grads.iter().map(|g| g.elem_count()).collect();
        let rows = grads
            .iter()
            .map(|g| Ok([0, address(g, device)?, 0, 0]))
            .collect::<Result<Vec<_>>>()?;
        let (table, chunks, count) = tables(device, &rows, &n, &vec![1.0; n.len()])?;
        if count == 0 {
            return Ok(0.0);
        }
        let stream = device.cuda_stream();
        let mut partial: CudaSlice<f32> = stream.alloc_zeros(count as usize).w()?;
        let func = device.get_or_load_custom_func("square_sums_many", MODULE, TRAIN_OPS_PTX)?;
        let mut b = func.builder();
        b.arg(&table).arg(&chunks).arg(&count).arg(&mut partial);
        let cfg = LaunchConfig {
            grid_dim: (count as u32, 1, 1),
            block_dim: (MANY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: square_sums_many (tensors, chunks, n_chunks, partial): the table holds
        // each gradient's address and length, `partial` one float per chunk.
        unsafe { b.launch(cfg) }.w()?;
        let sums = stream.clone_dtoh(&partial).w()?;
        Ok(sums.iter().map(|&s| f64::from(s)).sum())
    }
}
