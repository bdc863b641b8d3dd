//! The BF16 pair kernels: one 6×16 tile of `a · b` over inputs and weights in pairs of
//! k, f32 sums — `vdpbf16ps` where the CPU has AVX512-BF16 ([`avx512`](super::avx512)),
//! else the scalar reference, which the instruction meets but for results it flushes
//! below f32's normals. [`PackedMatrix`](super::PackedMatrix)'s BF16 pair panels and
//! [`gemm_bf16`](super::gemm_bf16) run them.

use super::tile::{MR, NR};

/// The FLOP rate of `vdpbf16ps` over that of `vfmadd231ps`, both 512-bit on register
/// operands with twelve independent sums (enough to hide either's latency), best of three
/// timings of about a tenth of a millisecond each; 0 without AVX512-BF16. Each
/// `vdpbf16ps` sums two products per f32 lane (64 FLOP), each FMA one (32 FLOP).
pub(super) fn dot_to_fma_rate() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::avx512().bf16 {
        const ITERS: usize = 20_000;
        let mut dot = f64::MAX;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            // SAFETY: AVX512F and AVX512-BF16 are present (checked above).
            std::hint::black_box(unsafe { dot_sums(ITERS) });
            dot = dot.min(start.elapsed().as_secs_f64());
        }
        return (ITERS * 12 * 64) as f64 / dot.max(1e-9) / fma_rate();
    }
    0.0
}

/// FLOP a second of 512-bit `vfmadd231ps` on register operands, twelve independent sums,
/// best of three timings of about a tenth of a millisecond; 1 without AVX-512F.
pub(super) fn fma_rate() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        const ITERS: usize = 20_000;
        let mut fma = f64::MAX;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            // SAFETY: AVX512F is present (checked above).
            std::hint::black_box(unsafe { fma_sums(ITERS) });
            fma = fma.min(start.elapsed().as_secs_f64());
        }
        return (ITERS * 12 * 32) as f64 / fma.max(1e-9);
    }
    1.0
}

/// `iters` rounds of twelve independent `vdpbf16ps`, summed at the end.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_sums(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let half = std::hint::black_box(0.5f32);
    let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(half), _mm512_set1_ps(-half));
    let mut sums = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for s in &mut sums {
            *s = _mm512_dpbf16_ps(*s, x, x);
        }
    }
    sums.iter().map(|&s| _mm512_reduce_add_ps(s)).sum()
}

/// `iters` rounds of twelve independent `vfmadd231ps`, summed at the end.
///
/// # Safety
/// The CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_sums(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let x = _mm512_set1_ps(std::hint::black_box(0.5f32));
    let mut sums = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for s in &mut sums {
            *s = _mm512_fmadd_ps(x, x, *s);
        }
    }
    sums.iter().map(|&s| _mm512_reduce_add_ps(s)).sum()
}

/// `tile (MR, NR) = a · b` over BF16 pairs: `a` a row block of `general::pack_rows` (kp pairs),
/// `b` a [`Panels::Bf16Pairs`] panel; f32 sums.
pub(super) fn kernel_bf16_pairs(a: &[u32], b: &[u16], tile: &mut [f32; MR * NR], kp: usize) {
    assert!(a.len() == kp * MR && b.len() == kp * 2 * NR);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::avx512().bf16 {
        // SAFETY: AVX512F and AVX512-BF16 are present (checked above); the slices hold
        // exactly the elements the kernel reads and writes (asserted above).
        unsafe { kernel_dpbf16(a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), kp) };
        return;
    }
    kernel_bf16_pairs_scalar(a, b, tile, kp)
}

/// [`kernel_bf16_pairs`] over two panels at once (`tiles[i]` from `b[i]`): twelve sums in
/// flight, each row's inputs broadcast once for both.
pub(super) fn kernel_bf16_pairs_x2(
    a: &[u32],
    b: [&[u16]; 2],
    tiles: &mut [[f32; MR * NR]; 2],
    kp: usize,
) {
    assert!(a.len() == kp * MR && b.iter().all(|b| b.len() == kp * 2 * NR));
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::avx512().bf16 {
        // SAFETY: AVX512F and AVX512-BF16 are present (checked above); the slices hold
        // exactly the elements the kernel reads and writes (asserted above).
        unsafe {
            kernel_dpbf16_x2(
                a.as_ptr(),
                [b[0].as_ptr(), b[1].as_ptr()],
                tiles.as_mut_ptr().cast(),
                kp,
            )
        };
        return;
    }
    let [t0, t1] = tiles;
    kernel_bf16_pairs_scalar(a, b[0], t0, kp);
    kernel_bf16_pairs_scalar(a, b[1], t1, kp);
}

