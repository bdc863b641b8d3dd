//! Vectorised `exp` and GELU (tanh approximation) over f32 slices, for the CPU hot paths
//! (sampling over the vocabulary, the MLP's activation), and the dot products and weighted
//! sums of attention over a run of keys or values. AVX2/FMA when the CPU has it, plain Rust
//! otherwise; `exp` and GELU within a few ulp of libm.

/// `exp` of Cephes' single-precision polynomial: e^x = 2^n · e^r, |r| ≤ ln2/2, degree-6
/// polynomial for e^r (relative error ≈ 1e-7 over the clamped range).
const EXP_HI: f32 = 88.376_26;
const EXP_LO: f32 = -87.336_55;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const P: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// √(2/π), GELU's tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;

/// Replaces every `x` with `e^x`.
pub fn exp_inplace(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present.
        unsafe { avx2::map(xs, |v| avx2::exp(v)) };
        return;
    }
    for x in xs {
        *x = x.exp();
    }
}

/// Replaces `xs` with softmax(scale · xs): `p_j = e^(scale·x_j − m) / Σ_i e^(scale·x_i − m)`,
/// `m = max_j scale·x_j` (attention's probabilities from its raw scores, [`exp_inplace`]).
pub fn scaled_softmax_inplace(xs: &mut [f32], scale: f32) {
    let max = xs.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
    xs.iter_mut().for_each(|s| *s = *s * scale - max);
    exp_inplace(xs);
    let inv = 1.0 / xs.iter().sum::<f32>();
    xs.iter_mut().for_each(|s| *s *= inv);
}

/// Replaces every `x` with GELU(x) = x · σ(2√(2/π)(x + 0.044715x³)), which equals
/// 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))) (`gelu_new`, GPT-2's activation).
pub fn gelu_new_inplace(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present.
        unsafe { avx2::map(xs, |v| avx2::gelu_new(v)) };
        return;
    }
    for x in xs {
        let u = GELU_C * (*x + 0.044_715 * *x * *x * *x);
        *x /= 1.0 + (-2.0 * u).exp();
    }
}

/// Σ a·b over the common length (AVX2/FMA when present, else 8 independent lanes,
/// which vectorise without fast-math).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present; both slices hold n floats.
        return unsafe { avx2::dot(a, b) };
    }
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `Σ xs` in f64, eight partial sums (element i into sum i mod 8): stable over a
/// vocabulary's 50k terms, and no chain of dependent additions across them.
pub fn sum_f64(xs: &[f32]) -> f64 {
    sum_in_lanes(xs, f64::from)
}

/// `Σ x²` in f64, eight partial sums as [`sum_f64`]: a gradient's squared norm without a
/// chain of dependent f64 additions (one every four cycles) through its millions of terms.
pub fn sum_squares_f64(xs: &[f32]) -> f64 {
    sum_in_lanes(xs, |x| f64::from(x) * f64::from(x))
}

/// `Σ term(x)` over `xs` in eight f64 partial sums, element i into sum i mod 8.
#[inline]
fn sum_in_lanes(xs: &[f32], term: impl Fn(f32) -> f64) -> f64 {
    let mut partial = [0f64; 8];
    for chunk in xs.chunks(8) {
        for (p, &x) in partial.iter_mut().zip(chunk) {
            *p += term(x);
        }
    }
    partial.iter().sum()
}

/// y += a·x over the common length.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present; both slices hold at least n floats.
        unsafe { avx2::axpy(a, &x[..n], &mut y[..n]) };
        return;
    }
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `out[j] = q · keys[j·stride ..][..q.len()]` for every j < `out.len()`: one query
/// against a run of keys `stride` floats apart (a KV cache's rows of one head, or one
/// head's columns of `[q | k | v]` rows). Four keys at a time share each load of `q`
/// (AVX2/FMA), where one [`dot`] per key reloads it and sums its lanes alone.
///
/// Panics if `keys` ends before the last key does.
pub fn dots(q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
    let (d, n) = (q.len(), out.len());
    if !check_run("dots", n, d, stride, keys.len()) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present; every key lies in `keys` (asserted).
        unsafe { avx2::dots(q, keys, stride, out) };
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(q, &keys[j * stride..][..d]);
    }
}

