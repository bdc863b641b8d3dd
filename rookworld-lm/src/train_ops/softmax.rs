//! Attention's masked softmax, the op in one place: [`masked_softmax`] with its backward
//! [`SoftmaxBwd`] (`scale · p ⊙ (dp − Σ p ⊙ dp)`), the CPU implementation (rows in
//! parallel, f64 sums) and, with the `cuda` feature, its kernels' launches, checked
//! against the CPU.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::fwd_impls;
use super::{Cpu, f32s, out};

/// Shape of a masked softmax: scores (B, H, T, S), additive bias (B or 1, 1, T, S).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoftmaxGeometry {
    pub heads: usize,
    pub queries: usize,
    pub keys: usize,
    /// 1 when one bias serves every batch row, else B.
    pub bias_batch: usize,
}

impl SoftmaxGeometry {
    /// The bias row that score row r (of B·H·T) adds.
    pub fn bias_row(&self, r: usize) -> usize {
        (r / (self.heads * self.queries) % self.bias_batch) * self.queries + r % self.queries
    }
}

/// `p = softmax(scale · s + bias)` per row of S keys; a row whose every key is masked
/// (−∞) gets zeros.
pub fn cpu_forward(s: &[f32], bias: &[f32], geom: SoftmaxGeometry, scale: f32) -> Vec<f32> {
    let n = geom.keys;
    let mut p = vec![0f32; s.len()];
    let rows = s.par_chunks(n).zip(p.par_chunks_mut(n)).enumerate();
    rows.for_each(|(r, (row, out))| {
        let bias = &bias[geom.bias_row(r) * n..][..n];
        let z = |j: usize| f64::from(scale * row[j] + bias[j]);
        let max = (0..n).map(z).fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return;
        }
        let sum = (0..n).map(|j| (z(j) - max).exp()).sum::<f64>();
        for (j, o) in out.iter_mut().enumerate() {
            *o = ((z(j) - max).exp() / sum) as f32;
        }
    });
    p
}

/// The softmax's backward to the raw scores: `ds = scale · p ⊙ (dp − Σ p ⊙ dp)` per row.
pub fn cpu_backward(p: &[f32], dp: &[f32], keys: usize, scale: f32) -> Vec<f32> {
    let mut ds = vec![0f32; p.len()];
    let rows = p.par_chunks(keys).zip(dp.par_chunks(keys));
    rows.zip(ds.par_chunks_mut(keys))
        .for_each(|((p, dp), out)| {
            let dot = p
                .iter()
                .zip(dp)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>();
            for (j, o) in out.iter_mut().enumerate() {
                *o = (f64::from(scale) * f64::from(p[j]) * (f64::from(dp[j]) - dot)) as f32;
            }
        });
    ds
}

/// `softmax(scale · scores + bias)` over the last dimension of scores (B, H, T, S), bias
/// (B or 1, 1, T, S) f32 (a mask: not differentiated).
pub fn masked_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let scale = scale as f32;
    scores
        .contiguous()?
        .apply_op2(&bias.contiguous()?, MaskedSoftmax { scale })
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
        out(cpu_forward(s, bias, geom, self.scale), sl.shape().clone())
    }
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fwd_impls!(2, cpu, cuda::masked_softmax);

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
        out(cpu_backward(p, dp, keys, self.scale), pl.shape().clone())
    }
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "softmax-bwd"
    }

    fwd_impls!(2, cpu, cuda::softmax_bwd);
}

/// The kernels' launches (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{Result, Shape};

    use super::{MaskedSoftmax, SoftmaxBwd};
    use crate::cuda::train::{Arg, MODULE, done, empty, warp_rows};
    use crate::cuda::{TRAIN_OPS_PTX, output, slice};

    pub(in crate::train_ops) fn masked_softmax(
        op: &MaskedSoftmax,
        (s, sl): Arg,
        (bias, bl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let geom = MaskedSoftmax::geometry(sl, bl)?;
        let total = sl.shape().elem_count();
        let r = total / geom.keys.max(1);
        let device = s.device().clone();
        if total == 0 {
            return empty(device, sl.shape().clone());
        }
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

    pub(in crate::train_ops) fn softmax_bwd(
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
        if total == 0 {
            return empty(device, pl.shape().clone());
        }
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
}
