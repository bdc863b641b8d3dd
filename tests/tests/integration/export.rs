//! `learner export` writes what `transformers` writes, and what it loaded:
//! `fixtures/export/hf_export.json` was written by `fixtures/export_hf_load.py`, which
//! saved a tiny GPT-2 and its tokenizer with transformers' own `save_pretrained`, then
//! loaded `learner export`'s directories with `AutoModelForCausalLM` and `AutoTokenizer`
//! and recorded what they held and computed. A training checkpoint exports only its model;
//! an `--out` holding anything is refused in one line.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use candle_core::{D, DType, Device, IndexOp, Tensor};
use rookworld_lm::{Config, EOT_TOKEN, LeftPadding, Tokenizer, model_io};
use rookworld_tests::fixture;
use serde_json::Value;
use sha2::{Digest, Sha256};

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");

/// Config keys transformers writes that the export leaves to transformers' defaults (the
/// same values), or that only say who wrote the file.
const CONFIG_DEFAULTED: &[&str] = &[
    "add_cross_attention",
    "initializer_range",
    "pad_token_id",
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    "transformers_version",
];
/// Dropout rates: transformers' default 0.1, the export 0 (RookWorld trains without).
const CONFIG_DROPOUT: &[&str] = &["attn_pdrop", "embd_pdrop", "resid_pdrop"];
/// Config keys the export writes beyond transformers': older transformers' dtype key and
/// GPT-2's original name of the context length.
const CONFIG_EXTRA: &[&str] = &["n_ctx", "torch_dtype"];

/// `learner export ARGS`, quiet.
fn export(args: &[&str], out: &Path) -> Output {
    Command::new(LEARNER)
        .arg("export")
        .args(args)
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn ok(out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
}

/// The one line a refused export prints.
fn refusal(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn sha256(path: &Path) -> String {
    format!("{:x}", Sha256::digest(std::fs::read(path).unwrap()))
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// name → (safetensors dtype, shape) of a safetensors file.
fn tensors(path: &Path) -> (BTreeMap<String, (String, Vec<usize>)>, Value) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let tensors = meta
        .tensors()
        .into_iter()
        .map(|(n, i)| (n, (format!("{:?}", i.dtype), i.shape.clone())))
        .collect();
    (tensors, serde_json::to_value(meta.metadata()).unwrap())
}

/// Logits (T, V) of `seq` in f32.
fn logits(model: &rookworld_lm::Gpt2, seq: &[u32]) -> Tensor {
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&input, &LeftPadding::none(1), &mut model.new_cache())
        .unwrap()
        .squeeze(0)
        .unwrap()
}

/// `n` greedy tokens after `prompt`.
fn greedy(model: &rookworld_lm::Gpt2, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let last = logits(model, &seq).i(seq.len() - 1).unwrap();
        seq.push(last.argmax(D::Minus1).unwrap().to_scalar().unwrap());
    }
    seq.split_off(prompt.len())
}

