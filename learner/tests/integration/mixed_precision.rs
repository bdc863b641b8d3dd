//! Mixed precision (`MatmulPrecision::Bf16`: BF16 matmul inputs, f32 weights, moments,
//! layer-norm and softmax statistics), both as CUDA runs it (candle's autograd) and as the
//! CPU's fused pass runs it (BF16 products: `vdpbf16ps` where the CPU has AVX512-BF16),
//! checked on the CPU: a GRPO step's loss and every parameter's gradient agree with the
//! f32 step's to BF16 rounding, and the gradients reach the f32 weights in f32.

use crate::common;

use candle_core::{DType, Device};
use rookworld_lm::model_io;
use rookworld_train::loss::LossConfig;
use rookworld_train::policy::{MatmulPrecision, Trainable};
use rookworld_train::step::{StepConfig, accumulate, accumulate_autograd};

#[test]
fn bf16_matmuls_give_the_f32_step_to_bf16_rounding() {
    let dir = common::grpo_fixture();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let exact = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let mut mixed = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    assert_eq!(
        mixed.model.matmul_dtype(),
        None,
        "a loaded policy is f32 on the CPU"
    );
    MatmulPrecision::Bf16.apply(&mut mixed.model);
    assert_eq!(mixed.model.matmul_dtype(), Some(DType::BF16));
    assert!(
        mixed.fused_pass_applies(),
        "mixed precision on the CPU runs the fused pass"
    );

    let batch = common::batch_of_four();
    let cfg = StepConfig {
        loss: LossConfig {
            max_new_tokens: 16,
            ..LossConfig::default()
        },
        micro_batch_groups: 2,
        max_grad_norm: 1.0,
    };
    let (want, a) = accumulate_autograd(&exact, Some(&reference), &batch, &cfg).unwrap();
    let fused = accumulate(&mixed, Some(&reference), &batch, &cfg).unwrap();
    let autograd = accumulate_autograd(&mixed, Some(&reference), &batch, &cfg).unwrap();
    for (path, (got, b)) in [("fused pass", fused), ("autograd", autograd)] {
        // BF16 logits are good to ~2⁻⁸ relative, so log-probs (and the ratios and KL built
        // from them) move by about 1e-2, and the loss, a sum of ±A·ρ terms that partly
        // cancel, by a few percent (observed 3.3%; the KL 0.2%). Relative tolerances, so
        // that a wrong sign or scale fails.
        for (what, x, y, tol) in [("loss", a.loss, b.loss, 0.1), ("kl", a.kl, b.kl, 0.01)] {
            assert!(
                (x - y).abs() <= tol * x.abs(),
                "{path}, {what}: f32 {x}, bf16 matmuls {y} (relative tolerance {tol})"
            );
        }
        let mut worst = 0f64;
        for (name, var) in &exact.vars {
            let (w, g) = (want.get(name).unwrap(), got.get(name).unwrap());
            assert_eq!(g.dtype(), DType::F32, "{name}");
            assert_eq!(var.dtype(), DType::F32, "{name}");
            // Largest error against the largest gradient entry of the tensor.
            let rel =
                f64::from(common::max_abs(&(&g - &w).unwrap()) / common::max_abs(&w).max(1e-12));
            worst = worst.max(rel);
            assert!(rel < 0.05, "{path}, {name}: relative gradient error {rel}");
        }
        println!(
            "{path}: loss {} vs f32 {}, worst relative gradient error {worst:.3e}",
            b.loss, a.loss
        );
        assert!(
            worst > 0.0,
            "{path}: BF16 matmuls changed nothing: did they run?"
        );
    }
}
