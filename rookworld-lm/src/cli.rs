//! Command-line options shared by every binary that loads a model.

use std::path::PathBuf;

use candle_core::Device;

use crate::checkpoint;
use crate::config::Config;
use crate::device::{DeviceChoice, default_dtype, parse_dtype};
use crate::error::{Error, Result};
use crate::model::Gpt2;
use crate::tokenizer::Tokenizer;

/// Where the weights come from, and where they run.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Hugging Face GPT-2 checkpoint: a directory (config.json + model.safetensors), or a
    /// Hub repository id (`jrahn/RookWorld-LM-124M`, `@revision` optional) resolved through
    /// the Hugging Face cache (`HF_HOME`; downloaded when missing unless `HF_HUB_OFFLINE`).
    #[arg(
        long,
        env = "ROOKWORLD_MODEL",
        conflicts_with = "preset",
        required_unless_present = "preset"
    )]
    pub model: Option<PathBuf>,
    /// Seeded random weights of a preset instead of a checkpoint: tiny, gpt2-124m.
    #[arg(long, env = "ROOKWORLD_PRESET")]
    pub preset: Option<String>,
    /// Seed of the random weights of --preset.
    #[arg(long, default_value_t = 0)]
    pub init_seed: u64,
    /// cpu, cuda, cuda:N, or auto (CUDA when usable, else CPU).
    #[arg(long, env = "ROOKWORLD_DEVICE", default_value = "cpu")]
    pub device: String,
    /// f32, f16 or bf16; default f32 on the CPU, bf16 on CUDA.
    #[arg(long, env = "ROOKWORLD_DTYPE")]
    pub dtype: Option<String>,
}

/// A loaded model with its tokenizer and where it runs.
#[derive(Debug)]
pub struct LoadedModel {
    pub model: Gpt2,
    pub tokenizer: Tokenizer,
    pub device: Device,
    /// Human-readable origin, e.g. `checkpoint /models/rw` or `preset tiny (seed 0)`.
    pub source: String,
}

impl ModelArgs {
    /// Opens the device, then loads the checkpoint or builds the preset.
    pub fn load(&self) -> Result<LoadedModel> {
        let choice: DeviceChoice = self.device.parse()?;
        let device = choice.open()?;
        let dtype = match &self.dtype {
            Some(name) => parse_dtype(name)?,
            None => default_dtype(&device),
        };
        let (model, tokenizer, source) = match (&self.model, &self.preset) {
            (Some(model), _) => {
                let dir = crate::hub::resolve(model)?;
                let source = if dir == *model {
                    format!("checkpoint {}", dir.display())
                } else {
                    format!("{} (checkpoint {})", model.display(), dir.display())
                };
                (
                    checkpoint::load(&dir, dtype, &device)?,
                    Tokenizer::from_dir_or_gpt2(&dir)?,
                    source,
                )
            }
            (None, Some(name)) => {
                let cfg = Config::preset(name)?;
                (
                    checkpoint::init_random(&cfg, self.init_seed, dtype, &device)?,
                    Tokenizer::gpt2(),
                    format!("preset {name} (random weights, seed {})", self.init_seed),
                )
            }
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "give --model DIR or --preset NAME".into(),
                ));
            }
        };
        Ok(LoadedModel {
            model,
            tokenizer,
            device,
            source,
        })
    }
}

/// Ends a command: success, or one `error: …` line on stderr and exit code 1.
pub fn exit_with<E: std::fmt::Display>(
    result: std::result::Result<(), E>,
) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
