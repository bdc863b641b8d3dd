//! `learner eval`: a checkpoint on held-out chess benchmarks — generated with the rollout
//! engine (batched, the workers' sampling code), graded with the reward server's code.
//!
//! - [`suites`]: the suites' items and the grading of one completion.
//! - [`report`]: per-suite metrics, pass@1 and pass@K, the table and the JSON.
//! - [`stockfish`]: `--engine PATH`, the policy suite ranked by the user's Stockfish.
//! - [`periodic`]: `learner train --eval-every`, the suites on a thread of their own.

mod error;
pub mod periodic;
pub mod report;
pub mod stockfish;
pub mod suites;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rookworld_generation::{EngineArgs, EngineConfig, Request, Scheduler, prepare_model};
use rookworld_lm::cli::{ModelArgs, SamplingArgs};
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Gpt2, Tokenizer};

use crate::settings::ConfigError;

pub use error::EvalError;
pub use report::{Report, SuiteReport};
pub use suites::{Completions, Graded, Item, Suite};

/// `learner eval` options.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Suites, comma-separated: checkmate-in-one, policy, environment.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "checkmate-in-one,policy,environment"
    )]
    pub suite: Vec<String>,
    /// Evaluate only the first N items of each suite.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Completions per item (K); pass@1 is estimated over them and pass@K reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub samples: u32,
    /// Seed of the samples.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// How completions are drawn: greedily by default here (`learner` sets this
    /// command's temperature default to 0), the other settings as everywhere.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A UCI engine (Stockfish) that re-analyses the policy suite's positions (multipv 5)
    /// and ranks their moves, instead of the evaluations written on the data lines.
    #[arg(long = "engine", value_name = "PATH", env = "LEARNER_EVAL_ENGINE")]
    pub engine_path: Option<PathBuf>,
    /// Search depth of --engine.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub engine_depth: u32,
    /// Engine processes searching at once (default: one per core).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub engine_processes: Option<u32>,
    /// A directory with replacements of the suites' data files (same names).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Write the report (one JSON object) here as well.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write every graded completion here, one JSON object per line.
    #[arg(long)]
    pub dump: Option<PathBuf>,
}

impl EvalArgs {
    /// The sampling, checked: several samples of an item need a temperature above 0
    /// (greedy samples would all be the same).
    fn sampling(&self) -> Result<SamplingParams, ConfigError> {
        self.sampling.validate().map_err(ConfigError::Value)?;
        if self.samples > 1 && self.sampling.temperature == 0.0 {
            return Err(ConfigError::Conflict(format!(
                "--samples {} at --temperature 0 (greedy) would give {} equal samples: give --temperature above 0 (e.g. 1)",
                self.samples, self.samples
            )));
        }
        Ok(self.sampling.params())
    }
}

