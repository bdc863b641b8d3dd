//! The KV cache: in-place buffers that grow, copies that do not alias, and the
//! differentiable path a training forward takes.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rookworld_lm::model_io::init_random;
use rookworld_lm::{Config, Gpt2, LeftPadding};

use crate::common;
use common::max_diff;

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919) % 50257).collect()
}

fn full_logits(m: &Gpt2, seq: &[u32]) -> Tensor {
    let input = Tensor::new(seq, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&input, &LeftPadding::none(1), &mut m.new_cache())
        .unwrap()
        .squeeze(0)
        .unwrap()
}

#[test]
fn stepping_across_buffer_growth_equals_the_full_forward() {
    let m = init_random(&Config::tiny(), 5, DType::F32, &Device::Cpu).unwrap();
    let seq = ids(150); // grows 64 → 128 → 256
    let full = full_logits(&m, &seq);
    let mut cache = m.new_cache();
    let mut rows = Vec::new();
    for chunk in [&seq[..40], &seq[40..41], &seq[41..100], &seq[100..]] {
        for step in chunk.chunks(if chunk.len() > 30 { chunk.len() } else { 1 }) {
            let input = Tensor::new(step, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            rows.push(
                m.forward(&input, &LeftPadding::none(1), &mut cache)
                    .unwrap()
                    .squeeze(0)
                    .unwrap(),
            );
        }
    }
    assert_eq!(cache.seq_len(), 150);
    let d = max_diff(&Tensor::cat(&rows, 0).unwrap(), &full);
    assert!(d < 1e-4, "max |Δ| = {d}");
}

#[test]
fn repeated_rows_are_independent_copies() {
    let m = init_random(&Config::tiny(), 5, DType::F32, &Device::Cpu).unwrap();
    let prompt = ids(10);
    let mut cache = m.new_cache();
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&input, &LeftPadding::none(1), &mut cache)
        .unwrap();
    let mut a = cache.repeat_rows(2).unwrap();
    let mut b = cache.repeat_rows(2).unwrap();
    // Feeding different tokens into `a` must not change what `b` computes.
    let step = |c: &mut rookworld_lm::KvCache, t: [u32; 2]| {
        let x = Tensor::new(&t, &Device::Cpu).unwrap().unsqueeze(1).unwrap();
        m.forward(&x, &LeftPadding::none(2), c).unwrap()
    };
    step(&mut a, [1, 2]);
    let from_b = step(&mut b, [3, 4]);
    let mut c = cache.repeat_rows(2).unwrap();
    let fresh = step(&mut c, [3, 4]);
    assert_eq!(max_diff(&from_b, &fresh), 0.0);
    assert_eq!((a.batch_size(), a.seq_len()), (2, 11));
}

#[test]
fn a_training_forward_through_the_cache_has_gradients() {
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let m = Gpt2::load(vb.clone(), vb, &Config::tiny()).unwrap();
    // Trainable variables holding a real (random) initialisation, as the learner loads them.
    let init = init_random(&Config::tiny(), 9, DType::F32, &Device::Cpu).unwrap();
    for (name, value) in init.named_tensors() {
        varmap
            .set_one(name.trim_start_matches("transformer."), value)
            .unwrap();
    }
    let logits = full_logits(&m, &ids(20));
    let grads = logits.sum_all().unwrap().backward().unwrap();
    let vars = varmap.all_vars();
    assert_eq!(
        vars.len(),
        rookworld_lm::model_io::tensor_specs(&Config::tiny()).len()
    );
    for var in &vars {
        let g = grads.get(var).expect("every parameter gets a gradient");
        assert!(
            g.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
}
