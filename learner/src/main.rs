//! `learner`: thin entry point; the command line lives in [`learner::app`].

fn main() -> std::process::ExitCode {
    learner::app::main()
}
