//! Run directories: what `learner train` and `learner sft` may do with one.
//!
//! A run directory that holds checkpoints is never started over by accident: without
//! `--resume` (or `--resume-from`) the command is refused, and `--overwrite` says to delete
//! the checkpoints and start over. A resumed run keeps the settings that define its maths;
//! the ones listed as resumable (such as `steps`) may change, and a refusal names each
//! differing key with its old and new value.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;

use crate::checkpoint::{self, CheckpointError, Loaded};

/// How a command treats its run directory's checkpoints.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunDirArgs {
    /// Continue from the run's newest intact checkpoint (starts fresh when it has none).
    #[arg(long, env = "LEARNER_RESUME")]
    pub resume: bool,
    /// Continue from this checkpoint directory (e.g. RUN/checkpoints/step-00000040); new
    /// checkpoints still go to the run directory.
    #[arg(long, env = "LEARNER_RESUME_FROM", conflicts_with = "overwrite")]
    pub resume_from: Option<PathBuf>,
    /// Start over in a run directory that holds checkpoints: they are deleted first.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
}

/// Why a run directory cannot be used as asked.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Another learner has the directory (see [`crate::run_lock`]).
    #[error(transparent)]
    Lock(#[from] crate::run_lock::LockError),
    #[error("{0}")]
    Refused(String),
}

/// What a command asks of the run it opens: its settings (a resumed run's must match,
/// but for the `resumable` keys) and its number of steps (at least those done).
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub settings: &'a Value,
    pub resumable: &'a [&'a str],
    pub steps: u64,
}

/// A run directory opened by a command: its lock, held until the command ends, and the
/// checkpoint it resumes from (`None`: it starts fresh).
pub struct Opened {
    pub lock: crate::run_lock::RunLock,
    pub loaded: Option<Loaded>,
}

/// Opens `run` the one way `learner train` and `learner sft` do: takes its lock (before
/// anything in it is read or deleted), then applies the start rules ([`start`]) and checks
/// a resumed checkpoint against `expect`.
pub fn open(
    run: &Path,
    args: &RunDirArgs,
    device: &Device,
    expect: Expect,
) -> Result<Opened, RunDirError> {
    let lock = crate::run_lock::RunLock::acquire(run)?;
    let loaded = start(run, args, device)?;
    if let Some(Loaded { dir, state, .. }) = &loaded {
        check_settings(&state.settings, expect.settings, expect.resumable)?;
        if expect.steps < state.step {
            return Err(RunDirError::Refused(format!(
                "--steps {} is below the {} steps {} has done",
                expect.steps,
                state.step,
                dir.display()
            )));
        }
    }
    Ok(Opened { lock, loaded })
}

/// Where a command starts, by its run directory's rules: `Some` to resume from a loaded
/// checkpoint, `None` to start fresh (after `--overwrite` deleted the old checkpoints).
fn start(run: &Path, args: &RunDirArgs, device: &Device) -> Result<Option<Loaded>, RunDirError> {
    if let Some(dir) = &args.resume_from {
        let (policy, opt, state) = checkpoint::load(dir, device)?;
        return Ok(Some(Loaded {
            dir: dir.clone(),
            policy,
            opt,
            state,
        }));
    }
    if args.resume {
        return Ok(checkpoint::load_newest(run, device)?);
    }
    let held = checkpoint::candidates(run)?;
    if let Some(newest) = held.first() {
        if !args.overwrite {
            return Err(RunDirError::Refused(format!(
                "{} holds checkpoints (newest: {}): pass --resume to continue that run, or --overwrite to delete them and start over",
                run.display(),
                newest.display()
            )));
        }
        let root = run.join("checkpoints");
        std::fs::remove_dir_all(&root).map_err(|source| CheckpointError::Io {
            path: root.clone(),
            source,
        })?;
        tracing::warn!(dir = %root.display(), checkpoints = held.len(), "--overwrite: the run's checkpoints were deleted; starting over");
    }
    Ok(None)
}

/// `RUN/run_id`: the run's id, made when the run starts fresh and kept while it resumes.
const RUN_ID: &str = "run_id";

