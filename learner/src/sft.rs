//! `learner sft`: supervised warm-up — next-token cross-entropy on RookWorld task text,
//! with the same optimizer, schedule and checkpoints as GRPO training.
//!
//! Environment-task lines are exact (shakmaty plays the move); policy-task lines come from
//! Stockfish's multipv 5 when an engine is configured, and are left out otherwise (said
//! once at start). Each document is `[50256] + tokens(text) + [50256]`, as RookWorld-LM was
//! trained, and every token after the first is predicted.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use rookworld_chess::rules::standard;
use rookworld_chess::stockfish::{StockfishConfig, StockfishPool};
use rookworld_lm::Tokenizer;
use rookworld_lm::cli::ModelArgs;
use rookworld_service::logging::Progress;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, Loaded, TrainerState};
use crate::prompts::{self, Generator, Source, TaskKind, TaskPrompt};
use rookworld_train::optim::{AdamW, AdamWConfig, Schedule};
use rookworld_train::policy::Trainable;
use rookworld_train::sft_loss::{self, Document};

/// Options of `learner sft`.
#[derive(Debug, Clone, clap::Args)]
pub struct SftArgs {
    /// The starting weights (a checkpoint directory or a preset); ignored on --resume
    /// when the run has a checkpoint.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Run directory: checkpoints go to RUN/checkpoints/.
    #[arg(long)]
    pub run_dir: PathBuf,
    #[command(flatten)]
    pub settings: SftSettings,
    #[command(flatten)]
    pub start: crate::run_dir::RunDirArgs,
    /// Checkpoint every this many steps (and after the last).
    #[arg(long, allow_negative_numbers = true, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// Append one JSON object per step to this file.
    #[arg(long)]
    pub log_jsonl: Option<PathBuf>,
    /// UCI engine for policy-task lines (default: `stockfish` if installed).
    #[arg(long)]
    pub engine: Option<PathBuf>,
    /// Read prompts (with completions) from RookWorld text lines or JSONL instead of
    /// generating them.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Which pass computes the gradients, as `learner train --step-path`: auto (the fused
    /// pass), fused or autograd.
    #[arg(long, value_parser = crate::settings::choice::<rookworld_train::policy::StepPath>(), env = "LEARNER_STEP_PATH", default_value = "auto")]
    pub step_path: rookworld_train::policy::StepPath,
}

/// The settings of [`SftSettings`] a resumed run may change: its length (the schedule
/// stretches to the new total) and the micro-batch split (the same sums).
pub const SFT_RESUMABLE: &[&str] = &["steps", "micro_batch_size"];

/// What a resume of `learner sft` does with each of its options (the run-directories
/// page's lists).
pub fn resume_rules() -> crate::run_dir::ResumeRules {
    use clap::Args;
    crate::run_dir::ResumeRules::of(
        &SftArgs::augment_args(clap::Command::new("sft")),
        &SftSettings::augment_args(clap::Command::new("settings")),
        SFT_RESUMABLE,
    )
}

/// Settings that define the run; a resumed run must keep them, except [`SFT_RESUMABLE`].
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct SftSettings {
    /// Steps in total.
    #[arg(long, allow_negative_numbers = true, default_value_t = 200)]
    pub steps: u64,
    /// Documents per step.
    #[arg(long, allow_negative_numbers = true, default_value_t = 16)]
    pub batch_size: usize,
    /// Documents per forward/backward (gradients accumulate to the step's).
    #[arg(long, allow_negative_numbers = true, default_value_t = 8)]
    pub micro_batch_size: usize,
    #[arg(long, allow_negative_numbers = true, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, allow_negative_numbers = true, default_value_t = 1e-4)]
    pub min_lr: f64,
    #[arg(long, allow_negative_numbers = true, default_value_t = 10)]
    pub warmup_steps: u64,
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.01)]
    pub weight_decay: f64,
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Seed of the prompt generator.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    pub seed: u64,
    /// Fraction of policy-task documents among generated ones (needs an engine).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.5)]
    pub policy_fraction: f64,
    /// Predict only the completions' tokens (the prompt is context, not target).
    #[arg(long)]
    #[serde(default)]
    pub completion_only: bool,
}

