//! The fused training pass (`rookworld_train::fused`: explicit forward/backward, each group's
//! prompt once) against candle's autograd on the plain model (`rookworld_lm::Gpt2`, the
//! forward the rollout worker samples with): loss parts and every parameter's gradient,
//! with and without behaviour log-probs, every aggregation and policy loss, the batch's
//! std over micro-batches, three temperatures, with a completion of one token (fed
//! nowhere, predicted from the prompt's last row), the LM head's rows in one chunk and in
//! several (the objective between each chunk's forward and backward).

use crate::common;

use candle_core::{DType, Device};
use rookworld_lm::model_io;
use rookworld_train::grpo::{AdvantageNorm, Aggregation, PolicyLoss};
use rookworld_train::loss::LossConfig;
use rookworld_train::offpolicy::Correction;
use rookworld_train::policy::Trainable;
use rookworld_train::step::{StepConfig, accumulate, accumulate_autograd};

#[test]
fn fused_pass_equals_autograd_on_the_plain_model() {
    let dir = common::grpo_fixture();
    let mut policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let mut worst = 0f32;
    for (
        with_old,
        aggregation,
        temperature,
        micro,
        policy_loss,
        advantage_norm,
        correction,
        mask_truncated,
    ) in [
        (
            true,
            Aggregation::Sequence,
            1.0,
            4,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            false,
        ),
        (
            false,
            Aggregation::Token,
            0.7,
            1,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            false,
        ),
        (
            true,
            Aggregation::Token,
            1.3,
            2,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            false,
        ),
        // The objectives users switch on, over micro-batches: the batch's std and Dr.
        // GRPO's constant must come out as for the whole batch.
        (
            true,
            Aggregation::Constant,
            1.0,
            1,
            PolicyLoss::Clip,
            AdvantageNorm::Batch,
            Correction::Off,
            false,
        ),
        (
            true,
            Aggregation::Sequence,
            0.9,
            2,
            PolicyLoss::Gspo,
            AdvantageNorm::None,
            Correction::Off,
            false,
        ),
        (
            true,
            Aggregation::Token,
            1.0,
            3,
            PolicyLoss::GspoToken,
            AdvantageNorm::Population,
            Correction::Off,
            false,
        ),
        (
            true,
            Aggregation::Constant,
            1.0,
            2,
            PolicyLoss::Cispo,
            AdvantageNorm::Batch,
            Correction::Off,
            false,
        ),
        // Decoupled off-policy correction.
        (
            true,
            Aggregation::Sequence,
            1.0,
            1,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::TokenTruncate,
            false,
        ),
        (
            true,
            Aggregation::Token,
            0.9,
            2,
            PolicyLoss::Clip,
            AdvantageNorm::Batch,
            Correction::SequenceMask,
            false,
        ),
        (
            true,
            Aggregation::Sequence,
            1.0,
            4,
            PolicyLoss::Gspo,
            AdvantageNorm::Unbiased,
            Correction::TokenMask,
            false,
        ),
        // Completions cut off at the budget left out, over micro-batches.
        (
            true,
            Aggregation::Sequence,
            1.0,
            1,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            true,
        ),
        (
            true,
            Aggregation::Token,
            1.0,
            2,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            true,
        ),
    ] {
        let mut batch = common::batch_of_four();
        if !with_old {
            batch.old_logprobs = None;
        }
        let cfg = StepConfig {
            loss: LossConfig {
                aggregation,
                temperature,
                policy_loss,
                advantage_norm,
                // Clipping both in and out of range on the fixture's ratios.
                gspo_eps_low: 0.1,
                gspo_eps_high: 0.15,
                max_new_tokens: 16,
                correction,
                is_cap: 1.3,
                mask_truncated,
                ..LossConfig::default()
            },
            micro_batch_groups: micro,
            max_grad_norm: 1.0,
        };
        // The head's rows in one chunk, and in chunks of at most three rows (a completion
        // of four its own chunk): the objective between the head's forward and backward
        // of each chunk adds up to the whole micro-batch's.
        let chunks = if micro % 2 == 0 { Some(3) } else { None };
        policy.set_head_chunk_rows(chunks);
        let (fused, a) = accumulate(&policy, Some(&reference), &batch, &cfg).unwrap();
        let (plain, b) = accumulate_autograd(&policy, Some(&reference), &batch, &cfg).unwrap();
        assert!(a.forward_seconds > 0.0, "the fused pass ran");
        // The policy's entropy per token, between 0 and ln V.
        let h = a.entropy.expect("the fused pass measures the entropy");
        assert!(h > 0.0 && h < (512f64).ln(), "{h}");
        assert_eq!(b.forward_seconds, 0.0, "the autograd pass ran");
        for (what, x, y) in [
            ("loss", a.loss, b.loss),
            ("policy_loss", a.policy_loss, b.policy_loss),
            ("kl", a.kl, b.kl),
            ("clip_frac", a.clip_frac, b.clip_frac),
        ] {
            // Relative, but no finer than 1e-7 absolute: the autograd path sums the loss's
            // ±A·ρ terms of size ~1 in f32 (rounding ~6e-8), and a loss whose terms cancel
            // (GSPO and corrected sequences: Σ A = 0 per group) can be 0.007.
            assert!(
                (x - y).abs() <= 1e-5 * y.abs().max(1e-2),
                "{what}: fused {x}, autograd {y}"
            );
        }
        assert_eq!((a.tokens, a.skipped_groups), (b.tokens, b.skipped_groups));
        for (name, _) in &policy.vars {
            let (x, y) = (fused.get(name).unwrap(), plain.get(name).unwrap());
            let rel = common::max_abs(&(&x - &y).unwrap()) / common::max_abs(&y).max(1e-6);
            worst = worst.max(rel);
            assert!(rel < 1e-4, "{name}: relative gradient difference {rel:.2e}");
        }
    }
    println!("largest relative gradient difference: {worst:.2e}");
}
