//! The LM head on the device: its logits a block of rows at a time (at most
//! [`launch::HEAD_BLOCK_ELEMENTS`]), each block's log-probs, or its gradient and the two products
//! of the backward, without a (rows, vocabulary) buffer; or, with the head kept
//! ([`Cuda::with_kept_head`]), a chunk's probabilities (at most [`launch::HEAD_KEEP_ELEMENTS`])
//! from its forward to its backward. Rows of logits, probabilities and their gradient are
//! [`launch::head_ld`] elements apart (the vocabulary rounded up to 64: aligned rows for
//! cuBLAS), their padding never read or written.

use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{Cuda, CudaRows, DevF32, config, fail, int};
use crate::backend::{Backend, HeadBackward, HeadForward, Result};
use crate::gemm::{RowMajor, row_major};
use crate::launch::{self, head_block};

impl Cuda {
    /// [`Backend::head_forward`] block by block of rows, nothing kept for the backward.
    pub(super) fn head_forward_blocks(
        &self,
        f: HeadForward<'_, Self>,
        rows: &CudaRows,
    ) -> Result<()> {
        let (span, e) = (f.span, f.e);
        let v = f.head.len / e.max(1);
        // Nothing is kept for the backward, which recomputes each block's logits: the
        // pass's head buffer stays empty, the blocks go through the backend's scratch.
        self.fit(f.scratch, 0)?;
        check_span("head", &span, rows.predicted)?;
        if span.is_empty() {
            return Ok(());
        }
        let block = head_block(v, span.len());
        let mut logits = self.scratch(launch::head_rows_len(block, v))?;
        let (vi, ldi, inv_t) = row_args(v, f.temperature)?;
        let targets = self.ptr(&rows.targets);
        let entropy = f.entropy.as_ref().map_or(0, |h| h.ptr);
        for start in span.clone().step_by(block) {
            let m = block.min(span.end - start);
            self.block_logits(&mut logits, f.hidden, f.head, (start, m, v, e))?;
            let (logp, t) = (f.logp.at(start), u32_at(targets, start));
            let h = if entropy == 0 {
                0
            } else {
                entropy + (start * 4) as CUdeviceptr
            };
            launch!(
                self,
                "head_logprobs",
                per_row(m)?,
                &logits.ptr,
                &t,
                &logp,
                &h,
                &vi,
                &ldi,
                &inv_t
            )?;
        }
        Ok(())
    }

    /// [`Backend::head_backward`] block by block of rows, each block's logits recomputed.
    pub(super) fn head_backward_blocks(
        &self,
        b: HeadBackward<'_, Self>,
        rows: &CudaRows,
    ) -> Result<()> {
        let (span, e) = (b.span, b.e);
        let v = b.head.len / e.max(1);
        check_span("head", &span, rows.predicted)?;
        if span.is_empty() {
            return Ok(());
        }
        let block = head_block(v, span.len());
        let mut logits = self.scratch(launch::head_rows_len(block, v))?;
        let (vi, ldi, inv_t) = row_args(v, b.temperature)?;
        let targets = self.ptr(&rows.targets);
        for start in span.clone().step_by(block) {
            let m = block.min(span.end - start);
            self.block_logits(&mut logits, b.hidden, b.head, (start, m, v, e))?;
            let (t, up) = (u32_at(targets, start), b.dlogp.at(start));
            launch!(
                self,
                "head_grad",
                per_row(m)?,
                &logits.ptr,
                &t,
                &up,
                &vi,
                &ldi,
                &inv_t
            )?;
            let grads = (&mut *b.dhidden, &mut *b.dhead);
            self.backward_products(grads, (b.hidden, b.head, &logits), (start, m, v, e))?;
        }
        Ok(())
    }

    /// [`Backend::head_forward`] of a chunk whose probabilities are kept: its logits (m, V)
    /// one product into the pass's head buffer, then per row the log-prob (and entropy)
    /// and the probabilities in place of the logits (`head_probs`).
    pub(super) fn head_forward_kept(
        &self,
        f: HeadForward<'_, Self>,
        rows: &CudaRows,
    ) -> Result<()> {
        let (span, e) = (f.span, f.e);
        let v = f.head.len / e.max(1);
        check_span("head", &span, rows.predicted)?;
        let m = span.len();
        self.fit(f.scratch, launch::head_rows_len(m, v))?;
        if m == 0 {
            return Ok(());
        }
        let probs: &mut DevF32 = f.scratch;
        self.block_logits(probs, f.hidden, f.head, (span.start, m, v, e))?;
        let (vi, ldi, inv_t) = row_args(v, f.temperature)?;
        let t = u32_at(self.ptr(&rows.targets), span.start);
        let logp = f.logp.at(span.start);
        let h = f.entropy.as_ref().map_or(0, |h| h.at(span.start));
        launch!(
            self,
            "head_probs",
            per_row(m)?,
            &probs.ptr,
            &t,
            &logp,
            &h,
            &vi,
            &ldi,
            &inv_t
        )
    }

