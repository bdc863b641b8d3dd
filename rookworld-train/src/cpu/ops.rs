//! Row-wise kernels of the CPU backend, each `*_forward` beside its `*_backward` (llm.c's
//! layout): matrix products, column sums and embeddings here; layer norm and GELU from
//! [`rookworld_lm::train_ops`], the implementation the autograd ops share. Everything is
//! f32, row-major; R rows of width E (or I, 3E), but for the matrix products' operands
//! under [`Matmuls::Bf16`].
//!
//! Gradients of parameters are *accumulated* (`+=`), gradients of activations are written
//! or accumulated as each function says.

use rayon::prelude::*;
use rookworld_lm::cpu_gemm;

/// How the fused pass multiplies matrices. Weights, gradients, activations and every
/// statistic stay f32 either way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Matmuls {
    /// f32 operands and sums.
    #[default]
    F32,
    /// Mixed precision: both operands of every product rounded to BF16, f32 sums
    /// (`vdpbf16ps` on a CPU with AVX512-BF16; elsewhere the rounded operands multiplied
    /// in f32, the same maths, slower than f32).
    Bf16,
}

/// `dst` (rows, cols) = [dst +] a · b in `how`'s precision: [`gemm_f32`], or
/// [`cpu_gemm::gemm_bf16`] (same operands and strides).
pub fn gemm(
    dst: &mut [f32],
    shape: (usize, usize, usize),
    accumulate: bool,
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    how: Matmuls,
) {
    match how {
        Matmuls::F32 => gemm_f32(dst, shape, accumulate, a, b),
        Matmuls::Bf16 if cpu_gemm::avx512().bf16 => {
            cpu_gemm::gemm_bf16(dst, shape, accumulate, a, b)
        }
        Matmuls::Bf16 => {
            let round = |x: &[f32]| -> Vec<f32> {
                x.par_iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect()
            };
            let (ra, rb) = (round(a.0), round(b.0));
            gemm_f32(dst, shape, accumulate, (&ra, a.1, a.2), (&rb, b.1, b.2))
        }
    }
}

/// A right operand (inner, cols) that several products share (an LM head's weight, block
/// after block of rows): packed once where the products are BF16 dot products.
pub enum Rhs<'a> {
    Plain((&'a [f32], usize, usize)),
    Packed(cpu_gemm::PackedRhs),
}

impl<'a> Rhs<'a> {
    /// `b` (inner, cols) as the right operand of products in `how`'s precision.
    pub fn new(b: (&'a [f32], usize, usize), (inner, cols): (usize, usize), how: Matmuls) -> Self {
        if how == Matmuls::Bf16 && cpu_gemm::avx512().bf16 {
            Self::Packed(cpu_gemm::PackedRhs::new(b, inner, cols))
        } else {
            Self::Plain(b)
        }
    }
}

/// [`gemm`] with a shared right operand.
pub fn gemm_rhs(
    dst: &mut [f32],
    shape: (usize, usize, usize),
    accumulate: bool,
    a: (&[f32], usize, usize),
    b: &Rhs,
    how: Matmuls,
) {
    match b {
        Rhs::Plain(b) => gemm(dst, shape, accumulate, a, *b, how),
        Rhs::Packed(b) => cpu_gemm::gemm_bf16_packed(dst, shape.0, accumulate, a, b),
    }
}

/// Rows and columns of a product per call of the `gemm` crate. It packs an operand's
/// (inner block, all rows or columns) slab into a buffer it allocates on every call. The
/// LM head's 50,257 rows of ∂W in one call would make that slab larger than glibc's 32 MiB
/// mmap threshold, and every call a fresh mapping — page faults, the kernel zeroing each
/// page, and a TLB shootdown on every core when it is unmapped (47k faults a step at
/// 4 × 8 × (46 + 64)). Tiles of 4,096 (at most 16 MiB at its 1,024-deep inner blocks) stay
/// on the heap.
const BLOCK: usize = 4096;

/// `dst` (rows, cols, row-major) = [dst +] a · b, with a (rows, inner) and b (inner, cols)
/// given as (data, row stride, column stride). Panics if a slice is too short for its
/// shape and strides (a programming error, checked before any unsafe access).
pub fn gemm_f32(
    dst: &mut [f32],
    (rows, cols, inner): (usize, usize, usize),
    accumulate: bool,
    (a, a_rs, a_cs): (&[f32], usize, usize),
    (b, b_rs, b_cs): (&[f32], usize, usize),
) {
    let span = |r: usize, c: usize, rs: usize, cs: usize| (r - 1) * rs + (c - 1) * cs + 1;
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(dst.len() >= rows * cols, "gemm dst too short");
    if inner == 0 {
        if !accumulate {
            dst[..rows * cols].fill(0.0);
        }
        return;
    }
    assert!(
        a.len() >= span(rows, inner, a_rs, a_cs),
        "gemm lhs too short"
    );
    assert!(
        b.len() >= span(inner, cols, b_rs, b_cs),
        "gemm rhs too short"
    );
    let threads = rayon::current_num_threads();
    for row in (0..rows).step_by(BLOCK) {
        let m = BLOCK.min(rows - row);
        for col in (0..cols).step_by(BLOCK) {
            let n = BLOCK.min(cols - col);
            // SAFETY: every index the kernel touches lies inside the slices (asserted
            // above: rows row..row + m and columns col..col + n of dst, a and b are within
            // their spans), and `dst` does not alias `a` or `b` (a &mut and two &
            // borrows).
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    inner,
                    dst.as_mut_ptr().add(row * cols + col),
                    1,
                    cols as isize,
                    accumulate,
                    a.as_ptr().add(row * a_rs),
                    a_cs as isize,
                    a_rs as isize,
                    b.as_ptr().add(col * b_cs),
                    b_cs as isize,
                    b_rs as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(threads),
                );
            }
        }
    }
}

