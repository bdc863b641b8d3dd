//! Weights written into panels: [`PackedMatrix`](super::PackedMatrix)'s packing, run at
//! load and at every weight update of a CPU rollout worker (half a gigabyte of f32 panels
//! for gpt2-124m, on the path of every push).
//!
//! With AVX2, two things make the transposed packing run at memory speed (3–4× the
//! value-by-value loop on this project's machine; rows copied as they are already do):
//! - a transposed weight — a (N, K) matrix such as the tied embedding used as the LM head
//!   (38.6 M values) — is read 16 rows at a time and transposed 8 × 8 in registers, so
//!   each panel row (16 values, one 64-byte line) is written whole, once; written value
//!   by value, each line of a panel was written 16 times over;
//! - panel rows are stored non-temporally: the panels are read next by matrix products,
//!   later, on every core; their lines need neither be read in before they are written
//!   over nor kept in this core's cache.
//!
//! Without AVX2 (where the packed kernel does not run anyway) a scalar loop does the same.

use rayon::prelude::*;

use super::tile::{BF16_COLUMNS, NR};

/// Writes `w` — (K, N) row-major, or (N, K) when `transposed` — into `panels`
/// (⌈N/NR⌉, K, NR); the padding columns of the last panel are left as they are (zero).
pub(super) fn fill_panels(panels: &mut [f32], w: &[f32], k: usize, n: usize, transposed: bool) {
    assert_eq!(w.len(), k * n, "weight of {k}×{n}");
    assert_eq!(panels.len(), n.div_ceil(NR) * k * NR, "panels of {k}×{n}");
    panels
        .par_chunks_mut(k * NR)
        .enumerate()
        .for_each(|(p, panel)| fill_panel(panel, w, k, n, p, transposed));
}

/// [`fill_panels`] into BF16 panels: each value rounded to the nearest BF16 (ties to
/// even), each panel row in [`BF16_COLUMNS`] order. A panel is written in f32 first, into
/// a buffer of the thread's own (K × NR values), then rounded into place (rounding from
/// w's rows in place, 64 bytes a row, is slower: gpt2-124m packs in 0.50 against 0.37 s
/// on a 2-core AVX2 EPYC).
pub(super) fn fill_panels_bf16(
    panels: &mut [u16],
    w: &[f32],
    k: usize,
    n: usize,
    transposed: bool,
) {
    assert_eq!(w.len(), k * n, "weight of {k}×{n}");
    assert_eq!(panels.len(), n.div_ceil(NR) * k * NR, "panels of {k}×{n}");
    panels.par_chunks_mut(k * NR).enumerate().for_each_init(
        || vec![0f32; k * NR],
        |wide, (p, panel)| {
            wide.fill(0.0); // the last panel's padding columns
            fill_panel(wide, w, k, n, p, transposed);
            for (dst, src) in panel.chunks_exact_mut(NR).zip(wide.chunks_exact(NR)) {
                for (d, &col) in dst.iter_mut().zip(&BF16_COLUMNS) {
                    *d = half::bf16::from_f32(src[col]).to_bits();
                }
            }
        },
    );
}

/// BF16 values `w` — little-endian bit patterns as a payload stores them, (K, N)
/// row-major or (N, K) when `transposed` — placed into BF16 panels (K, NR) with each
/// panel row in [`BF16_COLUMNS`] order, the padding columns of the last panel zero. A
/// BF16 value rounds to itself, so this writes what packing the values' f32 widening
/// writes, without the f32 copy (a push's BF16 payload into BF16 panels). With AVX2 a
/// whole panel goes through registers: a row of 16 columns is one load and a lane
/// permute; a transposed weight is read 16 values of 8 rows at a time and transposed as
/// pairs of values, 8 × 8 like f32 values ([`avx2::transpose_bf16_rows`]).
pub(super) fn place_bf16(panels: &mut [u16], w: &[u8], (k, n): (usize, usize), transposed: bool) {
    assert_eq!(w.len(), 2 * k * n, "BF16 weight of {k}×{n}");
    assert_eq!(panels.len(), n.div_ceil(NR) * k * NR, "panels of {k}×{n}");
    // BF16_COLUMNS swaps two blocks of four: its own inverse.
    let at = |kk: usize, c: usize| kk * NR + BF16_COLUMNS[c];
    panels
        .par_chunks_mut(k * NR)
        .enumerate()
        .for_each(|(p, panel)| {
            #[cfg(target_arch = "x86_64")]
            if NR.min(n - p * NR) == NR && std::arch::is_x86_feature_detected!("avx2") {
                let src = w.as_ptr().cast::<u16>();
                // SAFETY: AVX2 is present; `w` holds the K × N values (asserted above),
                // panel p has NR columns and `panel` K·NR values.
                unsafe {
                    if transposed {
                        avx2::transpose_bf16_rows(panel, src.add(p * NR * k), k);
                    } else {
                        avx2::permute_bf16_rows(panel, src, k, n, p);
                    }
                }
                return;
            }
            place_panel(panel, w, (k, n), p, transposed, &at)
        });
}

