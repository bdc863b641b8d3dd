//! The GPT-2 forward over a [`Packed`] micro-batch with its activations, and the backward
//! that turns gradients of the predicted tokens' log-probs into parameter gradients —
//! once, over any [`Backend`].
//!
//! Block l (pre-norm, as `rookworld_lm::Gpt2`): `x₂ = x + proj(attn(ln_1 x))`,
//! `x' = x₂ + fc_proj(gelu(fc(ln_2 x₂)))`; after the last block `ln_f`, then the LM head
//! on the predicting rows only. Every product is a Conv1D (`x · W + b`, W stored (K, N)
//! row-major) handed to the backend as its cuBLAS call ([`linear_forward`],
//! [`linear_backward`]).

use std::ops::{DerefMut, Range};
use std::time::Instant;

use rookworld_lm::config::Config;

use crate::backend::{Backend, Epilogue, HeadBackward, HeadForward, Heads, Result};
use crate::gemm::{Gemm, RowMajor, row_major};
use crate::packed::Packed;
use crate::weights::{self, Weights};

/// Largest (N, V) probability matrix kept from the head's forward for its backward
/// (elements); past it the backward recomputes the logits.
const KEEP_HEAD_PROBS: usize = 128 << 20;

/// What block l keeps for its backward (rows R of the micro-batch). The layer norms'
/// outputs and GELU's are not kept: the backward recomputes them from the inputs (and
/// the same code gives the same values), a sixth of a layer's work once more for 6E of
/// its 16E floats per row.
struct LayerActs<B: Backend> {
    x: B::Owned,         // (R, E) block input
    ln1_mean: B::Owned,  // (R)
    ln1_rstd: B::Owned,  // (R)
    qkv: B::Owned,       // (R, 3E)
    atty: B::Owned,      // (R, E)
    attention: B::Owned, // the backend's attention state (CPU: every head's probabilities)
    x2: B::Owned,        // (R, E)
    ln2_mean: B::Owned,  // (R)
    ln2_rstd: B::Owned,  // (R)
    fch: B::Owned,       // (R, I) before GELU
}

impl<B: Backend> Default for LayerActs<B> {
    fn default() -> Self {
        Self {
            x: Default::default(),
            ln1_mean: Default::default(),
            ln1_rstd: Default::default(),
            qkv: Default::default(),
            atty: Default::default(),
            attention: Default::default(),
            x2: Default::default(),
            ln2_mean: Default::default(),
            ln2_rstd: Default::default(),
            fch: Default::default(),
        }
    }
}

/// The backward's activation gradients (and the statistics of a recomputed layer norm).
struct GradScratch<B: Backend> {
    mean: B::Owned,   // (R)
    rstd: B::Owned,   // (R)
    hidden: B::Owned, // (N, E)
    res: B::Owned,    // (R, E) ∂ the residual stream
    tmp: B::Owned,    // (R, E)
    atty: B::Owned,   // (R, E)
    qkv: B::Owned,    // (R, 3E)
    fc: B::Owned,     // (R, I)
    dlogp: B::Owned,  // (N)
}

impl<B: Backend> Default for GradScratch<B> {
    fn default() -> Self {
        Self {
            mean: Default::default(),
            rstd: Default::default(),
            hidden: Default::default(),
            res: Default::default(),
            tmp: Default::default(),
            atty: Default::default(),
            qkv: Default::default(),
            fc: Default::default(),
            dlogp: Default::default(),
        }
    }
}

/// Every activation of one forward (and the backward's scratch), planned from the
/// micro-batch's shape before it runs and reused by the next micro-batch and step: the
/// memory a step needs is allocated once. Without gradients one block's worth serves
/// every block.
pub struct Activations<B: Backend> {
    layers: Vec<LayerActs<B>>,
    scratch: B::Owned, // (R, E)
    ln: B::Owned,      // (R, E) a layer norm's output, block after block
    gelu: B::Owned,    // (R, I) GELU's output, block after block
    out: B::Owned,     // (R, E) last block's output
    lnf: B::Owned,     // (R, E)
    lnf_mean: B::Owned,
    lnf_rstd: B::Owned,
    hidden: B::Owned,     // (N, E) ln_f rows that predict
    head_probs: B::Owned, // (rows, V) of the head rows last run, when kept (laid out by B)
    head_kept: bool,
    logp: B::Owned,    // (N)
    entropy: B::Owned, // (N) with gradients kept
    keep: bool,
    grad: GradScratch<B>,
}

