//! Each CUDA kernel against its CPU reference on random inputs, on a real GPU: what
//! `rollout-worker parity` reports and `tests/gpu-check.sh` shows, and the start-up check
//! of the families that are on. Each family's check is followed by a synchronisation of
//! the device, so that an asynchronous CUDA error is attributed to the family whose work
//! raised it.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::{AttentionKernel, DeviceGeometry, grouped_attention_with, sample_rows};
use crate::cpu_attention::{Geometry, decode_attention};
use crate::decode_ops::{AddLayerNorm, BiasGelu, QkvSplit};
use crate::device_sampling::sample_reference;
use crate::error::Result;
use crate::kernels::{
    ContextLost, DriverFault, Family, Finding, Kernel, Kernels, after_synchronize, judge,
};
use crate::sampling::RowDraw;

/// Largest errors of the kernels against their references, and whether they pass.
#[derive(Debug, Clone, Serialize)]
pub struct KernelCheck {
    /// Grouped attention, f32 buffers: max |device − reference|.
    pub attention_f32_max_abs_error: f64,
    /// Grouped attention, bf16 buffers, against the reference on the same bf16 values.
    pub attention_bf16_max_abs_error: f64,
    /// The split attention kernel (the trial `grouped_attention_split`), the same
    /// comparisons.
    pub attention_split_f32_max_abs_error: f64,
    pub attention_split_bf16_max_abs_error: f64,
    /// Sampled rows, and how many drew the reference's token.
    pub sampling_rows: usize,
    pub sampling_tokens_equal: usize,
    /// Max |device − reference| of the reported log-probabilities.
    pub sampling_max_logprob_error: f64,
    /// The fused decode ops (q/k/v split, bias + GELU, residual + layer norm) against
    /// their CPU implementations on the same values: max |device − CPU| in f32 and bf16.
    pub ops_f32_max_abs_error: f64,
    pub ops_bf16_max_abs_error: f64,
    /// The training ops (layer norm, bias + GELU, masked softmax, target log-probs), each
    /// forward and backward through candle's autograd on the device and on the CPU, and
    /// three AdamW steps (the two in-place passes, and the multi-tensor step with its
    /// bfloat16 copies and the gradients' sum of squares): the largest |device − CPU| of
    /// an output, gradient, parameter, moment or sum over that tensor's largest |CPU|.
    pub train_ops_max_rel_error: f64,
    /// The training ops on zero rows (forward and backward, and AdamW on nothing): `ok`,
    /// or the error. They return empty results without a launch.
    pub empty_rows: String,
    /// Random bytes uploaded into a bfloat16 and an f32 tensor through page-locked memory
    /// (the trial `weights_in_place`), at an odd offset and length: values read back that
    /// differ (0 to pass).
    pub upload_mismatched: f64,
    /// The decode step captured as CUDA graphs (the trial `decode_graphs`) against the same
    /// steps launched one op at a time, on a small random model: the largest |Δ| of a
    /// logit over the largest |logit|, with f32 and with bfloat16 weights; and with f32
    /// weights, the rows that drew the same greedy token.
    pub decode_graph_f32_max_rel_error: f64,
    pub decode_graph_bf16_max_rel_error: f64,
    pub decode_graph_rows: usize,
    pub decode_graph_tokens_equal: usize,
    pub passed: bool,
}

pub use crate::kernels::CHECKED_FAMILIES;

/// Runs every kernel on `device` against its CPU reference (every family of
/// [`CHECKED_FAMILIES`], on or off: `rollout-worker parity` reports each one's figures).
/// Each check is followed by a synchronisation, as at start-up, and a fault that poisons
/// the context ends the process in one line naming the family that caused it
/// ([`crate::kernels::end_process`]; [`check_families`] returns it instead).
pub fn self_check(device: &Device) -> Result<KernelCheck> {
    let reference = Kernels::chosen(&Default::default());
    let (check, errors) = check_families(device, &CHECKED_FAMILIES, &reference)
        .unwrap_or_else(|lost| crate::kernels::end_process(&lost));
    match errors.into_iter().next() {
        Some(f) => Err(crate::Error::InvalidArgument(format!(
            "the {} kernel check did not run: {}",
            f.kernel.name(),
            f.problem
        ))),
        None => Ok(check),
    }
}

