//! f32 `y = x W + b` for CPU inference, with `W` packed once into column panels.
//!
//! Decode steps multiply a few dozen rows by every weight matrix: M is small, so a
//! general GEMM spends much of its time re-packing the weights on every call. Here each
//! weight is packed once, at load, into panels of [`NR`] columns stored k-major
//! (`panel[k][0..NR]`), so a step streams each weight exactly once, sequentially. An
//! AVX2/FMA micro-kernel keeps an `MR × NR` tile of the output in registers; threads
//! (rayon) split the panels. Machines without AVX2 and FMA keep candle's matmul.
//!
//! Letters: M rows of `x`, K inputs, N outputs.

use rayon::prelude::*;

use crate::simd;

mod pack;
use pack::fill_panels;

/// Output columns per panel: two 8-lane AVX registers.
pub const NR: usize = 16;
/// Rows per register tile (12 accumulators + 2 weight vectors + 1 broadcast ≤ 16 YMM).
const MR: usize = 6;

/// What is applied to each output after the bias, while it is still in cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    None,
    /// GPT-2's `gelu_new` ([`simd::gelu_new_inplace`]).
    GeluNew,
}

/// A weight matrix (K, N) packed into ⌈N / NR⌉ panels of (K, NR), zero-padded.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    k: usize,
    n: usize,
    panels: Vec<f32>,       // (⌈N/NR⌉, K, NR)
    bias: Option<Vec<f32>>, // (N)
    epilogue: Epilogue,
}

/// Whether this CPU runs the packed kernel.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl PackedMatrix {
    /// Packs `w`: (K, N) row-major, or (N, K) row-major when `transposed` (a `Linear`
    /// weight or the tied embedding used as the LM head).
    pub fn pack(w: &[f32], k: usize, n: usize, transposed: bool, bias: Option<Vec<f32>>) -> Self {
        assert_eq!(w.len(), k * n, "weight of {k}×{n}");
        let mut panels = vec![0f32; n.div_ceil(NR) * k * NR];
        fill_panels(&mut panels, w, k, n, transposed);
        Self {
            k,
            n,
            panels,
            bias,
            epilogue: Epilogue::None,
        }
    }

    /// Packs new values `w` of the same shape into this matrix's own panels (memory
    /// already faulted in: no allocation), and `bias` into its bias. Returns false,
    /// changing nothing, when the shape or the presence of a bias differs.
    pub fn repack(&mut self, w: &[f32], transposed: bool, bias: Option<&[f32]>) -> bool {
        let same_bias = match (&self.bias, bias) {
            (Some(old), Some(new)) => old.len() == new.len(),
            (None, None) => true,
            _ => false,
        };
        if w.len() != self.k * self.n || !same_bias {
            return false;
        }
        fill_panels(&mut self.panels, w, self.k, self.n, transposed);
        if let (Some(old), Some(new)) = (self.bias.as_mut(), bias) {
            old.copy_from_slice(new);
        }
        true
    }

    /// Applies `epilogue` to every output from now on.
    pub fn with_epilogue(mut self, epilogue: Epilogue) -> Self {
        self.epilogue = epilogue;
        self
    }

    /// Applies `epilogue` to every output from now on.
    pub fn set_epilogue(&mut self, epilogue: Epilogue) {
        self.epilogue = epilogue;
    }

    pub fn epilogue(&self) -> Epilogue {
        self.epilogue
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// `x` (M, K) row-major → (M, N) row-major, bias (and epilogue) applied.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let (k, n) = (self.k, self.n);
        assert_eq!(x.len(), m * k, "input of {m}×{k}");
        let blocks = m.div_ceil(MR);
        // x packed by row block, k-major: a[block][k][r], zero rows past M.
        let mut a = vec![0f32; blocks * k * MR];
        for (row, xs) in x.chunks_exact(k).enumerate() {
            let (b, r) = (row / MR, row % MR);
            let dst = &mut a[b * k * MR..(b + 1) * k * MR];
            for (kk, &v) in xs.iter().enumerate() {
                dst[kk * MR + r] = v;
            }
        }
        let mut out = vec![0f32; m * n];
        let target = SharedOut(out.as_mut_ptr());
        let (bias, epilogue) = (self.bias.as_deref(), self.epilogue);
        self.panels
            .par_chunks(k * NR)
            .enumerate()
            .for_each(|(p, panel)| {
                let cols = NR.min(n - p * NR);
                let mut tile = [0f32; MR * NR];
                for blk in 0..blocks {
                    kernel(&a[blk * k * MR..(blk + 1) * k * MR], panel, &mut tile, k);
                    if let Some(bias) = bias {
                        for row in tile.chunks_exact_mut(NR) {
                            for (v, b) in row[..cols].iter_mut().zip(&bias[p * NR..]) {
                                *v += b;
                            }
                        }
                    }
                    if epilogue == Epilogue::GeluNew {
                        simd::gelu_new_inplace(&mut tile);
                    }
                    let rows = MR.min(m - blk * MR);
                    for (r, src) in tile.chunks_exact(NR).take(rows).enumerate() {
                        let offset = (blk * MR + r) * n + p * NR;
                        // SAFETY: panel p owns columns p·NR..p·NR+cols of every row, so no two
                        // threads write the same element, and offset + cols ≤ m·n.
                        unsafe { target.write(offset, &src[..cols]) };
                    }
                }
            });
        out
    }
}

