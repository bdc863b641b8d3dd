//! Hugging Face GPT-2 checkpoints: load, save, and seeded random initialisation.
//!
//! A checkpoint directory holds `config.json` and either `model.safetensors` or a sharded
//! set listed by `model.safetensors.index.json`. Tensor names may carry the
//! `transformer.` prefix or not; `attn.bias`/`attn.masked_bias` buffers and an `lm_head`
//! tied to `wte` are ignored; f32, f16 and bf16 files load into any requested dtype.
//! Saving writes the layout `transformers`' `GPT2LMHeadModel.from_pretrained` reads.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::model::Gpt2;
pub use crate::model::PREFIX;
use crate::weights_buffer::{WeightsBuffer, data_section, layout_of};

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// Name and shape of every tensor the model reads, without the `transformer.` prefix
/// (an untied `lm_head.weight` is listed with its root name).
pub fn tensor_specs(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (v, e, i) = (cfg.vocab_size, cfg.n_embd, cfg.inner_dim());
    let mut specs = vec![
        ("wte.weight".to_owned(), vec![v, e]),
        ("wpe.weight".to_owned(), vec![cfg.n_positions, e]),
    ];
    for l in 0..cfg.n_layer {
        let p = format!("h.{l}");
        for (name, shape) in [
            ("ln_1.weight", vec![e]),
            ("ln_1.bias", vec![e]),
            ("attn.c_attn.weight", vec![e, 3 * e]),
            ("attn.c_attn.bias", vec![3 * e]),
            ("attn.c_proj.weight", vec![e, e]),
            ("attn.c_proj.bias", vec![e]),
            ("ln_2.weight", vec![e]),
            ("ln_2.bias", vec![e]),
            ("mlp.c_fc.weight", vec![e, i]),
            ("mlp.c_fc.bias", vec![i]),
            ("mlp.c_proj.weight", vec![i, e]),
            ("mlp.c_proj.bias", vec![e]),
        ] {
            specs.push((format!("{p}.{name}"), shape));
        }
    }
    specs.push(("ln_f.weight".to_owned(), vec![e]));
    specs.push(("ln_f.bias".to_owned(), vec![e]));
    if !cfg.tie_word_embeddings {
        specs.push(("lm_head.weight".to_owned(), vec![v, e]));
    }
    specs
}

/// The safetensors files of a checkpoint directory: `model.safetensors`, or every shard
/// named by `model.safetensors.index.json`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(WEIGHTS_INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| Error::Json {
                path: index.clone(),
                source,
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Config {
                path: index.clone(),
                reason: "no `weight_map` object".into(),
            })?;
        let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        let files: Vec<PathBuf> = shards.into_iter().map(|s| dir.join(s)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(Error::MissingFile(format!(
                "shard {} named in {} does not exist",
                missing.display(),
                index.display()
            )));
        }
        return Ok(files);
    }
    let hint = if dir.join("pytorch_model.bin").is_file() {
        " (pytorch_model.bin is not supported: convert it to safetensors)"
    } else {
        ""
    };
    Err(Error::MissingFile(format!(
        "no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {}{hint}",
        dir.display()
    )))
}

/// Loads `config.json` and the weights of `dir` into `dtype` on `device`.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Gpt2> {
    if !dir.is_dir() {
        return Err(Error::MissingFile(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.is_file() {
        return Err(Error::MissingFile(format!(
            "no {CONFIG_FILE} in {}",
            dir.display()
        )));
    }
    let cfg = Config::from_file(&config_path)?;
    let files = weight_files(dir)?;
    // SAFETY: the files are mapped read-only; like every safetensors reader we rely on
    // nobody truncating them while the model is being built (tensors are copied out).
    let st = unsafe { MmapedSafetensors::multi(&files)? };
    let prefixed = check_tensors(
        &cfg,
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec())),
    )?;
    let vb = if device.is_cpu() && dtype == DType::F32 {
        let tensors = crate::bf16_payload::host_tensors(st.tensors(), true)?;
        VarBuilder::from_tensors(tensors, dtype, device)
    } else {
        VarBuilder::from_backend(Box::new(st), dtype, device.clone())
    };
    build(vb, prefixed, &cfg)
}

