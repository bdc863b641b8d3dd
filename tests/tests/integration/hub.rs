//! Models by any name: `--model owner/name[@revision]` through a Hugging Face cache the
//! test lays out as the Hub's clients do (`HF_HOME/hub/models--owner--name/{refs,snapshots}`),
//! offline (`HF_HUB_OFFLINE=1`: no network in tests); a run directory, its
//! `checkpoints/latest` and a checkpoint directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device};
use rookworld_lm::config::Config;
use rookworld_lm::model_io;

const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// `HF_HOME` with `jrahn/RookWorld-LM-124M` at `main` = [`COMMIT`]: a tiny model's files.
fn lay_out_cache(home: &Path) -> PathBuf {
    let repo = home.join("hub/models--jrahn--RookWorld-LM-124M");
    let snapshot = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    let cfg = Config::preset("tiny").unwrap();
    let model = model_io::init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    model_io::save(&model, &snapshot, DType::F32).unwrap();
    snapshot
}

#[test]
fn a_repository_id_resolves_through_the_cache_offline() {
    let home = tempfile::tempdir().unwrap();
    let snapshot = lay_out_cache(home.path());
    let cache = hf_hub::Cache::new(home.path().join("hub"));
    let resolve = |s: &str| rookworld_lm::hub::resolve_in(Path::new(s), &cache, true);
    assert_eq!(resolve("jrahn/RookWorld-LM-124M").unwrap(), snapshot);
    assert_eq!(
        resolve(&format!("jrahn/RookWorld-LM-124M@{COMMIT}")).unwrap(),
        snapshot
    );
    // Not cached, offline: one line that says where it looked and what to do.
    let e = resolve("jrahn/Other").unwrap_err().to_string();
    assert!(
        e.contains("not in the Hugging Face cache") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    let e = resolve("jrahn/RookWorld-LM-124M@v9")
        .unwrap_err()
        .to_string();
    assert!(e.contains("revision v9"), "{e}");
    // A directory that exists is a directory, whatever its name looks like.
    assert_eq!(resolve(snapshot.to_str().unwrap()).unwrap(), snapshot);
    let e = resolve("./no/such-dir").unwrap_err().to_string();
    assert!(e.contains("does not exist"), "{e}");
    assert!(e.contains("--model takes a checkpoint directory"), "{e}");
}

/// A run directory as `learner train` and `sft` leave it: checkpoints in
/// `checkpoints/step-N`, the newest named by `checkpoints/latest`.
fn lay_out_run(run: &Path) -> PathBuf {
    let cfg = Config::preset("tiny").unwrap();
    for (step, seed) in [(2, 1), (4, 2)] {
        let dir = run.join(format!("checkpoints/step-{step:08}"));
        let model = model_io::init_random(&cfg, seed, DType::F32, &Device::Cpu).unwrap();
        model_io::save(&model, &dir, DType::F32).unwrap();
    }
    std::fs::write(run.join("checkpoints/latest"), "step-00000004").unwrap();
    run.join("checkpoints/step-00000004")
}

#[test]
fn a_run_directory_or_its_latest_pointer_names_its_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let newest = lay_out_run(&dir.path().join("run"));
    let cache = hf_hub::Cache::new(dir.path().join("hub"));
    let resolve = |p: &Path| rookworld_lm::hub::resolve_in(p, &cache, true);
    let run = dir.path().join("run");
    assert_eq!(resolve(&run).unwrap(), newest);
    assert_eq!(resolve(&run.join("checkpoints/latest")).unwrap(), newest);
    let older = run.join("checkpoints/step-00000002");
    assert_eq!(resolve(&older).unwrap(), older);
    // A directory that holds no model says what --model takes.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = resolve(&empty).unwrap_err().to_string();
    assert!(
        e.contains("a directory without config.json")
            && e.contains("a run directory of `learner train`/`sft`")
            && e.contains("a Hugging Face id"),
        "{e}"
    );
    // A run without a finished checkpoint yet.
    std::fs::create_dir_all(dir.path().join("fresh/checkpoints")).unwrap();
    let e = resolve(&dir.path().join("fresh")).unwrap_err().to_string();
    assert!(
        e.contains("a run directory without a finished checkpoint"),
        "{e}"
    );

    // A command takes the run directory as its model.
    let out = Command::new(WORKER)
        .args(["generate", "--model"])
        .arg(&run)
        .args(["--prompt", "A: ", "--max-new-tokens", "3"])
        .env_remove("ROOKWORLD_PRESET")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("step-00000004"),
        "the source names the checkpoint: {err}"
    );
}

#[test]
fn a_command_loads_a_model_by_name() {
    let home = tempfile::tempdir().unwrap();
    lay_out_cache(home.path());
    let run = |model: &str| {
        Command::new(WORKER)
            .args([
                "generate",
                "--model",
                model,
                "--prompt",
                "A: ",
                "--max-new-tokens",
                "3",
            ])
            .env("HF_HOME", home.path())
            .env("HF_HUB_OFFLINE", "1")
            .env_remove("ROOKWORLD_PRESET")
            .output()
            .unwrap()
    };
    let out = run("jrahn/RookWorld-LM-124M");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert!(line["completions"].is_array(), "{line}");
    let out = run("jrahn/Missing");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("jrahn/Missing") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
}
