//! What the pass needs from a device: buffers it plans, and one kernel per operation.
//!
//! The pass ([`crate::pass`]) owns the order of operations, every buffer's size and every
//! product's operands; a backend owns memory and runs kernels. Kernels write their
//! outputs, and *add* into parameter gradients (`+=`), as each method says. Buffers of
//! one call never alias, but for the in-place ones named so.

use std::ops::{DerefMut, Range};

use crate::gemm::{EpilogueKind, Gemm};
use crate::packed::Packed;

pub(crate) mod error;
pub use error::{Error, Result};

/// Sizes of the attention: E width, H heads, D = E / H.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub e: usize,
    pub h: usize,
}

impl Heads {
    pub fn d(&self) -> usize {
        self.e / self.h
    }
}

/// The LM head's forward on the predicting rows `span` of the N: `logp[n] = log
/// softmax(hidden_n · Wᵀ / τ)[y_n]` and, when asked, each row's entropy; with `keep`, what
/// [`Backend::head_backward`] needs of those rows (the CPU: their probabilities) is left
/// in `scratch`.
pub struct HeadForward<'a, B: Backend + ?Sized> {
    pub logp: &'a mut B::Buf,            // (N)
    pub entropy: Option<&'a mut B::Buf>, // (N)
    pub scratch: &'a mut B::Owned,       // sized by the backend
    pub hidden: &'a B::Buf,              // (N, E)
    pub head: &'a B::Buf,                // (V, E)
    pub span: Range<usize>,
    pub e: usize,
    pub temperature: f64,
    pub keep: bool,
}

/// The LM head's backward on the predicting rows `span`: `dhidden (N, E) += Σ_v d_{n,v}
/// W_v`, `dhead (V, E) += Σ_n d_{n,v} h_n`, `d_{n,v} = g_n (1[v = y_n] − p_{n,v}) / τ`;
/// `probs` is what the forward of the same rows kept (consumed), else the logits are
/// recomputed.
pub struct HeadBackward<'a, B: Backend + ?Sized> {
    pub dhidden: &'a mut B::Buf,
    pub dhead: &'a mut B::Buf,
    pub hidden: &'a B::Buf,
    pub head: &'a B::Buf,
    pub dlogp: &'a B::Buf, // (N)
    pub span: Range<usize>,
    pub e: usize,
    pub temperature: f64,
    pub probs: Option<&'a mut B::Buf>,
}