/// Each family of `families` run once against its reference on `device`, loading its PTX
/// module, and the device synchronised after it. Returns what failed to run or disagreed
/// beyond its tolerance, for [`crate::kernels::Switches::apply`]; or the lost context,
/// naming the family whose check poisoned it.
pub fn startup_findings(
    device: &Device,
    families: &[Kernel],
    reference: &Kernels,
) -> std::result::Result<Vec<Finding>, ContextLost> {
    let (check, mut findings) = check_families(device, families, reference)?;
    let judged: Vec<Finding> = check
        .findings()
        .into_iter()
        .filter(|f| families.contains(&f.kernel) && !findings.iter().any(|e| e.kernel == f.kernel))
        .collect();
    findings.extend(judged);
    Ok(findings)
}

/// Each family of `families` checked in [`CHECKED_FAMILIES`]' order, each followed by a
/// synchronisation of the device ([`settle`]): a family failing to run (NaN figures and
/// a finding) leaves the others to run; a fault that poisons the context ends the checks
/// with the family that caused it. The figures of families not checked are NaN (and no
/// rows). Each family draws its inputs from its own seed, so they do not depend on which
/// others ran.
pub fn check_families(
    device: &Device,
    families: &[Kernel],
    reference: &Kernels,
) -> std::result::Result<(KernelCheck, Vec<Finding>), ContextLost> {
    let mut check = KernelCheck::unchecked();
    let mut errors = Vec::new();
    // Whatever the device ran before is not blamed on the first family.
    settle(device, None::<Kernel>)?;
    for (seed, family) in (0u64..).zip(CHECKED_FAMILIES) {
        if !families.contains(&family) {
            continue;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(0x5eed + seed);
        let ran = check.run(family, (device, reference), &mut rng);
        let settled = settle(device, Some(family))?;
        match ran {
            Err(e) => errors.push(Finding {
                kernel: family,
                problem: format!("did not run: {e}"),
            }),
            Ok(()) => errors.extend(settled),
        }
    }
    check.passed = check.findings().is_empty();
    Ok((check, errors))
}

/// Waits for everything the device has been given (on every stream of its context: the
/// captured step runs on one of its own) and judges what the wait reports, for the work
/// of `family` ([`crate::kernels::after_synchronize`]): a finding, or the lost context.
/// Off CUDA, nothing to wait for.
pub fn settle<F: Family>(
    device: &Device,
    family: Option<F>,
) -> std::result::Result<Option<Finding<F>>, ContextLost> {
    let Device::Cuda(cuda) = device else {
        return Ok(None);
    };
    let fault = cuda
        .cuda_stream()
        .context()
        .synchronize()
        .err()
        .map(|e| DriverFault {
            code: e.0 as u32,
            message: format!(
                "{:?}: {}",
                e.0,
                e.error_string()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            ),
        });
    after_synchronize(&crate::device::name(device), family, fault)
}

impl KernelCheck {
    /// No family checked yet: NaN figures, no rows.
    fn unchecked() -> Self {
        Self {
            attention_f32_max_abs_error: f64::NAN,
            attention_bf16_max_abs_error: f64::NAN,
            attention_split_f32_max_abs_error: f64::NAN,
            attention_split_bf16_max_abs_error: f64::NAN,
            sampling_rows: 0,
            sampling_tokens_equal: 0,
            sampling_max_logprob_error: f64::NAN,
            ops_f32_max_abs_error: f64::NAN,
            ops_bf16_max_abs_error: f64::NAN,
            train_ops_max_rel_error: f64::NAN,
            empty_rows: "not checked".into(),
            upload_mismatched: f64::NAN,
            decode_graph_f32_max_rel_error: f64::NAN,
            decode_graph_bf16_max_rel_error: f64::NAN,
            decode_graph_rows: 0,
            decode_graph_tokens_equal: 0,
            passed: false,
        }
    }

    /// Runs `family`'s check on `device` and records its figures; an error leaves them as
    /// they were (NaN).
    fn run(
        &mut self,
        family: Kernel,
        (device, reference): (&Device, &Kernels),
        rng: &mut ChaCha8Rng,
    ) -> Result<()> {
        match family {
            Kernel::Attention => {
                (
                    self.attention_f32_max_abs_error,
                    self.attention_bf16_max_abs_error,
                ) = check_attention(device, rng, AttentionKernel::Warp)?;
            }
            Kernel::SplitAttention => {
                (
                    self.attention_split_f32_max_abs_error,
                    self.attention_split_bf16_max_abs_error,
                ) = check_attention(device, rng, AttentionKernel::Split)?;
            }
            Kernel::Sampling => {
                (
                    self.sampling_rows,
                    self.sampling_tokens_equal,
                    self.sampling_max_logprob_error,
                ) = check_sampling(device, rng)?;
            }
            Kernel::DecodeOps => {
                let f32_error = check_ops(device, DType::F32, rng)?;
                self.ops_bf16_max_abs_error = check_ops(device, DType::BF16, rng)?;
                self.ops_f32_max_abs_error = f32_error;
            }
            Kernel::TrainOps => {
                self.empty_rows = match crate::train_ops::check_empty_rows(device) {
                    Ok(()) => "ok".into(),
                    Err(e) => e.to_string(),
                };
                self.train_ops_max_rel_error = check_train_ops(device, rng)?;
            }
            Kernel::WeightsInPlace => self.upload_mismatched = check_upload(device, rng)?,
            Kernel::DecodeGraphs => {
                (
                    self.decode_graph_f32_max_rel_error,
                    self.decode_graph_bf16_max_rel_error,
                    self.decode_graph_rows,
                    self.decode_graph_tokens_equal,
                ) = check_decode_graph(device, reference)?;
            }
        }
        Ok(())
    }

    /// Each figure against its tolerance (the one place they are stated).
    pub fn findings(&self) -> Vec<Finding> {
        let sampled = (self.sampling_tokens_equal != self.sampling_rows).then(|| Finding {
            kernel: Kernel::Sampling,
            problem: format!(
                "{} of {} rows drew the reference's token",
                self.sampling_tokens_equal, self.sampling_rows
            ),
        });
        let graph_tokens =
            (self.decode_graph_tokens_equal != self.decode_graph_rows).then(|| Finding {
                kernel: Kernel::DecodeGraphs,
                problem: format!(
                    "{} of {} rows drew the step's greedy token",
                    self.decode_graph_tokens_equal, self.decode_graph_rows
                ),
            });
        [
            judge(
                Kernel::Attention,
                "f32 max |Δ|",
                self.attention_f32_max_abs_error,
                1e-4,
            ),
            judge(
                Kernel::Attention,
                "bf16 max |Δ|",
                self.attention_bf16_max_abs_error,
                2e-2,
            ),
            judge(
                Kernel::SplitAttention,
                "f32 max |Δ|",
                self.attention_split_f32_max_abs_error,
                1e-4,
            ),
            judge(
                Kernel::SplitAttention,
                "bf16 max |Δ|",
                self.attention_split_bf16_max_abs_error,
                2e-2,
            ),
            sampled,
            judge(
                Kernel::Sampling,
                "log-prob max |Δ|",
                self.sampling_max_logprob_error,
                1e-3,
            ),
            judge(
                Kernel::DecodeOps,
                "f32 max |Δ|",
                self.ops_f32_max_abs_error,
                1e-4,
            ),
            judge(
                Kernel::DecodeOps,
                "bf16 max |Δ|",
                self.ops_bf16_max_abs_error,
                5e-2,
            ),
            judge(
                Kernel::TrainOps,
                "max rel. error",
                self.train_ops_max_rel_error,
                1e-3,
            ),
            judge(
                Kernel::WeightsInPlace,
                "values that differ",
                self.upload_mismatched,
                0.0,
            ),
            judge(
                Kernel::DecodeGraphs,
                "f32 logits max rel. |Δ|",
                self.decode_graph_f32_max_rel_error,
                1e-4,
            ),
            judge(
                Kernel::DecodeGraphs,
                "bf16 logits max rel. |Δ|",
                self.decode_graph_bf16_max_rel_error,
                5e-2,
            ),
            graph_tokens,
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// A small random model's decode steps as captured graphs against the same steps launched
/// one op at a time ([`crate::Gpt2::decode_grouped`], then [`sample_rows`]): three steps of
/// three rows in two groups, each fed the tokens the op-by-op step drew, with f32 and then
/// bfloat16 weights. Returns the largest |Δ| of a logit over the largest |logit| of each,
/// and with f32 weights the rows and the rows that drew the same greedy token.
fn check_decode_graph(device: &Device, reference: &Kernels) -> Result<(f64, f64, usize, usize)> {
    use crate::cache::KvCache;
    use crate::grouped::GroupedCache;
    use crate::mask::LeftPadding;
    let cfg = crate::Config {
        n_head: 2,
        ..crate::Config::tiny()
    };
    let greedy = RowDraw {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        uniform: 0.5,
    };
    let mut errors = [0f64; 2];
    let (mut rows, mut equal) = (0, 0);
    for (i, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
        let mut model = crate::model_io::init_random(&cfg, 7, dtype, device)?;
        // The reference step op by op on the kernels the device runs (its choice).
        model.set_kernels(reference.clone());
        model.prepare_for_inference()?;
        // Prompts of 5 and 3 tokens, left-padded together.
        let padding = LeftPadding::for_lengths(&[5, 3]);
        let ids = Tensor::new(&[[5u32, 9, 14, 2, 7], [0, 0, 3, 8, 1]], device)?;
        let mut caches = [
            GroupedCache::new(cfg.n_layer),
            GroupedCache::new(cfg.n_layer),
        ];
        for cache in &mut caches {
            let mut kv: KvCache = model.new_cache();
            model.forward_last(&ids, &padding, &mut kv)?;
            cache.add_groups(&kv, &padding)?;
            for g in [0, 0, 1] {
                cache.add_row(g);
            }
        }
        let [reference, captured] = &mut caches;
        let weights = model.step_weights();
        let mut graphs = None;
        let mut feed = vec![1u32, 2, 3];
        let draws = [greedy; 3];
        for _ in 0..3 {
            let logits = model.decode_grouped(&feed, reference)?; // (3, V)
            let want = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let drawn = sample_rows(&logits, &draws)?;
            let out = super::DecodeGraphs::step(&mut graphs, &weights, captured, &feed, &draws)?;
            let got_drawn = super::sampled(&out, out.len() / 3, feed.len())?;
            let got = graphs.as_ref().expect("made by the step").logits(3)?;
            let scale = want
                .iter()
                .flatten()
                .fold(0f32, |m, x| m.max(x.abs()))
                .max(1e-6);
            for (w, g) in want.iter().flatten().zip(got.iter().flatten()) {
                errors[i] = errors[i].max(f64::from((w - g).abs() / scale));
            }
            if dtype == DType::F32 {
                rows += drawn.len();
                equal += drawn
                    .iter()
                    .zip(&got_drawn)
                    .filter(|(a, b)| a.token == b.token)
                    .count();
            }
            feed = drawn.iter().map(|s| s.token).collect();
        }
    }
    Ok((errors[0], errors[1], rows, equal))
}

/// Uploads random values over part of a bfloat16 and of an f32 tensor (an odd offset and
/// length, so the staging path's edges are exercised) with `bf16_payload::overwrite` and
/// counts the values read back that are not the ones sent, or that changed outside it.
fn check_upload(device: &Device, rng: &mut ChaCha8Rng) -> Result<f64> {
    use crate::bf16_payload::{StoredValues, overwrite};
    let (len, start, count) = (100_003, 17, 99_971);
    let mut mismatched = 0usize;
    for dtype in [DType::BF16, DType::F32] {
        let before = random(rng, len);
        let sent = random(rng, count);
        let whole = Tensor::from_slice(&before, len, device)?.to_dtype(dtype)?;
        let part = whole.narrow(0, start, count)?;
        let bytes: Vec<u8> = match dtype {
            DType::BF16 => sent
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
            _ => sent.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        };
        let values = match dtype {
            DType::BF16 => StoredValues::Bf16(&bytes),
            _ => StoredValues::F32(&bytes),
        };
        overwrite(&part, values)?;
        let back = whole.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let round = |x: f32| match dtype {
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            _ => x,
        };
        mismatched += back
            .iter()
            .enumerate()
            .filter(|&(i, &got)| {
                let want = if (start..start + count).contains(&i) {
                    sent[i - start]
                } else {
                    before[i]
                };
                got.to_bits() != round(want).to_bits()
            })
            .count();
    }
    Ok(mismatched as f64)
}

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Three groups (one of 20 rows, so a group spans two blocks), left-padded prefixes (one
/// padded to all but its last column), rows joined at different suffix columns (one at
/// the cursor itself), through `kernel`.
fn check_attention(
    device: &Device,
    rng: &mut ChaCha8Rng,
    kernel: AttentionKernel,
) -> Result<(f64, f64)> {
    let (h, d, l, c, cursor) = (4usize, 64usize, 24usize, 48usize, 37usize);
    let group_pad = [0usize, 5, 23];
    let row_group: Vec<usize> = (0..28)
        .map(|r| if r < 20 { 0 } else { 1 + r % 2 })
        .collect();
    let row_start: Vec<usize> = (0..28).map(|r| (r * 7) % (cursor + 1)).collect();
    let (b, n) = (row_group.len(), group_pad.len());
    let r = 20;
    let mut scatter = vec![b as u32; n * r];
    let mut filled = vec![0usize; n];
    for (row, &g) in row_group.iter().enumerate() {
        scatter[g * r + filled[g]] = row as u32;
        filled[g] += 1;
    }
    let q = random(rng, b * h * d);
    let (pk, pv) = (random(rng, n * h * l * d), random(rng, n * h * l * d));
    let (sk, sv) = (random(rng, b * h * c * d), random(rng, b * h * c * d));
    let u32s = |v: &[usize]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
    let geometry = DeviceGeometry {
        split: false, // the kernel is named at each launch below
        scatter: Tensor::from_vec(scatter, n * r, device)?,
        row_start: Tensor::new(u32s(&row_start).as_slice(), device)?,
        group_pad: Tensor::new(u32s(&group_pad).as_slice(), device)?,
        group_rows: r,
        cursor,
    };
    let reference = Geometry {
        heads: h,
        head_dim: d,
        pool_len: l,
        suffix_cols: c,
        group_pad: &group_pad,
        row_group: &row_group,
        row_start: &row_start,
        cursor,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let mut errors = [0f64; 2];
    for (error, dtype) in errors.iter_mut().zip([DType::F32, DType::BF16]) {
        // Inputs rounded to the dtype, so the reference sees the kernel's values.
        let put = |v: &[f32], shape: (usize, usize, usize, usize)| -> Result<(Tensor, Vec<f32>)> {
            let t = Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?;
            let rounded = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok((t.to_device(device)?, rounded))
        };
        let (qt, qr) = put(&q, (b, h, 1, d))?;
        let (pkt, pkr) = put(&pk, (n, h, l, d))?;
        let (pvt, pvr) = put(&pv, (n, h, l, d))?;
        let (skt, skr) = put(&sk, (b, h, c, d))?;
        let (svt, svr) = put(&sv, (b, h, c, d))?;
        let got = grouped_attention_with(kernel, &qt, (&pkt, &pvt), (&skt, &svt), &geometry)?
            .ok_or_else(|| {
                crate::Error::InvalidArgument(format!(
                    "{kernel:?} attention does not apply to {dtype:?} at head dim {d}"
                ))
            })?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let want = decode_attention(&reference, &qr, (&pkr, &pvr), (&skr, &svr));
        *error = got
            .iter()
            .zip(&want)
            .map(|(a, b)| f64::from((a - b).abs()))
            .fold(0.0, f64::max);
    }
    Ok((errors[0], errors[1]))
}

/// Rows of a GPT-2-sized vocabulary under greedy, temperature, top-k and top-p draws,
/// one row with NaN logits, in each layout the sampler takes.
fn check_sampling(device: &Device, rng: &mut ChaCha8Rng) -> Result<(usize, usize, f64)> {
    let v = 50_257;
    let settings = [
        (0.0f32, 0u32, 1.0f32),
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.0, 50, 1.0),
        (1.0, 0, 0.9),
        (0.8, 40, 0.95),
        (1.3, 1, 1.0),
        (1.0, 0, 0.05),
    ];
    let draws: Vec<RowDraw> = (0..32)
        .map(|i| {
            let (temperature, top_k, top_p) = settings[i % settings.len()];
            RowDraw {
                temperature,
                top_k,
                top_p,
                uniform: rng.random(),
            }
        })
        .collect();
    let mut logits: Vec<f32> = (0..draws.len() * v)
        .map(|_| rng.random_range(-6.0f32..6.0))
        .collect();
    for x in logits[5 * v..6 * v].iter_mut().step_by(7) {
        *x = f32::NAN;
    }
    // Three layouts of the same rows: contiguous f32; the first V columns of rows padded
    // to a multiple of 64, as a padded head gives them, in f32 and in BF16 (checked
    // against the reference on the BF16 values). The padding holds 100, above every
    // logit: a read past column V would win the argmax.
    let n = draws.len();
    let ld = v.next_multiple_of(64);
    let wide: Vec<f32> = logits
        .chunks(v)
        .flat_map(|row| {
            row.iter()
                .copied()
                .chain(std::iter::repeat_n(100.0, ld - v))
        })
        .collect();
    let wide = Tensor::from_vec(wide, (n, ld), device)?;
    let rounded: Vec<f32> = logits
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    let cases = [
        (Tensor::from_slice(&logits, (n, v), device)?, &logits),
        (wide.narrow(1, 0, v)?, &logits),
        (wide.to_dtype(DType::BF16)?.narrow(1, 0, v)?, &rounded),
    ];
    let (mut equal, mut logprob_error) = (0, 0f64);
    for (on_device, values) in &cases {
        let got = sample_rows(on_device, &draws)?;
        for ((row, draw), got) in values.chunks(v).zip(&draws).zip(&got) {
            let want = sample_reference(row, draw)?;
            equal += usize::from(want.token == got.token);
            logprob_error = logprob_error.max(f64::from((want.logprob - got.logprob).abs()));
        }
    }
    Ok((cases.len() * n, equal, logprob_error))
}

/// Each fused op on `device` and on the CPU from the same `dtype` values: the largest
/// difference of their outputs (the shapes of a 12-head, 768-wide decode step).
fn check_ops(device: &Device, dtype: DType, rng: &mut ChaCha8Rng) -> Result<f64> {
    let (b, h, d, c, col) = (24usize, 12usize, 64usize, 40usize, 17usize);
    let e = h * d;
    let on_both = |v: Vec<f32>, shape: &[usize]| -> Result<(Tensor, Tensor)> {
        let cpu = Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?;
        Ok((cpu.to_device(device)?, cpu))
    };
    let ((qkv_d, qkv_c), (bias_d, bias_c)) = (
        on_both(random(rng, b * 3 * e), &[b, 3 * e])?,
        on_both(random(rng, 3 * e), &[3 * e])?,
    );
    let ((x_d, x_c), (y_d, y_c)) = (
        on_both(random(rng, b * e), &[b, e])?,
        on_both(random(rng, b * e), &[b, e])?,
    );
    let ((fc_d, fc_c), (fb_d, fb_c)) = (
        on_both(random(rng, b * 4 * e), &[b, 4 * e])?,
        on_both(random(rng, 4 * e), &[4 * e])?,
    );
    let vectors: Vec<(Tensor, Tensor)> = (0..3)
        .map(|_| on_both(random(rng, e), &[e]))
        .collect::<Result<_>>()?;
    let norm = |pick: fn(&(Tensor, Tensor)) -> Tensor| AddLayerNorm {
        y_bias: pick(&vectors[0]),
        weight: pick(&vectors[1]),
        bias: pick(&vectors[2]),
        eps: 1e-5,
    };
    let (norm_device, norm_cpu) = (norm(|p| p.0.clone()), norm(|p| p.1.clone()));
    let mut pairs: Vec<(Tensor, Tensor)> = Vec::new();
    for part in 0..3 {
        let op = QkvSplit {
            part,
            heads: h,
            col: 0,
        };
        pairs.push((op.extract(&qkv_d, &bias_d)?, op.extract(&qkv_c, &bias_c)?));
        let into = QkvSplit { col, ..op };
        let dst_d = Tensor::zeros((32, h, c, d), dtype, device)?;
        let dst_c = Tensor::zeros((32, h, c, d), dtype, &Device::Cpu)?;
        into.write_into(&dst_d, &qkv_d, &bias_d)?;
        into.write_into(&dst_c, &qkv_c, &bias_c)?;
        pairs.push((dst_d, dst_c));
    }
    pairs.push((
        fc_d.apply_op2_no_bwd(&fb_d, &BiasGelu)?,
        fc_c.apply_op2_no_bwd(&fb_c, &BiasGelu)?,
    ));
    let (sd, nd) = norm_device.forward(&x_d, &y_d)?;
    let (sc, nc) = norm_cpu.forward(&x_c, &y_c)?;
    pairs.push((sd, sc));
    pairs.push((nd, nc));
    let mut worst = 0f64;
    for (on_device, on_cpu) in pairs {
        let a = on_device.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        let b = on_cpu.to_dtype(DType::F32)?;
        let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        worst = worst.max(f64::from(diff));
    }
    Ok(worst)
}

/// Each training op's value and gradients (of Σ op(·) ⊙ r) on `device` and on the CPU
/// from the same inputs: the largest relative difference. Shapes of a gpt2-124m step:
/// rows crossing the 32-row chunks, a causal mask shared and per batch row, the vocabulary.
fn check_train_ops(device: &Device, rng: &mut ChaCha8Rng) -> Result<f64> {
    use crate::train_ops;
    use crate::train_ops::adamw::{AdamWStep, adamw_step};
    use candle_core::Var;
    type Op = fn(&[Tensor], &Tensor) -> candle_core::Result<Tensor>;
    /// An input's values, shape, and whether it is differentiated.
    type Input = (Vec<f32>, Vec<usize>, bool);
    let (m, e, t) = (70usize, 768usize, 46usize);
    let causal: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t <= k / t {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let per_row: Vec<f32> = (0..2).flat_map(|_| causal.iter().copied()).collect();
    let targets: Vec<u32> = (0..40).map(|_| rng.random_range(0..50_257u32)).collect();
    let cases: Vec<(Vec<Input>, Op)> = vec![
        (
            vec![
                (random(rng, m * e), vec![m, e], true),
                (random(rng, e), vec![e], true),
                (random(rng, e), vec![e], true),
            ],
            |a, _| train_ops::layer_norm(&a[0], &a[1], &a[2], 1e-5),
        ),
        (
            vec![
                (random(rng, m * 4 * e), vec![m, 4 * e], true),
                (random(rng, 4 * e), vec![4 * e], true),
            ],
            |a, _| train_ops::bias_gelu(&a[0], &a[1]),
        ),
        (
            vec![
                (random(rng, 2 * 12 * t * t), vec![2, 12, t, t], true),
                (causal.clone(), vec![1, 1, t, t], false),
            ],
            |a, _| train_ops::masked_softmax(&a[0], &a[1], 0.125),
        ),
        (
            vec![
                (random(rng, 2 * 12 * t * t), vec![2, 12, t, t], true),
                (per_row, vec![2, 1, t, t], false),
            ],
            |a, _| train_ops::masked_softmax(&a[0], &a[1], 0.125),
        ),
        (
            vec![(
                random(rng, 40 * 50_257).iter().map(|v| 8.0 * v).collect(),
                vec![40, 50_257],
                true,
            )],
            |a, y| train_ops::target_logprobs(&a[0], y, 0.9),
        ),
        // The mixed products: a linear (cuBLAS's operands as stored), and the tied head's
        // product with wteᵀ, a transposed view (handed to cuBLAS transposed).
        (
            vec![
                (random(rng, m * e), vec![m, e], true),
                (random(rng, e * 200), vec![e, 200], true),
                (random(rng, 200), vec![200], true),
            ],
            |a, _| train_ops::mixed_linear(&a[0], &a[1], &a[2]),
        ),
        (
            vec![
                (random(rng, m * 96), vec![m, 96], true),
                (random(rng, 300 * 96), vec![300, 96], true),
            ],
            |a, _| train_ops::mixed_matmul(&a[0], &a[1].t()?),
        ),
    ];
    let mut worst = 0f64;
    for (inputs, op) in cases {
        let mut outputs: Vec<Vec<Vec<f32>>> = Vec::new();
        for dev in [device, &Device::Cpu] {
            let vars: Vec<Var> = inputs
                .iter()
                .map(|(v, shape, _)| {
                    Var::from_tensor(&Tensor::from_slice(v, shape.as_slice(), dev)?)
                })
                .collect::<candle_core::Result<_>>()?;
            let args: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = op(&args, &Tensor::from_slice(&targets, targets.len(), dev)?)?;
            let r = Tensor::from_vec(
                (0..y.elem_count())
                    .map(|k| ((k * 7919) % 13) as f32 / 13.0 - 0.4)
                    .collect::<Vec<_>>(),
                y.shape(),
                dev,
            )?;
            let grads = (&y * r)?.sum_all()?.backward()?;
            let mut got = vec![y.flatten_all()?.to_vec1::<f32>()?];
            for (var, (_, _, differentiable)) in vars.iter().zip(&inputs) {
                if *differentiable {
                    let g = grads
                        .get(var)
                        .expect("every differentiable input has a gradient");
                    got.push(g.flatten_all()?.to_vec1::<f32>()?);
                }
            }
            outputs.push(got);
        }
        worst = worst.max(largest_relative(&outputs[0], &outputs[1]));
    }
    // AdamW's two in-place passes, three steps with decay and a gradient scale.
    let n = 10_000;
    let (p0, g0) = (random(rng, n), random(rng, n));
    let step = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        shrink: 1.0 - 1e-5,
        s1: 10.0,
        s2: 1000.0,
        grad_scale: 0.5,
    };
    let mut outputs: Vec<Vec<Vec<f32>>> = Vec::new();
    for dev in [device, &Device::Cpu] {
        let p = Tensor::from_slice(&p0, n, dev)?;
        let g = Tensor::from_slice(&g0, n, dev)?;
        let mv = Tensor::zeros((2, n), DType::F32, dev)?;
        for _ in 0..3 {
            adamw_step(&p, &g, &mv, &step, &crate::kernels::Kernels::every())?;
        }
        outputs.push(vec![
            p.to_vec1::<f32>()?,
            mv.flatten_all()?.to_vec1::<f32>()?,
        ]);
    }
    worst = worst.max(largest_relative(&outputs[0], &outputs[1]));
    Ok(worst.max(check_many(device, rng, &step)?))
}

/// The multi-tensor AdamW (three tensors, one past a chunk, one without decay), three
/// steps with each parameter's bfloat16 copy, and the gradients' sum of squares, on
/// `device` against the CPU: the largest relative difference. A bfloat16 copy that is not
/// its own parameter's values rounded is an error.
fn check_many(
    device: &Device,
    rng: &mut ChaCha8Rng,
    step: &crate::train_ops::adamw::AdamWStep,
) -> Result<f64> {
    use crate::train_ops::adamw::{ManyItem, adamw_step_many, square_sum_many};
    let sizes = [70_000usize, 10, 5_000];
    let p0: Vec<Vec<f32>> = sizes.iter().map(|&n| random(rng, n)).collect();
    let g0: Vec<Vec<f32>> = sizes.iter().map(|&n| random(rng, n)).collect();
    let mut outputs: Vec<Vec<Vec<f32>>> = Vec::new();
    for dev in [device, &Device::Cpu] {
        let put = |v: &Vec<f32>| Tensor::from_slice(v, v.len(), dev);
        let params = p0
            .iter()
            .map(put)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let grads = g0
            .iter()
            .map(put)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let moments = sizes
            .iter()
            .map(|&n| Tensor::zeros((2, n), DType::F32, dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // One buffer, each parameter's bits at its range: the first steps leave parameter
        // 1 out (a copy per range), the last exports all (one transfer of the buffer).
        let ranges: Vec<std::ops::Range<usize>> = sizes
            .iter()
            .scan(0, |at, &n| {
                *at += 2 * n;
                Some(*at - 2 * n..*at)
            })
            .collect();
        let mut all_bits = vec![0u8; ranges[2].end];
        for round in 0..3 {
            let items: Vec<ManyItem> = params
                .iter()
                .zip(&grads)
                .zip(&moments)
                .zip(&ranges)
                .enumerate()
                .map(|(k, (((param, grad), moments), out))| ManyItem {
                    param,
                    grad,
                    moments,
                    shrink: if k == 1 { 1.0 } else { step.shrink },
                    out: (k != 1 || round == 2).then(|| out.clone()),
                })
                .collect();
            adamw_step_many(
                &items,
                step,
                &mut all_bits,
                &crate::kernels::Kernels::every(),
            )?;
        }
        let bits: Vec<&[u8]> = ranges.iter().map(|r| &all_bits[r.clone()]).collect();
        let squares = square_sum_many(
            &grads.iter().collect::<Vec<_>>(),
            &crate::kernels::Kernels::every(),
        )?;
        let mut got = vec![vec![squares as f32]];
        for ((p, mv), b) in params.iter().zip(&moments).zip(&bits) {
            let own: Vec<u8> = p
                .to_dtype(DType::BF16)?
                .to_vec1::<half::bf16>()?
                .iter()
                .flat_map(|x| x.to_bits().to_le_bytes())
                .collect();
            if own.as_slice() != *b {
                return Err(crate::Error::InvalidArgument(format!(
                    "adamw_many's bfloat16 copy on {dev:?} is not its parameters' values rounded"
                )));
            }
            got.push(p.to_vec1::<f32>()?);
            got.push(mv.flatten_all()?.to_vec1::<f32>()?);
        }
        outputs.push(got);
    }
    Ok(largest_relative(&outputs[0], &outputs[1]))
}

/// The largest |a − b| over max |b|, tensor by tensor.
fn largest_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let mut worst = 0f64;
    for (a, b) in a.iter().zip(b) {
        let scale = b.iter().fold(0f32, |s, v| s.max(v.abs())).max(1e-12);
        let diff = a.iter().zip(b).fold(0f32, |s, (x, y)| s.max((x - y).abs()));
        worst = worst.max(f64::from(diff / scale));
    }
    worst
}
