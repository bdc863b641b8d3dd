//! The memory a payload is written into: a heap buffer, or — with a shared directory —
//! a file there, mapped into memory, so the optimizer's stores are the same-host file's
//! bytes and publishing it is a rename, not a copy of 249 MB.
//!
//! A payload file lives under an aside name (`.payload-{pid}-{n}.tmp`: no worker is ever
//! told of a name starting with a dot) while it is written, exclusively locked; published,
//! it is renamed to its version's name ([`shared_file_name`]) and unlocked, so workers can
//! share-lock it from opening it until their model is built. Written over again, it is
//! first locked — which fails while a worker still reads it: that file is let go of and a
//! new one made — and renamed aside, so no worker opens it by its old name while it
//! changes; a worker that opened it just before finds it renamed, or locked, and is
//! streamed that push instead.
//!
//! [`shared_file_name`]: rookworld_weights::set::shared_file_name

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Numbers the aside names of this process's payload files.
static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

/// A payload's bytes.
#[derive(Debug)]
pub(super) enum Buffer {
    Heap(Vec<u8>),
    File(PayloadFile),
}

impl Buffer {
    /// A zeroed heap buffer of `len` bytes, its pages faulted in (the first touch of 249
    /// MB took 0.7 s on two cores: paid here, not by the optimizer's pass).
    pub(super) fn heap(len: usize) -> Self {
        let mut bytes = vec![0u8; len];
        touch(&mut bytes);
        Self::Heap(bytes)
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Self::Heap(v) => v,
            Self::File(f) => &f.map,
        }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Heap(v) => v,
            Self::File(f) => &mut f.map,
        }
    }
}

/// Writes one byte of every page of `bytes`, so each is faulted in now.
fn touch(bytes: &mut [u8]) {
    for page in bytes.chunks_mut(4096) {
        // SAFETY: a write of a byte inside the buffer; volatile, so it is not elided as a
        // write of the value already there.
        unsafe { std::ptr::write_volatile(&mut page[0], page[0]) };
    }
}

/// A payload file in the shared directory, mapped read-write.
#[derive(Debug)]
pub(super) struct PayloadFile {
    /// Its name while it is written (its directory is the shared one).
    aside: PathBuf,
    /// Where it is now: `aside`, or its published version's name.
    path: PathBuf,
    /// (device, inode): the file removed on drop only if `path` is still this one.
    id: (u64, u64),
    file: File,
    map: memmap2::MmapMut,
    /// Whether this process holds its exclusive lock.
    locked: bool,
}

impl PayloadFile {
    /// A new file of `len` bytes under an aside name in `dir`, exclusively locked, mapped,
    /// every page faulted in.
    pub(super) fn create(dir: &Path, len: usize) -> std::io::Result<Self> {
        let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        let aside = dir.join(format!(".payload-{}-{n}.tmp", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&aside)?;
        let made = (|| {
            file.try_lock()?;
            file.set_len(len as u64)?;
            // SAFETY: the file is this process's own, just made; workers only ever map it
            // read-only and never change its length.
            let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }?;
            touch(&mut map);
            let meta = file.metadata()?;
            Ok::<_, std::io::Error>((map, (meta.dev(), meta.ino())))
        })();
        let (map, id) = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&aside);
                return Err(e);
            }
        };
        Ok(Self {
            path: aside.clone(),
            aside,
            id,
            file,
            map,
            locked: true,
        })
    }

    /// Makes a published file writable again: exclusively locked — an error while a worker
    /// still reads it — and renamed aside.
    pub(super) fn claim(&mut self) -> std::io::Result<()> {
        if !self.locked {
            self.file.try_lock()?;
            self.locked = true;
        }
        if self.path != self.aside {
            std::fs::rename(&self.path, &self.aside)?;
            self.path = self.aside.clone();
        }
        Ok(())
    }

    /// Names the written file `name` in its directory (replacing a file of that name) and
    /// unlocks it for the workers.
    pub(super) fn publish(&mut self, name: &str) -> std::io::Result<()> {
        let named = self.aside.with_file_name(name);
        std::fs::rename(&self.path, &named)?;
        self.path = named;
        self.file.unlock()?;
        self.locked = false;
        Ok(())
    }
}

impl Drop for PayloadFile {
    fn drop(&mut self) {
        // A worker that mapped it keeps its pages; only the name goes.
        if let Ok(meta) = std::fs::metadata(&self.path)
            && (meta.dev(), meta.ino()) == self.id
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_file_is_written_aside_published_by_name_and_claimed_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = PayloadFile::create(dir.path(), 10_000).unwrap();
        let aside = names(dir.path());
        assert!(aside[0].starts_with(".payload-"), "{aside:?}");
        f.map[..5].copy_from_slice(b"hello");
        f.publish("v1.safetensors").unwrap();
        assert_eq!(names(dir.path()), ["v1.safetensors"]);
        let published = std::fs::read(dir.path().join("v1.safetensors")).unwrap();
        assert_eq!((&published[..5], published.len()), (&b"hello"[..], 10_000));

        // A reader's shared lock keeps it from being claimed; without one it goes aside.
        let reader = File::open(dir.path().join("v1.safetensors")).unwrap();
        reader.lock_shared().unwrap();
        assert!(f.claim().is_err());
        drop(reader);
        f.claim().unwrap();
        assert_eq!(names(dir.path()), aside);
        // Locked while written: a reader cannot share-lock it.
        let reader = File::open(dir.path().join(&aside[0])).unwrap();
        assert!(reader.try_lock_shared().is_err());
        drop(reader);

        // Dropped, it is removed — unless its name now belongs to another file.
        f.publish("v2.safetensors").unwrap();
        std::fs::remove_file(dir.path().join("v2.safetensors")).unwrap();
        std::fs::write(dir.path().join("v2.safetensors"), b"another").unwrap();
        drop(f);
        assert_eq!(names(dir.path()), ["v2.safetensors"]);
        let g = PayloadFile::create(dir.path(), 64).unwrap();
        drop(g);
        assert_eq!(names(dir.path()), ["v2.safetensors"]);
    }
}
