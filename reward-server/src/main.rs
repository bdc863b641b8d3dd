//! `reward-server`: thin entry point; the command line lives in [`reward_server::app`].

fn main() -> std::process::ExitCode {
    reward_server::app::main()
}
