//! `learner bench`: one GRPO step — reference forward, policy forward/backward, gradient
//! clipping, AdamW — on a model shape and a synthetic batch of P prompts × G completions,
//! timed by phase and printed as one JSON line. `learner/bench/step_vs_pytorch.py` runs
//! it beside PyTorch's equivalent step and prints the ratio.

use std::time::Instant;

use candle_core::{DType, Device};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rookworld_lm::config::Config;
use rookworld_lm::device::DeviceChoice;
use rookworld_lm::{Gpt2, model_io};
use rookworld_service::logging::Progress;
use serde::Serialize;

use crate::settings::{
    BatchArgs, ConfigError, GPU_MICRO_BATCH_GROUPS, MicroBatchGroups, ObjectiveArgs,
};

mod desk;
use rookworld_train::batch::GrpoBatch;
use rookworld_train::loss::LossConfig;
use rookworld_train::optim::{AdamW, AdamWConfig};
use rookworld_train::policy::StepPath;
use rookworld_train::policy::{MatmulPrecision, Trainable};
use rookworld_train::step::{StepConfig, StepReport, accumulate, step_flops};

/// Whether the autograd path trains through `rookworld_lm::train_ops`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrainOps {
    /// The learner's default.
    On,
    /// candle's composed ops and their backwards.
    Off,
}

/// Options of `learner bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Model shape (seeded random weights): gpt2-124m or tiny.
    #[arg(long, default_value = "gpt2-124m")]
    pub preset: String,
    /// The step's batch: P prompts × G completions, in micro-batches.
    #[command(flatten)]
    pub batch: BatchArgs,
    /// Tokens per prompt.
    #[arg(long, allow_negative_numbers = true, default_value_t = 46)]
    pub prompt_tokens: usize,
    /// Tokens per completion.
    #[arg(long, allow_negative_numbers = true, default_value_t = 64)]
    pub completion_tokens: usize,
    /// Measured steps (after one warm-up step); the figures are their mean.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1)]
    pub steps: usize,
    /// The objective (β 0 skips the reference forward).
    #[command(flatten)]
    pub objective: ObjectiveArgs,
    /// Which pass computes the gradients: auto (the fused pass on the CPU, autograd on
    /// CUDA), fused (on CUDA the CUDA backend) or autograd; as `learner train --step-path`.
    #[arg(long, value_parser = crate::settings::choice::<StepPath>(), default_value = "auto")]
    pub path: StepPath,
    /// Training device: cpu, cuda, cuda:N (weights, moments and statistics in f32).
    #[arg(long, env = "ROOKWORLD_DEVICE", default_value = "cpu")]
    pub device: String,
    /// The precision of the step's products: auto (BF16 inputs on CUDA and on a CPU whose AVX512-BF16 dot
    /// products outrun its f32 FMAs, else f32), f32 or bf16 (on the CPU the fused pass's
    /// BF16 products).
    #[arg(long, env = "ROOKWORLD_MATMUL_PRECISION", default_value = "auto")]
    pub matmul_precision: MatmulPrecision,
    /// The old name of --matmul-precision, refused with a line naming it.
    #[command(flatten)]
    pub legacy_precision: rookworld_lm::cli::LegacyPrecision,
    /// The autograd path's layer norms, softmaxes, bias + GELU and head log-probs as
    /// single ops with their own backwards (on, the learner's default), or composed (off).
    #[arg(long, value_enum, default_value = "on")]
    pub train_ops: TrainOps,
    /// Peak of the device in TFLOP/s, for MFU (default: an estimate, see `learner train`).
    #[arg(long, allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
    /// Time every kernel of the measured steps with device events (the fused pass on
    /// CUDA): the report's `kernels`, and a table on stderr.
    #[arg(long)]
    pub profile: bool,
    /// Print the desk estimate of this step on a GPU instead of running it: the pass
    /// counted over a backend that computes nothing (FLOPs, bytes, calls by operation)
    /// and the least time each takes on an H100 and an H200 — as the CUDA backend runs it
    /// today and with BF16 operands and the head kept — beside a decode step of the same
    /// rows. One JSON line, and a table on stderr.
    #[arg(long)]
    pub desk: bool,
    /// Which CUDA kernels the device runs: the binary's kernel flags, parsed once.
    #[arg(skip)]
    pub kernels: rookworld_lm::kernels::KernelChoice,
}

