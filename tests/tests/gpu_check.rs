//! `tests/gpu-check.sh` run as a dry run on the CPU (`DEVICE=cpu QUICK=1`, the tiny
//! preset): every section the script runs on a lent GPU runs here with the real binaries,
//! so a GPU session spends its minutes on the GPU, not on the script. The sections that
//! need PyTorch record why they were skipped where it is not installed.

use std::path::Path;
use std::process::Command;

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");

#[test]
fn the_gpu_check_script_runs_every_section_on_the_cpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = tempfile::tempdir().unwrap();
    let run = Command::new("bash")
        .arg(root.join("tests/gpu-check.sh"))
        .arg(out.path())
        .current_dir(root)
        .env("DEVICE", "cpu")
        .env("QUICK", "1")
        .env("LEARNER", LEARNER)
        .env("WORKER", WORKER)
        .env(
            "PYTHON",
            std::env::var("ROOKWORLD_PYTHON").unwrap_or("python3".into()),
        )
        .output()
        .expect("bash runs");
    let table = String::from_utf8_lossy(&run.stdout);
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{table}\n{log}");
    let summary: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.path().join("summary.json")).expect("the table writes summary.json"),
    )
    .unwrap();
    let at = |section: &str, figure: &str| {
        summary[section][figure]
            .as_str()
            .unwrap_or_else(|| panic!("{section} / {figure} missing: {summary:#}\n{table}"))
            .to_owned()
    };
    // The CPU against itself is exact; bfloat16 is close and greedy decoding agrees.
    assert_eq!(at("parity vs CPU f32", "f32 logits rel. error"), "0");
    assert_eq!(
        at("parity vs CPU f32", "f32 greedy tokens equal"),
        "16/16/16"
    );
    assert_eq!(
        at("parity vs CPU f32", "f32 engine greedy tokens equal"),
        "16/16/16/16/16/16"
    );
    let bf16: f64 = at("parity vs CPU f32", "bf16 logits rel. error")
        .parse()
        .unwrap();
    assert!(bf16 > 0.0 && bf16 < 0.05, "{bf16}");
    // The engine's bench, the weight push both ways, and a local run with finite losses.
    let rate: f64 = at("rollout 2x2_8", "tokens/s").parse().unwrap();
    assert!(rate > 0.0);
    assert!(at("weight push", "same-host s").parse::<f64>().unwrap() > 0.0);
    assert!(at("weight push", "gRPC idle s").parse::<f64>().unwrap() > 0.0);
    assert_eq!(
        at("learner train on the device", "steps / finite losses"),
        "2 / 2"
    );
    // Every section left its JSON file.
    for name in [
        "device",
        "parity",
        "copy_bandwidth",
        "worker_2x2_8",
        "hf_2x2_8",
        "learner_step",
        "learner_composed",
        "push",
        "train",
        "nvml",
    ] {
        assert!(
            out.path().join(format!("{name}.json")).exists(),
            "{name}.json"
        );
    }
    assert!(table.contains("learner train on the device"), "{table}");
    // The learner's step with the training ops off ran (beside the step with them on).
    let composed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("learner_composed.json")).unwrap())
            .unwrap();
    assert_eq!(composed["train_ops"], false, "{composed}");
    assert!(
        composed["step_seconds"].as_f64().unwrap() > 0.0,
        "{composed}"
    );
}
