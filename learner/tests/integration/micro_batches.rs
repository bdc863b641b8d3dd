//! Micro-batches: the accumulated gradient and loss equal the full batch's, under every
//! aggregation and advantage scale (the batch's std is the whole batch's, not a part's).

use crate::common;

use candle_core::{DType, Device};
use rookworld_lm::model_io;
use rookworld_train::grpo::{AdvantageNorm, Aggregation};
use rookworld_train::loss::LossConfig;
use rookworld_train::policy::Trainable;
use rookworld_train::step::{StepConfig, accumulate};

#[test]
fn micro_batched_gradients_equal_the_full_batch() {
    let dir = common::grpo_fixture();
    let batch = common::batch_of_four();
    let policy = Trainable::load(&dir.join("policy"), &Device::Cpu).unwrap();
    let reference = model_io::load(&dir.join("reference"), DType::F32, &Device::Cpu).unwrap();
    for (aggregation, advantage_norm, mask_truncated) in [
        (Aggregation::Sequence, AdvantageNorm::Unbiased, false),
        (Aggregation::Token, AdvantageNorm::Unbiased, false),
        (Aggregation::Constant, AdvantageNorm::Batch, false),
        (Aggregation::Token, AdvantageNorm::Batch, false),
        // Cut-off completions left out: the parts' weights count only what is trained on.
        (Aggregation::Sequence, AdvantageNorm::Unbiased, true),
        (Aggregation::Token, AdvantageNorm::Unbiased, true),
    ] {
        let cfg = |micro| StepConfig {
            loss: LossConfig {
                aggregation,
                advantage_norm,
                max_new_tokens: 16,
                mask_truncated,
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
        let k = policy.model.kernels();
        let (n1, n2) = (full.global_norm(k).unwrap(), parts.global_norm(k).unwrap());
        assert!(
            (n1 - n2).abs() < 1e-5 * n1,
            "{aggregation:?}: grad norm {n1} vs {n2}"
        );
        for (name, _) in &policy.vars {
            let d = common::max_abs(&(full.get(name).unwrap() - parts.get(name).unwrap()).unwrap());
            assert!(d < 1e-5, "{name}");
        }
        assert_eq!((a.skipped_groups, b.skipped_groups), (1, 1));
    }
}