/// The JSON line `learner bench` prints.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub preset: String,
    pub path: &'static str,
    pub device: String,
    /// The matmuls' input dtype: "f32" or "bf16".
    pub matmul_dtype: &'static str,
    /// The CPU kernels the products take ([`rookworld_lm::cpu_gemm::kernels_line`]).
    pub cpu_kernels: String,
    /// Whether the autograd path ran the training ops (`--train-ops`).
    pub train_ops: bool,
    pub threads: usize,
    pub prompts: usize,
    pub group: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub micro_batch_groups: usize,
    pub steps: usize,
    /// Mean seconds of a whole step and of its phases.
    pub step_seconds: f64,
    pub phases: Phases,
    /// Sequence tokens (P·G·(prompt + completion)) per second of step.
    pub tokens_per_second: f64,
    /// FLOPs of the step as a plain trainer computes it (every completion with its
    /// prompt; LM head on completion tokens), and as this step executes them.
    pub model_tflop: f64,
    pub executed_tflop: f64,
    /// executed FLOPs / step seconds / the device's peak.
    pub mfu: f64,
    pub peak_tflops: f64,
    /// Peak resident memory of the process (bytes).
    pub peak_rss_bytes: u64,
    /// On CUDA: device memory in use (total − free) after the last step, the caching
    /// allocator's pool included (bytes).
    pub device_memory_bytes: Option<u64>,
    /// Largest activation plan of a micro-batch (bytes, fused pass).
    pub activation_bytes: usize,
    pub loss: f64,
    pub grad_norm: f64,
    /// With `--profile`: the pass's kernels, by device time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelReport>,
}

/// Where a measured step's device time went (`--profile`), per step.
#[derive(Debug, Serialize)]
pub struct KernelReport {
    /// Device seconds of the pass's kernels: the step's seconds less these are time the
    /// device waited for the host, or ran work outside the pass (clipping, AdamW).
    pub seconds: f64,
    pub launches: f64,
    /// Every kernel (a product by its shape, `gemm M×N×K` and cuBLAS's transposes),
    /// longest first.
    pub by_kernel: Vec<KernelRow>,
}

#[derive(Debug, Serialize)]
pub struct KernelRow {
    pub name: String,
    pub launches: f64,
    pub ms: f64,
    /// Of the kernels' device time.
    pub share: f64,
}

impl KernelReport {
    /// `profile` summed over `steps` steps, per step.
    pub fn new(profile: &rookworld_train::KernelProfile, steps: usize) -> Self {
        let steps = steps.max(1) as f64;
        let total = profile.seconds();
        Self {
            seconds: total / steps,
            launches: profile.launches() as f64 / steps,
            by_kernel: profile
                .by_time()
                .into_iter()
                .map(|(name, t)| KernelRow {
                    name: name.to_owned(),
                    launches: t.launches as f64 / steps,
                    ms: t.seconds * 1e3 / steps,
                    share: if total > 0.0 { t.seconds / total } else { 0.0 },
                })
                .collect(),
        }
    }