impl<B: Backend> Default for Activations<B> {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            scratch: Default::default(),
            ln: Default::default(),
            gelu: Default::default(),
            out: Default::default(),
            lnf: Default::default(),
            lnf_mean: Default::default(),
            lnf_rstd: Default::default(),
            hidden: Default::default(),
            head_probs: Default::default(),
            head_kept: false,
            logp: Default::default(),
            entropy: Default::default(),
            keep: false,
            grad: Default::default(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Activations<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activations")
            .field("blocks", &self.layers.len())
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Activations<B> {
    /// Sizes the buffers for `packed` (with every block's when `keep`).
    fn plan(&mut self, b: &B, cfg: &Config, packed: &Packed, keep: bool) -> Result<()> {
        let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
        let n = packed.targets.len();
        let heads = Heads { e, h: cfg.n_head };
        let state = b.attention_state_len(packed, heads);
        let blocks = if keep { cfg.n_layer } else { 1 };
        self.layers.resize_with(blocks, LayerActs::default);
        for a in &mut self.layers {
            for (buf, len) in [
                (&mut a.x, r * e),
                (&mut a.ln1_mean, r),
                (&mut a.ln1_rstd, r),
                (&mut a.qkv, r * 3 * e),
                (&mut a.atty, r * e),
                (&mut a.attention, state),
                (&mut a.x2, r * e),
                (&mut a.ln2_mean, r),
                (&mut a.ln2_rstd, r),
                (&mut a.fch, r * i),
            ] {
                b.fit(buf, len)?;
            }
        }
        for (buf, len) in [
            (&mut self.scratch, r * e),
            (&mut self.ln, r * e),
            (&mut self.gelu, r * i),
            (&mut self.out, r * e),
            (&mut self.lnf, r * e),
            (&mut self.lnf_mean, r),
            (&mut self.lnf_rstd, r),
            (&mut self.hidden, n * e),
            (&mut self.logp, n),
            (&mut self.entropy, if keep { n } else { 0 }),
        ] {
            b.fit(buf, len)?;
        }
        self.keep = keep;
        Ok(())
    }

    /// Bytes this plan holds.
    pub fn bytes(&self, b: &B) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|a| {
                [
                    &a.x,
                    &a.ln1_mean,
                    &a.ln1_rstd,
                    &a.qkv,
                    &a.atty,
                    &a.attention,
                    &a.x2,
                    &a.ln2_mean,
                    &a.ln2_rstd,
                    &a.fch,
                ]
                .into_iter()
                .map(|v| b.len(v))
                .sum::<usize>()
            })
            .sum();
        let g = &self.grad;
        let rest: usize = [
            &self.scratch,
            &self.ln,
            &self.gelu,
            &self.out,
            &self.lnf,
            &self.lnf_mean,
            &self.lnf_rstd,
            &self.hidden,
            &self.head_probs,
            &self.logp,
            &self.entropy,
            &g.mean,
            &g.rstd,
            &g.hidden,
            &g.res,
            &g.tmp,
            &g.atty,
            &g.qkv,
            &g.fc,
            &g.dlogp,
        ]
        .into_iter()
        .map(|v| b.len(v))
        .sum();
        4 * (l + rest)
    }

    /// The policy's entropy at each predicted token of the last forward with gradients
    /// kept (N).
    pub fn entropy(&self) -> &B::Buf {
        &self.entropy
    }

