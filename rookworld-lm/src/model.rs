//! GPT-2 forward pass (RookWorld-LM-124M is GPT-2 small).
//!
//! Shape letters: B batch rows, T tokens fed in this call, P tokens already in the KV cache,
//! S = P + T keys attended to, E `n_embd`, H heads, D head width (E / H), I MLP width,
//! V vocabulary.
//!
//! The weights are immutable and hold no per-sequence state: the KV cache ([`KvCache`]) is
//! passed in, so one `Arc<Gpt2>` serves any number of sequences. Attention/MLP weights are
//! kept in Hugging Face's Conv1D layout `[in, out]`, so loading and saving are mechanical.
//! No dropout exists anywhere: training and inference run the same deterministic forward.

use std::sync::Arc;

use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use crate::cache::{KvCache, LayerCache};
use crate::config::{Activation, Config};
use crate::cpu_gemm::{Epilogue, PackedMatrix};
use crate::grouped::{GroupedCache, GroupedLayer, StepPlan, with_zero_row};
use crate::mask::LeftPadding;

/// True when gradients may flow through `t` (it is, or derives from, a trainable `Var`).
/// Fused candle ops (layer norm, last-dim softmax) have no backward pass, so tracked
/// forwards use composed, differentiable ops instead; both agree to float rounding.
fn tracked(t: &Tensor) -> bool {
    t.track_op()
}

/// Hugging Face's `Conv1D`: `y = x W + b` with `W` stored `[in, out]`.
#[derive(Debug, Clone)]
struct Conv1D {
    weight: Tensor, // (in, out)
    bias: Tensor,   // (out)
    /// `weight` and `bias` packed for the CPU kernel ([`Gpt2::pack_for_cpu`]).
    packed: Option<Arc<PackedMatrix>>,
}

impl Conv1D {
    fn load(vb: VarBuilder, d_in: usize, d_out: usize) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get((d_in, d_out), "weight")?,
            bias: vb.get(d_out, "bias")?,
            packed: None,
        })
    }

    /// Packs the weight and bias, into the panels of the last packing when this layer
    /// holds them alone (no allocation: [`Gpt2::refill`]).
    fn pack(&mut self, epilogue: Epilogue) -> candle_core::Result<()> {
        let (d_in, d_out) = self.weight.dims2()?;
        let bias = self.bias.to_vec1::<f32>()?;
        let packed = repack_or_pack(
            &mut self.packed,
            &self.weight,
            (d_in, d_out),
            false,
            Some(bias),
        )?;
        packed.set_epilogue(epilogue);
        Ok(())
    }

    /// `act(x W + b)` in one pass when the packed kernel fuses `act` and applies to `x`.
    fn forward_fused(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
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

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
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
        x.reshape((b * t, d_in))? // (B*T, in)
            .matmul(&self.weight)? // (B*T, out)
            .broadcast_add(&self.bias)?
            .reshape((b, t, d_out)) // (B, T, out)
    }
}

/// Layer norm over the last dimension, statistics in f32 whatever the weights' dtype.
#[derive(Debug, Clone)]
struct LayerNorm {
    weight: Tensor, // (E)
    bias: Tensor,   // (E)
    eps: f64,
}

