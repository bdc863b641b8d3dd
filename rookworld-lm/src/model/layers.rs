//! The layers of GPT-2: Conv1D, layer norm, attention (full and grouped decode), MLP and
//! the pre-norm residual block (shape letters as in the module above).

use std::sync::Arc;

use candle_core::{D, DType, Tensor};
use candle_nn::VarBuilder;

use super::tensors::{packed_matmul, repack_or_pack, tracked, with_values};
use crate::bf16_payload::StoredValues;
use crate::cache::LayerCache;
use crate::config::{Activation, Config};
use crate::cpu_gemm::{Epilogue, PackedMatrix, PanelDtype};
use crate::decode_ops::{AddLayerNorm, BiasGelu, QkvSplit};
use crate::grouped::{GroupedLayer, StepPlan, with_zero_row};
use crate::train_ops;

/// `a · b` with both inputs cast to `compute` and the product cast back to `a`'s dtype
/// (mixed precision: BF16 inputs, f32 accumulation in cuBLAS); plain `a · b` when
/// `compute` is `None` or already `a`'s dtype. Differentiable: gradients pass through the
/// casts and reach f32 weights in f32.
pub(crate) fn matmul_in(
    a: &Tensor,
    b: &Tensor,
    compute: Option<DType>,
) -> candle_core::Result<Tensor> {
    match compute {
        Some(dtype) if dtype != a.dtype() => a
            .to_dtype(dtype)?
            .matmul(&b.to_dtype(dtype)?)?
            .to_dtype(a.dtype()),
        _ => a.matmul(b),
    }
}

