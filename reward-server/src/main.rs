//! `reward-server`: thin entry point; the work lives in the library.

use clap::Parser;

/// Reward server of the RookWorld GRPO trainer: verified chess rewards.
#[derive(Debug, Parser)]
#[command(version, about, arg_required_else_help = true)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
}
