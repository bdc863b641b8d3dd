//! What the model and its layers both do with tensors: whether gradients flow through one,
//! its f32 values borrowed where it is contiguous, and products with packed CPU weights.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::cpu_gemm::{PackedMatrix, PanelDtype};

/// True when gradients may flow through `t` (it is, or derives from, a trainable `Var`).
/// Fused candle ops (layer norm, last-dim softmax) have no backward pass, so tracked
/// forwards use composed, differentiable ops instead; both agree to float rounding.
pub(super) fn tracked(t: &Tensor) -> bool {
    t.track_op()
}

/// `x` (M, K) times a packed weight: (M, N), or `None` when `x` is not an untracked f32
/// CPU tensor (then candle's matmul runs).
pub(super) fn packed_matmul(
    packed: &PackedMatrix,
    x: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    if tracked(x) || !x.device().is_cpu() || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let m = x.dim(0)?;
    let y = with_values(x, |data| packed.matmul(data, m))?; // x read in place when contiguous
    Tensor::from_vec(y, (m, packed.n()), x.device()).map(Some)
}

/// Packs `w` — (K, N), or (N, K) when `transposed` — with `bias` into `slot`, in panels
/// of `dtype`: into the panels already there when `slot` holds the only reference to a
/// matrix of that shape and dtype, else into a new matrix. Returns the packed matrix.
pub(super) fn repack_or_pack<'a>(
    slot: &'a mut Option<Arc<PackedMatrix>>,
    dtype: PanelDtype,
    w: &[f32],
    (k, n): (usize, usize),
    transposed: bool,
    bias: Option<Vec<f32>>,
) -> candle_core::Result<&'a mut PackedMatrix> {
    let reused = match slot.as_mut().and_then(Arc::get_mut) {
        Some(packed) if packed.dtype() == dtype => packed.repack(w, transposed, bias.as_deref()),
        _ => false,
    };
    if !reused {
        let packed = PackedMatrix::pack_as(dtype, w, k, n, transposed, bias);
        *slot = Some(Arc::new(packed));
    }
    Ok(Arc::get_mut(slot.as_mut().expect("packed above")).expect("held alone"))
}

/// `f` of `t`'s f32 values in element order: borrowed from its CPU storage when it is
/// contiguous f32 (no copy of a weight matrix to pack it), else copied.
pub(super) fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
            && let Ok(all) = cpu.as_slice::<f32>()
        {
            return Ok(f(&all[a..b]));
        }
    }
    Ok(f(&t
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?))
}

/// `t` rounded to BF16 on its device: on the CPU from f32, the payload's vectorised
/// rounding in parallel pieces ([`write_bf16_parallel`](crate::bf16_payload::write_bf16_parallel),
/// candle's `to_dtype` to the bit, which rounds a value at a time: 70 ms of a 124M model's
/// load for `wte`); anything else through `to_dtype`.
pub(super) fn to_bf16(t: &Tensor) -> candle_core::Result<Tensor> {
    if !t.device().is_cpu() || t.dtype() != DType::F32 || cfg!(target_endian = "big") {
        return t.to_dtype(DType::BF16);
    }
    let mut out = vec![half::bf16::ZERO; t.elem_count()];
    // SAFETY: a bf16 is two bytes of any value; the view covers `out` exactly and is its
    // only use while it lives.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 2) };
    with_values(t, |w| crate::bf16_payload::write_bf16_parallel(w, bytes))?;
    Tensor::from_vec(out, t.shape(), t.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_bf16_rounding_is_candles_to_the_bit() {
        // Ties both ways, subnormals, infinities and NaNs, over several parallel pieces.
        let specials = [
            0.0,
            -0.0,
            1.0 + f32::EPSILON * 64.0,
            f32::MIN_POSITIVE / 3.0,
        ];
        let specials = specials
            .into_iter()
            .chain([f32::INFINITY, f32::NAN, -f32::NAN]);
        let values: Vec<f32> = specials
            .chain((0..300_007).map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761))))
            .collect();
        let t =
            Tensor::from_vec(values.clone(), (values.len(),), &candle_core::Device::Cpu).unwrap();
        let bits = |t: Tensor| -> Vec<u16> {
            t.to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(
            bits(to_bf16(&t).unwrap()),
            bits(t.to_dtype(DType::BF16).unwrap())
        );
    }
}