#[test]
fn the_export_is_what_transformers_writes_and_loaded() {
    let fx = read_json(&fixture("export/hf_export.json"));
    let reference = &fx["reference"];
    let want_files: Vec<String> = serde_json::from_value(reference["files"].clone()).unwrap();
    let prompt = fx["prompt"].as_str().unwrap();
    let new_tokens = fx["new_tokens"].as_u64().unwrap() as usize;
    let exports = fx["exports"].as_object().unwrap();
    assert_eq!(exports.len(), 3, "bf16, f32 and f16 recorded");

    for (dtype, hf) in exports {
        let (torch_dtype, st_dtype) = match dtype.as_str() {
            "bf16" => ("bfloat16", "BF16"),
            "f32" => ("float32", "F32"),
            "f16" => ("float16", "F16"),
            other => panic!("unknown dtype {other} in the fixture"),
        };
        // What transformers reported when it loaded this export.
        for (key, value) in hf["loading_info"].as_object().unwrap() {
            assert!(
                value.as_array().unwrap().is_empty(),
                "{dtype}: transformers reported {key}: {value}"
            );
        }
        assert_eq!(hf["warnings"], serde_json::json!([]), "{dtype}");
        assert_eq!(hf["model_class"], "GPT2LMHeadModel");
        assert_eq!(hf["tokenizer_class"], "GPT2Tokenizer");
        assert_eq!(hf["loaded_dtype"], format!("torch.{torch_dtype}"));
        assert_eq!(
            hf["num_parameters"].as_u64().unwrap() as usize,
            Config::tiny().num_parameters()
        );

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("export");
        ok(&export(
            &["--preset", "tiny", "--init-seed", "7", "--dtype", dtype],
            &out,
        ));

        // Exactly transformers' files; the weights' bytes transformers loaded.
        assert_eq!(listing(&out), want_files, "{dtype}: files");
        assert_eq!(hf["files"], reference["files"], "{dtype}");
        assert_eq!(
            sha256(&out.join("model.safetensors")),
            hf["sha256"].as_str().unwrap(),
            "{dtype}: model.safetensors differs from the file transformers loaded"
        );
        let (got, metadata) = tensors(&out.join("model.safetensors"));
        let want: BTreeMap<String, (String, Vec<usize>)> =
            serde_json::from_value(reference["tensors"].clone()).unwrap();
        assert_eq!(got.len(), want.len(), "{dtype}: tensor count");
        for (name, (_, shape)) in &want {
            assert_eq!(
                got.get(name),
                Some(&(st_dtype.to_owned(), shape.clone())),
                "{dtype}: tensor {name}"
            );
        }
        assert_eq!(metadata, reference["safetensors_metadata"], "{dtype}");

        // config.json: every value transformers wrote, in this dtype.
        let config = read_json(&out.join("config.json"));
        let config = config.as_object().unwrap();
        for (key, value) in reference["config"].as_object().unwrap() {
            if CONFIG_DEFAULTED.contains(&key.as_str()) {
                continue;
            }
            let got = &config[key];
            if CONFIG_DROPOUT.contains(&key.as_str()) {
                assert_eq!(got.as_f64(), Some(0.0), "{dtype}: {key}");
            } else if key == "dtype" {
                assert_eq!(got, torch_dtype, "{dtype}: dtype");
            } else if let (Some(a), Some(b)) = (got.as_f64(), value.as_f64()) {
                assert_eq!(a, b, "{dtype}: {key}");
            } else {
                assert_eq!(got, value, "{dtype}: {key}");
            }
        }
        for key in config.keys() {
            assert!(
                reference["config"].get(key).is_some() || CONFIG_EXTRA.contains(&key.as_str()),
                "{dtype}: config.json key {key} unknown to transformers"
            );
        }
        assert_eq!(config["torch_dtype"], torch_dtype);

        // generation_config.json: transformers' values, end-of-text also padding.
        let mut want_gen = reference["generation_config"].clone();
        let obj = want_gen.as_object_mut().unwrap();
        obj.remove("_from_model_config");
        obj.remove("transformers_version");
        obj.insert("pad_token_id".into(), EOT_TOKEN.into());
        assert_eq!(read_json(&out.join("generation_config.json")), want_gen);

        // The tokenizer's files: transformers' own.
        assert_eq!(
            read_json(&out.join("tokenizer_config.json")),
            reference["tokenizer_config"],
            "{dtype}: tokenizer_config.json"
        );
        assert_eq!(
            sha256(&out.join("tokenizer.json")),
            reference["tokenizer_json_sha256"].as_str().unwrap(),
            "{dtype}: tokenizer.json differs from transformers' save_pretrained"
        );
        let tokenizer = Tokenizer::from_dir(&out).unwrap().expect("tokenizer.json");
        let prompt_ids = tokenizer.encode(prompt).unwrap();
        assert_eq!(prompt_ids, ids(&hf["prompt_ids"]), "{dtype}: prompt ids");
        assert_eq!(hf["decoded_prompt"], prompt);

        // The model computes what transformers computed from these weights in f32.
        let model = model_io::load(&out, DType::F32, &Device::Cpu).unwrap();
        let argmax: Vec<u32> = logits(&model, &prompt_ids)
            .argmax(D::Minus1)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(
            argmax,
            ids(&hf["argmax_f32"]),
            "{dtype}: argmax per position"
        );
        assert_eq!(
            greedy(&model, &prompt_ids, new_tokens),
            ids(&hf["greedy_f32"]),
            "{dtype}: greedy tokens"
        );
    }
}

