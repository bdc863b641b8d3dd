//! Command-line options shared by every binary that loads a model.

use std::path::PathBuf;

use candle_core::Device;

use crate::config::Config;
use crate::device::{DeviceChoice, WeightDtype};
use crate::error::{Error, Result};
use crate::kernels::{DISABLE_ENV, ENABLE_ENV, KernelChoice, Kernels};
use crate::model::Gpt2;
use crate::model_io;
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
    #[arg(long, env = "ROOKWORLD_INIT_SEED", default_value_t = 0)]
    pub init_seed: u64,
    /// cpu, cuda, cuda:N, or auto (CUDA when usable, else CPU).
    #[arg(long, env = "ROOKWORLD_DEVICE", default_value = "cpu")]
    pub device: String,
    /// The weights' dtype: auto, f32, bf16, f16 or int8. On CUDA the weights' dtype (auto:
    /// bf16); on the CPU, f32 activations with BF16 (auto, bf16), f32 or INT8 (int8:
    /// quantized, CPU only) matmul weights.
    #[arg(long, env = "ROOKWORLD_WEIGHT_DTYPE", default_value = "auto")]
    pub weight_dtype: String,
    #[command(flatten)]
    pub legacy_precision: LegacyPrecision,
    /// Which CUDA kernels the device runs: the binary's kernel flags, parsed once
    /// ([`KernelArgs::choice`]) and set here before the command runs.
    #[arg(skip)]
    pub kernels: KernelChoice,
}

/// The old `--precision` (`--dtype`, `ROOKWORLD_PRECISION`), hidden: it meant the weights'
/// dtype in some commands and the products' precision in others, so it is refused with a
/// line naming both new keys ([`legacy_precision`]). Flattened into every command that
/// took it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LegacyPrecision {
    #[arg(
        long = "precision",
        alias = "dtype",
        env = "ROOKWORLD_PRECISION",
        hide = true
    )]
    pub precision: Option<String>,
}

impl LegacyPrecision {
    /// Refuses the old key when it was given.
    pub fn refuse(&self) -> Result<()> {
        match &self.precision {
            Some(old) => Err(legacy_precision("--precision", old)),
            None => Ok(()),
        }
    }
}

/// The line that refuses the old `precision` setting, which meant two things: the weights'
/// dtype of a worker or an evaluation, and the products' precision of the learner's step.
/// `key` is how it was given (`--precision`, `--rollout-precision`).
pub fn legacy_precision(key: &str, value: &str) -> Error {
    Error::InvalidArgument(format!(
        "{key} {value}: `precision` was split in two — use --weight-dtype (run file: \
         weight_dtype; auto, f32, bf16, f16, int8) for the weights of a rollout worker or an \
         evaluation (learner train --local: --rollout-weight-dtype), or --matmul-precision \
         (matmul_precision; auto, f32, bf16) for the products of the learner's step"
    ))
}

/// Which of this project's CUDA kernels a device runs (every binary that opens one; see
/// [`crate::kernels`]): global flags, also set by environment variables and run-file keys.
#[derive(Debug, Clone, clap::Args)]
pub struct KernelArgs {
    /// Exit when one of this project's CUDA kernels fails its start-up check against its
    /// reference, instead of logging an ERROR and using candle's ops for it.
    #[arg(long, global = true, env = "ROOKWORLD_STRICT_KERNELS")]
    pub strict_kernels: bool,
    /// Trial CUDA kernel families to run, each checked against its reference at start-up
    /// first: comma-separated names, or all.
    #[arg(long, global = true, env = ENABLE_ENV, value_name = "NAMES")]
    pub enable_kernels: Option<String>,
    /// CUDA kernel families to turn off (candle's ops run instead): comma-separated
    /// names, or all.
    #[arg(long, global = true, env = DISABLE_ENV, value_name = "NAMES")]
    pub disable_kernels: Option<String>,
}

impl KernelArgs {
    /// The choice, each name checked against `known` (every kernel family of the binary's
    /// crates, e.g. [`crate::kernels::names`]).
    pub fn choice(&self, known: &[&'static str]) -> Result<KernelChoice> {
        KernelChoice::parse(
            self.enable_kernels.as_deref(),
            self.disable_kernels.as_deref(),
            self.strict_kernels,
            known,
        )
    }
}

/// A loaded model with its tokenizer and where it runs.
#[derive(Debug)]
pub struct LoadedModel {
    /// On its device, with the device's kernels ([`Gpt2::kernels`]).
    pub model: Gpt2,
    pub tokenizer: Tokenizer,
    pub device: Device,
    /// Human-readable origin, e.g. `checkpoint /models/rw` or `preset tiny (seed 0)`.
    pub source: String,
}

/// What a loaded model's `source` says of a checkpoint directory without tokenizer files.
pub const NO_TOKENIZER: &str = ", without tokenizer files (tokenizer.json, or vocab.json + merges.txt): the built-in GPT-2 tokenizer";

impl ModelArgs {
    /// `--weight-dtype`, parsed; the old `--precision` refused.
    pub fn weight_dtype(&self) -> Result<WeightDtype> {
        self.legacy_precision.refuse()?;
        self.weight_dtype
            .parse()
            .map_err(|e: Error| Error::InvalidArgument(format!("--weight-dtype: {e}")))
    }

    /// Opens `--device` and judges its kernels ([`Self::kernels`]).
    pub fn open(&self) -> Result<(Device, Kernels)> {
        self.device.parse::<DeviceChoice>()?.open(&self.kernels)
    }