/// Checks a checkpoint's (name, shape) list against `cfg`, naming the first missing or
/// misshaped tensor; returns whether names carry the `transformer.` prefix.
pub fn check_tensors(
    cfg: &Config,
    tensors: impl Iterator<Item = (String, Vec<usize>)>,
) -> Result<bool> {
    let shapes: HashMap<String, Vec<usize>> = tensors.collect();
    let prefixed = shapes.contains_key(&format!("{PREFIX}wte.weight"));
    let prefix = if prefixed { PREFIX } else { "" };
    for (name, expected) in tensor_specs(cfg) {
        let full = if name.starts_with("lm_head") {
            name
        } else {
            format!("{prefix}{name}")
        };
        match shapes.get(&full) {
            None => return Err(Error::MissingTensor(full)),
            Some(actual) if *actual != expected => {
                return Err(Error::TensorShape {
                    name: full,
                    expected,
                    actual: actual.clone(),
                });
            }
            Some(_) => {}
        }
    }
    Ok(prefixed)
}

/// GPT-2's initialisation, reproducible from `seed`: N(0, 0.02) weights, residual
/// projections (`c_proj`) scaled by 1/√(2·n_layer), zero biases, unit layer-norm gains.
/// Values come from one ChaCha8 stream in [`tensor_specs`] order, so the same seed gives
/// the same weights on every machine.
pub fn init_random(cfg: &Config, seed: u64, dtype: DType, device: &Device) -> Result<Gpt2> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let std = 0.02f32;
    let proj_std = std / (2.0 * cfg.n_layer as f32).sqrt();
    let mut tensors = HashMap::new();
    for (name, shape) in tensor_specs(cfg) {
        let n: usize = shape.iter().product();
        let is_ln = name.contains("ln_");
        let data: Vec<f32> = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if is_ln {
            vec![1.0; n]
        } else {
            let sd = if name.ends_with("c_proj.weight") {
                proj_std
            } else {
                std
            };
            let normal = Normal::new(0.0f32, sd).expect("positive std");
            (0..n).map(|_| normal.sample(&mut rng)).collect()
        };
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?;
        tensors.insert(name, t);
    }
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    Ok(Gpt2::load(vb.clone(), vb, cfg)?)
}

/// Saves `model` into `dir` as `config.json` + `model.safetensors` in `dtype`, the layout
/// `GPT2LMHeadModel.from_pretrained` loads. Files are written to temporaries and renamed,
/// so a crash never leaves a half-written checkpoint under the final names.
pub fn save(model: &Gpt2, dir: &Path, dtype: DType) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        other => {
            return Err(Error::InvalidArgument(format!(
                "cannot save weights as {other:?}: use f32, f16 or bf16"
            )));
        }
    };
    write_atomic(&dir.join(WEIGHTS_FILE), &to_bytes(model, dtype)?)?;

    let config = serde_json::to_string_pretty(&model.config().to_hf_json(torch_dtype))
        .expect("config serialises");
    write_atomic(&dir.join(CONFIG_FILE), config.as_bytes())
}

/// The model's weights as a safetensors file in `dtype` (Hugging Face names, `format: pt`
/// metadata): what [`save`] writes and what a weight push sends.
pub fn to_bytes(model: &Gpt2, dtype: DType) -> Result<Vec<u8>> {
    let tensors = model
        .named_tensors()
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(dtype)?.to_device(&Device::Cpu)?)))
        .collect::<Result<Vec<(String, Tensor)>>>()?;
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    Ok(safetensors::serialize(tensors, Some(metadata))?)
}

