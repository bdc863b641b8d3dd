//! Mixed-precision products for training, as PyTorch's BF16 autocast runs a linear layer:
//! both operands rounded to BF16, products summed in f32, the result written in f32.
//!
//! - [`mixed_matmul`]: `y = x · W` for x (M, K) and W (K, N), f32 (the LM head, W = wteᵀ);
//! - [`mixed_linear`]: `y = x · W + b`, b (N).
//!
//! On CUDA each is one `cublasGemmEx` (BF16 operands, f32 output and compute; a linear's
//! output rows are first set to its bias and the product added onto them, β = 1), where
//! the composed path ([`crate::model::layers::matmul_in`]) runs candle's BF16 matmul
//! between casts, writes a BF16 product, widens it and adds the bias with a broadcast.
//! An operand that is a transposed view (wteᵀ, and the backward's xᵀ) is cast in memory
//! order and handed to cuBLAS transposed: no strided copy.
//!
//! Backward, with g = ∂L/∂y and r(·) the rounding to BF16:
//! `∂L/∂x = r(g) · r(W)ᵀ`, `∂L/∂W = r(x)ᵀ · r(g)` (each one more mixed product) and
//! `∂L/∂b = Σ_rows g` (f32). The CPU implementation is the reference: the same roundings,
//! the products summed in f32.

use half::bf16;
use rayon::prelude::*;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::{Cpu, fwd_impls, out};

/// `x · W` in mixed precision (module doc): x (M, K), W (K, N) f32 → (M, N) f32.
pub fn mixed_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.apply_op2(w, MixedMatmul)
}

/// `x · W + b` in mixed precision (module doc): x (M, K), W (K, N), b (N) f32 → (M, N)
/// f32.
pub fn mixed_linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.apply_op3(w, b, MixedLinear)
}

/// Whether the mixed ops take `x · W` under a BF16 compute dtype: f32 matrices on a
/// CUDA device whose training ops passed the start-up check. The CPU keeps the composed
/// path (its implementation here is the reference, not a fast kernel).
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda()
        && x.rank() == 2
        && w.rank() == 2
        && w.dtype() == DType::F32
        && super::supported(x)
}

/// The op behind [`mixed_matmul`].
#[derive(Debug, Clone, Copy)]
pub struct MixedMatmul;

/// The op behind [`mixed_linear`].
#[derive(Debug, Clone, Copy)]
pub struct MixedLinear;

impl MixedMatmul {
    fn cpu(&self, x: Cpu, w: Cpu) -> Result<(CpuStorage, Shape)> {
        product(x, w, None, "mixed-matmul")
    }
}

impl MixedLinear {
    fn cpu(&self, x: Cpu, w: Cpu, b: Cpu) -> Result<(CpuStorage, Shape)> {
        product(x, w, Some(b), "mixed-linear")
    }
}

impl CustomOp2 for MixedMatmul {
    fn name(&self) -> &'static str {
        "mixed-matmul"
    }

    fwd_impls!(2, cpu, cuda::mixed_matmul);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = product_grads(x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for MixedLinear {
    fn name(&self) -> &'static str {
        "mixed-linear"
    }

    fwd_impls!(3, cpu, cuda::mixed_linear);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = product_grads(x, w, g)?;
        let db = g.sum(0)?; // (N)
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `(r(g) · r(W)ᵀ, r(x)ᵀ · r(g))` for x (M, K), W (K, N), g (M, N). Where W is a
/// transposed view (the tied head's wteᵀ) its gradient is made as `(r(g)ᵀ · r(x))ᵀ`, so
/// that what flows back to the stored (N, K) matrix is contiguous.
fn product_grads(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let dx = g.apply_op2_no_bwd(&w.t()?, &MixedMatmul)?; // (M, K)
    let dw = if w.is_contiguous() {
        x.t()?.apply_op2_no_bwd(g, &MixedMatmul)? // (K, N)
    } else {
        g.t()?.apply_op2_no_bwd(x, &MixedMatmul)?.t()? // (N, K)ᵀ
    };
    Ok((dx, dw))
}

/// (rows, cols) of a 2-D operand.
fn dims2(l: &Layout, op: &str) -> Result<(usize, usize)> {
    match l.dims() {
        &[rows, cols] => Ok((rows, cols)),
        dims => candle_core::bail!("{op}: operands must be matrices, got {dims:?}"),
    }
}

/// (M, K, N) of `x · W (+ b)`, checked.
fn geometry(x: &Layout, w: &Layout, b: Option<&Layout>, op: &str) -> Result<(usize, usize, usize)> {
    let ((m, k), (k2, n)) = (dims2(x, op)?, dims2(w, op)?);
    if k != k2 {
        candle_core::bail!("{op}: x is ({m}, {k}) but W is ({k2}, {n})");
    }
    if let Some(b) = b
        && b.dims() != [n]
    {
        candle_core::bail!("{op}: the bias is {:?}, W has {n} columns", b.dims());
    }
    Ok((m, k, n))
}

/// A 2-D f32 operand of any strides, rounded to BF16, as row-major values.
fn rounded((s, l): Cpu, op: &str) -> Result<Vec<f32>> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{op}: operands must be f32");
    };
    let (rows, cols) = dims2(l, op)?;
    let (s0, s1, at) = (l.stride()[0], l.stride()[1], l.start_offset());
    Ok((0..rows * cols)
        .map(|i| bf16::from_f32(v[at + (i / cols) * s0 + (i % cols) * s1]).to_f32())
        .collect())
}

