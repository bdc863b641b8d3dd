//! `rollout-worker parity`: the model on a device against the same weights on the CPU in
//! f32 — the logits of three prompts at every position (relative and largest error, in f32
//! and in bfloat16 on the device), their greedy completions, and the same completions from
//! the rollout engine (grouped cache, fused attention and, on CUDA, sampling on the device)
//! — plus the bfloat16 model a weight push builds (on a GPU: one upload of the payload,
//! every weight a view of it) against the one loaded, and, on CUDA, each decode kernel
//! against its CPU reference, as one JSON line. The
//! first question `tests/gpu-check.sh` asks of a GPU; on the CPU it checks the bfloat16
//! path against f32.
//!
//! The kernels are reported per family (`kernel_report`): a family that fails to run or
//! disagrees fails its own line only, the logit and token parity stay in the report, and
//! a trial family that is off is reported as off. The command exits non-zero when a
//! family that is on failed, after printing the report.

use std::io::Write;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rookworld_lm::cli::ModelArgs;
use rookworld_lm::cpu_gemm::PanelDtype;
use rookworld_lm::device::DeviceChoice;
use rookworld_lm::generate::{GenerationConfig, generate_batch};
use rookworld_lm::kernels::{CHECKED_FAMILIES, Family, Finding, Kernel, KernelChoice};
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Gpt2, LeftPadding, Result};
use serde::Serialize;
use serde_json::{Map, Value};

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
    /// The CUDA decode kernels' figures against their CPU references, when every family's
    /// check ran (CUDA only); `passed`: every family that is on passed.
    kernels: Option<Value>,
    /// Each kernel family's line (CUDA only): its status, figures and problems.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_families: Option<Vec<FamilyReport>>,
    /// Why the kernel check did not run, or which family did not run or lost the context.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernel_check_error: Option<String>,
}

/// How `rollout-worker parity` fails.
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    /// The model could not be loaded or run, or the report not written.
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    /// Kernel families that are on failed their check (the report, printed, has why).
    #[error("CUDA kernel families failed their check against the CPU: {}", .0.join(", "))]
    Kernels(Vec<&'static str>),
    /// The kernel check could not run at all.
    #[error("the CUDA kernel check did not run: {0}")]
    KernelCheck(String),
}

