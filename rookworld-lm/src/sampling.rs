//! Token sampling: greedy, temperature, top-k, top-p, each row with its own seeded stream.
//!
//! The reported log-probability of a sampled token is taken under the distribution it was
//! drawn from: `log softmax(logits / T)` renormalised over the tokens top-k and top-p
//! kept. With top-k and top-p off that is the plain temperature-scaled log-softmax the
//! learner recomputes; greedy reports the plain `log softmax(logits)`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// One row's draw for the device ([`crate::device_sampling`]): its sampling parameters
/// and, unless greedy, the uniform in [0, 1) its seeded stream gives this draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDraw {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: u32,
    /// 1 disables.
    pub top_p: f32,
    pub uniform: f64,
}

/// How tokens are drawn from the model's logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches p; 1 disables.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Greedy at 0 and at any temperature so small that 1/T overflows (below about
    /// 3e-39): there the scaled logits are ±inf or NaN and no draw is defined, so the CPU
    /// sampler and the device kernel both take the argmax.
    pub fn is_greedy(&self) -> bool {
        !(1.0 / self.temperature).is_finite()
    }

    /// Rejects a negative or non-finite temperature and a top-p outside (0, 1]
    /// ([`check_temperature`], [`check_top_p`]), naming the fields.
    pub fn validate(&self) -> Result<()> {
        check_temperature("temperature", self.temperature.into())
            .and_then(|()| check_top_p("top-p", self.top_p.into()))
            .map_err(Error::InvalidArgument)
    }
}

/// The temperature rule of every command and call that samples: a finite number ≥ 0,
/// where 0 means greedy (argmax). `name` is the flag or field named in the refusal.
pub fn check_temperature(name: &str, v: f64) -> std::result::Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} must be ≥ 0, 0 meaning greedy (got {v})"))
    }
}

/// The top-p rule of every command and call that samples: in (0, 1], where 1 keeps every
/// token (off).
pub fn check_top_p(name: &str, v: f64) -> std::result::Result<(), String> {
    if v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(format!(
            "{name} must lie in (0, 1], 1 meaning off (got {v})"
        ))
    }
}

/// A sampled token and its log-probability under the sampling distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

/// Samples one sequence's tokens from its own ChaCha8 stream, so a row's draws never
/// depend on which other rows share its batch.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch: the row's unnormalised probabilities (plain temperature sampling).
    weights: Vec<f32>,
    /// Scratch for [`Self::sample_full`]: each run of the weights' sum.
    run_sums: Vec<f64>,
}

impl Sampler {
    /// Stream `stream` of `seed`: e.g. `(prompt_index << 32) | sample_index`.
    pub fn new(params: SamplingParams, seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self {
            params,
            rng,
            weights: Vec::new(),
            run_sums: Vec::new(),
        }
    }

    /// Draws the next token from one row of logits (V).
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled> {
        if self.params.is_greedy() {
            return greedy(logits);
        }
        if self.params.top_k == 0 && self.params.top_p >= 1.0 {
            return self.sample_full(logits);
        }
        let inv_t = 1.0 / self.params.temperature as f64;
        let scaled = |i: usize| sanitize(logits[i]) * inv_t;

        // Candidate set after top-k, most likely first when truncation needs the order.
        let mut kept: Vec<usize> = (0..logits.len()).collect();
        let by_logit_desc = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]);
        let k = self.params.top_k;
        if k > 0 && k < kept.len() {
            kept.select_nth_unstable_by(k - 1, by_logit_desc);
            kept.truncate(k);
        }
        if self.params.top_p < 1.0 {
            kept.sort_unstable_by(by_logit_desc);
            let lse = log_sum_exp(kept.iter().map(|&i| scaled(i)));
            let mut cumulative = 0.0;
            let mut keep = kept.len();
            for (n, &i) in kept.iter().enumerate() {
                cumulative += (scaled(i) - lse).exp();
                if cumulative >= self.params.top_p as f64 {
                    keep = n + 1;
                    break;
                }
            }
            kept.truncate(keep);
        }

        let lse = log_sum_exp(kept.iter().map(|&i| scaled(i)));
        if !lse.is_finite() {
            return Err(not_finite());
        }
        let u: f64 = self.rng.random();
        let mut cumulative = 0.0;
        let mut chosen = *kept.last().expect("at least one candidate");
        for &i in &kept {
            cumulative += (scaled(i) - lse).exp();
            if u < cumulative {
                chosen = i;
                break;
            }
        }
        Ok(Sampled {
            token: chosen as u32,
            logprob: (scaled(chosen) - lse) as f32,
        })
    }
}

