//! `learner compare-backends`: the debug mode of the step's backends. A synthetic
//! micro-batch goes through the backend under test and through a CPU backend (the
//! reference: by default with the same BF16 products as the CUDA backend, so that what
//! differs is a kernel, not the rounding of the products), and every buffer is compared in the order the pass writes it
//! (`rookworld_train::compare`): the forward's activations block by block, the log-probs,
//! then each parameter's gradient from the head down to the embedding. One JSON line is
//! printed; when a buffer differs beyond the tolerance the command exits 1 with a line
//! naming the first one, so that one failed run says which kernel is wrong.
//!
//! `--time-passes N` then times N passes (forward with activations, backward) of the
//! backend under test at the same shape.

use std::time::Instant;

use clap::ValueEnum;
use rookworld_lm::config::Config;
#[cfg(feature = "cuda")]
use rookworld_lm::device::DeviceChoice;
use rookworld_train::compare::{self, Checked, Side, Tolerance};
use rookworld_train::cpu::Cpu;
use rookworld_train::cpu::ops::Matmuls;
use rookworld_train::{Activations, Backend, Packed, Weights, packed, weights};
use serde::Serialize;

/// A backend of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompareBackend {
    /// The CUDA backend (a learner built with `--features cuda`): BF16 products, f32 sums.
    Cuda,
    /// The CPU backend with BF16 products and f32 sums (the CUDA backend's maths).
    CpuBf16,
    /// The CPU backend in f32.
    CpuF32,
}

/// A CPU backend as the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reference {
    /// BF16 products and f32 sums: the same rounding as the CUDA backend's products.
    CpuBf16,
    /// f32 throughout: how far mixed precision moves each buffer.
    CpuF32,
}

/// Options of `learner compare-backends`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Model shape (synthetic weights): tiny or gpt2-124m.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// The backend under test.
    #[arg(long, value_enum, default_value = "cuda")]
    pub backend: CompareBackend,
    /// The CPU backend it is compared with.
    #[arg(long, value_enum, default_value = "cpu-bf16")]
    pub reference: Reference,
    /// The CUDA device's ordinal (with `--backend cuda`).
    #[arg(long, default_value_t = 0)]
    pub cuda_device: usize,
    /// Groups in the micro-batch.
    #[arg(long, allow_negative_numbers = true, default_value_t = 2)]
    pub prompts: usize,
    /// Completions per group.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "LEARNER_GROUP_SIZE",
        default_value_t = 8
    )]
    pub group_size: usize,
    /// Tokens per prompt.
    #[arg(long, allow_negative_numbers = true, default_value_t = 12)]
    pub prompt_tokens: usize,
    /// Tokens per completion (a quarter of each group's completions half as long).
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub completion_tokens: usize,
    /// Sampling temperature of the log-probs.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_TEMPERATURE",
        default_value_t = rookworld_lm::cli::DEFAULT_TEMPERATURE
    )]
    pub temperature: f64,
    /// A buffer matches when max |Δ| ≤ atol + rtol · max |reference| (default: 1e-4
    /// against a reference with the same products, 1e-3 against f32).
    #[arg(long, allow_negative_numbers = true)]
    pub atol: Option<f32>,
    /// Default: 2e-2 against a reference with the same products (f32 sums in another
    /// order), 5e-2 against f32 (a product's operands rounded to BF16).
    #[arg(long, allow_negative_numbers = true)]
    pub rtol: Option<f32>,
    /// Passes of the backend under test timed after the comparison (0: none).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub time_passes: usize,
    /// Only time: no reference pass, no comparison.
    #[arg(long)]
    pub no_compare: bool,
    /// Which CUDA kernels the device runs: the binary's kernel flags, parsed once.
    #[arg(skip)]
    pub kernels: rookworld_lm::kernels::KernelChoice,
}

/// A buffer's comparison, as printed.
#[derive(Debug, Serialize)]
struct BufferReport {
    name: String,
    max_abs_diff: f32,
    scale: f32,
    element: usize,
    value: f32,
    reference: f32,
}

