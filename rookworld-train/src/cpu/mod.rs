//! The CPU backend: f32 kernels over `Vec<f32>` buffers, products in f32 or with BF16
//! operands ([`ops::Matmuls`]), the work of each kernel spread over rayon's threads.
//! Its kernels cannot fail: every method returns `Ok` once the shapes hold.

pub mod attention;
pub mod head;
pub mod ops;

use crate::backend::{Backend, Error, HeadBackward, HeadForward, Heads, Result};
use crate::gemm::Gemm;
use crate::packed::Packed;
use ops::Matmuls;

/// The CPU backend; `matmuls` says how it multiplies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cpu {
    pub matmuls: Matmuls,
    /// Rows of the LM head whose probabilities a chunk of [`crate::pass::train`] keeps;
    /// `None`: 128 MiB's worth ([`head::keep_rows`]).
    pub head_keep_rows: Option<usize>,
}

impl Cpu {
    pub fn new(matmuls: Matmuls) -> Self {
        Self {
            matmuls,
            head_keep_rows: None,
        }
    }

    /// With chunks of the head of at most `rows` rows (at least one).
    pub fn with_head_keep_rows(self, rows: usize) -> Self {
        Self {
            head_keep_rows: Some(rows.max(1)),
            ..self
        }
    }
}

/// `Err` naming `op` unless `ok`.
fn shape(ok: bool, op: &'static str, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Kernel {
            backend: "cpu",
            op,
            message: what(),
        })
    }
}

impl Backend for Cpu {
    type Buf = [f32];
    type Owned = Vec<f32>;
    type Rows<'a> = &'a Packed;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn fit(&self, buf: &mut Vec<f32>, len: usize) -> Result<()> {
        buf.resize(len, 0.0);
        Ok(())
    }

    fn len(&self, buf: &[f32]) -> usize {
        buf.len()
    }

    fn read(&self, buf: &[f32]) -> Result<Vec<f32>> {
        Ok(buf.to_vec())
    }

    fn write(&self, buf: &mut [f32], host: &[f32]) -> Result<()> {
        shape(buf.len() == host.len(), "write", || {
            format!("{} elements into {}", host.len(), buf.len())
        })?;
        buf.copy_from_slice(host);
        Ok(())
    }

