//! The desk estimate of a training step: what it asks of a device, counted by running the
//! pass itself ([`crate::pass`]) over a backend that computes nothing and tallies each
//! call ([`Tally`]) — the FLOPs, the bytes it moves through device memory, the calls —
//! and the least time those take on a device ([`Roofline`]). Not a guess beside the code:
//! the pass's own order, buffers and products are what is counted, so a change to the
//! pass changes the estimate.
//!
//! Bytes count every operand read once from device memory and every output written once
//! (an accumulated output read and written): what a kernel that keeps nothing in cache
//! between calls moves. Activations and the products' operands take `element_bytes` each
//! (4 as the CUDA backend keeps them today, 2 in BF16); the parameters' gradients, which
//! products accumulate into, stay f32.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};

use rookworld_lm::config::Config;

use crate::backend::{Backend, Epilogue, HeadBackward, HeadForward, Heads, Result};
use crate::gemm::Gemm;
use crate::packed::Packed;
use crate::weights::{self, Weights};

/// A buffer of the tally: its length only.
#[derive(Debug, Default)]
pub struct Len(usize);

/// An owned buffer of the tally.
#[derive(Debug, Default)]
pub struct OwnedLen(Len);

impl Deref for OwnedLen {
    type Target = Len;
    fn deref(&self) -> &Len {
        &self.0
    }
}

impl DerefMut for OwnedLen {
    fn deref_mut(&mut self) -> &mut Len {
        &mut self.0
    }
}

/// What the calls of one operation asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Work {
    pub calls: u64,
    pub flops: f64,
    pub bytes: f64,
}

impl Work {
    fn add(&mut self, o: Work) {
        self.calls += o.calls;
        self.flops += o.flops;
        self.bytes += o.bytes;
    }

    /// The least time on `device`: its FLOPs at the peak or its bytes at the bandwidth,
    /// whichever is longer.
    pub fn seconds(&self, device: &Roofline) -> f64 {
        (self.flops / device.flops).max(self.bytes / device.bytes_per_second)
    }
}

/// A backend that runs nothing and counts: each call adds its [`Work`] under its
/// operation's name.
#[derive(Debug)]
pub struct Tally {
    /// Bytes of an activation and of a product's operand (4 f32, 2 BF16).
    pub element_bytes: usize,
    /// Rows of the LM head kept from its forward to its backward (`None`: recomputed),
    /// as the backend being estimated does.
    pub head_keep_rows: Option<usize>,
    /// The products' epilogues inside them ([`Backend::gemm_epilogue`], as the trial
    /// family `step_epilogues` runs them), or the kernels they replace.
    pub epilogues: bool,
    work: RefCell<BTreeMap<&'static str, Work>>,
}

/// f32 bytes of `elements`.
fn f32s(elements: usize) -> f64 {
    4.0 * elements as f64
}

impl Tally {
    pub fn new(element_bytes: usize, head_keep_rows: Option<usize>) -> Self {
        Self {
            element_bytes,
            head_keep_rows,
            epilogues: false,
            work: RefCell::default(),
        }
    }

    /// The tally with the products' epilogues inside them.
    pub fn with_epilogues(self, on: bool) -> Self {
        Self {
            epilogues: on,
            ..self
        }
    }

    /// Bytes of `elements` activations.
    fn elems(&self, elements: usize) -> f64 {
        (self.element_bytes * elements) as f64
    }

    fn count(&self, op: &'static str, flops: f64, bytes: f64) {
        self.count_calls(op, 1, flops, bytes);
    }

    /// Work done inside another call (an epilogue inside its product): no call of its own.
    fn count_calls(&self, op: &'static str, calls: u64, flops: f64, bytes: f64) {
        self.work.borrow_mut().entry(op).or_default().add(Work {
            calls,
            flops,
            bytes,
        });
    }

