//! Causal self-attention of a group whose completions share their prompt, forward and
//! backward.
//!
//! A group's prompt rows attend causally among themselves; completion g's rows attend to
//! every prompt row and causally to their own completion's rows — exactly what each row
//! would see in its own `prompt ++ completion` sequence, while the prompt is computed once.
//! Per query row (head h, scale 1/√D), with keys K, values V of the visible rows:
//!
//! ```text
//! forward   s_j = q·k_j / √D,  p = softmax(s),  y = Σ_j p_j v_j
//! backward  dp_j = dy·v_j,  ds_j = p_j (dp_j − Σ_i p_i dp_i),
//!           dq = Σ_j ds_j k_j / √D,  dk_j += ds_j q / √D,  dv_j += p_j dy
//! ```
//!
//! The prompt's dk/dv collect the contributions of all G completions. Work is split by
//! (group, head): each task owns its group's rows in its head's columns.
//!
//! Rows are (R, 3E) `[q | k | v]` with head h at columns h·D..(h+1)·D of each part.

use crate::backend::Heads;
use crate::packed::GroupRows;
use rayon::prelude::*;
use rookworld_lm::simd::{axpy, dots, scaled_softmax_inplace, weighted_sum};

/// A buffer written by many tasks at disjoint places.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: tasks write disjoint (row, column) ranges, see the callers.
unsafe impl Send for Shared {}
// SAFETY: as for Send: no two tasks touch one place at once.
unsafe impl Sync for Shared {}

impl Shared {
    /// # Safety
    /// `at..at + len` lies in the buffer and no other task touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// Splits `probs` into one chunk per (group, head), in that order.
fn per_task<'a>(probs: &'a mut [f32], groups: &[GroupRows], h: usize) -> Vec<&'a mut [f32]> {
    let mut rest = probs;
    let mut out = Vec::with_capacity(groups.len() * h);
    for g in groups {
        for _ in 0..h {
            let (chunk, tail) = rest.split_at_mut(g.probs_len());
            out.push(chunk);
            rest = tail;
        }
    }
    out
}

/// Forward: `atty` (R, E) for `qkv` (R, 3E); `probs` receives every head's
/// probabilities (Σ_groups H · probs_len).
pub fn attention_forward(
    atty: &mut [f32],
    probs: &mut [f32],
    qkv: &[f32],
    groups: &[GroupRows],
    heads: Heads,
) {
    let (e, d) = (heads.e, heads.d());
    let scale = 1.0 / (d as f32).sqrt();
    let out = Shared(atty.as_mut_ptr());
    let out_len = atty.len();
    per_task(probs, groups, heads.h)
        .into_par_iter()
        .enumerate()
        .for_each(|(task, probs)| {
            let (group, h) = (&groups[task / heads.h], task % heads.h);
            let col = |row: usize, part: usize| row * 3 * e + part * e + h * d;
            for (prefix, own, offset) in group.segments() {
                let (lp, n) = (prefix.len(), own.len());
                for i in 0..n {
                    let q = &qkv[col(own.start + i, 0)..][..d];
                    let p = &mut probs[offset + i * (lp + n)..][..lp + i + 1];
                    let (pp, po) = p.split_at_mut(lp);
                    dots(q, &qkv[col(prefix.start, 1)..], 3 * e, pp);
                    dots(q, &qkv[col(own.start, 1)..], 3 * e, po);
                    scaled_softmax_inplace(p, scale);
                    let row = own.start + i;
                    assert!(row * e + h * d + d <= out_len);
                    // SAFETY: this task alone writes head h's columns of its group's rows,
                    // and the range lies in `atty` (asserted).
                    let y = unsafe { out.slice(row * e + h * d, d) };
                    y.fill(0.0);
                    let (pp, po) = p.split_at(lp);
                    weighted_sum(pp, &qkv[col(prefix.start, 2)..], 3 * e, y);
                    weighted_sum(po, &qkv[col(own.start, 2)..], 3 * e, y);
                }
            }
        });
}

