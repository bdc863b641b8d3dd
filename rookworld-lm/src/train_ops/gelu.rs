//! GPT-2's activation, the op in one place: [`bias_gelu`] (the decode step's bias + GELU
//! given a backward, [`BiasGeluBwd`]), its CPU implementation — one for every path: the
//! decode step, the learner's fused pass ([`forward`], [`backward`]) and the candle op's
//! backward ([`bias_backward`]) — and, with the `cuda` feature, its backward kernel's
//! launch, checked against the CPU.
//!
//! `gelu_new(x) = ½x(1 + tanh u)`, u = √(2/π)(x + 0.044715x³), and with t = tanh u:
//! `gelu_new'(x) = ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²)`.

use rayon::prelude::*;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::fwd_impls;
use super::{Cpu, f32s, out, rows_of};
use crate::decode_ops::BiasGelu;
use crate::simd;

/// √(2/π), GELU's tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;

/// Elements per parallel task.
const BLOCK: usize = 4096;

/// `out = gelu_new(x)`.
pub fn forward(out: &mut [f32], x: &[f32]) {
    out.par_chunks_mut(BLOCK)
        .zip(x.par_chunks(BLOCK))
        .for_each(|(o, x)| {
            o.copy_from_slice(x);
            simd::gelu_new_inplace(o);
        });
}

/// `dx = dout ⊙ gelu_new'(x)`. With `dout` `None`, `dx` holds dout and is overwritten in
/// place.
pub fn backward(dx: &mut [f32], dout: Option<&[f32]>, x: &[f32]) {
    let body = |dx: &mut [f32], dout: Option<&[f32]>, x: &[f32]| {
        let mut e = [0f32; 256];
        for (i, (dx, x)) in dx.chunks_mut(256).zip(x.chunks(256)).enumerate() {
            let e = &mut e[..x.len()];
            for (e, &x) in e.iter_mut().zip(x) {
                *e = -2.0 * GELU_C * (x + 0.044_715 * x * x * x);
            }
            simd::exp_inplace(e); // e^{−2u}
            for (j, (d, (&x, &e))) in dx.iter_mut().zip(x.iter().zip(e.iter())).enumerate() {
                let t = 2.0 / (1.0 + e) - 1.0; // tanh u
                let local =
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 0.134_145 * x * x);
                let g = dout.map_or(*d, |g| g[i * 256 + j]);
                *d = g * local;
            }
        }
    };
    match dout {
        Some(dout) => dx
            .par_chunks_mut(BLOCK)
            .zip(dout.par_chunks(BLOCK).zip(x.par_chunks(BLOCK)))
            .for_each(|(dx, (g, x))| body(dx, Some(g), x)),
        None => dx
            .par_chunks_mut(BLOCK)
            .zip(x.par_chunks(BLOCK))
            .for_each(|(dx, x)| body(dx, None, x)),
    }
}

/// The gradient of `gelu_new(x + b)` with respect to its argument z = x + b:
/// `dz = dy ⊙ gelu_new'(z)`, x and dy (M, I), b (I).
pub fn bias_backward(x: &[f32], b: &[f32], dy: &[f32]) -> Vec<f32> {
    let i = b.len();
    let mut z = x.to_vec();
    z.par_chunks_mut(i)
        .for_each(|row| row.iter_mut().zip(b).for_each(|(z, b)| *z += b));
    let mut dz = vec![0f32; x.len()];
    backward(&mut dz, Some(dy), &z);
    dz
}

/// `gelu_new(x + b)` for x (…, I), b (I), differentiable in both.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasGelu)
}

/// `gelu_new(x + b)`'s gradient to its argument (x, b, dy) → dz.
#[derive(Debug, Clone, Copy)]
pub struct BiasGeluBwd;

impl BiasGeluBwd {
    fn cpu(&self, (x, xl): Cpu, (b, bl): Cpu, (dy, dyl): Cpu) -> Result<(CpuStorage, Shape)> {
        let b = f32s(b, bl, "bias-gelu-bwd")?;
        rows_of(xl, b.len(), "bias-gelu-bwd")?;
        let (x, dy) = (
            f32s(x, xl, "bias-gelu-bwd")?,
            f32s(dy, dyl, "bias-gelu-bwd")?,
        );
        out(bias_backward(x, b, dy), xl.shape().clone())
    }
}

impl CustomOp3 for BiasGeluBwd {
    fn name(&self) -> &'static str {
        "bias-gelu-bwd"
    }

    fwd_impls!(3, cpu, cuda::bias_gelu_bwd);
}

/// The gradients of [`bias_gelu`]: (dz, Σ_rows dz) for x (…, I), b (I).
pub(crate) fn bias_gelu_grads(x: &Tensor, b: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let dz = x.apply_op3_no_bwd(b, &dy.contiguous()?, &BiasGeluBwd)?;
    let i = b.dim(0)?;
    let db = dz.reshape(((), i))?.sum(0)?; // (I)
    Ok((dz, db))
}

/// The kernels' launches (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{Result, Shape};

    use super::BiasGeluBwd;
    use crate::cuda::train::{Arg, MODULE, done, empty};
    use crate::cuda::{TRAIN_OPS_PTX, elementwise, output, slice};
    use crate::train_ops::rows_of as rows;

    pub(in crate::train_ops) fn bias_gelu_bwd(
        _: &BiasGeluBwd,
        (x, xl): Arg,
        (bias, bl): Arg,
        (dy, dyl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let n = bl.shape().elem_count();
        let m = rows(xl, n, "bias-gelu-bwd")?;
        let device = x.device().clone();
        if m * n == 0 {
            return empty(device, xl.shape().clone());
        }
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
}
