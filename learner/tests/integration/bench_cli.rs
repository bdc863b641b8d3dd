//! `learner bench`: one timed GRPO step prints one JSON line with the step split, and bad
//! shapes are one clear line with a non-zero exit.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_learner"))
        .arg("bench")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn bench_prints_one_json_line_with_the_step_split() {
    let out = bench(&[
        "--preset",
        "tiny",
        "-p",
        "2",
        "-n",
        "4",
        "--prompt-tokens",
        "10",
        "--completion-tokens",
        "12",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["path"], "fused");
    // auto: BF16 products where this CPU's AVX512-BF16 dot products outrun its f32 FMAs
    // (measured the same way in this process), f32 elsewhere.
    let auto = if rookworld_lm::cpu_gemm::bf16_products_pay() {
        "bf16"
    } else {
        "f32"
    };
    assert_eq!(v["matmul_dtype"], auto);
    let step = v["step_seconds"].as_f64().unwrap();
    let phases: f64 = ["reference", "forward", "backward", "clip", "optimizer"]
        .iter()
        .map(|p| v["phases"][p].as_f64().unwrap())
        .sum();
    assert!(step > 0.0 && phases <= step * 1.01, "{line}");
    assert!(v["executed_tflop"].as_f64().unwrap() < v["model_tflop"].as_f64().unwrap());
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(v["loss"].as_f64().unwrap().is_finite());
    assert!(v["grad_norm"].as_f64().unwrap() > 0.0);
}

/// `--desk`: the step counted, not run — one JSON line with both configurations and the
/// decode step, the planned one (BF16, head kept, epilogues) bound below today's, and a table on
/// stderr.
#[test]
fn desk_prints_the_counted_step_and_its_bounds() {
    let out = bench(&["--desk", "--preset", "gpt2-124m", "-p", "32", "-n", "8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("step, today: operation, calls, GFLOP, GB"),
        "{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (today, planned) = (&v["today"], &v["planned"]);
    for device in ["seconds_h100", "seconds_h200"] {
        let (t, p) = (
            today[device].as_f64().unwrap(),
            planned[device].as_f64().unwrap(),
        );
        assert!(p > 0.0 && p < t, "{device}: {p} vs {t}");
    }
    // 4 micro-batches of 8 groups; 4 products a layer, each 3 calls and the reference's 1.
    assert_eq!(today["operations"]["products"]["calls"], 4 * 12 * 4 * 4);
    assert_eq!(v["decode"]["rows"], 256);
    assert!(v["decode"]["work"]["bytes"].as_f64().unwrap() > 2.49e8);
}

#[test]
fn bf16_precision_runs_the_fused_step_with_bf16_matmuls() {
    let out = bench(&[
        "--preset",
        "tiny",
        "-p",
        "2",
        "-n",
        "2",
        "--prompt-tokens",
        "8",
        "--completion-tokens",
        "8",
        "--matmul-precision",
        "bf16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // On the CPU the fused pass takes BF16 products (`vdpbf16ps` where the CPU has it).
    assert_eq!(v["path"], "fused");
    assert_eq!(v["matmul_dtype"], "bf16");
    assert!(
        v["device_memory_bytes"].is_null(),
        "no device memory on the CPU"
    );
    assert!(v["loss"].as_f64().unwrap().is_finite());
}

#[test]
fn bad_shapes_are_one_line_and_a_failure() {
    for args in [
        vec!["--preset", "tiny", "-n", "1"],
        vec![
            "--preset",
            "tiny",
            "--prompt-tokens",
            "200",
            "--completion-tokens",
            "100",
        ],
        vec!["--preset", "tiny", "--device", "cuda"],
        vec!["--preset", "gpt5"],
    ] {
        let out = bench(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn each_path_runs_and_reports_itself() {
    for path in ["autograd", "fused"] {
        let out = bench(&[
            "--preset",
            "tiny",
            "-p",
            "2",
            "-n",
            "2",
            "--prompt-tokens",
            "8",
            "--completion-tokens",
            "8",
            "--path",
            path,
        ]);
        assert!(
            out.status.success(),
            "{path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["path"], path);
        assert!(v["loss"].as_f64().unwrap().is_finite(), "{path}");
    }
}
