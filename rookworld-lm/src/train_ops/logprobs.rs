//! The head's target log-probs, the op in one place: [`target_logprobs`]
//! (`log softmax(logits / τ)[y]` per row) whose backward [`TargetLogprobsBwd`] needs only the
//! logits (the (N, V) softmax is never kept), the CPU implementation and, with the `cuda`
//! feature, its kernels' launches, checked against the CPU.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::fwd_impls;
use super::{Cpu, f32s, out, u32s};

/// `log softmax(logits_n / τ)[y_n]` per row of logits (N, V); `inv_t` = 1/τ.
pub fn cpu_forward(logits: &[f32], targets: &[u32], v: usize, inv_t: f32) -> Vec<f32> {
    logits
        .par_chunks(v)
        .zip(targets)
        .map(|(row, &y)| {
            let z = |j: usize| f64::from(row[j]) * f64::from(inv_t);
            let max = (0..v).map(z).fold(f64::NEG_INFINITY, f64::max);
            let lse = max + (0..v).map(|j| (z(j) - max).exp()).sum::<f64>().ln();
            (z(y as usize) - lse) as f32
        })
        .collect()
}

/// Its backward, given each row's result ℓ_n and incoming gradient g_n as (N, 2):
/// `dlogits_{n,v} = g_n/τ · (1[v = y_n] − p_{n,v})`, with p recovered from ℓ as
/// `p_{n,v} = exp(logits_{n,v}/τ − lse_n)`, `lse_n = logits_{n,y_n}/τ − ℓ_n`.
pub fn cpu_backward(
    logits: &[f32],
    targets: &[u32],
    result_grad: &[f32],
    v: usize,
    inv_t: f32,
) -> Vec<f32> {
    let mut out = vec![0f32; logits.len()];
    let rows = logits.par_chunks(v).zip(out.par_chunks_mut(v)).enumerate();
    rows.for_each(|(n, (row, o))| {
        let (y, lp, g) = (
            targets[n] as usize,
            result_grad[2 * n],
            result_grad[2 * n + 1],
        );
        let inv_t = f64::from(inv_t);
        let lse = f64::from(row[y]) * inv_t - f64::from(lp);
        let scale = f64::from(g) * inv_t;
        for (j, o) in o.iter_mut().enumerate() {
            let p = (f64::from(row[j]) * inv_t - lse).exp();
            *o = (scale * (f64::from(u8::from(j == y)) - p)) as f32;
        }
    });
    out
}

/// `log softmax(logits / temperature)[target]` per row: logits (N, V) f32, targets (N)
/// u32 → (N), differentiable in the logits.
pub fn target_logprobs(logits: &Tensor, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    let inv_t = (1.0 / temperature) as f32;
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, TargetLogprobs { inv_t })
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
        out(cpu_forward(logits, targets, v, self.inv_t), n)
    }
}

impl CustomOp2 for TargetLogprobs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fwd_impls!(2, cpu, cuda::target_logprobs);

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
        let d = cpu_backward(logits, targets, rg, v, self.inv_t);
        out(d, (n, v))
    }
}

impl CustomOp3 for TargetLogprobsBwd {
    fn name(&self) -> &'static str {
        "target-logprobs-bwd"
    }

    fwd_impls!(3, cpu, cuda::target_logprobs_bwd);
}

/// The kernels' launches (`kernels/train_ops.cu`).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaStorage, WrapErr};
    use candle_core::{Result, Shape};

    use super::{TargetLogprobs, TargetLogprobsBwd, target_dims};
    use crate::cuda::train::{Arg, MODULE, REDUCE_THREADS, THREADS, done, empty};
    use crate::cuda::{TRAIN_OPS_PTX, output, slice};

    pub(in crate::train_ops) fn target_logprobs(
        op: &TargetLogprobs,
        (l, ll): Arg,
        (t, tl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, v) = target_dims(ll, tl)?;
        let device = l.device().clone();
        if n == 0 {
            return empty(device, n);
        }
        let func = device.get_or_load_custom_func("target_logprobs_fwd", MODULE, TRAIN_OPS_PTX)?;
        let mut out = output::<f32>(&device, n)?; // block n writes out[n]
        {
            let (lv, tv) = (slice::<f32>(l, ll)?, slice::<u32>(t, tl)?);
            let (n_arg, v_arg) = (n as i32, v as i32);
            let mut b = func.builder();
            b.arg(&lv)
                .arg(&tv)
                .arg(&mut out)
                .arg(&n_arg)
                .arg(&v_arg)
                .arg(&op.inv_t);
            let cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (REDUCE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (logits, targets, out, N, V, inv_t); block n reads row n (targets clamped
            // into the row), writes out[n].
            unsafe { b.launch(cfg) }.w()?;
        }
        done(out, device, n)
    }

    pub(in crate::train_ops) fn target_logprobs_bwd(
        op: &TargetLogprobsBwd,
        (l, ll): Arg,
        (t, tl): Arg,
        (rg, rgl): Arg,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, v) = target_dims(ll, tl)?;
        if rgl.shape().elem_count() != 2 * n {
            candle_core::bail!(
                "target-logprobs-bwd: result/gradient {:?} for {n} rows",
                rgl.dims()
            );
        }
        let device = l.device().clone();
        if n * v == 0 {
            return empty(device, (n, v));
        }
        let func = device.get_or_load_custom_func("target_logprobs_bwd", MODULE, TRAIN_OPS_PTX)?;
        let mut out = output::<f32>(&device, n * v)?; // thread (v, n) writes d[n, v]
        {
            let (lv, tv, rv) = (
                slice::<f32>(l, ll)?,
                slice::<u32>(t, tl)?,
                slice::<f32>(rg, rgl)?,
            );
            let (n_arg, v_arg) = (n as i32, v as i32);
            let mut b = func.builder();
            b.arg(&lv)
                .arg(&tv)
                .arg(&rv)
                .arg(&mut out)
                .arg(&n_arg)
                .arg(&v_arg)
                .arg(&op.inv_t);
            let cfg = LaunchConfig {
                grid_dim: ((v as u32).div_ceil(THREADS), n.min(65_535) as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (logits, targets, rg, d, N, V, inv_t); the grid covers V and strides over
            // N, each thread writing its own elements.
            unsafe { b.launch(cfg) }.w()?;
        }
        done(out, device, (n, v))
    }
}