    /// The `top` longest kernels as an aligned table, with the rest summed.
    pub fn table(&self, top: usize) -> String {
        let mut out = format!(
            "{:<40} {:>9} {:>10} {:>7}\n",
            "kernel (per step)", "launches", "ms", "share"
        );
        for row in self.by_kernel.iter().take(top) {
            out += &format!(
                "{:<40} {:>9.0} {:>10.3} {:>6.1}%\n",
                row.name,
                row.launches,
                row.ms,
                row.share * 100.0
            );
        }
        let rest = &self.by_kernel[top.min(self.by_kernel.len())..];
        if !rest.is_empty() {
            let (launches, ms, share) = rest.iter().fold((0.0, 0.0, 0.0), |a, r| {
                (a.0 + r.launches, a.1 + r.ms, a.2 + r.share)
            });
            out += &format!(
                "{:<40} {:>9.0} {:>10.3} {:>6.1}%\n",
                format!("({} others)", rest.len()),
                launches,
                ms,
                share * 100.0
            );
        }
        out += &format!(
            "{:<40} {:>9.0} {:>10.3}\n",
            "all kernels",
            self.launches,
            self.seconds * 1e3
        );
        out
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Phases {
    pub reference: f64,
    pub forward: f64,
    pub backward: f64,
    /// The autograd path's forward + backward (it does not split them).
    pub forward_backward: f64,
    pub clip: f64,
    pub optimizer: f64,
}

/// Why `learner bench` could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    /// The desk estimate's pass refused the shape.
    #[error(transparent)]
    Pass(#[from] rookworld_train::backend::Error),
}

impl From<candle_core::Error> for BenchError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

/// Runs the benchmark and prints its JSON line (and, profiled, the kernels' table on
/// stderr).
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    if args.desk {
        args.validate()?;
        let cfg = Config::preset(&args.preset)?;
        let shape = rookworld_train::desk::StepShape {
            prompts: args.batch.prompts_per_step,
            group: args.batch.group_size as usize,
            prompt: args.prompt_tokens,
            completion: args.completion_tokens,
            // As on a GPU.
            micro_batch_groups: match args.batch.micro_batch_groups {
                MicroBatchGroups::Auto => GPU_MICRO_BATCH_GROUPS,
                MicroBatchGroups::Groups(n) => n,
            },
            reference: args.objective.beta > 0.0,
        };
        let (table, json) = desk::report(&cfg, shape, &args.preset)?;
        eprint!("{table}");
        println!("{json}");
        return Ok(());
    }
    let report = bench(args)?;
    if let Some(kernels) = &report.kernels {
        eprint!("{}", kernels.table(20));
    }
    println!(
        "{}",
        serde_json::to_string(&report).expect("report serialises")
    );
    Ok(())
}

/// A seeded batch of the asked shape: random ids, distinct rewards in every group,
/// behaviour log-probs around a sampler's.
pub fn synthetic_batch(args: &BenchArgs, vocab: usize) -> GrpoBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab as u32)).collect() };
    let prompts: Vec<Vec<u32>> = (0..args.batch.prompts_per_step)
        .map(|_| ids(args.prompt_tokens))
        .collect();
    let completions: Vec<Vec<Vec<u32>>> = (0..args.batch.prompts_per_step)
        .map(|_| {
            (0..args.batch.group_size as usize)
                .map(|_| ids(args.completion_tokens))
                .collect()
        })
        .collect();
    let rewards = (0..args.batch.prompts_per_step)
        .map(|p| {
            (0..args.batch.group_size as usize)
                .map(|g| {
                    ((g + p) % args.batch.group_size as usize) as f32 / args.batch.group_size as f32
                })
                .collect()
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed + 1);
    let old = completions
        .iter()
        .map(|group| {
            group
                .iter()
                .map(|c| c.iter().map(|_| -rng.random_range(9.0f32..12.0)).collect())
                .collect()
        })
        .collect();
    GrpoBatch {
        prompts,
        completions,
        rewards,
        old_logprobs: Some(old),
        proximal_logprobs: None,
        stale_prefix: None,
    }
}

impl BenchArgs {
    /// The ranges of the batch shape and the objective (the same rules as `train`).
    fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_service::validate::{at_least, positive};
        self.legacy_precision
            .refuse()
            .map_err(|e| ConfigError::Value(e.to_string()))?;
        self.batch.validate()?;
        at_least("--prompt-tokens", self.prompt_tokens as u64, 1)?;
        at_least("--completion-tokens", self.completion_tokens as u64, 1)?;
        at_least("--steps", self.steps as u64, 1)?;
        if let Some(peak) = self.peak_tflops {
            positive("--peak-tflops", peak)?;
        }
        self.loss_config().map(drop)
    }

    /// The objective at temperature 1 over completions of `--completion-tokens`.
    fn loss_config(&self) -> Result<LossConfig, ConfigError> {
        self.objective.loss_config(
            rookworld_lm::cli::DEFAULT_TEMPERATURE,
            self.completion_tokens as u32,
        )
    }
}

