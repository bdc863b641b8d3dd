//! `--updates-per-batch μ`: μ optimizer steps on one batch, the proximal policy of the
//! off-policy correction fixed at the policy's own log-probs before the first, π_old the
//! sampler's throughout; equal to the same steps taken one by one with those log-probs
//! given, and different from re-taking them at every update.

use crate::common;

use candle_core::{DType, Device, Tensor};
use rookworld_lm::model_io;
use rookworld_train::batch::GrpoBatch;
use rookworld_train::loss::LossConfig;
use rookworld_train::offpolicy::Correction;
use rookworld_train::optim::{AdamW, Schedule};
use rookworld_train::policy::{Trainable, own_logprobs};
use rookworld_train::step::{StepConfig, Updater};

fn weights(policy: &Trainable) -> Vec<Tensor> {
    policy
        .vars
        .iter()
        .map(|(_, v)| v.as_tensor().copy().unwrap())
        .collect()
}

fn largest_difference(a: &[Tensor], b: &[Tensor]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| common::max_abs(&(x - y).unwrap()))
        .fold(0.0, f32::max)
}

#[test]
fn updates_on_one_batch_keep_the_proximal_policy_of_the_first() {
    let dir = common::grpo_fixture();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let batch = common::batch_of_four();
    let cfg = StepConfig {
        loss: LossConfig {
            correction: Correction::TokenTruncate,
            is_cap: 1.5,
            ..LossConfig::default()
        },
        micro_batch_groups: 2,
        max_grad_norm: 1.0,
    };
    let schedule = Schedule {
        lr: 1e-2,
        min_lr: 1e-2,
        warmup_steps: 0,
        total_steps: 1,
    };
    let fresh = || {
        let policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
        let opt = AdamW::new(Default::default());
        (policy, opt)
    };

    // Three updates in one call.
    let (policy, mut opt) = fresh();
    let report = updater(&policy, &reference, &mut opt, &schedule, &cfg)
        .updates(0, &batch, 3, None)
        .unwrap();
    assert_eq!(opt.steps, 3);
    assert!(report.loss.is_finite() && report.tokens > 0);
    let together = weights(&policy);

    // The same by hand: the policy's own log-probs before the first update, given.
    let (policy, mut opt) = fresh();
    let own = own_logprobs(&policy.model, &batch, 1.0).unwrap();
    let given = GrpoBatch {
        proximal_logprobs: Some(own),
        ..batch.clone()
    };
    for _ in 0..3 {
        updater(&policy, &reference, &mut opt, &schedule, &cfg)
            .step(0, &given, None)
            .unwrap();
    }
    let by_hand = weights(&policy);
    assert!(largest_difference(&together, &by_hand) < 1e-6);

    // Re-taking the proximal policy at every update is another objective.
    let (policy, mut opt) = fresh();
    for _ in 0..3 {
        updater(&policy, &reference, &mut opt, &schedule, &cfg)
            .step(0, &batch, None)
            .unwrap();
    }
    assert!(largest_difference(&together, &weights(&policy)) > 1e-4);
}

#[test]
fn the_own_log_probs_are_the_ones_the_loss_uses() {
    // With the proximal log-probs given as the policy's own, the loss is the one without.
    let dir = common::grpo_fixture();
    let policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let batch = common::batch_of_four();
    let own = own_logprobs(&policy.model, &batch, 0.8).unwrap();
    let cfg = LossConfig {
        correction: Correction::SequenceTruncate,
        temperature: 0.8,
        beta: 0.0,
        ..LossConfig::default()
    };
    let given = GrpoBatch {
        proximal_logprobs: Some(own),
        ..batch.clone()
    };
    let a = learner::loss_cmd::evaluate(&policy, None, &batch, &cfg).unwrap();
    let b = learner::loss_cmd::evaluate(&policy, None, &given, &cfg).unwrap();
    assert!(
        (a.loss - b.loss).abs() <= 1e-6 * a.loss.abs().max(1e-2),
        "{} vs {}",
        a.loss,
        b.loss
    );
    assert!(
        (a.grad_norm - b.grad_norm).abs() <= 1e-4 * a.grad_norm,
        "{} vs {}",
        a.grad_norm,
        b.grad_norm
    );
}

/// The updater of `policy` against `reference`.
fn updater<'a>(
    policy: &'a Trainable,
    reference: &'a rookworld_lm::Gpt2,
    opt: &'a mut AdamW,
    schedule: &'a Schedule,
    cfg: &'a StepConfig,
) -> Updater<'a> {
    Updater {
        policy,
        reference: Some(reference),
        opt,
        schedule,
        cfg,
    }
}
