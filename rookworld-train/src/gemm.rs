//! Matrix products as cuBLAS takes them, mapped once from the row-major maths.
//!
//! The pass thinks in row-major matrices: activations (R, E), Hugging Face Conv1D weights
//! (K, N), the head (V, E), sometimes through a transpose. cuBLAS thinks in column-major
//! ones. A row-major (r × c) matrix with row stride s is, read column-major, its
//! transpose: a (c × r) matrix with leading dimension s. So the row-major product
//!
//! ```text
//! C (rows × cols) = A (rows × inner) · B (inner × cols)
//! ```
//!
//! is, column-major, `Cᵀ = Bᵀ · Aᵀ`: cuBLAS's m = cols, n = rows, k = inner, its first
//! operand our B and its second our A, each transposed exactly when ours is a transposed
//! view of what is stored ([`row_major`]). The CPU backend executes the resulting [`Gemm`]
//! as written ([`Gemm::strided`]), so the CPU tests check the mapping a GPU backend hands
//! to cuBLAS unchanged.

use crate::backend::error::{Error, Result};

/// One operand of a column-major product: where its stored matrix starts in its buffer,
/// the stored matrix's leading dimension, and whether the product reads its transpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    pub offset: usize,
    pub ld: usize,
    pub trans: bool,
}

/// `C (m × n) = op(A) (m × k) · op(B) (k × n)`, plus C when `accumulate`; every matrix
/// column-major (A and B are cuBLAS's: A is the pass's right operand, B its left), element (i, j) of a stored matrix with leading dimension `ld` at
/// `offset + i + j·ld`: cuBLAS's `gemm` with α = 1 and β = `accumulate as f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub c_offset: usize,
    pub ldc: usize,
    pub accumulate: bool,
}

/// A row-major operand of the pass: rows at `stride` apart from `offset`; `transposed`
/// when the operand is the transpose of the matrix stored there (an (r × c) operand over
/// a stored (c × r) matrix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowMajor {
    pub offset: usize,
    pub stride: usize,
    pub transposed: bool,
}

impl RowMajor {
    /// A stored row-major matrix with `stride` elements a row, from the buffer's start.
    pub fn plain(stride: usize) -> Self {
        Self {
            offset: 0,
            stride,
            transposed: false,
        }
    }

    /// The transpose of a stored row-major matrix with `stride` elements a row.
    pub fn transposed(stride: usize) -> Self {
        Self {
            offset: 0,
            stride,
            transposed: true,
        }
    }

    /// The same operand starting `offset` elements into its buffer.
    pub fn at(self, offset: usize) -> Self {
        Self { offset, ..self }
    }
}

/// The column-major call computing the row-major `C (rows × cols) [+]= A (rows × inner) ·
/// B (inner × cols)`, C stored contiguously from `c_offset`: `Cᵀ = Bᵀ · Aᵀ` (see the
/// module's text).
pub fn row_major(
    (rows, cols, inner): (usize, usize, usize),
    a: RowMajor,
    b: RowMajor,
    c_offset: usize,
    accumulate: bool,
) -> Gemm {
    let operand = |x: RowMajor| Operand {
        offset: x.offset,
        ld: x.stride,
        trans: x.transposed,
    };
    Gemm {
        m: cols,
        n: rows,
        k: inner,
        a: operand(b),
        b: operand(a),
        c_offset,
        ldc: cols,
        accumulate,
    }
}

impl Gemm {
    /// The same call with C's rows (the row-major result's) `ldc` elements apart: a
    /// result written into rows wider than it (the head's logits, [`crate::launch::head_ld`]).
    pub fn with_ldc(self, ldc: usize) -> Self {
        Self { ldc, ..self }
    }

    /// Checks what cuBLAS requires (each leading dimension at least its stored matrix's
    /// row count) and that every element the call touches lies in its buffer.
    pub fn check(&self, a_len: usize, b_len: usize, c_len: usize) -> Result<()> {
        let fits = |name: &str, o: &Operand, (rows, cols): (usize, usize), len: usize| {
            // The stored matrix: op(X) = X, or Xᵀ stored.
            let (sr, sc) = if o.trans { (cols, rows) } else { (rows, cols) };
            if o.ld < sr.max(1) {
                return Err(Error::Shape(format!(
                    "gemm {self:?}: {name}'s leading dimension {} < its {sr} rows",
                    o.ld
                )));
            }
            let end = if sr == 0 || sc == 0 {
                o.offset
            } else {
                o.offset + (sc - 1) * o.ld + sr
            };
            if end > len {
                return Err(Error::Shape(format!(
                    "gemm {self:?}: {name} reaches element {end} of a buffer of {len}"
                )));
            }
            Ok(())
        };
        fits("A", &self.a, (self.m, self.k), a_len)?;
        fits("B", &self.b, (self.k, self.n), b_len)?;
        let c = Operand {
            offset: self.c_offset,
            ld: self.ldc,
            trans: false,
        };
        fits("C", &c, (self.m, self.n), c_len)
    }

