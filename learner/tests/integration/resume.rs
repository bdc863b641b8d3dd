//! `learner sft` checkpoints and `--resume`: after a crash, the resumed run's steps are
//! bit-identical to the uninterrupted run's; a half-written checkpoint is never `latest`.

use std::path::Path;
use std::process::Command;

use learner::sft::SftStep;

fn sft(run: &Path, extra: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["sft", "--preset", "tiny", "--run-dir"])
        .arg(run)
        .args([
            "--steps",
            "6",
            "--batch-size",
            "4",
            "--micro-batch-size",
            "3",
            "--lr",
            "3e-3",
            "--warmup-steps",
            "2",
            "--policy-fraction",
            "0",
            "--seed",
            "11",
            "--checkpoint-every",
            "3",
            "--log-jsonl",
        ])
        .arg(run.join("log.jsonl"))
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn log(run: &Path) -> Vec<SftStep> {
    std::fs::read_to_string(run.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn resumed_steps_are_bit_identical_to_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, cut) = (dir.path().join("whole"), dir.path().join("cut"));
    std::fs::create_dir_all(&whole).unwrap();
    sft(&whole, &[]);
    let straight = log(&whole);
    assert_eq!(straight.len(), 6);
    assert!(
        straight[5].loss < straight[0].loss,
        "training lowers the loss: {straight:?}"
    );

    // A crash after step 3's checkpoint, in the middle of writing step 6's.
    copy_dir(&whole, &cut);
    let checkpoints = cut.join("checkpoints");
    std::fs::rename(
        checkpoints.join("step-00000006"),
        checkpoints.join(".step-00000006.tmp"),
    )
    .unwrap();
    std::fs::write(checkpoints.join("latest"), "step-00000003").unwrap();
    std::fs::write(cut.join("log.jsonl"), "").unwrap();
    sft(&cut, &["--resume"]);
    let resumed = log(&cut);
    assert_eq!(resumed.len(), 3);
    for (a, b) in straight[3..].iter().zip(&resumed) {
        assert_eq!(
            (
                a.step,
                a.loss.to_bits(),
                a.grad_norm.to_bits(),
                a.lr.to_bits()
            ),
            (
                b.step,
                b.loss.to_bits(),
                b.grad_norm.to_bits(),
                b.lr.to_bits()
            )
        );
    }
    // The final weights are the same bytes.
    let weights = |run: &Path| {
        std::fs::read(run.join("checkpoints/step-00000006/model.safetensors")).unwrap()
    };
    assert!(weights(&whole) == weights(&cut), "final weights differ");
    assert_eq!(
        std::fs::read_to_string(checkpoints.join("latest")).unwrap(),
        "step-00000006"
    );

    // Changed settings are refused on resume.
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["sft", "--preset", "tiny", "--run-dir"])
        .arg(&cut)
        .args(["--steps", "9", "--batch-size", "4", "--resume"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("different settings"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// With Stockfish installed, policy-task documents come from its multipv lines.
#[test]
fn policy_documents_come_from_the_engine_when_installed() {
    let Some(engine) = rookworld_chess::stockfish::stockfish_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["sft", "--preset", "tiny", "--run-dir"])
        .arg(dir.path())
        .args([
            "--steps",
            "1",
            "--batch-size",
            "3",
            "--policy-fraction",
            "1",
            "--engine",
        ])
        .arg(engine)
        .args(["--log-jsonl"])
        .arg(dir.path().join("log.jsonl"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = log(dir.path());
    // Policy documents are long: a 90-column FEN field, M:, E: and B: sections.
    assert!(steps[0].tokens > 3 * 60, "{steps:?}");
}
