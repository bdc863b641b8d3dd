//! The GPT-2 forward over a [`Packed`] micro-batch with its activations, and the backward
//! that turns gradients of the predicted tokens' log-probs into parameter gradients.
//!
//! Block l (pre-norm, as `rookworld_lm::Gpt2`): `x₂ = x + proj(attn(ln_1 x))`,
//! `x' = x₂ + fc_proj(gelu(fc(ln_2 x₂)))`; after the last block `ln_f`, then the tied LM
//! head on the predicting rows only.

use rayon::prelude::*;

use crate::fused::attention::{self, Heads};
use crate::fused::ops;
use crate::fused::{Packed, Params};
use crate::head::{self, HeadGrads};

/// Largest (N, V) probability matrix kept from the head's forward for its backward
/// (elements); past it the backward recomputes the logits.
const KEEP_HEAD_PROBS: usize = 128 << 20;

/// What block l keeps for its backward (rows R of the micro-batch). The layer norms'
/// outputs and GELU's are not kept: the backward recomputes them from the inputs (and
/// the same code gives the same values), a sixth of a layer's work once more for 6E of
/// its 16E floats per row.
#[derive(Debug, Default)]
struct LayerActs {
    x: Vec<f32>, // (R, E) block input
    ln1_stats: (Vec<f32>, Vec<f32>),
    qkv: Vec<f32>,   // (R, 3E)
    atty: Vec<f32>,  // (R, E)
    probs: Vec<f32>, // per (group, head) attention probabilities
    x2: Vec<f32>,    // (R, E)
    ln2_stats: (Vec<f32>, Vec<f32>),
    fch: Vec<f32>, // (R, I) before GELU
}

impl LayerActs {
    /// Sizes every buffer for R rows (contents are overwritten by the forward).
    fn fit(&mut self, r: usize, e: usize, i: usize, probs: usize) {
        for (v, n) in [
            (&mut self.x, r * e),
            (&mut self.ln1_stats.0, r),
            (&mut self.ln1_stats.1, r),
            (&mut self.qkv, r * 3 * e),
            (&mut self.atty, r * e),
            (&mut self.probs, probs),
            (&mut self.x2, r * e),
            (&mut self.ln2_stats.0, r),
            (&mut self.ln2_stats.1, r),
            (&mut self.fch, r * i),
        ] {
            fit(v, n);
        }
    }
}

/// `v` holds exactly `n` elements, reusing its allocation when it can.
fn fit(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// Every activation of one forward (and the backward's scratch), planned from the
/// micro-batch's shape before it runs and reused by the next micro-batch and step: the
/// memory a step needs is allocated once. Without gradients one block's worth serves
/// every block.
#[derive(Debug, Default)]
pub struct Activations {
    layers: Vec<LayerActs>,
    scratch: Vec<f32>, // (R, E)
    ln: Vec<f32>,      // (R, E) a layer norm's output, block after block
    gelu: Vec<f32>,    // (R, I) GELU's output, block after block
    out: Vec<f32>,     // (R, E) last block's output
    lnf: Vec<f32>,     // (R, E)
    lnf_stats: (Vec<f32>, Vec<f32>),
    hidden: Vec<f32>,     // (N, E) ln_f rows that predict
    head_probs: Vec<f32>, // (N, V) when kept; else the head's block scratch
    head_kept: bool,
    /// The policy's entropy at each predicted token of the last kept forward (N).
    pub entropy: Vec<f32>,
    keep: bool,
    grad: GradScratch,
}

/// The buffers of the fused pass, kept from step to step by the model that trains
/// ([`crate::policy::Trainable`]): the policy's activations and the reference's.
#[derive(Debug, Default)]
pub struct Workspace {
    pub policy: Activations,
    pub reference: Activations,
    /// Gradient buffers of the last step, handed back after its optimizer step
    /// ([`crate::optim::Gradients::recycle`]).
    pub grads: Vec<Vec<f32>>,
}

impl Workspace {
    /// Zeroed gradient buffers for `params`: the last step's when they fit.
    pub fn zeroed_grads(&mut self, params: &Params) -> Vec<Vec<f32>> {
        params.zero_grads(std::mem::take(&mut self.grads))
    }
}

/// The backward's activation gradients (and the statistics of a recomputed layer norm).
#[derive(Debug, Default)]
struct GradScratch {
    stats: (Vec<f32>, Vec<f32>), // (R)
    hidden: Vec<f32>,            // (N, E)
    res: Vec<f32>,               // (R, E)
    tmp: Vec<f32>,               // (R, E)
    atty: Vec<f32>,              // (R, E)
    qkv: Vec<f32>,               // (R, 3E)
    fc: Vec<f32>,                // (R, I)
}

impl Activations {
    /// Sizes the buffers for `packed` (with every block's when `keep`).
    fn plan(&mut self, params: &Params, packed: &Packed, keep: bool) {
        let cfg = params.cfg;
        let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
        let probs = cfg.n_head * packed.groups.iter().map(|g| g.probs_len()).sum::<usize>();
        let blocks = if keep { cfg.n_layer } else { 1 };
        self.layers.resize_with(blocks, LayerActs::default);
        for layer in &mut self.layers {
            layer.fit(r, e, i, probs);
        }
        for (v, n) in [
            (&mut self.scratch, r * e),
            (&mut self.ln, r * e),
            (&mut self.gelu, r * i),
            (&mut self.out, r * e),
            (&mut self.lnf, r * e),
            (&mut self.lnf_stats.0, r),
            (&mut self.lnf_stats.1, r),
        ] {
            fit(v, n);
        }
        self.keep = keep;
    }

    /// Bytes this plan holds.
    pub fn bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|a| {
                a.x.len()
                    + 2 * a.ln1_stats.0.len()
                    + a.qkv.len()
                    + a.atty.len()
                    + a.probs.len()
                    + a.x2.len()
                    + 2 * a.ln2_stats.0.len()
                    + a.fch.len()
            })
            .sum();
        let g = &self.grad;
        let grads = 2 * g.stats.0.len()
            + g.hidden.len()
            + g.res.len()
            + g.tmp.len()
            + g.atty.len()
            + g.qkv.len()
            + g.fc.len();
        let shared = self.scratch.len() * 4 + self.gelu.len();
        4 * (l + shared + self.hidden.len() + self.head_probs.len() + grads)
    }
}