    /// Every operation's work so far, by name.
    pub fn work(&self) -> BTreeMap<&'static str, Work> {
        self.work.borrow().clone()
    }

    /// Adds what `other` counted.
    pub fn merge(&self, other: &BTreeMap<&'static str, Work>) {
        let mut work = self.work.borrow_mut();
        for (op, w) in other {
            work.entry(op).or_default().add(*w);
        }
    }

    /// A product of (m, k) by (k, n): 2mnk FLOPs, its operands read, its output written
    /// — or, accumulated into a parameter's f32 gradient, read and written.
    fn product(&self, op: &'static str, m: usize, n: usize, k: usize, accumulate: bool) {
        let out = if accumulate {
            2.0 * f32s(m * n)
        } else {
            self.elems(m * n)
        };
        self.count(
            op,
            2.0 * (m * n * k) as f64,
            self.elems(m * k + k * n) + out,
        );
    }

    /// Causal pairs (query row, key row) of the attention over `packed`: each group's
    /// prompt its own triangle, each completion the prompt and its own triangle.
    fn pairs(packed: &Packed) -> usize {
        packed
            .groups
            .iter()
            .map(|g| {
                let lp = g.prompt.len();
                lp * (lp + 1) / 2
                    + g.completions
                        .iter()
                        .map(|c| c.len() * lp + c.len() * (c.len() + 1) / 2)
                        .sum::<usize>()
            })
            .sum()
    }
}

#[allow(clippy::too_many_arguments)]
impl Backend for Tally {
    type Buf = Len;
    type Owned = OwnedLen;
    type Rows<'a> = &'a Packed;

