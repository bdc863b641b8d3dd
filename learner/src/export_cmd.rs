//! `learner export`: a model as a directory that Hugging Face `transformers` loads with
//! `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` — the files
//! `save_pretrained` writes for a GPT-2 and its tokenizer ([`FILES`]) and nothing else: a
//! training checkpoint's optimizer moments, trainer state and run record stay behind.

use std::path::{Path, PathBuf};

use rookworld_lm::cli::ModelArgs;
use rookworld_lm::device::parse_dtype;
use rookworld_lm::model_io::{self, CONFIG_FILE, WEIGHTS_FILE, write_atomic};
use rookworld_lm::{Config, Tokenizer};

/// `generation_config.json`: the token ids `generate` stops and pads with.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// `tokenizer.json`: the byte-level BPE, as the `tokenizers` library serialises it.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// `tokenizer_config.json`: which tokenizer class `AutoTokenizer` builds, and its tokens.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Every file of an export, sorted: what `transformers` 5's `save_pretrained` writes for
/// a GPT-2 model and its tokenizer.
pub const FILES: [&str; 5] = [
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
];
/// GPT-2's end-of-text token as text: its BOS, EOS, PAD and UNK.
const EOT_TEXT: &str = "<|endoftext|>";

/// Options of `learner export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// The model: `--model` or `--preset` (`--device` and `--weight-dtype` are hidden and
    /// not used: the weights are read on the CPU in f32, which holds every stored dtype
    /// exactly).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Directory to write the export into: created when missing; an existing one must be
    /// empty unless --overwrite.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// dtype of the exported weights: bf16 (half the size of f32, the dtype RookWorld-LM
    /// runs in on a GPU), f32 (lossless from a training checkpoint) or f16.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32", "f16"])]
    pub dtype: String,
    /// Write over an earlier export in --out (its files are replaced; a directory holding
    /// any other file is still refused, so nothing but an export is ever overwritten).
    #[arg(long)]
    pub overwrite: bool,
}

/// Why an export was refused or failed; each names the path it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// `--out` exists and is a file.
    #[error("--out {}: not a directory", path.display())]
    NotADirectory { path: PathBuf },
    /// `--out` holds `entry`, and `--overwrite` was not given.
    #[error(
        "--out {}: not empty (holds {entry}): give an empty or new directory, or \
         --overwrite to replace an earlier export",
        path.display()
    )]
    NotEmpty { path: PathBuf, entry: String },
    /// `--overwrite`, but `--out` holds `entry`, which no export writes.
    #[error(
        "--out {}: holds {entry}, which is not part of an export: --overwrite replaces \
         only an earlier export's files; remove it or give another directory",
        path.display()
    )]
    Foreign { path: PathBuf, entry: String },
    /// `--out` could not be listed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The model could not be loaded or a file not written (each names its path).
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
}

/// Checks `--out`, loads the model and writes the export: every file into a staging
/// directory beside `--out` ([`model_io::temporary`]), moved into `--out` once all are
/// written. Ctrl-C or SIGTERM before that ends the command (exit 0) with nothing written.
pub fn run(args: &ExportArgs) -> Result<(), ExportError> {
    check_out(&args.out, args.overwrite)?;
    let dtype = parse_dtype(&args.dtype)?;
    let stop = rookworld_service::serve::stop_on_signal().map_err(|source| ExportError::Io {
        path: "signal handlers".into(),
        source,
    })?;
    let stopped = || stop.load(std::sync::atomic::Ordering::Relaxed);
    let stored = ModelArgs {
        device: "cpu".into(),
        weight_dtype: "f32".into(),
        ..args.model.clone()
    };
    let loaded = stored.load()?;
    let cfg = loaded.model.config();
    let stage = model_io::temporary(&args.out);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Io { path, source }
    };
    // A stage left by an export that was killed.
    if stage.exists() {
        std::fs::remove_dir_all(&stage).map_err(io(&stage))?;
    }
    let written = (|| {
        model_io::save(&loaded.model, &stage, dtype)?;
        write_json(&stage.join(GENERATION_CONFIG_FILE), &generation_config(cfg))?;
        write_json(&stage.join(TOKENIZER_CONFIG_FILE), &tokenizer_config(cfg))?;
        write_tokenizer(&loaded.tokenizer, &stage.join(TOKENIZER_FILE))
    })();
    if written.is_err() || stopped() {
        let _ = std::fs::remove_dir_all(&stage);
        if written.is_ok() {
            eprintln!(
                "export: stopped by a signal; nothing written to {}",
                args.out.display()
            );
        }
        return written;
    }
    publish(&stage, &args.out).map_err(io(&args.out))?;
    tracing::info!(
        source = %loaded.source,
        out = %args.out.display(),
        dtype = %args.dtype,
        parameters = cfg.num_parameters(),
        "export written (load it with transformers' AutoModelForCausalLM.from_pretrained)"
    );
    Ok(())
}

