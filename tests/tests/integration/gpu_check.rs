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
        "learner_profile",
        "tiles_compare",
        "tiles_profile",
        "decode_profile",
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

/// The profile sections' parts on the CPU, with a stand-in for Nsight Compute (a script
/// printing what `ncu --csv --page raw` prints: ncu's own lines and the program's output
/// around a header row, a row of units and a row per profiled launch): the window and the
/// program reach it, the launches are summed by kernel, and the table lists the kernels
/// longest first, beside the fused step's as `learner bench --profile` reports them (with
/// the warp kernels' attention and with the trial tiled one).
#[test]
fn the_profile_sections_sum_kernels_by_name_and_table_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let py = std::env::var("ROOKWORLD_PYTHON").unwrap_or("python3".into());
    let check = root.join("tests/gpu/check.py");
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let args_seen = dir.path().join("ncu-args");
    let ncu = bin.join("ncu");
    std::fs::write(
        &ncu,
        format!(
            r#"#!/bin/sh
echo "$@" > {}
echo '==PROF== Connected to process 7 (rollout-worker)'
echo '{{"tokens_per_second": 1000}}'
echo '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum"'
echo '"","","","","","","","usecond"'
echo '"0","7","rollout-worker","127.0.0.1","row_attention_bf16","1","13","1,200.5"'
echo '"1","7","rollout-worker","127.0.0.1","sm90_gemm_bf16","1","13","300"'
echo '"2","7","rollout-worker","127.0.0.1","row_attention_bf16","1","13","799.5"'
echo '==PROF== Disconnected from process 7'
"#,
            args_seen.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&ncu, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let profiled = Command::new(&py)
        .arg(&check)
        .args(["ncu-profile"])
        .arg(out.join("decode_profile.json"))
        .args(["--launch-skip", "40", "--launch-count", "3", "--"])
        .args(["worker", "bench", "--prompts", "2"])
        .env("PATH", &path)
        .output()
        .expect("python runs");
    assert!(
        profiled.status.success(),
        "{}",
        String::from_utf8_lossy(&profiled.stderr)
    );
    let seen = std::fs::read_to_string(&args_seen).unwrap();
    for part in [
        "--clock-control none",
        "--launch-skip 40 --launch-count 3",
        "worker bench --prompts 2",
    ] {
        assert!(seen.contains(part), "{seen}");
    }
    let decode: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("decode_profile.json")).unwrap()).unwrap();
    assert_eq!(decode["launches"], 3, "{decode}");
    assert_eq!(decode["by_kernel"][0]["name"], "row_attention_bf16");
    assert_eq!(decode["by_kernel"][0]["launches"], 2);
    let ms = decode["by_kernel"][0]["ms"].as_f64().unwrap();
    assert!((ms - 2.0).abs() < 1e-9, "{decode}");
    let share = decode["by_kernel"][1]["share"].as_f64().unwrap();
    assert!((share - 300.0 / 2300.0).abs() < 1e-9, "{decode}");

    // The fused step's report, as `learner bench --profile` prints it: one JSON line (of
    // which only what the table reads).
    let report = serde_json::json!({"step_seconds": 0.1, "kernels": {
        "seconds": 0.08, "launches": 3100.0, "by_kernel": [
            {"name": "gemm 2304×17600×768 TN", "launches": 24.0, "ms": 50.0, "share": 0.625},
            {"name": "attention_bwd_dkv_d64", "launches": 12.0, "ms": 30.0, "share": 0.375}]}});
    std::fs::write(out.join("learner_profile.json"), report.to_string()).unwrap();
    // The same step with the step's trials (tiled attention, kept head), twice as fast.
    let tiled = serde_json::json!({"step_seconds": 0.05, "kernels": {
        "seconds": 0.04, "launches": 3100.0, "by_kernel": [
            {"name": "gemm 2304×17600×768 TN", "launches": 24.0, "ms": 40.0, "share": 1.0}]}});
    std::fs::write(out.join("tiles_profile.json"), tiled.to_string()).unwrap();
    let table = Command::new(&py)
        .arg(&check)
        .arg("table")
        .arg(&out)
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(table.status.success(), "{text}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let learner = &summary["learner kernels (per step)"];
    assert_eq!(learner["all kernels ms"], "80", "{summary:#}");
    assert_eq!(learner["gemm 2304×17600×768 TN"], "62.5%", "{summary:#}");
    assert_eq!(learner["attention_bwd_dkv_d64"], "37.5%", "{summary:#}");
    assert_eq!(
        summary["step trials (tiled attention, kept head)"]["× without them (step)"], "2",
        "{summary:#}"
    );
    assert_eq!(
        summary["learner kernels, step trials"]["gemm 2304×17600×768 TN"], "100.0%",
        "{summary:#}"
    );
    let decode = &summary["decode kernels (ncu)"];
    assert_eq!(decode["kernels ms"], "2.3", "{summary:#}");
    assert_eq!(decode["row_attention_bf16"], "87.0%", "{summary:#}");
    assert!(text.contains("20 ms outside the pass's kernels"), "{text}");
}