impl From<&Checked> for BufferReport {
    fn from(c: &Checked) -> Self {
        Self {
            name: c.name.clone(),
            max_abs_diff: c.max_diff,
            scale: c.scale,
            element: c.at,
            value: c.left,
            reference: c.right,
        }
    }
}

/// The printed line.
#[derive(Debug, Serialize)]
struct Report {
    backend: CompareBackend,
    reference: Reference,
    preset: String,
    shape: String,
    atol: f32,
    rtol: f32,
    buffers_checked: usize,
    skipped: Vec<String>,
    matched: Option<bool>,
    first_divergence: Option<BufferReport>,
    /// The buffer whose difference is largest against its scale.
    closest_to_tolerance: Option<BufferReport>,
    /// Mean seconds of one pass (forward with activations, backward) of the backend under
    /// test, and the activation bytes it planned.
    pass_seconds: Option<f64>,
    activation_bytes: usize,
}

fn validate(args: &CompareArgs, cfg: &Config) -> Result<(), String> {
    let positive = [
        ("--prompts", args.prompts),
        ("--group-size", args.group_size),
        ("--prompt-tokens", args.prompt_tokens),
        ("--completion-tokens", args.completion_tokens),
    ];
    if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(format!("{flag} must be at least 1"));
    }
    if args.prompt_tokens + args.completion_tokens > cfg.n_positions {
        return Err(format!(
            "--prompt-tokens + --completion-tokens = {} exceeds the model's {} positions",
            args.prompt_tokens + args.completion_tokens,
            cfg.n_positions
        ));
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        return Err(format!(
            "--temperature must be a positive number, got {}",
            args.temperature
        ));
    }
    let bad = |v: Option<f32>| v.is_some_and(|v| !(v.is_finite() && v >= 0.0));
    if bad(args.atol) || bad(args.rtol) {
        return Err("--atol and --rtol must be non-negative numbers".into());
    }
    if args.no_compare && args.time_passes == 0 {
        return Err("--no-compare leaves nothing to do without --time-passes".into());
    }
    Ok(())
}

/// Runs the command: prints the report; an error when a buffer diverged.
pub fn run(args: &CompareArgs) -> Result<(), String> {
    let cfg = Config::preset(&args.preset).map_err(|e| e.to_string())?;
    validate(args, &cfg)?;
    match args.backend {
        CompareBackend::Cuda => cuda(args, &cfg),
        CompareBackend::CpuBf16 => compare_on(&Cpu::new(Matmuls::Bf16), args, &cfg),
        CompareBackend::CpuF32 => compare_on(&Cpu::new(Matmuls::F32), args, &cfg),
    }
}

/// The CUDA backend on `--cuda-device`, opened as `train` and `bench` open theirs: the
/// device through [`DeviceChoice::open`] (its own stream, the decode kernels' start-up
/// check, `--disable-kernels` / `--enable-kernels`, `--strict-kernels`),
/// then the step backend's start-up check as `--step-path fused` runs it, so that the step's
/// trials are on here exactly when a step would run them. The backend under test runs even
/// when its own check turned `step_backend` off: naming the buffer that differs is this
/// command's purpose.
#[cfg(feature = "cuda")]
fn cuda(args: &CompareArgs, cfg: &Config) -> Result<(), String> {
    use rookworld_train::kernels::{StepKernel, StepKernels};
    let (device, _) = DeviceChoice::Cuda(args.cuda_device)
        .open(&args.kernels)
        .map_err(|e| e.to_string())?;
    let candle_core::Device::Cuda(cuda) = &device else {
        return Err(format!(
            "CUDA device {} did not open as CUDA",
            args.cuda_device
        ));
    };
    let step = StepKernels::chosen(&args.kernels);
    let findings = rookworld_train::fused::cuda::startup_check(&device, &step);
    step.apply(&format!("cuda:{}", args.cuda_device), &findings)
        .map_err(|e| e.to_string())?;
    let backend = rookworld_train::cuda::Cuda::new(cuda.clone())
        .with_attention(rookworld_train::kernels::attention_form(&step))
        .with_kept_head(step.enabled(StepKernel::HeadKept))
        .with_epilogues(step.enabled(StepKernel::Epilogues));
    compare_on(&backend, args, cfg)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &CompareArgs, _: &Config) -> Result<(), String> {
    Err("--backend cuda: this learner was built without CUDA (cargo build --features cuda)".into())
}