/// `x · W (+ b)` for a matrix x (N, in): with the training ops on under BF16 mixed
/// precision, one mixed product where that applies ([`train_ops::mixed_linear`]: BF16
/// operands, the f32 result written with its bias by the GEMM); else [`matmul_in`] and a
/// broadcast bias add.
pub(crate) fn linear_in(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    compute: Option<DType>,
    train_ops: bool,
) -> candle_core::Result<Tensor> {
    if train_ops && compute == Some(DType::BF16) && train_ops::mixed_applies(x, w) {
        return match b {
            Some(b) => train_ops::mixed_linear(x, w, b),
            None => train_ops::mixed_matmul(x, w),
        };
    }
    let y = matmul_in(x, w, compute)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Hugging Face's `Conv1D`: `y = x W + b` with `W` stored `[in, out]`.
#[derive(Debug, Clone)]
pub(crate) struct Conv1D {
    pub(crate) weight: Tensor, // (in, out)
    pub(crate) bias: Tensor,   // (out)
    /// `weight` and `bias` packed for the CPU kernel ([`Gpt2::pack_for_cpu`]); the only
    /// copy of the weight once [`Self::release_dense`] has emptied `weight`.
    pub(crate) packed: Option<Arc<PackedMatrix>>,
    /// The matmul's input dtype when it differs from the weights' ([`matmul_in`]).
    pub(crate) compute: Option<DType>,
    /// Mixed products through [`train_ops::mixed_linear`] ([`Gpt2::set_train_ops`]).
    pub(crate) train_ops: bool,
}

impl Conv1D {
    pub(crate) fn load(vb: VarBuilder, d_in: usize, d_out: usize) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get((d_in, d_out), "weight")?,
            bias: vb.get(d_out, "bias")?,
            packed: None,
            compute: None,
            train_ops: false,
        })
    }

    /// Packs the weight and bias, into the panels of the last packing when this layer
    /// holds them alone (no allocation: [`Gpt2::refill`]).
    pub(crate) fn pack(
        &mut self,
        dtype: PanelDtype,
        epilogue: Epilogue,
    ) -> candle_core::Result<()> {
        if self.dense_released() {
            candle_core::bail!("the dense weight was released: repack from stored values");
        }
        let weight = self.weight.clone(); // (in, out)
        with_values(&weight, |w| self.pack_values(w, dtype, epilogue))?
    }

    /// Packs `w`, the weight's (in, out) values in row order, with the bias.
    pub(crate) fn pack_values(
        &mut self,
        w: &[f32],
        dtype: PanelDtype,
        epilogue: Epilogue,
    ) -> candle_core::Result<()> {
        let d_out = self.bias.dim(0)?;
        let bias = self.bias.to_vec1::<f32>()?;
        let packed = repack_or_pack(
            &mut self.packed,
            dtype,
            w,
            (w.len() / d_out, d_out),
            false,
            Some(bias),
        )?;
        packed.set_epilogue(epilogue);
        Ok(())
    }

    /// [`Self::pack_values`] from the weight's stored values (a push's payload): BF16
    /// values straight into the BF16 panels this layer holds alone, anything else widened
    /// into `scratch` first.
    pub(crate) fn pack_stored(
        &mut self,
        stored: StoredValues,
        scratch: &mut Vec<f32>,
        dtype: PanelDtype,
        epilogue: Epilogue,
    ) -> candle_core::Result<()> {
        if let (StoredValues::Bf16(bits), Some(packed)) =
            (stored, self.packed.as_mut().and_then(Arc::get_mut))
            && packed.dtype() == dtype
            && packed.repack_bf16(bits, false, Some(&self.bias.to_vec1::<f32>()?))
        {
            packed.set_epilogue(epilogue);
            return Ok(());
        }
        let d_out = self.bias.dim(0)?;
        scratch.resize(stored.elem_count(), 0f32);
        if !scratch.len().is_multiple_of(d_out) {
            candle_core::bail!(
                "{} stored values for a weight of {d_out} outputs",
                scratch.len()
            );
        }
        stored.read_into(scratch)?;
        self.pack_values(scratch, dtype, epilogue)
    }

    /// Drops the dense weight once the panels hold it (inference on the CPU): `weight`
    /// becomes an empty (0, out) tensor and only the packed kernel runs this layer.
    pub(crate) fn release_dense(&mut self) -> candle_core::Result<()> {
        if self.packed.is_none() {
            candle_core::bail!("release_dense: the layer is not packed");
        }
        let d_out = self.bias.dim(0)?;
        self.weight = Tensor::zeros((0, d_out), self.weight.dtype(), self.weight.device())?;
        Ok(())
    }

    /// Whether [`Self::release_dense`] emptied the weight.
    pub(crate) fn dense_released(&self) -> bool {
        self.weight.elem_count() == 0
    }

    /// `act(x W + b)` in one pass when the packed kernel fuses `act` and applies to `x`.
    pub(crate) fn forward_fused(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Some(packed) = self
            .packed
            .as_ref()
            .filter(|p| p.epilogue() != Epilogue::None)
        else {
            return Ok(None);
        };
        let (b, t, d_in) = x.dims3()?;
        packed_matmul(packed, &x.reshape((b * t, d_in))?)?
            .map(|y| y.reshape((b, t, packed.n())))
            .transpose()
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d_in) = x.dims3()?;
        let d_out = self.bias.dim(0)?;
        if let Some(packed) = self
            .packed
            .as_ref()
            .filter(|p| p.epilogue() == Epilogue::None)
            && let Some(y) = packed_matmul(packed, &x.reshape((b * t, d_in))?)?
        {
            return y.reshape((b, t, d_out)); // (B, T, out)
        }
        if self.dense_released() {
            candle_core::bail!(
                "this layer keeps its weight only as packed panels, which take untracked f32 \
                 inputs on the CPU"
            );
        }
        let x = x.reshape((b * t, d_in))?; // (B*T, in)
        let y = linear_in(
            &x,
            &self.weight,
            Some(&self.bias),
            self.compute,
            self.train_ops,
        )?;
        y.reshape((b, t, d_out)) // (B, T, out)
    }
}

/// Layer norm over the last dimension, statistics in f32 whatever the weights' dtype.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    pub(crate) weight: Tensor, // (E)
    pub(crate) bias: Tensor,   // (E)
    pub(crate) eps: f64,
    /// Training through [`crate::train_ops::layer_norm`] ([`Gpt2::set_train_ops`]).
    pub(crate) train_ops: bool,
}

impl LayerNorm {
    /// The decode step's fused residual: s = x + (y + c), then this norm of s, for x, y
    /// (B, E) and c (E) the bias of the matmul that made y; returns (s, norm(s)).
    pub(crate) fn add_norm(
        &self,
        x: &Tensor,
        y: &Tensor,
        y_bias: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        AddLayerNorm {
            y_bias: y_bias.clone(),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            eps: self.eps as f32,
        }
        .forward(x, y)
    }