    fn fill(&self, buf: &mut [f32], value: f32) -> Result<()> {
        use rayon::prelude::*;
        buf.par_chunks_mut(1 << 16).for_each(|c| c.fill(value));
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn rows<'a>(&self, packed: &'a Packed) -> Result<&'a Packed> {
        Ok(packed)
    }

    fn head_keep_rows(&self, vocab: usize) -> Option<usize> {
        Some(
            self.head_keep_rows
                .unwrap_or_else(|| head::keep_rows(vocab)),
        )
    }

    fn attention_state_len(&self, packed: &Packed, heads: Heads) -> usize {
        heads.h * packed.groups.iter().map(|g| g.probs_len()).sum::<usize>()
    }

    fn gemm(&self, c: &mut [f32], g: &Gemm, a: &[f32], b: &[f32]) -> Result<()> {
        g.check(a.len(), b.len(), c.len())?;
        // cuBLAS's B is the row-major left operand, its A the right one.
        let s = g.strided();
        shape(s.dst.1 == s.shape.1, "gemm", || {
            format!("{g:?}: C's rows must be contiguous on the CPU")
        })?;
        let (rows, cols, _) = s.shape;
        ops::gemm(
            &mut c[s.dst.0..s.dst.0 + rows * cols],
            s.shape,
            g.accumulate,
            (&b[s.lhs.0..], s.lhs.1, s.lhs.2),
            (&a[s.rhs.0..], s.rhs.1, s.rhs.2),
            self.matmuls,
        );
        Ok(())
    }

    fn broadcast_rows(&self, out: &mut [f32], bias: &[f32]) -> Result<()> {
        use rayon::prelude::*;
        let n = bias.len().max(1);
        shape(out.len().is_multiple_of(n), "broadcast_rows", || {
            format!("{} elements in rows of {n}", out.len())
        })?;
        out.par_chunks_mut(n)
            .for_each(|row| row.copy_from_slice(bias));
        Ok(())
    }

    fn column_sums(&self, acc: &mut [f32], m: &[f32]) -> Result<()> {
        let n = acc.len().max(1);
        shape(m.len().is_multiple_of(n), "column_sums", || {
            format!("{} elements in rows of {n}", m.len())
        })?;
        ops::column_sums(acc, m, n);
        Ok(())
    }

    fn add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<()> {
        ops::add(out, a, b);
        Ok(())
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        rows: &&Packed,
        wte: &[f32],
        wpe: &[f32],
    ) -> Result<()> {
        ops::embedding_forward(out, &rows.ids, &rows.positions, wte, wpe);
        Ok(())
    }

    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        rows: &&Packed,
    ) -> Result<()> {
        ops::embedding_backward(dwte, dwpe, dout, &rows.ids, &rows.positions);
        Ok(())
    }

    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
    ) -> Result<()> {
        ops::layernorm_forward(out, mean, rstd, x, w, b, eps);
        Ok(())
    }

    fn layernorm_backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
        dout: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        w: &[f32],
    ) -> Result<()> {
        ops::layernorm_backward(dx, dw, db, dout, x, mean, rstd, w);
        Ok(())
    }

    fn gelu_forward(&self, out: &mut [f32], x: &[f32]) -> Result<()> {
        ops::gelu_forward(out, x);
        Ok(())
    }

    fn gelu_backward(&self, d: &mut [f32], x: &[f32]) -> Result<()> {
        ops::gelu_backward(d, None, x);
        Ok(())
    }

    fn attention_forward(
        &self,
        out: &mut [f32],
        state: &mut [f32],
        qkv: &[f32],
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        attention::attention_forward(out, state, qkv, &rows.groups, heads);
        Ok(())
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dout: &[f32],
        _out: &[f32],
        qkv: &[f32],
        state: &[f32],
        rows: &&Packed,
        heads: Heads,
    ) -> Result<()> {
        attention::attention_backward(dqkv, dout, qkv, state, &rows.groups, heads);
        Ok(())
    }

    fn gather_rows(&self, out: &mut [f32], x: &[f32], rows: &&Packed) -> Result<()> {
        use rayon::prelude::*;
        let e = out.len() / rows.head_rows.len().max(1);
        out.par_chunks_mut(e.max(1))
            .zip(&rows.head_rows)
            .for_each(|(o, &r)| o.copy_from_slice(&x[r as usize * e..(r as usize + 1) * e]));
        Ok(())
    }

    fn scatter_add_rows(&self, dst: &mut [f32], src: &[f32], rows: &&Packed) -> Result<()> {
        let e = src.len() / rows.head_rows.len().max(1);
        for (row, d) in rows.head_rows.iter().zip(src.chunks_exact(e.max(1))) {
            let at = *row as usize * e;
            dst[at..at + e].iter_mut().zip(d).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn head_forward(&self, f: HeadForward<'_, Self>, rows: &&Packed) -> Result<()> {
        let (span, e) = (f.span, f.e);
        let n = rows.targets.len();
        shape(span.start <= span.end && span.end <= n, "head", || {
            format!("rows {span:?} of {n}")
        })?;
        let mut entropy = f.entropy.is_some().then(Vec::new);
        let logp = head::logprobs_rows(
            &f.hidden[span.start * e..span.end * e],
            f.head,
            &rows.targets[span.clone()],
            e,
            f.temperature,
            f.scratch,
            f.keep,
            entropy.as_mut(),
            self.matmuls,
        );
        f.logp[span.clone()].copy_from_slice(&logp);
        if let (Some(dst), Some(h)) = (f.entropy, entropy) {
            dst[span].copy_from_slice(&h);
        }
        Ok(())
    }

    fn head_backward(&self, b: HeadBackward<'_, Self>, rows: &&Packed) -> Result<()> {
        let (span, e) = (b.span, b.e);
        let n = rows.targets.len();
        shape(span.start <= span.end && span.end <= n, "head", || {
            format!("rows {span:?} of {n}")
        })?;
        let v = b.head.len() / e.max(1);
        head::backward_rows(
            head::HeadGrads {
                hidden: &mut b.dhidden[span.start * e..span.end * e],
                head: b.dhead,
            },
            (
                &b.hidden[span.start * e..span.end * e],
                b.head,
                &rows.targets[span.clone()],
                &b.dlogp[span.clone()],
            ),
            e,
            b.temperature,
            b.probs.map(|p| &mut p[..span.len() * v]),
            self.matmuls,
        );
        Ok(())
    }
}
