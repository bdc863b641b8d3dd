//! INT8 panels ([`PanelDtype::Int8`](super::PanelDtype)): each weight column quantized
//! symmetrically to 63 levels either side of zero once, when packed (`q = round(w / s_j)`,
//! `s_j = max_k |w_kj| / 63`); each input row quantized to 127 levels either side at every
//! product (`x̂ = round(x / a_r)`, `a_r = max_k |x_rk| / 127`) and stored offset by 128 as
//! an unsigned byte `u = x̂ + 128`; the byte products summed exactly in i32 and scaled back:
//!
//! ```text
//! y_rj = a_r · s_j · (Σ_k u_rk q_kj − c_j),   c_j = 128 · Σ_k q_kj  (kept per column)
//! ```
//!
//! On AVX2 a group of four k per column is one `vpmaddubsw` (unsigned × signed bytes into
//! pairs of i16) and one `vpmaddwd` by ones (into i32): no pair sum (≤ 2 · 255 · 63 = 32,130)
//! reaches the i16 limit, so the sums are exact, the scalar reference's to the bit. Seven
//! bits of weight (oneDNN's choice on CPUs without VNNI, for the same reason) is what makes
//! the unsigned input possible: with eight, the input's sign had to be moved onto the weight
//! by a `vpsignb` per row and column block, half again the kernel's instructions.
//!
//! With AVX512-VNNI a group of four k for all 16 columns is one `vpdpbusd` per row (the
//! four products summed straight into i32), to the same sums.
//!
//! Layout: a panel is ⌈K/4⌉ groups of 64 bytes, columns 0..8 then 8..16, each column's
//! four k adjacent ([`position`]): 16 lanes of four bytes, column c in lane c; K is padded
//! with zero weights.

use rayon::prelude::*;

use super::lines::Lines;
use super::pack::fill_panel;
use super::tile::{MR, NR};

/// Levels either side of zero: weights (7 bits), inputs (8 bits).
const WEIGHT_LEVELS: f32 = 63.0;
const INPUT_LEVELS: f32 = 127.0;
/// What an input byte is offset by (its zero).
const INPUT_ZERO: i32 = 128;

/// Groups of four k: the dot products' unit.
pub(super) fn groups(k: usize) -> usize {
    k.div_ceil(4)
}

/// Where weight (kk, column c) of a panel lies in its bytes.
fn position(kk: usize, c: usize) -> usize {
    (kk / 4) * 4 * NR + (c / 8) * 32 + (c % 8) * 4 + kk % 4
}

/// `round(v · inv)` to the nearest level, ties to even, for |v · inv| ≤ 127.5 (the
/// quantizers' range). Adding and taking off 1.5 · 2²³ leaves no fraction bits, so the sum
/// rounds in the FPU's default mode (to nearest, ties to even) — what `round_ties_even`
/// does, in two additions the compiler vectorises instead of a call to libm's `rintf` per
/// value (a third of a second per gpt2-124m push without SSE4.1 in the baseline target).
#[inline(always)]
fn level(v: f32, inv: f32) -> i32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 · 2^23
    ((v * inv + SHIFT) - SHIFT) as i32
}

/// The scale `max / levels` of values whose largest magnitude is `max`, and its inverse
/// (both zero for an all-zero column or row).
fn scale_and_inverse(max: f32, levels: f32) -> (f32, f32) {
    if max > 0.0 {
        (max / levels, levels / max)
    } else {
        (0.0, 0.0)
    }
}

/// The quantized panels of a (K, N) matrix, each column's scale and its offset
/// correction `c_j`.
#[derive(Debug, Clone)]
pub(super) struct Int8Panels {
    q: Lines<i8>,          // (⌈N/NR⌉, ⌈K/4⌉, 64), see `position`
    scales: Vec<f32>,      // (⌈N/NR⌉ · NR), zero past N
    corrections: Vec<i32>, // (⌈N/NR⌉ · NR): 128 · Σ_k q_kj, zero past N
}

/// One panel's part of [`Int8Panels`]: its bytes, its columns' scales and corrections.
pub(super) type Panel<'a> = (&'a [i8], &'a [f32], &'a [i32]);

