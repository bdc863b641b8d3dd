//! One learner per run directory: an exclusive OS file lock on `RUN/.lock`, held for as
//! long as the command runs and released by the kernel when the process exits, crashes or
//! is killed (nothing stale to clean up). The holder writes its pid into the file, so a
//! second learner on the same directory can say whose it is.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// Why a run directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock.
    #[error(
        "{dir} is in use by another learner ({holder}); stop it first, or give this run another --run-dir"
    )]
    Held { dir: PathBuf, holder: String },
    /// `--run-dir` names something that is not a directory.
    #[error("--run-dir {} is a file, not a directory: give the run a directory (new or earlier)", dir.display())]
    NotADirectory { dir: PathBuf },
    #[error("locking {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The held lock of one run directory; dropping it releases the lock.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the exclusive lock of `run` (made if missing) without waiting: an error naming
    /// the holder's pid when another process has it.
    pub fn acquire(run: &Path) -> Result<Self, LockError> {
        let path = run.join(LOCK_FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        if run.exists() && !run.is_dir() {
            return Err(LockError::NotADirectory {
                dir: run.to_path_buf(),
            });
        }
        std::fs::create_dir_all(run).map_err(io)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(LockError::Held {
                    dir: run.to_path_buf(),
                    holder: holder(&mut file),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        // Ours now: the pid replaces whatever a previous holder left.
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.flush().map_err(io)?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// "pid N" from the holder's lock file; the holder may still be writing it.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    match text.trim().parse::<u32>() {
        Ok(pid) => format!("pid {pid}"),
        Err(_) => "pid unknown: it is starting".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder_and_a_dropped_lock_is_free_again() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let held = RunLock::acquire(&run).unwrap();
        let text = std::fs::read_to_string(held.path()).unwrap();
        assert_eq!(text.trim(), std::process::id().to_string());
        // A second open file description conflicts, even in the same process.
        let err = RunLock::acquire(&run).unwrap_err();
        let line = err.to_string();
        assert!(matches!(err, LockError::Held { .. }), "{line}");
        assert!(
            line.contains(&format!("pid {}", std::process::id())),
            "{line}"
        );
        assert!(!line.contains('\n'));
        drop(held);
        let again = RunLock::acquire(&run).unwrap();
        drop(again);
    }

    #[test]
    fn a_run_directory_that_is_a_file_is_named_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let err = RunLock::acquire(&file).unwrap_err();
        assert!(matches!(err, LockError::NotADirectory { .. }), "{err}");
        let line = err.to_string();
        assert!(
            line.contains("not-a-dir") && line.contains("is a file, not a directory"),
            "{line}"
        );
        // Nothing was written beside it.
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }
}
