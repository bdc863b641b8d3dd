//! `rollout-worker generate` as a user runs it: JSON on stdout, one error line otherwise.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_rollout-worker");
const START: &str = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:";

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The command fails with exit code 1 and exactly one line on stderr containing `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line expected: {stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(needle),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn four_completions_and_47_prompt_ids_for_the_start_position() {
    let out = run(&[
        "generate",
        "--preset",
        "tiny",
        "--prompt",
        START,
        "-n",
        "4",
        "--max-new-tokens",
        "16",
        "--seed",
        "3",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1);
    let line = &lines[0];
    assert_eq!(line["prompt"], START);
    let ids = line["prompt_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 47, "end-of-text BOS + 46 prompt tokens");
    assert_eq!(ids[0], 50256);
    let completions = line["completions"].as_array().unwrap();
    assert_eq!(completions.len(), 4);
    for c in completions {
        let n = c["ids"].as_array().unwrap().len();
        assert!((1..=16).contains(&n));
        assert_eq!(c["logprobs"].as_array().unwrap().len(), n);
        assert!(
            c["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|lp| lp.as_f64().unwrap() <= 0.0)
        );
        assert!(["eos", "length"].contains(&c["finish_reason"].as_str().unwrap()));
        assert!(c["text"].is_string());
    }
    assert!(line["timing"]["run_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(
        line["completions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["weight_version"] == 0)
    );
    // Same seed, same output.
    let again = json_lines(&run(&[
        "generate",
        "--preset",
        "tiny",
        "--prompt",
        START,
        "-n",
        "4",
        "--max-new-tokens",
        "16",
        "--seed",
        "3",
    ]));
    assert_eq!(again[0]["completions"], line["completions"]);
}

#[test]
fn prompts_file_and_repeated_prompts_give_one_line_each_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.txt");
    std::fs::write(&file, "A: first\n\nA: second\r\n").unwrap();
    let out = run(&[
        "generate",
        "--preset",
        "tiny",
        "--prompt",
        "P: zero",
        "--prompts-file",
        file.to_str().unwrap(),
        "--temperature",
        "0",
        "--max-new-tokens",
        "4",
        "--max-seqs",
        "2",
    ]);
    let lines = json_lines(&out);
    let prompts: Vec<&str> = lines
        .iter()
        .map(|l| l["prompt"].as_str().unwrap())
        .collect();
    assert_eq!(prompts, ["P: zero", "A: first", "A: second"]);
    // Two rows for three prompts: the third starts when a row frees, and every prompt
    // still gets its completion.
    assert!(
        lines
            .iter()
            .all(|l| l["completions"].as_array().unwrap().len() == 1)
    );
}

#[test]
fn a_checkpoint_directory_loads() {
    use candle_core::{DType, Device};
    use rookworld_lm::{Config, model_io};
    let dir = tempfile::tempdir().unwrap();
    let model = model_io::init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
    model_io::save(&model, dir.path(), DType::BF16).unwrap();
    let out = run(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "hi",
        "--temperature",
        "0",
        "--max-new-tokens",
        "3",
    ]);
    let lines = json_lines(&out);
    assert_eq!(
        lines[0]["completions"][0]["ids"].as_array().unwrap().len(),
        3
    );
}

#[test]
fn bad_input_gives_one_error_line_and_exit_code_1() {
    assert_one_line_error(
        &run(&["generate", "--model", "/nonexistent/rw", "--prompt", "x"]),
        "/nonexistent/rw",
    );
    assert_one_line_error(
        &run(&[
            "generate",
            "--preset",
            "tiny",
            "--weight-dtype",
            "f8",
            "--prompt",
            "x",
        ]),
        "f8",
    );
    assert_one_line_error(
        &run(&["generate", "--preset", "huge", "--prompt", "x"]),
        "huge",
    );
    assert_one_line_error(
        &run(&[
            "generate", "--preset", "tiny", "--device", "tpu", "--prompt", "x",
        ]),
        "tpu",
    );
    assert_one_line_error(
        &run(&[
            "generate", "--preset", "tiny", "--device", "cuda", "--prompt", "x",
        ]),
        "cuda",
    );
    assert_one_line_error(&run(&["generate", "--preset", "tiny"]), "no prompts");
    assert_one_line_error(
        &run(&[
            "generate", "--preset", "tiny", "--prompt", "x", "--top-p", "0",
        ]),
        "top-p",
    );
    assert_one_line_error(
        &run(&[
            "generate",
            "--preset",
            "tiny",
            "--prompts-file",
            "/nonexistent/p.txt",
        ]),
        "/nonexistent/p.txt",
    );
    let long = "e2e4 ".repeat(200); // 400 tokens > the tiny preset's 256 positions
    assert_one_line_error(
        &run(&["generate", "--preset", "tiny", "--prompt", &long]),
        "context",
    );
}

#[test]
fn help_answers() {
    for args in [&["--help"][..], &["generate", "--help"][..]] {
        let out = run(args);
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
    }
}
