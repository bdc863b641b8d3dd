//! `rollout-worker`: thin entry point; the command line lives in [`rollout_worker::app`].

fn main() -> std::process::ExitCode {
    rollout_worker::app::main()
}
