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

use super::bf16::{kernel_bf16_pairs, kernel_bf16_pairs_x2};
use super::lines::Lines;
use super::round::{round_into, rounded_pairs, transpose_16x16};
use super::tile::{MR, NR, SharedOut, Strided};

/// Row blocks per work item: 96 rows, whose packed pairs (K ≤ 3,072: ≤ 576 KiB) fit a
/// core's L2 beside the panels in use.
const CHUNK_BLOCKS: usize = 16;
/// Panels per work item: 192 columns (fewer where a product has too few row chunks to
/// give every thread work).
const PANEL_GROUP: usize = 12;

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
    panels: Lines<u16>, // (⌈N/NR⌉, kps, NR, 2)
    k: usize,
    n: usize,
    /// Pairs a panel: ⌈K/2⌉, or whole AMX k-steps of them ([`panel_pairs`]).
    kps: usize,
}

impl PackedRhs {
    /// `b` (K, N) rounded to BF16 and packed.
    ///
    /// # Panics
    /// When `b` is too short for its shape and strides.
    pub fn new(b: Strided, k: usize, n: usize) -> Self {
        let kps = panel_pairs(k);
        if k == 0 || n == 0 {
            let panels = Lines::new(); // nothing to multiply by
            return Self { panels, k, n, kps };
        }
        let mut panels = spare_panels(n.div_ceil(NR) * kps * 2 * NR);
        fill_pair_panels(&mut panels, b, k, n, kps); // checks b's extent
        Self { panels, k, n, kps }
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
    if super::amx::amx().bf16 && b.kps.is_multiple_of(super::amx::TILE_ROWS) {
        return in_row_tiles_amx(dst, m, accumulate, a, b);
    }
    // Rows a tile at a time, so that the packed rows stay within ROWS_PACKED (at least a
    // chunk of them): each row of the result is the same sum whatever the tile.
    let chunk_rows = CHUNK_BLOCKS * MR;
    let fit = ROWS_PACKED / (k.div_ceil(2) * 4) / chunk_rows * chunk_rows;
    in_row_tiles(dst, m, accumulate, a, b, fit.max(chunk_rows));
}

/// [`gemm_bf16_packed`] `tile` rows at a time.
fn in_row_tiles(
    dst: &mut [f32],
    m: usize,
    accumulate: bool,
    a: Strided,
    b: &PackedRhs,
    tile: usize,
) {
    let n = b.n;
    let mut rows = SPARE_ROWS.take(); // (⌈tile/MR⌉, kp, MR)
    for start in (0..m).step_by(tile) {
        let height = tile.min(m - start);
        let a = (&a.0[start * a.1..], a.1, a.2);
        let dst = &mut dst[start * n..(start + height) * n];
        multiply_rows(dst, height, accumulate, a, b, &mut rows);
    }
    SPARE_ROWS.set(rows);
}

/// [`gemm_bf16_packed`] on AMX tiles ([`super::amx`]), with at most [`ROWS_PACKED`] of
/// the left operand packed at a time: rows a tile at a time as [`in_row_tiles`] takes them
/// (at least 64, packed into whole tiles of 16), or, where every row fits beside a
/// [`K_BLOCK`] of K, every row a block of K at a time ([`in_k_blocks`]: the LM head's
/// ∂hidden, 50,257 values a row and 768 columns of result, whose right operand is far the
/// larger and is read once instead of once per row tile).
fn in_row_tiles_amx(dst: &mut [f32], m: usize, accumulate: bool, a: Strided, b: &PackedRhs) {
    let (n, k) = (b.n, b.k);
    let row_bytes = 2 * k.next_multiple_of(32);
    let all_rows = 2 * m.next_multiple_of(16);
    if m * row_bytes > ROWS_PACKED && all_rows * K_BLOCK <= ROWS_PACKED {
        let block = ROWS_PACKED / all_rows / K_BLOCK * K_BLOCK;
        return in_k_blocks(dst, m, accumulate, a, b, block);
    }
    let steps = b.kps / super::amx::TILE_ROWS;
    let tile = (ROWS_PACKED / row_bytes).max(64) / 16 * 16;
    let mut rows = SPARE_TILE_ROWS.take(); // (⌈tile/16⌉·16, K rounded up to 32)
    for start in (0..m).step_by(tile) {
        let height = tile.min(m - start);
        let a = (&a.0[start * a.1..], a.1, a.2);
        let stride = super::amx::pack_bf16_into(&mut rows, a, height, k);
        let dst = &mut dst[start * n..(start + height) * n];
        let b = (&b.panels[..], b.kps, 0..steps);
        super::amx::bf16_product(dst, (height, n), accumulate, (&rows, stride), b, None);
    }
    SPARE_TILE_ROWS.set(rows);
}

/// [`gemm_bf16_packed`] on AMX tiles, all M rows at once a `block` of K at a time (a
/// multiple of [`K_BLOCK`]), each block's products added to the result of those before.
/// Whole tiles of the result sum exactly as over K in one go (the tiles keep their sums in
/// the result between passes of [`K_BLOCK`] either way); the part-filled tiles at its
/// edges add each block's sum in turn, the same values up to f32 rounding.
fn in_k_blocks(
    dst: &mut [f32],
    m: usize,
    accumulate: bool,
    a: Strided,
    b: &PackedRhs,
    block: usize,
) {
    assert!(
        block > 0 && block.is_multiple_of(K_BLOCK),
        "a block of {block}"
    );
    let (n, k) = (b.n, b.k);
    let steps = b.kps / super::amx::TILE_ROWS;
    let mut rows = SPARE_TILE_ROWS.take(); // (⌈M/16⌉·16, the block)
    for first in (0..k).step_by(block) {
        let width = block.min(k - first);
        let a = (&a.0[first * a.2..], a.1, a.2);
        let stride = super::amx::pack_bf16_into(&mut rows, a, m, width);
        let step = first / 32;
        let b = (&b.panels[..], b.kps, step..steps.min(step + block / 32));
        let accumulate = accumulate || first > 0;
        super::amx::bf16_product(dst, (m, n), accumulate, (&rows, stride), b, None);
    }
    SPARE_TILE_ROWS.set(rows);
}

/// Values of K a pass of the tile products covers (16 k-steps of 32): the unit of
/// [`in_k_blocks`].
const K_BLOCK: usize = 512;

/// Bytes of packed rows of the left operand that [`gemm_bf16_packed`] holds at a time: a
/// row of the LM head's ∂hidden product is 50,257 values, and all 512 rows of a chunk
/// would be 51 MB.
const ROWS_PACKED: usize = 8 << 20;

/// [`gemm_bf16_packed`] of `m` rows, packing them into `rows`.
fn multiply_rows(
    dst: &mut [f32],
    m: usize,
    accumulate: bool,
    a: Strided,
    b: &PackedRhs,
    rows: &mut Vec<u32>,
) {
    let (n, k) = (b.n, b.k);
    let (kp, kps) = (k.div_ceil(2), b.kps);
    let panels = &b.panels;
    pack_rows_into(rows, a, m, k);
    let (blocks, panel_count) = (m.div_ceil(MR), n.div_ceil(NR));
    let chunks = blocks.div_ceil(CHUNK_BLOCKS);
    // Few chunks (a row tile of a long K): smaller panel groups, so that every thread
    // still has work items.
    let wanted = (2 * rayon::current_num_threads()).div_ceil(chunks);
    let per_group = PANEL_GROUP.min(panel_count.div_ceil(wanted)).max(2);
    let groups = panel_count.div_ceil(per_group);
    let target = SharedOut(dst.as_mut_ptr());
    (0..chunks * groups).into_par_iter().for_each(|item| {
        let (chunk, group) = (item / groups, item % groups);
        let block_range = chunk * CHUNK_BLOCKS..blocks.min((chunk + 1) * CHUNK_BLOCKS);
        let panel_end = panel_count.min((group + 1) * per_group);
        let panel_range = group * per_group..panel_end;
        let mut tiles = [[0f32; MR * NR]; 2];
        // Panels two at a time: twelve sums in flight per row block instead of six.
        for p in panel_range.step_by(2) {
            let pair = if p + 1 < panel_end { 2 } else { 1 };
            let panel = |q: usize| &panels[q * kps * 2 * NR..][..kp * 2 * NR];
            for blk in block_range.clone() {
                let a = &rows[blk * kp * MR..(blk + 1) * kp * MR];
                if pair == 2 {
                    kernel_bf16_pairs_x2(a, [panel(p), panel(p + 1)], &mut tiles, kp);
                } else {
                    kernel_bf16_pairs(a, panel(p), &mut tiles[0], kp);
                }
                for (q, tile) in (p..p + pair).zip(&tiles) {
                    let cols = NR.min(n - q * NR);
                    for (r, src) in tile.chunks_exact(NR).take(MR.min(m - blk * MR)).enumerate() {
                        let offset = (blk * MR + r) * n + q * NR;
                        // SAFETY: item (chunk, group) alone owns rows of its blocks ×
                        // columns of its panels, and offset + cols ≤ m·n.
                        unsafe { target.put(offset, &src[..cols], accumulate) };
                    }
                }
            }
        }
    });
}

/// Values in the pair panels of a (K, N) matrix: (⌈N/NR⌉, ⌈K/2⌉, NR, 2).
pub(super) fn pair_panels_len(k: usize, n: usize) -> usize {
    n.div_ceil(NR) * k.div_ceil(2) * 2 * NR
}

/// Pairs of k a [`PackedRhs`]'s panel holds: ⌈K/2⌉, rounded up to whole AMX k-steps (16
/// pairs) where the tiles multiply ([`super::amx`]).
fn panel_pairs(k: usize) -> usize {
    let kp = k.div_ceil(2);
    if super::amx::amx().bf16 {
        kp.next_multiple_of(super::amx::TILE_ROWS)
    } else {
        kp
    }
}

/// `b` (K, N) rounded to BF16 into `panels`, pair panels (⌈N/NR⌉, kps, NR, 2), `kps` ≥
/// ⌈K/2⌉ pairs each: panel p holds columns p·NR.., `[pair][c][2]`, each column's k =
/// 2·pair, 2·pair + 1 adjacent; columns past N, an odd K's last high halves and pairs past
/// ⌈K/2⌉ are written zero. Where the CPU has
/// AVX512-BF16 and one of b's dimensions is contiguous, a panel is rounded and placed 32
/// values at a time ([`fill_panels_from_rows`], [`fill_panel_from_columns`]); otherwise it
/// is gathered into f32 (K × NR), rounded in one pass and placed value by value.
pub(super) fn fill_pair_panels(
    panels: &mut [u16],
    (b, rs, cs): Strided,
    k: usize,
    n: usize,
    kps: usize,
) {
    let kp = k.div_ceil(2);
    assert!(kps >= kp, "{kps} pairs a panel for {k} k");
    assert_eq!(
        panels.len(),
        n.div_ceil(NR) * kps * 2 * NR,
        "panels of {k}×{n}"
    );
    if k == 0 || n == 0 {
        return;
    }
    if kps > kp {
        // Pairs past K: zero, whatever fills the rest.
        for panel in panels.chunks_exact_mut(kps * 2 * NR) {
            panel[kp * 2 * NR..].fill(0);
        }
    }
    assert!(b.len() > (k - 1) * rs + (n - 1) * cs, "gemm rhs too short");
    #[cfg(target_arch = "x86_64")]
    if (cs == 1 || rs == 1)
        && crate::cpu_features::avx512().bf16
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        let panel_len = kps * 2 * NR;
        if cs == 1 {
            panels
                .par_chunks_mut(PANELS_A_SWEEP * panel_len)
                .enumerate()
                .for_each(|(g, group)| {
                    let first = g * PANELS_A_SWEEP;
                    // SAFETY: AVX512F, BW and BF16 are present (checked above); with b's
                    // extent asserted above, every (kk, c) < (K, N − first·NR) of the
                    // group lies in b from first·NR on, and `group` holds whole panels.
                    unsafe {
                        fill_panels_from_rows(
                            (group, panel_len),
                            b[first * NR..].as_ptr(),
                            rs,
                            k,
                            n - first * NR,
                        )
                    }
                });
            return;
        }
        panels
            .par_chunks_mut(panel_len)
            .enumerate()
            .for_each(|(p, panel)| {
                let cols = NR.min(n - p * NR);
                // SAFETY: AVX512F, BW and BF16 are present (checked above); with b's
                // extent asserted above, every (kk, c) < (K, cols) of panel p lies in b
                // from p·NR·cs on, and `panel` holds kp·2·NR values.
                unsafe { fill_panel_from_columns(panel, b[p * NR * cs..].as_ptr(), cs, k, cols) }
            });
        return;
    }
    fill_pair_panels_gathered(panels, (b, rs, cs), k, n, kps)
}