impl LayerNorm {
    fn load(vb: VarBuilder, size: usize, eps: f64) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            bias: vb.get(size, "bias")?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !tracked(&self.weight) && x.is_contiguous() && !tracked(x) {
            return candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps as f32);
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
struct Attention {
    c_attn: Conv1D, // E -> 3E
    c_proj: Conv1D, // E -> E
    n_head: usize,
    head_dim: usize,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let e = cfg.n_embd;
        Ok(Self {
            c_attn: Conv1D::load(vb.pp("c_attn"), e, 3 * e)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), e, e)?,
            n_head: cfg.n_head,
            head_dim: cfg.head_dim(),
        })
    }

    /// Queries, keys and values of `x` (B, T, E): (B, H, T, D) each.
    fn qkv(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
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
    fn forward(
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
        let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?; // (B, H, T, S)
        let scores = match bias {
            Some(bias) => scores.broadcast_add(bias)?,
            None => scores,
        };
        let probs = if tracked(&scores) {
            candle_nn::ops::softmax(&scores, D::Minus1)?
        } else {
            candle_nn::ops::softmax_last_dim(&scores)?
        }
        .to_dtype(v.dtype())?; // (B, H, T, S)
        let y = probs
            .matmul(&v)? // (B, H, T, D)
            .transpose(1, 2)? // (B, T, H, D)
            .reshape((b, t, e))?; // (B, T, E)
        self.c_proj.forward(&y)
    }

    /// One decode step (T = 1) of rows that share their prompts' caches (see
    /// [`GroupedCache`]): each row attends to its group's prefix and its own suffix under
    /// one softmax, in f32.
    fn forward_grouped(
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
            && let Some(y) = cache.cpu_attention(&q, plan)?
        {
            return self.c_proj.forward(&y.reshape((b, 1, e))?); // (B, 1, E)
        }
        let (kp, vp) = cache.prefix(); // (N, H, L, D) each
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
            .broadcast_add(&plan.prefix_bias)?;
        let suffix_scores = (q.matmul(&ks.t()?)? * scale)? // (B, H, 1, W)
            .to_dtype(DType::F32)?
            .broadcast_add(&plan.suffix_bias)?;
        let w = suffix_scores.dim(3)?;
        let scores = Tensor::cat(&[&to_rows(&prefix_scores, l)?, &suffix_scores], 3)?; // (B, H, 1, L+W)
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(vs.dtype())?;
        let prefix_probs = to_groups(&probs.narrow(3, 0, l)?.contiguous()?, l)?; // (N, H, R, L)
        let from_prefix = to_rows(&prefix_probs.matmul(vp)?, d)?; // (B, H, 1, D)
        let from_suffix = probs.narrow(3, l, w)?.matmul(&vs)?; // (B, H, 1, D)
        let y = (from_prefix + from_suffix)?
            .transpose(1, 2)? // (B, 1, H, D)
            .reshape((b, 1, e))?;
        self.c_proj.forward(&y)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    c_fc: Conv1D,   // E -> I
    c_proj: Conv1D, // I -> E
    act: Activation,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (e, i) = (cfg.n_embd, cfg.inner_dim());
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), e, i)?,
            c_proj: Conv1D::load(vb.pp("c_proj"), i, e)?,
            act: cfg.activation_function,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(h) = self.c_fc.forward_fused(x)? {
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

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
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
    fn forward_with(
        &self,
        x: &Tensor,
        attend: impl FnOnce(&Attention, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let x = (x + attend(&self.attn, &self.ln_1.forward(x)?)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}

/// GPT-2 with a language-model head (Hugging Face `GPT2LMHeadModel`).
#[derive(Debug, Clone)]
pub struct Gpt2 {
    wte: Tensor, // (V, E)
    wpe: Tensor, // (n_positions, E)
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// Separate LM head, only when `tie_word_embeddings` is false.
    lm_head: Option<Tensor>, // (V, E)
    /// The LM head packed for the CPU kernel ([`Gpt2::pack_for_cpu`]).
    head_packed: Option<Arc<PackedMatrix>>,
    cfg: Config,
}

impl Gpt2 {
    /// Builds the model from `vb`, whose root holds `wte`, `wpe`, `h.{i}` and `ln_f`
    /// (i.e. already inside `transformer.` when the checkpoint uses that prefix).
    /// `head_vb` is where an untied `lm_head.weight` lives.
    pub fn load(vb: VarBuilder, head_vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (v, e) = (cfg.vocab_size, cfg.n_embd);
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::load(vb.pp(format!("h.{i}")), cfg))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(head_vb.get((v, e), "lm_head.weight")?)
        };
        Ok(Self {
            wte: vb.get((v, e), "wte.weight")?,
            wpe: vb.get((cfg.n_positions, e), "wpe.weight")?,
            blocks,
            ln_f: LayerNorm::load(vb.pp("ln_f"), e, cfg.layer_norm_epsilon)?,
            lm_head,
            head_packed: None,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.wte.device()
    }

    pub fn dtype(&self) -> DType {
        self.wte.dtype()
    }

    /// The LM head's weight (V, E): `wte` when tied.
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.wte)
    }

    /// A fresh, empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.n_layer)
    }

    /// Runs `ids` (B, T) through the transformer, appending their keys and values to
    /// `cache`, and returns the final hidden states (B, T, E) after `ln_f`.
    ///
    /// `padding` says how many leading slots of each row are padding; it sets each row's
    /// position ids and hides padded keys, so a padded row computes exactly what it would
    /// alone. Rows with no padding and a single new token need no mask at all.
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        padding: &LeftPadding,
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let past = cache.seq_len();
        if past + t > self.cfg.n_positions {
            candle_core::bail!(
                "sequence of {} tokens exceeds the context of {} positions",
                past + t,
                self.cfg.n_positions
            );
        }
        let device = self.device();
        let positions = padding.positions(past, t, device)?; // (B, T)
        let bias = padding.attention_bias(past, t, device)?; // (B, 1, T, S) or None

        let tok = self.wte.embedding_rows(ids)?; // (B, T, E)
        let pos = self.wpe.embedding_rows(&positions)?; // (B, T, E)
        let mut x = (tok + pos)?;
        for (block, layer_cache) in self.blocks.iter().zip(cache.layers_mut()) {
            x = block.forward_with(&x, |attn, x| attn.forward(x, bias.as_ref(), layer_cache))?;
        }
        debug_assert_eq!(x.dims3()?, (b, t, self.cfg.n_embd));
        self.ln_f.forward(&x)
    }

    /// For inference on the CPU in f32: packs every weight matrix and the LM head for
    /// the [`cpu_gemm`](crate::cpu_gemm) kernel (a second copy of the weights; outputs
    /// agree with candle's matmul to float rounding). Returns false, changing nothing,
    /// off the CPU, in other dtypes, without AVX2/FMA, or for trainable weights (the
    /// packed copy would not follow optimizer steps).
    pub fn pack_for_cpu(&mut self) -> candle_core::Result<bool> {
        if !self.device().is_cpu()
            || self.dtype() != DType::F32
            || !crate::cpu_gemm::supported()
            || tracked(&self.wte)
        {
            return Ok(false);
        }
        for block in &mut self.blocks {
            block.attn.c_attn.pack(Epilogue::None)?;
            block.attn.c_proj.pack(Epilogue::None)?;
            let fc_epilogue = match block.mlp.act {
                Activation::GeluNew => Epilogue::GeluNew,
                Activation::Gelu | Activation::Relu => Epilogue::None,
            };
            block.mlp.c_fc.pack(fc_epilogue)?;
            block.mlp.c_proj.pack(Epilogue::None)?;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.wte); // (V, E)
        let (v, e) = head.dims2()?;
        repack_or_pack(&mut self.head_packed, head, (e, v), true, None)?;
        Ok(true)
    }

    /// Logits (B, T, V) in f32 for hidden states (B, T, E).
    pub fn logits(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, e) = hidden.dims3()?;
        let head = self.lm_head.as_ref().unwrap_or(&self.wte); // (V, E)
        if let Some(packed) = &self.head_packed
            && let Some(y) = packed_matmul(packed, &hidden.reshape((b * t, e))?)?
        {
            return y.reshape((b, t, packed.n())); // (B, T, V)
        }
        hidden
            .reshape((b * t, e))? // (B*T, E)
            .matmul(&head.t()?)? // (B*T, V)
            .to_dtype(DType::F32)?
            .reshape((b, t, head.dim(0)?)) // (B, T, V)
    }

    /// Forward + logits for every fed token: (B, T, V) f32.
    pub fn forward(
        &self,
        ids: &Tensor,
        padding: &LeftPadding,
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let hidden = self.forward_hidden(ids, padding, cache)?;
        self.logits(&hidden)
    }

    /// Forward + logits of the last fed token only: (B, V) f32. What generation needs.
    pub fn forward_last(
        &self,
        ids: &Tensor,
        padding: &LeftPadding,
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let hidden = self.forward_hidden(ids, padding, cache)?; // (B, T, E)
        let t = hidden.dim(1)?;
        self.logits(&hidden.narrow(1, t - 1, 1)?)?.squeeze(1) // (B, V)
    }

    /// One decode step for the live rows of `cache`: `ids[r]` is the token row r feeds
    /// (its last sampled one). Returns the next-token logits (B, V) in f32.
    pub fn decode_grouped(
        &self,
        ids: &[u32],
        cache: &mut GroupedCache,
    ) -> candle_core::Result<Tensor> {
        let device = self.device();
        let plan = cache.plan_step(device)?;
        if ids.len() != plan.rows {
            candle_core::bail!("{} ids for {} live rows", ids.len(), plan.rows);
        }
        let ids = Tensor::new(ids, device)?.unsqueeze(1)?; // (B, 1)
        let tok = self.wte.embedding_rows(&ids)?; // (B, 1, E)
        let pos = self.wpe.embedding_rows(&plan.positions)?; // (B, 1, E)
        let mut x = (tok + pos)?;
        for (block, layer) in self.blocks.iter().zip(cache.layers_mut()) {
            x = block.forward_with(&x, |attn, x| attn.forward_grouped(x, &plan, layer))?;
        }
        cache.finish_step();
        self.logits(&self.ln_f.forward(&x)?)?.squeeze(1) // (B, V)
    }

    /// Every parameter under its Hugging Face name (with the `transformer.` prefix),
    /// in a fixed order; the tied LM head appears once, as `transformer.wte.weight`.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            ("transformer.wte.weight".to_owned(), self.wte.clone()),
            ("transformer.wpe.weight".to_owned(), self.wpe.clone()),
        ];
        let mut push = |name: String, t: &Tensor| out.push((name, t.clone()));
        for (i, blk) in self.blocks.iter().enumerate() {
            let p = format!("transformer.h.{i}");
            let ln = |n: &str, l: &LayerNorm| {
                [
                    (format!("{p}.{n}.weight"), l.weight.clone()),
                    (format!("{p}.{n}.bias"), l.bias.clone()),
                ]
            };
            let conv = |n: &str, c: &Conv1D| {
                [
                    (format!("{p}.{n}.weight"), c.weight.clone()),
                    (format!("{p}.{n}.bias"), c.bias.clone()),
                ]
            };
            for (name, t) in ln("ln_1", &blk.ln_1)
                .into_iter()
                .chain(conv("attn.c_attn", &blk.attn.c_attn))
                .chain(conv("attn.c_proj", &blk.attn.c_proj))
                .chain(ln("ln_2", &blk.ln_2))
                .chain(conv("mlp.c_fc", &blk.mlp.c_fc))
                .chain(conv("mlp.c_proj", &blk.mlp.c_proj))
            {
                push(name, &t);
            }
        }
        push("transformer.ln_f.weight".into(), &self.ln_f.weight);
        push("transformer.ln_f.bias".into(), &self.ln_f.bias);
        if let Some(head) = &self.lm_head {
            push("lm_head.weight".into(), head);
        }
        out
    }
}

