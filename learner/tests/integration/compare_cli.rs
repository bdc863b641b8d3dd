//! `learner compare-backends`, the debug mode of the step's backends, on the CPU: BF16
//! products against f32 within the mixed-precision tolerance, the first buffer beyond a
//! tighter one named on one line with exit 1, timing, and bad input refused.

use std::process::Command;

fn compare(args: &[&str]) -> (std::process::Output, Option<serde_json::Value>) {
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .arg("compare-backends")
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let json = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok());
    (out, json)
}

const BF16_VS_F32: [&str; 4] = ["--backend", "cpu-bf16", "--reference", "cpu-f32"];

#[test]
fn bf16_products_match_f32_within_the_mixed_precision_tolerance() {
    let (out, v) = compare(&BF16_VS_F32);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = v.expect("one JSON line");
    assert_eq!(v["matched"], true, "{v}");
    // tiny: 2 blocks of 10 buffers, 7 after them, 28 parameters' gradients, ∂ embedding.
    assert_eq!(v["buffers_checked"], 56, "{v}");
    assert_eq!(v["reference"], "cpu-f32");
    assert_eq!(
        (v["atol"].as_f64(), v["rtol"].as_f64()),
        (Some(1e-3), Some(5e-2))
    );
    let close = &v["closest_to_tolerance"];
    assert!(close["max_abs_diff"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["first_divergence"].is_null());
}

#[test]
fn the_first_buffer_beyond_the_tolerance_is_one_line_and_exit_1() {
    let mut args = BF16_VS_F32.to_vec();
    args.extend(["--atol", "0", "--rtol", "0"]);
    let (out, v) = compare(&args);
    assert_eq!(out.status.code(), Some(1));
    let v = v.expect("the report is printed before the error");
    // The embedding and the first layer norm have no products: the first product's
    // output is the first buffer BF16 operands change.
    assert_eq!(
        v["first_divergence"]["name"], "block 0: c_attn output (q, k, v)",
        "{v}"
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.starts_with(
            "error: cpu-bf16 differs from the cpu-f32 reference first at block 0: c_attn output (q, k, v): max |Δ|"
        ),
        "{err}"
    );
}

#[test]
fn the_same_products_match_and_a_pass_is_timed() {
    let (out, v) = compare(&["--backend", "cpu-bf16", "--time-passes", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = v.unwrap();
    assert_eq!(v["matched"], true, "{v}");
    assert!(v["pass_seconds"].as_f64().unwrap() > 0.0);
    assert!(v["activation_bytes"].as_u64().unwrap() > 0);
    // Only timing.
    let (out, v) = compare(&["--backend", "cpu-f32", "--no-compare", "--time-passes", "1"]);
    assert!(out.status.success());
    let v = v.unwrap();
    assert!(v["matched"].is_null() && v["buffers_checked"] == 0, "{v}");
}

#[test]
fn bad_input_is_one_line_and_exit_1() {
    for (args, want) in [
        (
            vec!["--backend", "cpu-f32", "--prompts", "0"],
            "error: --prompts must be at least 1",
        ),
        (
            vec![
                "--backend",
                "cpu-f32",
                "--prompt-tokens",
                "250",
                "--completion-tokens",
                "10",
            ],
            "error: --prompt-tokens + --completion-tokens = 260 exceeds the model's 256 positions",
        ),
        (
            vec!["--backend", "cpu-f32", "--rtol", "-1"],
            "error: --atol and --rtol must be non-negative numbers",
        ),
        (
            vec!["--backend", "cpu-f32", "--no-compare"],
            "error: --no-compare leaves nothing to do without --time-passes",
        ),
        (
            vec!["--backend", "tpu"],
            "error: invalid value 'tpu' for '--backend <BACKEND>'",
        ),
    ] {
        let (out, _) = compare(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.starts_with(want), "{args:?}: {err}");
    }
    if !cfg!(feature = "cuda") {
        let (out, _) = compare(&["--backend", "cuda"]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("built without CUDA"), "{err}");
    }
}