/// [`fill_pair_panels`] through an f32 gather of each panel: any strides, any CPU (pairs
/// past ⌈K/2⌉ left as they are).
fn fill_pair_panels_gathered(
    panels: &mut [u16],
    (b, rs, cs): Strided,
    k: usize,
    n: usize,
    kps: usize,
) {
    let kp = k.div_ceil(2);
    panels
        .par_chunks_mut(kps * 2 * NR)
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(wide, narrow): &mut (Vec<f32>, Vec<u16>), (p, panel)| {
                let cols = NR.min(n - p * NR);
                wide.clear();
                wide.resize(k * NR, 0.0); // (K, NR), zero past N
                if rs < cs {
                    // Down each column (a transposed operand: contiguous there).
                    for c in 0..cols {
                        let col = &b[(p * NR + c) * cs..];
                        for kk in 0..k {
                            wide[kk * NR + c] = col[kk * rs];
                        }
                    }
                } else {
                    for kk in 0..k {
                        let row = &b[kk * rs + p * NR * cs..];
                        for c in 0..cols {
                            wide[kk * NR + c] = row[c * cs];
                        }
                    }
                }
                narrow.resize(k * NR, 0);
                round_into(wide, narrow);
                for (kk, values) in narrow.chunks_exact(NR).enumerate() {
                    let (pair, half) = (kk / 2, kk % 2);
                    for (c, &v) in values.iter().enumerate() {
                        panel[(pair * NR + c) * 2 + half] = v;
                    }
                }
                if k % 2 == 1 {
                    for c in 0..NR {
                        panel[((kp - 1) * NR + c) * 2 + 1] = 0;
                    }
                }
            },
        );
}