/// The reference: `r(x) · r(W) (+ b)`, each output row starting at the bias (or zero) and
/// the products added in order of k, in f32.
fn product(x: Cpu, w: Cpu, b: Option<Cpu>, op: &str) -> Result<(CpuStorage, Shape)> {
    let (m, k, n) = geometry(x.1, w.1, b.map(|b| b.1), op)?;
    let (xs, ws) = (rounded(x, op)?, rounded(w, op)?);
    let bias = b.map(|b| super::f32s(b.0, b.1, op)).transpose()?;
    let mut y = vec![0f32; m * n];
    y.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        if let Some(bias) = bias {
            row.copy_from_slice(bias);
        }
        for (p, &xv) in xs[i * k..(i + 1) * k].iter().enumerate() {
            for (y, &wv) in row.iter_mut().zip(&ws[p * n..(p + 1) * n]) {
                *y += xv * wv;
            }
        }
    });
    out(y, (m, n))
}

/// The launches: one `cublasGemmEx`, after the bias rows (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::cublas::{result::gemm_ex, sys};
    use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{DType, Result, Shape};
    use half::bf16;

    use super::{MixedLinear, MixedMatmul, geometry};
    use crate::cuda::train::{Arg, MODULE, done, empty};
    use crate::cuda::{TRAIN_OPS_PTX, elementwise, output, slice};

    pub(in crate::train_ops) fn mixed_matmul(
        _: &MixedMatmul,
        x: Arg,
        w: Arg,
    ) -> Result<(CudaStorage, Shape)> {
        product(x, w, None, "mixed-matmul")
    }

    pub(in crate::train_ops) fn mixed_linear(
        _: &MixedLinear,
        x: Arg,
        w: Arg,
        b: Arg,
    ) -> Result<(CudaStorage, Shape)> {
        product(x, w, Some(b), "mixed-linear")
    }

    /// An f32 operand cast to BF16 in memory order: (the contiguous copy, whether it holds
    /// the operand transposed). A view whose transpose is contiguous (wteᵀ, xᵀ) is cast as
    /// stored; any other strides are gathered into row-major order by the cast.
    fn bf16_operand((s, l): Arg) -> Result<(CudaStorage, bool)> {
        if s.dtype() != DType::F32 {
            candle_core::bail!("mixed product: operands must be f32, got {:?}", s.dtype());
        }
        if !l.is_contiguous() {
            let stored = l.transpose(0, 1)?;
            if stored.is_contiguous() {
                return Ok((s.to_dtype(&stored, DType::BF16)?, true));
            }
        }
        Ok((s.to_dtype(l, DType::BF16)?, false))
    }

    fn product(x: Arg, w: Arg, b: Option<Arg>, op: &str) -> Result<(CudaStorage, Shape)> {
        let (m, k, n) = geometry(x.1, w.1, b.map(|b| b.1), op)?;
        let device = x.0.device().clone();
        if m * n == 0 {
            return empty(device, (m, n));
        }
        let mut y = match b {
            Some((bias, bl)) => {
                let func = device.get_or_load_custom_func("bias_rows", MODULE, TRAIN_OPS_PTX)?;
                let mut y = output::<f32>(&device, m * n)?; // the grid-stride loop covers M·N
                let bv = slice::<f32>(bias, bl)?;
                let (len, n_arg) = (m * n, n as i32);
                let mut builder = func.builder();
                builder.arg(&mut y).arg(&bv).arg(&len).arg(&n_arg);
                // SAFETY: (out, b, M·N, N); b holds N values.
                unsafe { builder.launch(elementwise(m * n)) }.w()?;
                y
            }
            None if k == 0 => device.alloc_zeros::<f32>(m * n)?,
            None => output::<f32>(&device, m * n)?, // β = 0: the product writes all of it
        };
        if k == 0 {
            return done(y, device, (m, n));
        }
        let ((x16, xt), (w16, wt)) = (bf16_operand(x)?, bf16_operand(w)?);
        // Row-major y (M, N) = x (M, K) · W (K, N) is column-major yᵀ (N, M) = Wᵀ · xᵀ.
        // A buffer holding an operand in order is its transpose in column-major terms.
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (lda, ldb) = (if wt { k } else { n }, if xt { m } else { k });
        let (alpha, beta) = (1f32, if b.is_some() { 1f32 } else { 0f32 });
        let stream = device.cuda_stream();
        let blas = device.cublas_handle();
        let (wp, w_guard) = w16.as_cuda_slice::<bf16>()?.device_ptr(&stream);
        let (xp, x_guard) = x16.as_cuda_slice::<bf16>()?.device_ptr(&stream);
        let (yp, y_guard) = y.device_ptr_mut(&stream);
        // SAFETY: W (K·N) and x (M·K) BF16 and y (M·N) f32 are device buffers of those
        // sizes on the handle's stream, the leading dimensions are their row lengths, and
        // alpha/beta are host f32 as CUBLAS_COMPUTE_32F takes them.
        unsafe {
            gemm_ex(
                *blas.handle(),
                op(wt),
                op(xt),
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                lda as i32,
                xp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                ldb as i32,
                (&beta as *const f32).cast(),
                yp as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()?;
        drop((w_guard, x_guard, y_guard));
        done(y, device, (m, n))
    }
}