    pub(crate) fn load(vb: VarBuilder, size: usize, eps: f64) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            bias: vb.get(size, "bias")?,
            eps,
            train_ops: false,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !tracked(&self.weight) && x.is_contiguous() && !tracked(x) {
            return candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps as f32);
        }
        if self.train_ops && train_ops::supported(x) && train_ops::supported(&self.weight) {
            return train_ops::layer_norm(x, &self.weight, &self.bias, self.eps);
        }
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let mean = x.mean_keepdim(D::Minus1)?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        normed
            .to_dtype(dtype)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Attention {
    pub(crate) c_attn: Conv1D, // E -> 3E
    pub(crate) c_proj: Conv1D, // E -> E
    pub(crate) n_head: usize,
    pub(crate) head_dim: usize,
    /// The score and value matmuls' input dtype ([`matmul_in`]).
    pub(crate) compute: Option<DType>,
    /// Softmax through [`crate::train_ops::masked_softmax`] ([`Gpt2::set_train_ops`]).
    pub(crate) train_ops: bool,
}

impl Attention {
    pub(crate) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let e = cfg.n_embd;
        Ok(Self {
            c_attn: Conv1D::load(vb.pp("c_attn"), e, 3 * e)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), e, e)?,
            n_head: cfg.n_head,
            head_dim: cfg.head_dim(),
            compute: None,
            train_ops: false,
        })
    }

    /// Queries, keys and values of `x` (B, T, E): (B, H, T, D) each.
    pub(crate) fn qkv(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (h, d) = (self.n_head, self.head_dim);
        let qkv = self
            .c_attn
            .forward(x)? // (B, T, 3E)
            .reshape((b, t, 3, h, d))?
            .permute((2, 0, 3, 1, 4))?; // (3, B, H, T, D)
        Ok((
            qkv.get(0)?.contiguous()?,
            qkv.get(1)?.contiguous()?,
            qkv.get(2)?.contiguous()?,
        ))
    }

    /// `bias`: additive attention bias (B or 1, 1, T, S) in f32, `None` when every key is
    /// visible (a single new token with no padding).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        bias: Option<&Tensor>,
        cache: &mut LayerCache,
    ) -> candle_core::Result<Tensor> {
        let (b, t, e) = x.dims3()?;
        let d = self.head_dim;
        let (q, k, v) = self.qkv(x)?; // (B, H, T, D) each
        let (k, v) = cache.append(&k, &v)?; // (B, H, S, D) each

        let scale = 1.0 / (d as f64).sqrt();
        let raw = matmul_in(&q, &k.t()?, self.compute)?; // (B, H, T, S)
        let probs = match bias {
            // One kernel forward and one backward, nothing else kept.
            Some(bias) if self.train_ops && train_ops::supported(&raw) => {
                train_ops::masked_softmax(&raw, bias, scale)?
            }
            _ => {
                let scores = (raw * scale)?.to_dtype(DType::F32)?;
                let scores = match bias {
                    Some(bias) => scores.broadcast_add(bias)?,
                    None => scores,
                };
                if tracked(&scores) {
                    candle_nn::ops::softmax(&scores, D::Minus1)?
                } else {
                    candle_nn::ops::softmax_last_dim(&scores)?
                }
            }
        }
        .to_dtype(v.dtype())?; // (B, H, T, S)
        let y = matmul_in(&probs, &v, self.compute)? // (B, H, T, D)
            .transpose(1, 2)? // (B, T, H, D)
            .reshape((b, t, e))?; // (B, T, E)
        self.c_proj.forward(&y)
    }

    /// One decode step (T = 1) of rows that share their prompts' caches (see
    /// [`GroupedCache`]): each row attends to its group's prefix and its own suffix under
    /// one softmax, in f32.
    pub(crate) fn forward_grouped(
        &self,
        x: &Tensor,
        plan: &StepPlan,
        cache: &mut GroupedLayer,
    ) -> candle_core::Result<Tensor> {
        let (b, _, e) = x.dims3()?;
        let (h, d) = (self.n_head, self.head_dim);
        let (q, k, v) = self.qkv(x)?; // (B, H, 1, D) each
        let (ks, vs) = cache.append(&k, &v, plan)?; // (B, H, W, D) each
        if !tracked(&q)
            && let Some(y) = cache.fused_attention(&q, plan)?
        {
            return self.c_proj.forward(&y.reshape((b, 1, e))?); // (B, 1, E)
        }
        let (kp, vp) = cache.prefix(plan.groups)?; // (N, H, L, D) each
        let (n, _, l, _) = kp.dims4()?;
        let r = plan.group_rows;
        let scale = 1.0 / (d as f64).sqrt();
        // Rows -> group slots: (B, X) -> (N, H, R, X), empty slots zero.
        let to_groups = |t: &Tensor, x: usize| -> candle_core::Result<Tensor> {
            with_zero_row(&t.reshape((b, h * x))?)?
                .index_select(&plan.scatter, 0)? // (N·R, H·X)
                .reshape((n, r, h, x))?
                .transpose(1, 2)? // (N, H, R, X)
                .contiguous()
        };
        // Group slots -> rows: (N, H, R, X) -> (B, H, 1, X).
        let to_rows = |t: &Tensor, x: usize| -> candle_core::Result<Tensor> {
            t.transpose(1, 2)? // (N, R, H, X)
                .contiguous()?
                .reshape((n * r, h * x))?
                .index_select(&plan.gather, 0)? // (B, H·X)
                .reshape((b, h, 1, x))
        };
        let prefix_scores = (to_groups(&q, d)?.matmul(&kp.t()?)? * scale)? // (N, H, R, L)
            .to_dtype(DType::F32)?
            .broadcast_add(plan.biases()?.0)?;
        let suffix_scores = (q.matmul(&ks.t()?)? * scale)? // (B, H, 1, W)
            .to_dtype(DType::F32)?
            .broadcast_add(plan.biases()?.1)?;
        let w = suffix_scores.dim(3)?;
        let scores = Tensor::cat(&[&to_rows(&prefix_scores, l)?, &suffix_scores], 3)?; // (B, H, 1, L+W)
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(vs.dtype())?;
        let prefix_probs = to_groups(&probs.narrow(3, 0, l)?.contiguous()?, l)?; // (N, H, R, L)
        let from_prefix = to_rows(&prefix_probs.matmul(&vp)?, d)?; // (B, H, 1, D)
        let from_suffix = probs.narrow(3, l, w)?.matmul(&vs)?; // (B, H, 1, D)
        let y = (from_prefix + from_suffix)?
            .transpose(1, 2)? // (B, 1, H, D)
            .reshape((b, 1, e))?;
        self.c_proj.forward(&y)
    }
}

