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

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

mod layers;
mod tensors;

use layers::{Block, Conv1D, LayerNorm};
use tensors::{packed_matmul, repack_or_pack, tracked, with_values};

use crate::bf16_payload::{StoredValues, overwrite};
use crate::cache::KvCache;
use crate::config::{Activation, Config};
use crate::cpu_gemm::{Epilogue, PackedMatrix, PanelDtype};
use crate::grouped::{GroupedCache, StepPlan};
use crate::kernels::{Kernel, Kernels};
use crate::mask::LeftPadding;
use crate::weights_buffer::WeightsBuffer;

/// The prefix of the tensor names in a Hugging Face GPT-2 checkpoint (optional).
pub const PREFIX: &str = "transformer.";

/// Rows of the padded LM head on CUDA are a multiple of this
/// ([`Gpt2::prepare_for_inference`]): 64 BF16 values are 128 bytes, one cache line.
pub const HEAD_ROWS_ALIGN: usize = 64;

/// Rows of the tied LM head widened at a time when a packed-only model is refilled
/// ([`Gpt2::refill_packed`]): 3 MB of f32 for GPT-2's 768 columns, not the 154 MB of the
/// whole head, whose fresh pages alone cost more than its packing.
const HEAD_BLOCK_ROWS: usize = 1024;

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
    /// On CUDA, the LM head with zero rows up to a multiple of [`HEAD_ROWS_ALIGN`]
    /// ([`Gpt2::prepare_for_inference`]).
    head_padded: Option<Tensor>, // (V', E)
    /// The one device buffer every weight is a view of, when the model was built by one
    /// upload of a payload ([`crate::model_io::from_bytes`]): where the next version of the
    /// same layout is written ([`crate::model_io::refill_in_place`]).
    weights_buffer: Option<WeightsBuffer>,
    /// What [`Gpt2::pack_for_cpu`]'s panels hold.
    panel_dtype: PanelDtype,
    /// The matmuls' input dtype when it differs from the weights' (mixed precision).
    matmul_dtype: Option<DType>,
    /// Whether [`Self::set_train_ops`] asked for the training ops.
    train_ops: bool,
    /// Which of this project's CUDA kernels the model's device runs (its open's verdict,
    /// [`Self::set_kernels`]; until then none).
    kernels: Kernels,
    /// The weights' dtype (`wte` may be kept in BF16 once the model is packed only).
    dtype: DType,
    /// The projections' weights live only in their packed panels
    /// ([`Self::prepare_for_inference`] on the CPU).
    packed_only: bool,
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
        let wte = vb.get((v, e), "wte.weight")?;
        Ok(Self {
            dtype: wte.dtype(),
            packed_only: false,
            wte,
            wpe: vb.get((cfg.n_positions, e), "wpe.weight")?,
            blocks,
            ln_f: LayerNorm::load(vb.pp("ln_f"), e, cfg.layer_norm_epsilon)?,
            lm_head,
            head_packed: None,
            head_padded: None,
            weights_buffer: None,
            panel_dtype: PanelDtype::F32,
            matmul_dtype: None,
            train_ops: false,
            kernels: Kernels::none(),
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
        self.dtype
    }

    /// Whether the projections' weights live only in their packed panels (see
    /// [`Self::prepare_for_inference`]); new weights then go in by [`Self::refill_packed`].
    pub fn packed_only(&self) -> bool {
        self.packed_only
    }

    /// Mixed precision: every matmul of the layers (and of [`Self::logits`]) takes its
    /// inputs in `dtype` — e.g. BF16 on CUDA with f32 weights, so cuBLAS runs BF16 with
    /// f32 accumulation — and returns the weights' dtype; layer norm, softmax and the
    /// residual stream stay in the weights' dtype. `None` (the default) turns it off.
    pub fn set_matmul_dtype(&mut self, dtype: Option<DType>) {
        self.matmul_dtype = dtype.filter(|&d| d != self.dtype());
        for block in &mut self.blocks {
            block.set_matmul_dtype(self.matmul_dtype);
        }
    }

    /// Trains through [`crate::train_ops`] (layer norms, attention's softmax, bias +
    /// GELU: one kernel forward and one backward each, one tensor kept) instead of the
    /// composed ops; f32 activations only, else the composed ops run. The learner's
    /// trainable policy has it on; the LM head's log-probs use
    /// [`crate::train_ops::target_logprobs`] on the caller's side ([`Self::train_ops`]).
    /// On CUDA they run where the device's `train_ops` kernels passed their check
    /// ([`Self::set_kernels`]).
    pub fn set_train_ops(&mut self, on: bool) {
        self.train_ops = on;
        let on = self.train_ops();
        self.ln_f.train_ops = on;
        for block in &mut self.blocks {
            block.set_train_ops(on);
        }
    }

    /// Whether the training ops run: asked for ([`Self::set_train_ops`]) and, on CUDA,
    /// their kernels on ([`Self::kernels`]).
    pub fn train_ops(&self) -> bool {
        self.train_ops && (!self.device().is_cuda() || self.kernels.enabled(Kernel::TrainOps))
    }

    /// Gives the model its device's kernels: the verdict of the device's open
    /// ([`crate::device::DeviceChoice::open`]), shared with what else runs on it. A model
    /// built on CUDA runs none of them until it is given one.
    pub fn set_kernels(&mut self, kernels: Kernels) {
        self.kernels = kernels;
        self.set_train_ops(self.train_ops);
    }

    /// Which of this project's CUDA kernels the model runs ([`Self::set_kernels`]).
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// The matmuls' input dtype set by [`Self::set_matmul_dtype`].
    pub fn matmul_dtype(&self) -> Option<DType> {
        self.matmul_dtype
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

        let tok = self.token_rows(ids)?; // (B, T, E)
        let pos = self.wpe.embedding_rows(&positions)?; // (B, T, E)
        let mut x = (tok + pos)?;
        for (block, layer_cache) in self.blocks.iter().zip(cache.layers_mut()) {
            x = block.forward_with(&x, |attn, x| attn.forward(x, bias.as_ref(), layer_cache))?;
        }
        debug_assert_eq!(x.dims3()?, (b, t, self.cfg.n_embd));
        self.ln_f.forward(&x)
    }

    /// Token embeddings of `ids` (B, T) in the weights' dtype: (B, T, E).
    fn token_rows(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.wte.embedding_rows(ids)?.to_dtype(self.dtype)
    }

    /// Readies untracked weights for inference on their device; returns whether
    /// anything changed. On the CPU, [`Self::pack_for_cpu`], after which the panels are
    /// the only copy of the projections' weights (their dense tensors are emptied, and
    /// `wte`, which embeds tokens, is kept in BF16 when the panels are BF16 or INT8):
    /// the model is then for inference only — [`Self::named_tensors`] no longer gives its
    /// weights — and takes new ones through [`Self::refill_packed`]. On CUDA, a copy of the LM
    /// head padded with zero rows to V' = V rounded up to [`HEAD_ROWS_ALIGN`], so the
    /// head's product writes rows of V' values: a row of GPT-2's 50,257 BF16 logits is
    /// not 16-byte aligned, and cuBLAS then takes an older, slower kernel (266 µs for the
    /// (256, 768) × (768, 50,257) decode product on an H100, whose FLOPs take about 30).
    /// The logits are the first V columns; the padding costs V' − V rows of the head.
    pub fn prepare_for_inference(&mut self) -> candle_core::Result<bool> {
        if !self.device().is_cuda() {
            if self.packed_only || !self.packs_for_cpu() {
                return Ok(false);
            }
            self.pack_and_release()?;
            return Ok(true);
        }
        if tracked(&self.wte) {
            return Ok(false);
        }
        self.pad_head()?;
        Ok(true)
    }

    /// The buffer the weights are views of, if the model was built by one upload.
    pub fn weights_buffer(&self) -> Option<&WeightsBuffer> {
        self.weights_buffer.as_ref()
    }

    /// Records that every weight is a view of `buffer`'s (see [`Self::weights_buffer`]).
    pub(crate) fn set_weights_buffer(&mut self, buffer: WeightsBuffer) {
        self.weights_buffer = Some(buffer);
    }

    /// After the weights were written in place: the copies made of them for inference
    /// (the padded LM head) written again, in place too.
    pub(crate) fn refresh_copies(&self) -> candle_core::Result<()> {
        if let Some(padded) = &self.head_padded {
            padded.slice_set(self.head_weight(), 0, 0)?; // the first V rows; zeros after
        }
        Ok(())
    }

    /// Keeps a copy of the LM head with zero rows up to a multiple of
    /// [`HEAD_ROWS_ALIGN`] for [`Self::head_product`].
    pub(crate) fn pad_head(&mut self) -> candle_core::Result<()> {
        let head = self.head_weight(); // (V, E)
        let v = head.dim(0)?;
        let padded = head.pad_with_zeros(0, 0, v.next_multiple_of(HEAD_ROWS_ALIGN) - v)?;
        self.head_padded = Some(padded); // (V', E)
        Ok(())
    }

    /// For inference on the CPU in f32: packs every weight matrix and the LM head for
    /// the [`cpu_gemm`](crate::cpu_gemm) kernel (a second copy of the weights; outputs
    /// agree with candle's matmul to float rounding). Returns false, changing nothing,
    /// off the CPU, in other dtypes, without AVX2/FMA, or for trainable weights (the
    /// packed copy would not follow optimizer steps).
    /// The panels are f32 unless [`set_panel_dtype`](Self::set_panel_dtype) chose BF16.
    pub fn pack_for_cpu(&mut self) -> candle_core::Result<bool> {
        if self.packed_only {
            candle_core::bail!("the model is packed only: new weights go in by refill_packed");
        }
        if !self.packs_for_cpu() {
            return Ok(false);
        }
        self.weights_buffer = None; // writing it in place would leave the panels behind
        self.pack_layers(false)?;
        let head = self.head_weight().clone(); // (V, E)
        with_values(&head, |w| self.pack_head(w))??;
        Ok(true)
    }

    /// Whether [`Self::pack_for_cpu`] applies: untracked f32 weights on a CPU with the
    /// packed kernel.
    fn packs_for_cpu(&self) -> bool {
        self.device().is_cpu()
            && self.dtype() == DType::F32
            && crate::cpu_gemm::supported()
            && !tracked(&self.wte)
    }

    /// Packs every projection, emptying each one's dense weight right after when
    /// `release` ([`Conv1D::release_dense`]).
    fn pack_layers(&mut self, release: bool) -> candle_core::Result<()> {
        let dtype = self.panel_dtype;
        for block in &mut self.blocks {
            let fc_epilogue = match block.mlp.act {
                Activation::GeluNew => Epilogue::GeluNew,
                Activation::Gelu | Activation::Relu => Epilogue::None,
            };
            for (name, conv) in block.convs_mut() {
                let epilogue = if name == "mlp.c_fc" {
                    fc_epilogue
                } else {
                    Epilogue::None
                };
                conv.pack(dtype, epilogue)?;
                if release {
                    conv.release_dense()?;
                }
            }
        }
        Ok(())
    }

    /// Packs the LM head from its (V, E) values in row order.
    fn pack_head(&mut self, w: &[f32]) -> candle_core::Result<()> {
        let e = self.cfg.n_embd;
        let v = w.len() / e;
        repack_or_pack(
            &mut self.head_packed,
            self.panel_dtype,
            w,
            (e, v),
            true,
            None,
        )?;
        Ok(())
    }

    /// [`Self::pack_for_cpu`] that leaves the panels the only copy of the projections'
    /// weights and keeps `wte` in BF16 under BF16 or INT8 panels
    /// ([`Self::prepare_for_inference`]). The head is packed first and `wte` narrowed,
    /// then each projection packed and emptied in turn, so the load's peak holds about
    /// one dense copy of the weights, not a dense copy beside all the panels. An untied
    /// LM head keeps its dense copy.
    fn pack_and_release(&mut self) -> candle_core::Result<()> {
        self.weights_buffer = None; // the panels are the weights now
        let head = self.head_weight().clone(); // (V, E)
        with_values(&head, |w| self.pack_head(w))??;
        drop(head);
        if self.panel_dtype != PanelDtype::F32 {
            self.wte = tensors::to_bf16(&self.wte)?;
        }
        self.pack_layers(true)?;
        self.packed_only = true;
        Ok(())
    }

    /// Writes new weights into a packed-only model ([`Self::packed_only`]) in place:
    /// `values(name)` gives each tensor of [`Self::named_tensors`]' names as stored. Small
    /// tensors and `wte` are overwritten; each projection and the LM head are packed from
    /// their values, widened one matrix at a time into one scratch buffer (the panels
    /// are reused when nothing else holds them). The caller checks names and shapes
    /// first ([`crate::model_io::check_tensors`]).
    pub fn refill_packed<'a>(
        &mut self,
        values: impl Fn(&str) -> candle_core::Result<StoredValues<'a>>,
    ) -> candle_core::Result<()> {
        if !self.packed_only {
            candle_core::bail!("refill_packed: the model keeps its dense weights");
        }
        for (name, t) in self.named_tensors() {
            if t.elem_count() > 0 {
                overwrite(&t, values(&name)?)?;
            }
        }
        let mut scratch = Vec::new();
        let dtype = self.panel_dtype;
        for (i, block) in self.blocks.iter_mut().enumerate() {
            for (name, conv) in block.convs_mut() {
                let Some(packed) = conv.packed.as_ref() else {
                    candle_core::bail!("refill_packed: h.{i}.{name} is not packed");
                };
                let (len, epilogue) = (packed.k() * packed.n(), packed.epilogue());
                let stored = values(&format!("{PREFIX}h.{i}.{name}.weight"))?;
                if stored.elem_count() != len {
                    candle_core::bail!(
                        "h.{i}.{name}: {} stored values for {len}",
                        stored.elem_count()
                    );
                }
                conv.pack_stored(stored, &mut scratch, dtype, epilogue)?;
            }
        }
        let head = match &self.lm_head {
            Some(head) => head.clone(), // overwritten above
            None => {
                // The tied head from wte's stored values, a block of rows at a time.
                let (v, e) = self.wte.dims2()?;
                let wte = values(&format!("{PREFIX}wte.weight"))?;
                if let Some(packed) = self.head_packed.as_mut().and_then(Arc::get_mut) {
                    if let StoredValues::Bf16(bits) = wte
                        && packed.repack_bf16(bits, true, None)
                    {
                        return Ok(()); // BF16 panels straight from the BF16 payload
                    }
                    return packed.repack_transposed_by_rows(
                        HEAD_BLOCK_ROWS,
                        &mut scratch,
                        |r, out| wte.slice(r.start * e..r.end * e).read_into(out),
                    );
                }
                scratch.resize(v * e, 0f32);
                wte.read_into(&mut scratch)?;
                return self.pack_head(&scratch);
            }
        };
        with_values(&head, |w| self.pack_head(w))?
    }

    /// What the CPU kernel's panels hold from the next [`pack_for_cpu`](Self::pack_for_cpu)
    /// on (BF16: half the memory and the bytes a step streams; each weight rounded to
    /// BF16 once, which changes nothing for weights that are BF16 values).
    pub fn set_panel_dtype(&mut self, dtype: PanelDtype) {
        self.panel_dtype = dtype;
    }

    /// What the CPU kernel's panels hold (or will, once packed).
    pub fn panel_dtype(&self) -> PanelDtype {
        self.panel_dtype
    }

    /// Logits (B, T, V) in f32 for hidden states (B, T, E).
    pub fn logits(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, e) = hidden.dims3()?;
        let v = self.head_weight().dim(0)?;
        if let Some(packed) = &self.head_packed
            && let Some(y) = packed_matmul(packed, &hidden.reshape((b * t, e))?)?
        {
            return y.reshape((b, t, packed.n())); // (B, T, V)
        }
        self.head_product(&hidden.reshape((b * t, e))?)? // (B*T, V)
            .to_dtype(DType::F32)?
            .contiguous()?
            .reshape((b, t, v)) // (B, T, V)
    }

    /// The LM head's product for hidden states (N, E): (N, V) in the matmul's output
    /// dtype; with a padded head ([`Self::prepare_for_inference`]) a view of the first V
    /// columns of (N, V') rows.
    fn head_product(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let head = self.head_weight(); // (V, E)
        match &self.head_padded {
            Some(padded) => layers::matmul_in(hidden, &padded.t()?, self.matmul_dtype)? // (N, V')
                .narrow(1, 0, head.dim(0)?), // (N, V)
            // Training under mixed precision: one mixed product, f32 logits.
            None => layers::linear_in(hidden, &head.t()?, None, self.matmul_dtype, self.train_ops), // (N, V)
        }
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
    /// (its last sampled one). Returns the next-token logits (B, V): f32, except on CUDA
    /// after [`Self::prepare_for_inference`] with the sampling kernel on, where they are
    /// the head's output as [`crate::device_sampling::sample_rows`] takes it (the weights'
    /// dtype, rows V' apart).
    pub fn decode_grouped(
        &self,
        ids: &[u32],
        cache: &mut GroupedCache,
    ) -> candle_core::Result<Tensor> {
        let device = self.device();
        let plan = cache.plan_step(ids, device, &self.kernels)?;
        let tok = self.token_rows(&plan.ids)?; // (B, 1, E)
        let pos = self.wpe.embedding_rows(&plan.positions)?; // (B, 1, E)
        let mut x = (tok + pos)?;
        let hidden = if plan.decode_ops && self.fused_decode_applies() {
            self.decode_layers_fused(&x.squeeze(1)?, &plan, cache)?
                .unsqueeze(1)? // (B, 1, E)
        } else {
            for (block, layer) in self.blocks.iter().zip(cache.layers_mut()) {
                x = block.forward_with(&x, |attn, x| attn.forward_grouped(x, &plan, layer))?;
            }
            self.ln_f.forward(&x)?
        };
        // The head (the step's largest allocation) before the step counts: an error there
        // leaves the cache as it was. A padded head's output goes to the device sampler
        // as it is (no f32 copy of the (B, V) logits).
        let logits = if self.head_padded.is_some()
            && crate::device_sampling::supported(device, &self.kernels)
        {
            self.head_product(&hidden.squeeze(1)?)? // (B, V) of (B, V')
        } else {
            self.logits(&hidden)?.squeeze(1)? // (B, V)
        };
        cache.finish_step();
        Ok(logits)
    }

    /// Whether [`Self::decode_sampled`] runs steps of `cache` as captured CUDA graphs: a
    /// build with the `cuda` feature, the model on CUDA and ready for inference (its head
    /// padded), the trial family `decode_graphs` on with the kernels it uses, the fused
    /// decode ops applying, and a cache that uses the fused kernels.
    pub fn decode_graph_applies(&self, cache: &GroupedCache) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device().is_cuda()
                && [
                    Kernel::DecodeGraphs,
                    Kernel::Attention,
                    Kernel::DecodeOps,
                    Kernel::Sampling,
                ]
                .into_iter()
                .all(|k| self.kernels.enabled(k))
                && self.fused_decode_applies()
                && self.head_padded.is_some()
                && self.wte.dtype() == self.dtype
                && self.wpe.dtype() == self.dtype
                && crate::cuda::DecodeGraphs::applies(self.dtype, self.cfg.head_dim())
                && cache.uses_fused_kernels()
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = cache;
            false
        }
    }

    /// One decode step for the live rows of `cache` (`ids[r]` the token row r feeds) with
    /// its sampling, row r drawing with `draws[r]`, as one captured CUDA graph per bucket
    /// of rows ([`crate::cuda::DecodeGraphs`]): each row's token and log-probability.
    /// `None` where [`Self::decode_graph_applies`] is false, or where the graph failed
    /// other than for memory: the family is then turned off (one ERROR naming it) and
    /// the caller runs [`Self::decode_grouped`] and samples, as it would without it.
    pub fn decode_sampled(
        &self,
        ids: &[u32],
        draws: &[crate::sampling::RowDraw],
        cache: &mut GroupedCache,
    ) -> crate::Result<Option<Vec<crate::sampling::Sampled>>> {
        if !self.decode_graph_applies(cache) {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            use crate::kernels::Finding;
            let weights = self.step_weights();
            let mut graphs = cache.graphs.take();
            let result = crate::cuda::DecodeGraphs::step(&mut graphs, &weights, cache, ids, draws);
            cache.graphs = graphs;
            match result {
                // The step ran and counts; a row without a finite logit is the model's
                // error, as on the op-by-op path.
                Ok(out) => crate::cuda::sampled(&out, out.len() / 3, ids.len()).map(Some),
                Err(e) if e.to_string().to_ascii_lowercase().contains("out of memory") => {
                    cache.graphs = None;
                    Err(e)
                }
                Err(e) => {
                    cache.graphs = None;
                    let finding = Finding {
                        kernel: Kernel::DecodeGraphs,
                        problem: format!("a captured decode step failed: {e}"),
                    };
                    self.kernels
                        .apply(&crate::device::name(self.device()), &[finding])?;
                    Ok(None)
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ids, draws);
            Ok(None)
        }
    }

    /// What a captured decode step reads of the model (its head padded).
    #[cfg(feature = "cuda")]
    pub(crate) fn step_weights(&self) -> crate::cuda::StepWeights<'_> {
        fn pair(n: &LayerNorm) -> (&Tensor, &Tensor) {
            (&n.weight, &n.bias)
        }
        fn conv(c: &Conv1D) -> (&Tensor, &Tensor) {
            (&c.weight, &c.bias)
        }
        crate::cuda::StepWeights {
            wte: &self.wte,
            wpe: &self.wpe,
            layers: self
                .blocks
                .iter()
                .map(|b| crate::cuda::LayerWeights {
                    ln_1: pair(&b.ln_1),
                    c_attn: conv(&b.attn.c_attn),
                    attn_proj: conv(&b.attn.c_proj),
                    ln_2: pair(&b.ln_2),
                    c_fc: conv(&b.mlp.c_fc),
                    mlp_proj: conv(&b.mlp.c_proj),
                })
                .collect(),
            ln_f: pair(&self.ln_f),
            head: self.head_padded.as_ref().unwrap_or(&self.wte),
            vocab: self.cfg.vocab_size,
            heads: self.cfg.n_head,
            eps: self.cfg.layer_norm_epsilon as f32,
        }
    }

    /// Whether the fused decode ops apply: untracked f32 or bf16 weights, `gelu_new`, a
    /// head dim the attention kernel holds, and at least one layer.
    fn fused_decode_applies(&self) -> bool {
        let d = self.cfg.head_dim();
        matches!(self.dtype(), DType::F32 | DType::BF16)
            && self.cfg.activation_function == Activation::GeluNew
            && d.is_multiple_of(32)
            && d <= 128
            && !self.blocks.is_empty()
            && !tracked(&self.wte)
            && !self.packed_only
    }

    /// The layers of a decode step with the fused ops ([`crate::decode_ops`]): `x` (B, E)
    /// embeddings in, `ln_f` of the last residual (B, E) out. Each residual add carries
    /// the bias of the projection before it and the layer norm after it, so a layer is
    /// norm-fused adds, four matmuls, the q/k/v split and one attention kernel.
    fn decode_layers_fused(
        &self,
        x: &Tensor,
        plan: &StepPlan,
        cache: &mut GroupedCache,
    ) -> candle_core::Result<Tensor> {
        let mut x = x.clone();
        let mut h = self.blocks[0].ln_1.forward(&x)?;
        for (i, (block, layer)) in self.blocks.iter().zip(cache.layers_mut()).enumerate() {
            let a = block.attn.forward_grouped_fused(&h, plan, layer)?; // (B, E)
            (x, h) = block.ln_2.add_norm(&x, &a, &block.attn.c_proj.bias)?;
            let m = block.mlp.forward_fused(&h)?; // (B, E)
            let next = self.blocks.get(i + 1).map_or(&self.ln_f, |b| &b.ln_1);
            (x, h) = next.add_norm(&x, &m, &block.mlp.c_proj.bias)?;
        }
        Ok(h)
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

#[cfg(test)]
mod tests;
