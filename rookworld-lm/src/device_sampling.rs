//! Sampling a decode step's tokens where its logits are: on CUDA one kernel draws every
//! row's token and log-probability (`kernels/sample.cu`), so only those cross to the host
//! instead of the (B, V) logits. The uniform of each draw still comes from the row's
//! seeded ChaCha stream on the host ([`Sampler::draw`](crate::sampling::Sampler::draw)),
//! so same seed, weights and device give the same completions.
//!
//! [`sample_reference`] is the kernel's algorithm on the CPU, step for step, which the
//! kernel is tested against on a GPU. Its semantics are the CPU sampler's
//! ([`crate::sampling`]) with two differences of detail: top-k keeps every token tied
//! with the k-th largest logit, and kept tokens are walked in index order, not in
//! probability order, when the draw is inverted (the same distribution).

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::kernels::{Kernel, Kernels};
use crate::sampling::{RowDraw, Sampled, not_finite};

/// Whether [`sample_rows`] runs on `device`: CUDA, in a build with the `cuda` feature,
/// where the device's `sample_rows` kernel is on (`kernels`, its verdict). Elsewhere the
/// caller samples on the host ([`crate::sampling::Sampler::sample`]).
pub fn supported(device: &Device, kernels: &Kernels) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && kernels.enabled(Kernel::Sampling)
}

/// Each row's token and log-probability drawn on the logits' device from (B, V) logits,
/// row r with `draws[r]`; an error where [`supported`] is false.
pub fn sample_rows(logits: &Tensor, draws: &[RowDraw]) -> Result<Vec<Sampled>> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return crate::cuda::sample_rows(logits, draws);
    }
    let _ = draws;
    Err(Error::InvalidArgument(format!(
        "no sampling kernel runs on {:?}: sample on the host",
        logits.device()
    )))
}

/// Order-preserving map of a float to an unsigned key (−∞ lowest among non-NaN values).
fn key_of(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// NaN logits never win: they count as −∞.
fn sanitize(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x }
}

/// The largest key τ with `holds(τ)`, for `holds` true at 0 and monotone (true up to some
/// key, false above): bisection on the key's bits from the highest.
fn largest_key(holds: impl Fn(u32) -> bool) -> u32 {
    (0..32).rev().fold(0u32, |lo, bit| {
        let cand = lo | (1 << bit);
        if holds(cand) { cand } else { lo }
    })
}

