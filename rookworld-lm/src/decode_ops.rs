//! The decode step's small fused ops as candle custom ops, so a CUDA step launches one
//! kernel where the tensor path launches several and allocates: each has a CPU
//! implementation (the reference, tested here against the unfused tensor ops) and, with
//! the `cuda` feature, one launch of `kernels/decode_ops.cu`. Decode only: no backward.
//!
//! - [`QkvSplit`]: one part (q, k or v) of c_attn's (B, 3E) output plus its bias, as
//!   (B, H, ·, D): q as a new tensor, k and v written straight into the grouped cache's
//!   suffix at the step's column;
//! - [`BiasGelu`]: `gelu_new(x + b)`;
//! - [`AddLayerNorm`]: the residual `s = x + (y + c)` (c the bias of the matmul that
//!   made y) and `layer_norm(s)`, as one (2, M, E) tensor.

use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp3, Layout, Result, Shape, Tensor};
use half::bf16;

pub(crate) mod params;
pub(crate) use params::{AddLayerNorm, QkvSplit};

impl QkvSplit {
    /// Writes the part into column `col` of `dst` (at least B rows, H, C, D), in place.
    pub fn write_into(self, dst: &Tensor, qkv: &Tensor, bias: &Tensor) -> Result<()> {
        dst.inplace_op3(qkv, bias, &self)
    }

    /// The part as a new (B, H, 1, D) tensor (`col` must be 0).
    pub fn extract(self, qkv: &Tensor, bias: &Tensor) -> Result<Tensor> {
        qkv.apply_op2_no_bwd(bias, &self)
    }

    /// Calls `put(index, value)` for each element of the part, `index` its place in a
    /// (·, H, `c`, D) destination: the CPU implementation of both forms.
    fn split_cpu(
        self,
        (qkv, qkv_l): (&CpuStorage, &Layout),
        (bias, bias_l): (&CpuStorage, &Layout),
        c: usize,
        mut put: impl FnMut(usize, f32),
    ) -> Result<()> {
        let (b, e, h, d) = self.dims(qkv_l)?;
        let (x, bias) = (values(qkv, qkv_l)?, values(bias, bias_l)?);
        for r in 0..b {
            for i in 0..e {
                let (head, dim) = (i / d, i % d);
                let v = x[r * 3 * e + self.part * e + i] + bias[self.part * e + i];
                put(((r * h + head) * c + self.col) * d + dim, v);
            }
        }
        Ok(())
    }
}