impl SftSettings {
    /// Checks ranges (the same rules as `learner train`'s).
    pub fn validate(&self) -> Result<(), crate::settings::ConfigError> {
        use rookworld_service::validate::{at_least, fraction, non_negative, positive};
        [
            at_least("--steps", self.steps, 1),
            at_least("--batch-size", self.batch_size as u64, 1),
            at_least("--micro-batch-size", self.micro_batch_size as u64, 1),
            positive("--lr", self.lr),
            non_negative("--min-lr", self.min_lr),
            non_negative("--weight-decay", self.weight_decay),
            non_negative("--max-grad-norm", self.max_grad_norm),
            fraction("--policy-fraction", self.policy_fraction),
        ]
        .into_iter()
        .collect::<Result<(), _>>()
    }

    /// A fresh AdamW and the schedule these settings ask for.
    fn optimizer(&self) -> (AdamW, Schedule) {
        let opt = AdamW::new(AdamWConfig {
            weight_decay: self.weight_decay,
            ..AdamWConfig::default()
        });
        let schedule = Schedule {
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.steps,
        };
        (opt, schedule)
    }
}

/// One step's numbers (the `--log-jsonl` record).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SftStep {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens: usize,
    pub seconds: f64,
}

/// Why `learner sft` stopped.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Prompts(#[from] prompts::PromptError),
    #[error(transparent)]
    Config(#[from] crate::settings::ConfigError),
    /// A prompt's position could not be read (the text says which).
    #[error("prompt FEN {fen}: {detail}")]
    Position { fen: String, detail: String },
    /// The engine that writes policy-task answers failed.
    #[error("engine{}: {source}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Engine {
        path: Option<PathBuf>,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("{what}: {source}")]
    Log {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    RunDir(#[from] crate::run_dir::RunDirError),
}

impl From<candle_core::Error> for SftError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

/// Turns prompts into training documents, asking the engine for policy lines.
struct Documents {
    source: Source,
    engine: Option<(tokio::runtime::Runtime, StockfishPool)>,
    tokenizer: Tokenizer,
    bos: u32,
    context: usize,
}

impl Documents {
    /// The next document: `[bos] + tokens(prompt + completion) + [bos]`, cut to the
    /// context; with `completion_only`, only the completion's tokens (and the final
    /// end-of-text) are predicted.
    fn next(&mut self, completion_only: bool) -> Result<Document, SftError> {
        for _ in 0..10_000 {
            let p = self.source.next_prompt();
            let Some(completion) = self.complete(&p)? else {
                continue;
            };
            let mut ids = vec![self.bos];
            ids.extend(
                self.tokenizer
                    .encode(&format!("{}{}", p.prompt, completion))?,
            );
            ids.push(self.bos);
            ids.truncate(self.context);
            let mut first = 1;
            if completion_only {
                let prompt = self.tokenizer.encode(&p.prompt)?;
                // The prompt's tokens are a prefix unless BPE merged across the boundary;
                // then the whole document is trained.
                if ids[1..].starts_with(&prompt) && 1 + prompt.len() < ids.len() {
                    first = 1 + prompt.len();
                }
            }
            return Ok(Document { ids, first });
        }
        Err(crate::settings::ConfigError::Conflict(
            "no trainable documents: policy prompts need an engine (--engine), or use --policy-fraction 0"
                .into(),
        )
        .into())
    }

    fn complete(&self, p: &TaskPrompt) -> Result<Option<String>, SftError> {
        if let Some(c) = &p.completion {
            return Ok(Some(c.clone()));
        }
        match (p.kind, &self.engine) {
            (TaskKind::Policy, Some((rt, pool))) => {
                let fen = p.prompt.trim_start_matches("P: ").trim();
                let pos = standard(fen).map_err(|e| SftError::Position {
                    fen: fen.to_owned(),
                    detail: format!("{e:?}"),
                })?;
                let analysis = rt
                    .block_on(pool.analyse(&pos))
                    .map_err(|e| SftError::Engine {
                        path: None,
                        source: Box::new(e),
                    })?;
                let moves: Vec<&str> = analysis.lines.iter().map(|l| l.uci.as_str()).collect();
                let evals: Vec<String> = analysis
                    .lines
                    .iter()
                    .map(|l| python_float(l.eval_pawns))
                    .collect();
                Ok(moves.first().map(|best| {
                    format!(
                        "M: {:<30}E: {:<40}B: {best}",
                        moves.join(" "),
                        evals.join(" ")
                    )
                }))
            }
            _ => Ok(None),
        }
    }
}

/// An eval in pawns written as the data writes it (`0.3`, `-2.07`, `0.0`).
fn python_float(x: f64) -> String {
    let s = format!("{:.2}", (x * 100.0).round() / 100.0);
    let s = s.trim_end_matches('0');
    if s.ends_with('.') {
        format!("{s}0")
    } else {
        s.to_owned()
    }
}

/// The engine for policy-task lines, when `wanted`: `path` or a Stockfish found on the
/// system; `None` (said once) when none is installed.
fn start_engine(
    path: Option<PathBuf>,
    wanted: bool,
) -> Result<Option<(tokio::runtime::Runtime, StockfishPool)>, SftError> {
    if !wanted {
        return Ok(None);
    }
    let Some(path) = path.or_else(rookworld_chess::stockfish::find_stockfish) else {
        tracing::warn!("no Stockfish found: supervised data is environment-task only");
        return Ok(None);
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SftError::Runtime)?;
    let pool = rt
        .block_on(StockfishPool::start(StockfishConfig::new(&path)))
        .map_err(|e| SftError::Engine {
            path: Some(path.clone()),
            source: Box::new(e),
        })?;
    Ok(Some((rt, pool)))
}

/// One supervised step (`step` counted from 0): a batch of documents, gradients over
/// micro-batches, clipping, AdamW.
fn sft_step(
    policy: &Trainable,
    opt: &mut AdamW,
    schedule: &Schedule,
    docs: &mut Documents,
    s: &SftSettings,
    step: u64,
) -> Result<SftStep, SftError> {
    let started = Instant::now();
    let batch: Vec<Document> = (0..s.batch_size)
        .map(|_| docs.next(s.completion_only))
        .collect::<Result<_, _>>()?;
    let total_tokens: usize = batch.iter().map(|d| d.ids.len() - d.first.max(1)).sum();
    let (mut grads, loss) = sft_loss::gradients(policy, &batch, s.micro_batch_size)?;
    let grad_norm = grads.clip(s.max_grad_norm, policy.model.kernels())?;
    let lr = schedule.lr_at(step);
    opt.step(&policy.vars, &grads, lr, policy.model.kernels())?;
    policy.recycle(grads);
    let record = SftStep {
        step: step + 1,
        loss,
        grad_norm,
        lr,
        tokens: total_tokens,
        seconds: started.elapsed().as_secs_f64(),
    };
    Ok(record)
}

/// Supervised warm-up in-process, as `learner train` runs it before GRPO: `s.steps` steps
/// on generated documents (policy-task lines need Stockfish; without it, environment
/// lines only), with an optimizer and schedule of its own. Calls `on_step` after each.
///
/// `stopped` is asked before each step: once it says yes, the warm-up ends there and
/// returns the steps done (fewer than `s.steps`).
pub fn warm_up(
    policy: &Trainable,
    s: &SftSettings,
    engine: Option<PathBuf>,
    stopped: impl Fn() -> bool,
    mut on_step: impl FnMut(&SftStep),
) -> Result<Vec<SftStep>, SftError> {
    let cfg = policy.model.config();
    let mut docs = Documents {
        source: Source::Generated(Box::new(Generator::new(s.seed, s.policy_fraction))),
        engine: start_engine(engine, s.policy_fraction > 0.0)?,
        tokenizer: Tokenizer::gpt2(),
        bos: cfg.bos_token_id,
        context: cfg.n_positions,
    };
    let (mut opt, schedule) = s.optimizer();
    let mut out = Vec::new();
    for step in 0..s.steps {
        if stopped() {
            break;
        }
        let record = sft_step(policy, &mut opt, &schedule, &mut docs, s, step)?;
        on_step(&record);
        out.push(record);
    }
    Ok(out)
}

/// Runs (or resumes) supervised training; returns every step's numbers of this process.
pub fn run(args: &SftArgs) -> Result<Vec<SftStep>, SftError> {
    let s = &args.settings;
    s.validate()?;
    rookworld_service::validate::at_least("--checkpoint-every", args.checkpoint_every, 1)?;
    let settings = serde_json::to_value(s).expect("settings serialise");
    let mut source = match &args.prompts {
        Some(path) => Source::File {
            prompts: prompts::load(path)?,
            next: 0,
        },
        None => Source::Generated(Box::new(Generator::new(s.seed, s.policy_fraction))),
    };
    let expect = crate::run_dir::Expect {
        settings: &settings,
        resumable: SFT_RESUMABLE,
        steps: s.steps,
    };
    // The device opened once: a resumed run continues where a fresh one would run.
    let (device, kernels) = args.model.open()?;
    let opened = crate::run_dir::open(&args.run_dir, &args.start, &device, expect)?;
    let _lock = opened.lock;
    let (mut policy, mut opt, schedule, start) = match opened.loaded {
        Some(Loaded {
            dir,
            policy,
            opt,
            state,
        }) => {
            source.restore(&state.cursor)?;
            tracing::info!(step = state.step, dir = %dir.display(), "resumed");
            let mut policy = policy;
            policy.model.set_kernels(kernels);
            // The schedule follows the settings: a longer run stretches it.
            (policy, opt, s.optimizer().1, state.step)
        }
        None => {
            let loaded = args.model.load_on((device, kernels))?;
            let policy = Trainable::from_model(&loaded.model)?;
            let (opt, schedule) = s.optimizer();
            (policy, opt, schedule, 0)
        }
    };
    policy
        .set_step_path(args.step_path, &args.model.kernels)
        .map_err(crate::settings::ConfigError::Conflict)?;
    let engine = start_engine(
        args.engine.clone(),
        s.policy_fraction > 0.0 && args.prompts.is_none(),
    )?;
    let cfg = policy.model.config().clone();
    let mut docs = Documents {
        source,
        engine,
        tokenizer: Tokenizer::gpt2(),
        bos: cfg.bos_token_id,
        context: cfg.n_positions,
    };
    let mut log = match &args.log_jsonl {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| SftError::Log {
                    what: format!("--log-jsonl {}", path.display()),
                    source,
                })?,
        ),
        None => None,
    };
    let mut out = Vec::new();
    let mut progress = Progress::new("sft step", start, s.steps, true);
    // From here a signal ends the run after the step in progress, with a checkpoint.
    let stop = rookworld_service::serve::stop_on_signal().map_err(SftError::Runtime)?;
    let mut saved = start;
    for step in start..s.steps {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            progress.finish();
            let checkpoint = if saved < step {
                let dir = save(
                    &args.run_dir,
                    &policy,
                    &opt,
                    &docs,
                    schedule,
                    &settings,
                    step,
                )?;
                format!("checkpoint {} written", dir.display())
            } else {
                "no checkpoint written (nothing new to save)".into()
            };
            eprintln!(
                "sft: stopped by a signal after step {step} of {}; {checkpoint}; \
                 `--start resume` continues it",
                s.steps
            );
            return Ok(out);
        }
        let record = sft_step(&policy, &mut opt, &schedule, &mut docs, s, step)?;
        if progress.on_terminal() {
            let detail = format!("loss {:.4}  grad norm {:.3}", record.loss, record.grad_norm);
            progress.update(step + 1, &detail);
        } else {
            tracing::info!(
                step = record.step,
                loss = format!("{:.4}", record.loss),
                grad_norm = format!("{:.3}", record.grad_norm),
                lr = format!("{:.3e}", record.lr),
                seconds = format!("{:.2}", record.seconds),
                "sft step"
            );
        }
        if let Some(f) = log.as_mut() {
            writeln!(
                f,
                "{}",
                serde_json::to_string(&record).expect("record serialises")
            )
            .map_err(|source| SftError::Log {
                what: "--log-jsonl".into(),
                source,
            })?;
        }
        out.push(record);
        let done = step + 1;
        if done % args.checkpoint_every.max(1) == 0 || done == s.steps {
            let dir = save(
                &args.run_dir,
                &policy,
                &opt,
                &docs,
                schedule,
                &settings,
                done,
            )?;
            tracing::info!(dir = %dir.display(), "checkpoint written");
            saved = done;
        }
    }
    Ok(out)
}

/// Writes the checkpoint of `learner sft` after `done` steps; returns its directory.
fn save(
    run_dir: &std::path::Path,
    policy: &Trainable,
    opt: &AdamW,
    docs: &Documents,
    schedule: Schedule,
    settings: &serde_json::Value,
    done: u64,
) -> Result<PathBuf, SftError> {
    let state = TrainerState {
        step: done,
        version: 0,
        adamw: opt.cfg,
        optimizer_steps: opt.steps,
        schedule,
        cursor: docs.source.cursor(),
        settings: settings.clone(),
        queue: None,
        eval: None,
        record: None,
    };
    Ok(checkpoint::save(run_dir, policy, opt, &state)?)
}

#[cfg(test)]
mod tests {
    #[test]
    fn evals_are_written_like_python_floats() {
        assert_eq!(super::python_float(0.3), "0.3");
        assert_eq!(super::python_float(-2.07), "-2.07");
        assert_eq!(super::python_float(0.0), "0.0");
        assert_eq!(super::python_float(999.9), "999.9");
        assert_eq!(super::python_float(1.0), "1.0");
    }
}
