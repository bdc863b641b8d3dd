//! Target log-probs through the LM head without materialising the logits, as a candle op
//! (the kernels are `crate::cpu::head`'s).
//!
//! Training needs, per predicted slot n, `log softmax(h_n·Wᵀ / τ)[y_n]`. Computed the
//! plain way this builds several (N, V) tensors (logits, scaled logits, exponentials, …)
//! and keeps them for the backward — with V = 50257 that is most of a training step's
//! memory traffic on a CPU. [`head_logprobs`] is one custom op instead: the forward walks
//! the rows in blocks whose logits fit in cache-sized buffers and keeps only the result;
//! the backward recomputes each block's logits and forms
//!
//! ```text
//! ∂ℓ_n/∂logits_{n,v} = g_n · (1[v = y_n] − p_{n,v}) / τ,   p_n = softmax(h_n·Wᵀ / τ)
//! ∂/∂h_n = Σ_v ∂ℓ_n/∂logits_{n,v} · W_v       ∂/∂W_v = Σ_n ∂ℓ_n/∂logits_{n,v} · h_n
//! ```
//!
//! block by block. Off the CPU (or in another dtype) the plain graph is used.

use candle_core::{CpuStorage, CustomOp3, D, DType, Layout, Result as CandleResult, Shape, Tensor};

use crate::cpu::head::{HeadGrads, backward_rows, logprobs_rows};
use crate::cpu::ops::Matmuls;

/// `log softmax(hidden · headᵀ / temperature)[target]` for every row: hidden (N, E),
/// head (V, E), targets (N) u32 → (N) f32. Differentiable in `hidden` and `head`.
pub fn head_logprobs(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let (n, e) = hidden.dims2()?;
    let (_, e2) = head.dims2()?;
    if e != e2 || targets.dims1()? != n {
        candle_core::bail!(
            "head_logprobs: hidden {:?}, head {:?}, targets {:?}",
            hidden.shape(),
            head.shape(),
            targets.shape()
        );
    }
    let fused = hidden.device().is_cpu()
        && hidden.dtype() == DType::F32
        && head.dtype() == DType::F32
        && targets.dtype() == DType::U32;
    if !fused {
        return plain_head_logprobs(hidden, head, targets, temperature);
    }
    hidden.contiguous()?.apply_op3(
        &head.contiguous()?,
        &targets.contiguous()?,
        HeadLogprobs { temperature },
    )
}

/// The same through candle's own ops, materialising the (N, V) logits.
pub fn plain_head_logprobs(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> CandleResult<Tensor> {
    let logits = (hidden.matmul(&head.t()?)?.to_dtype(DType::F32)? / temperature)?; // (N, V)
    let picked = logits
        .gather(&targets.unsqueeze(1)?, D::Minus1)?
        .squeeze(D::Minus1)?; // (N)
    picked - logits.log_sum_exp(D::Minus1)? // (N)
}

struct HeadLogprobs {
    temperature: f64,
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> CandleResult<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("head_logprobs: {what} must be contiguous f32"),
    }
}

