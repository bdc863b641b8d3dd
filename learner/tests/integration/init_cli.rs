//! `learner init` writes a loadable Hugging Face checkpoint.

use std::process::Command;

use candle_core::{DType, Device};

const BIN: &str = env!("CARGO_BIN_EXE_learner");

#[test]
fn init_writes_a_checkpoint_that_loads() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let status = Command::new(BIN)
        .args([
            "init",
            "--preset",
            "tiny",
            "--init-seed",
            "4",
            "--save-dtype",
            "bf16",
            "--out",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let model = rookworld_lm::model_io::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.config(), &rookworld_lm::Config::tiny());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["dtype"], "bfloat16");
}

#[test]
fn help_and_bad_arguments() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("init"));
    let out = Command::new(BIN)
        .args([
            "init",
            "--preset",
            "tiny",
            "--save-dtype",
            "f64",
            "--out",
            "/tmp/x",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("f64"));
}

#[test]
fn train_configuration_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().to_str().unwrap();
    let base = [
        "train",
        "--run-dir",
        run,
        "--metrics",
        "off",
        "--listen",
        "127.0.0.1:0",
    ];
    let cases: [(&[&str], &str); 4] = [
        (&[], "needs the shared token"),
        (&["--local", "--group-size", "1"], "--group-size"),
        (&["--local", "--temperature", "0"], "--temperature"),
        (
            &[
                "--token",
                "t",
                "--reward",
                "http://127.0.0.1:1",
                "--reward-wait",
                "1",
            ],
            "unreachable",
        ),
    ];
    for (extra, want) in cases {
        let out = Command::new(BIN)
            .args(base)
            .args(extra)
            .env_remove("ROOKWORLD_TOKEN")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| l.contains(want)).collect();
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {stderr}");
        assert_eq!(lines.len(), 1, "{extra:?}: {stderr}");
    }
}

#[test]
fn a_learner_waiting_for_its_reward_server_says_so_at_once_and_every_10_s() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: bound, then released.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{closed}");
    let out = Command::new(BIN)
        .args(["train", "--run-dir", dir.path().to_str().unwrap()])
        .args([
            "--metrics",
            "off",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "t",
        ])
        .args(["--reward", &url, "--reward-wait", "13"])
        .env_remove("ROOKWORLD_TOKEN")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let waiting: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("waiting for the reward server (--reward)") && l.contains(&url))
        .collect();
    // At once and 10 s later, within the 13.
    assert_eq!(waiting.len(), 2, "{stderr}");
    assert!(waiting[0].contains("stops in 1"), "{stderr}");
    let last = stderr.trim().lines().last().unwrap_or_default();
    assert!(last.contains("unreachable for 13 s"), "{stderr}");
}

#[test]
fn a_learner_without_workers_says_how_they_find_it_every_10_s() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("learner.log");
    let child = Command::new(BIN)
        .args([
            "train",
            "--run-dir",
            dir.path().join("run").to_str().unwrap(),
        ])
        .args([
            "--metrics",
            "off",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "t",
        ])
        .args(["--sft-steps", "0", "--no-progress"])
        .env_remove("ROOKWORLD_TOKEN")
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let advice = |text: &str| {
        text.lines()
            .filter(|l| {
                l.contains("no rollout worker has called the queue yet")
                    && l.contains("rollout-worker serve --learner http://127.0.0.1:")
            })
            .count()
    };
    // At once, then 10 s later: bounded by a minute, stopped with SIGTERM.
    let started = std::time::Instant::now();
    while advice(&std::fs::read_to_string(&log).unwrap_or_default()) < 2
        && started.elapsed() < std::time::Duration::from_secs(60)
    {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(advice(&text) >= 2, "{text}");
    assert_eq!(out.status.code(), Some(0), "{text}");
}
