//! The learner's TensorBoard event files (`learner::tensorboard`), read back by TensorBoard
//! itself: its `EventAccumulator` (`tests/scripts/tensorboard_read.py`) must see the file
//! version, every scalar at its step (a value of 0 included), and, for a run resumed from a
//! checkpoint (a second file in the same directory, restarted at the resumed step), each
//! step once with the resumed run's value. Without the Python `tensorboard` package the
//! test says SKIPPED, unless `ROOKWORLD_REQUIRE_TENSORBOARD` is set (CI sets it and
//! installs the package).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use learner::tensorboard::EventWriter;

/// A Python with `tensorboard`: `$ROOKWORLD_PYTHON`, else `python3`; `None` (SKIPPED)
/// without.
fn python() -> Option<PathBuf> {
    let py = std::env::var_os("ROOKWORLD_PYTHON").map_or_else(|| "python3".into(), PathBuf::from);
    let ok = Command::new(&py)
        .args([
            "-c",
            "import tensorboard.backend.event_processing.event_accumulator",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    assert!(
        std::env::var_os("ROOKWORLD_REQUIRE_TENSORBOARD").is_none(),
        "Python tensorboard is required (pip install tensorboard; ROOKWORLD_PYTHON=that python)"
    );
    eprintln!("SKIPPED: no Python tensorboard (pip install tensorboard)");
    None
}

/// What TensorBoard reads in `dir`: the file version and each scalar tag's (step, value).
struct Read {
    file_version: f64,
    scalars: BTreeMap<String, Vec<(i64, f32)>>,
}

fn read(py: &Path, dir: &Path) -> Read {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/tensorboard_read.py");
    let out = Command::new(py).arg(script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "tensorboard_read.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let scalars = v["scalars"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(tag, points)| {
            let points = points
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
                .collect();
            (tag.clone(), points)
        })
        .collect();
    Read {
        file_version: v["file_version"].as_f64().unwrap(),
        scalars,
    }
}

#[test]
fn tensorboard_reads_the_curves_and_a_resumed_run_once() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tb = dir.path().join("tensorboard");

    // A run's first five steps, an evaluation after step 2, then a crash after step 5
    // with its last checkpoint at step 3.
    let mut first = EventWriter::create(&tb, 1).unwrap();
    for step in 1..=5u64 {
        let reward = if step == 1 { 0.0 } else { step as f64 / 10.0 };
        first.scalars(step, [("train/reward", reward), ("train/loss", -0.5)]);
        if step == 2 {
            first.scalars(2, [("eval/policy/top1", 0.25)]);
        }
    }
    // It resumes at step 3: its file starts at step 4, in the same directory.
    let mut resumed = EventWriter::create(&tb, 4).unwrap();
    for step in 4..=6u64 {
        resumed.scalars(step, [("train/reward", 10.0 + step as f64)]);
    }
    resumed.scalars(6, vec![("eval/policy/top1".to_owned(), 0.5)]);
    assert!(first.is_writing() && resumed.is_writing());
    assert!(first.path() < resumed.path(), "the later file sorts later");

    let read = read(&py, &tb);
    assert_eq!(read.file_version, 2.0);
    let tags: Vec<&str> = read.scalars.keys().map(String::as_str).collect();
    assert_eq!(tags, ["eval/policy/top1", "train/loss", "train/reward"]);
    assert_eq!(
        read.scalars["train/reward"],
        [
            (1, 0.0),
            (2, 0.2),
            (3, 0.3),
            (4, 14.0),
            (5, 15.0),
            (6, 16.0)
        ]
    );
    // The crashed run's steps 4 and 5 are gone from every tag, not only the rewritten ones.
    assert_eq!(
        read.scalars["train/loss"],
        [(1, -0.5), (2, -0.5), (3, -0.5)]
    );
    assert_eq!(read.scalars["eval/policy/top1"], [(2, 0.25), (6, 0.5)]);
}
