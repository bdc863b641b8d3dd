//! Run-directory rules of `learner sft` and `learner train`: a directory with checkpoints
//! is never started over by accident, `--resume` may extend the run but not change its
//! maths (the refusal names each key), `--resume-from` picks a checkpoint, and a truncated
//! checkpoint is named and skipped for the newest intact one.

use std::path::Path;
use std::process::{Command, Output};

fn learner(args: &[&str], run: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(args)
        .arg("--run-dir")
        .arg(run)
        .env("RUST_LOG", "warn")
        .env_remove("LEARNER_RESUME")
        .output()
        .unwrap()
}

fn sft(run: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "sft",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--policy-fraction",
        "0",
        "--checkpoint-every",
        "2",
    ];
    args.extend_from_slice(extra);
    learner(&args, run)
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The one line a refused command prints.
fn refusal(out: &Output) -> String {
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn latest(run: &Path) -> String {
    std::fs::read_to_string(run.join("checkpoints/latest")).unwrap()
}

#[test]
fn a_run_directory_with_checkpoints_is_resumed_or_overwritten_never_restarted_silently() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&sft(&run, &["--steps", "4"]));
    assert_eq!(latest(&run), "step-00000004");

    // Again without --resume: refused, both ways out named; nothing touched.
    let err = refusal(&sft(&run, &["--steps", "4"]));
    assert!(
        err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(latest(&run), "step-00000004");
    // `train` follows the same rule (refused before it waits for any worker).
    let err = refusal(&learner(
        &[
            "train",
            "--token",
            "t",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--sft-steps",
            "0",
        ],
        &run,
    ));
    assert!(
        err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );

    // --resume may extend --steps: the run goes on from step 4 to 6.
    ok(&sft(&run, &["--steps", "6", "--resume"]));
    assert_eq!(latest(&run), "step-00000006");

    // A change of the maths is refused, naming each key old → new.
    let err = refusal(&sft(&run, &["--steps", "6", "--lr", "0.002", "--resume"]));
    assert!(err.contains("lr: 0.001 → 0.002"), "{err}");
    assert!(err.contains("different settings"), "{err}");

    // --resume-from an older checkpoint: the run goes on from there.
    let from = run.join("checkpoints/step-00000002");
    let out = sft(
        &run,
        &["--steps", "3", "--resume-from", from.to_str().unwrap()],
    );
    ok(&out);
    assert_eq!(latest(&run), "step-00000003");

    // --overwrite starts over: the old checkpoints are gone.
    ok(&sft(&run, &["--steps", "2", "--overwrite"]));
    assert_eq!(latest(&run), "step-00000002");
    assert!(!run.join("checkpoints/step-00000006").exists());
}

#[test]
fn a_truncated_checkpoint_is_named_and_the_newest_intact_one_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    ok(&sft(&run, &["--steps", "4"]));
    let newest = run.join("checkpoints/step-00000004/optimizer.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();

    // Picked explicitly, the truncated checkpoint is an error naming the file.
    let from = run.join("checkpoints/step-00000004");
    let err = refusal(&sft(
        &run,
        &["--steps", "4", "--resume-from", from.to_str().unwrap()],
    ));
    assert!(err.contains("optimizer.safetensors"), "{err}");

    // --resume warns, names it, and goes on from step 2 (the newest intact one).
    let out = sft(&run, &["--steps", "4", "--resume"]);
    ok(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("step-00000004"), "{log}");
    assert!(log.contains("step-00000002"), "{log}");
    assert_eq!(latest(&run), "step-00000004");
    let rewritten = std::fs::read(&newest).unwrap();
    assert_eq!(
        rewritten.len(),
        bytes.len(),
        "step 4's checkpoint is whole again"
    );
}

/// One learner per run directory: while `learner train` runs, a second `train` or `sft`
/// on its directory exits with one line naming the first's pid and touches nothing; once
/// the first is killed (no clean exit), the directory is free again.
#[test]
fn a_second_learner_on_a_run_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut first = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["train", "--local", "--preset", "tiny", "--steps", "100000"])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--no-progress",
        ])
        .arg("--run-dir")
        .arg(&run)
        .env("RUST_LOG", "warn")
        .env_remove("LEARNER_RESUME")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = first.id().to_string();
    let lock = run.join(".lock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&lock)
        .map(|t| t.trim() != pid)
        .unwrap_or(true)
    {
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first learner exited"
        );
        assert!(std::time::Instant::now() < deadline, "no lock after 60 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    let train = refusal(&learner(
        &["train", "--local", "--preset", "tiny", "--overwrite"],
        &run,
    ));
    let tuning = refusal(&sft(&run, &["--steps", "2", "--overwrite"]));
    for err in [train, tuning] {
        assert!(err.contains(&format!("pid {pid}")), "{err}");
        assert!(err.contains("in use by another learner"), "{err}");
    }
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first learner still runs"
    );

    first.kill().unwrap();
    first.wait().unwrap();
    ok(&sft(&run, &["--steps", "2", "--overwrite"]));
    // The lock file stays, with the last holder's pid: stale pids mean nothing.
    assert!(lock.exists());
}

/// The keys a checkpoint keeps are the options' run-file keys, so that the page's
/// lists ([`learner::run_dir::ResumeRules`]) name exactly what a resume compares.
#[test]
fn the_compared_settings_are_the_options_the_page_lists() {
    use clap::{Args, FromArgMatches};
    for (rules, kept, resumable) in [
        (
            learner::train::resume_rules(),
            serde_json::to_value(
                learner::train::TrainSettings::from_arg_matches(
                    &learner::train::TrainSettings::augment_args(clap::Command::new("s"))
                        .get_matches_from(["s"]),
                )
                .unwrap(),
            )
            .unwrap(),
            learner::train::RESUMABLE,
        ),
        (
            learner::sft::resume_rules(),
            serde_json::to_value(
                learner::sft::SftSettings::from_arg_matches(
                    &learner::sft::SftSettings::augment_args(clap::Command::new("s"))
                        .get_matches_from(["s"]),
                )
                .unwrap(),
            )
            .unwrap(),
            learner::sft::SFT_RESUMABLE,
        ),
    ] {
        // Settings left out at their defaults (added after runs were checkpointed) are
        // still compared: absent on one side is a change on the other.
        let compared: Vec<&String> = kept.as_object().unwrap().keys().collect();
        for key in &compared {
            assert!(
                rules.refused.contains(key) || rules.may_change.contains(key),
                "{key} is compared on resume but listed as free"
            );
        }
        for key in resumable {
            assert!(rules.may_change.iter().any(|k| k == key), "{key}");
        }
        assert!(!rules.free.is_empty() && !rules.refused.is_empty());
    }
}