/// How often a log (stderr not a terminal) gets a progress line of a suite.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Runs `learner eval`: the report on stdout (a table on a terminal, else the JSON). On
/// Ctrl-C or SIGTERM it stops within a decode step (or a Stockfish search), says what it
/// finished, writes no file and returns `Ok`.
pub fn run(args: &EvalArgs) -> Result<(), EvalError> {
    let suites = args
        .suite
        .iter()
        .map(|s| Suite::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let sampling = args.sampling()?;
    // The output files before any work: an unwritable path fails at once. Each is written
    // whole at the end, or not at all.
    let out = args
        .out
        .as_deref()
        .map(|p| Whole::check("--out", p))
        .transpose()?;
    let dump = args
        .dump
        .as_deref()
        .map(|p| Whole::check("--dump", p))
        .transpose()?;
    // From here a signal stops the evaluation instead of killing the process.
    let stop = rookworld_service::serve::stop_on_signal().map_err(EvalError::Signals)?;
    let stopped = |what: &str| {
        eprintln!("eval: stopped by a signal {what}; no report written");
        Ok(())
    };
    // Every suite's data before the model: a bad file fails at once.
    let mut work = Vec::new();
    for suite in suites {
        let mut items = suite.items(args.data_dir.as_deref())?;
        items.truncate(args.limit.unwrap_or(usize::MAX));
        work.push((suite, items));
    }
    let reanalysis = stockfish::Reanalysis {
        depth: args.engine_depth,
        processes: args.engine_processes.map_or_else(
            || std::thread::available_parallelism().map_or(1, usize::from),
            |n| n as usize,
        ),
    };
    let ranking = match &args.engine_path {
        Some(path) => {
            for (_, items) in &mut work {
                match reanalysis.rerank(items, path, &stop) {
                    Err(EvalError::Stopped) => {
                        return stopped("while --engine ranked the policy items");
                    }
                    other => other?,
                }
            }
            reanalysis.describe(path)
        }
        None => "the data lines' evaluations".to_owned(),
    };
    let loaded = args.model.load()?;
    tracing::info!(source = %loaded.source, "model loaded");
    let model = Arc::new(prepare_model(loaded.model)?);
    let mut reports = Vec::new();
    let mut dumped = Vec::new();
    let total = work.len();
    for (i, (suite, items)) in work.iter().enumerate() {
        let label = format!("eval {}/{total}: {}", i + 1, suite.name());
        let samples = items.len() * args.samples as usize;
        eprintln!("{label}, {} items × {} samples…", items.len(), args.samples);
        let started = Instant::now();
        let progress = SuiteProgress::new(&label, samples);
        let eval = Evaluation {
            model: model.clone(),
            tokenizer: &loaded.tokenizer,
            engine: args.engine.config(),
            sampling,
            samples: args.samples as usize,
            max_new_tokens: args.sampling.max_new_tokens as usize,
            seed: args.seed,
            stop: Some(&stop),
            progress: Some(&|done| progress.show(done)),
        };
        let result = eval.suite(*suite, items);
        let done = progress.finish();
        let (report, graded) = match result {
            Err(_) if stop.load(Ordering::Relaxed) => {
                return stopped(&format!(
                    "in suite {}/{total} ({}: {done} of {samples} samples; {i} suites finished)",
                    i + 1,
                    suite.name()
                ));
            }
            other => other?,
        };
        eprintln!("{label} done in {:.1} s", started.elapsed().as_secs_f64());
        if dump.is_some() {
            report::dump(&mut dumped, *suite, items, &graded)
                .map_err(write_error("--dump", &args.dump))?;
        }
        reports.push(report);
    }
    let report = Report {
        model: loaded.source,
        samples: args.samples as usize,
        temperature: sampling.temperature,
        policy_ranking: ranking,
        suites: reports,
    };
    let json = serde_json::to_string(&report).expect("the report serialises");
    if let Some(dump) = &dump {
        dump.write(&dumped)?;
    }
    if let Some(out) = &out {
        out.write(format!("{json}\n").as_bytes())?;
    }
    use std::io::IsTerminal;
    if std::io::stdout().is_terminal() {
        print!("{}", report.table());
    } else {
        println!("{json}");
    }
    Ok(())
}

/// An output file written whole or not at all: through a temporary file beside it
/// (`.NAME.tmp`), renamed over it once complete.
struct Whole {
    flag: &'static str,
    path: PathBuf,
}

impl Whole {
    /// Checks that the file can be written — its temporary created and removed — before
    /// any work.
    fn check(flag: &'static str, path: &std::path::Path) -> Result<Self, EvalError> {
        let whole = Self {
            flag,
            path: path.to_owned(),
        };
        let tmp = whole.temporary();
        std::fs::File::create(&tmp).map_err(|source| whole.error(source))?;
        let _ = std::fs::remove_file(&tmp);
        Ok(whole)
    }

    fn temporary(&self) -> PathBuf {
        rookworld_lm::model_io::temporary(&self.path)
    }

    fn error(&self, source: std::io::Error) -> EvalError {
        EvalError::Write {
            flag: self.flag,
            path: self.path.clone(),
            source,
        }
    }

    /// Writes `bytes` as the file's whole content.
    fn write(&self, bytes: &[u8]) -> Result<(), EvalError> {
        let tmp = self.temporary();
        let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(source) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(self.error(source));
        }
        Ok(())
    }
}

/// A suite's progress in samples: a line kept up to date on a terminal; in a log, a line
/// when the first samples finish and then every [`PROGRESS_EVERY`] (done, rate, time left).
struct SuiteProgress {
    label: String,
    samples: usize,
    started: Instant,
    bar: std::cell::RefCell<rookworld_service::logging::Progress>,
    /// When the log last got a line (`None`: not yet).
    logged: std::cell::Cell<Option<Instant>>,
    done: std::cell::Cell<usize>,
}

