//! The validation table: every refused value of every command exits 1 with one line that
//! names the flag, before any work (no model loaded, no port bound, no retry loop), and
//! never panics.

use std::process::Command;

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");
const REWARD: &str = env!("CARGO_BIN_EXE_rw-reward-server");

/// `learner train` with a test's flags and a token (loopback port 0, metrics off).
fn train(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<&str> = vec![
        "train",
        "--token",
        "t",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--sft-steps",
        "0",
    ];
    args.extend_from_slice(extra);
    args.into_iter().map(String::from).collect()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn every_refused_value_is_one_line_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run = run.to_str().unwrap();
    // A log file's directory is made when missing; under a regular file it cannot be.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let under_a_file = format!("{}/dir/steps.jsonl", file.display());
    let cases: Vec<(&str, Vec<String>, &str)> = vec![
        // learner train
        (LEARNER, train(&["--lr", "-1"]), "--lr must be > 0 (got -1)"),
        (
            LEARNER,
            train(&["--lr", "1e-6"]),
            "--min-lr 0.0001 is above --lr 0.000001: the cosine schedule would raise the rate",
        ),
        (
            LEARNER,
            train(&["--temperature", "-1"]),
            "--temperature must be ≥ 0, 0 meaning greedy (got -1)",
        ),
        (
            LEARNER,
            train(&["--temperature", "0"]),
            "--temperature 0 is greedy: every completion of a group would be the same",
        ),
        (
            LEARNER,
            train(&["--top-p", "0"]),
            "--top-p must lie in (0, 1], 1 meaning off (got 0)",
        ),
        // The same rules where completions are sampled outside training.
        (
            WORKER,
            strings(&[
                "generate",
                "--preset",
                "tiny",
                "--prompt",
                "A: ",
                "--temperature",
                "-1",
            ]),
            "temperature must be ≥ 0, 0 meaning greedy (got -1)",
        ),
        (
            WORKER,
            strings(&[
                "generate", "--preset", "tiny", "--prompt", "A: ", "--top-p", "0",
            ]),
            "top-p must lie in (0, 1], 1 meaning off (got 0)",
        ),
        (
            LEARNER,
            strings(&["eval", "--preset", "tiny", "--temperature", "-0.5"]),
            "temperature must be ≥ 0, 0 meaning greedy (got -0.5)",
        ),
        (
            LEARNER,
            strings(&["eval", "--preset", "tiny", "--samples", "4"]),
            "--samples 4 at --temperature 0 (greedy) would give 4 equal samples",
        ),
        (
            WORKER,
            strings(&["bench", "--preset", "tiny", "--top-p", "0"]),
            "--top-p must lie in (0, 1], 1 meaning off (got 0)",
        ),
        // The kernel profile is of the CUDA backend's kernels; the CPU is sampled by perf.
        (
            LEARNER,
            strings(&[
                "bench",
                "--preset",
                "tiny",
                "-p",
                "1",
                "-n",
                "2",
                "--profile",
            ]),
            "--profile times the kernels of the fused pass on CUDA (--device cuda --path \
             fused); this step runs the fused pass on the CPU (perf record samples it)",
        ),
        (
            LEARNER,
            train(&["--clip-eps", "5"]),
            "--clip-eps must lie in [0, 1]",
        ),
        // The weights' dtype and the products' precision: each refuses the other's values
        // with the key that takes them, and the old shared name is refused everywhere.
        (
            LEARNER,
            train(&["--precision", "bf16"]),
            "--precision bf16: `precision` was split in two — use --weight-dtype",
        ),
        (
            LEARNER,
            train(&["--rollout-precision", "int8"]),
            "--rollout-precision int8: `precision` was split in two",
        ),
        (
            LEARNER,
            train(&["--rollout-weight-dtype", "int4"]),
            "--rollout-weight-dtype: unknown weight dtype `int4` (use auto, f32, bf16, f16 or int8)",
        ),
        (
            WORKER,
            strings(&[
                "generate",
                "--preset",
                "tiny",
                "--prompt",
                "A: ",
                "--precision",
                "int8",
            ]),
            "--precision int8: `precision` was split in two",
        ),
        (
            WORKER,
            strings(&[
                "generate",
                "--preset",
                "tiny",
                "--prompt",
                "A: ",
                "--weight-dtype",
                "int4",
            ]),
            "--weight-dtype: unknown weight dtype `int4` (use auto, f32, bf16, f16 or int8)",
        ),
        (
            LEARNER,
            strings(&["bench", "--preset", "tiny", "--precision", "f32"]),
            "--precision f32: `precision` was split in two",
        ),
        (
            LEARNER,
            train(&["--push-every", "0"]),
            "--push-every must be ≥ 1",
        ),
        (
            LEARNER,
            train(&["--group-size", "1"]),
            "--group-size must be ≥ 2",
        ),
        (
            LEARNER,
            train(&["--top-p", "1.5"]),
            "--top-p must lie in (0, 1], 1 meaning off (got 1.5)",
        ),
        (
            LEARNER,
            train(&["--stall-timeout", "-3"]),
            "--stall-timeout must be ≥ 0",
        ),
        (
            LEARNER,
            train(&["--reward", "reward:50052"]),
            "--reward `reward:50052` is not a URL",
        ),
        (
            LEARNER,
            train(&[
                "--preset",
                "tiny",
                "--max-new-tokens",
                "250",
                "--run-dir",
                run,
            ]),
            "--max-new-tokens 250 does not fit",
        ),
        // learner sft
        (
            LEARNER,
            strings(&["sft", "--preset", "tiny", "--run-dir", run, "--lr=-1"]),
            "--lr must be > 0 (got -1)",
        ),
        (
            LEARNER,
            strings(&[
                "sft",
                "--preset",
                "tiny",
                "--run-dir",
                run,
                "--batch-size",
                "0",
            ]),
            "--batch-size must be ≥ 1",
        ),
        // learner loss and bench: the objective's rules are train's
        (
            LEARNER,
            strings(&[
                "loss",
                "--policy",
                "p",
                "--reference",
                "r",
                "--batch",
                "b.json",
                "--clip-eps",
                "5",
            ]),
            "--clip-eps must lie in [0, 1]",
        ),
        (
            LEARNER,
            strings(&["bench", "--preset", "tiny", "--beta=-0.5"]),
            "--beta must be ≥ 0",
        ),
        (
            LEARNER,
            strings(&["bench", "--preset", "tiny", "--group-size", "1"]),
            "--group-size must be ≥ 2",
        ),
        // rollout-worker bench and generate
        (
            WORKER,
            strings(&["bench", "--preset", "tiny", "--prompts", "0"]),
            "--prompts must be ≥ 1",
        ),
        (
            WORKER,
            strings(&["bench", "--preset", "tiny", "--max-new-tokens", "250"]),
            "--max-new-tokens 250 does not fit",
        ),
        (
            WORKER,
            strings(&[
                "generate", "--preset", "tiny", "--prompt", "A: x", "-n", "0",
            ]),
            "--num-completions must be ≥ 1",
        ),
        // rollout-worker serve
        (
            WORKER,
            strings(&[
                "serve",
                "--preset",
                "tiny",
                "--token",
                "t",
                "--learner",
                "learner:50051",
                "--reward",
                "http://r:1",
            ]),
            "--learner `learner:50051` is not a URL",
        ),
        (
            WORKER,
            strings(&[
                "serve",
                "--preset",
                "tiny",
                "--learner",
                "http://127.0.0.1:1",
                "--reward",
                "http://127.0.0.1:1",
                "--max-in-flight",
                "0",
            ]),
            "--max-in-flight must be ≥ 1",
        ),
        (
            WORKER,
            strings(&[
                "generate",
                "--preset",
                "tiny",
                "--prompt",
                "A: x",
                "--max-new-tokens",
                "300",
            ]),
            "exceed the model's 256-token context; use --max-new-tokens",
        ),
        // reward-server bench
        (
            REWARD,
            strings(&["bench", "--items", "0"]),
            "--items must be ≥ 1",
        ),
        // learner train: the output files checked before the warm-up
        (
            LEARNER,
            train(&["--log-jsonl", &under_a_file]),
            "Not a directory",
        ),
        // learner eval: the output checked before any work
        (
            LEARNER,
            strings(&[
                "eval",
                "--preset",
                "tiny",
                "--out",
                "/nonexistent/dir/eval.json",
            ]),
            "--out /nonexistent/dir/eval.json: No such file or directory",
        ),
        // reward-server serve
        (
            REWARD,
            strings(&[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--max-items-per-call",
                "0",
            ]),
            "--max-items-per-call must be ≥ 1 (got 0)",
        ),
    ];
    for (binary, args, expect) in cases {
        let out = Command::new(binary)
            .args(&args)
            .env("RUST_LOG", "off")
            .env_remove("LEARNER_RESUME")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let shown = format!("{} {}", binary.rsplit('/').next().unwrap(), args.join(" "));
        assert_eq!(out.status.code(), Some(1), "{shown}: {err}");
        assert!(err.contains(expect), "{shown}: {err}");
        assert!(!err.contains("panicked"), "{shown}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{shown}: {err}");
    }
    // Refused before anything was written: not even the run directory.
    assert!(!std::path::Path::new(run).exists(), "a refusal made {run}");
    // A negative count reaches the range rule (one line, exit 1) on every binary.
    for (binary, args, expect) in [
        (
            LEARNER,
            train(&["--steps", "-5"]),
            "--steps must not be negative (got -5)",
        ),
        (
            WORKER,
            strings(&["serve", "--preset", "tiny", "--max-in-flight", "-2"]),
            "--max-in-flight must not be negative (got -2)",
        ),
        (
            REWARD,
            strings(&["serve", "--max-items-per-call", "-1"]),
            "--max-items-per-call must not be negative (got -1)",
        ),
    ] {
        let out = Command::new(binary).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expect), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // A value that is not a number at all is the parser's error, one line naming the flag.
    let out = Command::new(LEARNER)
        .args(train(&["--steps", "five"]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("invalid value 'five' for '--steps"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // So is a weight dtype given as the learner's products' precision, naming the key that
    // takes it.
    let out = Command::new(LEARNER)
        .args(train(&["--matmul-precision", "int8"]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("int8 is a weight dtype, not a precision of the learner's products (auto, f32, bf16): a rollout worker's or an evaluation's weights take it (--weight-dtype int8; with train --local, --rollout-weight-dtype int8)"),
        "{err}"
    );
}
