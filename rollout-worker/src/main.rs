//! `rollout-worker`: thin entry point; the work lives in the library.

use clap::{Parser, Subcommand};
use rollout_worker::bench_cmd::{self, BenchArgs};
use rollout_worker::generate_cmd::{self, GenerateArgs};
use rollout_worker::serve_cmd::{self, ServeArgs};

/// Rollout worker of the RookWorld GRPO trainer: samples completions from the policy.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sample G completions per prompt and print one JSON object per prompt.
    Generate(GenerateArgs),
    /// Serve generation and weight updates over gRPC (health, reflection, metrics).
    Serve(ServeArgs),
    /// Measure new tokens per second (P prompts × G completions, and one stream).
    Bench(BenchArgs),
}

fn main() -> std::process::ExitCode {
    rookworld_lm::cli::init_tracing();
    let cli = Cli::parse();
    rookworld_lm::cli::exit_with(match &cli.command {
        Command::Generate(args) => {
            generate_cmd::run(args, &mut std::io::stdout().lock()).map_err(Into::into)
        }
        Command::Bench(args) => {
            bench_cmd::run(args, &mut std::io::stdout().lock()).map_err(Into::into)
        }
        Command::Serve(args) => serve(args),
    })
}

fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve_cmd::serve(args))
}
