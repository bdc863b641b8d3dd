//! Row-wise kernels of the fused training pass, each `*_forward` beside its `*_backward`
//! (llm.c's layout): matrix products with bias, layer norm, GELU (tanh approximation),
//! embeddings. Everything is f32, row-major; R rows of width E (or I, 3E).
//!
//! Gradients of parameters are *accumulated* (`+=`), gradients of activations are written
//! or accumulated as each function says.

use rayon::prelude::*;
use rookworld_lm::simd;

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
    // SAFETY: every index the kernel touches lies inside the slices (asserted above), and
    // `dst` does not alias `a` or `b` (a &mut and two & borrows).
    unsafe {
        gemm::gemm(
            rows,
            cols,
            inner,
            dst.as_mut_ptr(),
            1,
            cols as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
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

/// `out (R, N) = x (R, K) · w (K, N) + b (N)`: Hugging Face's Conv1D.
pub fn matmul_forward(out: &mut [f32], x: &[f32], w: &[f32], b: &[f32], r: usize, k: usize) {
    let n = b.len();
    for row in out[..r * n].chunks_exact_mut(n) {
        row.copy_from_slice(b);
    }
    gemm_f32(out, (r, n, k), true, (x, k, 1), (w, n, 1));
}

/// Backward of [`matmul_forward`]: `dx (R, K) [+]= dout · wᵀ`, `dw (K, N) += xᵀ · dout`,
/// `db (N) += Σ_rows dout`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dx: &mut [f32],
    accumulate_dx: bool,
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    (r, k, n): (usize, usize, usize),
) {
    // wᵀ (N, K): element (j, i) is w[i·N + j].
    gemm_f32(dx, (r, k, n), accumulate_dx, (dout, n, 1), (w, 1, n));
    // xᵀ (K, R): element (i, t) is x[t·K + i].
    gemm_f32(dw, (k, n, r), true, (x, 1, k), (dout, n, 1));
    column_sums(db, dout, n);
}

/// `acc (N) += Σ_rows m (·, N)`.
fn column_sums(acc: &mut [f32], m: &[f32], n: usize) {
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

/// Layer norm of each row of `x` (R, E): `out = (x − μ)·σ̂ · w + b` with
/// `σ̂ = 1/sqrt(var + eps)` (population variance); saves μ and σ̂ per row.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
) {
    let e = w.len();
    out.par_chunks_mut(e)
        .zip(x.par_chunks(e))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|((o, x), (mu, rs))| {
            // Statistics in f64: the rows are short, and they set every output's scale.
            let m64 = x.iter().map(|&v| f64::from(v)).sum::<f64>() / e as f64;
            let var = x.iter().map(|&v| (f64::from(v) - m64).powi(2)).sum::<f64>() / e as f64;
            let (m, s) = (m64 as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32);
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                *o = (x - m) * s * w + b;
            }
            (*mu, *rs) = (m, s);
        });
}

/// Backward of [`layernorm_forward`]: with n̂ = (x − μ)σ̂ and dn̂ = dout·w,
/// `dx += σ̂ (dn̂ − mean(dn̂) − n̂ · mean(dn̂ n̂))`, `dw += Σ dout·n̂`, `db += Σ dout`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    w: &[f32],
) {
    let e = w.len();
    dx.par_chunks_mut(e)
        .zip(dout.par_chunks(e).zip(x.par_chunks(e)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((dx, (dy, x)), (&m, &s))| {
            let (mut sum_dn, mut sum_dn_n) = (0f32, 0f32);
            for ((&dy, &x), &w) in dy.iter().zip(x).zip(w) {
                let dn = dy * w;
                sum_dn += dn;
                sum_dn_n += dn * (x - m) * s;
            }
            let (mean_dn, mean_dn_n) = (sum_dn / e as f32, sum_dn_n / e as f32);
            for (((dx, &dy), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                let n = (x - m) * s;
                *dx += s * (dy * w - mean_dn - n * mean_dn_n);
            }
        });
    let row = |r: usize| r * e..(r + 1) * e;
    sum_rows(dw, mean.len(), |r, gw| {
        let (m, s) = (mean[r], rstd[r]);
        for ((gw, &dy), &x) in gw.iter_mut().zip(&dout[row(r)]).zip(&x[row(r)]) {
            *gw += dy * (x - m) * s;
        }
    });
    column_sums(db, dout, e);
}

/// √(2/π), GELU's tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;

/// `out = gelu_new(x)`, GPT-2's activation `0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
pub fn gelu_forward(out: &mut [f32], x: &[f32]) {
    out.par_chunks_mut(4096)
        .zip(x.par_chunks(4096))
        .for_each(|(o, x)| {
            o.copy_from_slice(x);
            simd::gelu_new_inplace(o);
        });
}

/// `dx = dout · gelu_new'(x)`, with u = √(2/π)(x + 0.044715x³) and t = tanh u:
/// `gelu' = ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²)`. `dx` may hold `dout`
/// (it is overwritten in place when the two are the same buffer: pass `None`).
pub fn gelu_backward(dx: &mut [f32], dout: Option<&[f32]>, x: &[f32]) {
    let body = |dx: &mut [f32], dout: Option<&[f32]>, x: &[f32]| {
        let mut e = [0f32; 256];
        for (i, (dx, x)) in dx.chunks_mut(256).zip(x.chunks(256)).enumerate() {
            let e = &mut e[..x.len()];
            for (e, &x) in e.iter_mut().zip(x) {
                *e = -2.0 * GELU_C * (x + 0.044_715 * x * x * x);
            }
            simd::exp_inplace(e); // e^{−2u}
            for (j, (d, (&x, &e))) in dx.iter_mut().zip(x.iter().zip(e.iter())).enumerate() {
                let t = 2.0 / (1.0 + e) - 1.0; // tanh u
                let local =
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 0.134_145 * x * x);
                let g = dout.map_or(*d, |g| g[i * 256 + j]);
                *d = g * local;
            }
        }
    };
    match dout {
        Some(dout) => dx
            .par_chunks_mut(4096)
            .zip(dout.par_chunks(4096).zip(x.par_chunks(4096)))
            .for_each(|(dx, (g, x))| body(dx, Some(g), x)),
        None => dx
            .par_chunks_mut(4096)
            .zip(x.par_chunks(4096))
            .for_each(|(dx, x)| body(dx, None, x)),
    }
}

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
