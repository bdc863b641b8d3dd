//! Layer norm on the CPU, one implementation for both training paths: the learner's fused
//! pass calls [`forward`] and [`backward`] with the statistics the forward saved; the
//! autograd op ([`super::layer_norm`], through [`super::cpu`]) recomputes them. The CUDA
//! kernels (`kernels/train_ops.cu`) are checked against these. R rows of width E, f32
//! row-major; statistics in f64 (rows are short, and they set every output's scale).
//!
//! With x̂ = (x − μ)·σ̂, σ̂ = 1/√(var + eps) (population variance) and g = dy ⊙ w:
//! - forward: `y = x̂ ⊙ w + b`;
//! - input gradient: `dx = σ̂ (g − mean(g) − x̂ · mean(g ⊙ x̂))`;
//! - parameter gradients: `dw = Σ_rows dy ⊙ x̂`, `db = Σ_rows dy`.

use std::ops::Range;

use rayon::prelude::*;

/// Rows per block of the parameter gradients' sums: each block is summed in order on one
/// thread, then the blocks' sums (the CUDA kernel's rows per block likewise).
pub const PARAM_CHUNK: usize = 32;

/// μ and σ̂ of one row.
pub fn stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
}

/// `out = x̂ ⊙ w + b` per row of x (R, E); saves μ and σ̂ per row (R).
pub fn forward(
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
            let (m, s) = stats(x, eps);
            for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                *o = (x - m) * s * w + b;
            }
            (*mu, *rs) = (m, s);
        });
}

/// `dx += σ̂ (g − mean(g) − x̂ · mean(g ⊙ x̂))` per row, g = dout ⊙ w.
pub fn backward_dx(dx: &mut [f32], dout: &[f32], x: &[f32], mean: &[f32], rstd: &[f32], w: &[f32]) {
    let e = w.len();
    dx.par_chunks_mut(e)
        .zip(dout.par_chunks(e).zip(x.par_chunks(e)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((dx, (dy, x)), (&m, &s))| {
            let (mut sum_g, mut sum_gx) = (0f32, 0f32);
            for ((&dy, &x), &w) in dy.iter().zip(x).zip(w) {
                let g = dy * w;
                sum_g += g;
                sum_gx += g * (x - m) * s;
            }
            let (mean_g, mean_gx) = (sum_g / e as f32, sum_gx / e as f32);
            for (((dx, &dy), &x), &w) in dx.iter_mut().zip(dy).zip(x).zip(w) {
                let xhat = (x - m) * s;
                *dx += s * (dy * w - mean_g - xhat * mean_gx);
            }
        });
}

/// `dw += Σ dout ⊙ x̂`, `db += Σ dout` over `rows`, in order.
fn param_rows(
    dw: &mut [f32],
    db: &mut [f32],
    dout: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    rows: Range<usize>,
) {
    let e = dw.len();
    for r in rows {
        let (m, s) = (mean[r], rstd[r]);
        let (dy, x) = (&dout[r * e..(r + 1) * e], &x[r * e..(r + 1) * e]);
        for (((gw, gb), &dy), &x) in dw.iter_mut().zip(db.iter_mut()).zip(dy).zip(x) {
            *gw += dy * (x - m) * s;
            *gb += dy;
        }
    }
}

/// The parameters' gradients as partial sums over blocks of [`PARAM_CHUNK`] rows:
/// (C, 2, E) with `[c][0]` the weight's and `[c][1]` the bias's over block c's rows.
pub fn param_partials(dout: &[f32], x: &[f32], mean: &[f32], rstd: &[f32], e: usize) -> Vec<f32> {
    let rows = mean.len();
    let mut out = vec![0f32; rows.div_ceil(PARAM_CHUNK) * 2 * e];
    out.par_chunks_mut(2 * e).enumerate().for_each(|(c, part)| {
        let (dw, db) = part.split_at_mut(e);
        let block = c * PARAM_CHUNK..((c + 1) * PARAM_CHUNK).min(rows);
        param_rows(dw, db, dout, x, mean, rstd, block);
    });
    out
}

/// The whole backward, as the fused pass runs it: `dx +=` the input gradient, and
/// `dw`, `db +=` the parameters' (the blocks' partial sums added in order).
#[allow(clippy::too_many_arguments)]
pub fn backward(
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
    backward_dx(dx, dout, x, mean, rstd, w);
    let partials = param_partials(dout, x, mean, rstd, e);
    for part in partials.chunks(2 * e) {
        let (pw, pb) = part.split_at(e);
        dw.iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        db.iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
}

/// μ and σ̂ of every row of x (R, E).
pub fn row_stats(x: &[f32], e: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    x.par_chunks(e).map(|row| stats(row, eps)).unzip()
}
