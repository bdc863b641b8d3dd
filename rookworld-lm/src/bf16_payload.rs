//! The bfloat16 safetensors payload of f32 CPU weights, built in place: one buffer of the
//! file's size, the header first, then every tensor converted straight into its slot, in
//! parallel pieces. The generic path (`to_dtype`, then `safetensors::serialize`) converts
//! on one thread and copies each tensor twice; this is what a weight push pays per step.
//! [`load`] is the way back for the worker: bfloat16 to f32 in parallel pieces.
//!
//! Layout (the safetensors format): an 8-byte little-endian header length, the JSON
//! header (`__metadata__`, then per tensor `dtype`, `shape`, `data_offsets`) padded with
//! spaces to a multiple of 8, then the tensors' bytes in header order.

use candle_core::{DType, Device, Storage, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::error::Result;

/// Elements converted by one parallel piece.
const PIECE: usize = 1 << 18;

/// The payload of `tensors` (name, f32 tensor on the CPU) with `metadata`, or `None` when
/// a tensor is not f32, not on the CPU or not contiguous (the caller takes the generic
/// path). Values are rounded to nearest even, as candle's `to_dtype(BF16)`.
pub fn build(tensors: &[(String, Tensor)], metadata: &[(&str, &str)]) -> Result<Option<Vec<u8>>> {
    if tensors.iter().any(|(_, t)| {
        t.dtype() != DType::F32 || !matches!(t.device(), Device::Cpu) || !t.is_contiguous()
    }) {
        return Ok(None);
    }
    // The header: each tensor's slot in the data section.
    let mut header = serde_json::Map::new();
    let meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    header.insert("__metadata__".into(), meta.into());
    let mut end = 0usize;
    for (name, t) in tensors {
        let start = end;
        end += t.elem_count() * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": t.dims(), "data_offsets": [start, end]}),
        );
    }
    let mut json = serde_json::to_vec(&header).expect("header serialises");
    json.resize(json.len().next_multiple_of(8), b' ');
    let data_start = 8 + json.len();
    let mut out = vec![0u8; data_start + end];
    out[..8].copy_from_slice(&(json.len() as u64).to_le_bytes());
    out[8..data_start].copy_from_slice(&json);

    // Every tensor's f32 values, borrowed from its storage while the guards live.
    let guards: Vec<_> = tensors
        .iter()
        .map(|(_, t)| t.storage_and_layout())
        .collect();
    let mut sources: Vec<&[f32]> = Vec::with_capacity(tensors.len());
    for (guard, (_, t)) in guards.iter().zip(tensors) {
        let (storage, layout) = (&*guard.0, guard.1);
        let Storage::Cpu(cpu) = storage else {
            return Ok(None);
        };
        let all = cpu.as_slice::<f32>()?;
        let start = layout.start_offset();
        sources.push(&all[start..start + t.elem_count()]);
    }
    // Pieces of at most PIECE elements, each with its slot.
    let mut rest = &mut out[data_start..];
    let mut pieces: Vec<(&[f32], &mut [u8])> = Vec::new();
    for src in sources {
        let (slot, tail) = rest.split_at_mut(src.len() * 2);
        rest = tail;
        pieces.extend(src.chunks(PIECE).zip(slot.chunks_mut(PIECE * 2)));
    }
    pieces.into_par_iter().for_each(|(src, dst)| {
        for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
            d.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
        }
    });
    Ok(Some(out))
}

/// The tensors of safetensors `bytes` on the CPU; bfloat16 ones become f32 when
/// `to_f32`, converted in parallel pieces (exact: every bfloat16 is an f32). Other dtypes
/// load as stored.
pub fn load(bytes: &[u8], to_f32: bool) -> Result<std::collections::HashMap<String, Tensor>> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let mut out = std::collections::HashMap::new();
    for (name, view) in st.tensors() {
        let tensor = if to_f32 && view.dtype() == safetensors::Dtype::BF16 {
            let src = view.data();
            let mut values = vec![0f32; src.len() / 2];
            values
                .par_chunks_mut(PIECE)
                .zip(src.par_chunks(PIECE * 2))
                .for_each(|(dst, src)| {
                    for (v, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *v = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                });
            Tensor::from_vec(values, view.shape(), &Device::Cpu)?
        } else {
            candle_core::safetensors::Load::load(&view, &Device::Cpu)?
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::init_random;
    use crate::config::Config;

    #[test]
    fn the_payload_holds_what_the_generic_path_writes() {
        let model = init_random(&Config::tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        let tensors = model.named_tensors();
        let fast = build(&tensors, &[("format", "pt")]).unwrap().unwrap();
        let converted: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(DType::BF16).unwrap()))
            .collect();
        let generic = safetensors::serialize(converted, None).unwrap();
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&fast).unwrap(),
            safetensors::SafeTensors::deserialize(&generic).unwrap(),
        );
        assert_eq!(a.len(), tensors.len());
        for (name, _) in &tensors {
            let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
            assert_eq!(x.dtype(), safetensors::Dtype::BF16, "{name}");
            assert_eq!(x.shape(), y.shape(), "{name}");
            assert_eq!(x.data(), y.data(), "{name}: bit-identical values");
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&fast).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    }

    #[test]
    fn loading_to_f32_equals_candle_s_conversion() {
        let model = init_random(&Config::tiny(), 4, DType::F32, &Device::Cpu).unwrap();
        let bytes = build(&model.named_tensors(), &[]).unwrap().unwrap();
        let fast = load(&bytes, true).unwrap();
        let generic = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
        assert_eq!(fast.len(), generic.len());
        for (name, g) in generic {
            let f = &fast[&name];
            assert_eq!(f.dtype(), DType::F32);
            let g: Vec<f32> = g
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let f: Vec<f32> = f.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(f, g, "{name}");
        }
    }

    #[test]
    fn other_dtypes_take_the_generic_path() {
        let model = init_random(&Config::tiny(), 3, DType::BF16, &Device::Cpu).unwrap();
        assert!(build(&model.named_tensors(), &[]).unwrap().is_none());
    }
}
