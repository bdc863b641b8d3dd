//! Files written whole: a reader (or a later run) sees the old file or the new one, never
//! a part, and a command stopped midway leaves nothing behind under the file's name.

use std::path::{Path, PathBuf};

/// Where [`write_atomic`] writes `path` before renaming it: `.NAME.tmp` beside it.
pub fn temporary(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or("file".into(), |n| n.to_string_lossy());
    path.with_file_name(format!(".{name}.tmp"))
}

/// Writes `bytes` to `path` through a temporary file ([`temporary`]) and a rename; an
/// error names the path it concerns.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temporary(path);
    let named = |at: &Path| {
        let at = at.display().to_string();
        move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{at}: {e}"))
    };
    std::fs::write(&tmp, bytes).map_err(named(&tmp))?;
    std::fs::rename(&tmp, path).map_err(named(path))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_file_is_written_whole_and_its_temporary_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("items.jsonl");
        assert_eq!(super::temporary(&path), dir.path().join(".items.jsonl.tmp"));
        super::write_atomic(&path, b"one\n").unwrap();
        super::write_atomic(&path, b"two\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two\n");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "only the file itself is left");
        let missing = dir.path().join("no/such/dir/file");
        let e = super::write_atomic(&missing, b"x").unwrap_err();
        assert!(e.to_string().contains("no/such/dir/.file.tmp"), "{e}");
    }
}