/// [`kernel_bf16_pairs`] value by value, as `vdpbf16ps` sums (the odd k's product added
/// first, each addition rounded; products of two BF16 values are exact in f32): the
/// reference, which the instruction meets but for results it flushes below f32's normals.
fn kernel_bf16_pairs_scalar(a: &[u32], b: &[u16], tile: &mut [f32; MR * NR], kp: usize) {
    let widen = |bits: u32| f32::from_bits(bits << 16);
    for r in 0..MR {
        for c in 0..NR {
            let mut s = 0f32;
            for pair in 0..kp {
                let x = a[pair * MR + r];
                let w = &b[(pair * NR + c) * 2..][..2];
                s += widen(x >> 16) * widen(u32::from(w[1]));
                s += widen(x & 0xffff) * widen(u32::from(w[0]));
            }
            tile[r * NR + c] = s;
        }
    }
}

/// One 6×16 tile over BF16 pairs with `vdpbf16ps`: per pair and row, the row's two inputs
/// broadcast and dotted with each column's two weights into that column's f32 sum.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` points to `kp * MR` readable values, `b` to
/// `kp * 2 * NR`, and `tile` to `MR * NR` writable ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_dpbf16(a: *const u32, b: *const u16, tile: *mut f32, kp: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees the extents above; every offset
    // below stays inside them. A __m512i and a __m512bh are the same 64 bytes.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); MR];
        for pair in 0..kp {
            let w: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(pair * 2 * NR).cast()));
            let ap = a.add(pair * MR);
            for (r, sums) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                *sums = _mm512_dpbf16_ps(*sums, x, w);
            }
        }
        for (r, sums) in acc.iter().enumerate() {
            _mm512_storeu_ps(tile.add(r * NR), *sums);
        }
    }
}

/// [`kernel_dpbf16`] over two panels: per pair and row, the row's two inputs broadcast
/// once and dotted with both panels' columns.
///
/// # Safety
/// The CPU has AVX512F and AVX512-BF16; `a` points to `kp * MR` readable values, each of
/// `b` to `kp * 2 * NR`, and `tiles` to `2 * MR * NR` writable ones (tile 0, then tile 1).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_dpbf16_x2(a: *const u32, b: [*const u16; 2], tiles: *mut f32, kp: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees the extents above; every offset
    // below stays inside them. A __m512i and a __m512bh are the same 64 bytes.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for pair in 0..kp {
            let w0: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(b[0].add(pair * 2 * NR).cast()));
            let w1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(b[1].add(pair * 2 * NR).cast()));
            let ap = a.add(pair * MR);
            for (r, sums) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                sums[0] = _mm512_dpbf16_ps(sums[0], x, w0);
                sums[1] = _mm512_dpbf16_ps(sums[1], x, w1);
            }
        }
        for (r, sums) in acc.iter().enumerate() {
            _mm512_storeu_ps(tiles.add(r * NR), sums[0]);
            _mm512_storeu_ps(tiles.add(MR * NR + r * NR), sums[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::values;
    use super::*;

    #[test]
    fn the_dpbf16_kernel_equals_its_scalar_reference() {
        // Without AVX512-BF16 the kernel is its scalar reference: nothing to compare.
        if !super::super::TestFeature::Avx512Bf16.test_runs("the vdpbf16ps kernel") {
            return;
        }
        let kp = 37; // 74 k
        let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
        let x = values(kp * MR * 2, 13);
        let a: Vec<u32> = x
            .chunks_exact(2)
            .map(|p| bits(p[0]) | bits(p[1]) << 16)
            .collect();
        let b: Vec<u16> = values(kp * 2 * NR, 14)
            .iter()
            .map(|&v| bits(v) as u16)
            .collect();
        let (mut fast, mut reference) = ([0f32; MR * NR], [0f32; MR * NR]);
        kernel_bf16_pairs(&a, &b, &mut fast, kp);
        kernel_bf16_pairs_scalar(&a, &b, &mut reference, kp);
        let close = |fast: &[f32], reference: &[f32]| {
            for (f, r) in fast.iter().zip(reference) {
                assert!((f - r).abs() <= 1e-6 * r.abs().max(1.0), "{f} vs {r}");
            }
        };
        close(&fast, &reference);
        // Two panels at once: each tile its own panel's.
        let b2: Vec<u16> = b.iter().rev().copied().collect();
        let mut tiles = [[0f32; MR * NR]; 2];
        kernel_bf16_pairs_x2(&a, [&b, &b2], &mut tiles, kp);
        let mut reference2 = [0f32; MR * NR];
        kernel_bf16_pairs_scalar(&a, &b2, &mut reference2, kp);
        close(&tiles[0], &reference);
        close(&tiles[1], &reference2);
    }
}