    /// The model's configuration without its weights: the checkpoint's `config.json` or
    /// the preset's.
    pub fn config(&self) -> Result<Config> {
        match (&self.model, &self.preset) {
            (Some(model), _) => {
                let dir = crate::hub::resolve(model)?;
                Config::from_file(&dir.join(model_io::CONFIG_FILE))
            }
            (None, Some(name)) => Config::preset(name),
            (None, None) => Err(Error::InvalidArgument(
                "give --model DIR or --preset NAME".into(),
            )),
        }
    }

    /// Opens the device (judging its kernels: [`Self::kernels`]), then loads the
    /// checkpoint or builds the preset.
    pub fn load(&self) -> Result<LoadedModel> {
        self.weight_dtype()?;
        self.load_on(self.open()?)
    }

    /// Loads the checkpoint or builds the preset on a device already opened
    /// ([`Self::open`]) with its kernels.
    pub fn load_on(&self, (device, kernels): (Device, Kernels)) -> Result<LoadedModel> {
        let (dtype, panels) = self.weight_dtype()?.resolve(&device)?;
        let (model, tokenizer, source) = match (&self.model, &self.preset) {
            (Some(model), _) => {
                let dir = crate::hub::resolve(model)?;
                let mut source = if dir == *model {
                    format!("checkpoint {}", dir.display())
                } else {
                    format!("{} (checkpoint {})", model.display(), dir.display())
                };
                // The tokenizer (GPT-2's is 3.5 MB of JSON: ~60 ms to parse) is read on a
                // thread of its own while the checkpoint loads.
                let (model, tokenizer) = std::thread::scope(|scope| {
                    let tokenizer = scope.spawn(|| Tokenizer::from_dir(&dir));
                    let model = model_io::load(&dir, dtype, &device);
                    let tokenizer = tokenizer
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    (model, tokenizer)
                });
                let tokenizer = match tokenizer? {
                    Some(tokenizer) => tokenizer,
                    None => {
                        source += NO_TOKENIZER;
                        Tokenizer::gpt2()
                    }
                };
                (model?, tokenizer, source)
            }
            (None, Some(name)) => {
                let cfg = Config::preset(name)?;
                (
                    model_io::init_random(&cfg, self.init_seed, dtype, &device)?,
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
        let mut model = model;
        model.set_panel_dtype(panels);
        model.set_kernels(kernels);
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

/// The temperature by default wherever completions are sampled for training or measured
/// (`learner eval` samples greedily unless told otherwise).
pub const DEFAULT_TEMPERATURE: f64 = 1.0;

/// The token budget of a completion by default: RookWorld-LM's policy completions run to
/// about 80 tokens with end-of-text, its environment completions to fewer.
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 96;

/// How completions are sampled: one type, defaults and rules for every command that
/// samples (`learner train` and `eval`, `rollout-worker generate` and `bench`). The
/// temperature is ≥ 0 with 0 meaning greedy ([`crate::sampling::check_temperature`];
/// training refuses 0, a group of equal completions having nothing to learn from), top-p
/// lies in (0, 1] with 1 off ([`crate::sampling::check_top_p`]), top-k 0 is off.
#[derive(Debug, Clone, PartialEq, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct SamplingArgs {
    /// Softmax temperature (0: greedy).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_TEMPERATURE",
        default_value_t = DEFAULT_TEMPERATURE
    )]
    pub temperature: f64,
    /// Keep the k most likely tokens (0: off).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_TOP_K",
        default_value_t = 0
    )]
    pub top_k: u32,
    /// Keep the smallest most likely set whose probability reaches p (1: off).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_TOP_P",
        default_value_t = 1.0
    )]
    pub top_p: f64,
    /// Most tokens of a completion (end-of-text included).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "ROOKWORLD_MAX_NEW_TOKENS",
        default_value_t = DEFAULT_MAX_NEW_TOKENS
    )]
    pub max_new_tokens: u32,
}

impl Default for SamplingArgs {
    fn default() -> Self {
        Self {
            temperature: DEFAULT_TEMPERATURE,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
        }
    }
}

impl SamplingArgs {
    /// The rules of every sampling flag, naming the flag: temperature ≥ 0, top-p in
    /// (0, 1], at least one new token.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::sampling::check_temperature("--temperature", self.temperature)?;
        crate::sampling::check_top_p("--top-p", self.top_p)?;
        if self.max_new_tokens == 0 {
            return Err("--max-new-tokens must be ≥ 1 (got 0)".into());
        }
        Ok(())
    }

    /// The sampler's parameters (the token budget travels separately).
    pub fn params(&self) -> crate::sampling::SamplingParams {
        crate::sampling::SamplingParams {
            temperature: self.temperature as f32,
            top_k: self.top_k as usize,
            top_p: self.top_p as f32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_without_tokenizer_files_says_so_in_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let model =
            model_io::init_random(&Config::tiny(), 0, candle_core::DType::F32, &Device::Cpu)
                .unwrap();
        model_io::save(&model, dir.path(), candle_core::DType::F32).unwrap();
        let args = ModelArgs {
            model: Some(dir.path().to_path_buf()),
            preset: None,
            init_seed: 0,
            device: "cpu".into(),
            weight_dtype: "f32".into(),
            legacy_precision: Default::default(),
            kernels: Default::default(),
        };
        let loaded = args.load().unwrap();
        assert!(loaded.source.ends_with(NO_TOKENIZER), "{}", loaded.source);
        assert_eq!(
            loaded.tokenizer.vocab_size(),
            Tokenizer::gpt2().vocab_size()
        );
    }
}