/// Panels `first..` of `w` — (K, N) row-major, or (N, K) when `transposed` — into
/// `(q, scales, corrections)`, the parts of those panels: each panel gathered into a
/// (K, NR) buffer of the thread's own, then quantized.
fn gather_and_quantize(
    (q, scales, corrections): (&mut [i8], &mut [f32], &mut [i32]),
    w: &[f32],
    k: usize,
    n: usize,
    first: usize,
    transposed: bool,
) {
    q.par_chunks_mut(groups(k) * 4 * NR)
        .zip(scales.par_chunks_mut(NR))
        .zip(corrections.par_chunks_mut(NR))
        .enumerate()
        .for_each_init(
            || vec![0f32; k * NR],
            |wide, (i, ((q, s), c))| {
                wide.fill(0.0); // the last panel's padding columns
                fill_panel(wide, w, k, n, first + i, transposed);
                quantize_panels(wide, NR, k, 0, q, s, c);
            },
        );
}

impl Int8Panels {
    pub(super) fn new(k: usize, n: usize) -> Self {
        let panels = n.div_ceil(NR);
        Self {
            q: Lines::zeroed(panels * groups(k) * 4 * NR),
            scales: vec![0.0; panels * NR],
            corrections: vec![0; panels * NR],
        }
    }

    /// Quantizes `w` — (K, N) row-major, or (N, K) when `transposed` — into the panels.
    /// The whole panels of a (K, N) matrix are read in place, [`BLOCK`] panels at a time
    /// (each row's part of a block one contiguous read); the others are gathered first
    /// into a (K, NR) buffer of the thread's own.
    pub(super) fn fill(&mut self, w: &[f32], k: usize, n: usize, transposed: bool) {
        let bytes = groups(k) * 4 * NR;
        let in_place = if transposed { 0 } else { n / NR };
        let (q, q_rest) = self.q.split_at_mut(in_place * bytes);
        let (scales, scales_rest) = self.scales.split_at_mut(in_place * NR);
        let (corrections, corrections_rest) = self.corrections.split_at_mut(in_place * NR);
        q.par_chunks_mut(BLOCK * bytes)
            .zip(scales.par_chunks_mut(BLOCK * NR))
            .zip(corrections.par_chunks_mut(BLOCK * NR))
            .enumerate()
            .for_each(|(b, ((q, s), c))| quantize_panels(w, n, k, b * BLOCK * NR, q, s, c));
        let rest = (q_rest, scales_rest, corrections_rest);
        gather_and_quantize(rest, w, k, n, in_place, transposed);
    }

    /// Panels `first..` of a transposed (N, K) weight from its rows `first · NR..`
    /// (`rows`, row-major): what [`Self::fill`] writes there.
    pub(super) fn fill_transposed_rows(&mut self, rows: &[f32], k: usize, first: usize) {
        let n = rows.len() / k;
        let (at, end) = (first, first + n.div_ceil(NR));
        let bytes = groups(k) * 4 * NR;
        let panels = (
            &mut self.q[at * bytes..end * bytes],
            &mut self.scales[at * NR..end * NR],
            &mut self.corrections[at * NR..end * NR],
        );
        gather_and_quantize(panels, rows, k, n, 0, true);
    }

    /// `w` (K, N) row-major quantized into new panels.
    pub(super) fn new_filled(w: &[f32], k: usize, n: usize) -> Self {
        let mut panels = Self::new(k, n);
        panels.fill(w, k, n, false);
        panels
    }

    /// The bytes of all panels ((⌈N/NR⌉, ⌈K/4⌉, 64)), the columns' scales and
    /// corrections (⌈N/NR⌉ · NR each).
    pub(super) fn parts(&self) -> (&[i8], &[f32], &[i32]) {
        (&self.q, &self.scales, &self.corrections)
    }

