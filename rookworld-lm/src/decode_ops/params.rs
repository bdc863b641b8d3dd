//! What the fused ops that launch on CUDA are told: the parameters their CPU
//! implementations ([`super`]) and their launches (`crate::cuda::ops`) both read.

use candle_core::{Layout, Result, Tensor};

/// Part `part` (0 q, 1 k, 2 v) of c_attn's output (B, 3E) plus its bias, as (B, H, C, D)
/// at column `col` (letters as in `model`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvSplit {
    pub part: usize,
    pub heads: usize,
    pub col: usize,
}

impl QkvSplit {
    /// (B, E, H, D) of a (B, 3E) input.
    pub fn dims(self, qkv: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (b, e3) = qkv.shape().dims2()?;
        let e = e3 / 3;
        if e3 % 3 != 0 || e % self.heads != 0 || self.part > 2 {
            candle_core::bail!(
                "qkv split of a ({b}, {e3}) tensor into {} heads",
                self.heads
            );
        }
        Ok((b, e, self.heads, e / self.heads))
    }
}

/// `s = x + (y + c)`, then `layer_norm(s) · w + b` with f32 statistics over the sum as
/// stored, for x, y (M, E) and c (E): one (2, M, E) tensor, the sum then the norm. Each
/// addition rounds to the dtype, as the unfused ops do.
#[derive(Debug, Clone)]
pub(crate) struct AddLayerNorm {
    /// c: the bias of the matmul that made y.
    pub y_bias: Tensor,
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f32,
}
