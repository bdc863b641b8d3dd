//! The `reward-server` command line: its commands and their dispatch. `main.rs` only calls
//! [`main`], so every launcher of this code runs exactly the same thing.

use crate::bench::{self, BenchArgs};
use crate::cli::{self, ScoreArgs, ServeArgs};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use rookworld_service::logging::LogArgs;
use rookworld_service::probe::HealthArgs;
use rookworld_service::run_file::{self, RunFileArgs};

/// Reward server of the RookWorld GRPO trainer: verified chess rewards.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: LogArgs,
    #[command(flatten)]
    run_file: RunFileArgs,
}

/// The command-line interface (every command and option), for run files and tests.
pub fn command() -> clap::Command {
    Cli::command()
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the gRPC scoring service (with health, reflection and /metrics).
    Serve(Box<ServeArgs>),
    /// Score JSONL `{"task","prompt","completion"}` lines, one JSON result per line.
    Score(ScoreArgs),
    /// Measure verifications per second (one thread and all cores).
    Bench(BenchArgs),
    /// Ask a running service's gRPC health endpoint (exit 0 when serving).
    Health(HealthArgs),
}

/// Parses the command line and runs the command; the process exits with what it returns.
pub fn main() -> std::process::ExitCode {
    rookworld_service::env::unset_empty();
    let matches = run_file::parse(Cli::command(), &[]);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    rookworld_service::logging::init(cli.log.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(e),
    };
    let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = runtime.block_on(async {
        match &cli.command {
            Command::Serve(args) => cli::serve(args).await,
            Command::Score(args) => {
                let scorer = args.scoring.scorer().await?;
                let stdout = std::io::stdout();
                let mut out = std::io::BufWriter::new(stdout.lock());
                let stop = rookworld_service::serve::shutdown_signal();
                let scored = if args.input == "-" {
                    let stdin = std::io::BufReader::new(std::io::stdin());
                    cli::score(&scorer, stdin, &mut out, stop).await?
                } else {
                    let file = std::fs::File::open(&args.input)
                        .map_err(|e| format!("{}: {e}", args.input))?;
                    cli::score(&scorer, std::io::BufReader::new(file), &mut out, stop).await?
                };
                if scored.stopped {
                    eprintln!(
                        "score: stopped by a signal after {} lines (each written whole); \
                         the rest of the input was not scored",
                        scored.lines
                    );
                }
                Ok(())
            }
            Command::Bench(args) => {
                // Its unfinished work is worth nothing: a signal ends it at once, exit 0.
                rookworld_service::serve::exit_on_signal("reward-server bench", || {})?;
                Ok(bench::run(args, &mut std::io::stdout().lock())?)
            }
            Command::Health(args) => Ok(args.check().await?),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(e: impl std::fmt::Display) -> std::process::ExitCode {
    eprintln!("error: {}", run_file::annotate(&e.to_string()));
    std::process::ExitCode::FAILURE
}