impl InplaceOp3 for QkvSplit {
    fn name(&self) -> &'static str {
        "qkv-split"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        qkv: &CpuStorage,
        qkv_l: &Layout,
        bias: &CpuStorage,
        bias_l: &Layout,
    ) -> Result<()> {
        let c = dst_l.dims()[2];
        let (start, _) = contiguous(dst_l)?;
        let (qkv, bias) = ((qkv, qkv_l), (bias, bias_l));
        match dst {
            CpuStorage::F32(out) => self.split_cpu(qkv, bias, c, |i, v| out[start + i] = v),
            CpuStorage::BF16(out) => {
                self.split_cpu(qkv, bias, c, |i, v| out[start + i] = bf16::from_f32(v))
            }
            _ => candle_core::bail!("qkv-split: f32 or bf16 only"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        qkv: &candle_core::CudaStorage,
        qkv_l: &Layout,
        bias: &candle_core::CudaStorage,
        bias_l: &Layout,
    ) -> Result<()> {
        crate::cuda::ops::qkv_split(*self, (dst, dst_l), (qkv, qkv_l), (bias, bias_l))
    }
}

impl CustomOp2 for QkvSplit {
    fn name(&self) -> &'static str {
        "qkv-split"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        qkv_l: &Layout,
        bias: &CpuStorage,
        bias_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, e, h, d) = self.dims(qkv_l)?;
        let mut out = vec![0f32; b * e];
        self.split_cpu((qkv, qkv_l), (bias, bias_l), 1, |i, v| out[i] = v)?;
        Ok((storage(out, qkv), Shape::from((b, h, 1, d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        qkv_l: &Layout,
        bias: &candle_core::CudaStorage,
        bias_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::qkv_extract(*self, (qkv, qkv_l), (bias, bias_l))
    }
}

/// `gelu_new(x + b)` of x (M, N) and b (N): the MLP's bias and activation in one pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        bias: &CpuStorage,
        bias_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (mut out, bias) = (values(x, x_l)?, values(bias, bias_l)?);
        for row in out.chunks_mut(bias.len()) {
            row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
        }
        crate::simd::gelu_new_inplace(&mut out);
        Ok((storage(out, x), x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        bias: &candle_core::CudaStorage,
        bias_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::bias_gelu((x, x_l), (bias, bias_l))
    }

    /// Training's backward ([`crate::train_ops::bias_gelu`]): dz = dy · gelu_new'(x + b)
    /// for x, and Σ_rows dz for b.
    fn bwd(
        &self,
        x: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dz, db) = crate::train_ops::bias_gelu_grads(x, bias, dy)?;
        Ok((Some(dz), Some(db)))
    }
}

impl AddLayerNorm {
    /// (s, layer_norm(s)) for s = x + (y + c), each (M, E) like `x`.
    pub fn forward(&self, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        let both = x.apply_op2_no_bwd(y, self)?; // (2, M, E)
        Ok((both.get(0)?, both.get(1)?))
    }
}

impl CustomOp2 for AddLayerNorm {
    fn name(&self) -> &'static str {
        "add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        y: &CpuStorage,
        y_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, e) = x_l.shape().dims2()?;
        let (a, b) = (values(x, x_l)?, values(y, y_l)?);
        let f32s = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
        let (c, w, beta) = (f32s(&self.y_bias)?, f32s(&self.weight)?, f32s(&self.bias)?);
        let bf = matches!(x, CpuStorage::BF16(_));
        let round = |v: f32| if bf { bf16::from_f32(v).to_f32() } else { v };
        let mut out = vec![0f32; 2 * m * e];
        let (sums, norms) = out.split_at_mut(m * e);
        for ((s, n), (ra, rb)) in sums
            .chunks_mut(e)
            .zip(norms.chunks_mut(e))
            .zip(a.chunks(e).zip(b.chunks(e)))
        {
            for (i, s) in s.iter_mut().enumerate() {
                *s = round(ra[i] + round(rb[i] + c[i]));
            }
            let mean = s.iter().sum::<f32>() / e as f32;
            let var = s.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / e as f32;
            let inv = 1.0 / (var + self.eps).sqrt();
            for (i, n) in n.iter_mut().enumerate() {
                *n = (s[i] - mean) * inv * w[i] + beta[i];
            }
        }
        Ok((storage(out, x), Shape::from((2, m, e))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        y: &candle_core::CudaStorage,
        y_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::ops::add_layer_norm(self, (x, x_l), (y, y_l))
    }
}

fn contiguous(l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a fused op needs contiguous tensors".into()))
}

/// A contiguous f32 or bf16 CPU tensor's values as f32.
fn values(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, b) = contiguous(l)?;
    match s {
        CpuStorage::F32(v) => Ok(v[a..b].to_vec()),
        CpuStorage::BF16(v) => Ok(v[a..b].iter().map(|x| x.to_f32()).collect()),
        _ => candle_core::bail!("fused ops take f32 or bf16 tensors"),
    }
}

/// `vals` stored in the dtype of `like`.
fn storage(vals: Vec<f32>, like: &CpuStorage) -> CpuStorage {
    match like {
        CpuStorage::BF16(_) => CpuStorage::BF16(vals.into_iter().map(bf16::from_f32).collect()),
        _ => CpuStorage::F32(vals),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device};

    use super::*;

    fn random(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    #[test]
    fn qkv_split_is_the_models_reshape_and_permute() {
        let (b, h, d) = (3, 4, 8);
        let e = h * d;
        let (qkv, bias) = (random(&[b, 3 * e], 1), random(&[3 * e], 2));
        // The model's path: bias, then (B, 1, 3, H, D) -> (3, B, H, 1, D).
        let want = qkv
            .broadcast_add(&bias)
            .unwrap()
            .reshape((b, 1, 3, h, d))
            .unwrap()
            .permute((2, 0, 3, 1, 4))
            .unwrap();
        for part in 0..3 {
            let op = QkvSplit {
                part,
                heads: h,
                col: 0,
            };
            let got = op.extract(&qkv, &bias).unwrap();
            assert_eq!(got.dims(), &[b, h, 1, d]);
            assert_eq!(max_diff(&got, &want.get(part).unwrap()), 0.0);
            // In place at column 5 of an 8-row, 7-column buffer: only (r < B, col 5) change.
            let dst = Tensor::zeros((8, h, 7, d), DType::F32, &Device::Cpu).unwrap();
            QkvSplit { col: 5, ..op }
                .write_into(&dst, &qkv, &bias)
                .unwrap();
            let col = dst.narrow(0, 0, b).unwrap().narrow(2, 5, 1).unwrap();
            assert_eq!(max_diff(&col, &want.get(part).unwrap()), 0.0);
            let total = dst
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let in_col = col
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(total, in_col);
        }
    }

    #[test]
    fn bias_gelu_is_bias_then_gelu_new_in_both_dtypes() {
        let (x, bias) = (random(&[5, 48], 3), random(&[48], 4));
        for dtype in [DType::F32, DType::BF16] {
            let (x, bias) = (x.to_dtype(dtype).unwrap(), bias.to_dtype(dtype).unwrap());
            let want = x.broadcast_add(&bias).unwrap().gelu().unwrap();
            let got = x.apply_op2_no_bwd(&bias, &BiasGelu).unwrap();
            assert_eq!(got.dtype(), dtype);
            let tol = if dtype == DType::F32 { 1e-5 } else { 3e-2 };
            assert!(max_diff(&got, &want) < tol, "{dtype:?}");
        }
    }

    #[test]
    fn add_layer_norm_is_the_residual_add_then_layer_norm() {
        let (x, y) = (random(&[6, 64], 5), random(&[6, 64], 6));
        let (c, w, b) = (random(&[64], 9), random(&[64], 7), random(&[64], 8));
        for dtype in [DType::F32, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let op = AddLayerNorm {
                y_bias: cast(&c),
                weight: cast(&w),
                bias: cast(&b),
                eps: 1e-5,
            };
            let (sum, norm) = op.forward(&cast(&x), &cast(&y)).unwrap();
            let want_sum = (cast(&x) + cast(&y).broadcast_add(&cast(&c)).unwrap()).unwrap();
            assert_eq!(max_diff(&sum, &want_sum), 0.0);
            let s = want_sum.to_dtype(DType::F32).unwrap();
            let mean = s.mean_keepdim(D::Minus1).unwrap();
            let c = s.broadcast_sub(&mean).unwrap();
            let var = c.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = c
                .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&w)
                .unwrap()
                .broadcast_add(&b)
                .unwrap();
            let tol = if dtype == DType::F32 { 1e-5 } else { 5e-2 };
            assert!(max_diff(&norm, &want) < tol, "{dtype:?}");
        }
    }
}
