//! Loading real safetensors files in every layout a GPT-2 checkpoint comes in, the errors
//! for broken ones, and our own saves.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rookworld_lm::model_io::{self, init_random};
use rookworld_lm::{Config, Gpt2, LeftPadding};
use rookworld_tests::{fixture, max_abs_diff};

fn tiny_dir() -> std::path::PathBuf {
    fixture("parity/tiny-gpt2")
}

fn read_tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

/// A checkpoint dir holding the fixture's config and the given tensors.
fn write_checkpoint(tensors: &HashMap<String, Tensor>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        tiny_dir().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    candle_core::safetensors::save(tensors, dir.path().join("model.safetensors")).unwrap();
    dir
}

fn logits(model: &Gpt2, seq: &[u32]) -> Tensor {
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&input, &LeftPadding::none(1), &mut model.new_cache())
        .unwrap()
}

fn load_err(dir: &Path) -> String {
    model_io::load(dir, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string()
}

const SEQ: [u32; 6] = [3, 141, 59, 26, 5, 358];

#[test]
fn unprefixed_names_buffers_and_an_lm_head_copy_load_the_same_model() {
    let reference = logits(
        &model_io::load(&tiny_dir(), DType::F32, &Device::Cpu).unwrap(),
        &SEQ,
    );
    let mut tensors: HashMap<String, Tensor> = read_tensors(&tiny_dir())
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches("transformer.").to_owned(), v))
        .collect();
    let causal = Tensor::tril2(64, DType::U8, &Device::Cpu).unwrap();
    tensors.insert(
        "h.0.attn.bias".into(),
        causal.reshape((1, 1, 64, 64)).unwrap(),
    );
    tensors.insert(
        "h.0.attn.masked_bias".into(),
        Tensor::new(-1e4f32, &Device::Cpu).unwrap(),
    );
    tensors.insert("lm_head.weight".into(), tensors["wte.weight"].clone());
    let dir = write_checkpoint(&tensors);
    let model = model_io::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(max_abs_diff(&logits(&model, &SEQ), &reference), 0.0);
}

#[test]
fn a_missing_tensor_is_named() {
    let mut tensors = read_tensors(&tiny_dir());
    tensors.remove("transformer.h.1.mlp.c_fc.bias");
    let err = load_err(write_checkpoint(&tensors).path());
    assert!(err.contains("transformer.h.1.mlp.c_fc.bias"), "{err}");
}

#[test]
fn a_misshaped_tensor_is_named_with_both_shapes() {
    let mut tensors = read_tensors(&tiny_dir());
    let w = tensors["transformer.h.0.attn.c_attn.weight"]
        .t()
        .unwrap()
        .contiguous()
        .unwrap(); // [out, in]
    tensors.insert("transformer.h.0.attn.c_attn.weight".into(), w);
    let err = load_err(write_checkpoint(&tensors).path());
    assert!(
        err.contains("transformer.h.0.attn.c_attn.weight")
            && err.contains("[192, 64]")
            && err.contains("[64, 192]"),
        "{err}"
    );
}

#[test]
fn missing_files_and_bad_configs_are_clear_errors() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.contains("/nonexistent/model") && err.contains("does not exist"),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    assert!(load_err(empty.path()).contains("no config.json"));

    std::fs::copy(
        tiny_dir().join("config.json"),
        empty.path().join("config.json"),
    )
    .unwrap();
    let err = load_err(empty.path());
    assert!(err.contains("model.safetensors"), "{err}");

    std::fs::write(
        empty.path().join("config.json"),
        r#"{"model_type":"llama","vocab_size":3}"#,
    )
    .unwrap();
    let err = load_err(empty.path());
    assert!(err.contains("config.json"), "{err}");

    let cfg = r#"{"vocab_size":512,"n_positions":64,"n_embd":64,"n_layer":2,"n_head":5}"#;
    std::fs::write(empty.path().join("config.json"), cfg).unwrap();
    let err = load_err(empty.path());
    assert!(err.contains("n_head"), "{err}");

    let shard_index = r#"{"weight_map":{"transformer.wte.weight":"gone.safetensors"}}"#;
    std::fs::copy(
        tiny_dir().join("config.json"),
        empty.path().join("config.json"),
    )
    .unwrap();
    std::fs::write(
        empty.path().join("model.safetensors.index.json"),
        shard_index,
    )
    .unwrap();
    let err = load_err(empty.path());
    assert!(err.contains("gone.safetensors"), "{err}");
}

#[test]
fn our_saves_load_back_in_every_dtype() {
    let cfg = Config::tiny();
    let model = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let reference = logits(&model, &SEQ);
    for (dtype, tol) in [(DType::F32, 0.0), (DType::F16, 5e-3), (DType::BF16, 5e-2)] {
        let dir = tempfile::tempdir().unwrap();
        model_io::save(&model, dir.path(), dtype).unwrap();
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            files.len(),
            2,
            "only config.json and model.safetensors, no temporaries: {files:?}"
        );
        let back = model_io::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(back.config(), &cfg);
        let d = max_abs_diff(&logits(&back, &SEQ), &reference);
        assert!(d <= tol, "{dtype:?}: {d}");
    }
}

#[test]
fn a_124m_shaped_checkpoint_saves_loads_and_runs() {
    let cfg = Config::gpt2_124m();
    let model = init_random(&cfg, 0, DType::BF16, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model_io::save(&model, dir.path(), DType::BF16).unwrap();
    let bytes = std::fs::metadata(dir.path().join("model.safetensors"))
        .unwrap()
        .len();
    assert!(bytes > 2 * 124_000_000, "{bytes} bytes");
    let back = model_io::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..46).map(|i| 50256 - i * 997).collect();
    let out = logits(&back, &ids);
    assert_eq!(out.dims(), &[1, 46, 50257]);
    let values = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(values.iter().all(|v| v.is_finite()));
}
