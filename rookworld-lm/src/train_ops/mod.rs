//! The training forward's hot ops as candle custom ops with hand-written backwards, so the
//! autograd path (what trains on CUDA) launches one kernel per op and keeps one tensor for
//! its backward, where the composed ops launch several each and keep every intermediate:
//!
//! - [`layer_norm()`]: `(x − μ)/√(σ² + eps) · w + b`; backward [`LayerNormDx`] and the
//!   parameters' partial sums [`LayerNormParams`];
//! - [`bias_gelu`]: `gelu_new(x + b)` (the decode step's op, given a backward);
//! - [`masked_softmax`]: attention's `softmax(scale · s + bias)` with its backward
//!   `scale · p ⊙ (dp − Σ p ⊙ dp)`;
//! - [`target_logprobs`]: `log softmax(logits / τ)[y]` per row, whose backward needs only
//!   the logits (the (N, V) softmax is never kept);
//! - [`adamw::adamw_step`]: the optimizer's step on the parameter's device, moments kept
//!   there;
//! - [`mixed_linear`] and [`mixed_matmul`]: `x · W (+ b)` under BF16 mixed precision in one
//!   GEMM with BF16 operands and an f32 result (CUDA; the CPU keeps the composed path).
//!
//! One module per op ([`mod@layer_norm`], [`gelu`], [`softmax`], [`logprobs`], [`adamw`],
//! [`linear`]),
//! each with the candle op, its CPU implementation (the reference; layer norm's and GELU's
//! are also what the learner's fused pass runs) and, with the `cuda` feature, its launches
//! of `kernels/train_ops.cu`. f32 only: mixed precision keeps these in f32 by design. The
//! model uses them when [`crate::Gpt2::set_train_ops`] is on (the learner's trainable
//! policy: CUDA, and the CPU where the fused pass does not apply); tested against the composed ops' values and gradients in `tests/integration/train_ops.rs`.

pub mod adamw;
pub mod gelu;
pub mod layer_norm;
pub mod linear;
pub mod logprobs;
pub mod softmax;

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

pub(crate) use gelu::bias_gelu_grads;
pub use gelu::{BiasGeluBwd, bias_gelu};
pub use layer_norm::{LayerNorm, LayerNormDx, LayerNormParams, layer_norm};
pub(crate) use linear::applies as mixed_applies;
pub use linear::{MixedLinear, MixedMatmul, mixed_linear, mixed_matmul};
pub use logprobs::{TargetLogprobs, TargetLogprobsBwd, target_dims, target_logprobs};
pub use softmax::{MaskedSoftmax, SoftmaxBwd, SoftmaxGeometry, masked_softmax};

/// Whether the training ops take `t`: f32, on the CPU or (with the feature) CUDA. On
/// CUDA the caller has asked its device's verdict first ([`crate::Gpt2::train_ops`]:
/// the `train_ops` kernels passed their start-up check).
pub fn supported(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && (t.device().is_cpu() || t.device().is_cuda())
}

/// A contiguous f32 operand of a CPU op.
pub(crate) fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: operands must be contiguous f32"),
    }
}

/// A contiguous u32 operand of a CPU op.
pub(crate) fn u32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: targets must be contiguous u32"),
    }
}

pub(crate) fn out(values: Vec<f32>, shape: impl Into<Shape>) -> Result<(CpuStorage, Shape)> {
    Ok((CpuStorage::F32(values), shape.into()))
}

/// Rows of a (…, E) tensor, checked against a parameter of width E (the CUDA launches
/// check with it too).
pub(crate) fn rows_of(l: &Layout, e: usize, op: &str) -> Result<usize> {
    let dims = l.dims();
    if dims.last() != Some(&e) || e == 0 {
        candle_core::bail!("{op}: input {dims:?} does not end in the parameters' width {e}");
    }
    Ok(l.shape().elem_count() / e)
}

/// Implements a custom op's `cpu_fwd` and (with the feature) `cuda_fwd` by delegation.
macro_rules! fwd_impls {
    (2, $cpu:ident, $cuda:path) => {
        fn cpu_fwd(
            &self,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            self.$cpu((s1, l1), (s2, l2))
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            $cuda(self, (s1, l1), (s2, l2))
        }
    };
    (3, $cpu:ident, $cuda:path) => {
        fn cpu_fwd(
            &self,
            s1: &CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
            s3: &CpuStorage,
            l3: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            self.$cpu((s1, l1), (s2, l2), (s3, l3))
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
            s3: &candle_core::CudaStorage,
            l3: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            $cuda(self, (s1, l1), (s2, l2), (s3, l3))
        }
    };
}
pub(crate) use fwd_impls;

pub(crate) type Cpu<'a> = (&'a CpuStorage, &'a Layout);

/// Each training op on zero rows, forward and backward, and AdamW on zero elements.
/// What the GPU self-check reports as `empty_rows`; the CPU tests run it too.
pub fn check_empty_rows(device: &candle_core::Device) -> Result<()> {
    use crate::train_ops;
    use adamw::{AdamWStep, adamw_step};
    use candle_core::Var;
    let (e, v) = (768, 50_257);
    let var = |shape: (usize, usize)| Var::zeros(shape, DType::F32, device);
    let ones = |n: usize| Tensor::ones(n, DType::F32, device);
    let x = var((0, e))?;
    let y = train_ops::layer_norm(x.as_tensor(), &ones(e)?, &ones(e)?, 1e-5)?;
    let h = var((0, 4 * e))?;
    let g = train_ops::bias_gelu(h.as_tensor(), &ones(4 * e)?)?;
    let l = var((0, v))?;
    let targets = Tensor::zeros(0, DType::U32, device)?;
    let lp = train_ops::target_logprobs(l.as_tensor(), &targets, 1.0)?;
    let w = Var::zeros((e, 4 * e), DType::F32, device)?;
    let p = train_ops::mixed_linear(x.as_tensor(), w.as_tensor(), &ones(4 * e)?)?;
    let loss = (y.sum_all()? + g.sum_all()? + lp.sum_all()? + p.sum_all()?)?;
    let grads = loss.backward()?;
    if grads.get(w.as_tensor()).map(|g| g.dims().to_vec()) != Some(vec![e, 4 * e]) {
        candle_core::bail!("a mixed product over zero rows has no (zero) weight gradient");
    }
    for t in [&x, &h, &l] {
        let grad = grads.get(t.as_tensor());
        if grad.is_some_and(|g| g.elem_count() != 0) {
            candle_core::bail!("a gradient of an empty input is not empty");
        }
    }
    let step = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        shrink: 1.0,
        s1: 1.0,
        s2: 1.0,
        grad_scale: 1.0,
    };
    let empty = Tensor::zeros(0, DType::F32, device)?;
    adamw_step(
        &empty,
        &empty,
        &Tensor::zeros((2, 0), DType::F32, device)?,
        &step,
        &crate::kernels::Kernels::every(),
    )?;
    device.synchronize()
}