/// A product's epilogue ([`EpilogueKind`]) with its buffers, for
/// [`Backend::gemm_epilogue`].
pub enum Epilogue<'a, B: Backend + ?Sized> {
    /// `c = op(a)·op(b) + bias`, `bias` (m).
    Bias { bias: &'a B::Buf },
    /// `pre = op(a)·op(b) + bias`, `c = gelu_new(pre)`; `pre` stored like `c`.
    BiasGelu {
        bias: &'a B::Buf,
        pre: &'a mut B::Buf,
    },
    /// `c = (op(a)·op(b)) ⊙ gelu_new'(pre)`; `pre` stored like `c`.
    Dgelu { pre: &'a B::Buf },
    /// `c [+]= op(a)·op(b)`, `db (m) += Σ_l A(i, l)` (A: `a`, the whole buffer).
    BiasGrad { db: &'a mut B::Buf },
}

impl<B: Backend + ?Sized> Epilogue<'_, B> {
    pub fn kind(&self) -> EpilogueKind {
        match self {
            Epilogue::Bias { .. } => EpilogueKind::Bias,
            Epilogue::BiasGelu { .. } => EpilogueKind::BiasGelu,
            Epilogue::Dgelu { .. } => EpilogueKind::Dgelu,
            Epilogue::BiasGrad { .. } => EpilogueKind::BiasGrad,
        }
    }

    /// Checks the call with its buffers ([`Gemm::check`], [`Gemm::check_epilogue`]).
    pub fn check(&self, b: &B, g: &Gemm, (c, a, bb): (&B::Buf, &B::Buf, &B::Buf)) -> Result<()> {
        g.check(b.len(a), b.len(bb), b.len(c))?;
        let (vector, pre) = match self {
            Epilogue::Bias { bias } => (b.len(bias), 0),
            Epilogue::BiasGelu { bias, pre } => (b.len(bias), b.len(pre)),
            Epilogue::Dgelu { pre } => (0, b.len(pre)),
            Epilogue::BiasGrad { db } => (b.len(db), 0),
        };
        g.check_epilogue(self.kind(), (b.len(a), b.len(c)), (vector, pre))
    }
}

/// [`Backend::gemm_epilogue`] as the kernels it replaces: the product, then the bias
/// broadcast before it (added with β = 1), GELU or its gradient after it, or the column
/// sums of A. What every backend runs where its device has no epilogue for the call.
pub fn composed_epilogue<B: Backend + ?Sized>(
    b: &B,
    c: &mut B::Buf,
    g: &Gemm,
    (a, bb): (&B::Buf, &B::Buf),
    epilogue: Epilogue<'_, B>,
) -> Result<()> {
    epilogue.check(b, g, (c, a, bb))?;
    let added = Gemm {
        accumulate: true,
        ..*g
    };
    match epilogue {
        Epilogue::Bias { bias } => {
            b.broadcast_rows(c, bias)?;
            b.gemm(c, &added, a, bb)
        }
        Epilogue::BiasGelu { bias, pre } => {
            b.broadcast_rows(pre, bias)?;
            b.gemm(pre, &added, a, bb)?;
            b.gelu_forward(c, pre)
        }
        Epilogue::Dgelu { pre } => {
            b.gemm(c, g, a, bb)?;
            b.gelu_backward(c, pre)
        }
        Epilogue::BiasGrad { db } => {
            b.gemm(c, g, a, bb)?;
            b.column_sums(db, a)
        }
    }
}

/// A device that runs the pass. `Buf` is a buffer of f32 in its memory; `Rows` a
/// micro-batch's layout there (ids, positions, groups, predicting rows, targets).
#[allow(clippy::too_many_arguments)]
pub trait Backend {
    type Buf: ?Sized;
    type Owned: Default + DerefMut<Target = Self::Buf>;
    type Rows<'a>
    where
        Self: 'a;

    /// Its name in errors and reports.
    fn name(&self) -> &'static str;

    /// Makes `buf` hold exactly `len` elements, keeping its memory when it is large
    /// enough (contents unspecified).
    fn fit(&self, buf: &mut Self::Owned, len: usize) -> Result<()>;
    fn len(&self, buf: &Self::Buf) -> usize;
    /// A copy on the host.
    fn read(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// `buf = host` (the same length).
    fn write(&self, buf: &mut Self::Buf, host: &[f32]) -> Result<()>;
    fn fill(&self, buf: &mut Self::Buf, value: f32) -> Result<()>;
    /// Returns when every kernel launched so far has finished (a timing's end).
    fn synchronize(&self) -> Result<()>;
    /// The micro-batch's layout on the device.
    fn rows<'a>(&self, packed: &'a Packed) -> Result<Self::Rows<'a>>;
    /// Elements of attention state the forward keeps for the backward, per block.
    fn attention_state_len(&self, packed: &Packed, heads: Heads) -> usize;
    /// Rows of the LM head whose state [`crate::pass::train`] keeps from the head's forward
    /// to its backward, chunk by chunk (at a vocabulary of `vocab`); `None`: the backend
    /// keeps none, and the head's backward recomputes its logits after one objective over
    /// every row (a device, where a host round trip per chunk costs more than the
    /// product).
    fn head_keep_rows(&self, vocab: usize) -> Option<usize>;

    /// The column-major product `g` (cuBLAS's `gemm`): `c = op(a) · op(b) [+ c]`, `a` and
    /// `b` the buffers of cuBLAS's A and B.
    fn gemm(&self, c: &mut Self::Buf, g: &Gemm, a: &Self::Buf, b: &Self::Buf) -> Result<()>;
    /// The product `g` with `epilogue` done on its way out (see [`Epilogue`]): one
    /// cuBLASLt call where a device has it; by default the kernels it replaces
    /// ([`composed_epilogue`]).
    fn gemm_epilogue(
        &self,
        c: &mut Self::Buf,
        g: &Gemm,
        (a, b): (&Self::Buf, &Self::Buf),
        epilogue: Epilogue<'_, Self>,
    ) -> Result<()> {
        composed_epilogue(self, c, g, (a, b), epilogue)
    }
    /// Every row of `out` (·, len bias) = `bias`.
    fn broadcast_rows(&self, out: &mut Self::Buf, bias: &Self::Buf) -> Result<()>;
    /// `acc (C) += Σ_rows m (·, C)`, in an order that does not depend on the thread count.
    fn column_sums(&self, acc: &mut Self::Buf, m: &Self::Buf) -> Result<()>;
    /// `out = a + b`.
    fn add(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) -> Result<()>;

    /// `out[r] = wte[ids[r]] + wpe[pos[r]]`.
    fn embedding_forward(
        &self,
        out: &mut Self::Buf,
        rows: &Self::Rows<'_>,
        wte: &Self::Buf,
        wpe: &Self::Buf,
    ) -> Result<()>;
    /// `dwte[ids[r]] += dout[r]`, `dwpe[pos[r]] += dout[r]`.
    fn embedding_backward(
        &self,
        dwte: &mut Self::Buf,
        dwpe: &mut Self::Buf,
        dout: &Self::Buf,
        rows: &Self::Rows<'_>,
    ) -> Result<()>;
    /// `out = (x − mean) · rstd · w + b` row by row, with each row's mean and 1/σ.
    fn layernorm_forward(
        &self,
        out: &mut Self::Buf,
        mean: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        w: &Self::Buf,
        b: &Self::Buf,
        eps: f32,
    ) -> Result<()>;
    /// Backward of [`layernorm_forward`](Self::layernorm_forward): `dx += …`, `dw += …`,
    /// `db += …`.
    fn layernorm_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut Self::Buf,
        db: &mut Self::Buf,
        dout: &Self::Buf,
        x: &Self::Buf,
        mean: &Self::Buf,
        rstd: &Self::Buf,
        w: &Self::Buf,
    ) -> Result<()>;
    /// `out = gelu_new(x)`.
    fn gelu_forward(&self, out: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// In place: `d = d · gelu_new'(x)`.
    fn gelu_backward(&self, d: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// Causal attention of each group, completions over their prompt (see
    /// [`crate::packed::GroupRows`]): `out` (R, E) from `qkv` (R, 3E); `state` keeps
    /// what the backward needs.
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        state: &mut Self::Buf,
        qkv: &Self::Buf,
        rows: &Self::Rows<'_>,
        heads: Heads,
    ) -> Result<()>;
    /// Backward of [`attention_forward`](Self::attention_forward): writes `dqkv` (R, 3E)
    /// for `dout`, the gradient of its output `out` (R, E).
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        out: &Self::Buf,
        qkv: &Self::Buf,
        state: &Self::Buf,
        rows: &Self::Rows<'_>,
        heads: Heads,
    ) -> Result<()>;
    /// `out (N, E)` = the predicting rows of `x (R, E)`.
    fn gather_rows(&self, out: &mut Self::Buf, x: &Self::Buf, rows: &Self::Rows<'_>) -> Result<()>;
    /// `dst (R, E)` += `src (N, E)` scattered to the predicting rows (a row may predict
    /// more than once: a prompt's last row predicts each completion's first token).
    fn scatter_add_rows(
        &self,
        dst: &mut Self::Buf,
        src: &Self::Buf,
        rows: &Self::Rows<'_>,
    ) -> Result<()>;
    /// See [`HeadForward`]; targets from `rows`.
    fn head_forward(&self, f: HeadForward<'_, Self>, rows: &Self::Rows<'_>) -> Result<()>;
    /// See [`HeadBackward`]; targets from `rows`.
    fn head_backward(&self, b: HeadBackward<'_, Self>, rows: &Self::Rows<'_>) -> Result<()>;
}