/// The output buffer, written by many threads at disjoint places.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: threads write disjoint column ranges (one panel each), see `matmul`.
unsafe impl Send for SharedOut {}
// SAFETY: as for Send: no two threads write one place, and none reads while they write.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `offset..offset + src.len()` lies in the buffer and no other thread writes it.
    unsafe fn write(self, offset: usize, src: &[f32]) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(offset), src.len()) };
    }
}

/// `tile (MR, NR) = a (k, MR)ᵀ · b (k, NR)`.
fn kernel(a: &[f32], b: &[f32], tile: &mut [f32; MR * NR], k: usize) {
    assert!(a.len() == k * MR && b.len() == k * NR);
    #[cfg(target_arch = "x86_64")]
    if supported_cached() {
        // SAFETY: AVX2 and FMA are present (checked above); the slices hold exactly the
        // elements the kernel reads and writes (asserted above).
        unsafe { kernel_avx2(a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), k) };
        return;
    }
    for r in 0..MR {
        for j in 0..NR {
            let mut s = 0.0;
            for kk in 0..k {
                s += a[kk * MR + r] * b[kk * NR + j];
            }
            tile[r * NR + j] = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn supported_cached() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(supported)
}

/// One 6×16 tile of a product: `tile[r·NR + j] = Σ_kk a[kk·MR + r] · b[kk·NR + j]`, over a
/// packed panel of the input (`a`) and one of the weight (`b`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k * MR` readable values, `b` to `k * NR`, and
/// `tile` to `MR * NR` writable ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2(a: *const f32, b: *const f32, tile: *mut f32, k: usize) {
    use std::arch::x86_64::*;
    // SAFETY: (the whole body) the caller guarantees `a` holds k·MR, `b` k·NR and `tile`
    // MR·NR floats; every offset below stays inside those bounds.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for kk in 0..k {
            let b0 = _mm256_loadu_ps(b.add(kk * NR));
            let b1 = _mm256_loadu_ps(b.add(kk * NR + 8));
            let ak = a.add(kk * MR);
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*ak.add(r));
                row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                row[1] = _mm256_fmadd_ps(x, b1, row[1]);
            }
        }
        for (r, row) in acc.iter().enumerate() {
            _mm256_storeu_ps(tile.add(r * NR), row[0]);
            _mm256_storeu_ps(tile.add(r * NR + 8), row[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, bias: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = bias[j] as f64;
                for kk in 0..k {
                    s += x[i * k + kk] as f64 * w[kk * n + j] as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn packed_matmul_matches_a_naive_product_for_awkward_shapes() {
        for (m, k, n) in [(1, 7, 3), (5, 300, 33), (13, 513, 16), (32, 64, 50)] {
            let (x, w, bias) = (values(m * k, 1), values(k * n, 2), values(n, 3));
            let want = naive(&x, &w, m, k, n, &bias);
            let got = PackedMatrix::pack(&w, k, n, false, Some(bias.clone())).matmul(&x, m);
            let d = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-3, "{m}×{k}×{n}: max |Δ| = {d}");
            // The same weight given transposed (N, K).
            let mut wt = vec![0f32; k * n];
            for kk in 0..k {
                for j in 0..n {
                    wt[j * k + kk] = w[kk * n + j];
                }
            }
            let got_t = PackedMatrix::pack(&wt, k, n, true, Some(bias)).matmul(&x, m);
            assert_eq!(got, got_t);
        }
    }

    #[test]
    fn a_repacked_matrix_computes_what_a_fresh_pack_of_the_new_values_does() {
        let (m, k, n) = (7, 300, 33); // a padded last panel
        let x = values(m * k, 9);
        for transposed in [false, true] {
            let mut packed =
                PackedMatrix::pack(&values(k * n, 4), k, n, transposed, Some(values(n, 5)))
                    .with_epilogue(Epilogue::GeluNew);
            let (w, bias) = (values(k * n, 6), values(n, 7));
            assert!(packed.repack(&w, transposed, Some(&bias)));
            let fresh = PackedMatrix::pack(&w, k, n, transposed, Some(bias.clone()))
                .with_epilogue(Epilogue::GeluNew);
            assert_eq!(
                packed.matmul(&x, m),
                fresh.matmul(&x, m),
                "transposed: {transposed}"
            );
            // Another shape, or a bias where there was none, is refused and changes nothing.
            assert!(!packed.repack(&w[1..], transposed, Some(&bias)));
            assert!(!packed.repack(&w, transposed, None));
            assert_eq!(packed.matmul(&x, m), fresh.matmul(&x, m));
        }
    }
}