    /// `x` (M, K) times these (K, N) panels by the row-block kernels ([`quantize_rows`],
    /// [`kernel`], [`dequantize`]): what the tiles' product must equal to the bit.
    pub(super) fn reference_product(
        &self,
        x: &[f32],
        (m, n, k): (usize, usize, usize),
    ) -> Vec<f32> {
        let (a, row_scales) = quantize_rows(x, m, k);
        let kq = groups(k);
        let mut out = vec![0f32; m * n];
        for (p, (q, s, c)) in self.panels(k).collect::<Vec<_>>().into_iter().enumerate() {
            for blk in 0..m.div_ceil(MR) {
                let mut sums = [0i32; MR * NR];
                kernel(&a[blk * kq * MR * 4..][..kq * MR * 4], q, &mut sums, kq);
                let mut tile = [0f32; MR * NR];
                dequantize(&mut tile, &sums, &row_scales[blk * MR..], (s, c));
                let cols = NR.min(n - p * NR);
                for r in 0..MR.min(m - blk * MR) {
                    let row = blk * MR + r;
                    out[row * n + p * NR..][..cols].copy_from_slice(&tile[r * NR..][..cols]);
                }
            }
        }
        out
    }

    /// Every panel's bytes, scales and corrections.
    pub(super) fn panels(&self, k: usize) -> impl IndexedParallelIterator<Item = Panel<'_>> {
        self.q
            .par_chunks(groups(k) * 4 * NR)
            .zip(self.scales.par_chunks(NR))
            .zip(self.corrections.par_chunks(NR))
            .map(|((q, s), c)| (q, s, c))
    }
}

/// Panels quantized per parallel piece of [`Int8Panels::fill`].
const BLOCK: usize = 8;

/// The panels of columns `first..first + scales.len()` (at most [`BLOCK`] panels) of `w`
/// (K, N) row-major, quantized into `q` ([`position`] order), with each column's scale and
/// correction. Through AVX2 where the CPU has it (the same values: the steps are exact or
/// rounded alike), else the baseline target's vectors.
fn quantize_panels(
    w: &[f32],
    n: usize,
    k: usize,
    first: usize,
    q: &mut [i8],
    scales: &mut [f32],
    corrections: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX512F is present.
        unsafe { quantize_panels_avx512(w, n, k, first, q, scales, corrections) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        unsafe { quantize_panels_avx2(w, n, k, first, q, scales, corrections) };
        return;
    }
    quantize_panels_body(w, n, k, first, q, scales, corrections)
}

/// Panics unless columns `first..first + cols` are whole panels of at most a [`BLOCK`]
/// inside a (K, N) weight of `len` values: what both forms of [`quantize_panels`] read.
fn check_block(len: usize, n: usize, k: usize, first: usize, cols: usize) {
    assert!(cols <= BLOCK * NR && cols.is_multiple_of(NR) && first + cols <= n);
    assert!(
        len >= (k.max(1) - 1) * n + first + cols,
        "weight of {k}×{n}"
    );
}

