//! The learner's autograd path as CUDA runs it, checked on the CPU: a GRPO step through
//! candle's autograd with the training ops on (`Gpt2::set_train_ops`: layer norms, attention's
//! softmax, bias + GELU and the head's log-probs as single ops with hand-written
//! backwards) gives the composed graph's loss and gradients — in f32, and under mixed
//! precision within BF16 rounding of the f32 step.

use crate::common;

use candle_core::{DType, Device};
use rookworld_lm::model_io;
use rookworld_train::loss::LossConfig;
use rookworld_train::policy::{MatmulPrecision, Trainable};
use rookworld_train::step::{StepConfig, accumulate_autograd};

#[test]
fn a_grpo_step_through_the_training_ops_equals_the_composed_graph() {
    let dir = common::grpo_fixture();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let mut plain = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    plain.model.set_train_ops(false);
    let fused = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    assert!(fused.model.train_ops(), "the learner's default");
    let mut mixed = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    MatmulPrecision::Bf16.apply(&mut mixed.model);

    let batch = common::batch_of_four();
    let cfg = StepConfig {
        loss: LossConfig {
            max_new_tokens: 16,
            ..LossConfig::default()
        },
        micro_batch_groups: 2,
        max_grad_norm: 1.0,
    };
    let (want, a) = accumulate_autograd(&plain, Some(&reference), &batch, &cfg).unwrap();
    let (got, b) = accumulate_autograd(&fused, Some(&reference), &batch, &cfg).unwrap();
    let (bf16, c) = accumulate_autograd(&mixed, Some(&reference), &batch, &cfg).unwrap();
    for (what, x, y, z) in [
        ("loss", a.loss, b.loss, c.loss),
        ("kl", a.kl, b.kl, c.kl),
        ("policy loss", a.policy_loss, b.policy_loss, c.policy_loss),
    ] {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs().max(1.0),
            "{what}: composed {x}, ops {y}"
        );
        // Relative, so that a wrong sign or scale fails: observed 3.3% (loss), 4.4%
        // (policy loss, a sum of ±A·ρ terms that cancel) and 0.2% (KL).
        let tol = if what == "kl" { 0.01 } else { 0.1 };
        assert!(
            (x - z).abs() <= tol * x.abs(),
            "{what}: f32 {x}, ops with bf16 matmuls {z} (relative tolerance {tol})"
        );
    }
    let (mut worst, mut worst_bf16) = (0f64, 0f64);
    for (name, _) in &plain.vars {
        let w = want.get(name).unwrap();
        let scale = f64::from(common::max_abs(&w).max(1e-12));
        let rel = |g: &candle_core::Tensor| f64::from(common::max_abs(&(g - &w).unwrap())) / scale;
        let (g, h) = (got.get(name).unwrap(), bf16.get(name).unwrap());
        assert_eq!(g.dtype(), DType::F32, "{name}");
        assert!(
            rel(&g) < 1e-4,
            "{name}: gradient through the ops off by {}",
            rel(&g)
        );
        assert!(
            rel(&h) < 0.05,
            "{name}: bf16 gradient through the ops off by {}",
            rel(&h)
        );
        worst = worst.max(rel(&g));
        worst_bf16 = worst_bf16.max(rel(&h));
    }
    assert!(
        worst > 0.0,
        "the training ops changed nothing: did they run?"
    );
    eprintln!(
        "worst relative gradient error: ops {worst:.2e}, ops + bf16 matmuls {worst_bf16:.2e}"
    );
}