    /// The call as a row-major product with strides, the form of the CPU's kernels:
    /// `Cᵀ (n × m, row stride ldc) = op(B)ᵀ (n × k) · op(A)ᵀ (k × m)`, each operand as
    /// (offset, row stride, column stride).
    pub fn strided(&self) -> Strided {
        // op(X)ᵀ's element (r, c) is X's stored element at r·ld + c (X not transposed) or
        // at c·ld + r (transposed): a stored column-major X is a row-major Xᵀ.
        let t = |o: &Operand| {
            if o.trans {
                (o.offset, 1, o.ld)
            } else {
                (o.offset, o.ld, 1)
            }
        };
        Strided {
            shape: (self.n, self.m, self.k),
            lhs: t(&self.b),
            rhs: t(&self.a),
            dst: (self.c_offset, self.ldc),
        }
    }
}

/// What a product does to its result on the way out, as cuBLASLt's epilogues do it inside
/// the product ([`crate::backend::Epilogue`] holds the buffers; these are their kinds). In
/// the row-major terms of [`row_major`], cuBLAS's m is the result's columns and its A the
/// pass's right operand, so a bias of m elements is added to every row of the result, and
/// the bias gradient adds up the right operand's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EpilogueKind {
    /// `C = op(A)·op(B) + bias`: cuBLASLt's `BIAS`.
    Bias,
    /// `pre = op(A)·op(B) + bias`, `C = gelu_new(pre)`: `GELU_AUX_BIAS`, `pre` its
    /// auxiliary output.
    BiasGelu,
    /// `C = (op(A)·op(B)) ⊙ gelu_new'(pre)`: `DGELU`, `pre` its auxiliary input.
    Dgelu,
    /// `C [+]= op(A)·op(B)` and `db (m) += Σ_l A(i, l)`, A's rows summed over the product's
    /// inner dimension: `BGRADA` (which writes the sum; the device adds it into `db`).
    BiasGrad,
}

impl EpilogueKind {
    /// Its name in profiles and errors.
    pub fn name(self) -> &'static str {
        match self {
            EpilogueKind::Bias => "bias",
            EpilogueKind::BiasGelu => "bias+gelu",
            EpilogueKind::Dgelu => "dgelu",
            EpilogueKind::BiasGrad => "bias grad",
        }
    }
}

/// Where cuBLASLt reads a vector or matrix the epilogue uses: its `AUX_LD` must be a
/// multiple of 8 elements, and its vectors and auxiliary matrices start 16-byte aligned
/// (offset 0 of an allocation, which CUDA aligns to 256 bytes).
pub const EPILOGUE_AUX_LD_MULTIPLE: usize = 8;

impl Gemm {
    /// Checks what `kind` asks of the call on top of [`Gemm::check`], with the lengths of
    /// its buffers (`a`, `c`, the epilogue's vector — the bias or `db` — and `pre`, 0 where
    /// the kind has none): the result dense from the start of C (the composed form's
    /// kernels run over the whole buffer, and cuBLASLt's auxiliary matrix shares C's
    /// layout), not accumulated where the epilogue replaces C; the vector m long, `pre` as
    /// long as C; for the bias gradient, A the whole of its buffer, stored (m × k)
    /// untransposed.
    pub fn check_epilogue(
        &self,
        kind: EpilogueKind,
        (a_len, c_len): (usize, usize),
        (vector_len, pre_len): (usize, usize),
    ) -> Result<()> {
        let refuse = |why: String| {
            Err(Error::Shape(format!(
                "gemm {self:?} with epilogue {}: {why}",
                kind.name()
            )))
        };
        let dense = self.c_offset == 0 && self.ldc == self.m && c_len == self.m * self.n;
        let (vector, pre) = match kind {
            EpilogueKind::Bias => (self.m, 0),
            EpilogueKind::BiasGelu => (self.m, c_len),
            EpilogueKind::Dgelu => (0, c_len),
            EpilogueKind::BiasGrad => (self.m, 0),
        };
        if kind == EpilogueKind::BiasGrad {
            let whole = self.a.offset == 0 && !self.a.trans && self.a.ld == self.m;
            if !whole || a_len != self.m * self.k {
                return refuse(format!(
                    "A must be the whole of its buffer ({a_len}), stored {} × {} untransposed",
                    self.m, self.k
                ));
            }
        } else {
            if self.accumulate {
                return refuse("the epilogue writes C; it cannot add into it".into());
            }
            if !dense {
                return refuse(format!(
                    "C must be the dense {} × {} result from its buffer's start (a buffer of {c_len})",
                    self.m, self.n
                ));
            }
        }
        if vector_len != vector {
            return refuse(format!(
                "its vector holds {vector_len} elements, not {vector}"
            ));
        }
        if pre_len != pre {
            return refuse(format!(
                "its pre-activation holds {pre_len} elements, not {pre}"
            ));
        }
        Ok(())
    }