/// [`quantize_panels_body`] a panel (16 columns) to a register: the same scales, bytes
/// and corrections. Each level is rounded as [`level`] rounds it (the same two additions),
/// a NaN weight's level is zero as `as i32` makes it, and a group's four levels of a
/// column become its four bytes by shifts, a lane each: the layout's 64 bytes in one store
/// (the body moves them a byte at a time, four fifths of a load's time on a Xeon).
///
/// # Safety
/// The CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_panels_avx512(
    w: &[f32],
    n: usize,
    k: usize,
    first: usize,
    q: &mut [i8],
    scales: &mut [f32],
    corrections: &mut [i32],
) {
    use std::arch::x86_64::*;
    const { assert!(NR == 16, "a panel's group is one register of 64 bytes") };
    let cols = scales.len();
    check_block(w.len(), n, k, first, cols);
    let (panels, bytes) = (cols / NR, groups(k) * 4 * NR);
    assert!(q.len() >= panels * bytes && corrections.len() == cols);
    // Panel j's columns of row kk, 16 floats (in `w`: asserted above).
    let row = |kk: usize, j: usize| {
        // SAFETY: kk < k and j < panels: within the extent asserted above.
        unsafe { _mm512_loadu_ps(w.as_ptr().add(kk * n + first + j * NR)) }
    };
    let mut max = [_mm512_setzero_ps(); BLOCK];
    for kk in 0..k {
        for (j, m) in max.iter_mut().enumerate().take(panels) {
            // max(|v|, m): a NaN |v| leaves m, as f32::max does.
            *m = _mm512_max_ps(_mm512_abs_ps(row(kk, j)), *m);
        }
    }
    let levels = _mm512_set1_ps(WEIGHT_LEVELS);
    let mut inv = [_mm512_setzero_ps(); BLOCK];
    for j in 0..panels {
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(max[j], _mm512_setzero_ps());
        inv[j] = _mm512_maskz_div_ps(positive, levels, max[j]);
        let scale = _mm512_maskz_div_ps(positive, max[j], levels);
        // SAFETY: 16 scales of panel j lie in `scales` (cols = panels · 16).
        unsafe { _mm512_storeu_ps(scales.as_mut_ptr().add(j * NR), scale) };
    }
    let shift = _mm512_set1_ps(12_582_912.0); // 1.5 · 2^23, as in `level`
    let byte = _mm512_set1_epi32(0xff);
    let mut sums = [_mm512_setzero_si512(); BLOCK];
    for g in 0..groups(k) {
        for j in 0..panels {
            let mut four = [_mm512_setzero_si512(); 4];
            for (r, l) in four.iter_mut().enumerate() {
                if 4 * g + r < k {
                    let t = _mm512_mul_ps(row(4 * g + r, j), inv[j]);
                    let t = _mm512_sub_ps(_mm512_add_ps(t, shift), shift);
                    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(t, t);
                    *l = _mm512_maskz_cvttps_epi32(ordered, t);
                }
            }
            sums[j] = _mm512_add_epi32(
                sums[j],
                _mm512_add_epi32(
                    _mm512_add_epi32(four[0], four[1]),
                    _mm512_add_epi32(four[2], four[3]),
                ),
            );
            let packed = _mm512_or_si512(
                _mm512_or_si512(
                    _mm512_and_si512(four[0], byte),
                    _mm512_slli_epi32::<8>(_mm512_and_si512(four[1], byte)),
                ),
                _mm512_or_si512(
                    _mm512_slli_epi32::<16>(_mm512_and_si512(four[2], byte)),
                    _mm512_slli_epi32::<24>(four[3]),
                ),
            );
            // SAFETY: group g of panel j is 64 bytes inside `q` (asserted above).
            unsafe { _mm512_storeu_si512(q.as_mut_ptr().add(j * bytes + g * 64).cast(), packed) };
        }
    }
    for (j, sum) in sums.iter().enumerate().take(panels) {
        let correction = _mm512_mullo_epi32(*sum, _mm512_set1_epi32(INPUT_ZERO));
        // SAFETY: 16 corrections of panel j lie in `corrections` (asserted above).
        unsafe { _mm512_storeu_si512(corrections.as_mut_ptr().add(j * NR).cast(), correction) };
    }
}

/// [`quantize_panels_body`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_panels_avx2(
    w: &[f32],
    n: usize,
    k: usize,
    first: usize,
    q: &mut [i8],
    scales: &mut [f32],
    corrections: &mut [i32],
) {
    quantize_panels_body(w, n, k, first, q, scales, corrections)
}

