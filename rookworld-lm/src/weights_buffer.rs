//! The one buffer a model's weights are views of when one copy of a safetensors payload
//! filled it ([`crate::model_io::from_bytes_in_one_buffer`]), with the payload's layout,
//! which a refill of the same layout ([`crate::model_io::refill_in_place`]) must match.

use candle_core::Tensor;

/// The one buffer a model's weights are views of, and where each tensor of the payload
/// it was built from lies in it (see [`crate::model_io::from_bytes_in_one_buffer`]).
#[derive(Debug, Clone)]
pub struct WeightsBuffer {
    /// [elements] the payload's data section, in the stored dtype.
    pub(crate) whole: Tensor,
    pub(crate) layout: Vec<Slot>,
}

impl WeightsBuffer {
    /// Bytes of the buffer.
    pub fn bytes(&self) -> usize {
        self.whole.elem_count() * self.whole.dtype().size_in_bytes()
    }
}

/// A tensor of a payload: its name, dtype, shape and bytes in the data section.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Slot {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

/// The bytes after a safetensors payload's header (`bytes` deserialised already, so the
/// header length is in range).
pub(crate) fn data_section(bytes: &[u8]) -> &[u8] {
    let header = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    &bytes[8 + header..]
}

/// Every tensor's slot of `data` (the payload's data section), by name.
pub(crate) fn layout_of(st: &safetensors::SafeTensors<'_>, data: &[u8]) -> Vec<Slot> {
    let mut slots: Vec<Slot> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let start = view.data().as_ptr() as usize - data.as_ptr() as usize;
            Slot {
                name,
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                bytes: start..start + view.data().len(),
            }
        })
        .collect();
    slots.sort_by(|a, b| a.name.cmp(&b.name));
    slots
}