/// The model's weights as a bfloat16 safetensors payload, fast: f32 CPU weights are
/// converted in parallel straight into one buffer (the same tensors, values and names as
/// `to_bytes(model, BF16)`, bit for bit; the header's layout may differ, so [`save`] keeps
/// the byte-exact `to_bytes`). What a weight push sends.
pub fn to_bf16_payload(model: &Gpt2) -> Result<Vec<u8>> {
    match crate::bf16_payload::build(&model.named_tensors(), &[("format", "pt")])? {
        Some(bytes) => Ok(bytes),
        None => to_bytes(model, DType::BF16),
    }
}

/// Builds a model of shape `cfg` from safetensors `bytes` (any stored float dtype, with
/// or without the `transformer.` prefix), into `dtype` on `device`. A missing or
/// misshaped tensor is named; nothing is trusted before every tensor is checked.
pub fn from_bytes(bytes: &[u8], cfg: &Config, dtype: DType, device: &Device) -> Result<Gpt2> {
    if !device.is_cpu()
        && let Some(model) = from_bytes_in_one_buffer(bytes, cfg, dtype, device)?
    {
        return Ok(model);
    }
    let (_, prefixed) = checked(bytes, cfg)?;
    build(
        VarBuilder::from_tensors(
            crate::bf16_payload::load(bytes, dtype == DType::F32)?,
            dtype,
            device,
        ),
        prefixed,
        cfg,
    )
}

/// The model of safetensors `bytes` with every weight a view of one buffer on `device`,
/// filled by one copy of the payload's data section (what [`from_bytes`] builds off the
/// CPU); `None` when the payload does not allow it ([`upload_whole`]). When the stored
/// dtype is `dtype` (no conversion), the model keeps that buffer and the payload's layout
/// ([`Gpt2::weights_buffer`]), and [`refill_in_place`] writes the next version of the same
/// layout into it.
pub fn from_bytes_in_one_buffer(
    bytes: &[u8],
    cfg: &Config,
    dtype: DType,
    device: &Device,
) -> Result<Option<Gpt2>> {
    let (st, prefixed) = checked(bytes, cfg)?;
    let Some((tensors, buffer)) = upload_whole(&st, bytes, cfg, dtype, device)? else {
        return Ok(None);
    };
    let mut model = build(
        VarBuilder::from_tensors(tensors, dtype, device),
        prefixed,
        cfg,
    )?;
    if let Some(buffer) = buffer {
        model.set_weights_buffer(buffer);
    }
    Ok(Some(model))
}

/// Safetensors `bytes` parsed, every tensor `cfg` reads there in its shape, and whether
/// the names carry the `transformer.` prefix.
fn checked<'a>(bytes: &'a [u8], cfg: &Config) -> Result<(safetensors::SafeTensors<'a>, bool)> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let prefixed = check_tensors(
        cfg,
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec())),
    )?;
    Ok((st, prefixed))
}

/// Writes the weights of safetensors `bytes` over `model`'s in place, in one copy of the
/// payload's data section into the buffer its weights are views of (on a GPU: from
/// page-locked memory, one transfer), and refreshes the copies made of them for inference
/// (the padded LM head). Returns false, changing nothing, unless the model was built by
/// [`from_bytes_in_one_buffer`] from a payload of exactly this layout: the same names,
/// shapes, dtype and places in the data section (so the same checks hold as for a fresh
/// build).
///
/// The model's tensors are written through: a clone of the model sees the new values.
/// Refill only a model nothing else uses.
pub fn refill_in_place(model: &mut Gpt2, bytes: &[u8]) -> Result<bool> {
    let Some(buffer) = model.weights_buffer() else {
        return Ok(false);
    };
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let data = data_section(bytes);
    if layout_of(&st, data) != buffer.layout {
        return Ok(false);
    }
    let values = match buffer.whole.dtype() {
        DType::BF16 => crate::bf16_payload::StoredValues::Bf16(data),
        DType::F32 => crate::bf16_payload::StoredValues::F32(data),
        _ => return Ok(false),
    };
    crate::bf16_payload::overwrite(&buffer.whole, values)?;
    model.refresh_copies()?;
    Ok(true)
}

/// The tensors of a payload uploaded in one buffer, and that buffer when it is kept.
type Uploaded = (HashMap<String, Tensor>, Option<WeightsBuffer>);

