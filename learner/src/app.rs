//! The `learner` command line: its commands and their dispatch. `main.rs` only calls
//! [`main`], so every launcher of this code runs exactly the same thing.

use crate::bench_cmd::{self, BenchArgs};
use crate::bench_push::{self, BenchPushArgs};
use crate::init_cmd::{self, InitArgs};
use crate::loss_cmd::{self, LossArgs};
use crate::sft::{self, SftArgs};
use crate::train::{self, TrainArgs};
use clap::{Parser, Subcommand};
use rookworld_proto::logging::LogArgs;
use rookworld_proto::probe::HealthArgs;

/// GRPO learner of the RookWorld trainer.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: LogArgs,
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
    Eval(Box<crate::eval::EvalArgs>),
    /// Ask a running service's gRPC health endpoint (exit 0 when serving).
    Health(HealthArgs),
}

/// Parses the command line and runs the command; the process exits with what it returns.
pub fn main() -> std::process::ExitCode {
    rookworld_proto::env::unset_empty();
    let cli = Cli::parse();
    rookworld_proto::logging::init(cli.log.log_format);
    rookworld_lm::cli::exit_with(match &cli.command {
        Command::Init(args) => init_cmd::run(args).map_err(|e| e.to_string()),
        Command::Loss(args) => loss_cmd::run(args).map_err(|e| e.to_string()),
        Command::Sft(args) => sft::run(args).map(|_| ()).map_err(|e| e.to_string()),
        Command::Train(args) => train_cmd(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::BenchPush(args) => bench_push::run(args),
        Command::Eval(args) => crate::eval::run(args),
        Command::Health(args) => args.run(),
    })
}

/// Runs `learner train` on a multi-threaded runtime until its last step or a signal.
fn train_cmd(args: &TrainArgs) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        let listen = args.listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        if let Some(addr) = args.metrics_addr().map_err(|e| e.to_string())? {
            crate::metrics::install_exporter(addr)
                .map_err(|e| format!("metrics on {addr}: {e}"))?;
        }
        let summary = train::run(
            args.clone(),
            listener,
            rookworld_proto::serve::shutdown_signal(),
        )
        .await
        .map_err(|e| e.to_string())?;
        train::print_summary(&summary);
        Ok(())
    })
}
