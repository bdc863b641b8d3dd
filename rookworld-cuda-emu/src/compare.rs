//! What the kernels' tests share: reproducible inputs and a comparison that names the first
//! element out of tolerance.

/// A reproducible stream of values in [-1, 1) (a 64-bit LCG's top 24 bits).
pub struct Values(pub u64);

impl Values {
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `n` values in [-by, by).
    pub fn scaled(&mut self, n: usize, by: f32) -> Vec<f32> {
        self.take(n).into_iter().map(|x| x * by).collect()
    }
}

/// `got` equals `want` to `tol` relative to the larger of 1 and `want`'s largest value
/// (every `got` finite); panics naming `what` and the first element that is not.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale && g.is_finite(),
            "{what}[{i}]: {g} where the reference gives {w} (tolerance {tol} of {scale})"
        );
    }
}