fn compare_on<B: Backend>(backend: &B, args: &CompareArgs, cfg: &Config) -> Result<(), String> {
    let err = |e: rookworld_train::Error| e.to_string();
    let params = weights::synthetic(cfg, 0);
    let (prompts, completions) = packed::synthetic(
        (args.prompts, args.group_size),
        (args.prompt_tokens, args.completion_tokens),
        cfg.vocab_size,
        0,
    );
    let packed = Packed::of(&prompts, &completions);
    let lengths = weights::lengths(cfg);
    let held = compare::upload(backend, &params).map_err(err)?;
    let w = Weights::<B>::new(cfg, held.iter().map(|b| &**b).collect()).map_err(err)?;
    let mut acts = Activations::<B>::default();
    let mut grads = compare::zeros(backend, &lengths).map_err(err)?;
    let (matmuls, default) = match args.reference {
        Reference::CpuBf16 => (Matmuls::Bf16, Tolerance::SAME_PRODUCTS),
        Reference::CpuF32 => (Matmuls::F32, Tolerance::BF16),
    };
    let tol = Tolerance {
        atol: args.atol.unwrap_or(default.atol),
        rtol: args.rtol.unwrap_or(default.rtol),
    };
    let mut report = Report {
        backend: args.backend,
        reference: args.reference,
        preset: args.preset.clone(),
        shape: format!(
            "{} x {} x ({} + {})",
            args.prompts, args.group_size, args.prompt_tokens, args.completion_tokens
        ),
        atol: tol.atol,
        rtol: tol.rtol,
        buffers_checked: 0,
        skipped: Vec::new(),
        matched: None,
        first_divergence: None,
        closest_to_tolerance: None,
        pass_seconds: None,
        activation_bytes: 0,
    };
    if !args.no_compare {
        let left = Side {
            backend,
            weights: &w,
            acts: &mut acts,
            grads: &mut grads,
        };
        let cmp = compare::against_cpu(left, &params, matmuls, (&packed, args.temperature), tol)
            .map_err(err)?;
        report.buffers_checked = cmp.checked.len();
        report.skipped = cmp.skipped.clone();
        report.matched = Some(cmp.first_divergence().is_none());
        report.first_divergence = cmp.first_divergence().map(BufferReport::from);
        report.closest_to_tolerance = cmp
            .checked
            .iter()
            .max_by(|a, b| {
                let r = |c: &Checked| {
                    c.max_diff / (tol.atol + tol.rtol * c.scale).max(f32::MIN_POSITIVE)
                };
                r(a).total_cmp(&r(b))
            })
            .map(BufferReport::from);
    }
    if args.time_passes > 0 {
        let n = packed.targets.len();
        let dlogp = vec![-1.0 / n.max(1) as f32; n];
        let mut pass = || -> Result<(), rookworld_train::Error> {
            rookworld_train::forward(backend, &w, &packed, args.temperature, &mut acts, true)?;
            rookworld_train::backward(
                backend,
                &w,
                &packed,
                &mut acts,
                &dlogp,
                args.temperature,
                &mut grads,
            )?;
            backend.synchronize()
        };
        pass().map_err(err)?; // warm-up: buffers planned, kernels loaded
        let started = Instant::now();
        for _ in 0..args.time_passes {
            pass().map_err(err)?;
        }
        report.pass_seconds = Some(started.elapsed().as_secs_f64() / args.time_passes as f64);
    }
    report.activation_bytes = acts.bytes(backend);
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| e.to_string())?
    );
    match &report.first_divergence {
        Some(d) => Err(format!(
            "{} differs from the {} reference first at {}: max |Δ| {:.3e} against a scale \
             of {:.3e} (element {}: {} vs {})",
            args.backend
                .to_possible_value()
                .map_or("the backend".into(), |v| v.get_name().to_owned()),
            args.reference
                .to_possible_value()
                .map_or("CPU".into(), |v| v.get_name().to_owned()),
            d.name,
            d.max_abs_diff,
            d.scale,
            d.element,
            d.value,
            d.reference
        )),
        None => Ok(()),
    }
}
