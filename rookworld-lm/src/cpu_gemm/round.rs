//! Rounding f32 to BF16 as the products' packers do: a run at a time
//! ([`round_into`]), or two runs of k at once into each lane's pair ([`rounded_pairs`]);
//! and the packers' turn of 16 × 16 such pairs ([`transpose_16x16`]).

/// `src` rounded to the nearest BF16 (ties to even) into `dst`, as bits: 32 values per
/// `vcvtne2ps2bf16` where the CPU has AVX512-BF16 (which reads subnormal inputs as zero, as
/// `vdpbf16ps` does anyway), the rest value by value.
pub(super) fn round_into(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::avx512().bf16 {
        done = src.len() / 32 * 32;
        // SAFETY: AVX512F and AVX512-BF16 are present (checked above); both slices hold
        // `done` values.
        unsafe { round32(src.as_ptr(), dst.as_mut_ptr(), done / 32) };
    }
    for (d, &v) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = half::bf16::from_f32(v).to_bits();
    }
}

/// [`round_into`] for `groups` groups of 32 values.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `src` and `dst` hold `groups * 32` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round32(src: *const f32, dst: *mut u16, groups: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees the extents; a __m512bh and a
    // __m512i are the same 64 bytes.
    unsafe {
        for g in 0..groups {
            let low = _mm512_loadu_ps(src.add(g * 32));
            let high = _mm512_loadu_ps(src.add(g * 32 + 16));
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(high, low));
            _mm512_storeu_si512(dst.add(g * 32).cast(), both);
        }
    }
}

/// Two runs of 16 f32 — `even`, and `odd` or zeros — masked to `mask`'s lanes, rounded to
/// BF16 together (`vcvtne2ps2bf16`) and interleaved lane by lane (`vpermw`): lane i's pair
/// (even in the low half, odd in the high) as one 32-bit value.
///
/// # Safety
/// The CPU has AVX512F, AVX512BW and AVX512-BF16; `mask`'s lanes of each run are readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) unsafe fn rounded_pairs(
    mask: std::arch::x86_64::__mmask16,
    even: *const f32,
    odd: Option<*const f32>,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    const INTERLEAVE: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut i = 0;
        while i < 16 {
            idx[2 * i] = i as u16; // lane i's even value: the low half
            idx[2 * i + 1] = 16 + i as u16; // its odd value
            i += 1;
        }
        idx
    };
    // SAFETY: the caller guarantees the features and the masked lanes' extent.
    unsafe {
        let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
        let even = _mm512_maskz_loadu_ps(mask, even);
        let odd = odd.map_or(_mm512_setzero_ps(), |odd| _mm512_maskz_loadu_ps(mask, odd));
        let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(odd, even));
        _mm512_permutexvar_epi16(idx, both)
    }
}

/// The 16 × 16 matrix of 32-bit values `rows` (row i in `rows[i]`, column j in lane j)
/// transposed in place: lane j of row i becomes lane i of row j. Four rounds of 16
/// shuffles — 32-bit and 64-bit interleaves within 128-bit lanes, then two of whole
/// 128-bit lanes — where a packer that turns k-runs into pairs a row would otherwise
/// store each value on its own (a scatter, or 16 scalar stores).
///
/// # Safety
/// The CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn transpose_16x16(rows: &mut [std::arch::x86_64::__m512i; 16]) {
    use std::arch::x86_64::*;
    let r = *rows;
    // Within each 128-bit lane L (columns 4L..4L + 3): t[2i] holds rows 2i, 2i + 1 at
    // columns 4L, 4L + 1 (interleaved), t[2i + 1] at 4L + 2, 4L + 3.
    let mut t = r;
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4m + j]'s lane L: rows 4m..4m + 3 at column 4L + j.
    let mut u = t;
    for m in 0..4 {
        let (a, b, c, d) = (t[4 * m], t[4 * m + 2], t[4 * m + 1], t[4 * m + 3]);
        u[4 * m] = _mm512_unpacklo_epi64(a, b);
        u[4 * m + 1] = _mm512_unpackhi_epi64(a, b);
        u[4 * m + 2] = _mm512_unpacklo_epi64(c, d);
        u[4 * m + 3] = _mm512_unpackhi_epi64(c, d);
    }
    // Column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j], in that order — a
    // 4 × 4 transpose of 128-bit lanes for each j.
    for j in 0..4 {
        let (a, b, c, d) = (u[j], u[4 + j], u[8 + j], u[12 + j]);
        let e = _mm512_shuffle_i32x4::<0x44>(a, b); // a0 a1 b0 b1
        let f = _mm512_shuffle_i32x4::<0xEE>(a, b); // a2 a3 b2 b3
        let g = _mm512_shuffle_i32x4::<0x44>(c, d); // c0 c1 d0 d1
        let h = _mm512_shuffle_i32x4::<0xEE>(c, d); // c2 c3 d2 d3
        rows[j] = _mm512_shuffle_i32x4::<0x88>(e, g); // a0 b0 c0 d0
        rows[4 + j] = _mm512_shuffle_i32x4::<0xDD>(e, g); // a1 b1 c1 d1
        rows[8 + j] = _mm512_shuffle_i32x4::<0x88>(f, h);
        rows[12 + j] = _mm512_shuffle_i32x4::<0xDD>(f, h);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sixteen_rows_of_sixteen_are_transposed() {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            // Where the packers use it: with AVX512-BF16 (AVX-512F with it).
            if !super::super::TestFeature::Avx512Bf16.test_runs("the packers' 16 × 16 turn") {
                return;
            }
            let value = |i: u32, j: u32| i * 1000 + j;
            let mut rows: [[u32; 16]; 16] = [[0; 16]; 16];
            for (i, row) in rows.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = value(i as u32, j as u32);
                }
            }
            // SAFETY: AVX512F is present (checked above); [u32; 16] and __m512i are the
            // same 64 bytes.
            let turned: [[u32; 16]; 16] = unsafe {
                let mut regs: [__m512i; 16] = std::mem::transmute(rows);
                super::transpose_16x16(&mut regs);
                std::mem::transmute(regs)
            };
            for (i, row) in turned.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    assert_eq!(v, value(j as u32, i as u32), "({i}, {j})");
                }
            }
        }
    }
}