/// [`place_bf16`] into `vdpbf16ps` pair panels ((⌈K/2⌉, NR, 2) each: column c's values k
/// = 2·pair, 2·pair + 1 adjacent). With AVX2 and an even K, a whole panel goes through
/// registers: two rows interleaved 16 columns at a time, or — for a transposed weight,
/// whose pairs are adjacent already — the (N, K/2) matrix of pairs transposed 8 × 8 like
/// f32 values ([`fill_panels`]' transposed path).
pub(super) fn place_bf16_pairs(
    panels: &mut [u16],
    w: &[u8],
    (k, n): (usize, usize),
    transposed: bool,
) {
    let panel_len = k.div_ceil(2) * NR * 2;
    assert_eq!(w.len(), 2 * k * n, "BF16 weight of {k}×{n}");
    assert_eq!(
        panels.len(),
        n.div_ceil(NR) * panel_len,
        "panels of {k}×{n}"
    );
    let at = |kk: usize, c: usize| ((kk / 2) * NR + c) * 2 + kk % 2;
    panels
        .par_chunks_mut(panel_len)
        .enumerate()
        .for_each(|(p, panel)| {
            #[cfg(target_arch = "x86_64")]
            if NR.min(n - p * NR) == NR
                && k.is_multiple_of(2)
                && std::arch::is_x86_feature_detected!("avx2")
            {
                let src = w.as_ptr();
                if !transposed {
                    // SAFETY: AVX2 is present; `w` holds the K × N values (asserted
                    // above), K is even, panel p has NR columns and `panel` K·NR values.
                    unsafe { avx2::interleave_rows(panel, src.cast(), k, n, p) };
                    return;
                }
                let out = panel.as_mut_ptr();
                if (k / 2).is_multiple_of(8) && (out as usize).is_multiple_of(16) {
                    // SAFETY: AVX2 is present; rows p·NR.. of the (N, K/2) pairs lie in
                    // `w` (asserted above, the panel has NR columns), K/2 is a multiple of
                    // 8 and `out` — (K/2) · NR pairs — is 16-byte aligned.
                    unsafe {
                        avx2::transpose_rows(out.cast(), src.add(p * NR * k * 2).cast(), k / 2)
                    };
                    return;
                }
            }
            place_panel(panel, w, (k, n), p, transposed, &at)
        });
}

/// Panel `p` of [`place_bf16`], value by value: zeroed, then each value placed at `at`.
fn place_panel(
    panel: &mut [u16],
    w: &[u8],
    (k, n): (usize, usize),
    p: usize,
    transposed: bool,
    at: &impl Fn(usize, usize) -> usize,
) {
    let bits = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    panel.fill(0);
    let cols = NR.min(n - p * NR);
    if transposed {
        for c in 0..cols {
            let column = &w[(p * NR + c) * k * 2..][..k * 2];
            for (kk, v) in column.chunks_exact(2).enumerate() {
                panel[at(kk, c)] = bits(v);
            }
        }
    } else {
        for kk in 0..k {
            let row = &w[(kk * n + p * NR) * 2..][..cols * 2];
            for (c, v) in row.chunks_exact(2).enumerate() {
                panel[at(kk, c)] = bits(v);
            }
        }
    }
}