/// Backward: `dqkv` (R, 3E) is overwritten with the gradient of `qkv` given `datty`
/// (R, E) and the forward's `probs`.
pub fn attention_backward(
    dqkv: &mut [f32],
    datty: &[f32],
    qkv: &[f32],
    probs: &[f32],
    groups: &[GroupRows],
    heads: Heads,
) {
    let (e, d) = (heads.e, heads.d());
    let scale = 1.0 / (d as f32).sqrt();
    dqkv.fill(0.0);
    let grad = Shared(dqkv.as_mut_ptr());
    let grad_len = dqkv.len();
    let mut offsets = Vec::with_capacity(groups.len() * heads.h);
    let mut at = 0;
    for g in groups {
        for _ in 0..heads.h {
            offsets.push(at);
            at += g.probs_len();
        }
    }
    offsets.into_par_iter().enumerate().for_each(|(task, at)| {
        let (group, h) = (&groups[task / heads.h], task % heads.h);
        let col = |row: usize, part: usize| row * 3 * e + part * e + h * d;
        let mut dp = Vec::new();
        for (prefix, own, offset) in group.segments() {
            let (lp, n) = (prefix.len(), own.len());
            for i in 0..n {
                let qrow = own.start + i;
                let q = &qkv[col(qrow, 0)..][..d];
                let dy = &datty[qrow * e + h * d..][..d];
                let p = &probs[at + offset + i * (lp + n)..][..lp + i + 1];
                let key = |j: usize| {
                    if j < lp {
                        prefix.start + j
                    } else {
                        own.start + j - lp
                    }
                };
                dp.clear();
                dp.resize(p.len(), 0.0);
                let (dpp, dpo) = dp.split_at_mut(lp);
                dots(dy, &qkv[col(prefix.start, 2)..], 3 * e, dpp);
                dots(dy, &qkv[col(own.start, 2)..], 3 * e, dpo);
                let mean: f32 = p.iter().zip(&dp).map(|(p, g)| p * g).sum();
                // dp becomes ds: ds_j = p_j (dp_j − mean) / √D.
                dp.iter_mut()
                    .zip(p)
                    .for_each(|(g, &pj)| *g = pj * (*g - mean) * scale);
                assert!(col(qrow, 2) + d <= grad_len);
                // SAFETY: this task alone touches head h's columns of its group's rows
                // (queries, keys and values), all inside `dqkv` (asserted for the largest
                // row of the group's rows it reads, and every key row precedes it).
                let dq = unsafe { grad.slice(col(qrow, 0), d) };
                let (dsp, dso) = dp.split_at(lp);
                weighted_sum(dsp, &qkv[col(prefix.start, 1)..], 3 * e, dq);
                weighted_sum(dso, &qkv[col(own.start, 1)..], 3 * e, dq);
                for (j, (&pj, &ds)) in p.iter().zip(&dp).enumerate() {
                    let kr = key(j);
                    // SAFETY: as above.
                    axpy(ds, q, unsafe { grad.slice(col(kr, 1), d) });
                    // SAFETY: as above.
                    axpy(pj, dy, unsafe { grad.slice(col(kr, 2), d) });
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Heads;
    use crate::packed::GroupRows;
    use rookworld_lm::simd::dot;

    /// Attention of one plain causal sequence, the textbook way.
    fn reference(qkv: &[f32], rows: &[usize], e: usize, h: usize) -> Vec<Vec<f32>> {
        let d = e / h;
        let mut out = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            let mut y = vec![0f32; e];
            for hh in 0..h {
                let q = &qkv[r * 3 * e + hh * d..][..d];
                let s: Vec<f32> = rows[..=i]
                    .iter()
                    .map(|&k| dot(q, &qkv[k * 3 * e + e + hh * d..][..d]) / (d as f32).sqrt())
                    .collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter().map(|s| (s - m).exp()).sum();
                for (j, &k) in rows[..=i].iter().enumerate() {
                    let p = (s[j] - m).exp() / z;
                    for t in 0..d {
                        y[hh * d + t] += p * qkv[k * 3 * e + 2 * e + hh * d + t];
                    }
                }
            }
            out.push(y);
        }
        out
    }

    #[test]
    fn shared_prompt_rows_see_what_a_full_sequence_sees() {
        let (e, h) = (8, 2);
        let group = GroupRows {
            prompt: 0..3,
            completions: vec![3..5, 5..5, 5..9],
        };
        let r = 9;
        let qkv: Vec<f32> = (0..r * 3 * e)
            .map(|i| ((i as f32 * 0.37).sin() * 1.7).fract())
            .collect();
        let mut atty = vec![0f32; r * e];
        let mut probs = vec![0f32; h * group.probs_len()];
        attention_forward(
            &mut atty,
            &mut probs,
            &qkv,
            std::slice::from_ref(&group),
            Heads { e, h },
        );
        for c in &group.completions {
            let rows: Vec<usize> = group.prompt.clone().chain(c.clone()).collect();
            let want = reference(&qkv, &rows, e, h);
            for (i, &row) in rows.iter().enumerate() {
                for t in 0..e {
                    let got = atty[row * e + t];
                    assert!((got - want[i][t]).abs() < 1e-5, "row {row}");
                }
            }
        }
    }
}