/// Pair panels a sweep of [`fill_panels_from_rows`] fills: 128 columns, 512 contiguous
/// bytes of each row read at a time, where one panel at a time read a 64-byte line of
/// every row, a page apart or more — a TLB miss a row.
const PANELS_A_SWEEP: usize = 8;

/// Consecutive pair panels (`group`, each `panel_len` values) from a (K, cols) operand
/// whose rows are contiguous (row kk at `b + kk·rs`): per pair of rows, for each panel,
/// rows 2·pair and 2·pair + 1 rounded together (`vcvtne2ps2bf16`) and interleaved column
/// by column (`vpermw`), 64 bytes per pair; columns past `cols` and a missing odd row zero.
///
/// # Safety
/// The CPU has AVX512F, AVX512BW and AVX512-BF16; `b + kk·rs + c` is readable for every
/// kk < k, c < min(cols, 16 × panels of `group`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn fill_panels_from_rows(
    (group, panel_len): (&mut [u16], usize),
    b: *const f32,
    rs: usize,
    k: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    assert!(panel_len >= k.div_ceil(2) * 2 * NR && group.len().is_multiple_of(panel_len));
    let count = group.len() / panel_len;
    let out = group.as_mut_ptr();
    // SAFETY: (the whole body) the caller guarantees the features and extents; loads are
    // masked to the columns below `cols`, stores stay within the group (asserted above).
    unsafe {
        for pair in 0..k.div_ceil(2) {
            let even = b.add(2 * pair * rs);
            let odd = (2 * pair + 1 < k).then(|| b.add((2 * pair + 1) * rs));
            for q in 0..count {
                let left = cols.saturating_sub(q * NR);
                let mask: __mmask16 = if left >= 16 { !0 } else { (1u16 << left) - 1 };
                let placed = rounded_pairs(mask, even.add(q * NR), odd.map(|o| o.add(q * NR)));
                _mm512_storeu_si512(out.add(q * panel_len + pair * 2 * NR).cast(), placed);
            }
        }
    }
}