/// The id of the run in `run`: a new one on a fresh start (`fresh`), else the one kept
/// there (made if the directory predates run ids). Weight versions count within a run:
/// pushes and groups carry the id, so workers still holding another run's weights take
/// this run's first push, and groups made with those weights are never trained on.
pub fn run_id(run: &Path, fresh: bool) -> Result<String, RunDirError> {
    let path = run.join(RUN_ID);
    let io = |source| CheckpointError::Io {
        path: path.clone(),
        source,
    };
    if !fresh {
        match std::fs::read_to_string(&path) {
            Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_owned()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e).into()),
        }
    }
    let id = format!("{:016x}", rand::random::<u64>());
    std::fs::create_dir_all(run).map_err(|source| CheckpointError::Io {
        path: run.to_path_buf(),
        source,
    })?;
    rookworld_lm::model_io::write_atomic(&path, id.as_bytes()).map_err(CheckpointError::from)?;
    Ok(id)
}

/// Checks a resumed run's settings against its checkpoint's. Keys in `resumable` may
/// differ (each change is logged); any other difference is refused with every differing
/// key as `key: old → new`.
pub fn check_settings(saved: &Value, now: &Value, resumable: &[&str]) -> Result<(), RunDirError> {
    let empty = serde_json::Map::new();
    let (old, new) = (
        saved.as_object().unwrap_or(&empty),
        now.as_object().unwrap_or(&empty),
    );
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut refused = Vec::new();
    for key in keys {
        let (a, b) = (old.get(key), new.get(key));
        if a == b {
            continue;
        }
        let show = |v: Option<&Value>| v.map_or_else(|| "(none)".to_owned(), Value::to_string);
        let change = format!("{key}: {} → {}", show(a), show(b));
        if resumable.contains(&key.as_str()) {
            tracing::info!(%change, "setting changed on resume");
        } else {
            refused.push(change);
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    Err(RunDirError::Refused(format!(
        "--resume with different settings: {} (only {} may change on resume; use a new run directory for the others)",
        refused.join(", "),
        resumable.join(", ")
    )))
}

/// What a resume does with each option of a command: the lists the run-directories page
/// shows (generated from here, so the page and the check cannot disagree). Each command
/// makes its own (`train::resume_rules`, `sft::resume_rules`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeRules {
    /// Kept in every checkpoint and compared on resume: a change is refused.
    pub refused: Vec<String>,
    /// Kept and compared, but a change is taken (and logged).
    pub may_change: Vec<String>,
    /// Not part of the run's settings: where and how this process runs, and the starting
    /// weights (a resume takes its weights from the checkpoint).
    pub free: Vec<String>,
}

impl ResumeRules {
    /// The options of `all` (as run-file keys), of which those of `kept` are compared on
    /// resume and `resumable` of those may change.
    pub fn of(all: &clap::Command, kept: &clap::Command, resumable: &[&str]) -> Self {
        let keys = |c: &clap::Command| -> Vec<String> {
            c.get_arguments()
                .filter(|a| !a.is_hide_set())
                .filter_map(|a| a.get_long().map(|l| l.replace('-', "_")))
                .collect()
        };
        let kept = keys(kept);
        let mut rules = Self {
            refused: Vec::new(),
            may_change: Vec::new(),
            free: Vec::new(),
        };
        for key in keys(all) {
            if resumable.contains(&key.as_str()) {
                rules.may_change.push(key);
            } else if kept.contains(&key) {
                rules.refused.push(key);
            } else {
                rules.free.push(key);
            }
        }
        for list in [&mut rules.refused, &mut rules.may_change, &mut rules.free] {
            list.sort();
        }
        rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resumable_keys_may_change_and_the_others_are_named() {
        let saved = json!({"steps": 10, "lr": 0.001, "seed": 1, "lease_timeout": 300.0});
        let longer = json!({"steps": 20, "lr": 0.001, "seed": 1, "lease_timeout": 60.0});
        check_settings(&saved, &longer, &["steps", "lease_timeout"]).unwrap();

        let changed = json!({"steps": 20, "lr": 0.002, "seed": 2, "lease_timeout": 300.0});
        let err = check_settings(&saved, &changed, &["steps"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("lr: 0.001 → 0.002"), "{err}");
        assert!(err.contains("seed: 1 → 2"), "{err}");
        assert!(!err.contains("steps: "), "{err}");
        assert_eq!(err.lines().count(), 1);
    }
}