/// `y += Σ_j p[j] · values[j·stride ..][..y.len()]`: the weights `p` of a run of values
/// `stride` floats apart, summed into `y` (attention's weighted sum of values, or a
/// query's gradient from its keys). AVX2/FMA keeps up to 64 columns of `y` in registers
/// across the run, where one [`axpy`] per value loads and stores them all.
///
/// Panics if `values` ends before the last value does.
pub fn weighted_sum(p: &[f32], values: &[f32], stride: usize, y: &mut [f32]) {
    let (d, n) = (y.len(), p.len());
    if !check_run("weighted_sum", n, d, stride, values.len()) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu_features::supported() {
        // SAFETY: AVX2 and FMA are present; every value lies in `values` (asserted).
        unsafe { avx2::weighted_sum(p, values, stride, y) };
        return;
    }
    for (j, &pj) in p.iter().enumerate() {
        axpy(pj, &values[j * stride..][..d], y);
    }
}

/// Whether a run of `n` vectors of `d` floats, `stride` apart, is non-empty; panics (naming
/// `op`) if a buffer of `len` floats ends before its last vector does.
fn check_run(op: &str, n: usize, d: usize, stride: usize, len: usize) -> bool {
    if n == 0 {
        return false;
    }
    assert!(
        len >= (n - 1) * stride + d,
        "{op}: {n} vectors of {d} floats, {stride} apart, need more than {len} floats"
    );
    true
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    /// Applies `f` to 8 lanes at a time; the tail goes through a padded vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA ([`crate::cpu_features::supported`]).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn map(xs: &mut [f32], f: impl Fn(__m256) -> __m256) {
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), f(_mm256_loadu_ps(c.as_ptr()))) };
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut buf = [0f32; 8];
            buf[..tail.len()].copy_from_slice(tail);
            // SAFETY: `buf` holds 8 floats.
            unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), f(_mm256_loadu_ps(buf.as_ptr()))) };
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }

    /// Σ a·b; the slices have one length.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and `b` is at least as long as `a` (the vector loads
    /// read `a.len()` values of each).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n floats lie in both slices (the caller's contract).
            unsafe {
                s0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    s0,
                );
                s1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    s1,
                );
            }
            i += 16;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n floats lie in both slices.
            unsafe {
                s0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    s0,
                );
            }
            i += 8;
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1)) };
        lanes.iter().sum::<f32>() + a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum::<f32>()
    }

    /// y += a·x; the slices have one length.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and `y` is at least as long as `x` (the vector loads and
    /// stores touch `x.len()` values of each).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n floats lie in both slices.
            unsafe {
                let p = y.as_mut_ptr().add(i);
                _mm256_storeu_ps(
                    p,
                    _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)),
                );
            }
            i += 8;
        }
        for (y, x) in y[i..].iter_mut().zip(&x[i..]) {
            *y += a * x;
        }
    }

    /// [`super::dots`].
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and `keys` holds `(out.len() − 1) · stride + q.len()`
    /// floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots(q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
        let (d, n) = (q.len(), out.len());
        let vec = d / 8 * 8;
        let base = keys.as_ptr();
        let mut j = 0;
        while j + 4 <= n {
            // SAFETY: keys j..j + 4 lie in `keys` (the caller's contract), each read at
            // columns below d; `q` holds d floats.
            unsafe {
                let k = [0, 1, 2, 3].map(|r| base.add((j + r) * stride));
                // Two sums per key (even and odd blocks of 8): eight chains of FMAs.
                let (mut acc, mut odd) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
                let mut i = 0;
                while i + 16 <= vec {
                    let (q0, q1) = (
                        _mm256_loadu_ps(q.as_ptr().add(i)),
                        _mm256_loadu_ps(q.as_ptr().add(i + 8)),
                    );
                    for r in 0..4 {
                        acc[r] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k[r].add(i)), acc[r]);
                        odd[r] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k[r].add(i + 8)), odd[r]);
                    }
                    i += 16;
                }
                if i < vec {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                    for r in 0..4 {
                        acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[r].add(i)), acc[r]);
                    }
                }
                for r in 0..4 {
                    acc[r] = _mm256_add_ps(acc[r], odd[r]);
                }
                // Lanes summed four keys at once: [k0, k1, k2, k3] in one register.
                let s = _mm256_hadd_ps(
                    _mm256_hadd_ps(acc[0], acc[1]),
                    _mm256_hadd_ps(acc[2], acc[3]),
                );
                let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                _mm_storeu_ps(out.as_mut_ptr().add(j), s);
                for (r, kr) in k.iter().enumerate() {
                    for (c, qc) in q.iter().enumerate().skip(vec) {
                        out[j + r] += qc * *kr.add(c);
                    }
                }
            }
            j += 4;
        }
        for (jj, o) in out.iter_mut().enumerate().skip(j) {
            // SAFETY: key jj lies in `keys`, d floats from its start.
            *o = unsafe { dot(q, std::slice::from_raw_parts(base.add(jj * stride), d)) };
        }
    }

    /// [`super::weighted_sum`]: `y` in blocks of 64, 32 and 8 columns, each block in
    /// registers across every value; the last d mod 8 columns value by value.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA, and `values` holds `(p.len() − 1) · stride + y.len()`
    /// floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum(p: &[f32], values: &[f32], stride: usize, y: &mut [f32]) {
        let d = y.len();
        let mut c = 0;
        while c + 64 <= d {
            // SAFETY: columns c..c + 64 ≤ d of every value lie in `values` and in `y` (the
            // caller's contract); likewise for the blocks below.
            unsafe { block::<8>(p, values, stride, &mut y[c..], c) };
            c += 64;
        }
        while c + 32 <= d {
            // SAFETY: as above, c + 32 ≤ d.
            unsafe { block::<4>(p, values, stride, &mut y[c..], c) };
            c += 32;
        }
        while c + 8 <= d {
            // SAFETY: as above, c + 8 ≤ d.
            unsafe { block::<1>(p, values, stride, &mut y[c..], c) };
            c += 8;
        }
        for (j, &pj) in p.iter().enumerate() {
            for (i, yi) in y.iter_mut().enumerate().skip(c) {
                *yi += pj * values[j * stride + i];
            }
        }
    }

    /// `y[..R·8] += Σ_j p[j] · values[j·stride + col ..][..R·8]`, `y`'s columns in R
    /// registers.
    ///
    /// # Safety
    /// AVX2 and FMA; `y` holds R·8 floats and every value's columns col..col + R·8 lie in
    /// `values`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const R: usize>(
        p: &[f32],
        values: &[f32],
        stride: usize,
        y: &mut [f32],
        col: usize,
    ) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(y.as_ptr().add(r * 8));
            }
            for (j, &pj) in p.iter().enumerate() {
                let w = _mm256_set1_ps(pj);
                let v = values.as_ptr().add(j * stride + col);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(r * 8)), *a);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(y.as_mut_ptr().add(r * 8), *a);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
            _mm256_set1_ps(EXP_HI),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn gelu_new(x: __m256) -> __m256 {
        let x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        let u = _mm256_mul_ps(
            _mm256_set1_ps(GELU_C),
            _mm256_fmadd_ps(_mm256_set1_ps(0.044_715), x3, x),
        );
        let e = exp(_mm256_mul_ps(_mm256_set1_ps(-2.0), u));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_match_plain_loops_at_every_length() {
        for n in [0, 1, 7, 8, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64) * (*y as f64))
                .sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "dot, n = {n}");
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6, "axpy, n = {n}");
            }
        }
    }

    #[test]
    fn sums_in_eight_lanes_match_plain_f64_sums_at_every_length() {
        for n in [0, 1, 7, 8, 9, 100, 4099] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let plain: f64 = x.iter().map(|&v| f64::from(v)).sum();
            let squares: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            // f64 rounding of n terms in another order: far below f32's.
            let close = |got: f64, want: f64| (got - want).abs() <= 1e-12 * want.abs().max(1.0);
            assert!(close(sum_f64(&x), plain), "sum, n = {n}");
            assert!(close(sum_squares_f64(&x), squares), "squares, n = {n}");
        }
    }

    /// Runs of keys and values at every head width the kernels split differently (blocks
    /// of 64, 32 and 8 columns, a scalar tail; four keys at a time and the rest), laid
    /// out `stride` apart, against f64 sums.
    #[test]
    fn dots_and_weighted_sums_match_plain_sums_for_every_width_and_run() {
        for d in [1, 5, 8, 12, 24, 40, 64, 72, 100, 131] {
            for n in [0, 1, 3, 4, 5, 9, 46] {
                let stride = 3 * d + 7;
                let len = if n == 0 { 0 } else { (n - 1) * stride + d };
                let keys: Vec<f32> = (0..len).map(|i| (i as f32 * 0.173).sin()).collect();
                let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.61).cos()).collect();
                let p: Vec<f32> = (0..n).map(|j| 0.3 + (j as f32 * 0.7).sin()).collect();
                let mut got = vec![f32::NAN; n];
                dots(&q, &keys, stride, &mut got);
                let mut y: Vec<f32> = (0..d).map(|i| i as f32 * 0.01).collect();
                let y0 = y.clone();
                weighted_sum(&p, &keys, stride, &mut y);
                for j in 0..n {
                    let want: f64 = (0..d)
                        .map(|i| q[i] as f64 * keys[j * stride + i] as f64)
                        .sum();
                    assert!(
                        (got[j] as f64 - want).abs() < 1e-5,
                        "dots d={d} n={n} j={j}"
                    );
                }
                for i in 0..d {
                    let want: f64 = y0[i] as f64
                        + (0..n)
                            .map(|j| p[j] as f64 * keys[j * stride + i] as f64)
                            .sum::<f64>();
                    assert!((y[i] as f64 - want).abs() < 1e-5, "sum d={d} n={n} i={i}");
                }
            }
        }
    }

    #[test]
    fn the_scaled_softmax_equals_its_f64_formula() {
        let xs: Vec<f32> = (0..37).map(|i| (i as f32 * 0.9).sin() * 20.0).collect();
        let mut p = xs.clone();
        scaled_softmax_inplace(&mut p, 0.125);
        let m = xs
            .iter()
            .map(|&x| x as f64 * 0.125)
            .fold(f64::MIN, f64::max);
        let z: f64 = xs.iter().map(|&x| (x as f64 * 0.125 - m).exp()).sum();
        for (&x, &got) in xs.iter().zip(&p) {
            let want = (x as f64 * 0.125 - m).exp() / z;
            assert!((got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        }
    }

    #[test]
    #[should_panic(expected = "dots")]
    fn a_run_of_keys_past_the_buffer_is_refused() {
        dots(&[1.0; 8], &[0.0; 20], 10, &mut [0.0; 3]);
    }

    #[test]
    fn exp_and_gelu_match_libm() {
        // The clamped range: e^x of f32 neither overflows nor flushes to zero.
        let xs: Vec<f32> = (-1740..1760).map(|i| i as f32 * 0.05 + 0.013).collect();
        let mut e = xs.clone();
        exp_inplace(&mut e);
        for (&x, &y) in xs.iter().zip(&e) {
            let want = (x as f64).exp();
            let rel = ((y as f64 - want) / want.max(f64::MIN_POSITIVE)).abs();
            assert!(rel < 4e-7 || want < 1e-37, "exp({x}) = {y}, want {want}");
        }
        let mut g = xs.clone();
        gelu_new_inplace(&mut g);
        for (&x, &y) in xs.iter().zip(&g) {
            let x64 = x as f64;
            let want = 0.5
                * x64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3)))
                        .tanh());
            assert!(
                (y as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
                "gelu({x}) = {y}, want {want}"
            );
        }
    }
}
