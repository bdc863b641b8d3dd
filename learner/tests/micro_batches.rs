//! Micro-batches: the accumulated gradient and loss equal the full batch's, under both
//! aggregations.

use std::path::Path;

use candle_core::{DType, Device};
use learner::batch::GrpoBatch;
use learner::grpo::Aggregation;
use learner::loss::LossConfig;
use learner::policy::Trainable;
use learner::step::{StepConfig, accumulate};
use rookworld_lm::checkpoint;

#[test]
fn micro_batched_gradients_equal_the_full_batch() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo");
    let mut batch: GrpoBatch =
        serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    // A fourth group so micro-batches of 2 differ from the whole.
    batch.prompts.push(vec![511, 4, 5]);
    batch
        .completions
        .push(vec![vec![9, 8, 7, 6], vec![1], vec![2, 3]]);
    batch.rewards.push(vec![0.0, 1.0, 0.5]);
    batch.old_logprobs.as_mut().unwrap().push(vec![
        vec![-6.0, -6.1, -5.9, -6.2],
        vec![-6.3],
        vec![-5.8, -6.0],
    ]);
    let policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let reference = checkpoint::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    for aggregation in [Aggregation::Sequence, Aggregation::Token] {
        let cfg = |micro| StepConfig {
            loss: LossConfig {
                aggregation,
                ..LossConfig::default()
            },
            micro_batch_groups: micro,
            max_grad_norm: 1.0,
        };
        let (full, a) = accumulate(&policy, Some(&reference), &batch, &cfg(4)).unwrap();
        let (parts, b) = accumulate(&policy, Some(&reference), &batch, &cfg(1)).unwrap();
        assert!(
            (a.loss - b.loss).abs() < 1e-6 * a.loss.abs().max(1.0),
            "{aggregation:?}: {} vs {}",
            a.loss,
            b.loss
        );
        assert!((a.kl - b.kl).abs() < 1e-5 * a.kl.abs().max(1.0));
        let (n1, n2) = (full.global_norm().unwrap(), parts.global_norm().unwrap());
        assert!(
            (n1 - n2).abs() < 1e-5 * n1,
            "{aggregation:?}: grad norm {n1} vs {n2}"
        );
        for (name, _) in &policy.vars {
            let d = (full.get(name).unwrap() - parts.get(name).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(d.to_scalar::<f32>().unwrap() < 1e-5, "{name}");
        }
        assert_eq!((a.skipped_groups, b.skipped_groups), (1, 1));
    }
}
