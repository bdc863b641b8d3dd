//! The fused training pass (`rookworld_train::fused`: explicit forward/backward, each group's
//! prompt once) against candle's autograd on the plain model (`rookworld_lm::Gpt2`, the
//! forward the rollout worker samples with): loss parts and every parameter's gradient,
//! with and without behaviour log-probs, every aggregation and policy loss, the batch's
//! std over micro-batches, three temperatures, with a completion of one token (fed
//! nowhere, predicted from the prompt's last row), completions cut off or with a stale
//! prefix left out, the LM head's rows in one chunk and in several (the objective between
//! each chunk's forward and backward).

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
        stale,
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
            false,
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
            false,
        ),
        // Tokens sampled by versions past the staleness limit left out (a prefix of
        // some completions, the whole of one), with and without the sampler's log-probs.
        (
            true,
            Aggregation::Sequence,
            1.0,
            1,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::TokenTruncate,
            false,
            true,
        ),
        (
            true,
            Aggregation::Token,
            0.9,
            2,
            PolicyLoss::Clip,
            AdvantageNorm::Unbiased,
            Correction::Off,
            false,
            true,
        ),
        (
            false,
            Aggregation::Constant,
            1.0,
            3,
            PolicyLoss::Cispo,
            AdvantageNorm::Batch,
            Correction::Off,
            false,
            true,
        ),
    ] {
        let mut batch = common::batch_of_four();
        if !with_old {
            batch.old_logprobs = None;
        }
        if stale {
            batch.stale_prefix = Some(common::stale_prefixes(&batch));
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

/// A stale prefix is out of the loss on both passes: moving its tokens' sampler log-probs
/// changes neither the loss nor a gradient, and the tokens counted fall by its length.
#[test]
fn the_tokens_of_a_stale_prefix_change_nothing_and_are_not_counted() {
    let dir = common::grpo_fixture();
    let policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let cfg = StepConfig {
        loss: LossConfig {
            aggregation: Aggregation::Token,
            max_new_tokens: 16,
            ..LossConfig::default()
        },
        micro_batch_groups: 2,
        max_grad_norm: 1.0,
    };
    let whole = common::batch_of_four();
    let prefixes = common::stale_prefixes(&whole);
    let stale = rookworld_train::batch::GrpoBatch {
        stale_prefix: Some(prefixes.clone()),
        ..whole.clone()
    };
    let mut moved = stale.clone();
    for (group, lps) in prefixes.iter().zip(moved.old_logprobs.as_mut().unwrap()) {
        for (&n, lp) in group.iter().zip(lps) {
            lp[..n].iter_mut().for_each(|x| *x -= 1.0);
        }
    }
    let with_signal: usize = prefixes
        .iter()
        .zip(&whole.rewards)
        .filter(|(_, r)| r.iter().any(|x| *x != r[0]))
        .map(|(p, _)| p.iter().sum::<usize>())
        .sum();
    for pass in [accumulate, accumulate_autograd] {
        let (_, all) = pass(&policy, Some(&reference), &whole, &cfg).unwrap();
        let (g, a) = pass(&policy, Some(&reference), &stale, &cfg).unwrap();
        let (h, b) = pass(&policy, Some(&reference), &moved, &cfg).unwrap();
        assert_eq!(all.tokens - a.tokens, with_signal);
        assert_eq!((a.loss, a.tokens), (b.loss, b.tokens));
        assert_ne!(a.loss, all.loss);
        for (name, _) in &policy.vars {
            let d = common::max_abs(&(g.get(name).unwrap() - h.get(name).unwrap()).unwrap());
            assert_eq!(d, 0.0, "{name}");
        }
    }
}
