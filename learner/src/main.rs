//! `learner`: thin entry point; the work lives in the library.

use clap::{Parser, Subcommand};
use learner::init_cmd::{self, InitArgs};
use learner::loss_cmd::{self, LossArgs};
use learner::sft::{self, SftArgs};

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
    /// Print the GRPO loss, its parts and the gradient norm of one batch (JSON).
    Loss(LossArgs),
    /// Supervised warm-up on RookWorld task text (checkpoints, --resume).
    Sft(SftArgs),
}

fn main() -> std::process::ExitCode {
    rookworld_lm::cli::init_tracing();
    let cli = Cli::parse();
    rookworld_lm::cli::exit_with(match &cli.command {
        Command::Init(args) => init_cmd::run(args).map_err(|e| e.to_string()),
        Command::Loss(args) => loss_cmd::run(args).map_err(|e| e.to_string()),
        Command::Sft(args) => sft::run(args).map(|_| ()).map_err(|e| e.to_string()),
    })
}
