//! The decode step's attention on the CPU in f32, read straight from the grouped cache's
//! buffers: for each row and head, scores against its prompt's keys and its own suffix,
//! one softmax, the weighted sum of values. Rows run in parallel (rayon).
//!
//! candle would run this as hundreds of tiny matmuls per layer (one per row and head);
//! here each (row, head) is a few thousand multiply-adds done in place, which at decode
//! batch sizes costs less than the dispatch of those matmuls: each run of keys (the
//! prompt's, the row's own) scored four keys per load of the query and each run of values
//! summed with the output in registers ([`crate::simd::dots`], [`weighted_sum`]).

use candle_core::{CpuStorage, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::simd::{dots, scaled_softmax_inplace, weighted_sum};

/// Where one decode step's rows find their keys (letters as in `grouped.rs`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry<'a> {
    pub heads: usize,
    pub head_dim: usize,
    /// Pool columns L and suffix buffer columns C (capacity).
    pub pool_len: usize,
    pub suffix_cols: usize,
    /// Per group: padded columns at the start of its prefix.
    pub group_pad: &'a [usize],
    /// Per row: its group and the suffix column it starts at.
    pub row_group: &'a [usize],
    pub row_start: &'a [usize],
    /// The column this step wrote (each row attends to `start..=cursor`).
    pub cursor: usize,
    pub scale: f32,
}

/// Runs `f` on the f32 CPU data of a contiguous tensor; `None` for anything else.
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (storage, layout): (_, &Layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) => Some(f(&data[start..end])),
        _ => None,
    }
}

/// `q` (B, H, D); prefix keys/values (N, H, L, D); suffix keys/values (rows capacity, H,
/// C, D). Returns the attention output (B, H·D).
pub(crate) fn decode_attention(
    g: &Geometry,
    q: &[f32],
    prefix: (&[f32], &[f32]),
    suffix: (&[f32], &[f32]),
) -> Vec<f32> {
    let (h, d) = (g.heads, g.head_dim);
    let b = g.row_group.len();
    let mut out = vec![0f32; b * h * d];
    out.par_chunks_mut(d).enumerate().for_each_init(
        || Vec::with_capacity(g.pool_len + g.suffix_cols),
        |scores, (bh, y)| {
            let (row, head) = (bh / h, bh % h);
            let group = g.row_group[row];
            let qv = &q[bh * d..(bh + 1) * d];
            let prefix_base = (group * h + head) * g.pool_len * d;
            let suffix_base = (row * h + head) * g.suffix_cols * d;
            let (first, np) = (g.group_pad[group], g.pool_len - g.group_pad[group]);
            let (start, ns) = (
                g.row_start[row],
                (g.cursor + 1).saturating_sub(g.row_start[row]),
            );
            let prefix_at = prefix_base + first * d;
            let suffix_at = suffix_base + start * d;
            scores.clear();
            scores.resize(np + ns, 0.0);
            let (sp, ss) = scores.split_at_mut(np);
            dots(qv, &prefix.0[prefix_at..], d, sp);
            dots(qv, &suffix.0[suffix_at..], d, ss);
            scaled_softmax_inplace(scores, g.scale);
            let (sp, ss) = scores.split_at(np);
            weighted_sum(sp, &prefix.1[prefix_at..], d, y);
            weighted_sum(ss, &suffix.1[suffix_at..], d, y);
        },
    );
    out
}