/// Panel `p` (K, NR) of `w`: through registers where the CPU has AVX2, else value by value.
pub(super) fn fill_panel(
    panel: &mut [f32],
    w: &[f32],
    k: usize,
    n: usize,
    p: usize,
    transposed: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; `panel` is panel p of a (K, N) weight `w`.
        unsafe { avx2::fill_panel(panel, w, k, n, p, transposed) };
        return;
    }
    fill_panel_scalar(panel, w, k, n, p, transposed)
}

/// Panel `p` (K, NR) of `w`, value by value.
fn fill_panel_scalar(panel: &mut [f32], w: &[f32], k: usize, n: usize, p: usize, transposed: bool) {
    let (first, cols) = (p * NR, NR.min(n - p * NR));
    if transposed {
        // Row `col` of w is column `col` of W: scattered down the panel.
        for j in 0..cols {
            let row = &w[(first + j) * k..(first + j + 1) * k];
            for (kk, &x) in row.iter().enumerate() {
                panel[kk * NR + j] = x;
            }
        }
    } else {
        for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
            dst[..cols].copy_from_slice(&w[kk * n + first..kk * n + first + cols]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{NR, fill_panel_scalar};

    /// Panel `p` of `w` (see [`super::fill_panels`]): a transposed one through registers,
    /// its rows stored non-temporally; otherwise (rows copied as they are, which is as
    /// fast: measured) value by value.
    ///
    /// # Safety
    /// The CPU has AVX2; `w` holds the K × N matrix (`k * n` values), `p` is one of its
    /// panels and `panel` holds `k * NR` values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fill_panel(
        panel: &mut [f32],
        w: &[f32],
        k: usize,
        n: usize,
        p: usize,
        transposed: bool,
    ) {
        let (first, cols) = (p * NR, NR.min(n - p * NR));
        let streamed = (panel.as_ptr() as usize).is_multiple_of(16);
        if !transposed || cols < NR || !streamed || !k.is_multiple_of(8) {
            fill_panel_scalar(panel, w, k, n, p, transposed);
            return;
        }
        // SAFETY: `panel` holds K·NR floats and `w` N·K; panel p's rows first..first + NR
        // of w lie within N (cols == NR), K is a multiple of 8 and the panel 16-byte
        // aligned.
        unsafe { transpose_rows(panel.as_mut_ptr(), w.as_ptr().add(first * k), k) }
    }

    /// The 16 rows of K 32-bit values from `base` (row j at `base + j·K`, any alignment)
    /// written transposed as K panel rows of 16 at `out`, non-temporally: two 8 × 8 blocks
    /// through registers at a time.
    ///
    /// # Safety
    /// The CPU has AVX2; `base` is valid for 16·K reads, `out` for K·16 writes and 16-byte
    /// aligned; K is a multiple of 8.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose_rows(out: *mut f32, base: *const f32, k: usize) {
        // SAFETY: (the whole body) within the bounds the caller guarantees; every
        // 64-byte panel row after `out` is 16-byte aligned as it is.
        unsafe {
            for kk in (0..k).step_by(8) {
                let lo = transpose8(std::array::from_fn(|j| {
                    _mm256_loadu_ps(base.add(j * k + kk))
                }));
                let hi = transpose8(std::array::from_fn(|j| {
                    _mm256_loadu_ps(base.add((j + 8) * k + kk))
                }));
                for c in 0..8 {
                    stream_row(out.add((kk + c) * NR), lo[c], hi[c]);
                }
            }
            _mm_sfence();
        }
    }

    /// Pair panel `p` of a (K, N) BF16 weight at `w` (row-major, any alignment): rows
    /// 2·pair and 2·pair + 1, 16 columns each, interleaved in registers into the panel's
    /// 32 values of that pair.
    ///
    /// # Safety
    /// The CPU has AVX2; `w` is valid for K·N reads, K is even, panel p's NR columns lie
    /// within N, and `panel` holds K·NR values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn interleave_rows(
        panel: &mut [u16],
        w: *const u16,
        k: usize,
        n: usize,
        p: usize,
    ) {
        assert!(panel.len() >= k * NR, "pair panel of {k} rows");
        let out = panel.as_mut_ptr();
        // SAFETY: (the whole body) rows kk < K, columns p·NR..p·NR + 16 ≤ N of `w`; panel
        // values pair·32..pair·32 + 32 < K·NR.
        unsafe {
            for pair in 0..k / 2 {
                let even = _mm256_loadu_si256(w.add(2 * pair * n + p * NR).cast());
                let odd = _mm256_loadu_si256(w.add((2 * pair + 1) * n + p * NR).cast());
                // Within each 128-bit lane: columns 0–3 | 8–11 (lo), 4–7 | 12–15 (hi).
                let lo = _mm256_unpacklo_epi16(even, odd);
                let hi = _mm256_unpackhi_epi16(even, odd);
                let dst = out.add(pair * NR * 2);
                _mm256_storeu_si256(dst.cast(), _mm256_permute2x128_si256::<0x20>(lo, hi));
                _mm256_storeu_si256(
                    dst.add(16).cast(),
                    _mm256_permute2x128_si256::<0x31>(lo, hi),
                );
            }
        }
    }

    /// BF16 panel `p` of a (K, N) weight at `w` (row-major, any alignment): each row's
    /// 16 columns loaded at once and stored with their middle two blocks of four swapped
    /// ([`super::BF16_COLUMNS`]).
    ///
    /// # Safety
    /// The CPU has AVX2; `w` is valid for K·N reads, panel p's NR columns lie within N,
    /// and `panel` holds K·NR values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn permute_bf16_rows(
        panel: &mut [u16],
        w: *const u16,
        k: usize,
        n: usize,
        p: usize,
    ) {
        assert!(panel.len() >= k * NR, "panel of {k} rows");
        let out = panel.as_mut_ptr();
        // SAFETY: (the whole body) rows kk < K, columns p·NR..p·NR + 16 ≤ N of `w`; panel
        // values kk·16..kk·16 + 16 ≤ K·NR.
        unsafe {
            for kk in 0..k {
                let row = _mm256_loadu_si256(w.add(kk * n + p * NR).cast());
                let placed = _mm256_permute4x64_epi64::<0b11_01_10_00>(row);
                _mm256_storeu_si256(out.add(kk * NR).cast(), placed);
            }
        }
    }

    /// BF16 panel of the 16 rows of K values from `base` (row c at `base + c·K`, any
    /// alignment; a transposed weight's rows are the panel's columns), each panel row in
    /// [`super::BF16_COLUMNS`] order. Sixteen values of K at a time: each half of the rows
    /// as eight 32-bit pairs transposed 8 × 8, the pairs' first and second values parted
    /// in each lane, and the two halves' blocks of four interleaved into two panel rows;
    /// the last K % 16 values one by one.
    ///
    /// # Safety
    /// The CPU has AVX2; `base` is valid for 16·K reads and `panel` holds K·NR values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose_bf16_rows(panel: &mut [u16], base: *const u16, k: usize) {
        assert!(panel.len() >= k * NR, "panel of {k} rows");
        let out = panel.as_mut_ptr();
        let whole = k - k % 16;
        // SAFETY: (the whole body) rows c < 16 and values kk < K of `base`; panel values
        // kk·16..kk·16 + 16 ≤ K·NR.
        unsafe {
            // In each lane: the first values of four pairs, then their second values.
            let part = _mm256_setr_epi8(
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
                0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
            );
            for kk in (0..whole).step_by(16) {
                let half = |h: usize| {
                    transpose8(std::array::from_fn(|i| {
                        _mm256_loadu_ps(base.add((8 * h + i) * k + kk).cast())
                    }))
                };
                let (a, b) = (half(0), half(1));
                for j in 0..8 {
                    // Pair j of columns 0–7 and 8–15: values kk + 2j and kk + 2j + 1.
                    let a = _mm256_shuffle_epi8(_mm256_castps_si256(a[j]), part);
                    let b = _mm256_shuffle_epi8(_mm256_castps_si256(b[j]), part);
                    // Columns 0–3 | 8–11 | 4–7 | 12–15: the BF16_COLUMNS order.
                    let row = out.add((kk + 2 * j) * NR);
                    _mm256_storeu_si256(row.cast(), _mm256_unpacklo_epi64(a, b));
                    _mm256_storeu_si256(row.add(NR).cast(), _mm256_unpackhi_epi64(a, b));
                }
            }
            for kk in whole..k {
                for c in 0..NR {
                    *out.add(kk * NR + super::BF16_COLUMNS[c]) = *base.add(c * k + kk);
                }
            }
        }
    }

    /// Stores a panel row of 16 values (`lo`, `hi`) at 16-byte aligned `dst`,
    /// non-temporally.
    ///
    /// # Safety
    /// The CPU has AVX2; `dst` is valid for 16 writes of f32 and 16-byte aligned.
    #[inline(always)]
    unsafe fn stream_row(dst: *mut f32, lo: __m256, hi: __m256) {
        // SAFETY: the caller's `dst` holds 16 floats and is 16-byte aligned.
        unsafe {
            _mm_stream_ps(dst, _mm256_castps256_ps128(lo));
            _mm_stream_ps(dst.add(4), _mm256_extractf128_ps::<1>(lo));
            _mm_stream_ps(dst.add(8), _mm256_castps256_ps128(hi));
            _mm_stream_ps(dst.add(12), _mm256_extractf128_ps::<1>(hi));
        }
    }

    /// The 8 × 8 transpose of rows `r`: element c of result j is element j of `r[c]`.
    #[inline(always)]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // SAFETY: register shuffles only; AVX2 is enabled in every caller.
        unsafe {
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            [
                _mm256_permute2f128_ps::<0x20>(s0, s4),
                _mm256_permute2f128_ps::<0x20>(s1, s5),
                _mm256_permute2f128_ps::<0x20>(s2, s6),
                _mm256_permute2f128_ps::<0x20>(s3, s7),
                _mm256_permute2f128_ps::<0x31>(s0, s4),
                _mm256_permute2f128_ps::<0x31>(s1, s5),
                _mm256_permute2f128_ps::<0x31>(s2, s6),
                _mm256_permute2f128_ps::<0x31>(s3, s7),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_are_the_scalar_packing_for_every_shape_and_orientation() {
        for (k, n) in [
            (8usize, 16usize),
            (16, 40),
            (24, 33),
            (13, 50),
            (768, 48),
            (5, 3),
        ] {
            let w: Vec<f32> = (0..k * n).map(|i| i as f32 * 0.5 - 7.0).collect();
            for transposed in [false, true] {
                let mut want = vec![0f32; n.div_ceil(NR) * k * NR];
                for (p, panel) in want.chunks_mut(k * NR).enumerate() {
                    fill_panel_scalar(panel, &w, k, n, p, transposed);
                }
                let mut got = vec![0f32; want.len()];
                fill_panels(&mut got, &w, k, n, transposed);
                assert_eq!(got, want, "{k}×{n}, transposed: {transposed}");
                // W's element (kk, col) is at row kk, column col % NR of panel col / NR.
                let (kk, col) = (k - 1, n - 1);
                let at = (col / NR) * k * NR + kk * NR + col % NR;
                let w_kk_col = if transposed {
                    w[col * k + kk]
                } else {
                    w[kk * n + col]
                };
                assert_eq!(got[at], w_kk_col);
            }
        }
    }

    #[test]
    fn bf16_panels_are_the_f32_panels_rounded_in_column_order() {
        for (k, n) in [(8usize, 16usize), (13, 50), (768, 48), (5, 3)] {
            let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
            let mut wide = vec![0f32; n.div_ceil(NR) * k * NR];
            fill_panels(&mut wide, &w, k, n, false);
            let want: Vec<u16> = wide
                .chunks_exact(NR)
                .flat_map(|row| BF16_COLUMNS.map(|c| half::bf16::from_f32(row[c]).to_bits()))
                .collect();
            for (m, transposed) in [(&w, false), (&wt, true)] {
                let mut got = vec![0u16; want.len()];
                fill_panels_bf16(&mut got, m, k, n, transposed);
                assert_eq!(got, want, "{k}×{n}, transposed: {transposed}");
            }
        }
    }
}
