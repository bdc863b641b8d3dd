//! INT8 panels ([`PanelDtype::Int8`](super::PanelDtype)): each weight column quantized
//! symmetrically to 127 levels once, when packed (`q = round(w / s_j)`, `s_j = max_k |w_kj| /
//! 127`); each input row quantized the same way at every product (`a_r`); the i8 · i8 dot
//! products summed exactly in i32 and scaled back, `y_rj = a_r · s_j · Σ_k x̂_rk q_kj`.
//!
//! On AVX2 a group of four k per column is one `vpmaddubsw` (unsigned × signed bytes into
//! pairs of i16) and one `vpmaddwd` (into i32). The input's sign is moved onto the weight
//! (`vpsignb`) so the unsigned operand is |x̂| ≤ 127 and no pair sum (≤ 2 · 127 · 127)
//! saturates: the sums are exact, the scalar reference's to the bit.
//!
//! Layout: a panel is ⌈K/4⌉ groups of 64 bytes, columns 0..8 then 8..16, each column's
//! four k adjacent ([`position`]); K is padded with zero weights.

use rayon::prelude::*;

use super::{MR, NR, pack::fill_panel};

/// Groups of four k: the dot products' unit.
pub(super) fn groups(k: usize) -> usize {
    k.div_ceil(4)
}

/// Where weight (kk, column c) of a panel lies in its bytes.
fn position(kk: usize, c: usize) -> usize {
    (kk / 4) * 4 * NR + (c / 8) * 32 + (c % 8) * 4 + kk % 4
}

/// The quantized panels of a (K, N) matrix and each column's scale.
#[derive(Debug, Clone)]
pub(super) struct Int8Panels {
    q: Vec<i8>,       // (⌈N/NR⌉, ⌈K/4⌉, 64), see `position`
    scales: Vec<f32>, // (⌈N/NR⌉ · NR), zero past N
}

impl Int8Panels {
    pub(super) fn new(k: usize, n: usize) -> Self {
        let panels = n.div_ceil(NR);
        Self {
            q: vec![0; panels * groups(k) * 4 * NR],
            scales: vec![0.0; panels * NR],
        }
    }

    /// Quantizes `w` — (K, N) row-major, or (N, K) when `transposed` — into the panels.
    pub(super) fn fill(&mut self, w: &[f32], k: usize, n: usize, transposed: bool) {
        let bytes = groups(k) * 4 * NR;
        self.q
            .par_chunks_mut(bytes)
            .zip(self.scales.par_chunks_mut(NR))
            .enumerate()
            .for_each_init(
                || vec![0f32; k * NR],
                |wide, (p, (q, scales))| {
                    wide.fill(0.0); // the last panel's padding columns
                    fill_panel(wide, w, k, n, p, transposed);
                    for (c, scale) in scales.iter_mut().enumerate() {
                        let max = (0..k).fold(0f32, |m, kk| m.max(wide[kk * NR + c].abs()));
                        *scale = if max > 0.0 { max / 127.0 } else { 0.0 };
                        let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
                        for kk in 0..k {
                            q[position(kk, c)] = (wide[kk * NR + c] * inv).round() as i8;
                        }
                    }
                },
            );
    }

    /// Panel p's bytes and its columns' scales, for every panel.
    pub(super) fn panels(&self, k: usize) -> impl IndexedParallelIterator<Item = (&[i8], &[f32])> {
        self.q
            .par_chunks(groups(k) * 4 * NR)
            .zip(self.scales.par_chunks(NR))
    }
}

/// The rows of `x` (M, K) quantized: i8 values packed by row block — `[block][group][row][4]`,
/// zeros past K and past M — and each row's scale (zero past M).
pub(super) fn quantize_rows(x: &[f32], m: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    let kq = groups(k);
    let mut a = vec![0i8; m.div_ceil(MR) * kq * MR * 4];
    let mut scales = vec![0f32; m.div_ceil(MR) * MR];
    for (row, xs) in x.chunks_exact(k).enumerate() {
        let max = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        scales[row] = if max > 0.0 { max / 127.0 } else { 0.0 };
        let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
        let (block, r) = (row / MR, row % MR);
        for (kk, &v) in xs.iter().enumerate() {
            a[((block * kq + kk / 4) * MR + r) * 4 + kk % 4] = (v * inv).round() as i8;
        }
    }
    (a, scales)
}