    /// [`Backend::head_backward`] from the probabilities [`Cuda::head_forward_kept`] kept
    /// of the same rows: turned into the logits' gradient in place (`head_grad_kept`), then
    /// the two products of the backward over the whole chunk.
    pub(super) fn head_backward_kept(
        &self,
        b: HeadBackward<'_, Self>,
        rows: &CudaRows,
    ) -> Result<()> {
        let (span, e) = (b.span, b.e);
        let v = b.head.len / e.max(1);
        check_span("head", &span, rows.predicted)?;
        let (start, m) = (span.start, span.len());
        let Some(probs) = b.probs else {
            return Err(fail("head", "no kept probabilities"));
        };
        if probs.len != launch::head_rows_len(m, v) {
            return Err(fail(
                "head",
                format!("{} kept probabilities for {m} rows of {v}", probs.len),
            ));
        }
        if m == 0 {
            return Ok(());
        }
        let mi = int("head", m)?;
        let (vi, ldi, inv_t) = row_args(v, b.temperature)?;
        let (t, up) = (u32_at(self.ptr(&rows.targets), start), b.dlogp.at(start));
        launch!(
            self,
            "head_grad_kept",
            super::elementwise(m * v)?,
            &probs.ptr,
            &t,
            &up,
            &mi,
            &vi,
            &ldi,
            &inv_t
        )?;
        self.backward_products(
            (b.dhidden, b.dhead),
            (b.hidden, b.head, probs),
            (start, m, v, e),
        )
    }

    /// The head's backward products for the rows `start..start + m`, from their logits'
    /// gradient `d` (m, V; rows [`launch::head_ld`] apart): ∂hidden[start..] (m, E) += d ·
    /// W (V, E), and ∂W (V, E) += dᵀ (V, m) · hidden[start..] (m, E).
    fn backward_products(
        &self,
        (dhidden, dhead): (&mut DevF32, &mut DevF32),
        (hidden, head, d): (&DevF32, &DevF32, &DevF32),
        (start, m, v, e): (usize, usize, usize, usize),
    ) -> Result<()> {
        let ld = launch::head_ld(v);
        let g = row_major(
            (m, e, v),
            RowMajor::plain(ld),
            RowMajor::plain(e),
            start * e,
            true,
        );
        self.gemm(dhidden, &g, head, d)?;
        let g = row_major(
            (v, e, m),
            RowMajor::transposed(ld),
            RowMajor::plain(e).at(start * e),
            0,
            true,
        );
        self.gemm(dhead, &g, hidden, d)
    }

    /// `out` (m, V; rows [`launch::head_ld`] apart) = hidden rows `start..start + m` (·, E)
    /// · Wᵀ, W (V, E) the head: one block of the head's logits, before the temperature.
    fn block_logits(
        &self,
        out: &mut DevF32,
        hidden: &DevF32,
        head: &DevF32,
        (start, m, v, e): (usize, usize, usize, usize),
    ) -> Result<()> {
        let g = row_major(
            (m, v, e),
            RowMajor::plain(e).at(start * e),
            RowMajor::transposed(e),
            0,
            false,
        )
        .with_ldc(launch::head_ld(v));
        // cuBLAS's A is the right operand (W), its B the left (the hidden rows).
        self.gemm(out, &g, head, hidden)
    }
}

/// `Err` unless `span` lies within the `n` predicting rows.
fn check_span(op: &'static str, span: &std::ops::Range<usize>, n: usize) -> Result<()> {
    if span.start <= span.end && span.end <= n {
        Ok(())
    } else {
        Err(fail(op, format!("rows {span:?} of {n}")))
    }
}

/// The head's kernels' row arguments: the vocabulary V, the rows' stride
/// ([`launch::head_ld`]) and 1/τ.
fn row_args(v: usize, temperature: f64) -> Result<(i32, i32, f32)> {
    let ld = launch::head_ld(v);
    Ok((
        int("head", v)?,
        int("head", ld)?,
        (1.0 / temperature) as f32,
    ))
}

/// A block per row, `m` rows (the head's kernels; [`launch::per_row`]).
fn per_row(m: usize) -> Result<LaunchConfig> {
    launch::per_row(m).map(config)
}

/// The device address of u32 element `i` from `base`.
fn u32_at(base: CUdeviceptr, i: usize) -> CUdeviceptr {
    base + (i * std::mem::size_of::<u32>()) as CUdeviceptr
}