/// The tensors of safetensors `bytes` on `device` in `dtype` through one host-to-device
/// copy of the whole data section (and, when the stored dtype differs, one cast there):
/// every tensor is a view of that one buffer. A weight push to a GPU worker takes this
/// path: one copy of 249 MB instead of one allocation, conversion and copy per tensor.
/// With them the buffer and the payload's layout, when no cast was needed.
///
/// `None` (nothing done) unless the payload holds exactly the tensors `cfg` reads, all
/// stored in one float dtype, with the data section aligned for it in memory: the
/// per-tensor path loads anything else.
fn upload_whole(
    st: &safetensors::SafeTensors<'_>,
    bytes: &[u8],
    cfg: &Config,
    dtype: DType,
    device: &Device,
) -> Result<Option<Uploaded>> {
    use safetensors::Dtype;
    let views = st.tensors();
    if views.len() != tensor_specs(cfg).len() || cfg!(target_endian = "big") {
        return Ok(None);
    }
    let stored = views[0].1.dtype();
    if views.iter().any(|(_, v)| v.dtype() != stored) {
        return Ok(None);
    }
    // The data section (safetensors checked the header, and that the tensors' byte ranges
    // tile the rest with no gap).
    let data = data_section(bytes);
    let whole = match stored {
        Dtype::F32 => aligned::<f32>(data, device)?,
        Dtype::BF16 => aligned::<half::bf16>(data, device)?,
        Dtype::F16 => aligned::<half::f16>(data, device)?,
        _ => None,
    };
    let Some(whole) = whole else {
        return Ok(None);
    };
    let kept = whole.dtype() == dtype;
    // [elements] on the device, in `dtype`.
    let whole = whole.to_dtype(dtype)?;
    let size = stored.bitsize() / 8;
    let mut out = HashMap::with_capacity(views.len());
    for (name, view) in views {
        let start = (view.data().as_ptr() as usize - data.as_ptr() as usize) / size;
        let len = view.data().len() / size;
        let tensor = whole.narrow(0, start, len)?.reshape(view.shape())?;
        out.insert(name, tensor);
    }
    let buffer = kept.then(|| WeightsBuffer {
        layout: layout_of(st, data),
        whole,
    });
    Ok(Some((out, buffer)))
}

/// `data` as one tensor of `T` on `device`; `None` when the bytes are not aligned for `T`
/// or not a whole number of them.
fn aligned<T: candle_core::WithDType>(data: &[u8], device: &Device) -> Result<Option<Tensor>> {
    // SAFETY: candle's element types are plain data (every bit pattern a value, no
    // padding); `align_to` hands out only the aligned middle, and the whole slice is
    // required to be that middle.
    let (head, values, tail) = unsafe { data.align_to::<T>() };
    if !head.is_empty() || !tail.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tensor::from_slice(values, values.len(), device)?))
}

/// The model from `root`, whose names carry the `transformer.` prefix when `prefixed`.
fn build(root: VarBuilder, prefixed: bool, cfg: &Config) -> Result<Gpt2> {
    let vb = if prefixed {
        root.pp("transformer")
    } else {
        root.clone()
    };
    Ok(Gpt2::load(vb, root, cfg)?)
}

/// Where [`write_atomic`] writes `path` before renaming it: `.NAME.tmp` beside it.
pub fn temporary(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or("file".into(), |n| n.to_string_lossy());
    path.with_file_name(format!(".{name}.tmp"))
}