/// The i32 sums of one row block `a` (⌈K/4⌉ groups of MR × 4) times one panel `q`:
/// `sums[r·NR + c] = Σ_k a_rk · q_kc`.
pub(super) fn kernel(a: &[i8], q: &[i8], sums: &mut [i32; MR * NR], kq: usize) {
    assert!(a.len() == kq * MR * 4 && q.len() == kq * 4 * NR);
    #[cfg(target_arch = "x86_64")]
    if super::supported_cached() {
        // SAFETY: AVX2 is present (checked above); the slices hold exactly the bytes the
        // kernel reads, `sums` the values it writes (asserted above).
        unsafe { kernel_avx2(a.as_ptr(), q.as_ptr(), sums.as_mut_ptr(), kq) };
        return;
    }
    kernel_scalar(a, q, sums, kq)
}

/// [`kernel`] value by value: the reference.
fn kernel_scalar(a: &[i8], q: &[i8], sums: &mut [i32; MR * NR], kq: usize) {
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

/// [`kernel`] with AVX2: per group and row, the row's four bytes broadcast, their
/// magnitudes times the weights carrying their signs (`vpsignb`, `vpmaddubsw`), pairs
/// summed into i32 (`vpmaddwd` by ones).
///
/// # Safety
/// The CPU has AVX2; `a` points to `kq * MR * 4` readable bytes, `q` to `kq * 4 * NR`, and
/// `sums` to `MR * NR` writable values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_avx2(a: *const i8, q: *const i8, sums: *mut i32, kq: usize) {
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
                let magnitude = _mm256_abs_epi8(x);
                let p0 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w0, x));
                let p1 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w1, x));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_int8_kernel_equals_its_scalar_reference_to_the_bit() {
        let kq = 193; // 772 k: sums far past what one i16 pair holds
        let bytes = |len: usize, seed: u32| -> Vec<i8> {
            (0..len as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 255) as i8)
                .map(|v| v.max(-127)) // the quantizers' range
                .collect()
        };
        let (a, q) = (bytes(kq * MR * 4, 1), bytes(kq * 4 * NR, 2));
        let (mut fast, mut reference) = ([0i32; MR * NR], [0i32; MR * NR]);
        kernel(&a, &q, &mut fast, kq);
        kernel_scalar(&a, &q, &mut reference, kq);
        assert_eq!(fast, reference);
        // Every extreme at once: 127 · 127 in every product, of either sign.
        let (a, q) = (vec![-127i8; kq * MR * 4], vec![127i8; kq * 4 * NR]);
        kernel(&a, &q, &mut fast, kq);
        assert!(fast.iter().all(|&s| s == -(kq as i32) * 4 * 127 * 127));
    }

    #[test]
    fn quantized_rows_and_columns_hold_each_value_to_half_a_level() {
        let (m, k, n) = (7, 10, 19);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let (a, row_scales) = quantize_rows(&x, m, k);
        for row in 0..m {
            for kk in 0..k {
                let got = a[(((row / MR) * groups(k) + kk / 4) * MR + row % MR) * 4 + kk % 4];
                let back = f32::from(got) * row_scales[row];
                assert!((back - x[row * k + kk]).abs() <= row_scales[row] * 0.5 + 1e-6);
            }
        }
        let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.71).cos()).collect();
        let mut panels = Int8Panels::new(k, n);
        panels.fill(&w, k, n, false);
        for kk in 0..k {
            for col in 0..n {
                let (p, c) = (col / NR, col % NR);
                let q = panels.q[p * groups(k) * 4 * NR + position(kk, c)];
                let s = panels.scales[p * NR + c];
                assert!((f32::from(q) * s - w[kk * n + col]).abs() <= s * 0.5 + 1e-6);
            }
        }
        // Padding (k past K, columns past N) holds zeros.
        assert!(panels.scales[n..].iter().all(|&s| s == 0.0));
    }
}