impl Sampler {
    /// Where the row's stream stands: [`Self::rewind`] to it takes back the draws since.
    pub fn position(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Puts the stream back at `position`: the next draws repeat those made after it.
    pub fn rewind(&mut self, position: u128) {
        self.rng.set_word_pos(position);
    }

    /// What the device needs to draw this row's next token instead of [`Self::sample`]
    /// (see [`crate::device_sampling`]): the parameters and, unless greedy, the uniform
    /// this stream gives the next draw, taken from the stream as `sample` would take it.
    pub fn draw(&mut self) -> RowDraw {
        let greedy = self.params.is_greedy();
        RowDraw {
            // The kernel's greedy branch is `temperature == 0`.
            temperature: if greedy { 0.0 } else { self.params.temperature },
            top_k: u32::try_from(self.params.top_k).unwrap_or(u32::MAX),
            top_p: self.params.top_p,
            uniform: if greedy { 0.0 } else { self.rng.random() },
        }
    }

    /// Temperature sampling over the whole vocabulary (GRPO's default), in one vectorised
    /// pass: w_i = exp((l_i − max) / T), token i drawn with probability w_i / Σw, and
    /// logprob = (l_i − max) / T − ln Σw. The same draw as the general path.
    ///
    /// No step waits on the one before it across the vocabulary: the maximum runs in 16
    /// lanes, Σw is summed in f64 a [`RUN`] of weights at a time
    /// ([`crate::simd::sum_f64`]), and the draw finds its run by the runs' sums before
    /// walking that run's weights alone — a chain of 50,257 dependent additions per row,
    /// twice, was a tenth of a decode step.
    fn sample_full(&mut self, logits: &[f32]) -> Result<Sampled> {
        let inv_t = 1.0 / self.params.temperature;
        let max = largest(logits);
        if !max.is_finite() {
            return Err(not_finite());
        }
        self.weights.clear();
        self.weights.extend(logits.iter().map(|&v| {
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                (v - max) * inv_t
            }
        }));
        crate::simd::exp_inplace(&mut self.weights);
        self.run_sums.clear();
        self.run_sums
            .extend(self.weights.chunks(RUN).map(crate::simd::sum_f64));
        let total: f64 = self.run_sums.iter().sum();
        let target = self.rng.random::<f64>() * total;
        let chosen = pick(&self.weights, &self.run_sums, target).unwrap_or(logits.len() - 1);
        Ok(Sampled {
            token: chosen as u32,
            logprob: (((logits[chosen] - max) * inv_t) as f64 - total.ln()) as f32,
        })
    }
}

/// Weights summed per run by [`Sampler::sample_full`].
const RUN: usize = 512;

/// The largest of `xs` that is not NaN (−∞ when none is), in 16 independent lanes.
fn largest(xs: &[f32]) -> f32 {
    let above = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = xs.chunks_exact(16);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = above(*m, v);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| above(m, v));
    lanes.into_iter().fold(tail, above)
}

/// The first index whose cumulative weight passes `target`: the run whose sum takes the
/// running total past it (`run_sums[r]` is the sum of `weights`' run r), then the weight
/// inside it that does; if rounding leaves the walk short at the run's end, that run's
/// last nonzero weight. `None` when no run passes it (`target` ≥ the total).
fn pick(weights: &[f32], run_sums: &[f64], target: f64) -> Option<usize> {
    let mut before = 0.0;
    for (r, &sum) in run_sums.iter().enumerate() {
        if target < before + sum {
            let run = &weights[r * RUN..(r * RUN + RUN).min(weights.len())];
            let mut cumulative = before;
            for (i, &w) in run.iter().enumerate() {
                cumulative += w as f64;
                if target < cumulative {
                    return Some(r * RUN + i);
                }
            }
            return run.iter().rposition(|&w| w > 0.0).map(|i| r * RUN + i);
        }
        before += sum;
    }
    None
}

/// Argmax (the first maximum, as `torch.argmax`) and its plain log-softmax.
pub fn greedy(logits: &[f32]) -> Result<Sampled> {
    let (best, _) = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if sanitize(v) > bv as f64 {
                (i, v)
            } else {
                (bi, bv)
            }
        });
    let lse = log_sum_exp(logits.iter().map(|&v| sanitize(v)));
    if !lse.is_finite() {
        return Err(not_finite());
    }
    Ok(Sampled {
        token: best as u32,
        logprob: (sanitize(logits[best]) - lse) as f32,
    })
}

/// `log Σ exp(x)`, stable; −∞ for an empty or all −∞ input.
pub fn log_sum_exp(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = xs.clone().fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return max;
    }
    max + xs.map(|x| (x - max).exp()).sum::<f64>().ln()
}

/// NaN logits never win: they count as −∞.
fn sanitize(v: f32) -> f64 {
    if v.is_nan() {
        f64::NEG_INFINITY
    } else {
        v as f64
    }
}

