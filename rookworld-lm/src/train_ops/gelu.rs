//! GPT-2's activation on the CPU, one implementation for every path: the decode step's
//! bias + GELU, the learner's fused pass ([`forward`], [`backward`]) and the autograd op's
//! backward ([`bias_backward`]); the CUDA kernels are checked against these.
//!
//! `gelu_new(x) = ½x(1 + tanh u)`, u = √(2/π)(x + 0.044715x³), and with t = tanh u:
//! `gelu_new'(x) = ½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²)`.

use rayon::prelude::*;

use crate::simd;

/// √(2/π), GELU's tanh-approximation constant.
const GELU_C: f32 = 0.797_884_6;

/// Elements per parallel task.
const BLOCK: usize = 4096;

/// `out = gelu_new(x)`.
pub fn forward(out: &mut [f32], x: &[f32]) {
    out.par_chunks_mut(BLOCK)
        .zip(x.par_chunks(BLOCK))
        .for_each(|(o, x)| {
            o.copy_from_slice(x);
            simd::gelu_new_inplace(o);
        });
}

/// `dx = dout ⊙ gelu_new'(x)`. With `dout` `None`, `dx` holds dout and is overwritten in
/// place.
pub fn backward(dx: &mut [f32], dout: Option<&[f32]>, x: &[f32]) {
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
            .par_chunks_mut(BLOCK)
            .zip(dout.par_chunks(BLOCK).zip(x.par_chunks(BLOCK)))
            .for_each(|(dx, (g, x))| body(dx, Some(g), x)),
        None => dx
            .par_chunks_mut(BLOCK)
            .zip(x.par_chunks(BLOCK))
            .for_each(|(dx, x)| body(dx, None, x)),
    }
}

/// The gradient of `gelu_new(x + b)` with respect to its argument z = x + b:
/// `dz = dy ⊙ gelu_new'(z)`, x and dy (M, I), b (I).
pub fn bias_backward(x: &[f32], b: &[f32], dy: &[f32]) -> Vec<f32> {
    let i = b.len();
    let mut z = x.to_vec();
    z.par_chunks_mut(i)
        .for_each(|row| row.iter_mut().zip(b).for_each(|(z, b)| *z += b));
    let mut dz = vec![0f32; x.len()];
    backward(&mut dz, Some(dy), &z);
    dz
}
