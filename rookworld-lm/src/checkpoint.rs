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

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
/// The prefix of the tensor names in a Hugging Face GPT-2 checkpoint (optional).
pub const PREFIX: &str = "transformer.";

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
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let prefixed = check_tensors(
        cfg,
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec())),
    )?;
    let whole = if device.is_cpu() {
        None
    } else {
        upload_whole(&st, bytes, cfg, dtype, device)?
    };
    let tensors = match whole {
        Some(tensors) => tensors,
        None => crate::bf16_payload::load(bytes, dtype == DType::F32)?,
    };
    build(
        VarBuilder::from_tensors(tensors, dtype, device),
        prefixed,
        cfg,
    )
}

/// The tensors of safetensors `bytes` on `device` in `dtype` through one host-to-device
/// copy of the whole data section (and, when the stored dtype differs, one cast there):
/// every tensor is a view of that one buffer. A weight push to a GPU worker takes this
/// path: one copy of 249 MB instead of one allocation, conversion and copy per tensor.
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
) -> Result<Option<HashMap<String, Tensor>>> {
    use safetensors::Dtype;
    let views = st.tensors();
    if views.len() != tensor_specs(cfg).len() || cfg!(target_endian = "big") {
        return Ok(None);
    }
    let stored = views[0].1.dtype();
    if views.iter().any(|(_, v)| v.dtype() != stored) {
        return Ok(None);
    }
    // The data section: after the 8-byte header length and the header (safetensors checked
    // both, and that the tensors' byte ranges tile the rest with no gap).
    let header = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let data = &bytes[8 + header..];
    let whole = match stored {
        Dtype::F32 => aligned::<f32>(data, device)?,
        Dtype::BF16 => aligned::<half::bf16>(data, device)?,
        Dtype::F16 => aligned::<half::f16>(data, device)?,
        _ => None,
    };
    let Some(whole) = whole else {
        return Ok(None);
    };
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
    Ok(Some(out))
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

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map_or("file".into(), |n| n.to_string_lossy());
    let tmp = path.with_file_name(format!(".{name}.tmp"));
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
                let whole = upload_whole(&st, &payload, &cfg, dtype, &Device::Cpu)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{stored:?} payload into {dtype:?}: not taken"));
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
