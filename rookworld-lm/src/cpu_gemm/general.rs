//! General products with both operands rounded to BF16 and f32 sums: the matrix products
//! of a mixed-precision training pass on a CPU with AVX512-BF16 (PyTorch's BF16 autocast
//! does the same there), where neither operand is fixed: activations, weights that change
//! every step, upstream gradients.
//!
//! Each call packs its operands once — the right one (K, N) into the pair panels of
//! `vdpbf16ps` ((⌈N/NR⌉, ⌈K/2⌉, NR, 2), as BF16 weight panels are), the left one (M, K) into
//! row blocks of BF16 pairs — and runs the packed kernel on every (row block, panel) tile.
//! Work is split into items of a chunk of row blocks times a group of panels, chunk-major:
//! a chunk's packed rows stay in one core's L2 across its panel groups, and each panel in
//! L1 across the chunk's blocks. The packing reads any strides, so transposed operands
//! (a Conv1D weight's Wᵀ, Xᵀ of a weight gradient) cost no copy of their own.
//!
//! Letters: M rows of the result, N columns, K the inner dimension.

use rayon::prelude::*;

use super::{MR, NR, SharedOut, kernel_bf16_pairs};

/// Row blocks per work item: 96 rows, whose packed pairs (K ≤ 3,072: ≤ 576 KiB) fit a
/// core's L2 beside the panels in use.
const CHUNK_BLOCKS: usize = 16;
/// Panels per work item: 192 columns.
const PANEL_GROUP: usize = 12;

/// An operand: (values, row stride, column stride).
pub type Strided<'a> = (&'a [f32], usize, usize);

/// `dst` (M, N, row-major) = [`dst` +] `a` (M, K) · `b` (K, N), each value of `a` and `b`
/// rounded to the nearest BF16 and every product summed in f32 (by `vdpbf16ps` where the
/// CPU has AVX512-BF16, else by its scalar reference: the same sums, far slower — callers
/// choose this product only where [`super::avx512`] has `bf16`).
///
/// # Panics
/// When a slice is too short for its shape and strides (a programming error).
pub fn gemm_bf16(
    dst: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    a: Strided,
    b: Strided,
) {
    if m == 0 || n == 0 {
        return;
    }
    gemm_bf16_packed(dst, m, accumulate, a, &PackedRhs::new(b, k, n));
}

/// A right operand (K, N) packed for [`gemm_bf16_packed`]: pack once, multiply by many left
/// operands (an LM head's weight, block after block of rows).
#[derive(Debug, Clone)]
pub struct PackedRhs {
    panels: Vec<u16>, // (⌈N/NR⌉, ⌈K/2⌉, NR, 2)
    k: usize,
    n: usize,
}

impl PackedRhs {
    /// `b` (K, N) rounded to BF16 and packed.
    ///
    /// # Panics
    /// When `b` is too short for its shape and strides.
    pub fn new(b: Strided, k: usize, n: usize) -> Self {
        if k == 0 || n == 0 {
            let panels = Vec::new(); // nothing to multiply by
            return Self { panels, k, n };
        }
        assert!(
            b.0.len() > (k - 1) * b.1 + (n - 1) * b.2,
            "gemm rhs too short"
        );
        let mut panels = vec![0u16; n.div_ceil(NR) * k.div_ceil(2) * 2 * NR];
        fill_pair_panels(&mut panels, b, k, n);
        Self { panels, k, n }
    }
}

/// [`gemm_bf16`] with the right operand packed already: `dst` (M, N) = [`dst` +] `a`
/// (M, K) · `b`.
///
/// # Panics
/// When `dst` or `a` is too short for its shape and strides.
pub fn gemm_bf16_packed(dst: &mut [f32], m: usize, accumulate: bool, a: Strided, b: &PackedRhs) {
    let (n, k) = (b.n, b.k);
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= m * n, "gemm dst too short");
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    assert!(
        a.0.len() > (m - 1) * a.1 + (k - 1) * a.2,
        "gemm lhs too short"
    );
    let kp = k.div_ceil(2);
    let panels = &b.panels;
    let rows = pack_rows(a, m, k); // (⌈M/MR⌉, kp, MR)
    let (blocks, panel_count) = (m.div_ceil(MR), n.div_ceil(NR));
    let (chunks, groups) = (
        blocks.div_ceil(CHUNK_BLOCKS),
        panel_count.div_ceil(PANEL_GROUP),
    );
    let target = SharedOut(dst.as_mut_ptr());
    (0..chunks * groups).into_par_iter().for_each(|item| {
        let (chunk, group) = (item / groups, item % groups);
        let block_range = chunk * CHUNK_BLOCKS..blocks.min((chunk + 1) * CHUNK_BLOCKS);
        let panel_range = group * PANEL_GROUP..panel_count.min((group + 1) * PANEL_GROUP);
        let mut tile = [0f32; MR * NR];
        for p in panel_range {
            let panel = &panels[p * kp * 2 * NR..(p + 1) * kp * 2 * NR];
            let cols = NR.min(n - p * NR);
            for blk in block_range.clone() {
                kernel_bf16_pairs(
                    &rows[blk * kp * MR..(blk + 1) * kp * MR],
                    panel,
                    &mut tile,
                    kp,
                );
                for (r, src) in tile.chunks_exact(NR).take(MR.min(m - blk * MR)).enumerate() {
                    let offset = (blk * MR + r) * n + p * NR;
                    // SAFETY: item (chunk, group) alone owns rows of its blocks × columns
                    // of its panels, and offset + cols ≤ m·n.
                    unsafe { target.put(offset, &src[..cols], accumulate) };
                }
            }
        }
    });
}

