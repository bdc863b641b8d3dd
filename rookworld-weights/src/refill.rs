//! A model's next weights written into its own memory.
//!
//! A rollout worker on the CPU builds every pushed version into about 1 GB of f32
//! weights and packed panels (gpt2-124m). Built fresh, every page of that is faulted in
//! and zeroed by the kernel first — on a small VM a fresh 249 MB buffer's first touch
//! alone took 0.7 s. [`refill`] instead writes a new version into a retired model's
//! tensors and panels in place: the same checks as
//! [`checkpoint::from_bytes`](rookworld_lm::checkpoint::from_bytes), no allocation of the
//! model's size.

use candle_core::{CpuStorage, DType, InplaceOp1, Layout};
use safetensors::{Dtype, SafeTensors};

use rookworld_lm::Gpt2;
use rookworld_lm::Result;
use rookworld_lm::bf16_payload::{read_bf16_parallel, read_f32_parallel};
use rookworld_lm::checkpoint;

/// Overwrites `model`'s weights with those of safetensors `bytes` (bfloat16 or f32
/// values, names with or without the `transformer.` prefix) and repacks them for the
/// CPU kernel, in place. Every name and shape is checked first, as `from_bytes` checks
/// them, and an error leaves the model's values as they were.
///
/// Returns false, changing nothing, when the model is not f32 on the CPU or a tensor is
/// stored in another dtype: build the model afresh then.
///
/// The model's tensors are written through: a tensor cloned out of `model` earlier (or
/// a clone of the model) sees the new values. Refill only a model nothing else shares.
pub fn refill(model: &mut Gpt2, bytes: &[u8]) -> Result<bool> {
    if !refillable(model) {
        return Ok(false);
    }
    let st = SafeTensors::deserialize(bytes)?;
    let prefixed = checkpoint::check_tensors(
        model.config(),
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec())),
    )?;
    let mut writes = Vec::new();
    for (name, tensor) in model.named_tensors() {
        let key = match name.strip_prefix(checkpoint::PREFIX) {
            Some(bare) if !prefixed => bare,
            _ => &name,
        };
        let view = st.tensor(key)?;
        if !matches!(view.dtype(), Dtype::BF16 | Dtype::F32) {
            return Ok(false);
        }
        writes.push((tensor, view));
    }
    for (tensor, view) in writes {
        tensor.inplace_op1(&Overwrite {
            src: view.data(),
            bf16: view.dtype() == Dtype::BF16,
        })?;
    }
    model.pack_for_cpu()?;
    Ok(true)
}

/// Whether [`refill`] can write into `model`: f32 weights on the CPU.
pub fn refillable(model: &Gpt2) -> bool {
    model.device().is_cpu() && model.dtype() == DType::F32
}

/// Writes little-endian bfloat16 or f32 `src` over a contiguous f32 tensor of as many
/// elements, in parallel pieces (bfloat16 to f32 is exact; stored non-temporally:
/// [`read_bf16`](rookworld_lm::bf16_payload::read_bf16)).
struct Overwrite<'a> {
    src: &'a [u8],
    bf16: bool,
}

impl InplaceOp1 for Overwrite<'_> {
    fn name(&self) -> &'static str {
        "overwrite"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let width = if self.bf16 { 2 } else { 4 };
        let (CpuStorage::F32(all), Some((a, b))) = (storage, layout.contiguous_offsets()) else {
            candle_core::bail!("overwrite: the tensor is not contiguous f32");
        };
        let dst = &mut all[a..b];
        if dst.len() * width != self.src.len() {
            candle_core::bail!(
                "overwrite: {} bytes for {} elements",
                self.src.len(),
                dst.len()
            );
        }
        if self.bf16 {
            read_bf16_parallel(self.src, dst);
            return Ok(());
        }
        read_f32_parallel(self.src, dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use rookworld_lm::Config;
    use rookworld_lm::checkpoint::{from_bytes, init_random, to_bf16_payload, to_bytes};

    fn values(model: &Gpt2) -> Vec<Vec<f32>> {
        model
            .named_tensors()
            .into_iter()
            .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    }

    fn logits(model: &Gpt2) -> Vec<f32> {
        let ids = Tensor::new(&[[5u32, 17, 3, 250]], &Device::Cpu).unwrap();
        let padding = rookworld_lm::LeftPadding::none(1);
        let mut cache = model.new_cache();
        model
            .forward(&ids, &padding, &mut cache)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn a_refilled_model_is_the_model_built_from_the_same_bytes() {
        let cfg = Config::tiny();
        let source = init_random(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
        for bytes in [
            to_bf16_payload(&source).unwrap(),
            to_bytes(&source, DType::F32).unwrap(),
        ] {
            let mut fresh = from_bytes(&bytes, &cfg, DType::F32, &Device::Cpu).unwrap();
            let mut old = init_random(&cfg, 12, DType::F32, &Device::Cpu).unwrap();
            let packed = fresh.pack_for_cpu().unwrap();
            old.pack_for_cpu().unwrap();
            assert!(refill(&mut old, &bytes).unwrap());
            assert_eq!(values(&old), values(&fresh), "bit-identical weights");
            if packed {
                assert_eq!(logits(&old), logits(&fresh), "the packed panels follow");
            }
        }
    }

    #[test]
    fn a_wrong_shape_is_refused_before_anything_is_written() {
        let mut model = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
        let before = values(&model);
        let mut other_cfg = Config::tiny();
        other_cfg.n_embd *= 2;
        let other = init_random(&other_cfg, 2, DType::F32, &Device::Cpu).unwrap();
        let err = refill(&mut model, &to_bf16_payload(&other).unwrap()).unwrap_err();
        assert!(err.to_string().contains("shape"), "{err}");
        assert_eq!(values(&model), before);
    }

    #[test]
    fn other_dtypes_and_devices_are_left_to_a_fresh_build() {
        let cfg = Config::tiny();
        let source = init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        let mut model = init_random(&cfg, 4, DType::F32, &Device::Cpu).unwrap();
        let before = values(&model);
        assert!(!refill(&mut model, &to_bytes(&source, DType::F16).unwrap()).unwrap());
        assert_eq!(values(&model), before);
        let mut bf16 = init_random(&cfg, 4, DType::BF16, &Device::Cpu).unwrap();
        assert!(!refill(&mut bf16, &to_bf16_payload(&source).unwrap()).unwrap());
    }
}
