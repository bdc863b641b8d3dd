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
pub fn adamw_step(param: &Tensor, grad: &Tensor, moments: &Tensor, step: &AdamWStep) -> Result<()> {
    let n = param.elem_count();
    if grad.elem_count() != n || moments.dims() != [2, n] {
        candle_core::bail!(
            "adamw: parameter {:?}, gradient {:?}, moments {:?}",
            param.dims(),
            grad.dims(),
            moments.dims()
        );
    }
    if n == 0 {
        return Ok(()); // nothing to update (candle refuses in-place ops on empty tensors)
    }
    if param.device().is_cuda() && !crate::kernels::enabled(crate::kernels::Kernel::TrainOps) {
        return composed(param, grad, moments, step);
    }
    moments.inplace_op2(&grad.contiguous()?, &AdamWMoments(*step))?;
    param.inplace_op2(moments, &AdamWParam(*step))
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
                    adamw_step(&p, &g, &mv, &step)?;
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