/// One pair panel from a (K, cols) operand whose columns are contiguous (column c at
/// `b + c·cs`, a transposed weight): a column's 32 values rounded at once are 16 of its
/// pairs already in order; the 16 columns' runs turned into 16 pairs' rows of the panel
/// ([`transpose_16x16`]), one 64-byte store each. The last values of an odd K or a short
/// tail value by value, columns past `cols` zero.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `b + c·cs + kk` is readable for every kk < k,
/// c < cols ≤ NR; `panel` holds ⌈k/2⌉·2·NR values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn fill_panel_from_columns(
    panel: &mut [u16],
    b: *const f32,
    cs: usize,
    k: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let kp = k.div_ceil(2);
    assert!(panel.len() >= kp * 2 * NR && cols <= NR);
    // (pair, c) as one u32: the even k in the low half.
    let out = panel.as_mut_ptr().cast::<u32>();
    let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
    let whole = k / 32;
    // SAFETY: (the whole body) the caller guarantees the features and extents: reads stay
    // below k in each of the `cols` columns, writes below kp·NR u32 (2·kp·NR u16); a
    // __m512bh and a __m512i are the same 64 bytes.
    unsafe {
        for g in 0..whole {
            // runs[c] lane i: column c's pair 16·g + i (zero past `cols`).
            let mut runs = [_mm512_setzero_si512(); NR];
            for (c, run) in runs.iter_mut().enumerate().take(cols) {
                let col = b.add(c * cs + g * 32);
                let (low, high) = (_mm512_loadu_ps(col), _mm512_loadu_ps(col.add(16)));
                *run = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low));
            }
            transpose_16x16(&mut runs);
            for (i, row) in runs.iter().enumerate() {
                _mm512_storeu_si512(out.add((g * 16 + i) * NR).cast(), *row);
            }
        }
        for c in 0..NR {
            for pair in whole * 16..kp {
                *out.add(pair * NR + c) = if c >= cols {
                    0
                } else {
                    let col = b.add(c * cs);
                    let even = bits(*col.add(2 * pair));
                    let odd = if 2 * pair + 1 < k {
                        bits(*col.add(2 * pair + 1))
                    } else {
                        0
                    };
                    even | odd << 16
                };
            }
        }
    }
}

