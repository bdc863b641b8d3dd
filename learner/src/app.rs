//! The `learner` command line: its commands and their dispatch. `main.rs` only calls
//! [`main`], so every launcher of this code runs exactly the same thing.

use crate::bench_cmd::{self, BenchArgs};
use crate::bench_fleet::{self, BenchFleetArgs};
use crate::bench_push::{self, BenchPushArgs};
use crate::compare_cmd::{self, CompareArgs};
use crate::export_cmd::{self, ExportArgs};
use crate::init_cmd::{self, InitArgs};
use crate::loss_cmd::{self, LossArgs};
use crate::settings::ConfigError;
use crate::sft::{self, SftArgs};
use crate::train::{self, TrainArgs, TrainError};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use rookworld_lm::kernels::KernelChoice;
use rookworld_service::logging::LogArgs;
use rookworld_service::probe::HealthArgs;
use rookworld_service::run_file::{self, RunFileArgs};

/// GRPO learner of the RookWorld trainer.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: LogArgs,
    #[command(flatten)]
    kernels: rookworld_lm::cli::KernelArgs,
    #[command(flatten)]
    run_file: RunFileArgs,
}

/// The command-line interface (every command and option), for run files and tests.
pub fn command() -> clap::Command {
    Cli::command()
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a starting checkpoint (preset random weights, or a converted checkpoint).
    Init(InitArgs),
    /// Write a model as a directory Hugging Face transformers loads
    /// (AutoModelForCausalLM, AutoTokenizer): config, weights, tokenizer, generation config.
    // `--dtype` names the export's dtype here, not the refused old `--precision`; the
    // weights are read on the CPU in f32 whatever `--device` and `--weight-dtype` say.
    #[command(
        mut_arg("precision", |a| a.alias(None)),
        mut_arg("device", |a| a.hide(true)),
        mut_arg("weight_dtype", |a| a.hide(true))
    )]
    Export(ExportArgs),
    /// Print the GRPO loss, its parts and the gradient norm of one batch (JSON).
    Loss(LossArgs),
    /// Supervised warm-up on RookWorld task text (checkpoints, --resume).
    Sft(SftArgs),
    /// GRPO training against the rollout queue (--local: one process with a reward
    /// server and a worker on loopback).
    ///
    /// What a gpt2-124m run takes on the CPU: memory, 3.8 GB RSS measured with random
    /// weights (2-core AMD EPYC) and 7.1 GB in a run of the real model writing full
    /// completions, so give it 8 GB; disk, 0.5 GB of reference weights and 1.5 GB per
    /// checkpoint, every one kept; a checkpoint's write, up to 21 s. The run logs its own
    /// estimate at start ("resources, estimated").
    Train(Box<TrainArgs>),
    /// Time one GRPO step (reference forward, policy forward/backward, clipping, AdamW)
    /// on a synthetic batch; prints one JSON line.
    Bench(BenchArgs),
    /// Debug the step's backends: a synthetic micro-batch through a backend (cuda, or the
    /// CPU's) and a CPU reference, every buffer compared in the pass's order; prints one
    /// JSON line, exit 1 naming the first buffer beyond the tolerance.
    CompareBackends(CompareArgs),
    /// Time weight pushes to a real worker on loopback, phase by phase, beside the floor
    /// (memcpy, raw TCP); prints one JSON line.
    BenchPush(BenchPushArgs),
    /// Time weight pushes to N real worker processes, each in a network namespace behind a
    /// link shaped with tc: the star against relays, the payload against a delta (root;
    /// prints one JSON line).
    BenchFleet(BenchFleetArgs),
    /// Evaluate a checkpoint on chess benchmarks (checkmate-in-one, policy, environment):
    /// a table on a terminal, else one JSON object.
    #[command(mut_arg("temperature", |a| a.default_value("0")))]
    Eval(Box<crate::eval::EvalArgs>),
    /// Ask a running service's gRPC health endpoint (exit 0 when serving).
    Health(HealthArgs),
    /// Run files: `learner config show [--config FILE] [flags]` prints the resolved
    /// settings of `learner train` (defaults, file, environment, flags) as TOML.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print every setting of `learner train` as it would run, without running.
    Show(Box<TrainArgs>),
}

impl Command {
    /// Hands the command the kernel choice the global flags made (parsed once).
    fn choose_kernels(&mut self, kernels: KernelChoice) {
        match self {
            Command::Init(a) => a.model.kernels = kernels,
            Command::Export(a) => a.model.kernels = kernels,
            Command::Sft(a) => a.model.kernels = kernels,
            Command::Train(a) | Command::Config(ConfigCommand::Show(a)) => a.kernels = kernels,
            Command::Bench(a) => a.kernels = kernels,
            Command::CompareBackends(a) => a.kernels = kernels,
            Command::BenchPush(a) => a.kernels = kernels,
            Command::Eval(a) => a.model.kernels = kernels,
            // The CPU only, or no model.
            Command::Loss(_) | Command::Health(_) | Command::BenchFleet(_) => {}
        }
    }
}

