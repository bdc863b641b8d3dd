//! Our saved checkpoints are what `transformers` loaded: `fixtures/roundtrip/hf_loaded.json`
//! was written by `fixtures/roundtrip_hf_load.py`, which loaded `learner init`'s output
//! with `GPT2LMHeadModel.from_pretrained` and recorded its logits.

use candle_core::{D, DType, Device, IndexOp, Tensor};
use rookworld_lm::model_io::{self, init_random};
use rookworld_lm::{Config, LeftPadding};
use rookworld_tests::{fixture, max_abs_diff};
use sha2::{Digest, Sha256};

#[test]
fn saved_bytes_and_logits_match_what_transformers_loaded() {
    let text = std::fs::read_to_string(fixture("roundtrip/hf_loaded.json")).unwrap();
    let fx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let seq: Vec<u32> = fx["seq"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let model = init_random(&Config::tiny(), 7, DType::F32, &Device::Cpu).unwrap();

    for (name, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let hf = &fx["checkpoints"][name];
        for (key, value) in hf["loading_info"].as_object().unwrap() {
            assert!(
                value.as_array().unwrap().is_empty(),
                "{name}: transformers reported {key}: {value}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        model_io::save(&model, dir.path(), dtype).unwrap();
        let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        let sha = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(
            sha,
            hf["sha256"].as_str().unwrap(),
            "{name}: saved bytes differ from the file transformers loaded"
        );

        let back = model_io::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
        let input = Tensor::new(seq.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = back
            .forward(&input, &LeftPadding::none(1), &mut back.new_cache())
            .unwrap()
            .squeeze(0)
            .unwrap();

        let argmax: Vec<u32> = logits.argmax(D::Minus1).unwrap().to_vec1().unwrap();
        let want_argmax: Vec<u32> = hf["argmax"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(argmax, want_argmax, "{name}: argmax per position");

        let lse = logits.exp().unwrap().sum(D::Minus1).unwrap().log().unwrap();
        let want_lse: Vec<f32> = serde_json::from_value(hf["logsumexp"].clone()).unwrap();
        let d = max_abs_diff(&lse, &Tensor::new(want_lse, &Device::Cpu).unwrap());
        println!("{name}: log-sum-exp max |Δ| = {d:.3e}");
        assert!(d <= 1e-4);

        let want: Vec<Vec<f32>> = serde_json::from_value(hf["logits_first_64"].clone()).unwrap();
        let d = max_abs_diff(
            &logits.i((.., ..64)).unwrap(),
            &Tensor::new(want, &Device::Cpu).unwrap(),
        );
        println!("{name}: logits[:, :64] max |Δ| = {d:.3e}");
        assert!(d <= 1e-4);
    }
}
