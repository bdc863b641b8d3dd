//! GPT-2 hyper-parameters: named presets and Hugging Face `config.json` I/O.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// End-of-text: also the BOS and PAD token of GPT-2 and RookWorld-LM.
pub const EOT_TOKEN: u32 = 50256;

/// The MLP's activation, as named by Hugging Face's `activation_function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// The tanh approximation of GELU (GPT-2's own, `gelu_new`).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh", alias = "gelu_fast")]
    GeluNew,
    /// Exact GELU with the error function (`gelu`).
    #[serde(rename = "gelu")]
    Gelu,
    /// `relu`.
    #[serde(rename = "relu")]
    Relu,
}

/// GPT-2 hyper-parameters, field names as in Hugging Face's `GPT2Config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    /// Context length (maximum position id + 1).
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// MLP width; `None` means 4 × `n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "default_activation")]
    pub activation_function: Activation,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default)]
    pub reorder_and_upcast_attn: bool,
    #[serde(default = "default_eot")]
    pub bos_token_id: u32,
    #[serde(default = "default_eot")]
    pub eos_token_id: u32,
}

fn default_activation() -> Activation {
    Activation::GeluNew
}
fn default_eps() -> f64 {
    1e-5
}
fn default_true() -> bool {
    true
}
fn default_eot() -> u32 {
    EOT_TOKEN
}

/// Names accepted by [`Config::preset`].
pub const PRESETS: &[&str] = &["gpt2-124m", "tiny"];

impl Config {
    /// GPT-2 small, the shape of RookWorld-LM-124M (124,439,808 parameters).
    pub fn gpt2_124m() -> Self {
        Self {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: Activation::GeluNew,
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            reorder_and_upcast_attn: false,
            bos_token_id: EOT_TOKEN,
            eos_token_id: EOT_TOKEN,
        }
    }

    /// A tiny GPT-2 with the full GPT-2 vocabulary, for tests and smoke runs.
    pub fn tiny() -> Self {
        Self {
            n_positions: 256,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            ..Self::gpt2_124m()
        }
    }

    /// Looks a preset up by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "gpt2-124m" | "gpt2" | "rookworld-lm-124m" => Ok(Self::gpt2_124m()),
            "tiny" => Ok(Self::tiny()),
            other => Err(Error::InvalidArgument(format!(
                "unknown preset `{other}` (known: {})",
                PRESETS.join(", ")
            ))),
        }
    }

    /// The shape in one line, as a worker's `Status` and a learner's errors name it:
    /// `gpt2 n_layer=12 n_embd=768 n_head=12 vocab=50257 ctx=1024`.
    pub fn shape(&self) -> String {
        format!(
            "gpt2 n_layer={} n_embd={} n_head={} vocab={} ctx={}",
            self.n_layer, self.n_embd, self.n_head, self.vocab_size, self.n_positions
        )
    }

    /// Width of the MLP's hidden layer.
    pub fn inner_dim(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Number of parameters, the tied LM head counted once.
    pub fn num_parameters(&self) -> usize {
        let (e, i, l) = (self.n_embd, self.inner_dim(), self.n_layer);
        let block = 2 * (2 * e) + (e * 3 * e + 3 * e) + (e * e + e) + (e * i + i) + (i * e + e);
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * e
        };
        self.vocab_size * e + self.n_positions * e + l * block + 2 * e + head
    }

    /// Rejects shapes and options the model does not implement.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "n_embd ({}) must be a positive multiple of n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if self.vocab_size == 0 || self.n_positions == 0 || self.n_layer == 0 {
            return Err("vocab_size, n_positions and n_layer must be positive".into());
        }
        if !self.scale_attn_weights || self.scale_attn_by_inverse_layer_idx {
            return Err(
                "only scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false are supported"
                    .into(),
            );
        }
        if self.layer_norm_epsilon.is_nan() || self.layer_norm_epsilon <= 0.0 {
            return Err("layer_norm_epsilon must be positive".into());
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let cfg: Config = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        if let Some(model_type) = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| {
                v.get("model_type")
                    .and_then(|t| t.as_str().map(str::to_owned))
            })
            && model_type != "gpt2"
        {
            return Err(Error::Config {
                path: path.to_path_buf(),
                reason: format!("model_type is `{model_type}`, expected `gpt2`"),
            });
        }
        cfg.validate().map_err(|reason| Error::Config {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(cfg)
    }

    /// The `config.json` that `transformers`' `GPT2LMHeadModel.from_pretrained` expects.
    pub fn to_hf_json(&self, torch_dtype: &str) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("Config serialises");
        let obj = v.as_object_mut().expect("Config is an object");
        obj.insert("model_type".into(), "gpt2".into());
        obj.insert(
            "architectures".into(),
            serde_json::json!(["GPT2LMHeadModel"]),
        );
        // transformers ≥ 5 reads `dtype`, earlier versions `torch_dtype`.
        obj.insert("dtype".into(), torch_dtype.into());
        obj.insert("torch_dtype".into(), torch_dtype.into());
        obj.insert("n_ctx".into(), self.n_positions.into());
        for key in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
            obj.insert(key.into(), 0.0.into());
        }
        obj.insert("use_cache".into(), true.into());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_has_the_published_parameter_count() {
        assert_eq!(Config::gpt2_124m().num_parameters(), 124_439_808);
    }

    #[test]
    fn reads_the_real_rookworld_config() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/rookworld-lm-124m.config.json");
        let cfg = Config::from_file(&path).expect("real config parses");
        assert_eq!(cfg, Config::gpt2_124m());
    }

    #[test]
    fn unknown_preset_is_an_error_naming_the_known_ones() {
        let err = Config::preset("gpt5").unwrap_err().to_string();
        assert!(err.contains("gpt5") && err.contains("tiny"), "{err}");
    }
}
