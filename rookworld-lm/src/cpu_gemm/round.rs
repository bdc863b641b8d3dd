//! Rounding f32 to BF16 as the products' packers do: a run at a time
//! ([`round_into`]), or two runs of k at once into each lane's pair ([`rounded_pairs`]).

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