/// See [`quantize_panels`]: each column's largest magnitude over K, then a group of four
/// rows at a time, its levels computed across the block's columns and laid out panel by
/// panel (byte 4c + r of a group is row r of column c).
#[inline(always)]
fn quantize_panels_body(
    w: &[f32],
    n: usize,
    k: usize,
    first: usize,
    q: &mut [i8],
    scales: &mut [f32],
    corrections: &mut [i32],
) {
    const COLS: usize = BLOCK * NR;
    let cols = scales.len();
    check_block(w.len(), n, k, first, cols);
    let row = |kk: usize| &w[kk * n + first..][..cols];
    let mut max = [0f32; COLS];
    for kk in 0..k {
        for (m, v) in max.iter_mut().zip(row(kk)) {
            *m = m.max(v.abs());
        }
    }
    let mut inv = [0f32; COLS];
    for ((s, i), &m) in scales.iter_mut().zip(&mut inv).zip(&max) {
        (*s, *i) = scale_and_inverse(m, WEIGHT_LEVELS);
    }
    let bytes = groups(k) * 4 * NR;
    let mut sums = [0i32; COLS];
    let mut levels = [[0i32; COLS]; 4];
    for g in 0..groups(k) {
        for (r, lv) in levels.iter_mut().enumerate() {
            if 4 * g + r >= k {
                lv.fill(0); // rows past K: zero weights
                continue;
            }
            for (((l, &v), &i), sum) in lv.iter_mut().zip(row(4 * g + r)).zip(&inv).zip(&mut sums) {
                *l = level(v, i);
                *sum += *l;
            }
        }
        for (j, panel) in q.chunks_exact_mut(bytes).enumerate() {
            let out = &mut panel[g * 4 * NR..][..4 * NR];
            for (c, lane) in out.chunks_exact_mut(4).enumerate() {
                for (byte, lv) in lane.iter_mut().zip(&levels) {
                    *byte = lv[j * NR + c] as i8;
                }
            }
        }
    }
    for (correction, sum) in corrections.iter_mut().zip(sums) {
        *correction = INPUT_ZERO * sum;
    }
}

/// The rows of `x` (M, K) quantized: offset bytes packed by row block —
/// `[block][group][row][4]`, the zero (128) past K and past M — and each row's scale (zero
/// past M). Row blocks are quantized in parallel.
pub(super) fn quantize_rows(x: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let kq = groups(k);
    let blocks = m.div_ceil(MR);
    let mut a = vec![INPUT_ZERO as u8; blocks * kq * MR * 4];
    let mut scales = vec![0f32; blocks * MR];
    a.par_chunks_mut(kq * MR * 4)
        .zip(scales.par_chunks_mut(MR))
        .zip(x.par_chunks(MR * k))
        .for_each(|((a, scales), rows)| quantize_block(a, scales, rows, k));
    (a, scales)
}

/// One row block of [`quantize_rows`]: MR rows (fewer in the last block).
fn quantize_block(a: &mut [u8], scales: &mut [f32], rows: &[f32], k: usize) {
    for (r, (xs, scale)) in rows.chunks_exact(k).zip(scales.iter_mut()).enumerate() {
        let inv;
        (*scale, inv) = row_scale(xs);
        for (g, four) in xs.chunks(4).enumerate() {
            let dst = &mut a[(g * MR + r) * 4..][..four.len()];
            for (d, &v) in dst.iter_mut().zip(four) {
                *d = (level(v, inv) + INPUT_ZERO) as u8;
            }
        }
    }
}

/// An input row's scale and its inverse ([`INPUT_LEVELS`] either side of zero).
fn row_scale(xs: &[f32]) -> (f32, f32) {
    let max = xs
        .chunks(8) // eight running maxima: vectorised
        .fold([0f32; 8], |mut m, c| {
            for (m, v) in m.iter_mut().zip(c) {
                *m = m.max(v.abs());
            }
            m
        })
        .into_iter()
        .fold(0f32, f32::max);
    scale_and_inverse(max, INPUT_LEVELS)
}

/// [`quantize_rows`] row-major, for AMX tiles: (⌈M/16⌉·16, 4·⌈K/4⌉) offset bytes (the
/// input's zero past K and past M) and M row scales; the same bytes and scales.
pub(super) fn quantize_rows_flat(x: &[f32], m: usize, k: usize) -> (Lines<u8>, Vec<f32>) {
    let (stride, rows) = (groups(k) * 4, m.div_ceil(16) * 16);
    let mut a = Lines::zeroed(rows * stride);
    a.fill(INPUT_ZERO as u8);
    let mut scales = vec![0f32; m];
    a.par_chunks_mut(stride)
        .zip(scales.par_iter_mut())
        .zip(x.par_chunks(k))
        .for_each(|((a, scale), xs)| {
            let inv;
            (*scale, inv) = row_scale(xs);
            for (d, &v) in a.iter_mut().zip(xs) {
                *d = (level(v, inv) + INPUT_ZERO) as u8;
            }
        });
    (a, scales)
}

