//! Settings from the environment: an empty variable means "not set".
//!
//! Compose files and manifests pass settings through as `NAME: ${NAME:-}`, which sets the
//! variable to the empty string when the user gave none; clap would take that as a value
//! (and fail, or conflict with another option). Each binary calls [`unset_empty`] first.

/// The prefixes of the RookWorld services' variables.
pub const PREFIXES: [&str; 4] = ["ROOKWORLD_", "LEARNER_", "ROLLOUT_", "REWARD_"];

/// Removes every empty environment variable whose name starts with one of [`PREFIXES`].
///
/// Call it first thing in `main`, before any other thread exists.
pub fn unset_empty() {
    let empty: Vec<_> = std::env::vars_os()
        .filter(|(name, value)| {
            value.is_empty()
                && name
                    .to_str()
                    .is_some_and(|n| PREFIXES.iter().any(|p| n.starts_with(p)))
        })
        .map(|(name, _)| name)
        .collect();
    for name in empty {
        // SAFETY: called at the start of `main`, while the process has one thread, so no
        // other thread reads the environment concurrently.
        unsafe { std::env::remove_var(name) };
    }
}
