//! `rollout-worker parity`: the model on a device against the same weights on the CPU in
//! f32 — the logits of three prompts at every position (relative and largest error, in f32
//! and in bfloat16 on the device), their greedy completions, and the same completions from
//! the rollout engine (grouped cache, fused attention and, on CUDA, sampling on the device)
//! — plus the bfloat16 model a weight push builds (on a GPU: one upload of the payload,
//! every weight a view of it) against the one loaded, and, on CUDA, each decode kernel
//! against its CPU reference, as one JSON line. The
//! first question `tests/gpu-check.sh` asks of a GPU; on the CPU it checks the bfloat16
//! path against f32.

use std::io::Write;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rookworld_lm::cli::ModelArgs;
use rookworld_lm::cpu_gemm::PanelDtype;
use rookworld_lm::generate::{GenerationConfig, generate_batch};
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Gpt2, LeftPadding, Result};
use serde::Serialize;

use crate::engine::{EngineConfig, Request, Scheduler};

/// The prompts compared: a policy prompt at the start, one from a middlegame, and an
/// environment prompt.
pub const PROMPTS: [&str; 3] = [
    "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:",
    "P: r1bqkb1r/pppp1ppp/2n2n2/4p3/2B1P3/5N2/PPPP1PPP/RNBQK2R w KQkq - 4 4    M:",
    "A: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1+e2e4+",
];

/// Options of `rollout-worker parity`.
#[derive(Debug, Clone, clap::Args)]
pub struct ParityArgs {
    /// The model (`--preset` with `--init-seed`, or `--model DIR`) and the device checked
    /// (`--device`); `--weight-dtype` is ignored: f32 and bf16 are both checked.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Greedy tokens generated per prompt.
    #[arg(long, allow_negative_numbers = true, default_value_t = 16)]
    pub new_tokens: usize,
}

/// One dtype on the device against the CPU's f32.
#[derive(Debug, Serialize)]
struct DtypeParity {
    dtype: &'static str,
    /// ‖device − cpu‖ / ‖cpu‖ over the logits of every prompt position.
    logits_rel_error: f64,
    logits_max_abs_error: f64,
    /// Per prompt: how many greedy tokens equal the CPU's, of `new_tokens`.
    greedy_matching: Vec<usize>,
    greedy_tokens: Vec<Vec<u32>>,
    /// The same through the rollout engine (two samples per prompt sharing its cache):
    /// per sample, how many tokens equal the CPU's.
    engine_greedy_matching: Vec<usize>,
    /// bf16 only: the model built from the CPU model's push payload (BF16), as a worker
    /// builds a pushed version, against this loaded one: the largest |Δ| of the logits
    /// (0 on CUDA, the same BF16 values; on the CPU the payload also rounds the f32
    /// embeddings, biases and norm gains that the loaded model keeps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pushed_logits_max_abs_error: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    model: String,
    prompts: usize,
    new_tokens: usize,
    cpu_greedy_tokens: Vec<Vec<u32>>,
    results: Vec<DtypeParity>,
    /// The CUDA decode kernels against their CPU references (CUDA only).
    kernels: Option<serde_json::Value>,
}

/// Runs the comparison and prints its JSON line.
pub fn run(args: &ParityArgs, out: &mut impl Write) -> Result<()> {
    args.model.weight_dtype()?; // the old --precision is refused, not ignored
    let on = |device: &str, dtype: &str| ModelArgs {
        device: device.into(),
        weight_dtype: dtype.into(),
        legacy_precision: Default::default(),
        ..args.model.clone()
    };
    let reference = on("cpu", "f32").load()?;
    let bos = reference.model.config().bos_token_id;
    let prompts = PROMPTS
        .iter()
        .map(|p| reference.tokenizer.encode_prompt(bos, p))
        .collect::<Result<Vec<_>>>()?;
    let want_logits = logits(&reference.model, &prompts)?;
    let want_tokens = greedy(&reference.model, &prompts, args.new_tokens)?;
    let mut results = Vec::new();
    for dtype in ["f32", "bf16"] {
        let mut loaded = on(&args.model.device, dtype).load()?;
        if loaded.model.panel_dtype() == PanelDtype::Bf16 || loaded.model.device().is_cuda() {
            // On the CPU, BF16 lives in the packed panels (`--weight-dtype`); on CUDA the
            // engine's model has a padded head: check those.
            loaded.model.prepare_for_inference()?;
        }
        let got = logits(&loaded.model, &prompts)?;
        let (rel, max_abs) = errors(&got, &want_logits);
        let tokens = greedy(&loaded.model, &prompts, args.new_tokens)?;
        let matching = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let greedy_matching = tokens
            .iter()
            .zip(&want_tokens)
            .map(|(a, b)| matching(a, b))
            .collect();
        let pushed_logits_max_abs_error = if dtype == "bf16" {
            Some(
                errors(
                    &logits(&pushed(&reference.model, &loaded.model)?, &prompts)?,
                    &got,
                )
                .1,
            )
        } else {
            None
        };
        let engine_greedy_matching = engine_greedy(loaded.model, &prompts, args.new_tokens)?
            .iter()
            .enumerate()
            .map(|(i, got)| matching(got, &want_tokens[i / ENGINE_SAMPLES]))
            .collect();
        results.push(DtypeParity {
            dtype,
            logits_rel_error: rel,
            logits_max_abs_error: max_abs,
            greedy_matching,
            greedy_tokens: tokens,
            engine_greedy_matching,
            pushed_logits_max_abs_error,
        });
    }
    let report = Report {
        device: args.model.device.clone(),
        model: reference.source,
        prompts: prompts.len(),
        new_tokens: args.new_tokens,
        cpu_greedy_tokens: want_tokens,
        results,
        kernels: kernel_check(&args.model.device)?,
    };
    writeln!(
        out,
        "{}",
        serde_json::to_string(&report).expect("the report serialises")
    )
    .map_err(|source| rookworld_lm::Error::Io {
        path: "<stdout>".into(),
        source,
    })?;
    Ok(())
}