    /// Whether cuBLASLt's epilogue `kind` can serve the call as [`Gemm::check_epilogue`]
    /// passed it: the auxiliary matrix's leading dimension (C's) a multiple of
    /// [`EPILOGUE_AUX_LD_MULTIPLE`]. Where not, a device runs the composed form.
    pub fn lt_serves(&self, kind: EpilogueKind) -> bool {
        let aux = matches!(kind, EpilogueKind::BiasGelu | EpilogueKind::Dgelu);
        !aux || self.ldc.is_multiple_of(EPILOGUE_AUX_LD_MULTIPLE)
    }
}

/// A [`Gemm`] as a row-major strided product: `dst (rows × cols) = lhs (rows × inner) ·
/// rhs (inner × cols)`, `shape` = (rows, cols, inner), operands as (offset, row stride,
/// column stride), `dst` as (offset, row stride).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strided {
    pub shape: (usize, usize, usize),
    pub lhs: (usize, usize, usize),
    pub rhs: (usize, usize, usize),
    pub dst: (usize, usize),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// cuBLAS's definition, element by element: C(i, j) [+]= Σ_l op(A)(i, l) op(B)(l, j),
    /// with `a` and `b` the buffers of cuBLAS's A and B.
    fn column_major(g: &Gemm, c: &mut [f32], a: &[f32], b: &[f32]) {
        let at = |o: &Operand, x: &[f32], i: usize, j: usize| {
            if o.trans {
                x[o.offset + j + i * o.ld]
            } else {
                x[o.offset + i + j * o.ld]
            }
        };
        for i in 0..g.m {
            for j in 0..g.n {
                let s: f32 = (0..g.k)
                    .map(|l| at(&g.a, a, i, l) * at(&g.b, b, l, j))
                    .sum();
                let dst = &mut c[g.c_offset + i + j * g.ldc];
                *dst = if g.accumulate { *dst + s } else { s };
            }
        }
    }

    /// The row-major maths: element (i, j) of an operand through its view.
    fn row_major_at(x: &[f32], v: RowMajor, i: usize, j: usize) -> f32 {
        if v.transposed {
            x[v.offset + j * v.stride + i]
        } else {
            x[v.offset + i * v.stride + j]
        }
    }

    fn values(len: usize, salt: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2654435761).wrapping_add(salt) >> 16) % 17) as f32 - 8.0)
            .collect()
    }

    proptest! {
        /// The mapped call computes the row-major product, whatever the transposes,
        /// offsets and padding (of the operands' rows, and of the result's with
        /// `with_ldc`, whose padding stays as it was), and passes cuBLAS's checks; its
        /// strided form (what the CPU runs) is the same product.
        #[test]
        fn the_mapped_call_is_the_row_major_product(
            rows in 1usize..7, cols in 1usize..7, inner in 1usize..7,
            ta: bool, tb: bool, pad in 0usize..3, off in 0usize..5, acc: bool,
            c_pad in 0usize..3,
        ) {
            let view = |r: usize, c: usize, t: bool| {
                let stored_cols = if t { r } else { c };
                RowMajor { offset: off, stride: stored_cols + pad, transposed: t }
            };
            let (va, vb) = (view(rows, inner, ta), view(inner, cols, tb));
            let len = |r: usize, c: usize, v: RowMajor| off + v.stride * if v.transposed { c } else { r };
            let a = values(len(rows, inner, va), 1);
            let b = values(len(inner, cols, vb), 2);
            let ldc = cols + c_pad;
            let c0 = values(off + rows * ldc, 3);
            let g = row_major((rows, cols, inner), va, vb, off, acc).with_ldc(ldc);
            g.check(b.len(), a.len(), c0.len()).unwrap();

            let mut want = c0.clone();
            for i in 0..rows {
                for j in 0..cols {
                    let s: f32 = (0..inner)
                        .map(|l| row_major_at(&a, va, i, l) * row_major_at(&b, vb, l, j))
                        .sum();
                    let d = &mut want[off + i * ldc + j];
                    *d = if acc { *d + s } else { s };
                }
            }
            // cuBLAS's A is our B, its B our A.
            let mut got = c0.clone();
            column_major(&g, &mut got, &b, &a);
            prop_assert_eq!(&got, &want);

            let s = g.strided();
            let (r, c, k) = s.shape;
            let mut strided = c0.clone();
            for i in 0..r {
                for j in 0..c {
                    let v: f32 = (0..k)
                        .map(|l| a[s.lhs.0 + i * s.lhs.1 + l * s.lhs.2] * b[s.rhs.0 + l * s.rhs.1 + j * s.rhs.2])
                        .sum();
                    let d = &mut strided[s.dst.0 + i * s.dst.1 + j];
                    *d = if acc { *d + v } else { v };
                }
            }
            prop_assert_eq!(&strided, &want);
        }
    }

    #[test]
    fn an_epilogue_is_refused_where_its_buffers_or_the_result_do_not_fit_it() {
        use EpilogueKind::*;
        // A linear layer of 5 rows, 4 in, 8 out: the forward (m = 8, n = 5, k = 4) and
        // the weight's gradient (m = 8, n = 4, k = 5).
        let fwd = row_major((5, 8, 4), RowMajor::plain(4), RowMajor::plain(8), 0, false);
        let wgrad = row_major(
            (4, 8, 5),
            RowMajor::transposed(4),
            RowMajor::plain(8),
            0,
            true,
        );
        fwd.check_epilogue(Bias, (32, 40), (8, 0)).unwrap();
        fwd.check_epilogue(BiasGelu, (32, 40), (8, 40)).unwrap();
        fwd.check_epilogue(Dgelu, (32, 40), (0, 40)).unwrap();
        wgrad.check_epilogue(BiasGrad, (40, 32), (8, 0)).unwrap();
        let refused = |g: Gemm, kind, lens, extra, why: &str| {
            let e = g.check_epilogue(kind, lens, extra).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(kind.name()), "{e}");
        };
        refused(
            fwd,
            Bias,
            (32, 40),
            (5, 0),
            "vector holds 5 elements, not 8",
        );
        refused(fwd, BiasGelu, (32, 40), (8, 39), "pre-activation holds 39");
        refused(fwd, Bias, (32, 48), (8, 0), "dense 8 × 5 result");
        refused(fwd.with_ldc(9), Bias, (32, 45), (8, 0), "dense");
        let added = Gemm {
            accumulate: true,
            ..fwd
        };
        refused(added, Bias, (32, 40), (8, 0), "cannot add into it");
        // The bias gradient sums the whole of A, stored untransposed.
        refused(wgrad, BiasGrad, (48, 32), (8, 0), "whole of its buffer");
        let dgrad = row_major(
            (5, 4, 8),
            RowMajor::plain(8),
            RowMajor::transposed(8),
            0,
            false,
        );
        refused(
            dgrad,
            BiasGrad,
            (32, 20),
            (4, 0),
            "stored 4 × 8 untransposed",
        );
        // cuBLASLt's auxiliary matrix wants a leading dimension of a multiple of 8; the
        // bias alone does not.
        let odd = row_major(
            (5, 12, 4),
            RowMajor::plain(4),
            RowMajor::plain(12),
            0,
            false,
        );
        assert!(odd.lt_serves(Bias) && odd.lt_serves(BiasGrad));
        assert!(!odd.lt_serves(BiasGelu) && !odd.lt_serves(Dgelu));
        assert!(fwd.lt_serves(BiasGelu) && fwd.lt_serves(Dgelu));
    }

    #[test]
    fn a_call_cublas_would_refuse_or_one_past_its_buffer_is_an_error() {
        let g = row_major((4, 3, 2), RowMajor::plain(2), RowMajor::plain(3), 0, false);
        // cuBLAS's A is our B (6 elements), its B our A (8).
        g.check(6, 8, 12).unwrap();
        let short = g.check(6, 8, 11).unwrap_err().to_string();
        assert!(
            short.contains("C reaches element 12 of a buffer of 11"),
            "{short}"
        );
        let mut narrow = g;
        narrow.a.ld = 2; // A stores (3 × 2): ld must be ≥ 3
        let e = narrow.check(6, 8, 12).unwrap_err().to_string();
        assert!(e.contains("A's leading dimension 2 < its 3 rows"), "{e}");
    }
}
