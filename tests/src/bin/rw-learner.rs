//! The `learner` command line, as the fault tests launch it: the very code the `learner`
//! binary runs (its `main` is this same one call), built in this crate so the tests can
//! name the executable.

fn main() -> std::process::ExitCode {
    learner::app::main()
}
