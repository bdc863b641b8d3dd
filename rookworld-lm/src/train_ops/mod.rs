//! The training forward's hot ops as candle custom ops with hand-written backwards, so the
//! autograd path (what trains on CUDA) launches one kernel per op and keeps one tensor for
//! its backward, where the composed ops launch several each and keep every intermediate:
//!
//! - [`layer_norm`]: `(x − μ)/√(σ² + eps) · w + b`; backward [`cpu::layer_norm_dx`] and
//!   the parameters' partial sums [`cpu::layer_norm_params`];
//! - [`bias_gelu`]: `gelu_new(x + b)` (the decode step's op, given a backward);
//! - [`masked_softmax`]: attention's `softmax(scale · s + bias)` with its backward
//!   `scale · p ⊙ (dp − Σ p ⊙ dp)`;
//! - [`target_logprobs`]: `log softmax(logits / τ)[y]` per row, whose backward needs only
//!   the logits (the (N, V) softmax is never kept);
//! - [`adamw::adamw_step`]: the optimizer's step on the parameter's device, moments kept
//!   there.
//!
//! Layer norm and GELU have one CPU implementation each ([`layer_norm`](mod@layer_norm),
//! [`gelu`]) that these ops and the learner's fused pass share.
//!
//! Each runs [`cpu`] on the CPU (the reference) and, with the `cuda` feature, one launch of
//! `kernels/train_ops.cu`. f32 only: mixed precision keeps these in f32 by design. The
//! model uses them when [`crate::Gpt2::set_train_ops`] is on (the learner's trainable
//! policy: CUDA, and the CPU where the fused pass does not apply); tested against the composed ops' values and gradients in `tests/train_ops.rs`.

pub mod adamw;
pub mod cpu;
pub mod gelu;
pub mod layer_norm;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::fused_ops::BiasGelu;
use cpu::SoftmaxGeometry;

/// Whether the training ops take `t`: f32, on the CPU or (with the feature) CUDA.
pub fn supported(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && (t.device().is_cpu() || t.device().is_cuda())
}

/// Layer norm over the last dimension of x (…, E), differentiable in x, w and b.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let eps = eps as f32;
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

/// `gelu_new(x + b)` for x (…, I), b (I), differentiable in both.
pub fn bias_gelu(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasGelu)
}

/// `softmax(scale · scores + bias)` over the last dimension of scores (B, H, T, S), bias
/// (B or 1, 1, T, S) f32 (a mask: not differentiated).
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let scale = scale as f32;
    scores
        .contiguous()?
        .apply_op2(&bias.contiguous()?, MaskedSoftmax { scale })
}

/// `log softmax(logits / temperature)[target]` per row: logits (N, V) f32, targets (N)
/// u32 → (N), differentiable in the logits.
pub fn target_logprobs(logits: &Tensor, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    let inv_t = (1.0 / temperature) as f32;
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, TargetLogprobs { inv_t })
}

/// A contiguous f32 operand of a CPU op.
fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: operands must be contiguous f32"),
    }
}

/// A contiguous u32 operand of a CPU op.
fn u32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [u32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::U32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("{op}: targets must be contiguous u32"),
    }
}

fn out(values: Vec<f32>, shape: impl Into<Shape>) -> Result<(CpuStorage, Shape)> {
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
    (2, $cpu:ident, $cuda:ident) => {
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
            crate::cuda::train::$cuda(self, (s1, l1), (s2, l2))
        }
    };
    (3, $cpu:ident, $cuda:ident) => {
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
            crate::cuda::train::$cuda(self, (s1, l1), (s2, l2), (s3, l3))
        }
    };
}

type Cpu<'a> = (&'a CpuStorage, &'a Layout);

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
        let y = cpu::layer_norm(f32s(x, xl, "layer-norm")?, w, b, self.eps);
        out(y, xl.shape().clone())
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fwd_impls!(3, cpu, layer_norm);

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
        out(cpu::layer_norm_dx(x, w, dy, self.eps), xl.shape().clone())
    }
}

impl CustomOp3 for LayerNormDx {
    fn name(&self) -> &'static str {
        "layer-norm-dx"
    }

    fwd_impls!(3, cpu, layer_norm_dx);
}

impl LayerNormParams {
    fn cpu(&self, (x, xl): Cpu, (dy, dyl): Cpu) -> Result<(CpuStorage, Shape)> {
        let e = *xl.dims().last().unwrap_or(&0);
        let rows = rows_of(xl, e, "layer-norm-params")?;
        let (x, dy) = (
            f32s(x, xl, "layer-norm-params")?,
            f32s(dy, dyl, "layer-norm-params")?,
        );
        let chunks = rows.div_ceil(cpu::PARAM_CHUNK);
        out(cpu::layer_norm_params(x, dy, e, self.eps), (chunks, 2, e))
    }
}

impl CustomOp2 for LayerNormParams {
    fn name(&self) -> &'static str {
        "layer-norm-params"
    }

    fwd_impls!(2, cpu, layer_norm_params);
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
        out(cpu::bias_gelu_bwd(x, b, dy), xl.shape().clone())
    }
}

impl CustomOp3 for BiasGeluBwd {
    fn name(&self) -> &'static str {
        "bias-gelu-bwd"
    }

    fwd_impls!(3, cpu, bias_gelu_bwd);
}

/// The gradients of [`bias_gelu`]: (dz, Σ_rows dz) for x (…, I), b (I).
pub(crate) fn bias_gelu_grads(x: &Tensor, b: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let dz = x.apply_op3_no_bwd(b, &dy.contiguous()?, &BiasGeluBwd)?;
    let i = b.dim(0)?;
    let db = dz.reshape(((), i))?.sum(0)?; // (I)
    Ok((dz, db))
}