#[test]
fn a_training_checkpoint_exports_only_its_model() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sft = Command::new(LEARNER)
        .args([
            "sft",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--batch-size",
            "2",
        ])
        .args(["--micro-batch-size", "2", "--policy-fraction", "0"])
        .args(["--checkpoint-every", "1", "--run-dir"])
        .arg(&run)
        .env("RUST_LOG", "warn")
        .env_remove("LEARNER_RESUME")
        .output()
        .unwrap();
    ok(&sft);
    let step = run.join("checkpoints/step-00000001");
    let held = listing(&step);
    for f in ["optimizer.safetensors", "trainer_state.json"] {
        assert!(held.iter().any(|h| h == f), "the checkpoint holds {f}");
    }

    let out = dir.path().join("export");
    // The weights are read in f32 whatever --weight-dtype says (hidden here).
    let args = ["--model", step.to_str().unwrap(), "--dtype", "f32"];
    ok(&export(
        &[&args[..], &["--weight-dtype", "f16"]].concat(),
        &out,
    ));
    assert_eq!(listing(&out), learner::export_cmd::FILES);
    // In f32 the trained weights come out bit for bit.
    assert_eq!(
        sha256(&out.join("model.safetensors")),
        sha256(&step.join("model.safetensors"))
    );
}

#[test]
fn out_is_new_empty_or_an_earlier_export_and_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("export");
    let tiny = ["--preset", "tiny"];

    // Something else in --out: refused, with or without --overwrite; nothing written.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let err = refusal(&export(&tiny, &out));
    assert!(
        err.contains(&out.display().to_string()) && err.contains("notes.txt"),
        "{err}"
    );
    assert!(err.contains("--overwrite"), "{err}");
    let err = refusal(&export(&[&tiny[..], &["--overwrite"]].concat(), &out));
    assert!(
        err.contains("notes.txt") && err.contains("not part of an export"),
        "{err}"
    );
    assert_eq!(listing(&out), ["notes.txt"]);

    // An empty directory is written; an earlier export is replaced only with --overwrite.
    std::fs::remove_file(out.join("notes.txt")).unwrap();
    ok(&export(&tiny, &out));
    let err = refusal(&export(&tiny, &out));
    assert!(
        err.contains("not empty") && err.contains("--overwrite"),
        "{err}"
    );
    ok(&export(
        &[&tiny[..], &["--overwrite", "--dtype", "f16"]].concat(),
        &out,
    ));
    assert_eq!(listing(&out), learner::export_cmd::FILES);
    assert_eq!(read_json(&out.join("config.json"))["dtype"], "float16");

    // A file as --out, a missing model: one line naming the path.
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let err = refusal(&export(&tiny, &file));
    assert!(
        err.contains(&file.display().to_string()) && err.contains("not a directory"),
        "{err}"
    );
    let missing = dir.path().join("no-such-model");
    let err = refusal(&export(
        &["--model", missing.to_str().unwrap()],
        &dir.path().join("new"),
    ));
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(!dir.path().join("new").exists());

    // A dtype it cannot write: one line naming the value and the choices.
    let err = refusal(&export(
        &[&tiny[..], &["--dtype", "f64"]].concat(),
        &dir.path().join("x"),
    ));
    assert!(
        err.contains("'f64'") && err.contains("bf16, f32, f16"),
        "{err}"
    );
}