impl Attention {
    /// One decode step with the fused ops ([`crate::decode_ops`]): `h` (B, E) normed input;
    /// returns the projection (B, E) *without* c_proj's bias, which the following
    /// [`LayerNorm::add_norm`] adds. q is split out of c_attn's output, k and v written
    /// straight into the cache's suffix, and attention runs as one kernel.
    pub(crate) fn forward_grouped_fused(
        &self,
        h: &Tensor,
        plan: &StepPlan,
        cache: &mut GroupedLayer,
    ) -> candle_core::Result<Tensor> {
        let (b, e) = h.dims2()?;
        let qkv = h.matmul(&self.c_attn.weight)?; // (B, 3E), bias not yet added
        let bias = &self.c_attn.bias;
        let part = |part, col| QkvSplit {
            part,
            heads: self.n_head,
            col,
        };
        let q = part(0, 0).extract(&qkv, bias)?; // (B, H, 1, D)
        let (sk, sv) = cache.suffix();
        part(1, plan.cursor).write_into(&sk, &qkv, bias)?;
        part(2, plan.cursor).write_into(&sv, &qkv, bias)?;
        let Some(y) = cache.fused_attention(&q, plan)? else {
            candle_core::bail!("the fused decode step needs the fused attention kernel");
        };
        y.reshape((b, e))?.matmul(&self.c_proj.weight) // (B, E)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub(crate) c_fc: Conv1D,   // E -> I
    pub(crate) c_proj: Conv1D, // I -> E
    pub(crate) act: Activation,
    /// Bias + GELU through [`crate::train_ops::bias_gelu`] ([`Gpt2::set_train_ops`]).
    pub(crate) train_ops: bool,
}

impl Mlp {
    pub(crate) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (e, i) = (cfg.n_embd, cfg.inner_dim());
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), e, i)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), i, e)?,
            act: cfg.activation_function,
            train_ops: false,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(h) = self.c_fc.forward_fused(x)? {
            return self.c_proj.forward(&h); // (B, T, E)
        }
        if self.train_ops && self.act == Activation::GeluNew && train_ops::supported(x) {
            let (b, t, e) = x.dims3()?;
            let fc = &self.c_fc;
            let h = linear_in(&x.reshape((b * t, e))?, &fc.weight, None, fc.compute, true)?; // (B·T, I)
            let h = train_ops::bias_gelu(&h, &fc.bias)?.reshape((b, t, ()))?; // (B, T, I)
            return self.c_proj.forward(&h); // (B, T, E)
        }
        let h = self.c_fc.forward(x)?; // (B, T, I)
        let h = match self.act {
            Activation::GeluNew => h.gelu()?, // tanh approximation
            Activation::Gelu => h.gelu_erf()?,
            Activation::Relu => h.relu()?,
        };
        self.c_proj.forward(&h) // (B, T, E)
    }
}

