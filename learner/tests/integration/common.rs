//! What several learner tests share: the GRPO fixture's batch with a fourth group, so
//! that micro-batches of 1 or 2 groups differ from the whole, and the largest magnitude
//! of a tensor.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use rookworld_train::batch::GrpoBatch;

/// `tests/fixtures/grpo`.
pub fn grpo_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/grpo")
}

/// The fixture's three groups (one without signal) and a fourth with a one-token
/// completion.
pub fn batch_of_four() -> GrpoBatch {
    let text = std::fs::read_to_string(grpo_fixture().join("batch.json")).unwrap();
    let mut batch: GrpoBatch = serde_json::from_str(&text).unwrap();
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
    batch
}

/// Stale prefixes for every completion of `batch`: none for the first of each group, the
/// whole of the second, two tokens (or all but the last) of the others.
pub fn stale_prefixes(batch: &GrpoBatch) -> Vec<Vec<usize>> {
    batch
        .completions
        .iter()
        .map(|group| {
            group
                .iter()
                .enumerate()
                .map(|(g, c)| match g {
                    0 => 0,
                    1 => c.len(),
                    _ => 2.min(c.len() - 1),
                })
                .collect()
        })
        .collect()
}

/// Largest |x| of a tensor of any shape.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