/// Writes `bytes` to `path` through a temporary file ([`temporary`]) and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temporary(path);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_cover_the_124m_parameter_count() {
        let cfg = Config::gpt2_124m();
        let n: usize = tensor_specs(&cfg)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(n, cfg.num_parameters());
    }

    #[test]
    fn saved_names_match_the_loader_specs() {
        let cfg = Config::tiny();
        let model = init_random(&cfg, 0, DType::F32, &Device::Cpu).unwrap();
        let saved: Vec<String> = model.named_tensors().into_iter().map(|(n, _)| n).collect();
        let specs: Vec<String> = tensor_specs(&cfg)
            .into_iter()
            .map(|(n, _)| format!("{PREFIX}{n}"))
            .collect();
        assert_eq!(saved, specs);
    }

    /// Every tensor of `tensors` and `expected` equal to the bit (as f32 values).
    fn assert_same_tensors(tensors: &HashMap<String, Tensor>, expected: &HashMap<String, Tensor>) {
        assert_eq!(tensors.len(), expected.len());
        for (name, want) in expected {
            let got = &tensors[name];
            assert_eq!(got.dims(), want.dims(), "{name}");
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                v.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            assert_eq!(bits(got), bits(want), "{name}");
        }
    }

    #[test]
    fn one_upload_gives_every_tensor_of_the_per_tensor_path() {
        let cfg = Config::tiny();
        let model = init_random(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        for (payload, stored) in [
            (to_bf16_payload(&model).unwrap(), DType::BF16),
            (to_bytes(&model, DType::F32).unwrap(), DType::F32),
            (to_bytes(&model, DType::F16).unwrap(), DType::F16),
        ] {
            let st = safetensors::SafeTensors::deserialize(&payload).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let (whole, buffer) = upload_whole(&st, &payload, &cfg, dtype, &Device::Cpu)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{stored:?} payload into {dtype:?}: not taken"));
                // The buffer is kept where no cast made a new one.
                assert_eq!(
                    buffer.is_some(),
                    stored == dtype,
                    "{stored:?} into {dtype:?}"
                );
                let per_tensor: HashMap<String, Tensor> =
                    crate::bf16_payload::load(&payload, false)
                        .unwrap()
                        .into_iter()
                        .map(|(n, t)| (n, t.to_dtype(dtype).unwrap()))
                        .collect();
                assert!(whole.values().all(|t| t.dtype() == dtype));
                assert_same_tensors(&whole, &per_tensor);
                // Views of one buffer, and the model built of them computes the same.
                let a = build(
                    VarBuilder::from_tensors(whole, dtype, &Device::Cpu),
                    true,
                    &cfg,
                )
                .unwrap();
                let b = from_bytes(&payload, &cfg, dtype, &Device::Cpu).unwrap();
                let ids = Tensor::new(&[[3u32, 1, 4, 1, 5]], &Device::Cpu).unwrap();
                let pad = crate::mask::LeftPadding::none(1);
                let logits = |m: &Gpt2| {
                    m.forward(&ids, &pad, &mut m.new_cache())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                assert_eq!(logits(&a), logits(&b), "{stored:?} payload into {dtype:?}");
            }
        }
    }

    /// The logits of `m` for a few tokens, in f32.
    fn some_logits(m: &Gpt2) -> Vec<f32> {
        let ids = Tensor::new(&[[3u32, 1, 4, 1, 5]], &Device::Cpu).unwrap();
        let pad = crate::mask::LeftPadding::none(1);
        m.forward(&ids, &pad, &mut m.new_cache())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    #[test]
    fn a_version_of_the_same_layout_is_written_into_the_one_buffer() {
        let cfg = Config::tiny();
        let payload = |seed| {
            to_bf16_payload(&init_random(&cfg, seed, DType::F32, &Device::Cpu).unwrap()).unwrap()
        };
        let (first, second) = (payload(1), payload(2));
        let mut model = from_bytes_in_one_buffer(&first, &cfg, DType::BF16, &Device::Cpu)
            .unwrap()
            .expect("a bfloat16 payload in one buffer");
        let buffer = model.weights_buffer().expect("the buffer is kept").bytes();
        assert_eq!(buffer, cfg.num_parameters() * 2);
        // The padded head a GPU model keeps is a copy; it is written again too.
        model.pad_head().unwrap();
        let clone = model.clone();
        assert!(refill_in_place(&mut model, &second).unwrap());
        let fresh = from_bytes(&second, &cfg, DType::BF16, &Device::Cpu).unwrap();
        assert_same_tensors(
            &model.named_tensors().into_iter().collect(),
            &fresh.named_tensors().into_iter().collect(),
        );
        assert_eq!(
            some_logits(&model),
            some_logits(&fresh),
            "through the padded head"
        );
        // Written through: a clone shares the buffer (refill only a model nothing uses).
        assert_eq!(some_logits(&clone), some_logits(&fresh));

        // Another layout (f32 values) is not written; nothing changes.
        let other = to_bytes(
            &init_random(&cfg, 3, DType::F32, &Device::Cpu).unwrap(),
            DType::F32,
        )
        .unwrap();
        assert!(!refill_in_place(&mut model, &other).unwrap());
        assert_eq!(some_logits(&model), some_logits(&fresh));
        // Nor a model with no buffer: built per tensor, or cast on upload.
        let mut per_tensor = from_bytes(&first, &cfg, DType::BF16, &Device::Cpu).unwrap();
        assert!(!refill_in_place(&mut per_tensor, &second).unwrap());
        let mut cast = from_bytes_in_one_buffer(&first, &cfg, DType::F32, &Device::Cpu)
            .unwrap()
            .unwrap();
        assert!(cast.weights_buffer().is_none());
        assert!(!refill_in_place(&mut cast, &second).unwrap());
        // A malformed payload is an error, and the model is as it was.
        assert!(refill_in_place(&mut model, &second[..100]).is_err());
        assert_eq!(some_logits(&model), some_logits(&fresh));
    }

    #[test]
    fn one_upload_leaves_other_payloads_to_the_per_tensor_path() {
        let cfg = Config::tiny();
        let model = init_random(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        let mut tensors = model.named_tensors();
        let taken = |bytes: &[u8]| {
            let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
            upload_whole(&st, bytes, &cfg, DType::F32, &Device::Cpu)
                .unwrap()
                .is_some()
        };
        let payload = to_bf16_payload(&model).unwrap();
        assert!(taken(&payload));
        // The data section one byte off its alignment.
        let mut shifted = vec![0u8; payload.len() + 1];
        shifted[1..].copy_from_slice(&payload);
        assert!(!taken(&shifted[1..]));
        // Two stored dtypes.
        tensors[1].1 = tensors[1].1.to_dtype(DType::BF16).unwrap();
        assert!(!taken(
            &safetensors::serialize(tensors.clone(), None).unwrap()
        ));
        // A tensor the model does not read (a causal-mask buffer of an HF file).
        tensors[1].1 = tensors[1].1.to_dtype(DType::F32).unwrap();
        let mask = Tensor::ones((1, 1, 4, 4), DType::F32, &Device::Cpu).unwrap();
        tensors.push(("transformer.h.0.attn.bias".into(), mask));
        assert!(!taken(&safetensors::serialize(tensors, None).unwrap()));
        // Every such payload still loads, by the per-tensor path.
        assert!(from_bytes(&shifted[1..], &cfg, DType::F32, &Device::Cpu).is_ok());
    }

    #[test]
    fn a_saved_directory_loads_back_in_every_stored_dtype() {
        let cfg = Config::tiny();
        let model = init_random(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let dir = tempfile::tempdir().unwrap();
            save(&model, dir.path(), dtype).unwrap();
            let loaded = load(dir.path(), DType::F32, &Device::Cpu).unwrap();
            assert_eq!(loaded.dtype(), DType::F32);
            // Each tensor as the stored values widened by candle, to the bit.
            let want: HashMap<String, Tensor> = model
                .named_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()))
                .collect();
            let got: HashMap<String, Tensor> = loaded.named_tensors().into_iter().collect();
            assert_same_tensors(&got, &want);
        }
    }

    #[test]
    fn random_init_is_reproducible() {
        let cfg = Config::tiny();
        let a = init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
        let b = init_random(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
        let c = init_random(&cfg, 8, DType::F32, &Device::Cpu).unwrap();
        let first = |m: &Gpt2| {
            m.named_tensors()[0]
                .1
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(first(&a), first(&b));
        assert_ne!(first(&a), first(&c));
    }
}