/// `a` (M, K) into row blocks of BF16 pairs: `[block][pair][r]`, k = 2·pair in the low
/// half, 2·pair + 1 in the high half, zero past K and past M.
pub(super) fn pack_rows(a: Strided, m: usize, k: usize) -> Vec<u32> {
    let mut rows = Vec::new();
    pack_rows_into(&mut rows, a, m, k);
    rows
}

/// [`pack_rows`] into `rows` (resized; its memory reused).
fn pack_rows_into(rows: &mut Vec<u32>, (a, rs, cs): Strided, m: usize, k: usize) {
    let kp = k.div_ceil(2);
    rows.clear();
    rows.resize(m.div_ceil(MR) * kp * MR, 0);
    rows.par_chunks_mut(kp * MR).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(wide, narrow): &mut (Vec<f32>, Vec<u16>), (blk, block)| {
            narrow.clear();
            narrow.resize(2 * kp, 0); // an odd K's last high half stays zero
            let height = MR.min(m - blk * MR);
            let along_k = cs != 1 && rs == 1;
            if along_k {
                // A transposed operand (Xᵀ of a weight gradient): the block's rows are
                // adjacent at each k, so read k after k (one short run per k) rather than
                // each row down its stride.
                wide.clear();
                wide.resize(height * k, 0.0); // (height, K)
                for kk in 0..k {
                    let run = &a[blk * MR + kk * cs..][..height];
                    for (r, &v) in run.iter().enumerate() {
                        wide[r * k + kk] = v;
                    }
                }
            }
            for r in 0..height {
                let start = (blk * MR + r) * rs;
                let row: &[f32] = if cs == 1 {
                    &a[start..start + k]
                } else if along_k {
                    &wide[r * k..(r + 1) * k]
                } else {
                    wide.clear();
                    wide.extend((0..k).map(|kk| a[start + kk * cs]));
                    wide
                };
                round_into(row, &mut narrow[..k]);
                for (pair, two) in narrow.chunks_exact(2).enumerate() {
                    block[pair * MR + r] = u32::from(two[0]) | u32::from(two[1]) << 16;
                }
            }
        },
    );
}

