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
