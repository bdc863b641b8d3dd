//! Numerical parity with Hugging Face transformers on stored fixtures.
//!
//! `fixtures/parity/` was written by `fixtures/make_parity_fixtures.py` (torch +
//! transformers, run once; see its docstring and `manifest.json`).

use std::collections::HashMap;

use candle_core::{DType, Device, IndexOp, Tensor};
use rookworld_lm::generate::{GenerationConfig, generate_group};
use rookworld_lm::model_io;
use rookworld_lm::sampling::SamplingParams;
use rookworld_lm::{Gpt2, LeftPadding};
use rookworld_tests::{fixture, max_abs_diff};

const TOL: f32 = 1e-4;
const N_SEQ: usize = 5;
const N_GREEDY: usize = 3;

fn expected() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("parity/expected.safetensors"), &Device::Cpu).unwrap()
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

fn load(dir: &str) -> Gpt2 {
    model_io::load(&fixture(&format!("parity/{dir}")), DType::F32, &Device::Cpu).unwrap()
}

/// Logits (T, V) of one sequence run alone with a fresh cache.
fn logits_alone(model: &Gpt2, seq: &[u32]) -> Tensor {
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut cache = model.new_cache();
    model
        .forward(&input, &LeftPadding::none(1), &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
}

fn check(what: &str, ours: &Tensor, theirs: &Tensor, tol: f32) {
    let d = max_abs_diff(ours, theirs);
    println!("{what}: max |Δ| = {d:.3e}");
    assert!(d <= tol, "{what}: max |Δ| = {d} > {tol}");
}

#[test]
fn unbatched_logits_match_transformers_single_file_and_sharded() {
    let exp = expected();
    for dir in ["tiny-gpt2", "tiny-gpt2-sharded"] {
        let model = load(dir);
        for i in 0..N_SEQ {
            let seq = ids(&exp[&format!("seq_{i}")]);
            check(
                &format!("{dir} seq {i} (T={})", seq.len()),
                &logits_alone(&model, &seq),
                &exp[&format!("logits_{i}")],
                TOL,
            );
        }
    }
}

#[test]
fn left_padded_batch_matches_transformers_and_each_row_alone() {
    let exp = expected();
    let model = load("tiny-gpt2");
    let seqs: Vec<Vec<u32>> = (0..N_SEQ).map(|i| ids(&exp[&format!("seq_{i}")])).collect();
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let padding = LeftPadding::for_lengths(&lengths);
    let longest = *lengths.iter().max().unwrap();
    // Pad with a real token id (7) so that a leak through the mask would change results.
    let mut flat = Vec::new();
    for s in &seqs {
        flat.extend(std::iter::repeat_n(7u32, longest - s.len()));
        flat.extend(s);
    }
    let input = Tensor::from_vec(flat, (seqs.len(), longest), &Device::Cpu).unwrap();
    let mut cache = model.new_cache();
    let logits = model.forward(&input, &padding, &mut cache).unwrap(); // (B, T, V)
    for (i, s) in seqs.iter().enumerate() {
        let real = logits.i((i, longest - s.len()..)).unwrap();
        check(
            &format!("batched row {i} vs transformers batched"),
            &real,
            &exp[&format!("batched_{i}")],
            TOL,
        );
        check(
            &format!("batched row {i} vs alone"),
            &real,
            &logits_alone(&model, s),
            1e-5,
        );
    }
}

#[test]
fn kv_cached_steps_equal_the_full_forward() {
    let exp = expected();
    let model = load("tiny-gpt2");
    let seq = ids(&exp[&format!("seq_{}", N_SEQ - 1)]);
    let full = logits_alone(&model, &seq);
    for chunk in [1usize, 5] {
        let mut cache = model.new_cache();
        let mut steps = Vec::new();
        for part in seq.chunks(chunk) {
            let input = Tensor::new(part, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            steps.push(
                model
                    .forward(&input, &LeftPadding::none(1), &mut cache)
                    .unwrap()
                    .squeeze(0)
                    .unwrap(),
            );
        }
        let stepped = Tensor::cat(&steps, 0).unwrap();
        check(
            &format!("cached chunks of {chunk} vs full forward"),
            &stepped,
            &full,
            1e-5,
        );
        check(
            &format!("cached chunks of {chunk} vs transformers"),
            &stepped,
            &exp[&format!("logits_{}", N_SEQ - 1)],
            TOL,
        );
    }
}

#[test]
fn greedy_decoding_equals_transformers_generate() {
    let exp = expected();
    let model = load("tiny-gpt2");
    let eos = model.config().eos_token_id;
    for j in 0..N_GREEDY {
        let prompt = ids(&exp[&format!("greedy_prompt_{j}")]);
        let want = ids(&exp[&format!("greedy_ids_{j}")]);
        assert!(
            !want.contains(&eos),
            "fixture continuation must not need eos suppression"
        );
        let cfg = GenerationConfig {
            n: 1,
            max_new_tokens: want.len(),
            sampling: SamplingParams::greedy(),
            seed: 0,
            ignore_eos: false,
        };
        let out = generate_group(&model, &prompt, &cfg, 0).unwrap();
        assert_eq!(out.completions[0].ids, want, "greedy case {j}");
    }
}

#[test]
fn f16_and_bf16_files_load_and_match_their_rounded_reference() {
    let exp = expected();
    for (dir, key) in [("tiny-gpt2-f16", "f16w"), ("tiny-gpt2-bf16", "bf16w")] {
        let model = load(dir);
        for i in 0..N_SEQ {
            let seq = ids(&exp[&format!("seq_{i}")]);
            check(
                &format!("{dir} seq {i}"),
                &logits_alone(&model, &seq),
                &exp[&format!("logits_{key}_{i}")],
                TOL,
            );
        }
    }
}

#[test]
fn bf16_and_f16_compute_stay_close_to_f32() {
    let exp = expected();
    let seq = ids(&exp[&format!("seq_{}", N_SEQ - 1)]);
    let reference = logits_alone(&load("tiny-gpt2"), &seq);
    for dtype in [DType::BF16, DType::F16] {
        let model = model_io::load(&fixture("parity/tiny-gpt2"), dtype, &Device::Cpu).unwrap();
        assert_eq!(model.dtype(), dtype);
        let d = max_abs_diff(&logits_alone(&model, &seq), &reference);
        println!("{dtype:?} compute: max |Δ| vs f32 = {d:.3e}");
        assert!(d < 0.25, "{dtype:?} drifted by {d}");
    }
}
