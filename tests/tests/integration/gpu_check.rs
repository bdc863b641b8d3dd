//! `tests/gpu-check.sh` run as a dry run on the CPU (`DEVICE=cpu QUICK=1`, the tiny
//! preset): every section the script runs on a lent GPU runs here with the real binaries,
//! so a GPU session spends its minutes on the GPU, not on the script. The sections that
//! need PyTorch record why they were skipped where it is not installed (`ROOKWORLD_PYTHON`
//! names a Python that has it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

fn python() -> String {
    std::env::var("ROOKWORLD_PYTHON").unwrap_or("python3".into())
}

/// Runs the script into `out` on the CPU with the tiny preset, `env` on top; its output
/// and how long it took.
fn gpu_check(out: &Path, env: &[(&str, &str)]) -> (Output, Duration) {
    let started = Instant::now();
    let output = Command::new("bash")
        .arg(root().join("tests/gpu-check.sh"))
        .arg(out)
        .current_dir(root())
        .env("DEVICE", "cpu")
        .env("QUICK", "1")
        .env("PYTHON", python())
        .envs(env.iter().copied())
        .output()
        .expect("bash runs");
    (output, started.elapsed())
}

/// The run's archive (`OUT/check.tar.gz`) unpacked, and the names it lists.
fn unpack(out: &Path) -> (tempfile::TempDir, Vec<String>) {
    let archive = out.join("check.tar.gz");
    let dir = tempfile::tempdir().unwrap();
    let tar = |args: &[&str]| {
        let run = Command::new("tar")
            .args(args)
            .arg(&archive)
            .args(["-C"])
            .arg(dir.path())
            .output()
            .expect("tar runs");
        assert!(run.status.success(), "{archive:?}: {run:?}");
        String::from_utf8(run.stdout).unwrap()
    };
    let listed = tar(&["-tzf"])
        .lines()
        .map(|l| l.trim_start_matches("./").to_owned())
        .collect();
    tar(&["-xzf"]);
    (dir, listed)
}

fn json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// The section JSON files of the archive that record an error (failed or cut).
fn errors(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name()?.to_str()?.to_owned();
            let text = std::fs::read_to_string(&path).ok()?;
            (name.ends_with(".json") && text.contains("\"error\"")).then_some(name)
        })
        .collect();
    names.sort();
    names
}

#[test]
fn the_gpu_check_script_runs_every_section_on_the_cpu() {
    let out = tempfile::tempdir().unwrap();
    let (run, took) = gpu_check(out.path(), &[("LEARNER", LEARNER), ("WORKER", WORKER)]);
    let table = String::from_utf8_lossy(&run.stdout);
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{table}\n{log}");
    eprintln!("the dry run took {took:?}");
    // The estimate of what was selected, printed before the first section.
    let estimate = log.lines().next().unwrap_or("");
    assert!(
        estimate.starts_with("gpu-check: 16 sections selected, estimated ")
            && estimate.contains("deadline 420 s"),
        "{log}"
    );
    // What comes back: one archive and the table, nothing else loose.
    let mut loose: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    loose.sort();
    assert_eq!(loose, ["check.tar.gz", "summary.json", "table.txt"]);
    let (dir, listed) = unpack(out.path());
    let summary = json(out.path().join("summary.json"));
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
        "3 / 3"
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
    // The whole loop: seconds a step and generated tokens a second after the first step,
    // and a run that trained (a group whose rewards differ), its kept groups beside.
    let per_step: f64 = at("learner train on the device", "s / step")
        .parse()
        .unwrap();
    assert!(per_step > 0.0, "{per_step}");
    let generated: f64 = at("learner train on the device", "generated tokens/s")
        .parse()
        .unwrap();
    assert!(generated > 0.0, "{table}");
    let train = json(dir.path().join("train.json"));
    assert!(train["trained_tokens"].as_u64().unwrap() > 0, "{train}");
    assert!(train["kept_groups"].as_u64().unwrap() > 0, "{train}");
    assert!(
        train["generated_tokens_per_second"].as_f64().unwrap()
            >= train["trained_tokens_per_second"].as_f64().unwrap(),
        "{train}"
    );
    // Every section left its JSON and its log in the archive, the table beside them.
    for name in [
        "device",
        "parity",
        "copy_bandwidth",
        "worker_2x2_8",
        "split_2x2_8",
        "graphs_2x2_8",
        "hf_2x2_8",
        "graph_2x2_8",
        "backend_compare",
        "backend_pass",
        "learner_profile",
        "tiles_compare",
        "tiles_profile",
        "mma_compare",
        "mma_profile",
        "decode_profile",
        "learner_step",
        "learner_composed",
        "push",
        "push_in_place",
        "train",
        "trl",
        "nvml",
    ] {
        assert!(
            listed.contains(&format!("{name}.json")),
            "{name}: {listed:?}"
        );
    }
    for name in ["parity", "worker_2x2_8", "learner_step", "push", "train"] {
        assert!(
            listed.contains(&format!("{name}.log")),
            "{name}: {listed:?}"
        );
    }
    assert!(listed.contains(&"table.txt".to_owned()), "{listed:?}");
    // Nothing failed, nothing was cut, no probe was needed, and the deadline held.
    assert_eq!(at("check", "failed"), "none", "{table}");
    assert_eq!(at("check", "cut by the deadline"), "none", "{table}");
    assert!(
        !listed.iter().any(|n| n.starts_with("health_after_")),
        "{listed:?}"
    );
    let check = json(dir.path().join("check.json"));
    assert!(check["elapsed_seconds"].as_u64().unwrap() <= 420, "{check}");
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
    let composed = json(dir.path().join("learner_composed.json"));
    assert_eq!(composed["train_ops"], false, "{composed}");
    assert!(
        composed["step_seconds"].as_f64().unwrap() > 0.0,
        "{composed}"
    );
}