impl CustomOp3 for HeadLogprobs {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CandleResult<(CpuStorage, Shape)> {
        let hidden = f32_slice(s1, l1, "hidden")?;
        let head = f32_slice(s2, l2, "head")?;
        let (n, e) = l1.shape().dims2()?;
        let (v, _) = l2.shape().dims2()?;
        let targets = match (s3, l3.contiguous_offsets()) {
            (CpuStorage::U32(t), Some((a, b))) => &t[a..b],
            _ => candle_core::bail!("head_logprobs: targets must be contiguous u32"),
        };
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("head_logprobs: target {bad} outside the vocabulary of {v}");
        }
        let out = logprobs_rows(
            hidden,
            head,
            targets,
            e,
            self.temperature,
            &mut Vec::new(),
            false,
            None,
            Matmuls::F32,
        );
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> CandleResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, e) = hidden.dims2()?;
        let (v, _) = head.dims2()?;
        let h = hidden.flatten_all()?.to_vec1::<f32>()?;
        let w = head.flatten_all()?.to_vec1::<f32>()?;
        let y = targets.to_vec1::<u32>()?;
        let g = grad_res.to_vec1::<f32>()?;
        let mut grad_h = vec![0f32; n * e];
        let mut grad_w = vec![0f32; v * e];
        backward_rows(
            HeadGrads {
                hidden: &mut grad_h,
                head: &mut grad_w,
            },
            (&h, &w, &y, &g),
            e,
            self.temperature,
            None,
            Matmuls::F32,
        );
        let device = hidden.device();
        Ok((
            Some(Tensor::from_vec(grad_h, (n, e), device)?),
            Some(Tensor::from_vec(grad_w, (v, e), device)?),
            None,
        ))
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Deterministic pseudo-random values in [−scale, scale].
    fn values(len: usize, salt: f32, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|i| scale * ((i as f32 * 12.9898 + salt).sin() * 43758.547).fract())
            .collect()
    }

    fn inputs(n: usize, e: usize, v: usize) -> (Var, Var, Tensor) {
        let cpu = Device::Cpu;
        let h = Tensor::from_vec(values(n * e, 0.3, 2.0), (n, e), &cpu).unwrap();
        let w = Tensor::from_vec(values(v * e, 1.7, 1.0), (v, e), &cpu).unwrap();
        let y: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 3) % v as u32).collect();
        (
            Var::from_tensor(&h).unwrap(),
            Var::from_tensor(&w).unwrap(),
            Tensor::new(y, &cpu).unwrap(),
        )
    }

    fn max_abs(a: &Tensor) -> f32 {
        a.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Largest difference relative to the largest magnitude.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        max_abs(&(a - b).unwrap()) / max_abs(b).max(1e-12)
    }

    #[test]
    fn row_entropies_equal_the_softmax_s_own() {
        let (n, e, v) = (5, 8, 3000);
        let (h, w, y) = inputs(n, e, v);
        for (temperature, keeping) in [(1.0, false), (0.7, true)] {
            let (hv, wv) = (
                h.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                w.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            let mut entropy = Vec::new();
            let targets = y.to_vec1::<u32>().unwrap();
            let (mut buf, rows) = (Vec::new(), n);
            let _ = logprobs_rows(
                &hv,
                &wv,
                &targets,
                e,
                temperature,
                &mut buf,
                keeping,
                Some(&mut entropy),
                Matmuls::F32,
            );
            assert_eq!(entropy.len(), rows);
            let logits =
                (h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap() / temperature).unwrap();
            let logp = candle_nn::ops::log_softmax(&logits, 1).unwrap();
            let want = (logp.exp().unwrap() * &logp)
                .unwrap()
                .sum(1)
                .unwrap()
                .neg()
                .unwrap();
            for (got, want) in entropy.iter().zip(want.to_vec1::<f32>().unwrap()) {
                assert!(
                    (got - want).abs() < 1e-4 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn fused_values_and_gradients_equal_the_plain_graph() {
        // V large enough that the rows span several blocks.
        let (n, e, v) = (37, 8, 300_000);
        let (h, w, y) = inputs(n, e, v);
        let weights = Tensor::from_vec(values(n, 5.1, 1.0), n, &Device::Cpu).unwrap();
        for temperature in [1.0, 0.7] {
            let fused = head_logprobs(&h, &w, &y, temperature).unwrap();
            let plain = plain_head_logprobs(&h, &w, &y, temperature).unwrap();
            assert!(rel_diff(&fused, &plain) < 1e-5, "values");
            let gf = (&fused * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gp = (&plain * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for var in [&h, &w] {
                let (a, b) = (gf.get(var).unwrap(), gp.get(var).unwrap());
                assert!(rel_diff(a, b) < 1e-4, "gradient {}", rel_diff(a, b));
            }
        }
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() {
        let (h, w, _) = inputs(2, 4, 10);
        let y = Tensor::new(&[1u32, 10], &Device::Cpu).unwrap();
        let err = head_logprobs(&h, &w, &y, 1.0).unwrap_err().to_string();
        assert!(err.contains("outside the vocabulary"), "{err}");
    }
}