/// Attention's softmax (scores, bias) → p.
#[derive(Debug, Clone, Copy)]
pub struct MaskedSoftmax {
    pub scale: f32,
}

/// Its backward (p, dp) → d scores.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxBwd {
    pub scale: f32,
}

impl MaskedSoftmax {
    /// The geometry of scores (B, H, T, S) and bias (B or 1, 1, T, S).
    pub fn geometry(scores: &Layout, bias: &Layout) -> Result<SoftmaxGeometry> {
        let (b, h, t, s) = scores.shape().dims4()?;
        let (bb, one, bt, bs) = bias.shape().dims4()?;
        if one != 1 || bt != t || bs != s || (bb != 1 && bb != b) {
            candle_core::bail!(
                "masked-softmax: bias {:?} does not fit scores {:?}",
                bias.dims(),
                scores.dims()
            );
        }
        Ok(SoftmaxGeometry {
            heads: h,
            queries: t,
            keys: s,
            bias_batch: bb,
        })
    }

    fn cpu(&self, (s, sl): Cpu, (bias, bl): Cpu) -> Result<(CpuStorage, Shape)> {
        let geom = Self::geometry(sl, bl)?;
        let (s, bias) = (
            f32s(s, sl, "masked-softmax")?,
            f32s(bias, bl, "masked-softmax")?,
        );
        out(
            cpu::masked_softmax(s, bias, geom, self.scale),
            sl.shape().clone(),
        )
    }
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fwd_impls!(2, cpu, masked_softmax);

    fn bwd(
        &self,
        _scores: &Tensor,
        _bias: &Tensor,
        p: &Tensor,
        dp: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = self.scale;
        let ds = p.apply_op2_no_bwd(&dp.contiguous()?, &SoftmaxBwd { scale })?;
        Ok((Some(ds), None))
    }
}

impl SoftmaxBwd {
    fn cpu(&self, (p, pl): Cpu, (dp, dpl): Cpu) -> Result<(CpuStorage, Shape)> {
        let keys = *pl.dims().last().unwrap_or(&1);
        if pl.dims() != dpl.dims() {
            candle_core::bail!("softmax-bwd: p {:?}, dp {:?}", pl.dims(), dpl.dims());
        }
        let (p, dp) = (f32s(p, pl, "softmax-bwd")?, f32s(dp, dpl, "softmax-bwd")?);
        out(
            cpu::softmax_bwd(p, dp, keys, self.scale),
            pl.shape().clone(),
        )
    }
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "softmax-bwd"
    }

    fwd_impls!(2, cpu, softmax_bwd);
}

/// Target log-probs (logits, targets) → (N).
#[derive(Debug, Clone, Copy)]
pub struct TargetLogprobs {
    pub inv_t: f32,
}

/// Its backward (logits, targets, (N, 2) result and gradient) → d logits.
#[derive(Debug, Clone, Copy)]
pub struct TargetLogprobsBwd {
    pub inv_t: f32,
}

/// (N, V) of logits and targets, every target inside the vocabulary (checked on the CPU;
/// the CUDA kernels clamp instead of reading outside a row).
pub fn target_dims(logits: &Layout, targets: &Layout) -> Result<(usize, usize)> {
    let (n, v) = logits.shape().dims2()?;
    if targets.shape().dims1()? != n {
        candle_core::bail!(
            "target-logprobs: logits {:?}, targets {:?}",
            logits.dims(),
            targets.dims()
        );
    }
    Ok((n, v))
}

fn check_targets(targets: &[u32], v: usize) -> Result<()> {
    match targets.iter().find(|&&t| t as usize >= v) {
        Some(bad) => candle_core::bail!("target {bad} outside the vocabulary of {v}"),
        None => Ok(()),
    }
}

impl TargetLogprobs {
    fn cpu(&self, (l, ll): Cpu, (t, tl): Cpu) -> Result<(CpuStorage, Shape)> {
        let (n, v) = target_dims(ll, tl)?;
        let targets = u32s(t, tl, "target-logprobs")?;
        check_targets(targets, v)?;
        let logits = f32s(l, ll, "target-logprobs")?;
        out(cpu::target_logsoftmax(logits, targets, v, self.inv_t), n)
    }
}

impl CustomOp2 for TargetLogprobs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fwd_impls!(2, cpu, target_logprobs);

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rg = Tensor::stack(&[res, grad], 1)?; // (N, 2)
        let inv_t = self.inv_t;
        let d = logits.apply_op3_no_bwd(targets, &rg, &TargetLogprobsBwd { inv_t })?;
        Ok((Some(d), None))
    }
}

impl TargetLogprobsBwd {
    fn cpu(&self, (l, ll): Cpu, (t, tl): Cpu, (rg, rgl): Cpu) -> Result<(CpuStorage, Shape)> {
        let (n, v) = target_dims(ll, tl)?;
        let targets = u32s(t, tl, "target-logprobs-bwd")?;
        check_targets(targets, v)?;
        let rg = f32s(rg, rgl, "target-logprobs-bwd")?;
        if rg.len() != 2 * n {
            candle_core::bail!(
                "target-logprobs-bwd: {} result/gradient values for {n} rows",
                rg.len()
            );
        }
        let logits = f32s(l, ll, "target-logprobs-bwd")?;
        let d = cpu::target_logsoftmax_bwd(logits, targets, rg, v, self.inv_t);
        out(d, (n, v))
    }
}

impl CustomOp3 for TargetLogprobsBwd {
    fn name(&self) -> &'static str {
        "target-logprobs-bwd"
    }

    fwd_impls!(3, cpu, target_logprobs_bwd);
}