/// The i32 sums of one row block `a` (⌈K/4⌉ groups of MR × 4 offset bytes) times one panel
/// `q`: `sums[r·NR + c] = Σ_k u_rk · q_kc` (the offset not yet taken off).
pub(super) fn kernel(a: &[u8], q: &[i8], sums: &mut [i32; MR * NR], kq: usize) {
    assert!(a.len() == kq * MR * 4 && q.len() == kq * 4 * NR);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::avx512().vnni {
        // SAFETY: AVX512F and AVX512-VNNI are present (checked above); the slices hold
        // exactly the bytes the kernel reads, `sums` the values it writes (asserted above).
        unsafe { kernel_vnni(a.as_ptr(), q.as_ptr(), sums.as_mut_ptr(), kq) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported_cached() {
        // SAFETY: AVX2 is present (checked above); the slices hold exactly the bytes the
        // kernel reads, `sums` the values it writes (asserted above).
        unsafe { kernel_avx2(a.as_ptr(), q.as_ptr(), sums.as_mut_ptr(), kq) };
        return;
    }
    kernel_scalar(a, q, sums, kq)
}

/// [`kernel`] value by value: the reference.
fn kernel_scalar(a: &[u8], q: &[i8], sums: &mut [i32; MR * NR], kq: usize) {
    for r in 0..MR {
        for c in 0..NR {
            let mut s = 0i32;
            for kk in 0..kq * 4 {
                s += i32::from(a[((kk / 4) * MR + r) * 4 + kk % 4]) * i32::from(q[position(kk, c)]);
            }
            sums[r * NR + c] = s;
        }
    }
}

/// `out[r·NR + c] = a_r · s_c · (sums[r·NR + c] − c_c)`: a tile's sums scaled back to f32.
pub(super) fn dequantize(
    out: &mut [f32; MR * NR],
    sums: &[i32; MR * NR],
    row_scales: &[f32],
    (col_scales, corrections): (&[f32], &[i32]),
) {
    for ((out, sums), &a) in out
        .chunks_exact_mut(NR)
        .zip(sums.chunks_exact(NR))
        .zip(row_scales)
    {
        for (((o, &s), &sc), &c) in out.iter_mut().zip(sums).zip(col_scales).zip(corrections) {
            *o = (s - c) as f32 * (a * sc);
        }
    }
}

/// [`kernel`] with AVX2: per group and row, the row's four bytes broadcast and multiplied
/// with each column's four weights (`vpmaddubsw`), the pairs summed into i32 (`vpmaddwd`
/// by ones).
///
/// # Safety
/// The CPU has AVX2; `a` points to `kq * MR * 4` readable bytes, `q` to `kq * 4 * NR`, and
/// `sums` to `MR * NR` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_avx2(a: *const u8, q: *const i8, sums: *mut i32, kq: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees the extents above; every offset
    // below stays inside them.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); 2]; MR];
        for g in 0..kq {
            let w0 = _mm256_loadu_si256(q.add(g * 4 * NR).cast()); // columns 0..8
            let w1 = _mm256_loadu_si256(q.add(g * 4 * NR + 32).cast()); // columns 8..16
            let ag = a.add(g * MR * 4);
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm256_set1_epi32(ag.add(r * 4).cast::<i32>().read_unaligned());
                let p0 = _mm256_maddubs_epi16(x, w0);
                let p1 = _mm256_maddubs_epi16(x, w1);
                row[0] = _mm256_add_epi32(row[0], _mm256_madd_epi16(p0, ones));
                row[1] = _mm256_add_epi32(row[1], _mm256_madd_epi16(p1, ones));
            }
        }
        for (r, row) in acc.iter().enumerate() {
            _mm256_storeu_si256(sums.add(r * NR).cast(), row[0]);
            _mm256_storeu_si256(sums.add(r * NR + 8).cast(), row[1]);
        }
    }
}