/// Runs the comparison and prints its JSON line; an error after printing it when a kernel
/// family that is on failed.
pub fn run(args: &ParityArgs, out: &mut impl Write) -> std::result::Result<(), ParityError> {
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
    // The device opened and its kernels judged once; each dtype's model on a stream of its
    // own beside it.
    let (device, kernels) = args.model.open()?;
    let choice: DeviceChoice = args.model.device.parse()?;
    let mut results = Vec::new();
    for dtype in ["f32", "bf16"] {
        let beside = choice.open_beside(&kernels)?;
        let mut loaded = on(&args.model.device, dtype).load_on(beside)?;
        if loaded.model.panel_dtype() == PanelDtype::Bf16 || loaded.model.device().is_cuda() {
            // On the CPU, BF16 lives in the packed panels (`--weight-dtype`); on CUDA the
            // engine's model has a padded head: check those.
            loaded
                .model
                .prepare_for_inference()
                .map_err(rookworld_lm::Error::from)?;
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
    let kernels = kernel_check(&device, &args.model.kernels);
    let verdict = kernels.as_ref().map_or(Ok(()), KernelReport::verdict);
    let report = Report {
        device: args.model.device.clone(),
        model: reference.source,
        prompts: prompts.len(),
        new_tokens: args.new_tokens,
        cpu_greedy_tokens: want_tokens,
        results,
        kernels: None,
        kernel_families: None,
        kernel_check_error: None,
    }
    .with_kernels(kernels);
    writeln!(
        out,
        "{}",
        serde_json::to_string(&report).expect("the report serialises")
    )
    .map_err(|source| rookworld_lm::Error::Io {
        path: "<stdout>".into(),
        source,
    })?;
    verdict
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
    let payload = rookworld_lm::model_io::to_bf16_payload(reference)?;
    let kind = (like.dtype(), like.panel_dtype());
    let on = (like.device(), like.kernels());
    rookworld_weights::set::build_model(&payload, like.config(), kind, on, None).map_err(
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

/// What the kernel check gave, before it is judged per family.
#[derive(Debug, Default)]
struct KernelOutcome {
    /// Whether a check ran (with or without figures).
    ran: bool,
    /// The check's figures (its `KernelCheck`, as a JSON object) when every family ran.
    figures: Option<Map<String, Value>>,
    /// Each family that failed to run or disagreed beyond its tolerance.
    findings: Vec<Finding>,
    /// The first family that did not run, a lost context, or the device or kernel
    /// switches that could not be read.
    error: Option<String>,
}

/// A kernel family's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum FamilyStatus {
    Passed,
    /// Did not run (the problem says why) or disagreed beyond its tolerance.
    Failed,
    /// A trial not turned on, or a family turned off on request: nothing runs it, so its
    /// problems, if any, fail nothing.
    Off,
}

/// One kernel family's line of the report.
#[derive(Debug, Serialize)]
struct FamilyReport {
    family: &'static str,
    status: FamilyStatus,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    problems: Vec<String>,
    /// The check's figures of this family (absent where it did not run).
    #[serde(skip_serializing_if = "Map::is_empty")]
    figures: Map<String, Value>,
}

/// The kernel check, judged per family.
#[derive(Debug)]
struct KernelReport {
    families: Vec<FamilyReport>,
    /// The check's figures, `passed` replaced by the families' verdict.
    figures: Option<Map<String, Value>>,
    error: Option<String>,
}

impl KernelReport {
    /// An error naming the families that are on and failed, or saying why no check ran.
    fn verdict(&self) -> std::result::Result<(), ParityError> {
        let failed: Vec<&'static str> = self
            .families
            .iter()
            .filter(|f| f.status == FamilyStatus::Failed)
            .map(|f| f.family)
            .collect();
        match (&self.error, self.families.is_empty()) {
            (Some(why), true) => Err(ParityError::KernelCheck(why.clone())),
            _ if !failed.is_empty() => Err(ParityError::Kernels(failed)),
            _ => Ok(()),
        }
    }
}

impl Report {
    fn with_kernels(self, kernels: Option<KernelReport>) -> Self {
        match kernels {
            None => self,
            Some(k) => Self {
                kernels: k.figures.map(Value::Object),
                kernel_families: Some(k.families),
                kernel_check_error: k.error,
                ..self
            },
        }
    }
}

/// The family a figure of the check belongs to, by its name (`KernelCheck`'s fields);
/// `None` for the overall `passed` and any figure of no family.
fn figure_family(name: &str) -> Option<Kernel> {
    const PREFIXES: [(&str, Kernel); 8] = [
        ("attention_split_", Kernel::SplitAttention),
        ("attention_", Kernel::Attention),
        ("sampling_", Kernel::Sampling),
        ("ops_", Kernel::DecodeOps),
        ("train_ops_", Kernel::TrainOps),
        ("empty_rows", Kernel::TrainOps),
        ("upload_", Kernel::WeightsInPlace),
        ("decode_graph_", Kernel::DecodeGraphs),
    ];
    PREFIXES
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|&(_, kernel)| kernel)
}

/// Whether the process runs `kernel`, as the command line chose: every family that is
/// not a trial and each trial `enabled` names (`--enable-kernels`), less those `disabled`
/// names (`--disable-kernels`). Not the verdict after the start-up check, which turns a
/// failed family off: that family is on here, and fails its line.
fn family_on(kernel: Kernel, enabled: &[Kernel], disabled: &[Kernel]) -> bool {
    (!kernel.trial() || enabled.contains(&kernel)) && !disabled.contains(&kernel)
}

/// Judges the check per family: each family's figures and problems, failed when it is on
/// and has a problem, off when it is not on. A family with no problem passed, figures or
/// not (a check that ran without figures after a failure elsewhere); no family is judged
/// when no check ran.
fn kernel_report(outcome: KernelOutcome, on: impl Fn(Kernel) -> bool) -> KernelReport {
    let KernelOutcome {
        ran,
        mut figures,
        findings,
        error,
    } = outcome;
    let families: Vec<FamilyReport> = Kernel::ALL
        .iter()
        .copied()
        .filter(|_| ran)
        .filter(|k| CHECKED_FAMILIES.contains(k) || findings.iter().any(|f| f.kernel == *k))
        .map(|kernel| {
            let problems: Vec<String> = findings
                .iter()
                .filter(|f| f.kernel == kernel)
                .map(|f| f.problem.clone())
                .collect();
            let own = figures
                .iter()
                .flatten()
                .filter(|(name, _)| figure_family(name) == Some(kernel))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect();
            let status = if !on(kernel) {
                FamilyStatus::Off
            } else if problems.is_empty() {
                FamilyStatus::Passed
            } else {
                FamilyStatus::Failed
            };
            FamilyReport {
                family: kernel.name(),
                status,
                problems,
                figures: own,
            }
        })
        .collect();
    let passed = families.iter().all(|f| f.status != FamilyStatus::Failed);
    if let Some(figures) = &mut figures {
        figures.insert("passed".into(), Value::Bool(passed));
    }
    KernelReport {
        families,
        figures,
        error,
    }
}

/// The decode step's CUDA kernels against their CPU references, per family; `None` off
/// CUDA. Never an error: what keeps the check from running is in the report.
fn kernel_check(device: &Device, choice: &KernelChoice) -> Option<KernelReport> {
    if !device.is_cuda() {
        return None;
    }
    let (enabled, disabled) = (choice.enabled(), choice.disabled());
    Some(kernel_report(run_kernel_check(device, choice), |k| {
        family_on(k, &enabled, &disabled)
    }))
}

/// Runs the decode kernels' check on a CUDA device: every family, on or off, each followed
/// by a synchronisation, so that the figures of those that ran survive one that did not.
/// A fault that poisons the context stops the checks; the report then names it, and every
/// family's line says it did not run.
#[cfg(feature = "cuda")]
fn run_kernel_check(device: &Device, choice: &KernelChoice) -> KernelOutcome {
    let reference = rookworld_lm::kernels::Kernels::chosen(choice);
    match rookworld_lm::cuda::check_families(device, &CHECKED_FAMILIES, &reference) {
        Ok((check, errors)) => {
            // A family that did not run is the check's error; one that disagreed only its
            // family's problem.
            let error = errors
                .first()
                .map(|f| format!("the {} kernel check {}", f.kernel.name(), f.problem));
            let judged: Vec<Finding> = check
                .findings()
                .into_iter()
                .filter(|f| !errors.iter().any(|e| e.kernel == f.kernel))
                .collect();
            let mut findings = errors;
            findings.extend(judged);
            KernelOutcome {
                ran: true,
                figures: match serde_json::to_value(&check) {
                    Ok(Value::Object(figures)) => Some(figures),
                    _ => None,
                },
                error,
                findings,
            }
        }
        Err(lost) => KernelOutcome {
            ran: true,
            figures: None,
            findings: CHECKED_FAMILIES
                .iter()
                .map(|&kernel| Finding {
                    kernel,
                    problem: format!("did not run: {lost}"),
                })
                .collect(),
            error: Some(lost.to_string()),
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn run_kernel_check(_: &Device, _: &KernelChoice) -> KernelOutcome {
    KernelOutcome {
        error: Some("this binary was built without the `cuda` feature".into()),
        ..KernelOutcome::default()
    }
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
                kernels: Default::default(),
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

    /// A check whose figures came back: sampling disagreed, the trial `decode_graphs` (off)
    /// too, everything else within tolerance.
    fn some_failed() -> KernelOutcome {
        let figures = serde_json::json!({
            "attention_f32_max_abs_error": 1e-6,
            "attention_bf16_max_abs_error": 1e-3,
            "attention_split_f32_max_abs_error": 2e-6,
            "attention_split_bf16_max_abs_error": 2e-3,
            "sampling_rows": 8,
            "sampling_tokens_equal": 5,
            "sampling_max_logprob_error": 0.5,
            "ops_f32_max_abs_error": 1e-6,
            "ops_bf16_max_abs_error": 1e-2,
            "train_ops_max_rel_error": 1e-5,
            "empty_rows": "ok",
            "upload_mismatched": 0.0,
            "decode_graph_f32_max_rel_error": 0.3,
            "decode_graph_bf16_max_rel_error": 0.3,
            "decode_graph_rows": 3,
            "decode_graph_tokens_equal": 1,
            "passed": false,
        });
        let Value::Object(figures) = figures else {
            unreachable!()
        };
        let finding = |kernel, problem: &str| Finding {
            kernel,
            problem: problem.into(),
        };
        KernelOutcome {
            ran: true,
            figures: Some(figures),
            findings: vec![
                finding(Kernel::Sampling, "5 of 8 rows drew the reference's token"),
                finding(
                    Kernel::DecodeGraphs,
                    "1 of 3 rows drew the step's greedy token",
                ),
            ],
            error: None,
        }
    }

    fn line<'a>(report: &'a KernelReport, family: &str) -> &'a FamilyReport {
        report
            .families
            .iter()
            .find(|f| f.family == family)
            .unwrap_or_else(|| panic!("no line for {family}"))
    }

    fn parity_only() -> Report {
        Report {
            device: "cuda".into(),
            model: "preset tiny (seed 0)".into(),
            prompts: 1,
            new_tokens: 2,
            cpu_greedy_tokens: vec![vec![7, 8]],
            results: vec![DtypeParity {
                dtype: "bf16",
                logits_rel_error: 0.01,
                logits_max_abs_error: 0.02,
                greedy_matching: vec![2],
                greedy_tokens: vec![vec![7, 8]],
                engine_greedy_matching: vec![2, 2],
                pushed_logits_max_abs_error: Some(0.0),
            }],
            kernels: None,
            kernel_families: None,
            kernel_check_error: None,
        }
    }

    #[test]
    fn a_failed_family_fails_its_own_line_and_the_parity_figures_stay() {
        let on = |k| family_on(k, &[], &[]);
        let kernels = kernel_report(some_failed(), on);
        assert_eq!(line(&kernels, "sample_rows").status, FamilyStatus::Failed);
        assert_eq!(
            line(&kernels, "sample_rows").figures["sampling_tokens_equal"],
            5
        );
        assert_eq!(
            line(&kernels, "grouped_attention").status,
            FamilyStatus::Passed
        );
        // Its figures only: the split kernel's are its own family's.
        let attention = &line(&kernels, "grouped_attention").figures;
        assert_eq!(attention.len(), 2, "{attention:?}");
        assert_eq!(line(&kernels, "train_ops").figures["empty_rows"], "ok");
        // A trial that is off: reported off, its problem kept, failing nothing.
        let graphs = line(&kernels, "decode_graphs");
        assert_eq!(graphs.status, FamilyStatus::Off);
        assert_eq!(graphs.problems.len(), 1);
        assert_eq!(kernels.families.len(), CHECKED_FAMILIES.len());
        let err = kernels.verdict().unwrap_err().to_string();
        assert!(
            err.contains("sample_rows") && !err.contains("decode_graphs"),
            "{err}"
        );

        let report = serde_json::to_value(parity_only().with_kernels(Some(kernels))).unwrap();
        assert_eq!(report["results"][0]["logits_rel_error"], 0.01);
        assert_eq!(
            report["results"][0]["engine_greedy_matching"],
            serde_json::json!([2, 2])
        );
        assert_eq!(report["kernels"]["passed"], false);
        assert_eq!(report["kernels"]["sampling_rows"], 8);
        let families = report["kernel_families"].as_array().unwrap();
        assert!(
            families
                .iter()
                .any(|f| f["family"] == "sample_rows" && f["status"] == "failed")
        );
    }

    #[test]
    fn a_trial_that_is_off_and_did_not_run_fails_nothing() {
        // The check stopped at a family that did not run: no figures, each family's
        // finding from the start-up check.
        let outcome = KernelOutcome {
            ran: true,
            figures: None,
            findings: vec![Finding {
                kernel: Kernel::DecodeGraphs,
                problem: "did not run: CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            }],
            error: Some("the decode_graphs kernel check did not run".into()),
        };
        let kernels = kernel_report(outcome, |k| family_on(k, &[], &[]));
        assert!(kernels.verdict().is_ok());
        assert_eq!(line(&kernels, "decode_graphs").status, FamilyStatus::Off);
        assert!(line(&kernels, "decode_graphs").problems[0].contains("did not run"));
        assert!(
            kernels
                .families
                .iter()
                .filter(|f| f.family != "decode_graphs")
                .all(|f| f.status != FamilyStatus::Failed)
        );
        let report = serde_json::to_value(parity_only().with_kernels(Some(kernels))).unwrap();
        assert!(report["kernels"].is_null());
        assert_eq!(
            report["results"][0]["greedy_matching"],
            serde_json::json!([2])
        );
        assert!(
            report["kernel_check_error"]
                .as_str()
                .unwrap()
                .contains("decode_graphs")
        );

        // The same trial turned on: its line fails, and the command with it.
        let outcome = KernelOutcome {
            ran: true,
            findings: vec![Finding {
                kernel: Kernel::DecodeGraphs,
                problem: "did not run: CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            }],
            ..KernelOutcome::default()
        };
        let kernels = kernel_report(outcome, |k| family_on(k, &[Kernel::DecodeGraphs], &[]));
        assert_eq!(line(&kernels, "decode_graphs").status, FamilyStatus::Failed);
        assert!(
            kernels
                .verdict()
                .unwrap_err()
                .to_string()
                .contains("decode_graphs")
        );
    }

    #[test]
    fn a_check_that_could_not_run_judges_no_family_and_fails() {
        let outcome = KernelOutcome {
            error: Some("CUDA device 0 is unavailable".into()),
            ..KernelOutcome::default()
        };
        let kernels = kernel_report(outcome, |_| true);
        assert!(kernels.families.is_empty() && kernels.figures.is_none());
        let err = kernels.verdict().unwrap_err().to_string();
        assert!(
            err.contains("did not run") && err.contains("unavailable"),
            "{err}"
        );
    }

    #[test]
    fn which_families_are_on_and_whose_figures_are_whose() {
        assert!(family_on(Kernel::Attention, &[], &[]));
        assert!(!family_on(Kernel::Attention, &[], &[Kernel::Attention]));
        assert!(!family_on(Kernel::DecodeGraphs, &[], &[]));
        assert!(family_on(
            Kernel::DecodeGraphs,
            &[Kernel::DecodeGraphs],
            &[]
        ));
        assert!(!family_on(
            Kernel::DecodeGraphs,
            &[Kernel::DecodeGraphs],
            &[Kernel::DecodeGraphs]
        ));
        // Every figure of the check belongs to one of the families it covers.
        for name in some_failed().figures.unwrap().keys() {
            match figure_family(name) {
                Some(k) => assert!(CHECKED_FAMILIES.contains(&k), "{name}"),
                None => assert_eq!(name, "passed"),
            }
        }
        assert_eq!(
            figure_family("attention_split_f32_max_abs_error"),
            Some(Kernel::SplitAttention)
        );
    }
}