    /// Every buffer a forward with `keep` leaves, in the order the forward writes them,
    /// named: what [`crate::compare`] walks.
    pub fn named(&self) -> Vec<(String, &B::Buf)> {
        let mut out = Vec::new();
        for (l, a) in self.layers.iter().enumerate() {
            let name = |what: &str| format!("block {l}: {what}");
            out.extend([
                (name("input"), &*a.x),
                (name("ln_1 mean"), &*a.ln1_mean),
                (name("ln_1 1/σ"), &*a.ln1_rstd),
                (name("c_attn output (q, k, v)"), &*a.qkv),
                (name("attention state"), &*a.attention),
                (name("attention output"), &*a.atty),
                (name("after attention (x₂)"), &*a.x2),
                (name("ln_2 mean"), &*a.ln2_mean),
                (name("ln_2 1/σ"), &*a.ln2_rstd),
                (name("c_fc output (before GELU)"), &*a.fch),
            ]);
        }
        out.extend([
            ("last block's output".to_owned(), &*self.out),
            ("ln_f mean".to_owned(), &*self.lnf_mean),
            ("ln_f 1/σ".to_owned(), &*self.lnf_rstd),
            ("ln_f output".to_owned(), &*self.lnf),
            ("predicting rows of ln_f".to_owned(), &*self.hidden),
            ("log-probs".to_owned(), &*self.logp),
            ("entropy".to_owned(), &*self.entropy),
        ]);
        out
    }

    /// ∂ of the embedding's output (R, E) after a backward: everything the blocks passed
    /// down.
    pub fn embedding_gradient(&self) -> &B::Buf {
        &self.grad.res
    }
}

/// The three products of a linear layer over `r` rows, `k` in and `n` out (weight stored
/// (K, N)), as [`linear_forward`] and [`linear_backward`] make them: the forward `x · w`,
/// the input's gradient `dout · wᵀ` and the weight's `xᵀ · dout` (added into `dw`). In
/// each, cuBLAS's A is the right operand.
pub fn linear_products((r, k, n): (usize, usize, usize)) -> [Gemm; 3] {
    [
        row_major((r, n, k), RowMajor::plain(k), RowMajor::plain(n), 0, false),
        row_major(
            (r, k, n),
            RowMajor::plain(n),
            RowMajor::transposed(n),
            0,
            false,
        ),
        row_major(
            (k, n, r),
            RowMajor::transposed(k),
            RowMajor::plain(n),
            0,
            true,
        ),
    ]
}

/// `out (R, N) = x (R, K) · w (K, N) + bias (N)`: Hugging Face's Conv1D, the bias added
/// on the product's way out ([`Epilogue::Bias`]); with `gelu`, `pre (R, N)` holds that and
/// `out = gelu_new(pre)` ([`Epilogue::BiasGelu`]).
pub fn linear_forward<B: Backend>(
    b: &B,
    (out, gelu): (&mut B::Buf, Option<&mut B::Buf>),
    (x, w, bias): (&B::Buf, &B::Buf, &B::Buf),
    (r, k, n): (usize, usize, usize),
) -> Result<()> {
    let [g, ..] = linear_products((r, k, n));
    let epilogue = match gelu {
        Some(pre) => Epilogue::BiasGelu { bias, pre },
        None => Epilogue::Bias { bias },
    };
    // cuBLAS's A is the right operand.
    b.gemm_epilogue(out, &g, (w, x), epilogue)
}

/// Backward of [`linear_forward`]: `dx (R, K) = dout · wᵀ`, or with `gelu_pre` (the
/// forward's `pre` of the GELU that made x) `dx = (dout · wᵀ) ⊙ gelu_new'(pre)`
/// ([`Epilogue::Dgelu`]); `dw (K, N) += xᵀ · dout` with `db (N) += Σ_rows dout` on its way
/// out ([`Epilogue::BiasGrad`]).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<B: Backend>(
    b: &B,
    (dx, gelu_pre): (&mut B::Buf, Option<&B::Buf>),
    dw: &mut B::Buf,
    db: &mut B::Buf,
    dout: &B::Buf,
    x: &B::Buf,
    w: &B::Buf,
    (r, k, n): (usize, usize, usize),
) -> Result<()> {
    let [_, dgrad, wgrad] = linear_products((r, k, n));
    match gelu_pre {
        Some(pre) => b.gemm_epilogue(dx, &dgrad, (w, dout), Epilogue::Dgelu { pre })?,
        None => b.gemm(dx, &dgrad, w, dout)?,
    }
    b.gemm_epilogue(dw, &wgrad, (dout, x), Epilogue::BiasGrad { db })
}