/// Parses the command line and runs the command; the process exits with what it returns.
pub fn main() -> std::process::ExitCode {
    rookworld_lm::alloc::keep_freed_memory();
    rookworld_service::env::unset_empty();
    let matches = run_file::parse(Cli::command(), &[("config show", "train")]);
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Command::Train(args) = &mut cli.command {
        args.record = Some(run_file::resolved(&Cli::command(), &matches));
    }
    rookworld_service::logging::init(cli.log.log_format);
    match cli.kernels.choice(&rookworld_train::kernels::names()) {
        Ok(kernels) => cli.command.choose_kernels(kernels),
        Err(e) => return rookworld_lm::cli::exit_with(Err(e)),
    }
    // A benchmark's unfinished work is worth nothing: a signal ends it at once, exit 0.
    let bench = match &cli.command {
        Command::Bench(_) => Some("learner bench"),
        Command::CompareBackends(_) => Some("learner compare-backends"),
        _ => None,
    };
    if let Some(command) = bench
        && let Err(e) = rookworld_service::serve::exit_on_signal(command, || {})
    {
        return rookworld_lm::cli::exit_with(Err(format!("signal handlers: {e}")));
    }
    let result = match &cli.command {
        Command::Init(args) => init_cmd::run(args).map_err(|e| e.to_string()),
        Command::Export(args) => export_cmd::run(args).map_err(|e| e.to_string()),
        Command::Loss(args) => loss_cmd::run(args).map_err(|e| e.to_string()),
        Command::Sft(args) => sft::run(args).map(|_| ()).map_err(|e| e.to_string()),
        Command::Train(args) => train_cmd(args).map_err(|e| e.to_string()),
        Command::Bench(args) => bench_cmd::run(args).map_err(|e| e.to_string()),
        Command::BenchPush(args) => bench_push::run(args).map_err(|e| e.to_string()),
        Command::BenchFleet(args) => bench_fleet::run(args).map_err(|e| e.to_string()),
        Command::CompareBackends(args) => compare_cmd::run(args),
        Command::Eval(args) => crate::eval::run(args).map_err(|e| e.to_string()),
        Command::Health(args) => args.run(),
        Command::Config(ConfigCommand::Show(args)) => {
            show_config(args, &matches).map_err(|e| e.to_string())
        }
    };
    // The one place a command's error becomes its line on stderr.
    rookworld_lm::cli::exit_with(result.map_err(|e| run_file::annotate(&e)))
}

/// Prints the resolved settings of `learner train` (checked as `train` checks them); with
/// `--run-dir RUN` on the command line, the settings that run recorded.
fn show_config(args: &TrainArgs, matches: &clap::ArgMatches) -> Result<(), ConfigError> {
    let show = matches
        .subcommand_matches("config")
        .and_then(|m| m.subcommand_matches("show"))
        .expect("config show matched");
    let given = |id: &str, flag: &str| {
        show.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
            && !run_file::set_by_file(flag)
    };
    if given("run_dir", "--run-dir") {
        return show_recorded(&args.run_dir, given);
    }
    args.validate()?;
    let table = run_file::resolved(&Cli::command(), matches);
    print!("{}", crate::run_record::render(&table, None));
    Ok(())
}

/// Prints `RUN/config.toml`, what `learner train` recorded of the run in `run`; other
/// options of `train` on the command line are refused (they would not change it).
fn show_recorded(
    run: &std::path::Path,
    given: impl Fn(&str, &str) -> bool,
) -> Result<(), ConfigError> {
    let train = Cli::command();
    let train = train.find_subcommand("train").expect("train is a command");
    let others: Vec<String> = train
        .get_arguments()
        .filter(|a| a.get_id() != "run_dir" && !a.is_global_set())
        .filter_map(|a| {
            let flag = format!("--{}", a.get_long()?);
            given(a.get_id().as_str(), &flag).then_some(flag)
        })
        .collect();
    if !others.is_empty() {
        return Err(ConfigError::Conflict(format!(
            "config show --run-dir prints the settings {} recorded; {} would not change them (without --run-dir, config show resolves new settings)",
            run.display(),
            others.join(", ")
        )));
    }
    let path = run.join(crate::run_record::FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ConfigError::Unusable(format!(
            "{}: {e} (no run of learner train recorded its settings there)",
            path.display()
        ))
    })?;
    print!("{text}");
    Ok(())
}

/// Runs `learner train` on a multi-threaded runtime until its last step or a signal.
fn train_cmd(args: &TrainArgs) -> Result<(), TrainError> {
    // Before anything starts or logs: a bad setting is the only line.
    args.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(TrainError::Runtime)?;
    runtime.block_on(async {
        let listen = args.listen_addr();
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| TrainError::Listen {
                addr: listen.to_string(),
                source,
            })?;
        if let Some(addr) = args.metrics_addr()? {
            let bound = crate::metrics::install_exporter(addr)
                .map_err(|source| TrainError::Metrics { addr, source })?;
            tracing::info!(metrics = %bound, "Prometheus metrics at http://{bound}/metrics");
        }
        let summary = train::run(
            args.clone(),
            listener,
            rookworld_service::serve::shutdown_signal(),
        )
        .await?;
        train::print_summary(&summary);
        Ok(())
    })
}