pub(crate) fn not_finite() -> Error {
    Error::InvalidArgument("the model produced no finite logits".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum_with_its_log_softmax() {
        let s = greedy(&[1.0, 3.0, 3.0, -2.0]).unwrap();
        assert_eq!(s.token, 1);
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp()).ln();
        assert!((s.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn a_temperature_whose_inverse_overflows_is_greedy_on_the_host_and_the_device() {
        let logits = [0.5f32, 2.0, -1.0, 1.5];
        let want = greedy(&logits).unwrap();
        for t in [0.0f32, 1e-45, 2e-39] {
            for (k, p) in [(0, 1.0), (2, 0.9)] {
                let mut s = Sampler::new(params(t, k, p), 7, 0);
                assert_eq!(s.sample(&logits).unwrap(), want, "T = {t}");
                let draw = s.draw();
                assert_eq!(draw.temperature, 0.0, "the kernel's greedy branch, T = {t}");
                let device = crate::device_sampling::sample_reference(&logits, &draw).unwrap();
                assert_eq!(device, want, "T = {t}");
            }
        }
        // The smallest temperatures with a finite inverse still sample.
        assert!(!params(1e-30, 0, 1.0).is_greedy());
    }

    #[test]
    fn same_seed_and_stream_reproduce_and_streams_differ() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |stream| {
            let mut s = Sampler::new(params(1.0, 0, 1.0), 42, stream);
            (0..50)
                .map(|_| s.sample(&logits).unwrap().token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn top_k_and_top_p_restrict_and_renormalise() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let mut s = Sampler::new(params(1.0, 2, 1.0), 0, 0);
        for _ in 0..200 {
            let d = s.sample(&logits).unwrap();
            assert!(d.token >= 2);
            let lse = (2f64.exp() + 3f64.exp()).ln();
            assert!((d.logprob as f64 - (logits[d.token as usize] as f64 - lse)).abs() < 1e-6);
        }
        // p(3) ≈ 0.64 < 0.7, so top-p 0.7 keeps tokens 3 and 2.
        let mut s = Sampler::new(params(1.0, 0, 0.7), 0, 0);
        let seen: std::collections::BTreeSet<u32> =
            (0..500).map(|_| s.sample(&logits).unwrap().token).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![2, 3]);
    }

    #[test]
    fn the_run_wise_draw_finds_the_weight_a_plain_cumulative_walk_finds() {
        // A vocabulary's worth of weights spanning 40 orders of magnitude, zeros among them.
        let weights: Vec<f32> = (0..50_257u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761) >> 8;
                if h % 7 == 0 {
                    0.0
                } else {
                    (-((h % 9_000) as f32) / 100.0).exp()
                }
            })
            .collect();
        let run_sums: Vec<f64> = weights.chunks(RUN).map(crate::simd::sum_f64).collect();
        let plain: f64 = weights.iter().map(|&w| w as f64).sum();
        let total: f64 = run_sums.iter().sum();
        assert!((total - plain).abs() <= plain * 1e-12);
        // The middle of each sizeable weight's interval: where no rounding decides.
        let mut before = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            if w as f64 > plain * 1e-9 {
                assert_eq!(pick(&weights, &run_sums, before + w as f64 / 2.0), Some(i));
            }
            before += w as f64;
        }
        assert_eq!(
            pick(&weights, &run_sums, 0.0),
            weights.iter().position(|&w| w > 0.0)
        );
        assert_eq!(pick(&weights, &run_sums, total * 2.0), None);
        // The maximum skips NaNs as the plain fold does, at every remainder length.
        for n in [1, 15, 16, 17, 33, 50_257] {
            let mut xs: Vec<f32> = weights[..n].iter().map(|w| w.ln()).collect();
            xs[n / 2] = f32::NAN;
            let fold = xs
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
            assert_eq!(largest(&xs).to_bits(), fold.to_bits(), "{n}");
        }
    }

    #[test]
    fn empirical_frequencies_follow_the_temperature_scaled_softmax() {
        let logits = [0.0f32, 1.0];
        let mut s = Sampler::new(params(2.0, 0, 1.0), 9, 0);
        let n = 20_000;
        let ones = (0..n)
            .filter(|_| s.sample(&logits).unwrap().token == 1)
            .count();
        let p1 = 1.0 / (1.0 + (-0.5f64).exp());
        assert!((ones as f64 / n as f64 - p1).abs() < 0.015, "{ones}");
    }

    #[test]
    fn bad_parameters_and_nan_logits_are_errors() {
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(f32::NAN, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.5).validate().is_err());
        assert!(greedy(&[f32::NAN, f32::NAN]).is_err());
    }
}
