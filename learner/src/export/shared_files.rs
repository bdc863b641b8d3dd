//! The payload files of the same-host path, written into a directory the workers on this
//! host share.
//!
//! Each version gets a file of its own name, written aside and renamed into place, so a
//! worker never sees a half-written payload under a version's name. The newest
//! [`KEEP_FILES`] are kept. Writing a fresh 249 MB file into tmpfs makes the kernel find
//! and zero every page of it (0.5–0.8 s on a small VM); so the file due for removal is
//! written over instead, in memory the kernel already gave it, unless a worker still reads
//! it: a worker holds a shared lock on a payload file from opening it until its model is
//! built, and the learner recycles a file only when it gets the exclusive lock at once.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use rollout_worker::weights::{WeightSet, shared_file_name};

/// Payload files kept in the shared directory (a push of an older one still reading it
/// has its file; a worker that opens a removed one is streamed the payload instead).
pub const KEEP_FILES: usize = 3;

/// A directory of this process, `{name}-{pid}`, under /dev/shm (memory, where the
/// same-host path belongs), or under the system's temporary directory where there is no
/// /dev/shm. Not created here.
pub fn process_dir(name: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join(format!("{name}-{}", std::process::id()))
}

/// The payload files this learner wrote into a shared directory.
#[derive(Debug)]
pub struct SharedFiles {
    dir: PathBuf,
    written: VecDeque<PathBuf>,
    /// The last write failed (said once, until one succeeds).
    failing: bool,
    /// Files written over instead of afresh (for tests and the benchmark).
    recycled: u64,
}

impl SharedFiles {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            written: VecDeque::new(),
            failing: false,
            recycled: 0,
        }
    }

    /// How many files were written over an old one's memory so far.
    pub fn recycled(&self) -> u64 {
        self.recycled
    }

    /// Writes `set`'s payload as its file (aside, then renamed into place) and names it in
    /// the set; older files beyond [`KEEP_FILES`] are removed, or the oldest written over.
    /// A failure (a full tmpfs, a read-only directory) is logged and leaves the set to
    /// the stream.
    pub fn write(&mut self, set: &mut WeightSet) {
        let name = shared_file_name(&set.run_id, set.version);
        let (path, aside) = (self.dir.join(&name), self.dir.join(format!(".{name}.tmp")));
        let written = match self.recycle(&aside) {
            Some(file) => {
                self.recycled += 1;
                overwrite(file, &set.bytes)
            }
            None => std::fs::write(&aside, &set.bytes),
        }
        .and_then(|()| std::fs::rename(&aside, &path));
        match written {
            Ok(()) => {
                if self.failing {
                    tracing::info!(dir = %self.dir.display(), "shared payload files written again");
                }
                self.failing = false;
                set.shared_file = Some(name);
                self.written.push_back(path);
                while self.written.len() > KEEP_FILES {
                    let old = self.written.pop_front().expect("non-empty");
                    let _ = std::fs::remove_file(old);
                }
            }
            Err(e) => {
                let _ = std::fs::remove_file(&aside);
                if !self.failing {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write the shared payload file; workers on this host are streamed the weights");
                }
                self.failing = true;
            }
        }
    }

    /// The oldest file, if it is due for removal and no worker reads it: renamed to
    /// `aside` and open for writing, exclusively locked until written.
    fn recycle(&mut self, aside: &Path) -> Option<File> {
        if self.written.len() < KEEP_FILES {
            return None;
        }
        let oldest = self.written.front()?;
        let file = OpenOptions::new().write(true).open(oldest).ok()?;
        file.try_lock().ok()?;
        std::fs::rename(oldest, aside).ok()?;
        self.written.pop_front();
        Some(file)
    }

    /// Removes every file written (at the end of the run).
    pub fn remove_all(self) {
        for path in self.written {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Writes `bytes` over `file` from its start, to exactly their length.
fn overwrite(mut file: File, bytes: &[u8]) -> std::io::Result<()> {
    file.set_len(bytes.len() as u64)?;
    file.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(version: u64, fill: u8) -> WeightSet {
        WeightSet::from_bytes("run-f", version, vec![fill; 4096 + version as usize])
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn old_files_are_written_over_unless_a_reader_holds_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut shared = SharedFiles::new(dir.path().to_owned());
        for v in 1..=5 {
            let mut s = set(v, v as u8);
            shared.write(&mut s);
            let path = dir.path().join(s.shared_file.as_ref().unwrap());
            assert_eq!(std::fs::read(path).unwrap(), s.bytes, "version {v}");
        }
        assert_eq!(
            shared.recycled(),
            2,
            "versions 4 and 5 reuse 1's and 2's files"
        );
        assert_eq!(files(dir.path()).len(), KEEP_FILES);

        // A reader's lock on the oldest (version 3): the next file is written afresh and
        // the reader's file keeps its bytes (removed from the directory, not rewritten).
        let oldest = dir.path().join(shared_file_name("run-f", 3));
        let reader = File::open(&oldest).unwrap();
        reader.lock_shared().unwrap();
        let mut s = set(6, 6);
        shared.write(&mut s);
        assert_eq!(shared.recycled(), 2);
        assert!(!oldest.exists());
        let mut held = Vec::new();
        std::io::Read::read_to_end(&mut &reader, &mut held).unwrap();
        assert_eq!(held, set(3, 3).bytes);
        let names = files(dir.path());
        assert_eq!(names.len(), KEEP_FILES, "{names:?}");
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        shared.remove_all();
        assert!(files(dir.path()).is_empty());
    }
}
