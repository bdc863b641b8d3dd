//! The log every service binary writes: stderr (stdout stays free for JSON output),
//! filtered by `RUST_LOG` (default `info`), as text — coloured only on a terminal, so that
//! `docker compose logs` and log collectors get plain text — or as one JSON object per
//! line (`--log-format json`, `ROOKWORLD_LOG_FORMAT=json`).
//!
//! Long work shows a [`Progress`] line on a terminal; log lines written while it is shown
//! are printed above it and the line is drawn again below them, so it stays whole.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`).
    Json,
}

/// The logging options every binary takes (before or after its subcommand).
#[derive(Clone, Debug, clap::Args)]
pub struct LogArgs {
    /// Log lines as text or as one JSON object per line (for log collectors).
    #[arg(
        long,
        global = true,
        env = "ROOKWORLD_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
}

/// Installs the global subscriber; call once, first thing in `main` after parsing the
/// command line.
pub fn init(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| AboveProgress);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

/// The progress line shown now, if any.
static SHOWN: Mutex<Option<String>> = Mutex::new(None);

/// Clears the terminal's current line.
const CLEAR: &[u8] = b"\r\x1b[2K";

/// Stderr, with a shown progress line moved below what is written (one log event is one
/// write).
struct AboveProgress;

impl Write for AboveProgress {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let shown = SHOWN.lock().unwrap_or_else(PoisonError::into_inner);
        let mut err = std::io::stderr().lock();
        match shown.as_deref() {
            Some(line) => {
                err.write_all(CLEAR)?;
                err.write_all(buf)?;
                if buf.ends_with(b"\n") {
                    err.write_all(line.as_bytes())?;
                }
            }
            None => err.write_all(buf)?,
        }
        err.flush()?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Shows `line` as the progress line (replacing the one shown), or with `None` ends it,
/// leaving the last one on the screen.
fn show(line: Option<String>) {
    let mut shown = SHOWN.lock().unwrap_or_else(PoisonError::into_inner);
    let mut err = std::io::stderr().lock();
    let _ = match &line {
        Some(l) => err
            .write_all(CLEAR)
            .and_then(|()| err.write_all(l.as_bytes())),
        None if shown.is_some() => err.write_all(b"\n"),
        None => Ok(()),
    };
    let _ = err.flush();
    *shown = line;
}

/// Progress of long work (`done` of `total` units) as one line on a terminal: a bar, what
/// the caller adds, and the time left. Off the terminal (or when not enabled) it shows
/// nothing, and [`Progress::on_terminal`] tells the caller to log instead.
pub struct Progress {
    label: String,
    total: u64,
    first: u64,
    done: u64,
    started: Instant,
    on_terminal: bool,
}

/// Width of the bar in characters.
const BAR: usize = 24;

impl Progress {
    /// Progress of `label` from `first` to `total`, shown when `enabled` and stderr is a
    /// terminal.
    pub fn new(label: impl Into<String>, first: u64, total: u64, enabled: bool) -> Self {
        Self {
            label: label.into(),
            total,
            first,
            done: first,
            started: Instant::now(),
            on_terminal: enabled && std::io::stderr().is_terminal(),
        }
    }

    /// Whether the line is shown (else the caller logs each unit as it sees fit).
    pub fn on_terminal(&self) -> bool {
        self.on_terminal
    }

    /// The line for `done` units with `detail`: `label done/total [###…] detail  eta Ns`.
    pub fn line(&self, done: u64, detail: &str) -> String {
        let finished = done.saturating_sub(self.first) as f64;
        let left = self.total.saturating_sub(done) as f64;
        let eta = self.started.elapsed().as_secs_f64() / finished.max(1.0) * left;
        let filled = ((done as f64 / self.total.max(1) as f64) * BAR as f64).round() as usize;
        let filled = filled.min(BAR);
        format!(
            "{} {done}/{} [{}{}] {detail}  eta {eta:.0}s",
            self.label,
            self.total,
            "#".repeat(filled),
            ".".repeat(BAR - filled)
        )
    }

    /// Shows `done` units (on a terminal; the line ends when `done` reaches the total).
    pub fn update(&mut self, done: u64, detail: &str) {
        if !self.on_terminal {
            return;
        }
        show(Some(self.line(done, detail)));
        if done >= self.total {
            self.finish();
        }
    }

    /// One more unit done: shown on a terminal, else one INFO line with `detail`.
    pub fn tick(&mut self, detail: &str) {
        self.done += 1;
        if self.on_terminal {
            self.update(self.done, detail);
        } else {
            tracing::info!(done = self.done, total = self.total, %detail, "{}", self.label);
        }
    }

    /// Ends the line (before other output), leaving the last one on the screen.
    pub fn finish(&mut self) {
        if self.on_terminal {
            show(None);
            self.on_terminal = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_has_the_count_the_bar_and_the_time_left() {
        let p = Progress::new("step", 0, 4, false);
        let line = p.line(1, "loss 0.5");
        assert!(
            line.starts_with("step 1/4 [######..................] loss 0.5  eta "),
            "{line}"
        );
        assert!(line.ends_with('s'), "{line}");
        let done = p.line(4, "");
        assert!(done.contains(&format!("[{}]", "#".repeat(BAR))), "{done}");
    }

    #[test]
    fn off_a_terminal_nothing_is_shown() {
        if std::io::stderr().is_terminal() {
            return; // run by hand on a terminal: the line would be shown
        }
        let mut p = Progress::new("sft", 0, 2, true);
        assert!(!p.on_terminal());
        p.update(1, "x");
        assert!(SHOWN.lock().unwrap().is_none());
    }
}