    fn name(&self) -> &'static str {
        "tally"
    }

    fn fit(&self, buf: &mut OwnedLen, len: usize) -> Result<()> {
        buf.0.0 = len;
        Ok(())
    }

    fn len(&self, buf: &Len) -> usize {
        buf.0
    }

    fn read(&self, buf: &Len) -> Result<Vec<f32>> {
        self.count("copy to host", 0.0, f32s(buf.0));
        Ok(vec![0.0; buf.0])
    }

    fn write(&self, buf: &mut Len, _host: &[f32]) -> Result<()> {
        self.count("copy from host", 0.0, f32s(buf.0));
        Ok(())
    }

    fn fill(&self, buf: &mut Len, _value: f32) -> Result<()> {
        self.count("fill", 0.0, self.elems(buf.0));
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn rows<'a>(&self, packed: &'a Packed) -> Result<&'a Packed> {
        Ok(packed)
    }

    fn attention_state_len(&self, packed: &Packed, heads: Heads) -> usize {
        // Each (row, head)'s log-sum-exp, as a device keeps it.
        packed.rows() * heads.h
    }

    fn head_keep_rows(&self, _vocab: usize) -> Option<usize> {
        self.head_keep_rows
    }

    fn gemm(&self, _c: &mut Len, g: &Gemm, _a: &Len, _b: &Len) -> Result<()> {
        self.product("products", g.m, g.n, g.k, g.accumulate);
        Ok(())
    }

    /// With epilogues, the product and what its epilogue reads and writes beside it (the
    /// bias; GELU's input, written or read; the bias's gradient, written and then added
    /// into the f32 gradient), counted under the kernels' names they replace; without,
    /// those kernels.
    fn gemm_epilogue(
        &self,
        c: &mut Len,
        g: &Gemm,
        (a, b): (&Len, &Len),
        epilogue: Epilogue<'_, Self>,
    ) -> Result<()> {
        if !self.epilogues {
            return crate::backend::composed_epilogue(self, c, g, (a, b), epilogue);
        }
        self.product("products", g.m, g.n, g.k, g.accumulate);
        let out = (g.m * g.n) as f64;
        let inside = |op, flops, bytes| self.count_calls(op, 0, flops, bytes);
        match epilogue {
            Epilogue::Bias { bias } => inside("bias", out, self.elems(bias.0)),
            Epilogue::BiasGelu { bias, pre } => {
                inside("bias", out, self.elems(bias.0));
                inside("gelu", 15.0 * out, self.elems(pre.0));
            }
            Epilogue::Dgelu { pre } => inside("gelu", 25.0 * out, self.elems(pre.0)),
            // Written by the product, then added into the f32 gradient (a call).
            Epilogue::BiasGrad { db } => {
                inside("bias gradient", (g.m * g.k) as f64, f32s(db.0));
                self.count("bias gradient", g.m as f64, f32s(3 * db.0));
            }
        }
        Ok(())
    }

    fn broadcast_rows(&self, out: &mut Len, bias: &Len) -> Result<()> {
        self.count("bias", 0.0, self.elems(out.0 + bias.0));
        Ok(())
    }

    fn column_sums(&self, acc: &mut Len, m: &Len) -> Result<()> {
        self.count("bias gradient", m.0 as f64, self.elems(m.0 + 2 * acc.0));
        Ok(())
    }

    fn add(&self, out: &mut Len, _a: &Len, _b: &Len) -> Result<()> {
        self.count("residual", out.0 as f64, self.elems(3 * out.0));
        Ok(())
    }

    fn embedding_forward(&self, out: &mut Len, _r: &&Packed, _wte: &Len, _wpe: &Len) -> Result<()> {
        self.count("embedding", out.0 as f64, self.elems(3 * out.0));
        Ok(())
    }

    fn embedding_backward(
        &self,
        _dwte: &mut Len,
        _dwpe: &mut Len,
        dout: &Len,
        _rows: &&Packed,
    ) -> Result<()> {
        // Each row read once and added into two gradient rows (read and written).
        self.count("embedding", 2.0 * dout.0 as f64, self.elems(5 * dout.0));
        Ok(())
    }

    fn layernorm_forward(
        &self,
        out: &mut Len,
        _mean: &mut Len,
        _rstd: &mut Len,
        _x: &Len,
        _w: &Len,
        _b: &Len,
        _eps: f32,
    ) -> Result<()> {
        self.count("layer norm", 8.0 * out.0 as f64, self.elems(2 * out.0));
        Ok(())
    }

    fn layernorm_backward(
        &self,
        dx: &mut Len,
        _dw: &mut Len,
        _db: &mut Len,
        _dout: &Len,
        _x: &Len,
        _mean: &Len,
        _rstd: &Len,
        _w: &Len,
    ) -> Result<()> {
        // dout and x read, dx read and written.
        self.count("layer norm", 12.0 * dx.0 as f64, self.elems(4 * dx.0));
        Ok(())
    }

    fn gelu_forward(&self, out: &mut Len, _x: &Len) -> Result<()> {
        self.count("gelu", 15.0 * out.0 as f64, self.elems(2 * out.0));
        Ok(())
    }

    fn gelu_backward(&self, d: &mut Len, _x: &Len) -> Result<()> {
        self.count("gelu", 25.0 * d.0 as f64, self.elems(3 * d.0));
        Ok(())
    }

    fn attention_forward(
        &self,
        out: &mut Len,
        state: &mut Len,
        qkv: &Len,
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        // QKᵀ and PV: 4D FLOPs a pair and head, the softmax's exp and sums beside.
        let pairs = (Self::pairs(rows) * heads.h) as f64;
        let flops = pairs * (4 * heads.d() + 5) as f64;
        self.count("attention", flops, self.elems(qkv.0 + out.0 + state.0));
        Ok(())
    }

    fn attention_backward(
        &self,
        dqkv: &mut Len,
        dout: &Len,
        out: &Len,
        qkv: &Len,
        state: &Len,
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        // QKᵀ recomputed, then dP = dO Vᵀ, dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q.
        let pairs = (Self::pairs(rows) * heads.h) as f64;
        let flops = pairs * (10 * heads.d() + 8) as f64;
        let bytes = self.elems(dqkv.0 + dout.0 + out.0 + qkv.0 + state.0);
        self.count("attention", flops, bytes);
        Ok(())
    }

    fn gather_rows(&self, out: &mut Len, _x: &Len, _rows: &&Packed) -> Result<()> {
        self.count("gather and scatter", 0.0, self.elems(2 * out.0));
        Ok(())
    }

    fn scatter_add_rows(&self, _dst: &mut Len, src: &Len, _rows: &&Packed) -> Result<()> {
        self.count("gather and scatter", src.0 as f64, self.elems(3 * src.0));
        Ok(())
    }

    fn head_forward(&self, f: HeadForward<'_, Self>, _rows: &&Packed) -> Result<()> {
        let (n, v) = (f.span.len(), f.head.0 / f.e);
        // The logits' product, then their softmax (written, read back, and kept when
        // asked).
        self.product("LM head", n, v, f.e, false);
        let kept = if f.keep { 1.0 } else { 0.0 };
        self.count(
            "LM head softmax",
            5.0 * (n * v) as f64,
            self.elems(n * v) * (1.0 + kept),
        );
        Ok(())
    }

    fn head_backward(&self, b: HeadBackward<'_, Self>, _rows: &&Packed) -> Result<()> {
        let (n, v) = (b.span.len(), b.head.0 / b.e);
        if b.probs.is_none() {
            self.product("LM head", n, v, b.e, false);
        }
        // d = g (onehot − p) / τ, read and written; then dhidden += d W, dW += dᵀ h.
        self.count(
            "LM head softmax",
            3.0 * (n * v) as f64,
            self.elems(2 * n * v),
        );
        self.product("LM head", n, b.e, v, true);
        self.product("LM head", v, b.e, n, true);
        Ok(())
    }
}