fn bench(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    args.validate()?;
    let cfg = Config::preset(&args.preset)?;
    if args.prompt_tokens + args.completion_tokens > cfg.n_positions {
        return Err(ConfigError::Conflict(format!(
            "{} + {} tokens exceed the context of {}",
            args.prompt_tokens, args.completion_tokens, cfg.n_positions
        ))
        .into());
    }
    let (device, kernels) = args
        .device
        .parse::<DeviceChoice>()
        .and_then(|d| d.open(&args.kernels))?;
    let init = |seed| -> Result<Gpt2, BenchError> {
        let mut model = model_io::init_random(&cfg, seed, DType::F32, &device)?;
        model.set_kernels(kernels.clone());
        args.matmul_precision.apply(&mut model);
        Ok(model)
    };
    let mut policy = Trainable::from_model(&init(args.seed)?)?;
    args.matmul_precision.apply(&mut policy.model);
    policy.model.set_train_ops(args.train_ops == TrainOps::On);
    policy
        .set_step_path(args.path, &args.kernels)
        .map_err(ConfigError::Conflict)?;
    if args.profile {
        policy.profile_kernels().map_err(ConfigError::Conflict)?;
    }
    let reference: Option<Gpt2> = if args.objective.beta > 0.0 {
        Some(init(args.seed)?)
    } else {
        None
    };
    let batch = synthetic_batch(args, cfg.vocab_size);
    let step_cfg = StepConfig {
        loss: args.loss_config()?,
        micro_batch_groups: args.batch.micro_batch_groups.resolve(&device),
        max_grad_norm: 1.0,
    };
    let mut opt = AdamW::new(AdamWConfig::default());
    let mut phases = Phases::default();
    let mut last = (StepReport::default(), 0.0);
    let mut total = 0.0;
    let mut progress = Progress::new("bench step", 0, args.steps.max(1) as u64, true);
    for step in 0..=args.steps.max(1) {
        let started = Instant::now();
        let (mut grads, report) = accumulate(&policy, reference.as_ref(), &batch, &step_cfg)?;
        let t = Instant::now();
        let norm = grads.clip(step_cfg.max_grad_norm, policy.model.kernels())?;
        let clip = t.elapsed().as_secs_f64();
        let t = Instant::now();
        opt.step(&policy.vars, &grads, 1e-5, policy.model.kernels())?;
        policy.recycle(grads);
        device.synchronize()?; // queued kernels count in the step
        let optimizer = t.elapsed().as_secs_f64();
        let seconds = started.elapsed().as_secs_f64();
        if step == 0 {
            policy.take_kernel_profile(); // the warm-up's kernels are not counted
            continue; // warm-up: first touches of every buffer, moments allocated
        }
        if progress.on_terminal() {
            progress.update(step as u64, &format!("{seconds:.2} s/step"));
        } else {
            tracing::info!(step, seconds = format!("{seconds:.3}"), "bench step");
        }
        total += seconds;
        let fused = report.forward_seconds > 0.0;
        phases.reference += report.reference_seconds;
        phases.forward += report.forward_seconds;
        phases.backward += report.backward_seconds;
        if !fused {
            phases.forward_backward += report.forward_backward_seconds;
        }
        phases.clip += clip;
        phases.optimizer += optimizer;
        last = (report, norm);
    }
    let steps = args.steps.max(1) as f64;
    for p in [
        &mut phases.reference,
        &mut phases.forward,
        &mut phases.backward,
        &mut phases.forward_backward,
        &mut phases.clip,
        &mut phases.optimizer,
    ] {
        *p /= steps;
    }
    let step_seconds = total / steps;
    let fused = last.0.forward_seconds > 0.0;
    let model_flops = step_flops(&policy.model, &batch, reference.is_some());
    let executed_flops = if fused {
        executed_flops(&cfg, args, reference.is_some())
    } else {
        model_flops
    };
    let threads = rayon::current_num_threads();
    let matmul_dtype = policy.model.matmul_dtype();
    let peak = args.peak_tflops.map_or_else(
        || rookworld_train::step::device_peak_flops(&device, matmul_dtype),
        |t| t * 1e12,
    );
    let sequence_tokens = args.batch.prompts_per_step
        * args.batch.group_size as usize
        * (args.prompt_tokens + args.completion_tokens);
    Ok(BenchReport {
        preset: args.preset.clone(),
        path: if fused { "fused" } else { "autograd" },
        device: args.device.clone(),
        matmul_dtype: if matmul_dtype.is_some() {
            "bf16"
        } else {
            "f32"
        },
        cpu_kernels: rookworld_lm::cpu_gemm::kernels_line(),
        train_ops: !fused && policy.model.train_ops(),
        threads,
        prompts: args.batch.prompts_per_step,
        group: args.batch.group_size as usize,
        prompt_tokens: args.prompt_tokens,
        completion_tokens: args.completion_tokens,
        micro_batch_groups: step_cfg.micro_batch_groups,
        steps: args.steps.max(1),
        step_seconds,
        phases,
        tokens_per_second: sequence_tokens as f64 / step_seconds,
        model_tflop: model_flops / 1e12,
        executed_tflop: executed_flops / 1e12,
        mfu: executed_flops / step_seconds / peak,
        peak_tflops: peak / 1e12,
        peak_rss_bytes: peak_rss_bytes(),
        device_memory_bytes: device_memory_bytes(&device),
        activation_bytes: last.0.activation_bytes,
        loss: last.0.loss,
        grad_norm: last.1,
        kernels: policy
            .take_kernel_profile()
            .map(|p| KernelReport::new(&p, args.steps.max(1))),
    })
}

