//! `reward-server`: thin entry point; the work lives in the library.

use clap::{Parser, Subcommand};
use reward_server::bench::{self, BenchArgs};
use reward_server::cli::{self, ScoreArgs, ServeArgs};

/// Reward server of the RookWorld GRPO trainer: verified chess rewards.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the gRPC scoring service (with health, reflection and /metrics).
    Serve(ServeArgs),
    /// Score JSONL `{"task","prompt","completion"}` lines, one JSON result per line.
    Score(ScoreArgs),
    /// Measure verifications per second (one thread and all cores).
    Bench(BenchArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
                if args.input == "-" {
                    cli::score(&scorer, std::io::stdin().lock(), &mut out).await?;
                } else {
                    let file = std::fs::File::open(&args.input)
                        .map_err(|e| format!("{}: {e}", args.input))?;
                    cli::score(&scorer, std::io::BufReader::new(file), &mut out).await?;
                }
                Ok(())
            }
            Command::Bench(args) => Ok(bench::run(args, &mut std::io::stdout().lock())?),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(e: impl std::fmt::Display) -> std::process::ExitCode {
    eprintln!("error: {e}");
    std::process::ExitCode::FAILURE
}
