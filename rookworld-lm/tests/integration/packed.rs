//! The CPU inference kernels (packed weights with fused GELU, in-place decode attention)
//! compute what the plain tensor path computes, in f32 panels and in BF16 panels.

use candle_core::{DType, Device, Tensor};
use rookworld_lm::cpu_gemm::PanelDtype;
use rookworld_lm::model_io::{self, init_random};
use rookworld_lm::{Config, Gpt2, GroupedCache, LeftPadding};

use crate::common;
use common::max_diff;

#[test]
fn packed_weights_give_the_logits_of_the_plain_model() {
    let cfg = Config {
        n_embd: 96,
        n_head: 3,
        ..Config::tiny()
    };
    let plain = init_random(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
    let mut packed = plain.clone();
    if !packed.pack_for_cpu().unwrap() {
        return skipped();
    }
    // A left-padded prefill batch.
    let ids = Tensor::new(&[[5u32, 6, 7, 8, 9], [0, 0, 11, 12, 13]], &Device::Cpu).unwrap();
    let padding = LeftPadding::new(vec![0, 2]);
    let (mut kv_a, mut kv_b) = (plain.new_cache(), packed.new_cache());
    let a = plain.forward(&ids, &padding, &mut kv_a).unwrap();
    let b = packed.forward(&ids, &padding, &mut kv_b).unwrap();
    let d = max_diff(&a, &b);
    assert!(d < 1e-4, "prefill max |Δ| = {d}");
    // Decode steps through the grouped cache (the CPU attention kernel in both).
    let (mut ga, mut gb) = (
        GroupedCache::new(cfg.n_layer),
        GroupedCache::new(cfg.n_layer),
    );
    ga.add_groups(&kv_a, &padding).unwrap();
    gb.add_groups(&kv_b, &padding).unwrap();
    for g in [0, 0, 1] {
        ga.add_row(g);
        gb.add_row(g);
    }
    for step in 0..20u32 {
        let feed = [step, step + 100, step + 200];
        let a = plain.decode_grouped(&feed, &mut ga).unwrap();
        let b = packed.decode_grouped(&feed, &mut gb).unwrap();
        let d = max_diff(&a, &b);
        assert!(d < 1e-4, "step {step}: max |Δ| = {d}");
    }
}

/// A worker's model (`prepare_for_inference` on the CPU) keeps its projections only as
/// panels, and `wte` in BF16 under BF16 or INT8 panels; on weights that are BF16 values
/// (a learner's push) its log-probs are those of the same panels beside the dense
/// weights, to the bit, in every panel dtype. It refuses to repack from the dense weights
/// it no longer has.
#[test]
fn a_packed_only_model_computes_what_the_packed_model_computes() {
    let cfg = Config {
        n_embd: 96,
        n_head: 3,
        ..Config::tiny()
    };
    let random = init_random(&cfg, 9, DType::F32, &Device::Cpu).unwrap();
    let payload = model_io::to_bf16_payload(&random).unwrap();
    let model = model_io::from_bytes(&payload, &cfg, DType::F32, &Device::Cpu).unwrap();
    for dtype in [PanelDtype::F32, PanelDtype::Bf16, PanelDtype::Int8] {
        let Some(packed) = packed_in(&model, dtype) else {
            return skipped();
        };
        let mut only = model.clone();
        only.set_panel_dtype(dtype);
        assert!(only.prepare_for_inference().unwrap());
        assert!(only.packed_only() && only.dtype() == DType::F32);
        let tensors = only.named_tensors();
        let dense: usize = tensors
            .iter()
            .filter(|(n, _)| n.contains(".c_") && n.ends_with(".weight"))
            .map(|(_, t)| t.elem_count())
            .sum();
        assert_eq!(
            dense, 0,
            "{dtype:?}: the projections' dense weights are released"
        );
        let wte = match dtype {
            PanelDtype::F32 => DType::F32,
            PanelDtype::Bf16 | PanelDtype::Int8 => DType::BF16,
        };
        assert_eq!(tensors[0].1.dtype(), wte, "{dtype:?}: wte");
        assert_eq!(logprobs_of(&only), logprobs_of(&packed), "{dtype:?}");
        assert!(only.pack_for_cpu().is_err());
        assert!(!only.prepare_for_inference().unwrap(), "prepared once");
    }
}

/// Reports a test that cannot run here: this CPU lacks AVX2/FMA, nothing is packed
/// (`SKIPPED:`, or a failure where ROOKWORLD_REQUIRE_AVX2 is set).
fn skipped() {
    let runs = rookworld_lm::cpu_gemm::TestFeature::Avx2.test_runs("the packed model");
    assert!(!runs, "nothing was packed although this CPU has AVX2/FMA");
}

/// Log-softmax of a prefill and 12 grouped decode steps of `model` (f32 activations):
/// every row's log-probs over the vocabulary, concatenated.
fn logprobs_of(model: &Gpt2) -> Vec<f32> {
    let ids = Tensor::new(&[[5u32, 6, 7, 8, 9], [0, 0, 11, 12, 13]], &Device::Cpu).unwrap();
    let padding = LeftPadding::new(vec![0, 2]);
    let mut kv = model.new_cache();
    let mut out = Vec::new();
    let mut push = |logits: &Tensor| {
        let lp = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1).unwrap();
        out.extend(lp.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    };
    push(&model.forward(&ids, &padding, &mut kv).unwrap());
    let mut cache = GroupedCache::new(model.config().n_layer);
    cache.add_groups(&kv, &padding).unwrap();
    for g in [0, 0, 1] {
        cache.add_row(g);
    }
    for step in 0..12u32 {
        push(
            &model
                .decode_grouped(&[step, step + 7, step + 300], &mut cache)
                .unwrap(),
        );
    }
    out
}

fn packed_in(model: &Gpt2, dtype: PanelDtype) -> Option<Gpt2> {
    let mut m = model.clone();
    m.set_panel_dtype(dtype);
    m.pack_for_cpu().unwrap().then_some(m)
}

/// `--weight-dtype bf16` on the CPU (BF16 panels, f32 activations and statistics): log-probs
/// within 2e-2 of the f32 panels' on f32 weights (each weight rounded to BF16 once). On
/// weights that are BF16 values, as a learner's push is: the f32 panels' to the bit where
/// the weights are widened (AVX2), within 2e-2 where each product also rounds its inputs
/// to BF16 (`vdpbf16ps`, AVX512-BF16).
#[test]
fn bf16_panels_give_the_log_probs_of_f32_panels() {
    let cfg = Config {
        n_embd: 96,
        n_head: 3,
        ..Config::tiny()
    };
    let f32_weights = init_random(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
    let (Some(f32_panels), Some(bf16_panels)) = (
        packed_in(&f32_weights, PanelDtype::F32),
        packed_in(&f32_weights, PanelDtype::Bf16),
    ) else {
        return skipped();
    };
    let (want, got) = (logprobs_of(&f32_panels), logprobs_of(&bf16_panels));
    let d = want
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "f32 weights: BF16 panels' log-probs max |Δ| = {d:.3e} over {}",
        want.len()
    );
    assert!(d > 0.0 && d < 2e-2, "max |Δ| = {d}");

    // Weights that are BF16 values: saved in BF16 and loaded back in f32.
    let dir = tempfile::tempdir().unwrap();
    model_io::save(&f32_weights, dir.path(), DType::BF16).unwrap();
    let bf16_values = model_io::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let f32_panels = packed_in(&bf16_values, PanelDtype::F32).unwrap();
    let bf16_panels = packed_in(&bf16_values, PanelDtype::Bf16).unwrap();
    assert_eq!(bf16_panels.panel_dtype(), PanelDtype::Bf16);
    let (want, got) = (logprobs_of(&f32_panels), logprobs_of(&bf16_panels));
    if rookworld_lm::cpu_gemm::avx512().bf16 {
        let d = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("BF16 weights, BF16 inputs (vdpbf16ps): log-probs max |Δ| = {d:.3e}");
        assert!(d < 2e-2, "max |Δ| = {d}");
    } else {
        assert_eq!(want, got);
    }
}

/// `--weight-dtype int8` on the CPU (INT8 panels, inputs quantized per row): an approximation
/// whose log-probs stay within 0.05 of the f32 panels' (mean |Δ| under 0.01; 1.7e-2 and
/// 2.3e-3 measured) on this model's random weights; what a trained model's gap is, the sampler's log-probs carry
/// and the learner's off-policy correction weighs.
#[test]
fn int8_panels_give_log_probs_near_f32_panels() {
    let cfg = Config {
        n_embd: 96,
        n_head: 3,
        ..Config::tiny()
    };
    let weights = init_random(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
    let (Some(f32_panels), Some(int8_panels)) = (
        packed_in(&weights, PanelDtype::F32),
        packed_in(&weights, PanelDtype::Int8),
    ) else {
        return skipped();
    };
    let (want, got) = (logprobs_of(&f32_panels), logprobs_of(&int8_panels));
    let d: Vec<f32> = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).collect();
    let max = d.iter().copied().fold(0f32, f32::max);
    let mean = d.iter().sum::<f32>() / d.len() as f32;
    println!(
        "INT8 panels' log-probs: max |Δ| = {max:.3e}, mean {mean:.3e} over {}",
        d.len()
    );
    assert!(max < 0.05 && mean < 0.01, "max |Δ| = {max}, mean {mean}");
}