/// FLOPs the fused pass executes: the matmul weights once per fed row (prompts once,
/// completions without their last token), 6 per weight (forward 2, backward 4) plus 2
/// for the reference forward; the head's 2 per weight per completion token for each
/// forward and 4 for the backward; attention's score and value products.
fn executed_flops(cfg: &Config, args: &BenchArgs, reference: bool) -> f64 {
    let body = (cfg.n_layer * 12 * cfg.n_embd * cfg.n_embd) as f64;
    let head = (cfg.vocab_size * cfg.n_embd) as f64;
    let (p, g) = (
        args.batch.prompts_per_step as f64,
        args.batch.group_size as f64,
    );
    let (lp, lc) = (args.prompt_tokens as f64, args.completion_tokens as f64);
    let rows = p * (lp + g * (lc - 1.0));
    let predicted = p * g * lc;
    let passes = if reference { 8.0 } else { 6.0 };
    // Keys seen: the prompt's causal triangle, each completion row the prompt and its own
    // causal part; 2 products (QKᵀ, PV) of 2 FLOPs per element, ×3 with the backward.
    let pairs = p * (lp * (lp + 1.0) / 2.0 + g * ((lc - 1.0) * lp + (lc - 1.0) * lc / 2.0));
    let attention = pairs * (cfg.n_layer * cfg.n_embd) as f64 * 4.0 * passes / 2.0;
    passes * (body * rows + head * predicted) + attention
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 where unknown.
/// Device memory in use (total − free) on a CUDA device; `None` elsewhere.
fn device_memory_bytes(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        use candle_core::cuda::cudarc::driver::result::mem_get_info;
        cuda.cuda_stream().context().bind_to_thread().ok()?;
        let (free, total) = mem_get_info().ok()?;
        return Some((total - free) as u64);
    }
    let _ = device;
    None
}

pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_is_reported_per_step_longest_first_with_the_rest_summed() {
        let mut p = rookworld_train::KernelProfile::default();
        for _ in 0..2 {
            p.add("gemm 2304×880×768 TN", 3e-3);
            p.add("pass_layer_norm_fwd", 1e-3);
            p.add("gelu_fwd", 0.25e-3);
            p.add("gelu_fwd", 0.25e-3);
        }
        let r = KernelReport::new(&p, 2);
        assert!((r.seconds - 4.5e-3).abs() < 1e-12);
        assert_eq!(r.launches, 4.0);
        let names: Vec<&str> = r.by_kernel.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(
            names,
            ["gemm 2304×880×768 TN", "pass_layer_norm_fwd", "gelu_fwd"]
        );
        assert_eq!(r.by_kernel[2].launches, 2.0);
        assert!((r.by_kernel[0].ms - 3.0).abs() < 1e-9);
        assert!((r.by_kernel[0].share - 3.0 / 4.5).abs() < 1e-9);
        let table = r.table(1);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(lines[1].starts_with("gemm 2304×880×768 TN"), "{table}");
        assert!(lines[2].starts_with("(2 others)"), "{table}");
        assert!(lines[2].ends_with("33.3%"), "{table}");
        assert!(lines[3].starts_with("all kernels"), "{table}");
    }
}