/// A device's peak rates: dense products in the step's operand dtype, and memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    pub name: &'static str,
    /// Dense FLOP/s of the products.
    pub flops: f64,
    pub bytes_per_second: f64,
}

/// One H100 SXM: 989 TFLOP/s dense BF16 (495 TF32), 3.35 TB/s HBM3.
pub const H100: Roofline = Roofline {
    name: "H100 SXM",
    flops: 989e12,
    bytes_per_second: 3.35e12,
};

/// One H200: H100's tensor cores, 4.8 TB/s HBM3e.
pub const H200: Roofline = Roofline {
    name: "H200",
    flops: 989e12,
    bytes_per_second: 4.8e12,
};

/// A step's shape: P prompts of `prompt` tokens, G completions of `completion` tokens,
/// in micro-batches of `micro_batch_groups` groups; a reference forward when
/// `reference`.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    pub prompts: usize,
    pub group: usize,
    pub prompt: usize,
    pub completion: usize,
    pub micro_batch_groups: usize,
    pub reference: bool,
}

/// The work of one optimizer step of `shape` on a model of `cfg`, by operation: every
/// micro-batch's reference forward and pass ([`crate::pass::train`]) over `tally`, then
/// AdamW over the parameters (`optimizer`: each parameter's weight, gradient and two
/// moments read, the three written, and its BF16 copy for the push).
pub fn step(cfg: &Config, shape: StepShape, tally: &Tally) -> Result<BTreeMap<&'static str, Work>> {
    let lengths = weights::lengths(cfg);
    let params: Vec<OwnedLen> = lengths.iter().map(|&n| OwnedLen(Len(n))).collect();
    let mut grads: Vec<OwnedLen> = lengths.iter().map(|&n| OwnedLen(Len(n))).collect();
    let weights = Weights::<Tally>::new(cfg, params.iter().map(|p| &**p).collect())?;
    let group: Vec<Vec<u32>> = vec![vec![0; shape.completion]; shape.group];
    let per = shape.micro_batch_groups.clamp(1, shape.prompts.max(1));
    let mut acts = crate::pass::Activations::<Tally>::default();
    let mut left = shape.prompts;
    while left > 0 {
        let groups = per.min(left);
        left -= groups;
        let prompts = vec![vec![0u32; shape.prompt]; groups];
        let completions = vec![group.clone(); groups];
        let packed = Packed::of(&prompts, &completions);
        if shape.reference {
            let mut reference = crate::pass::Activations::<Tally>::default();
            crate::pass::forward(tally, &weights, &packed, 1.0, &mut reference, false)?;
        }
        crate::pass::train(
            tally,
            &weights,
            &packed,
            1.0,
            (&mut acts, &mut grads),
            |span, _| Ok(vec![0.0; span.len()]),
        )?;
    }
    let n = cfg.num_parameters() as f64;
    let mut work = tally.work();
    work.insert(
        "optimizer",
        Work {
            calls: 1,
            flops: 12.0 * n,
            bytes: n * (16.0 + 12.0 + 2.0),
        },
    );
    Ok(work)
}

