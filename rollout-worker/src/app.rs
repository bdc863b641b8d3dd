//! The `rollout-worker` command line: its commands and their dispatch. `main.rs` only calls
//! [`main`], so every launcher of this code runs exactly the same thing.

use crate::bench_cmd::{self, BenchArgs};
use crate::generate_cmd::{self, GenerateArgs};
use crate::parity_cmd::{self, ParityArgs};
use crate::serve_cmd::{self, ServeArgs};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use rookworld_service::logging::LogArgs;
use rookworld_service::probe::HealthArgs;
use rookworld_service::run_file::{self, RunFileArgs};

/// Rollout worker of the RookWorld GRPO trainer: samples completions from the policy.
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
    /// Sample G completions per prompt and print one JSON object per prompt.
    Generate(GenerateArgs),
    /// Serve generation and weight updates over gRPC (health, reflection, metrics).
    Serve(Box<ServeArgs>),
    /// Measure new tokens per second (P prompts × G completions, and one stream).
    Bench(BenchArgs),
    /// Ask a running service's gRPC health endpoint (exit 0 when serving).
    Health(HealthArgs),
    /// Compare the model on a device (f32 and bf16) with the CPU in f32: logits and
    /// greedy tokens of three prompts, as one JSON line.
    Parity(ParityArgs),
}

/// Parses the command line and runs the command; the process exits with what it returns.
pub fn main() -> std::process::ExitCode {
    rookworld_lm::alloc::keep_freed_memory();
    rookworld_service::env::unset_empty();
    let matches = run_file::parse(Cli::command(), &[]);
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    rookworld_service::logging::init(cli.log.log_format);
    let known = rookworld_lm::kernels::names::<rookworld_lm::kernels::Kernel>();
    match cli.kernels.choice(&known) {
        // Every command that opens a device takes it with its model options.
        Ok(kernels) => match &mut cli.command {
            Command::Generate(a) => a.model.kernels = kernels,
            Command::Serve(a) => a.model.kernels = kernels,
            Command::Bench(a) => a.model.kernels = kernels,
            Command::Parity(a) => a.model.kernels = kernels,
            Command::Health(_) => {}
        },
        Err(e) => return rookworld_lm::cli::exit_with(Err(e)),
    }
    // A benchmark's unfinished work is worth nothing: a signal ends it at once, exit 0.
    let bench = match &cli.command {
        Command::Bench(_) => Some("rollout-worker bench"),
        Command::Parity(_) => Some("rollout-worker parity"),
        _ => None,
    };
    if let Some(command) = bench
        && let Err(e) = rookworld_service::serve::exit_on_signal(command, || {})
    {
        return rookworld_lm::cli::exit_with(Err(format!("signal handlers: {e}")));
    }
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = match &cli.command {
        Command::Generate(args) => {
            generate_cmd::run(args, &mut std::io::stdout().lock()).map_err(Into::into)
        }
        Command::Bench(args) => {
            bench_cmd::run(args, &mut std::io::stdout().lock()).map_err(Into::into)
        }
        Command::Serve(args) => serve(args),
        Command::Health(args) => args.run().map_err(Into::into),
        Command::Parity(args) => {
            parity_cmd::run(args, &mut std::io::stdout().lock()).map_err(Into::into)
        }
    };
    rookworld_lm::cli::exit_with(result.map_err(|e| run_file::annotate(&e.to_string())))
}

fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve_cmd::serve(args))
}