impl SuiteProgress {
    fn new(label: &str, samples: usize) -> Self {
        Self {
            label: label.to_owned(),
            samples,
            started: Instant::now(),
            bar: std::cell::RefCell::new(rookworld_service::logging::Progress::new(
                label,
                0,
                samples as u64,
                true,
            )),
            logged: std::cell::Cell::new(None),
            done: std::cell::Cell::new(0),
        }
    }

    /// `done` samples finished.
    fn show(&self, done: usize) {
        self.done.set(done);
        let seconds = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = done as f64 / seconds;
        let mut bar = self.bar.borrow_mut();
        if bar.on_terminal() {
            bar.update(done as u64, &format!("{rate:.1} samples/s"));
        } else if self
            .logged
            .get()
            .is_none_or(|t| t.elapsed() >= PROGRESS_EVERY)
        {
            self.logged.set(Some(Instant::now()));
            let left = self.samples.saturating_sub(done) as f64 / rate.max(1e-9);
            tracing::info!(
                done,
                samples = self.samples,
                rate = format!("{rate:.1}/s"),
                left = format!("{left:.0} s"),
                "{}",
                self.label
            );
        }
    }

    /// Ends the line; the samples finished.
    fn finish(&self) -> usize {
        self.bar.borrow_mut().finish();
        self.done.get()
    }
}

/// The failure to write `flag`'s file.
fn write_error(
    flag: &'static str,
    path: &Option<PathBuf>,
) -> impl FnOnce(std::io::Error) -> EvalError {
    let path = path.clone().unwrap_or_default();
    move |source| EvalError::Write { flag, path, source }
}

/// What one evaluation generates with.
pub struct Evaluation<'a> {
    pub model: Arc<Gpt2>,
    pub tokenizer: &'a Tokenizer,
    pub engine: EngineConfig,
    pub sampling: SamplingParams,
    pub samples: usize,
    pub max_new_tokens: usize,
    pub seed: u64,
    /// Set when the evaluation is to be abandoned (checked before every decode step).
    pub stop: Option<&'a AtomicBool>,
    /// Told the samples finished so far, as they finish.
    pub progress: Option<&'a dyn Fn(usize)>,
}

impl Evaluation<'_> {
    /// Generates `samples` completions of every item in one batched run and grades
    /// them: the suite's report and every grading, by item then sample.
    pub fn suite(
        &self,
        suite: Suite,
        items: &[Item],
    ) -> Result<(SuiteReport, Vec<Completions>), EvalError> {
        let started = Instant::now();
        let context = self.model.config().n_positions;
        let bos = self.model.config().bos_token_id;
        let prompts = items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let ids = self.tokenizer.encode_prompt(bos, &item.prompt)?;
                let what = format!("{} item {i}", suite.name());
                rookworld_service::validate::fits_context(
                    self.max_new_tokens,
                    ids.len(),
                    &what,
                    context,
                )?;
                Ok(ids)
            })
            .collect::<Result<Vec<_>, EvalError>>()?;
        let mut engine = Scheduler::new(self.model.clone(), 0, self.engine);
        engine.submit(Request {
            prompts,
            n: self.samples,
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling,
            seed: self.seed,
            ignore_eos: false,
        })?;
        let stopped = || self.stop.is_some_and(|s| s.load(Ordering::Relaxed));
        let (samples, _) = engine.run_reporting(stopped, |done| {
            if let Some(progress) = self.progress {
                progress(done);
            }
        })?;
        if engine.has_work() {
            return Err(EvalError::Stopped);
        }
        drop(engine);
        let mut by_item: Vec<Vec<(u32, String)>> = vec![Vec::new(); items.len()];
        for s in samples {
            let text = self.tokenizer.decode(&s.completion.ids)?;
            let text = text.trim_end_matches(['\n', '\r']).to_owned();
            by_item[s.prompt_index as usize].push((s.sample_index, text));
        }
        let graded: Vec<Completions> = by_item
            .into_iter()
            .zip(items)
            .map(|(mut samples, item)| {
                samples.sort_by_key(|(k, _)| *k);
                samples
                    .into_iter()
                    .map(|(_, text)| {
                        let g = item.grade(&text);
                        (text, g)
                    })
                    .collect()
            })
            .collect();
        let seconds = started.elapsed().as_secs_f64();
        Ok((SuiteReport::of(suite, &graded, seconds), graded))
    }
}