/// Forward of `packed`: the log-prob of every predicted token (N), under
/// `softmax(logits / temperature)`, on the host. With `keep`, `acts` holds what
/// [`backward`] needs.
pub fn forward<B: Backend>(
    b: &B,
    params: &Weights<B>,
    packed: &Packed,
    temperature: f64,
    acts: &mut Activations<B>,
    keep: bool,
) -> Result<Vec<f32>> {
    let rows = b.rows(packed)?;
    forward_blocks(b, params, packed, &rows, acts, keep)?;
    let n = packed.targets.len();
    acts.head_kept = keep && n * params.cfg.vocab_size <= KEEP_HEAD_PROBS;
    head_forward(b, params, &rows, acts, (0..n, temperature))?;
    b.read(&acts.logp)
}

/// Backward of [`forward`] for upstream gradients `dlogp` (N, on the host): adds every
/// parameter's gradient to `grads` (indexed as [`Weights`]): buffers the pass planned, or
/// views of memory the caller holds (the optimizer's own gradient tensors).
pub fn backward<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    params: &Weights<B>,
    packed: &Packed,
    acts: &mut Activations<B>,
    dlogp: &[f32],
    temperature: f64,
    grads: &mut [G],
) -> Result<()> {
    if !acts.keep {
        return Err(crate::Error::Shape(
            "backward needs the activations of a forward with keep".into(),
        ));
    }
    let rows = b.rows(packed)?;
    let n = packed.targets.len();
    plan_gradients(b, params.cfg, packed, acts)?;
    b.write(&mut acts.grad.dlogp, dlogp)?;
    head_backward(b, params, &rows, acts, (0..n, temperature), grads)?;
    backward_blocks(b, params, packed, &rows, acts, grads)
}

/// The forward, the objective and the backward of `packed` in one pass: adds every
/// parameter's gradient of the objective to `grads` (as [`backward`]) and returns the
/// log-probs of the predicted tokens (N) with the forward's time.
///
/// The LM head runs chunk by chunk, each chunk a run of whole completions (of
/// `packed.tokens`): its forward, then `objective(span, logp)` — the upstream gradients
/// `∂L/∂logp` of the chunk's tokens `span` (a range of the N) from their log-probs — then
/// its backward, with what the forward kept of those rows. So the objective must be a sum
/// over completions, each term a function of that completion's tokens only (every GRPO
/// variant's, aggregated with fixed denominators). A chunk holds at most
/// [`Backend::head_keep_rows`] rows (or one completion when that is longer): the (N, V)
/// probabilities of a micro-batch are never held at once. A backend that keeps none
/// gets one objective over all N rows, and its head backward recomputes the logits.
/// The micro-batch's layout goes to the backend once, for the forward and the backward.
pub fn train<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    params: &Weights<B>,
    packed: &Packed,
    temperature: f64,
    (acts, grads): (&mut Activations<B>, &mut [G]),
    mut objective: impl FnMut(Range<usize>, &[f32]) -> Result<Vec<f32>>,
) -> Result<Trained> {
    let started = Instant::now();
    let rows = b.rows(packed)?;
    forward_blocks(b, params, packed, &rows, acts, true)?;
    plan_gradients(b, params.cfg, packed, acts)?;
    let mut forward = started.elapsed();
    let n = packed.targets.len();
    let keep_rows = b.head_keep_rows(params.cfg.vocab_size);
    let spans = match keep_rows {
        Some(limit) => head_chunks(&packed.tokens, n, limit),
        None => std::iter::once(0..n).collect(),
    };
    acts.head_kept = keep_rows.is_some();
    let (mut logp, mut dlogp) = (vec![0f32; n], vec![0f32; n]);
    for span in spans {
        let head_started = Instant::now();
        head_forward(b, params, &rows, acts, (span.clone(), temperature))?;
        let all = b.read(&acts.logp)?;
        forward += head_started.elapsed();
        logp[span.clone()].copy_from_slice(&all[span.clone()]);
        let d = objective(span.clone(), &logp[span.clone()])?;
        if d.len() != span.len() {
            return Err(crate::Error::Shape(format!(
                "the objective gave {} gradients for {} tokens",
                d.len(),
                span.len()
            )));
        }
        dlogp[span.clone()].copy_from_slice(&d);
        b.write(&mut acts.grad.dlogp, &dlogp)?;
        head_backward(b, params, &rows, acts, (span, temperature), grads)?;
    }
    backward_blocks(b, params, packed, &rows, acts, grads)?;
    Ok(Trained {
        logp,
        forward_seconds: forward.as_secs_f64(),
    })
}

