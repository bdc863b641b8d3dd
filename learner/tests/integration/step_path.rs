//! `--step-path`: which pass computes a step's gradients. `auto` runs the fused pass on
//! the CPU, `autograd` candle's autograd there too, and `fused` where the fused pass does
//! not apply is refused with its reason instead of running another pass; the two passes'
//! steps agree.

use crate::common;

use candle_core::{DType, Device};
use rookworld_lm::config::{Activation, Config};
use rookworld_lm::model_io;
use rookworld_train::loss::LossConfig;
use rookworld_train::policy::StepPath;
use rookworld_train::policy::{Pass, Trainable};
use rookworld_train::step::{StepConfig, accumulate};

fn step_config() -> StepConfig {
    StepConfig {
        loss: LossConfig {
            max_new_tokens: 16,
            ..LossConfig::default()
        },
        micro_batch_groups: 2,
        max_grad_norm: 1.0,
    }
}

#[test]
fn each_path_runs_its_own_pass_and_they_agree() {
    let dir = common::grpo_fixture();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    let mut policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    assert_eq!(policy.pass(), Pass::FusedCpu, "auto on the CPU");
    let batch = common::batch_of_four();
    let cfg = step_config();

    let mut steps = Vec::new();
    for (path, pass) in [
        (StepPath::Autograd, Pass::Autograd),
        (StepPath::Fused, Pass::FusedCpu),
        (StepPath::Auto, Pass::FusedCpu),
    ] {
        policy.set_step_path(path, &Default::default()).unwrap();
        assert_eq!(policy.pass(), pass, "{path:?}");
        let (grads, report) = accumulate(&policy, Some(&reference), &batch, &cfg).unwrap();
        // Only the fused pass measures the policy's entropy.
        assert_eq!(report.entropy.is_some(), pass == Pass::FusedCpu, "{path:?}");
        steps.push((path, grads, report));
    }
    let (_, want, a) = &steps[0];
    for (path, got, b) in &steps[1..] {
        assert!(
            (a.loss - b.loss).abs() <= 1e-4 * a.loss.abs().max(1e-3),
            "{path:?}: loss {} against autograd's {}",
            b.loss,
            a.loss
        );
        for (name, _) in &policy.vars {
            let (w, g) = (want.get(name).unwrap(), got.get(name).unwrap());
            let scale = common::max_abs(&w).max(1e-6);
            let diff = common::max_abs(&(&w - &g).unwrap());
            assert!(
                diff <= 1e-3 * scale,
                "{path:?}, {name}: max |Δ| {diff} of {scale}"
            );
        }
    }
}

#[test]
fn fused_where_it_does_not_apply_is_refused_with_the_reason() {
    let mut cfg = Config::preset("tiny").unwrap();
    cfg.activation_function = Activation::Relu;
    let model = model_io::init_random(&cfg, 0, DType::F32, &Device::Cpu).unwrap();
    let mut policy = Trainable::from_model(&model).unwrap();
    assert_eq!(policy.pass(), Pass::Autograd, "auto falls back to autograd");
    let err = policy
        .set_step_path(StepPath::Fused, &Default::default())
        .unwrap_err();
    assert!(
        err.starts_with("--step-path fused: ") && err.contains("gelu_new") && !err.contains('\n'),
        "{err}"
    );
    assert_eq!(
        policy.pass(),
        Pass::Autograd,
        "a refused path changes nothing"
    );
    policy
        .set_step_path(StepPath::Autograd, &Default::default())
        .unwrap();
    assert_eq!(policy.pass(), Pass::Autograd);
}