/// Moves a complete export from `stage` into `out`: the directory renamed whole when `out`
/// is missing or empty, else each file renamed over the earlier export's (and that
/// export's leftover temporaries removed).
fn publish(stage: &Path, out: &Path) -> std::io::Result<()> {
    if !out.exists() || std::fs::remove_dir(out).is_ok() {
        return std::fs::rename(stage, out);
    }
    for file in FILES {
        std::fs::rename(stage.join(file), out.join(file))?;
        let _ = std::fs::remove_file(model_io::temporary(&out.join(file)));
    }
    std::fs::remove_dir(stage)
}

/// Refuses an `out` that is a file, or a directory with entries (with `overwrite`: with
/// an entry that is neither an export's file nor its temporary).
fn check_out(out: &Path, overwrite: bool) -> Result<(), ExportError> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        return Err(ExportError::NotADirectory {
            path: out.to_path_buf(),
        });
    }
    let io = |source| ExportError::Io {
        path: out.to_path_buf(),
        source,
    };
    let mut entries: Vec<String> = std::fs::read_dir(out)
        .map_err(io)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort();
    let ours = |name: &str| {
        let name = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp"))
            .unwrap_or(name);
        FILES.contains(&name)
    };
    let path = out.to_path_buf();
    match entries.into_iter().find(|e| !overwrite || !ours(e)) {
        None => Ok(()),
        Some(entry) if overwrite => Err(ExportError::Foreign { path, entry }),
        Some(entry) => Err(ExportError::NotEmpty { path, entry }),
    }
}

/// `generation_config.json`: what `transformers` derives from the model's config, with
/// end-of-text also the padding token (RookWorld-LM pads with it), so `generate` needs no
/// `pad_token_id` of its own.
pub fn generation_config(cfg: &Config) -> serde_json::Value {
    serde_json::json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "output_attentions": false,
        "output_hidden_states": false,
        "pad_token_id": cfg.eos_token_id,
        "use_cache": true,
    })
}

/// `tokenizer_config.json`: GPT-2's tokenizer (the `tokenizers` backend, no prefix space)
/// with end-of-text for every special token and the model's context as its longest input.
pub fn tokenizer_config(cfg: &Config) -> serde_json::Value {
    serde_json::json!({
        "add_prefix_space": false,
        "backend": "tokenizers",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "errors": "replace",
        "model_max_length": cfg.n_positions,
        "pad_token": EOT_TEXT,
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": EOT_TEXT,
    })
}

/// Writes `value` as `transformers` writes its JSON files: keys sorted, two-space indent,
/// a final newline.
fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), ExportError> {
    let mut text = serde_json::to_string_pretty(value).expect("a JSON value serialises");
    text.push('\n');
    Ok(write_atomic(path, text.as_bytes())?)
}

/// Writes `tokenizer.json` indented, as `save_pretrained` does.
fn write_tokenizer(tokenizer: &Tokenizer, path: &Path) -> Result<(), ExportError> {
    Ok(write_atomic(path, tokenizer.to_json()?.as_bytes())?)
}