/// What [`train`] gives back.
#[derive(Debug, Clone, Default)]
pub struct Trained {
    /// The predicted tokens' log-probs (N).
    pub logp: Vec<f32>,
    /// Time in the forward: the blocks, then the head chunk by chunk up to each chunk's
    /// log-probs on the host (on a device, the first read waits for the blocks).
    pub forward_seconds: f64,
}

/// The spans of [`train`]'s head chunks: consecutive completions (`tokens`, their ranges
/// of the N predicted tokens) while the chunk stays within `limit` rows; a completion
/// longer than `limit` is a chunk of its own. Covers 0..N.
fn head_chunks(tokens: &[Range<usize>], n: usize, limit: usize) -> Vec<Range<usize>> {
    let mut spans: Vec<Range<usize>> = Vec::new();
    for t in tokens.iter().filter(|t| !t.is_empty()) {
        match spans.last_mut() {
            Some(last) if last.end == t.start && t.end - last.start <= limit => last.end = t.end,
            _ => spans.push(t.clone()),
        }
    }
    // Completions tile 0..N in order; anything else is one chunk.
    let tiled = spans.first().is_none_or(|s| s.start == 0)
        && spans.windows(2).all(|w| w[0].end == w[1].start)
        && spans.last().map_or(0, |s| s.end) == n;
    if tiled {
        spans
    } else {
        std::iter::once(0..n).collect()
    }
}

/// The blocks and `ln_f` of [`forward`]: `acts.hidden` (N, E) holds the predicting rows of
/// `ln_f`'s output after it.
fn forward_blocks<B: Backend>(
    b: &B,
    params: &Weights<B>,
    packed: &Packed,
    rows: &B::Rows<'_>,
    acts: &mut Activations<B>,
    keep: bool,
) -> Result<()> {
    let cfg = params.cfg;
    let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
    let eps = cfg.layer_norm_epsilon as f32;
    let heads = Heads { e, h: cfg.n_head };
    acts.plan(b, cfg, packed, keep)?;
    let w = |l: usize, j: usize| params.get(weights::layer(l, j));
    let Activations {
        layers,
        scratch,
        ln,
        gelu,
        out,
        ..
    } = acts;
    b.embedding_forward(&mut layers[0].x, rows, params.get(0), params.get(1))?;
    let blocks = layers.len();
    for l in 0..cfg.n_layer {
        let a = &mut layers[l % blocks];
        b.layernorm_forward(
            ln,
            &mut a.ln1_mean,
            &mut a.ln1_rstd,
            &a.x,
            w(l, 0),
            w(l, 1),
            eps,
        )?;
        linear_forward(b, (&mut a.qkv, None), (ln, w(l, 2), w(l, 3)), (r, e, 3 * e))?;
        b.attention_forward(&mut a.atty, &mut a.attention, &a.qkv, rows, heads)?;
        linear_forward(b, (scratch, None), (&a.atty, w(l, 4), w(l, 5)), (r, e, e))?;
        b.add(&mut a.x2, &a.x, scratch)?;
        b.layernorm_forward(
            ln,
            &mut a.ln2_mean,
            &mut a.ln2_rstd,
            &a.x2,
            w(l, 6),
            w(l, 7),
            eps,
        )?;
        linear_forward(
            b,
            (gelu, Some(&mut a.fch)),
            (ln, w(l, 8), w(l, 9)),
            (r, e, i),
        )?;
        linear_forward(b, (scratch, None), (gelu, w(l, 10), w(l, 11)), (r, i, e))?;
        b.add(out, &a.x2, scratch)?;
        if l + 1 < cfg.n_layer {
            // The output is the next block's input.
            std::mem::swap(&mut layers[(l + 1) % blocks].x, out);
        }
    }
    let f = weights::ln_f(cfg);
    b.layernorm_forward(
        &mut acts.lnf,
        &mut acts.lnf_mean,
        &mut acts.lnf_rstd,
        &acts.out,
        params.get(f),
        params.get(f + 1),
        eps,
    )?;
    b.gather_rows(&mut acts.hidden, &acts.lnf, rows)
}