/// The script's time budget, with stand-ins for the binaries: a section past its limit is
/// stopped and recorded, the device's health is probed after it, the sections after it
/// still run, a deadline cuts what would not finish before it (and the table says so),
/// each section leaves its JSON in the archive, the exit status counts the failed and cut
/// sections, and a second run of some sections keeps the first run's others.
#[test]
fn the_gpu_check_script_bounds_each_section_and_the_whole_run() {
    let stubs = tempfile::tempdir().unwrap();
    let slow = stubs.path().join("slow");
    std::fs::write(&slow, "#!/bin/sh\nsleep 60\n").unwrap();
    std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let slow = slow.to_str().unwrap();
    fn with<'a>(slow: &'a str, more: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut env = vec![("LEARNER", "/bin/false"), ("WORKER", slow)];
        env.extend_from_slice(more);
        env
    }

    // Each worker section (the stand-in sleeps 60 s) is stopped at its 2 s limit.
    let out = tempfile::tempdir().unwrap();
    let (done, took) = gpu_check(out.path(), &with(slow, &[("SECTION_TIMEOUT", "2")]));
    assert!(
        took.as_secs() < 50,
        "the sections were not stopped: {took:?}"
    );
    let (dir, listed) = unpack(out.path());
    let parity = std::fs::read_to_string(dir.path().join("parity.json")).unwrap();
    assert!(parity.contains("stopped at its 2 s limit"), "{parity}");
    // After each failed section, the device's health (the CPU's here).
    let health = json(dir.path().join("health_after_parity.json"));
    assert_eq!(health["healthy"], true, "{health}");
    for later in [
        "learner_step",
        "push",
        "push_in_place",
        "train",
        "learner_composed",
    ] {
        assert!(listed.contains(&format!("{later}.json")), "{later}");
        assert!(
            listed.contains(&format!("health_after_{later}.json")),
            "{later}"
        );
    }
    assert!(out.path().join("table.txt").exists() && out.path().join("summary.json").exists());
    let failed = errors(dir.path());
    assert!(failed.len() >= 6, "{failed:?}");
    assert_eq!(done.status.code(), Some(failed.len() as i32), "{failed:?}");

    // A second run of one section into a new directory keeps the first run's others.
    let again = tempfile::tempdir().unwrap();
    let previous = out.path().join("check.tar.gz");
    gpu_check(
        again.path(),
        &with(
            slow,
            &[("ONLY", "device"), ("PREVIOUS", previous.to_str().unwrap())],
        ),
    );
    let (_, relisted) = unpack(again.path());
    assert!(relisted.contains(&"parity.json".to_owned()), "{relisted:?}");

    // An 8 s deadline: the device section runs, the parity check's 10 s estimate does not
    // fit in what is left, so it is cut, and so on; the run ends near the deadline.
    let out = tempfile::tempdir().unwrap();
    let (_, took) = gpu_check(out.path(), &with(slow, &[("DEADLINE", "8")]));
    assert!(took.as_secs() < 25, "the deadline was not kept: {took:?}");
    let (dir, _) = unpack(out.path());
    let parity = std::fs::read_to_string(dir.path().join("parity.json")).unwrap();
    assert!(
        parity.contains("cut: estimated 10 s") && parity.contains("of the 8 s deadline"),
        "{parity}"
    );
    let summary = json(out.path().join("summary.json"));
    let cut = summary["check"]["cut by the deadline"].as_str().unwrap();
    assert!(
        cut.contains("parity") && cut.contains("learner_composed"),
        "{cut}"
    );

    // Past the deadline every section is cut, and counted: device, parity, worker, graph,
    // backend_compare, learner_step, push, copy_bandwidth, hf, graphs, split,
    // backend_pass, push_in_place, train, trl, learner_composed.
    let out = tempfile::tempdir().unwrap();
    let (done, _) = gpu_check(out.path(), &with(slow, &[("DEADLINE", "0")]));
    let (dir, _) = unpack(out.path());
    let failed = errors(dir.path());
    assert_eq!(failed.len(), 16, "{failed:?}");
    assert_eq!(done.status.code(), Some(16));
    let train = std::fs::read_to_string(dir.path().join("train.json")).unwrap();
    assert!(train.contains("deadline"), "{train}");
}