/// `acc (N) += Σ_rows m (·, N)`.
pub fn column_sums(acc: &mut [f32], m: &[f32], n: usize) {
    sum_rows(acc, m.len() / n, |r, s| add_to(s, &m[r * n..(r + 1) * n]));
}

/// `acc (N) += Σ_r term(r)` over `rows` rows, where `add_term(r, s)` adds row r's term
/// to `s` (N); blocks of 64 rows are summed in parallel, then the blocks' sums.
fn sum_rows(acc: &mut [f32], rows: usize, add_term: impl Fn(usize, &mut [f32]) + Sync) {
    let n = acc.len();
    let partial = (0..rows.div_ceil(64))
        .into_par_iter()
        .map(|blk| {
            let mut s = vec![0f32; n];
            (blk * 64..((blk + 1) * 64).min(rows)).for_each(|r| add_term(r, &mut s));
            s
        })
        .reduce(
            || vec![0f32; n],
            |mut a, b| {
                add_to(&mut a, &b);
                a
            },
        );
    add_to(acc, &partial);
}

/// `a += b`, element-wise, on this thread (short rows; see [`add_assign`] for long ones).
fn add_to(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

pub use rookworld_lm::train_ops::gelu::{backward as gelu_backward, forward as gelu_forward};
pub use rookworld_lm::train_ops::layer_norm::{
    backward as layernorm_backward, forward as layernorm_forward,
};

/// `out[r] = wte[ids[r]] + wpe[pos[r]]` for every row.
pub fn embedding_forward(out: &mut [f32], ids: &[u32], pos: &[u32], wte: &[f32], wpe: &[f32]) {
    let e = out.len() / ids.len().max(1);
    out.par_chunks_mut(e)
        .zip(ids.par_iter().zip(pos.par_iter()))
        .for_each(|(o, (&id, &p))| {
            let (t, q) = (id as usize * e, p as usize * e);
            for ((o, a), b) in o.iter_mut().zip(&wte[t..t + e]).zip(&wpe[q..q + e]) {
                *o = a + b;
            }
        });
}

/// Backward of [`embedding_forward`]: `dwte[ids[r]] += dout[r]`, `dwpe[pos[r]] += dout[r]`.
pub fn embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    ids: &[u32],
    pos: &[u32],
) {
    let e = dout.len() / ids.len().max(1);
    for ((row, &id), &p) in dout.chunks_exact(e).zip(ids).zip(pos) {
        let (t, q) = (id as usize * e, p as usize * e);
        dwte[t..t + e]
            .iter_mut()
            .zip(row)
            .for_each(|(a, b)| *a += b);
        dwpe[q..q + e]
            .iter_mut()
            .zip(row)
            .for_each(|(a, b)| *a += b);
    }
}

/// `a += b`, element-wise.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    a.par_chunks_mut(8192)
        .zip(b.par_chunks(8192))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(x, y)| *x += y));
}

/// `out = a + b`, element-wise.
pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.par_chunks_mut(8192)
        .zip(a.par_chunks(8192).zip(b.par_chunks(8192)))
        .for_each(|(o, (a, b))| {
            o.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (x, y))| *o = x + y)
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A product larger than one tile each way, operands read transposed and plain,
    /// written and accumulated: every tile lands where the whole product would.
    #[test]
    fn a_product_in_tiles_equals_the_whole() {
        let (rows, cols, inner) = (BLOCK + 5, BLOCK + 3, 3);
        let value = |i: usize| ((i * 7919) % 13) as f32 - 6.0;
        let a: Vec<f32> = (0..inner * rows).map(value).collect(); // stored (inner, rows)
        let b: Vec<f32> = (0..inner * cols).map(|i| value(i + 5)).collect(); // (inner, cols)
        let mut dst = vec![1f32; rows * cols];
        // a read transposed: element (r, k) at k·rows + r.
        gemm_f32(
            &mut dst,
            (rows, cols, inner),
            true,
            (&a, 1, rows),
            (&b, cols, 1),
        );
        for (r, c) in [
            (0, 0),
            (rows - 1, cols - 1),
            (BLOCK, 7),
            (3, BLOCK + 2),
            (BLOCK + 4, BLOCK),
        ] {
            let want: f32 = 1.0
                + (0..inner)
                    .map(|k| a[k * rows + r] * b[k * cols + c])
                    .sum::<f32>();
            assert_eq!(dst[r * cols + c], want, "({r}, {c})");
        }
        let mut fresh = vec![f32::NAN; rows * cols];
        gemm_f32(
            &mut fresh,
            (rows, cols, inner),
            false,
            (&a, 1, rows),
            (&b, cols, 1),
        );
        assert!(fresh.iter().zip(&dst).all(|(f, d)| *f + 1.0 == *d));
    }
}