/// The LM head's forward on the predicting rows `span` into `acts.logp` (and, with
/// gradients kept, `acts.entropy`); with `acts.head_kept`, what its backward needs stays
/// in `acts.head_probs`.
fn head_forward<B: Backend>(
    b: &B,
    params: &Weights<B>,
    rows: &B::Rows<'_>,
    acts: &mut Activations<B>,
    (span, temperature): (Range<usize>, f64),
) -> Result<()> {
    let keep = acts.keep;
    b.head_forward(
        HeadForward {
            logp: &mut acts.logp,
            entropy: keep.then_some(&mut *acts.entropy),
            scratch: &mut acts.head_probs,
            hidden: &acts.hidden,
            head: params.get(params.head_index()),
            span,
            e: params.cfg.n_embd,
            temperature,
            keep: acts.head_kept,
        },
        rows,
    )
}

/// Sizes the backward's scratch for `packed`, and zeroes ∂ of the head's input rows,
/// which the head's backward adds into span by span.
fn plan_gradients<B: Backend>(
    b: &B,
    cfg: &Config,
    packed: &Packed,
    acts: &mut Activations<B>,
) -> Result<()> {
    let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
    let n = packed.targets.len();
    let g = &mut acts.grad;
    for (buf, len) in [
        (&mut g.mean, r),
        (&mut g.rstd, r),
        (&mut g.hidden, n * e),
        (&mut g.res, r * e),
        (&mut g.tmp, r * e),
        (&mut g.atty, r * e),
        (&mut g.qkv, r * 3 * e),
        (&mut g.fc, r * i),
        (&mut g.dlogp, n),
    ] {
        b.fit(buf, len)?;
    }
    b.fill(&mut g.hidden, 0.0)
}

/// The LM head's backward on the predicting rows `span` for the upstream gradients in
/// `acts.grad.dlogp`: ∂ of its input rows into `acts.grad.hidden`, of its weight into
/// `grads`; with `acts.head_kept`, from what its forward of the same rows kept.
fn head_backward<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    params: &Weights<B>,
    rows: &B::Rows<'_>,
    acts: &mut Activations<B>,
    (span, temperature): (Range<usize>, f64),
    grads: &mut [G],
) -> Result<()> {
    let head_index = params.head_index();
    b.head_backward(
        HeadBackward {
            dhidden: &mut acts.grad.hidden,
            dhead: &mut grads[head_index],
            hidden: &acts.hidden,
            head: params.get(head_index),
            dlogp: &acts.grad.dlogp,
            span,
            e: params.cfg.n_embd,
            temperature,
            probs: acts.head_kept.then_some(&mut *acts.head_probs),
        },
        rows,
    )
}

