//! `rollout-worker bench`: new tokens per second on the benchmark shape of the
//! rollout-worker issue — P prompts × G completions of the 46-token start-position policy
//! prompt, a fixed number of new tokens each (end-of-text ignored, so every row runs full
//! length) — and one stream alone. `bench/compare_transformers.py` runs Hugging Face
//! transformers on the same shape in the same run.

use std::io::Write;
use std::time::Instant;

use std::sync::Arc;

use rookworld_lm::Gpt2;
use rookworld_lm::cli::{ModelArgs, SamplingArgs};
use rookworld_lm::generate::{GenerationConfig, generate_batch};
use rookworld_service::logging::Progress;

use crate::engine::{EngineConfig, EngineError, Request, Scheduler, prepare_model};

pub use crate::engine::BENCH_PROMPT;

/// Options of `rollout-worker bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompts per batch (P).
    #[arg(allow_negative_numbers = true, long, default_value_t = 4)]
    pub prompts: usize,
    /// Completions per prompt (G).
    #[arg(
        allow_negative_numbers = true,
        short = 'n',
        long = "num-completions",
        default_value_t = 8
    )]
    pub n: usize,
    /// How tokens are drawn; every completion runs to --max-new-tokens (end-of-text
    /// ignored), so that each measurement generates the same number of tokens.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Timed repetitions; the fastest is reported.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub repeat: usize,
    /// Measure only the engine on the batch (no single stream, no reference): for profiling.
    #[arg(long)]
    pub batch_only: bool,
}

/// Which generation path a measurement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The engine: grouped prompt caches, continuous batching.
    Engine,
    /// The reference: static batch, each prompt's cache copied to its G rows.
    Reference,
}

/// New tokens per second of `prompts` × `n` completions, best of `repeat`.
fn measure(
    model: &Arc<Gpt2>,
    prompt: &[u32],
    prompts: usize,
    n: usize,
    args: &BenchArgs,
    path: Path,
    runs: &mut Progress,
) -> Result<serde_json::Value, EngineError> {
    let sampling = args.sampling.params();
    let max_new_tokens = args.sampling.max_new_tokens as usize;
    let batch = vec![prompt.to_vec(); prompts];
    let mut best = f64::INFINITY;
    let mut tokens = 0;
    let mut phases = serde_json::Value::Null;
    for _ in 0..args.repeat.max(1) {
        let start = Instant::now();
        tokens = match path {
            Path::Engine => {
                // Every row at once: room for all of them in the KV bound too.
                let kv = prompts * (prompt.len() + n * max_new_tokens);
                let cfg = EngineConfig {
                    max_seqs: prompts * n,
                    max_kv_tokens: kv.max(EngineConfig::default().max_kv_tokens),
                    ..EngineConfig::default()
                };
                let mut engine = Scheduler::new(model.clone(), 0, cfg);
                engine.submit(Request {
                    prompts: batch.clone(),
                    n,
                    max_new_tokens,
                    sampling,
                    seed: 0,
                    ignore_eos: true,
                })?;
                let (samples, stats) = engine.run_to_completion()?;
                // Where a run's time went (host clock; on CUDA the forward's share is
                // its launches, sampling's includes the wait for the device).
                let run = start.elapsed().as_secs_f64();
                if run < best {
                    phases = serde_json::json!({
                        "prefill_seconds": stats.prefill_seconds,
                        "decode_seconds": stats.decode_seconds,
                        "decode_forward_seconds": stats.decode_forward_seconds,
                        "decode_sample_seconds": stats.decode_sample_seconds,
                        "decoded_rows": stats.decode_rows,
                    });
                }
                samples.iter().map(|s| s.completion.ids.len()).sum()
            }
            Path::Reference => {
                let cfg = GenerationConfig {
                    n,
                    max_new_tokens,
                    sampling,
                    seed: 0,
                    ignore_eos: true,
                };
                generate_batch(model, &batch, &cfg, 0)?.new_tokens()
            }
        };
        let seconds = start.elapsed().as_secs_f64();
        best = best.min(seconds);
        runs.tick(&format!("{path:?} {prompts}×{n}: {seconds:.2} s"));
    }
    Ok(serde_json::json!({
        "prompts": prompts,
        "completions_per_prompt": n,
        "new_tokens": tokens,
        "seconds": best,
        "tokens_per_second": tokens as f64 / best,
        "phases": phases,
    }))
}

/// Runs the benchmark and prints one JSON object: the engine on the batch and on one
/// stream, and the reference static-batch path on the batch as an in-run baseline.
pub fn run(args: &BenchArgs, out: &mut impl Write) -> Result<(), EngineError> {
    use rookworld_service::validate::at_least;
    [
        at_least("--prompts", args.prompts as u64, 1),
        at_least("--num-completions", args.n as u64, 1),
        at_least("--repeat", args.repeat as u64, 1),
    ]
    .into_iter()
    .collect::<Result<(), _>>()
    .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
    args.sampling
        .validate()
        .map_err(EngineError::InvalidRequest)?;
    let max_new_tokens = args.sampling.max_new_tokens as usize;
    let loaded = args.model.load()?;
    let prompt = loaded.tokenizer.encode(BENCH_PROMPT)?;
    let context = loaded.model.config().n_positions;
    rookworld_service::validate::fits_context(
        max_new_tokens,
        prompt.len(),
        "the bench prompt",
        context,
    )
    .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
    let reference = Arc::new(loaded.model.clone());
    let model = Arc::new(prepare_model(loaded.model)?);
    // Warm-up: allocator and thread pool.
    let warm = BenchArgs {
        sampling: SamplingArgs {
            max_new_tokens: 4,
            ..args.sampling.clone()
        },
        repeat: 1,
        ..args.clone()
    };
    let mut quiet = Progress::new("warm-up", 0, 1, false);
    measure(&model, &prompt, 1, 1, &warm, Path::Engine, &mut quiet)?;
    let repeat = args.repeat.max(1) as u64;
    let total = if args.batch_only { repeat } else { 3 * repeat };
    let mut runs = Progress::new("bench run", 0, total, true);
    if args.batch_only {
        let batch = measure(
            &model,
            &prompt,
            args.prompts,
            args.n,
            args,
            Path::Engine,
            &mut runs,
        )?;
        return writeln!(out, "{}", serde_json::json!({ "batch": batch }))
            .map_err(|e| EngineError::Failed(format!("<stdout>: {e}")));
    }
    let report = serde_json::json!({
        "source": loaded.source,
        "device": format!("{:?}", loaded.device),
        "dtype": format!("{:?}", model.dtype()),
        "panels": format!("{:?}", model.panel_dtype()),
        "cpu_kernels": rookworld_lm::cpu_gemm::kernels_line(),
        "prompt_tokens": prompt.len(),
        "sampling": args.sampling,
        "batch": measure(&model, &prompt, args.prompts, args.n, args, Path::Engine, &mut runs)?,
        "single": measure(&model, &prompt, 1, 1, args, Path::Engine, &mut runs)?,
        "reference_batch": measure(&reference, &prompt, args.prompts, args.n, args, Path::Reference, &mut runs)?,
    });
    writeln!(out, "{report}").map_err(|e| EngineError::Failed(format!("<stdout>: {e}")))
}