/// `v` rounded to the nearest BF16 (ties to even), as the low 16 bits.
fn bf16(v: f32) -> u32 {
    u32::from(half::bf16::from_f32(v).to_bits())
}

/// `b` (K, N) rounded to BF16 into `panels`, pair panels (⌈N/NR⌉, ⌈K/2⌉, NR, 2): panel p
/// holds columns p·NR.., `[pair][c][2]`, each column's k = 2·pair, 2·pair + 1 adjacent. What
/// lies past K and past N is left as it is (zero in new panels). Read along whichever of
/// b's dimensions is contiguous (a transposed weight down its columns).
pub(super) fn fill_pair_panels(panels: &mut [u16], (b, rs, cs): Strided, k: usize, n: usize) {
    let kp = k.div_ceil(2);
    assert_eq!(
        panels.len(),
        n.div_ceil(NR) * kp * 2 * NR,
        "panels of {k}×{n}"
    );
    panels
        .par_chunks_mut(kp * 2 * NR)
        .enumerate()
        .for_each(|(p, panel)| {
            let cols = NR.min(n - p * NR);
            let at = |kk: usize, c: usize| (kk / 2 * NR + c) * 2 + kk % 2;
            if rs < cs {
                // Columns contiguous down k (a transposed operand).
                for c in 0..cols {
                    let col = &b[(p * NR + c) * cs..];
                    for kk in 0..k {
                        panel[at(kk, c)] = bf16(col[kk * rs]) as u16;
                    }
                }
            } else {
                for kk in 0..k {
                    let row = &b[kk * rs + p * NR * cs..];
                    for c in 0..cols {
                        panel[at(kk, c)] = bf16(row[c * cs]) as u16;
                    }
                }
            }
        });
}

/// `a` (M, K) into row blocks of BF16 pairs: `[block][pair][r]`, k = 2·pair in the low
/// half, 2·pair + 1 in the high half, zero past K and past M.
pub(super) fn pack_rows((a, rs, cs): Strided, m: usize, k: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut rows = vec![0u32; m.div_ceil(MR) * kp * MR];
    rows.par_chunks_mut(kp * MR)
        .enumerate()
        .for_each(|(blk, block)| {
            let valid = MR.min(m - blk * MR);
            let value = |r: usize, kk: usize| a[(blk * MR + r) * rs + kk * cs];
            for pair in 0..kp {
                let (lo, hi) = (2 * pair, 2 * pair + 1);
                for r in 0..valid {
                    let high = if hi < k { bf16(value(r, hi)) } else { 0 };
                    block[pair * MR + r] = bf16(value(r, lo)) | high << 16;
                }
            }
        });
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn round(v: f32) -> f64 {
        f64::from(half::bf16::from_f32(v).to_f32())
    }

    /// dst = [dst +] a · b in f64 over the BF16-rounded operands.
    fn reference(
        dst: &mut [f32],
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
        (a, ars, acs): Strided,
        (b, brs, bcs): Strided,
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut s = if accumulate {
                    f64::from(dst[i * n + j])
                } else {
                    0.0
                };
                for kk in 0..k {
                    s += round(a[i * ars + kk * acs]) * round(b[kk * brs + j * bcs]);
                }
                dst[i * n + j] = s as f32;
            }
        }
    }

    #[test]
    fn products_of_every_orientation_equal_the_rounded_operands_product() {
        // Awkward shapes: part-filled blocks, chunks and panel groups, odd K.
        for (m, n, k) in [(1, 1, 1), (7, 17, 5), (100, 200, 33), (13, 400, 64)] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
                // A transposed operand is stored (K, M) or (N, K) and read by its strides.
                let a_op: Strided = if a_t { (&a, 1, m) } else { (&a, k, 1) };
                let b_op: Strided = if b_t { (&b, 1, k) } else { (&b, n, 1) };
                for accumulate in [false, true] {
                    let start = values(m * n, 3);
                    let (mut got, mut want) = (start.clone(), start);
                    gemm_bf16(&mut got, (m, n, k), accumulate, a_op, b_op);
                    reference(&mut want, (m, n, k), accumulate, a_op, b_op);
                    let d = got
                        .iter()
                        .zip(&want)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        d < 1e-4,
                        "{m}×{n}×{k} {a_t}/{b_t}/{accumulate}: max |Δ| {d}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_empty_inner_dimension_clears_or_keeps_the_destination() {
        let mut dst = vec![1.0f32; 6];
        gemm_bf16(&mut dst, (2, 3, 0), true, (&[], 0, 1), (&[], 3, 1));
        assert_eq!(dst, vec![1.0; 6]);
        gemm_bf16(&mut dst, (2, 3, 0), false, (&[], 0, 1), (&[], 3, 1));
        assert_eq!(dst, vec![0.0; 6]);
    }
}
