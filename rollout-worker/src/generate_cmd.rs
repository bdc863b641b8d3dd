//! `rollout-worker generate`: G completions for each prompt, one JSON object per prompt.
//!
//! Each prompt is fed as `[bos] + tokens(prompt)`, where `bos` is the model's
//! `bos_token_id`: end-of-text (50256) for RookWorld-LM, exactly as its training
//! documents began. `prompt_ids` in the output are the ids fed.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rookworld_service::logging::Progress;

use rookworld_lm::cli::{ModelArgs, SamplingArgs};
use rookworld_lm::{Error, Result};
use serde::Serialize;

use crate::engine::{EngineArgs, EngineError, Request, Scheduler, prepare_model};

/// Options of `rollout-worker generate`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A prompt (repeatable), e.g. 'P: <FEN>    M:'.
    #[arg(long = "prompt", value_name = "TEXT")]
    pub prompts: Vec<String>,
    /// File with one prompt per line (blank lines skipped).
    #[arg(long, value_name = "FILE")]
    pub prompts_file: Option<PathBuf>,
    /// Completions per prompt (G).
    #[arg(
        allow_negative_numbers = true,
        short = 'n',
        long = "num-completions",
        default_value_t = 1
    )]
    pub n: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Sampling seed: the same seed, weights and device give the same completions.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Serialize)]
struct CompletionJson {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<f32>,
    finish_reason: &'static str,
    weight_version: u64,
}

/// Timing of the whole run (all prompts generate together).
#[derive(Debug, Serialize)]
struct TimingJson {
    prefill_seconds: f64,
    decode_seconds: f64,
    /// Tokens sampled for this prompt.
    new_tokens: usize,
    run_tokens_per_second: f64,
}

#[derive(Debug, Serialize)]
struct PromptJson {
    prompt: String,
    prompt_ids: Vec<u32>,
    completions: Vec<CompletionJson>,
    timing: TimingJson,
}

impl GenerateArgs {
    /// Prompts from `--prompt` then `--prompts-file`; at least one is required.
    fn collect_prompts(&self) -> Result<Vec<String>> {
        let mut prompts = self.prompts.clone();
        if let Some(path) = &self.prompts_file {
            let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
            for line in std::io::BufReader::new(file).lines() {
                let line = line.map_err(|e| io_error(path, e))?;
                let line = line.trim_end_matches('\r');
                if !line.trim().is_empty() {
                    prompts.push(line.to_owned());
                }
            }
        }
        if prompts.is_empty() {
            return Err(Error::InvalidArgument(
                "no prompts: give --prompt TEXT or --prompts-file FILE".into(),
            ));
        }
        Ok(prompts)
    }
}

fn io_error(path: &std::path::Path, e: std::io::Error) -> Error {
    Error::InvalidArgument(format!("{}: {e}", path.display()))
}

/// Runs the command on the generation engine (every prompt is one request's prompt, so
/// all generate together under continuous batching), writing one JSON line per prompt to
/// `out`. Every prompt is checked before anything is generated.
pub fn run(args: &GenerateArgs, out: &mut impl Write) -> std::result::Result<(), EngineError> {
    args.sampling.validate().map_err(Error::InvalidArgument)?;
    rookworld_service::validate::at_least("--num-completions", args.n as u64, 1)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let sampling = args.sampling.params();
    let max_new_tokens = args.sampling.max_new_tokens as usize;
    let prompts = args.collect_prompts()?;
    let loaded = args.model.load()?;
    tracing::info!(
        source = %loaded.source,
        device = ?loaded.device,
        dtype = ?loaded.model.dtype(),
        "model loaded"
    );

    let bos = loaded.model.config().bos_token_id;
    let encoded = prompts
        .iter()
        .map(|p| loaded.tokenizer.encode_prompt(bos, p))
        .collect::<Result<Vec<_>>>()?;

    let context = loaded.model.config().n_positions;
    for (i, ids) in encoded.iter().enumerate() {
        if ids.len() + max_new_tokens > context {
            return Err(Error::InvalidArgument(format!(
                "prompt {i}: {} tokens and --max-new-tokens {} exceed the model's {context}-token context; use --max-new-tokens {} or less",
                ids.len(),
                max_new_tokens,
                context.saturating_sub(ids.len())
            ))
            .into());
        }
    }
    let model = Arc::new(prepare_model(loaded.model)?);
    let mut engine = Scheduler::new(model, 0, args.engine.config());
    engine.submit(Request {
        prompts: encoded.clone(),
        n: args.n,
        max_new_tokens,
        sampling,
        seed: args.seed,
        ignore_eos: false,
    })?;
    // From here Ctrl-C or SIGTERM ends the run: the prompts whose completions are all
    // finished are written, the rest abandoned.
    let stop = rookworld_service::serve::stop_on_signal()
        .map_err(|e| EngineError::Failed(format!("signal handlers: {e}")))?;
    let total = (prompts.len() * args.n) as u64;
    let mut progress = Progress::new("generate", 0, total, true);
    let started = Instant::now();
    let (samples, stats) = engine.run_reporting(
        || stop.load(Ordering::Relaxed),
        |done| {
            let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-9);
            progress.update(done as u64, &format!("completions  {rate:.1}/s"));
        },
    )?;
    progress.finish();
    let seconds = started.elapsed().as_secs_f64();
    let stopped = engine.has_work();
    let mut counts = vec![0; prompts.len()];
    for s in &samples {
        counts[s.prompt_index as usize] += 1;
    }
    let whole: Vec<bool> = counts.iter().map(|&c| c == args.n).collect();
    let written = whole.iter().filter(|&&w| w).count();
    let total_tokens: usize = samples.iter().map(|s| s.completion.ids.len()).sum();
    let mut samples = samples.into_iter().peekable();
    for (i, (prompt, prompt_ids)) in prompts.iter().zip(encoded).enumerate() {
        let mut completions = Vec::with_capacity(args.n);
        while let Some(s) = samples.next_if(|s| s.prompt_index as usize == i) {
            if !whole[i] {
                continue;
            }
            completions.push(CompletionJson {
                text: loaded.tokenizer.decode(&s.completion.ids)?,
                ids: s.completion.ids,
                logprobs: s.completion.logprobs,
                finish_reason: s.completion.finish_reason.as_str(),
                weight_version: s.weight_version,
            });
        }
        if !whole[i] {
            continue;
        }
        let line = PromptJson {
            prompt: prompt.clone(),
            prompt_ids,
            timing: TimingJson {
                prefill_seconds: stats.prefill_seconds,
                decode_seconds: stats.decode_seconds,
                new_tokens: completions.iter().map(|c| c.ids.len()).sum(),
                run_tokens_per_second: total_tokens as f64 / seconds.max(1e-9),
            },
            completions,
        };
        let json = serde_json::to_string(&line).expect("output serialises");
        writeln!(out, "{json}").map_err(|e| io_error(std::path::Path::new("<stdout>"), e))?;
    }
    if stopped {
        eprintln!(
            "generate: stopped by a signal; {written} of {} prompts finished and written, \
             the rest abandoned",
            prompts.len()
        );
    }
    Ok(())
}
