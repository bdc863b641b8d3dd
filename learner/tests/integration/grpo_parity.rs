//! The GRPO loss, its parts, the advantages and the gradient norm against an independent
//! PyTorch computation (float64, one unpadded forward per sequence): relative error ≤ 1e-5.
//! Fixture and the script that made it: `tests/fixtures/grpo/`, `make_grpo_fixture.py`.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device};
use learner::loss_cmd::evaluate;
use rookworld_lm::model_io;
use rookworld_train::batch::GrpoBatch;
use rookworld_train::grpo::{AdvantageNorm, Aggregation, PolicyLoss};
use rookworld_train::loss::LossConfig;
use rookworld_train::offpolicy::Correction;
use rookworld_train::policy::Trainable;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo")
}

fn close(name: &str, got: f64, want: f64) {
    let rel = (got - want).abs() / want.abs().max(1e-12);
    assert!(
        rel <= 1e-5,
        "{name}: got {got}, PyTorch {want} (relative error {rel:.2e})"
    );
}

fn cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn config(args: &serde_json::Value) -> LossConfig {
    let text = |k: &str, default: &str| args[k].as_str().unwrap_or(default).to_owned();
    let number = |k: &str, default: f64| args[k].as_f64().unwrap_or(default);
    let norm = match text("advantage_norm", "unbiased").as_str() {
        "unbiased" => AdvantageNorm::Unbiased,
        "population" => AdvantageNorm::Population,
        "batch" => AdvantageNorm::Batch,
        _ => AdvantageNorm::None,
    };
    let aggregation = match text("aggregation", "sequence").as_str() {
        "sequence" => Aggregation::Sequence,
        "constant" => Aggregation::Constant,
        _ => Aggregation::Token,
    };
    let policy_loss = match text("policy_loss", "clip").as_str() {
        "clip" => PolicyLoss::Clip,
        "gspo" => PolicyLoss::Gspo,
        "gspo_token" => PolicyLoss::GspoToken,
        _ => PolicyLoss::Cispo,
    };
    let eps = number("clip_eps", 0.2);
    LossConfig {
        beta: number("beta", 0.0),
        eps_low: eps,
        eps_high: number("clip_eps_high", eps),
        temperature: number("temperature", 1.0),
        advantage_norm: norm,
        aggregation,
        policy_loss,
        gspo_eps_low: number("gspo_eps", 3e-4),
        gspo_eps_high: number("gspo_eps_high", 4e-4),
        max_new_tokens: number("max_new_tokens", 64.0) as usize,
        correction: match text("correction", "off").as_str() {
            "off" => Correction::Off,
            "token_truncate" => Correction::TokenTruncate,
            "token_mask" => Correction::TokenMask,
            "sequence_truncate" => Correction::SequenceTruncate,
            _ => Correction::SequenceMask,
        },
        is_cap: number("is_cap", 2.0),
        mask_truncated: args["mask_truncated"].as_bool().unwrap_or(false),
    }
}

#[test]
fn loss_parts_advantages_and_grad_norm_match_pytorch() {
    let batch_of = |name: &str| -> GrpoBatch {
        serde_json::from_str(&std::fs::read_to_string(fixture().join(name)).unwrap()).unwrap()
    };
    let reference = model_io::load(&fixture().join("reference"), DType::F32, &Device::Cpu).unwrap();
    for case in cases() {
        let cfg = config(&case["args"]);
        let policy = Trainable::load(&fixture().join("policy"), &Device::Cpu).unwrap();
        let batch = batch_of(case["args"]["batch"].as_str().unwrap_or("batch.json"));
        let got = evaluate(&policy, Some(&reference), &batch, &cfg).unwrap();
        let want = &case["expected"];
        let label = |n: &str| format!("{n} ({})", case["args"]);
        close(&label("loss"), got.loss, want["loss"].as_f64().unwrap());
        close(
            &label("policy_loss"),
            got.policy_loss,
            want["policy_loss"].as_f64().unwrap(),
        );
        if cfg.beta > 0.0 {
            close(&label("kl"), got.kl, want["kl"].as_f64().unwrap());
        }
        close(
            &label("grad_norm"),
            got.grad_norm,
            want["grad_norm"].as_f64().unwrap(),
        );
        let want_adv: Vec<Vec<f64>> = serde_json::from_value(want["advantages"].clone()).unwrap();
        assert_eq!(got.advantages.len(), want_adv.len());
        for (g, w) in got
            .advantages
            .iter()
            .flatten()
            .zip(want_adv.iter().flatten())
        {
            assert!(
                (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
                "advantage {g} vs {w}"
            );
        }
        assert_eq!(
            got.skipped_groups, 1,
            "the group of equal rewards is skipped"
        );
    }
}

#[test]
fn the_cli_prints_the_same_numbers() {
    let case = &cases()[0];
    let out = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["loss", "--policy"])
        .arg(fixture().join("policy"))
        .arg("--reference")
        .arg(fixture().join("reference"))
        .arg("--batch")
        .arg(fixture().join("batch.json"))
        .args(["--beta", "0.04", "--clip-eps", "0.2"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["loss", "policy_loss", "kl", "grad_norm"] {
        close(
            key,
            got[key].as_f64().unwrap(),
            case["expected"][key].as_f64().unwrap(),
        );
    }
    assert!(got["advantages"].is_array());
}

#[test]
fn bad_batches_are_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let run = |batch: &str| {
        let path = dir.path().join("batch.json");
        std::fs::write(&path, batch).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_learner"))
            .args(["loss", "--policy"])
            .arg(fixture().join("policy"))
            .arg("--reference")
            .arg(fixture().join("reference"))
            .arg("--batch")
            .arg(&path)
            .env("RUST_LOG", "off")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    assert!(run("{").contains("--batch"));
    assert!(
        run(r#"{"prompts":[[1]],"completions":[[[2],[3]]],"rewards":[[1.0]]}"#)
            .contains("2 completions and 1 rewards")
    );
    assert!(
        run(r#"{"prompts":[[1]],"completions":[[[2],[999]]],"rewards":[[1.0,0.0]]}"#)
            .contains("vocabulary")
    );
    assert!(
        run(r#"{"prompts":[[1]],"completions":[[[2],[3]]],"rewards":[[1.0,0.0]],"old_logprobs":[[[0.1],[]]]}"#)
            .contains("old log-probs")
    );
    assert!(
        run(r#"{"prompts":[[1]],"completions":[[[2],[3]]],"rewards":[[1.0,0.0]],"proximal_logprobs":[[[0.1]]]}"#)
            .contains("proximal log-probs")
    );
}
