//! Helpers shared by this crate's integration tests.

use candle_core::Tensor;

/// max |a − b| over all elements (f32 tensors of one shape).
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