/// The CUDA-graph decode peer's guard against host synchronisations, which its step runs
/// under in the dry run (`tests/gpu/host_sync_test.py`): a 0-dim device index and the
/// like are refused, the step's own ops pass. Where PyTorch is missing it says so.
#[test]
fn the_graph_peer_guard_refuses_host_synchronisations() {
    let run = Command::new(python())
        .arg(root().join("tests/gpu/host_sync_test.py"))
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        text.contains("\"passed\": true") || text.contains("\"skipped\""),
        "{text}"
    );
}

/// The profile sections' parts on the CPU, with a stand-in for Nsight Compute (a script
/// printing what `ncu --csv --page raw` prints: ncu's own lines and the program's output
/// around a header row, a row of units and a row per profiled launch): the window and the
/// program reach it, the launches are summed by kernel, and the table lists the kernels
/// longest first, beside the fused step's as `learner bench --profile` reports them (with
/// the warp kernels' attention and with the trial tiled one).
#[test]
fn the_profile_sections_sum_kernels_by_name_and_table_them() {
    let py = python();
    let check = root().join("tests/gpu/check.py");
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
        "--cache-control none",
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
    // With the attention on tensor cores instead, four times as fast.
    let mma = serde_json::json!({"step_seconds": 0.025, "kernels": {
        "seconds": 0.02, "launches": 3100.0, "by_kernel": [
            {"name": "attention_mma_dkv_d64", "launches": 12.0, "ms": 5.0, "share": 0.25},
            {"name": "gemm 2304×17600×768 TN", "launches": 24.0, "ms": 15.0, "share": 0.75}]}});
    std::fs::write(out.join("mma_profile.json"), mma.to_string()).unwrap();
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
    assert_eq!(
        summary["step trials (tensor-core attention, kept head, epilogues)"]["× without them (step)"],
        "4",
        "{summary:#}"
    );
    assert_eq!(
        summary["learner kernels, tensor-core attention, epilogues"]["attention_mma_dkv_d64"],
        "25.0%",
        "{summary:#}"
    );
    let decode = &summary["decode kernels (ncu)"];
    assert_eq!(decode["kernels ms"], "2.3", "{summary:#}");
    assert_eq!(decode["row_attention_bf16"], "87.0%", "{summary:#}");
    assert!(text.contains("20 ms outside the pass's kernels"), "{text}");
}