thread_local! {
    /// Buffers of finished products, kept for the next on this thread (their pages mapped
    /// already: a fresh allocation of this size is mostly the kernel zeroing pages).
    static SPARE_PANELS: std::cell::RefCell<Vec<Lines<u16>>> = const { std::cell::RefCell::new(Vec::new()) };
    static SPARE_ROWS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    static SPARE_TILE_ROWS: std::cell::RefCell<Lines<u16>> = const { std::cell::RefCell::new(Lines::new()) };
}

/// A buffer of `len` values, unspecified (every one is written by [`fill_pair_panels`]): a
/// spare one of this thread's when one is big enough (the smallest such), else a new one.
fn spare_panels(len: usize) -> Lines<u16> {
    let found = SPARE_PANELS.with_borrow_mut(|spare| {
        let best = (0..spare.len())
            .filter(|&i| spare[i].capacity() >= len)
            .min_by_key(|&i| spare[i].capacity())?;
        Some(spare.swap_remove(best))
    });
    let mut v = found.unwrap_or_default();
    v.fit(len);
    v
}

/// How many spare panel buffers a thread keeps.
const SPARE_KEPT: usize = 4;

impl Drop for PackedRhs {
    fn drop(&mut self) {
        let panels = std::mem::take(&mut self.panels);
        if panels.capacity() > 0 {
            SPARE_PANELS.with_borrow_mut(|spare| {
                spare.push(panels);
                if spare.len() > SPARE_KEPT {
                    // Keep the largest.
                    let smallest = (0..spare.len()).min_by_key(|&i| spare[i].capacity());
                    spare.swap_remove(smallest.expect("not empty"));
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::values;
    use super::*;

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
    fn panels_packed_into_a_spare_buffer_are_the_panels_packed_into_a_fresh_one() {
        // A finished product's panels become this thread's spare buffer, its values left
        // in it: the next, smaller operand (odd K, a part-filled panel) overwrites every one.
        let (k, n) = (37, 21);
        let b = values(k * n, 41);
        let kps = panel_pairs(k);
        let mut fresh = vec![0u16; n.div_ceil(NR) * kps * 2 * NR];
        fill_pair_panels(&mut fresh, (&b, n, 1), k, n, kps);
        drop(PackedRhs::new((&values(96 * 64, 42), 64, 1), 96, 64));
        let reused = PackedRhs::new((&b, n, 1), k, n);
        assert_eq!(&reused.panels[..], &fresh[..]);
    }

    #[test]
    fn a_product_in_blocks_of_k_is_the_product_in_one() {
        if !super::super::TestFeature::Amx.test_runs("the AMX BF16 tile product in blocks of K") {
            return;
        }
        // Whole tiles sum as in one go, to the bit; part-filled ones (rows past 96,
        // columns past 32) to f32 rounding. A K past a block, with a short last one.
        let (m, n, k) = (100, 40, 1400);
        let (a, b) = (values(m * k, 51), values(k * n, 52));
        let packed = PackedRhs::new((&b, n, 1), k, n);
        for a_op in [(&a[..], k, 1), (&a[..], 1, m)] {
            for accumulate in [false, true] {
                let start = values(m * n, 53);
                let (mut whole, mut blocked) = (start.clone(), start);
                in_row_tiles_amx(&mut whole, m, accumulate, a_op, &packed);
                in_k_blocks(&mut blocked, m, accumulate, a_op, &packed, K_BLOCK);
                for (i, (w, g)) in whole.iter().zip(&blocked).enumerate() {
                    let (r, c) = (i / n, i % n);
                    if r < 96 && c < 32 {
                        assert_eq!(w.to_bits(), g.to_bits(), "({r}, {c})");
                    } else {
                        assert!((w - g).abs() <= 1e-5 * w.abs().max(1.0), "({r}, {c})");
                    }
                }
            }
        }
    }

    #[test]
    fn a_product_in_row_tiles_is_the_product_in_one() {
        // Each row's sums are the same whatever the tile: bit for bit, rows read plain and
        // transposed (the path that gathers k after k), tiles that leave a part-filled one.
        let (m, n, k) = (300, 50, 70);
        let (a, b) = (values(m * k, 4), values(k * n, 5));
        let packed = PackedRhs::new((&b, n, 1), k, n);
        for a_op in [(&a[..], k, 1), (&a[..], 1, m)] {
            for accumulate in [false, true] {
                let start = values(m * n, 6);
                let (mut whole, mut tiled) = (start.clone(), start);
                in_row_tiles(&mut whole, m, accumulate, a_op, &packed, m);
                in_row_tiles(&mut tiled, m, accumulate, a_op, &packed, 96);
                assert_eq!(whole, tiled, "strides {:?}, {accumulate}", (a_op.1, a_op.2));
            }
        }
    }

    /// `w` (rows, cols), row-major, as its transpose (cols, rows), row-major.
    fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| w[(i % rows) * cols + i / rows])
            .collect()
    }

    #[test]
    fn panels_placed_32_values_at_a_time_are_the_gathered_panels() {
        // Both contiguous orientations, odd K, part-filled panels, a K past 32 with a tail,
        // and panels refilled over other values.
        for (k, n) in [(1, 1), (5, 7), (33, 17), (70, 40), (64, 16), (37, 150)] {
            let w = values(k * n, 5);
            for transposed in [false, true] {
                let stored = if transposed {
                    transpose(&w, k, n)
                } else {
                    w.clone()
                };
                let b: Strided = if transposed {
                    (&stored, 1, k)
                } else {
                    (&stored, n, 1)
                };
                let kp = k.div_ceil(2);
                let mut want = vec![0u16; pair_panels_len(k, n)];
                fill_pair_panels_gathered(&mut want, b, k, n, kp);
                let mut got = vec![0x7fc0u16; pair_panels_len(k, n)];
                fill_pair_panels(&mut got, b, k, n, kp);
                assert_eq!(got, want, "{k}×{n} transposed: {transposed}");
                let mut again = vec![0x3f80u16; pair_panels_len(k, n)];
                fill_pair_panels_gathered(&mut again, b, k, n, kp);
                assert_eq!(again, want, "{k}×{n} gathered over old values");
            }
        }
    }

    #[test]
    fn a_transposed_left_operand_packs_as_its_row_major_copy() {
        // Read k after k (rows adjacent), the same pairs as rows read one by one.
        for (m, k) in [(1, 1), (7, 5), (13, 64), (100, 33)] {
            let stored = values(k * m, 4); // (K, M): the operand is its transpose
            let copy = transpose(&stored, k, m);
            assert_eq!(
                pack_rows((&stored, 1, m), m, k),
                pack_rows((&copy, k, 1), m, k),
                "{m}×{k}"
            );
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