/// `x` (M, K) times a packed weight: (M, N), or `None` when `x` is not an untracked f32
/// CPU tensor (then candle's matmul runs).
fn packed_matmul(packed: &PackedMatrix, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if tracked(x) || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let m = x.dim(0)?;
    let data = x.flatten_all()?.to_vec1::<f32>()?;
    Tensor::from_vec(packed.matmul(&data, m), (m, packed.n()), x.device()).map(Some)
}

/// Packs `w` — (K, N), or (N, K) when `transposed` — with `bias` into `slot`: into the
/// panels already there when `slot` holds the only reference to a matrix of that shape,
/// else into a new matrix. Returns the packed matrix.
fn repack_or_pack<'a>(
    slot: &'a mut Option<Arc<PackedMatrix>>,
    w: &Tensor,
    (k, n): (usize, usize),
    transposed: bool,
    bias: Option<Vec<f32>>,
) -> candle_core::Result<&'a mut PackedMatrix> {
    let reused = match slot.as_mut().and_then(Arc::get_mut) {
        Some(packed) => with_values(w, |w| packed.repack(w, transposed, bias.as_deref()))?,
        None => false,
    };
    if !reused {
        let packed = with_values(w, |w| PackedMatrix::pack(w, k, n, transposed, bias))?;
        *slot = Some(Arc::new(packed));
    }
    Ok(Arc::get_mut(slot.as_mut().expect("packed above")).expect("held alone"))
}

/// `f` of `t`'s f32 values in element order: borrowed from its CPU storage when it is
/// contiguous f32 (no copy of a weight matrix to pack it), else copied.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
            && let Ok(all) = cpu.as_slice::<f32>()
        {
            return Ok(f(&all[a..b]));
        }
    }
    Ok(f(&t
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?))
}

/// Row lookup `table[ids]` for a (B, T) id tensor: (B, T, E).
trait EmbeddingRows {
    fn embedding_rows(&self, ids: &Tensor) -> candle_core::Result<Tensor>;
}

impl EmbeddingRows for Tensor {
    fn embedding_rows(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let e = self.dim(1)?;
        candle_nn::Embedding::new(self.clone(), e)
            .forward(&ids.flatten_all()?)? // (B*T, E)
            .reshape((b, t, e))
    }
}