/// The backward from ∂ of the head's input rows (`acts.grad.hidden`) down: `ln_f`, the
/// blocks from the last, the embedding.
fn backward_blocks<B: Backend, G: DerefMut<Target = B::Buf>>(
    b: &B,
    params: &Weights<B>,
    packed: &Packed,
    rows: &B::Rows<'_>,
    acts: &mut Activations<B>,
    grads: &mut [G],
) -> Result<()> {
    let cfg = params.cfg;
    let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
    let eps = cfg.layer_norm_epsilon as f32;
    let heads = Heads { e, h: cfg.n_head };
    let g = &mut acts.grad;
    b.fill(&mut g.tmp, 0.0)?;
    b.scatter_add_rows(&mut g.tmp, &g.hidden, rows)?;

    // ln_f → the residual stream.
    b.fill(&mut g.res, 0.0)?;
    let f = weights::ln_f(cfg);
    let (gw, gb) = pair::<B, G>(grads, f);
    b.layernorm_backward(
        &mut g.res,
        gw,
        gb,
        &g.tmp,
        &acts.out,
        &acts.lnf_mean,
        &acts.lnf_rstd,
        params.get(f),
    )?;
    let w = |l: usize, j: usize| params.get(weights::layer(l, j));
    for l in (0..cfg.n_layer).rev() {
        let a = &acts.layers[l];
        let p = |j: usize| weights::layer(l, j);
        // x' = x₂ + fc_proj(gelu(fc(ln_2 x₂)))
        b.gelu_forward(&mut acts.gelu, &a.fch)?;
        let (gw, gb) = pair::<B, G>(grads, p(10));
        let dims = (r, i, e);
        linear_backward(
            b,
            (&mut g.fc, Some(&a.fch)),
            gw,
            gb,
            &g.res,
            &acts.gelu,
            w(l, 10),
            dims,
        )?;
        b.layernorm_forward(
            &mut acts.ln,
            &mut g.mean,
            &mut g.rstd,
            &a.x2,
            w(l, 6),
            w(l, 7),
            eps,
        )?;
        let (gw, gb) = pair::<B, G>(grads, p(8));
        linear_backward(
            b,
            (&mut g.tmp, None),
            gw,
            gb,
            &g.fc,
            &acts.ln,
            w(l, 8),
            (r, e, i),
        )?;
        let (gw, gb) = pair::<B, G>(grads, p(6));
        b.layernorm_backward(
            &mut g.res,
            gw,
            gb,
            &g.tmp,
            &a.x2,
            &a.ln2_mean,
            &a.ln2_rstd,
            w(l, 6),
        )?;
        // x₂ = x + proj(attn(ln_1 x))
        let (gw, gb) = pair::<B, G>(grads, p(4));
        linear_backward(
            b,
            (&mut g.atty, None),
            gw,
            gb,
            &g.res,
            &a.atty,
            w(l, 4),
            (r, e, e),
        )?;
        b.attention_backward(
            &mut g.qkv,
            &g.atty,
            &a.atty,
            &a.qkv,
            &a.attention,
            rows,
            heads,
        )?;
        b.layernorm_forward(
            &mut acts.ln,
            &mut g.mean,
            &mut g.rstd,
            &a.x,
            w(l, 0),
            w(l, 1),
            eps,
        )?;
        let (gw, gb) = pair::<B, G>(grads, p(2));
        let dims = (r, e, 3 * e);
        linear_backward(
            b,
            (&mut g.tmp, None),
            gw,
            gb,
            &g.qkv,
            &acts.ln,
            w(l, 2),
            dims,
        )?;
        let (gw, gb) = pair::<B, G>(grads, p(0));
        b.layernorm_backward(
            &mut g.res,
            gw,
            gb,
            &g.tmp,
            &a.x,
            &a.ln1_mean,
            &a.ln1_rstd,
            w(l, 0),
        )?;
    }
    let (dwte, rest) = grads.split_at_mut(1);
    b.embedding_backward(&mut dwte[0], &mut rest[0], &g.res, rows)
}

/// Gradients `i` and `i + 1` (a weight and its bias) at once.
fn pair<B: Backend, G: DerefMut<Target = B::Buf>>(
    grads: &mut [G],
    i: usize,
) -> (&mut B::Buf, &mut B::Buf) {
    let (a, b) = grads[i..].split_at_mut(1);
    (&mut a[0], &mut b[0])
}