/// The f32 logits of every position of every prompt, on the host, one prompt after another.
fn logits(model: &Gpt2, prompts: &[Vec<u32>]) -> Result<Vec<f32>> {
    let mut all = Vec::new();
    for ids in prompts {
        let input = Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?; // (1, T)
        let mut cache = model.new_cache();
        let logits = model.forward(&input, &LeftPadding::none(1), &mut cache)?; // (1, T, V)
        all.extend(
            logits
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    Ok(all)
}

/// `reference`'s weights pushed to a worker like `like` (its dtype, panels and device):
/// the BF16 payload a learner sends, built as the worker builds it.
fn pushed(reference: &Gpt2, like: &Gpt2) -> Result<Gpt2> {
    let payload = rookworld_lm::checkpoint::to_bf16_payload(reference)?;
    let kind = (like.dtype(), like.panel_dtype());
    rookworld_weights::set::build_model(&payload, like.config(), kind, like.device(), None).map_err(
        |e| match e {
            rookworld_weights::set::WeightError::Model(e) => e,
            other => rookworld_lm::Error::InvalidArgument(other.to_string()),
        },
    )
}

/// `new_tokens` greedy tokens after each prompt.
fn greedy(model: &Gpt2, prompts: &[Vec<u32>], new_tokens: usize) -> Result<Vec<Vec<u32>>> {
    let cfg = GenerationConfig {
        n: 1,
        max_new_tokens: new_tokens,
        sampling: SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        },
        seed: 0,
        ignore_eos: true,
    };
    let out = generate_batch(model, prompts, &cfg, 0)?;
    Ok(out
        .groups
        .into_iter()
        .map(|mut g| g.swap_remove(0).ids)
        .collect())
}

/// Greedy samples per prompt the engine decodes (rows sharing the prompt's cache).
const ENGINE_SAMPLES: usize = 2;

/// `new_tokens` greedy tokens of each of `ENGINE_SAMPLES` samples of each prompt, through
/// the rollout engine; samples in prompt order.
fn engine_greedy(model: Gpt2, prompts: &[Vec<u32>], new_tokens: usize) -> Result<Vec<Vec<u32>>> {
    let mut engine = Scheduler::new(Arc::new(model), 0, EngineConfig::default());
    let request = Request {
        prompts: prompts.to_vec(),
        n: ENGINE_SAMPLES,
        max_new_tokens: new_tokens,
        sampling: SamplingParams::greedy(),
        seed: 0,
        ignore_eos: true,
    };
    let failed =
        |e: crate::engine::EngineError| rookworld_lm::Error::InvalidArgument(e.to_string());
    engine.submit(request).map_err(failed)?;
    let (samples, _) = engine.run_to_completion().map_err(failed)?;
    Ok(samples.into_iter().map(|s| s.completion.ids).collect())
}

/// The decode step's CUDA kernels against their CPU references; `None` off CUDA.
fn kernel_check(device: &str) -> Result<Option<serde_json::Value>> {
    let device: rookworld_lm::device::DeviceChoice = device.parse()?;
    let device = device.open()?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let check = rookworld_lm::cuda::self_check(&device)?;
        return Ok(Some(
            serde_json::to_value(check).expect("the kernel check serialises"),
        ));
    }
    let _ = device;
    Ok(None)
}

/// (‖a − b‖ / ‖b‖, max |a − b|).
fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut diff, mut norm, mut max) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = f64::from(*x) - f64::from(*y);
        diff += d * d;
        norm += f64::from(*y) * f64::from(*y);
        max = max.max(d.abs());
    }
    ((diff / norm.max(f64::MIN_POSITIVE)).sqrt(), max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_against_itself_is_exact_and_bf16_is_close() {
        let args = ParityArgs {
            model: ModelArgs {
                model: None,
                preset: Some("tiny".into()),
                init_seed: 3,
                device: "cpu".into(),
                weight_dtype: "auto".into(),
                legacy_precision: Default::default(),
            },
            new_tokens: 4,
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let results = report["results"].as_array().unwrap();
        assert_eq!(results[0]["dtype"], "f32");
        assert_eq!(results[0]["logits_rel_error"], 0.0);
        assert_eq!(results[0]["greedy_matching"], serde_json::json!([4, 4, 4]));
        // The engine (grouped cache, fused CPU attention) decodes what the plain path does.
        assert_eq!(
            results[0]["engine_greedy_matching"],
            serde_json::json!([4, 4, 4, 4, 4, 4])
        );
        assert!(report["kernels"].is_null());
        let bf16 = results[1]["logits_rel_error"].as_f64().unwrap();
        assert!(bf16 > 0.0 && bf16 < 0.05, "bf16 relative error {bf16}");
        // A pushed BF16 model computes what the loaded one does, up to the payload's
        // rounding of the weights the CPU keeps in f32.
        assert!(results[0].get("pushed_logits_max_abs_error").is_none());
        let pushed = results[1]["pushed_logits_max_abs_error"].as_f64().unwrap();
        assert!(pushed < 0.05, "pushed bf16 logits differ by {pushed}");
    }
}