/// The desk estimate of a decode step of `rows` rows at `context` positions each (the
/// prompt and the tokens so far), BF16 weights and KV cache: the projections' and the
/// head's products over every row (2 FLOPs per weight per row), each row's attention over
/// its context, the weights read once, each row's keys and values read once (a prompt
/// shared by its group is read per row: the kernels today) and one new (K, V) row written
/// per layer.
pub fn decode_step(cfg: &Config, rows: usize, context: usize) -> Work {
    let (l, e, v) = (cfg.n_layer, cfg.n_embd, cfg.vocab_size);
    let body = 12 * l * e * e;
    let products = 2.0 * (rows * (body + v * e)) as f64;
    let attention = 4.0 * (rows * context * e * l) as f64;
    let weights = 2.0 * (body + v * e + cfg.n_positions * e) as f64;
    let cache = 2.0 * (rows * context * 2 * e * l) as f64;
    let logits = 2.0 * (rows * v) as f64;
    Work {
        calls: 0,
        flops: products + attention,
        bytes: weights + cache + logits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> StepShape {
        StepShape {
            prompts: 32,
            group: 8,
            prompt: 46,
            completion: 64,
            micro_batch_groups: 8,
            reference: true,
        }
    }

    /// The products' FLOPs the tally counts over the pass itself are the model's: 8 per
    /// body weight and row fed (2 the reference's forward, 2 the policy's, 4 its
    /// backward), and the head's 2 + 2 + 4 (+ 2 recomputed) per weight and token predicted.
    #[test]
    fn the_tally_counts_the_model_s_products() {
        let cfg = Config::gpt2_124m();
        let s = shape();
        let work = step(&cfg, s, &Tally::new(4, None)).unwrap();
        let rows = s.prompts * (s.prompt + s.group * (s.completion - 1));
        let predicted = s.prompts * s.group * s.completion;
        let body = (cfg.n_layer * 12 * cfg.n_embd * cfg.n_embd) as f64;
        let head = (cfg.vocab_size * cfg.n_embd) as f64;
        let products = work["products"].flops;
        assert!(
            (products / (8.0 * body * rows as f64) - 1.0).abs() < 1e-9,
            "{products}"
        );
        assert_eq!(work["LM head"].flops, 10.0 * head * predicted as f64);
        // The step's calls: 4 micro-batches, each a reference forward and a pass.
        assert!(work["products"].calls > 4 * 12 * 4 * 3);
        assert_eq!(work["optimizer"].calls, 1);
    }

    /// A head kept from the forward drops the recomputed product; BF16 elements move less
    /// for the same FLOPs.
    #[test]
    fn a_kept_head_and_bf16_operands_move_less() {
        let cfg = Config::tiny();
        let s = StepShape {
            prompts: 2,
            group: 4,
            prompt: 8,
            completion: 6,
            micro_batch_groups: 2,
            reference: false,
        };
        let recomputed = step(&cfg, s, &Tally::new(4, None)).unwrap();
        let kept = step(&cfg, s, &Tally::new(4, Some(1 << 20))).unwrap();
        // V · E per token predicted, 2 × 4 × 6 tokens.
        let head = (cfg.vocab_size * cfg.n_embd * 2 * 4 * 6) as f64;
        assert_eq!(
            recomputed["LM head"].flops - kept["LM head"].flops,
            2.0 * head
        );
        let bf16 = step(&cfg, s, &Tally::new(2, None)).unwrap();
        assert!(bf16["products"].bytes < recomputed["products"].bytes);
        assert_eq!(bf16["products"].flops, recomputed["products"].flops);
        // The epilogues: the same products, and the bias's, GELU's and the bias
        // gradient's traffic mostly gone.
        let fused = step(&cfg, s, &Tally::new(4, None).with_epilogues(true)).unwrap();
        assert_eq!(fused["products"].flops, recomputed["products"].flops);
        assert_eq!(fused["products"].calls, recomputed["products"].calls);
        for op in ["bias", "bias gradient"] {
            assert!(fused[op].bytes < recomputed[op].bytes / 10.0, "{op}");
        }
        // The bias and the forwards' GELU launch nothing of their own; GELU's gradient
        // neither (the output's GELU is recomputed in the backward, a call a layer).
        assert_eq!(fused["bias"].calls, 0);
        assert_eq!(fused["gelu"].calls, recomputed["gelu"].calls / 3);
        // GELU's output is still recomputed in the backward, for the weight's gradient.
        assert!(fused["gelu"].bytes < recomputed["gelu"].bytes * 0.6);
        // The forward's products no longer add into a broadcast bias.
        assert!(fused["products"].bytes < recomputed["products"].bytes);
    }

    /// A decode step at 256 rows of 142 positions: the weights (249 MB) and the caches
    /// (1.34 GB) make up its 1.61 GB.
    #[test]
    fn a_decode_step_is_its_weights_and_caches() {
        let cfg = Config::gpt2_124m();
        let w = decode_step(&cfg, 256, 142);
        assert!((w.bytes / 1e9 - 1.61).abs() < 0.01, "{}", w.bytes);
        let t = w.seconds(&H200);
        assert!(t > 3e-4 && t < 4e-4, "{t}");
    }
}