/// [`kernel`] with AVX512-VNNI: per group and row, the row's four bytes broadcast and
/// dotted with every column's four weights into the column's i32 sum (`vpdpbusd`).
///
/// # Safety
/// The CPU has AVX512F and AVX512-VNNI; `a` points to `kq * MR * 4` readable bytes, `q` to
/// `kq * 4 * NR`, and `sums` to `MR * NR` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn kernel_vnni(a: *const u8, q: *const i8, sums: *mut i32, kq: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees the extents above; every offset
    // below stays inside them.
    unsafe {
        let mut acc = [_mm512_setzero_si512(); MR];
        for g in 0..kq {
            let w = _mm512_loadu_si512(q.add(g * 4 * NR).cast());
            let ag = a.add(g * MR * 4);
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_epi32(ag.add(r * 4).cast::<i32>().read_unaligned());
                *row = _mm512_dpbusd_epi32(*row, x, w);
            }
        }
        for (r, row) in acc.iter().enumerate() {
            _mm512_storeu_si512(sums.add(r * NR).cast(), *row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_int8_kernel_equals_its_scalar_reference_to_the_bit() {
        let kq = 193; // 772 k: sums far past what one i16 pair holds
        let hash = |i: usize, seed: u32| (i as u32).wrapping_mul(2_654_435_761) ^ seed;
        let a: Vec<u8> = (0..kq * MR * 4).map(|i| (hash(i, 1) % 256) as u8).collect();
        let q: Vec<i8> = (0..kq * 4 * NR)
            .map(|i| (hash(i, 2) % 127) as i8 - 63) // the weights' range, −63..=63
            .collect();
        use super::super::TestFeature;
        if !TestFeature::Avx2.test_runs("the INT8 kernels") {
            return; // without AVX2 the dispatch is the scalar reference itself
        }
        let (mut fast, mut reference) = ([0i32; MR * NR], [0i32; MR * NR]);
        kernel(&a, &q, &mut fast, kq);
        kernel_scalar(&a, &q, &mut reference, kq);
        assert_eq!(fast, reference);
        // The dispatch took VNNI where the CPU has it: the AVX2 kernel too, then.
        let _ = TestFeature::Avx512Vnni.test_runs("the INT8 kernel's VNNI form");
        #[cfg(target_arch = "x86_64")]
        {
            let mut avx2 = [0i32; MR * NR];
            // SAFETY: AVX2 is present; the extents are those `kernel` asserts.
            unsafe { kernel_avx2(a.as_ptr(), q.as_ptr(), avx2.as_mut_ptr(), kq) };
            assert_eq!(avx2, reference);
        }
        // Every extreme at once: 255 · ±63 in every product, no pair saturating.
        for w in [63i8, -63] {
            let (a, q) = (vec![255u8; kq * MR * 4], vec![w; kq * 4 * NR]);
            kernel(&a, &q, &mut fast, kq);
            assert!(
                fast.iter()
                    .all(|&s| s == (kq as i32) * 4 * 255 * i32::from(w))
            );
        }
    }

    #[test]
    fn quantized_rows_and_columns_hold_each_value_to_half_a_level() {
        let (m, k, n) = (7, 10, 19);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (a, row_scales) = quantize_rows(&x, m, k);
        let kq = groups(k);
        for row in 0..m {
            for kk in 0..k {
                let got = a[(((row / MR) * kq + kk / 4) * MR + row % MR) * 4 + kk % 4];
                let back = (i32::from(got) - INPUT_ZERO) as f32 * row_scales[row];
                assert!((back - x[row * k + kk]).abs() <= row_scales[row] * 0.5 + 1e-6);
            }
        }
        // Past K and past M: the zero.
        for block in 0..m.div_ceil(MR) {
            for r in 0..MR {
                for kk in 0..kq * 4 {
                    if kk >= k || block * MR + r >= m {
                        let got = a[((block * kq + kk / 4) * MR + r) * 4 + kk % 4];
                        assert_eq!(i32::from(got), INPUT_ZERO);
                    }
                }
            }
        }
        let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.71).cos()).collect();
        let mut panels = Int8Panels::new(k, n);
        panels.fill(&w, k, n, false);
        for col in 0..n {
            let (p, c) = (col / NR, col % NR);
            let s = panels.scales[p * NR + c];
            let mut sum = 0;
            for kk in 0..k {
                let q = panels.q[p * groups(k) * 4 * NR + position(kk, c)];
                assert!((f32::from(q) * s - w[kk * n + col]).abs() <= s * 0.5 + 1e-6);
                assert!(q.unsigned_abs() <= 63);
                sum += i32::from(q);
            }
            assert_eq!(panels.corrections[p * NR + c], INPUT_ZERO * sum);
        }
        // Padding (k past K, columns past N) holds zeros.
        assert!(panels.scales[n..].iter().all(|&s| s == 0.0));
        assert!(panels.corrections[n..].iter().all(|&c| c == 0));
    }

    #[test]
    fn a_matrix_read_in_place_and_its_transpose_gathered_quantize_alike() {
        // Several blocks of whole panels, a last partial one, K not a multiple of 4.
        for (k, n) in [(10, 19), (37, 16 * BLOCK * 2 + 16 * 3 + 5), (5, 16 * BLOCK)] {
            let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
            let (mut direct, mut gathered) = (Int8Panels::new(k, n), Int8Panels::new(k, n));
            direct.fill(&w, k, n, false);
            gathered.fill(&wt, k, n, true);
            assert_eq!(direct.q, gathered.q, "{k}×{n}");
            assert_eq!(direct.scales, gathered.scales, "{k}×{n}");
            assert_eq!(direct.corrections, gathered.corrections, "{k}×{n}");
            // Every weight where `position` says, within half a level.
            for col in 0..n {
                let (p, c) = (col / NR, col % NR);
                let s = direct.scales[p * NR + c];
                for kk in 0..k {
                    let q = direct.q[p * groups(k) * 4 * NR + position(kk, c)];
                    assert!((f32::from(q) * s - w[kk * n + col]).abs() <= s * 0.5 + 1e-6);
                }
            }
            // A refill over other values gives what a fresh fill does.
            let mut again = Int8Panels::new(k, n);
            again.fill(&wt.iter().map(|v| -v).collect::<Vec<_>>(), k, n, true);
            again.fill(&w, k, n, false);
            assert_eq!(again.q, direct.q);
        }
    }

    #[test]
    fn the_avx512_quantizer_writes_the_bodys_bytes_scales_and_corrections() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // Whole and partial blocks, K not a multiple of 4; ties, a zero column, a NaN.
            for (k, n, cols) in [
                (10, 16 * BLOCK, 16 * BLOCK),
                (37, 16 * 5, 16 * 3),
                (1, 16, 16),
            ] {
                let mut w: Vec<f32> = (0..k * n)
                    .map(|i| ((i as f32 * 0.37).sin() * 3.0 * 16.0).round() / 16.0)
                    .collect();
                let first = n - cols;
                for kk in 0..k {
                    w[kk * n + first + 3] = 0.0;
                }
                w[(k - 1) * n + first + 5] = f32::NAN;
                let run = |vector: bool| {
                    let bytes = groups(k) * 4 * NR;
                    let mut q = vec![0i8; cols / NR * bytes];
                    let (mut s, mut c) = (vec![0f32; cols], vec![0i32; cols]);
                    if vector {
                        // SAFETY: AVX512F is present (checked above).
                        unsafe { quantize_panels_avx512(&w, n, k, first, &mut q, &mut s, &mut c) };
                    } else {
                        quantize_panels_body(&w, n, k, first, &mut q, &mut s, &mut c);
                    }
                    (q, s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), c)
                };
                assert_eq!(run(true), run(false), "{k}×{n}, {cols} columns");
            }
            return;
        }
        let _ = super::super::TestFeature::Avx512Vnni.test_runs("the AVX-512 quantizer");
    }

    #[test]
    fn levels_round_to_the_nearest_ties_to_even() {
        for i in -2550..=2550 {
            let v = i as f32 / 20.0; // every tenth and twentieth in ±127.5: all the ties
            assert_eq!(level(v, 1.0), v.round_ties_even() as i32, "{v}");
        }
        assert_eq!(level(0.7, 127.0 / 0.7), 127);
        assert_eq!(level(-1.0, 63.0), -63);
    }
}
