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
    // The step's backend: every buffer matched, and its pass timed.
    let matched = at("step backend vs CPU", "buffers matched");
    let (n, of) = matched.split_once(" of ").expect("N of N");
    assert_eq!(n, of, "{table}");
    assert!(
        at("step backend", "forward + backward s")
            .parse::<f64>()
            .unwrap()
            > 0.0
    );
    // The timed steps after the first: seconds a step and tokens a second.
    let per_step: f64 = at("learner train on the device", "s / step")
        .parse()
        .unwrap();
    assert!(per_step > 0.0, "{per_step}");
    // Every section left its JSON file.
    for name in [
        "device",
        "parity",
        "copy_bandwidth",
        "worker_2x2_8",
        "split_2x2_8",
        "hf_2x2_8",
        "graph_2x2_8",
        "backend_compare",
        "backend_pass",
        "learner_step",
        "learner_composed",
        "push",
        "train",
        "trl",
        "nvml",
    ] {
        assert!(
            out.path().join(format!("{name}.json")).exists(),
            "{name}.json"
        );
    }
    assert!(table.contains("learner train on the device"), "{table}");
    // The worker with the trial attention kernel named (the CPU has none: the same run).
    assert!(
        at("rollout 2x2_8", "split attention tokens/s")
            .parse::<f64>()
            .unwrap()
            > 0.0
    );
    // And with the trial captured decode step named (it does not apply on the CPU).
    assert!(
        at("rollout 2x2_8", "captured step tokens/s")
            .parse::<f64>()
            .unwrap()
            > 0.0
    );
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

/// The script's time budget, with stand-ins for the binaries: a section past its limit is
/// stopped and recorded, the sections after it still run, a deadline skips what is left,
/// each section leaves its JSON and the table so far, and the exit status counts the
/// failed sections.
#[test]
fn the_gpu_check_script_bounds_each_section_and_the_whole_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let stubs = tempfile::tempdir().unwrap();
    let slow = stubs.path().join("slow");
    std::fs::write(&slow, "#!/bin/sh\nsleep 60\n").unwrap();
    std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let run = |out: &Path, env: &[(&str, &str)]| {
        let mut cmd = Command::new("bash");
        cmd.arg(root.join("tests/gpu-check.sh"))
            .arg(out)
            .current_dir(root)
            .env("DEVICE", "cpu")
            .env("QUICK", "1")
            .env("LEARNER", "/bin/false")
            .env("WORKER", &slow)
            .envs(env.iter().copied());
        let started = std::time::Instant::now();
        let output = cmd.output().expect("bash runs");
        (output, started.elapsed())
    };
    let errors = |out: &Path| {
        std::fs::read_dir(out)
            .unwrap()
            .filter_map(|e| {
                let path = e.unwrap().path();
                let name = path.file_name()?.to_str()?.to_owned();
                let text = std::fs::read_to_string(&path).ok()?;
                (name.ends_with(".json") && text.contains("\"error\"")).then_some(name)
            })
            .collect::<Vec<_>>()
    };

    // Each worker section (the stand-in sleeps 60 s) is stopped at its 2 s limit.
    let out = tempfile::tempdir().unwrap();
    let (done, took) = run(out.path(), &[("SECTION_TIMEOUT", "2")]);
    assert!(
        took.as_secs() < 50,
        "the sections were not stopped: {took:?}"
    );
    let parity = std::fs::read_to_string(out.path().join("parity.json")).unwrap();
    assert!(parity.contains("stopped at its 2 s limit"), "{parity}");
    for later in [
        "learner_step",
        "push",
        "push_in_place",
        "train",
        "learner_composed",
    ] {
        assert!(out.path().join(format!("{later}.json")).exists(), "{later}");
    }
    assert!(out.path().join("table.txt").exists() && out.path().join("summary.json").exists());
    let failed = errors(out.path());
    assert!(failed.len() >= 6, "{failed:?}");
    assert_eq!(done.status.code(), Some(failed.len() as i32), "{failed:?}");

    // Past the deadline every section is skipped, and counted: device, parity,
    // copy_bandwidth, worker, split, graphs, hf, graph, backend_compare, backend_pass,
    // learner_step, push, push_in_place, train, trl, learner_composed.
    let out = tempfile::tempdir().unwrap();
    let (done, _) = run(out.path(), &[("DEADLINE", "0")]);
    let failed = errors(out.path());
    assert_eq!(failed.len(), 16, "{failed:?}");
    assert_eq!(done.status.code(), Some(16));
    let train = std::fs::read_to_string(out.path().join("train.json")).unwrap();
    assert!(train.contains("deadline"), "{train}");
}
