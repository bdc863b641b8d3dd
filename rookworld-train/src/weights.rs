//! The model's parameters as a backend holds them, in `rookworld_lm::Gpt2::named_tensors`
//! order: wte, wpe, 12 per block, ln_f (w, b), then an untied LM head.

use rookworld_lm::config::Config;

use crate::backend::{Backend, Error, Result};

/// Tensors per transformer block, in `Gpt2::named_tensors` order: ln_1 (w, b), c_attn
/// (w, b), attn.c_proj (w, b), ln_2 (w, b), c_fc (w, b), mlp.c_proj (w, b).
pub const PER_LAYER: usize = 12;

const BLOCK_NAMES: [&str; PER_LAYER] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

/// Read access to the parameters on a backend.
pub struct Weights<'a, B: Backend + ?Sized> {
    pub cfg: &'a Config,
    bufs: Vec<&'a B::Buf>,
}

impl<'a, B: Backend + ?Sized> Weights<'a, B> {
    /// `bufs` in `named_tensors` order; their number must be the model's.
    pub fn new(cfg: &'a Config, bufs: Vec<&'a B::Buf>) -> Result<Self> {
        let want = count(cfg);
        if bufs.len() != want {
            return Err(Error::Shape(format!(
                "{} parameter tensors, the model has {want}",
                bufs.len()
            )));
        }
        Ok(Self { cfg, bufs })
    }

    pub fn get(&self, i: usize) -> &'a B::Buf {
        self.bufs[i]
    }

    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    /// Index of the LM head's weight (V, E): `wte` when tied.
    pub fn head_index(&self) -> usize {
        head_index(self.cfg)
    }
}

/// Number of parameter tensors of a model of `cfg`.
pub fn count(cfg: &Config) -> usize {
    4 + PER_LAYER * cfg.n_layer + usize::from(!cfg.tie_word_embeddings)
}

/// Index of parameter `j` (0..12) of block `l`.
pub fn layer(l: usize, j: usize) -> usize {
    2 + l * PER_LAYER + j
}

/// Index of ln_f's weight (its bias follows).
pub fn ln_f(cfg: &Config) -> usize {
    2 + PER_LAYER * cfg.n_layer
}

/// Index of the LM head's weight: `wte` when tied.
pub fn head_index(cfg: &Config) -> usize {
    if cfg.tie_word_embeddings {
        0
    } else {
        count(cfg) - 1
    }
}

/// Parameter `i`'s name, as `Gpt2::named_tensors` gives it.
pub fn name(cfg: &Config, i: usize) -> String {
    let f = ln_f(cfg);
    match i {
        0 => "transformer.wte.weight".into(),
        1 => "transformer.wpe.weight".into(),
        i if i < f => {
            let (l, j) = ((i - 2) / PER_LAYER, (i - 2) % PER_LAYER);
            format!("transformer.h.{l}.{}", BLOCK_NAMES[j])
        }
        i if i == f => "transformer.ln_f.weight".into(),
        i if i == f + 1 => "transformer.ln_f.bias".into(),
        _ => "lm_head.weight".into(),
    }
}

/// Each parameter's number of elements, in `named_tensors` order.
pub fn lengths(cfg: &Config) -> Vec<usize> {
    let (e, i, v, p) = (cfg.n_embd, cfg.inner_dim(), cfg.vocab_size, cfg.n_positions);
    let mut out = vec![v * e, p * e];
    for _ in 0..cfg.n_layer {
        out.extend([e, e, e * 3 * e, 3 * e, e * e, e, e, e, e * i, i, i * e, e]);
    }
    out.extend([e, e]);
    if !cfg.tie_word_embeddings {
        out.push(v * e);
    }
    out
}

/// Deterministic weights of a model of `cfg` for tests and benches, in `named_tensors`
/// order: independent uniform values of GPT-2's initial scale (standard deviation 0.02,
/// a different stream per parameter and `seed`), layer-norm weights around 1.
pub fn synthetic(cfg: &Config, seed: u64) -> Vec<Vec<f32>> {
    // Uniform on [−a, a] has standard deviation a / √3.
    let a = 0.02 * 3f32.sqrt();
    lengths(cfg)
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            let n = name(cfg, k);
            let offset = if n.contains("ln_") && n.ends_with(".weight") {
                1.0
            } else {
                0.0
            };
            let stream = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((k as u64) << 32);
            (0..len as u64)
                .map(|i| offset + a * (2.0 * unit(splitmix64(stream.wrapping_add(i))) - 1.0))
                .collect()
        })
        .collect()
}

/// SplitMix64's output for `x`: a well-mixed 64-bit value.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x`'s top 24 bits as a number in [0, 1).
fn unit(x: u64) -> f32 {
    (x >> 40) as f32 / (1u64 << 24) as f32
}
