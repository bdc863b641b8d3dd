//! The `learner` command line: its commands and their dispatch. `main.rs` only calls
//! [`main`], so every launcher of this code runs exactly the same thing.

use crate::bench_cmd::{self, BenchArgs};
use crate::bench_push::{self, BenchPushArgs};
use crate::init_cmd::{self, InitArgs};
use crate::loss_cmd::{self, LossArgs};
use crate::settings::ConfigError;
use crate::sft::{self, SftArgs};
use crate::train::{self, TrainArgs, TrainError};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// Print the GRPO loss, its parts and the gradient norm of one batch (JSON).
    Loss(LossArgs),
    /// Supervised warm-up on RookWorld task text (checkpoints, --resume).
    Sft(SftArgs),
    /// GRPO training against the rollout queue (--local: one process with a reward
    /// server and a worker on loopback).
    Train(Box<TrainArgs>),
    /// Time one GRPO step (reference forward, policy forward/backward, clipping, AdamW)
    /// on a synthetic batch; prints one JSON line.
    Bench(BenchArgs),
    /// Time weight pushes to a real worker on loopback, phase by phase, beside the floor
    /// (memcpy, raw TCP); prints one JSON line.
    BenchPush(BenchPushArgs),
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
    cli.kernels.apply();
    let result = match &cli.command {
        Command::Init(args) => init_cmd::run(args).map_err(|e| e.to_string()),
        Command::Loss(args) => loss_cmd::run(args).map_err(|e| e.to_string()),
        Command::Sft(args) => sft::run(args).map(|_| ()).map_err(|e| e.to_string()),
        Command::Train(args) => train_cmd(args).map_err(|e| e.to_string()),
        Command::Bench(args) => bench_cmd::run(args).map_err(|e| e.to_string()),
        Command::BenchPush(args) => bench_push::run(args).map_err(|e| e.to_string()),
        Command::Eval(args) => crate::eval::run(args).map_err(|e| e.to_string()),
        Command::Health(args) => args.run(),
        Command::Config(ConfigCommand::Show(args)) => {
            show_config(args, &matches).map_err(|e| e.to_string())
        }
    };
    // The one place a command's error becomes its line on stderr.
    rookworld_lm::cli::exit_with(result.map_err(|e| run_file::annotate(&e)))
}

/// Prints the resolved settings of `learner train` (checked as `train` checks them).
fn show_config(args: &TrainArgs, matches: &clap::ArgMatches) -> Result<(), ConfigError> {
    args.validate()?;
    let table = run_file::resolved(&Cli::command(), matches);
    print!("{}", crate::run_record::render(&table, None));
    Ok(())
}

/// Runs `learner train` on a multi-threaded runtime until its last step or a signal.
fn train_cmd(args: &TrainArgs) -> Result<(), TrainError> {
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