/// Forward of `packed`: the log-prob of every predicted token (N), under
/// `softmax(logits / temperature)`. With `keep`, `acts` holds what [`backward`] needs.
pub fn forward(
    params: &Params,
    packed: &Packed,
    temperature: f64,
    acts: &mut Activations,
    keep: bool,
) -> Vec<f32> {
    let cfg = params.cfg;
    let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
    let eps = cfg.layer_norm_epsilon as f32;
    let heads = Heads { e, h: cfg.n_head };
    acts.plan(params, packed, keep);
    let w = |l: usize, j: usize| params.get(Params::layer(l, j));
    let how = params.matmuls;
    ops::embedding_forward(
        &mut acts.layers[0].x,
        &packed.ids,
        &packed.positions,
        params.get(0),
        params.get(1),
    );
    let blocks = acts.layers.len();
    for l in 0..cfg.n_layer {
        let a = &mut acts.layers[l % blocks];
        let (m1, s1) = &mut a.ln1_stats;
        ops::layernorm_forward(&mut acts.ln, m1, s1, &a.x, w(l, 0), w(l, 1), eps);
        ops::matmul_forward(&mut a.qkv, (&acts.ln, w(l, 2), w(l, 3)), r, e, how);
        attention::attention_forward(&mut a.atty, &mut a.probs, &a.qkv, &packed.groups, heads);
        ops::matmul_forward(&mut acts.scratch, (&a.atty, w(l, 4), w(l, 5)), r, e, how);
        ops::add(&mut a.x2, &a.x, &acts.scratch);
        let (m2, s2) = &mut a.ln2_stats;
        ops::layernorm_forward(&mut acts.ln, m2, s2, &a.x2, w(l, 6), w(l, 7), eps);
        ops::matmul_forward(&mut a.fch, (&acts.ln, w(l, 8), w(l, 9)), r, e, how);
        ops::gelu_forward(&mut acts.gelu, &a.fch);
        ops::matmul_forward(
            &mut acts.scratch,
            (&acts.gelu, w(l, 10), w(l, 11)),
            r,
            i,
            how,
        );
        let a = &acts.layers[l % blocks];
        ops::add(&mut acts.out, &a.x2, &acts.scratch);
        if l + 1 < cfg.n_layer {
            // The output is the next block's input.
            std::mem::swap(&mut acts.layers[(l + 1) % blocks].x, &mut acts.out);
        }
    }
    let f = params.ln_f();
    let (mf, sf) = &mut acts.lnf_stats;
    ops::layernorm_forward(
        &mut acts.lnf,
        mf,
        sf,
        &acts.out,
        params.get(f),
        params.get(f + 1),
        eps,
    );
    gather_rows(&mut acts.hidden, &acts.lnf, &packed.head_rows, e);
    let n = packed.targets.len();
    let keep_probs = keep && n * cfg.vocab_size <= KEEP_HEAD_PROBS;
    acts.head_kept = keep_probs;
    head::logprobs_rows(
        &acts.hidden,
        params.get(params.head_index()),
        &packed.targets,
        e,
        temperature,
        &mut acts.head_probs,
        keep_probs,
        keep.then_some(&mut acts.entropy),
        how,
    )
}