/// The device kernel's draw on the CPU. With x the row's logits and m = max x:
/// greedy (T = 0) gives the first argmax c and `x_c − log Σ exp(x_i)`; otherwise
/// w_i = exp((x_i − m)/T) over the kept tokens K = {i : x_i ≥ τ}, where τ is the k-th
/// largest logit for top-k, raised for top-p to the largest logit whose kept mass
/// reaches p of top-k's; the token is the first i ∈ K with Σ_{j ≤ i, j∈K} w_j > u Σ_K w,
/// its log-probability (x_c − m)/T − log Σ_K w.
pub fn sample_reference(logits: &[f32], draw: &RowDraw) -> Result<Sampled> {
    let (mut m, mut best) = (f32::NEG_INFINITY, 0usize);
    for (i, &x) in logits.iter().enumerate() {
        if sanitize(x) > m {
            (m, best) = (sanitize(x), i);
        }
    }
    if !m.is_finite() {
        return Err(not_finite());
    }
    // Greedy at T = 0 and wherever 1/T overflows, as `SamplingParams::is_greedy`.
    if !(1.0 / draw.temperature).is_finite() {
        let sum: f64 = logits
            .iter()
            .map(|&x| (f64::from(sanitize(x)) - f64::from(m)).exp())
            .sum();
        return Ok(Sampled {
            token: best as u32,
            logprob: (f64::from(m) - (f64::from(m) + sum.ln())) as f32,
        });
    }
    let inv_t = 1.0 / draw.temperature;
    let weight = |x: f32| ((sanitize(x) - m) * inv_t).exp();
    let keys: Vec<u32> = logits.iter().map(|&x| key_of(sanitize(x))).collect();
    let mass = |floor: u32| -> f64 {
        logits
            .iter()
            .zip(&keys)
            .filter(|(_, k)| **k >= floor)
            .map(|(&x, _)| f64::from(weight(x)))
            .sum()
    };

    let k = draw.top_k as usize;
    let mut tau = if k > 0 && k < logits.len() {
        largest_key(|cand| keys.iter().filter(|&&key| key >= cand).count() >= k)
    } else {
        0
    };
    if draw.top_p < 1.0 {
        let target = f64::from(draw.top_p) * mass(tau);
        tau = tau.max(largest_key(|cand| mass(cand.max(tau)) >= target));
    }

    let total = mass(tau);
    let target = draw.uniform * total;
    let mut cumulative = 0.0;
    let mut chosen = None;
    let mut last_kept = best; // m is finite, so the argmax has w = 1
    for (i, &x) in logits.iter().enumerate() {
        if keys[i] < tau {
            continue;
        }
        let w = weight(x);
        if w > 0.0 {
            last_kept = i;
        }
        cumulative += f64::from(w);
        if chosen.is_none() && target < cumulative {
            chosen = Some(i);
        }
    }
    let c = chosen.unwrap_or(last_kept);
    Ok(Sampled {
        token: c as u32,
        logprob: (f64::from((sanitize(logits[c]) - m) * inv_t) - total.ln()) as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{Sampler, SamplingParams, greedy};

    fn row(seed: u64, v: usize) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..v).map(|_| rng.random_range(-8.0f32..8.0)).collect()
    }

    fn draw(temperature: f32, top_k: u32, top_p: f32, uniform: f64) -> RowDraw {
        RowDraw {
            temperature,
            top_k,
            top_p,
            uniform,
        }
    }

    #[test]
    fn keys_keep_the_order_of_floats() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(key_of(w[0]) <= key_of(w[1]), "{} vs {}", w[0], w[1]);
        }
        assert!(key_of(-3.5) < key_of(-1e-30));
    }

    #[test]
    fn greedy_is_the_cpu_samplers_greedy() {
        for seed in 0..20 {
            let mut x = row(seed, 500);
            x[7] = f32::NAN;
            x[300] = x[200].max(9.0);
            x[200] = x[300]; // a tie: the first maximum wins
            let want = greedy(&x).unwrap();
            let got = sample_reference(&x, &draw(0.0, 0, 1.0, 0.0)).unwrap();
            assert_eq!(got.token, want.token);
            assert!((got.logprob - want.logprob).abs() < 1e-6);
        }
    }

    #[test]
    fn full_vocabulary_draws_match_the_cpu_sampler_on_the_same_stream() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
        };
        let (mut cpu, mut dev) = (Sampler::new(params, 5, 9), Sampler::new(params, 5, 9));
        for step in 0..200 {
            let x = row(step, 2000);
            let want = cpu.sample(&x).unwrap();
            let got = sample_reference(&x, &dev.draw()).unwrap();
            assert_eq!(got.token, want.token, "step {step}");
            assert!((got.logprob - want.logprob).abs() < 1e-4, "step {step}");
        }
    }

    #[test]
    fn top_k_and_top_p_keep_what_the_cpu_sampler_keeps() {
        let x = row(3, 1000);
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
        for (k, p) in [(5u32, 1.0f32), (0, 0.3), (40, 0.5), (1, 1.0)] {
            let params = SamplingParams {
                temperature: 1.3,
                top_k: k as usize,
                top_p: p,
            };
            let mut cpu = Sampler::new(params, 1, 2);
            let cpu_set: std::collections::BTreeSet<u32> =
                (0..3000).map(|_| cpu.sample(&x).unwrap().token).collect();
            let drawn: std::collections::BTreeMap<u32, f32> = (0..3000)
                .map(|i| {
                    let u = (i as f64 + 0.5) / 3000.0;
                    let s = sample_reference(&x, &draw(1.3, k, p, u)).unwrap();
                    (s.token, s.logprob)
                })
                .collect();
            let dev_set: std::collections::BTreeSet<u32> = drawn.keys().copied().collect();
            assert_eq!(dev_set, cpu_set, "top-k {k}, top-p {p}");
            // Log-probabilities renormalised over the kept set.
            let total: f64 = drawn.values().map(|&lp| f64::from(lp).exp()).sum();
            assert!((total - 1.0).abs() < 1e-4, "kept mass {total}");
        }
    }

    #[test]
    fn the_draw_inverts_the_kept_distribution_in_index_order() {
        let x = [0.0f32, 1.0, f32::NAN, 2.0];
        let w: Vec<f64> = [0.0f64, 1.0, 2.0].iter().map(|v| (v - 2.0).exp()).collect();
        let total: f64 = w.iter().sum();
        let first = w[0] / total;
        let second = (w[0] + w[1]) / total;
        let token = |u| sample_reference(&x, &draw(1.0, 0, 1.0, u)).unwrap().token;
        assert_eq!(token(0.0), 0);
        assert_eq!(token(first - 1e-6), 0);
        assert_eq!(token(first + 1e-6), 1);
        assert_eq!(token(second + 1e-6), 3); // the NaN logit is never drawn
        assert_eq!(token(0.999_999_999), 3);
        assert!(sample_reference(&[f32::NAN; 3], &draw(1.0, 0, 1.0, 0.5)).is_err());
    }

    #[test]
    fn top_k_keeps_every_token_tied_with_the_kth() {
        let x = [3.0f32, 1.0, 3.0, 2.0, 3.0];
        let kept: std::collections::BTreeSet<u32> = (0..100)
            .map(|i| {
                let u = (i as f64 + 0.5) / 100.0;
                sample_reference(&x, &draw(1.0, 2, 1.0, u)).unwrap().token
            })
            .collect();
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![0, 2, 4]);
    }

    #[test]
    fn the_cpu_has_no_sampling_kernel() {
        assert!(!supported(&Device::Cpu, &Kernels::every()));
        let logits = Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
        let draws = [draw(1.0, 0, 1.0, 0.5); 2];
        assert!(sample_rows(&logits, &draws).is_err());
    }
}
