//! The log of every service binary: stderr (stdout stays free for JSON output), filtered
//! by `RUST_LOG` (default `info`), coloured only on a terminal, so that `docker compose
//! logs` and log collectors get plain text.

use std::io::IsTerminal;

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