/// Backward of [`forward`] for upstream gradients `dlogp` (N): adds every parameter's
/// gradient to `grads` (indexed as [`Params`]).
pub fn backward(
    params: &Params,
    packed: &Packed,
    acts: &mut Activations,
    dlogp: &[f32],
    temperature: f64,
    grads: &mut [Vec<f32>],
) {
    assert!(
        acts.keep,
        "backward needs the activations of a forward with keep"
    );
    let cfg = params.cfg;
    let (r, e, i) = (packed.rows(), cfg.n_embd, cfg.inner_dim());
    let eps = cfg.layer_norm_epsilon as f32;
    let heads = Heads { e, h: cfg.n_head };
    let n = packed.targets.len();
    let g = &mut acts.grad;
    for (v, len) in [
        (&mut g.stats.0, r),
        (&mut g.stats.1, r),
        (&mut g.hidden, n * e),
        (&mut g.res, r * e),
        (&mut g.tmp, r * e),
        (&mut g.atty, r * e),
        (&mut g.qkv, r * 3 * e),
        (&mut g.fc, r * i),
    ] {
        fit(v, len);
    }

    // LM head → ln_f's output rows (into tmp).
    g.hidden.fill(0.0);
    let head_index = params.head_index();
    let probs = acts.head_kept.then_some(acts.head_probs.as_mut_slice());
    head::backward_rows(
        HeadGrads {
            hidden: &mut g.hidden,
            head: &mut grads[head_index],
        },
        (&acts.hidden, params.get(head_index), &packed.targets, dlogp),
        e,
        temperature,
        probs,
        params.matmuls,
    );
    g.tmp.fill(0.0);
    for (row, d) in packed.head_rows.iter().zip(g.hidden.chunks_exact(e)) {
        let at = *row as usize * e;
        g.tmp[at..at + e]
            .iter_mut()
            .zip(d)
            .for_each(|(a, b)| *a += b);
    }

    // ln_f → the residual stream.
    g.res.fill(0.0);
    let f = params.ln_f();
    let (gw, gb) = pair(grads, f);
    ops::layernorm_backward(
        &mut g.res,
        gw,
        gb,
        &g.tmp,
        &acts.out,
        &acts.lnf_stats.0,
        &acts.lnf_stats.1,
        params.get(f),
    );
    let w = |l: usize, j: usize| params.get(Params::layer(l, j));
    let how = params.matmuls;
    for l in (0..cfg.n_layer).rev() {
        let a = &acts.layers[l];
        let p = |j: usize| Params::layer(l, j);
        // x' = x₂ + fc_proj(gelu(fc(ln_2 x₂)))
        ops::gelu_forward(&mut acts.gelu, &a.fch);
        let (gw, gb) = pair(grads, p(10));
        ops::matmul_backward(
            &mut g.fc,
            false,
            gw,
            gb,
            &g.res,
            &acts.gelu,
            w(l, 10),
            (r, i, e),
            how,
        );
        ops::gelu_backward(&mut g.fc, None, &a.fch);
        let (m, s) = &mut g.stats;
        ops::layernorm_forward(&mut acts.ln, m, s, &a.x2, w(l, 6), w(l, 7), eps);
        let (gw, gb) = pair(grads, p(8));
        ops::matmul_backward(
            &mut g.tmp,
            false,
            gw,
            gb,
            &g.fc,
            &acts.ln,
            w(l, 8),
            (r, e, i),
            how,
        );
        let (gw, gb) = pair(grads, p(6));
        let (m2, s2) = &a.ln2_stats;
        ops::layernorm_backward(&mut g.res, gw, gb, &g.tmp, &a.x2, m2, s2, w(l, 6));
        // x₂ = x + proj(attn(ln_1 x))
        let (gw, gb) = pair(grads, p(4));
        ops::matmul_backward(
            &mut g.atty,
            false,
            gw,
            gb,
            &g.res,
            &a.atty,
            w(l, 4),
            (r, e, e),
            how,
        );
        attention::attention_backward(&mut g.qkv, &g.atty, &a.qkv, &a.probs, &packed.groups, heads);
        let (m, s) = &mut g.stats;
        ops::layernorm_forward(&mut acts.ln, m, s, &a.x, w(l, 0), w(l, 1), eps);
        let (gw, gb) = pair(grads, p(2));
        ops::matmul_backward(
            &mut g.tmp,
            false,
            gw,
            gb,
            &g.qkv,
            &acts.ln,
            w(l, 2),
            (r, e, 3 * e),
            how,
        );
        let (gw, gb) = pair(grads, p(0));
        let (m1, s1) = &a.ln1_stats;
        ops::layernorm_backward(&mut g.res, gw, gb, &g.tmp, &a.x, m1, s1, w(l, 0));
    }
    let (dwte, rest) = grads.split_at_mut(1);
    ops::embedding_backward(
        &mut dwte[0],
        &mut rest[0],
        &g.res,
        &packed.ids,
        &packed.positions,
    );
}

/// Gradients `i` and `i + 1` (a weight and its bias) at once.
fn pair(grads: &mut [Vec<f32>], i: usize) -> (&mut [f32], &mut [f32]) {
    let (a, b) = grads[i..].split_at_mut(1);
    (&mut a[0], &mut b[0])
}

/// `out` (len, E) = rows `rows` of `x` (·, E).
fn gather_rows(out: &mut Vec<f32>, x: &[f32], rows: &[u32], e: usize) {
    fit(out, rows.len() * e);
    out.par_chunks_mut(e).zip(rows).for_each(|(o, &r)| {
        o.copy_from_slice(&x[r as usize * e..(r as usize + 1) * e]);
    });
}