impl Mlp {
    /// The decode step's MLP with the fused bias + GELU: `h` (B, E) → (B, E) *without*
    /// c_proj's bias (the following [`LayerNorm::add_norm`] adds it). `gelu_new` only.
    pub(crate) fn forward_fused(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        h.matmul(&self.c_fc.weight)? // (B, I)
            .apply_op2_no_bwd(&self.c_fc.bias, &BiasGelu)?
            .matmul(&self.c_proj.weight) // (B, E)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) ln_1: LayerNorm,
    pub(crate) attn: Attention,
    pub(crate) ln_2: LayerNorm,
    pub(crate) mlp: Mlp,
}

impl Block {
    /// The block's four projections under their Hugging Face names.
    pub(crate) fn convs_mut(&mut self) -> [(&'static str, &mut Conv1D); 4] {
        [
            ("attn.c_attn", &mut self.attn.c_attn),
            ("attn.c_proj", &mut self.attn.c_proj),
            ("mlp.c_fc", &mut self.mlp.c_fc),
            ("mlp.c_proj", &mut self.mlp.c_proj),
        ]
    }

    /// Sets the input dtype of every matmul of the block ([`matmul_in`]).
    pub(crate) fn set_matmul_dtype(&mut self, dtype: Option<DType>) {
        self.attn.compute = dtype;
        self.attn.c_attn.compute = dtype;
        self.attn.c_proj.compute = dtype;
        self.mlp.c_fc.compute = dtype;
        self.mlp.c_proj.compute = dtype;
    }

    /// Turns the training ops of every layer of the block on or off.
    pub(crate) fn set_train_ops(&mut self, on: bool) {
        self.ln_1.train_ops = on;
        self.attn.train_ops = on;
        self.attn.c_attn.train_ops = on;
        self.attn.c_proj.train_ops = on;
        self.mlp.c_fc.train_ops = on;
        self.mlp.c_proj.train_ops = on;
        self.ln_2.train_ops = on;
        self.mlp.train_ops = on;
    }

    pub(crate) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (e, eps) = (cfg.n_embd, cfg.layer_norm_epsilon);
        Ok(Self {
            ln_1: LayerNorm::load(vb.pp("ln_1"), e, eps)?,
            attn: Attention::load(vb.pp("attn"), cfg)?,
            ln_2: LayerNorm::load(vb.pp("ln_2"), e, eps)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }

    /// Pre-norm residual block with `attend` as its attention: x + attn(ln_1 x), then
    /// x + mlp(ln_2 x).
    pub(crate) fn forward_with(
        &self,
        x: &Tensor,
        attend: impl FnOnce(&Attention, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let x = (x + attend(&self.attn, &self.ln_1.forward(x)?)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}
