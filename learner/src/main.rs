//! `learner`: thin entry point; the work lives in the library.

use clap::{Parser, Subcommand};
use learner::init_cmd::{self, InitArgs};

/// GRPO learner of the RookWorld trainer.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a starting checkpoint (preset random weights, or a converted checkpoint).
    Init(InitArgs),
}

fn main() -> std::process::ExitCode {
    rookworld_lm::cli::init_tracing();
    let cli = Cli::parse();
    rookworld_lm::cli::exit_with(match &cli.command {
        Command::Init(args) => init_cmd::run(args),
    })
}
