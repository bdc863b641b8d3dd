//! A model's next weights written into its own memory.
//!
//! A rollout worker on the CPU builds every pushed version into about 1 GB of f32
//! weights and packed panels (gpt2-124m). Built fresh, every page of that is faulted in
//! and zeroed by the kernel first — on a small VM a fresh 249 MB buffer's first touch
//! alone took 0.7 s. [`refill`] instead writes a new version into a retired model's
//! tensors and panels in place: the same checks as
//! [`model_io::from_bytes`](rookworld_lm::model_io::from_bytes), no allocation of the
//! model's size.

use candle_core::DType;
use safetensors::{Dtype, SafeTensors};

use rookworld_lm::Gpt2;
use rookworld_lm::Result;
use rookworld_lm::bf16_payload::{StoredValues, overwrite};
use rookworld_lm::model_io;

/// Overwrites `model`'s weights with those of safetensors `bytes` (bfloat16 or f32
/// values, names with or without the `transformer.` prefix) and repacks them for the
/// CPU kernel, in place. Every name and shape is checked first, as `from_bytes` checks
/// them, and an error leaves the model's values as they were. A packed-only model
/// ([`Gpt2::packed_only`], a worker's) is packed straight from `bytes`
/// ([`Gpt2::refill_packed`]): no dense copy of its projections is written.
///
/// A model built by one upload ([`model_io::from_bytes_in_one_buffer`]) takes the next
/// version of the same layout by one copy into that buffer instead
/// ([`model_io::refill_in_place`]).
///
/// Returns false, changing nothing, when the model is neither f32 on the CPU nor in one
/// buffer of this payload's layout, or a tensor is stored in another dtype: build the
/// model afresh then.
///
/// The model's tensors are written through: a tensor cloned out of `model` earlier (or
/// a clone of the model) sees the new values. Refill only a model nothing else shares.
pub fn refill(model: &mut Gpt2, bytes: &[u8]) -> Result<bool> {
    if in_place(model) {
        return model_io::refill_in_place(model, bytes);
    }
    if !refillable(model) {
        return Ok(false);
    }
    let st = SafeTensors::deserialize(bytes)?;
    let prefixed = model_io::check_tensors(
        model.config(),
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec())),
    )?;
    let key = |name: &str| -> String {
        match name.strip_prefix(model_io::PREFIX) {
            Some(bare) if !prefixed => bare.to_owned(),
            _ => name.to_owned(),
        }
    };
    let mut stored = std::collections::HashMap::new();
    for (name, _) in model.named_tensors() {
        let view = st.tensor(&key(&name))?;
        let values = match view.dtype() {
            Dtype::BF16 => StoredValues::Bf16(view.data()),
            Dtype::F32 => StoredValues::F32(view.data()),
            _ => return Ok(false),
        };
        stored.insert(name, values);
    }
    if model.packed_only() {
        model.refill_packed(|name| {
            stored
                .get(name)
                .copied()
                .ok_or_else(|| candle_core::Error::Msg(format!("refill: no tensor {name}")))
        })?;
        return Ok(true);
    }
    for (name, tensor) in model.named_tensors() {
        overwrite(&tensor, stored[&name])?;
    }
    model.pack_for_cpu()?;
    Ok(true)
}

/// Whether [`refill`] can write into `model`: f32 weights on the CPU, or a model whose
/// weights are views of one buffer ([`model_io::from_bytes_in_one_buffer`]: a GPU
/// worker's) while the `weights_in_place` trial is on.
pub fn refillable(model: &Gpt2) -> bool {
    in_place(model) || (model.device().is_cpu() && model.dtype() == DType::F32)
}

/// Whether [`refill`] writes `model`'s one weights buffer: off the CPU only while the
/// `weights_in_place` trial is on (`--enable-kernels`) and its start-up check passed
/// ([`Gpt2::kernels`]).
fn in_place(model: &Gpt2) -> bool {
    model.weights_buffer().is_some()
        && (model.device().is_cpu()
            || model
                .kernels()
                .enabled(rookworld_lm::kernels::Kernel::WeightsInPlace))
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use rookworld_lm::Config;
    use rookworld_lm::model_io::{from_bytes, init_random, to_bf16_payload, to_bytes};

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

    /// A worker's model keeps its projections only as panels: refilled from a payload,
    /// it computes what a model freshly built and prepared from the payload computes, to
    /// the bit, in every panel dtype and from bfloat16 or f32 payloads; the small
    /// tensors and the embeddings are the fresh model's.
    #[test]
    fn a_packed_only_model_is_refilled_from_the_payload() {
        use rookworld_lm::cpu_gemm::PanelDtype;
        let cfg = Config::tiny();
        let source = init_random(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
        let kept = |m: &Gpt2| -> Vec<Vec<f32>> {
            m.named_tensors()
                .into_iter()
                .filter(|(_, t)| t.elem_count() > 0)
                .map(|(_, t)| {
                    let t = t.to_dtype(DType::F32).unwrap();
                    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                })
                .collect()
        };
        for panels in [PanelDtype::F32, PanelDtype::Bf16, PanelDtype::Int8] {
            for bytes in [
                to_bf16_payload(&source).unwrap(),
                to_bytes(&source, DType::F32).unwrap(),
            ] {
                let mut fresh = from_bytes(&bytes, &cfg, DType::F32, &Device::Cpu).unwrap();
                fresh.set_panel_dtype(panels);
                if !fresh.prepare_for_inference().unwrap() {
                    return; // no AVX2/FMA: nothing is packed (rookworld-lm/tests/integration/packed.rs reports it)
                }
                let mut old = init_random(&cfg, 12, DType::F32, &Device::Cpu).unwrap();
                old.set_panel_dtype(panels);
                assert!(old.prepare_for_inference().unwrap() && old.packed_only());
                assert!(refill(&mut old, &bytes).unwrap());
                assert!(old.packed_only());
                assert_eq!(
                    kept(&old),
                    kept(&fresh),
                    "{panels:?}: small tensors and wte"
                );
                assert_eq!(
                    logits(&old),
                    logits(&fresh),
                    "{panels:?}: the panels follow"
                );
            }
        }
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
