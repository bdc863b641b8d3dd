//! Training checkpoints: the model in Hugging Face layout (loadable by transformers), the
//! optimizer's moments, and the trainer's state (step, schedule, data cursor, seeds),
//! written so that a crash never leaves a corrupt latest checkpoint.
//!
//! `RUN/checkpoints/step-00000012/` holds `config.json`, `model.safetensors`,
//! `tokenizer.json`, `optimizer.safetensors` and `trainer_state.json`; `RUN/checkpoints/latest` names the
//! newest complete one. A checkpoint is written in a hidden temporary directory, renamed
//! into place, and only then does `latest` move (itself replaced by rename).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rookworld_lm::model_io::{self, write_atomic};
use serde::{Deserialize, Serialize};

use crate::prompts::Cursor;
use crate::queue::QueueSnapshot;
use rookworld_train::optim::{AdamW, AdamWConfig, Schedule};
use rookworld_train::policy::Trainable;

const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "trainer_state.json";
const LATEST: &str = "latest";
/// `RUN/published_version`: the highest weight version ever handed to the workers.
const PUBLISHED: &str = "published_version";

/// Everything besides weights and moments that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps completed.
    pub step: u64,
    /// GRPO runs: the weight version of these weights (0 in older checkpoints, where it
    /// was the step).
    #[serde(default)]
    pub version: u64,
    pub adamw: AdamWConfig,
    /// AdamW's step count (bias correction).
    pub optimizer_steps: u64,
    pub schedule: Schedule,
    /// Where the prompt source stands.
    pub cursor: Cursor,
    /// The command's own settings (checked on resume so a run is not silently changed).
    pub settings: serde_json::Value,
    /// GRPO runs: the rollout queue's unfinished prompts, re-queued on resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueSnapshot>,
    /// GRPO runs with `--eval-every`: the evaluation of these weights, when there is one
    /// (always for the final checkpoint of a run that finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<serde_json::Value>,
    /// The run's record (`config.toml`, [`crate::run_record`]), written beside the state.
    #[serde(skip)]
    pub record: Option<String>,
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error("{0}")]
    Invalid(String),
    /// A checkpoint file that cannot be read as what it should be (truncated, corrupt).
    #[error("{}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
}

impl From<candle_core::Error> for CheckpointError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(e.into())
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The directory of the checkpoint after `step` steps.
pub fn step_dir(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

/// Writes a checkpoint of `policy`, `opt` and `state` under `run`; returns its directory.
pub fn save(
    run: &Path,
    policy: &Trainable,
    opt: &AdamW,
    state: &TrainerState,
) -> Result<PathBuf, CheckpointError> {
    let root = run.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let dir = step_dir(run, state.step);
    let name = dir
        .file_name()
        .expect("step dir has a name")
        .to_string_lossy()
        .into_owned();
    let tmp = root.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;

    model_io::save(&policy.model, &tmp, DType::F32)?;
    rookworld_lm::Tokenizer::gpt2().save(&tmp)?;
    let mut moments: Vec<(String, Tensor)> = Vec::new();
    let shapes: HashMap<&str, candle_core::Shape> = policy
        .vars
        .iter()
        .map(|(n, v)| (n.as_str(), v.shape().clone()))
        .collect();
    for (name, m, v) in opt.host_moments()? {
        let shape = shapes
            .get(name)
            .cloned()
            .unwrap_or_else(|| candle_core::Shape::from(m.len()));
        for (kind, values) in [("m", m), ("v", v)] {
            let t = Tensor::from_slice(&values, shape.clone(), &Device::Cpu)?;
            moments.push((format!("{kind}.{name}"), t));
        }
    }
    moments.sort_by(|a, b| a.0.cmp(&b.0));
    let bytes = safetensors::serialize(moments, None).map_err(rookworld_lm::Error::from)?;
    write_atomic(&tmp.join(OPTIMIZER_FILE), &bytes)?;
    let json = serde_json::to_vec_pretty(state).expect("state serialises");
    write_atomic(&tmp.join(STATE_FILE), &json)?;
    if let Some(record) = &state.record {
        write_atomic(&tmp.join(crate::run_record::FILE), record.as_bytes())?;
    }
    sync_dir(&tmp)?;

    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    sync_dir(&root)?;
    write_atomic(&root.join(LATEST), name.as_bytes())?;
    Ok(dir)
}

/// Flushes a directory's entries to disk (renames inside it become durable).
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(dir))
}

/// Records, before the weights go out, that version `version` is published: after a crash
/// the resumed run numbers its weights past every version the workers may hold.
pub fn record_published(run: &Path, version: u64) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(run).map_err(io(run))?;
    write_atomic(&run.join(PUBLISHED), version.to_string().as_bytes())?;
    Ok(())
}

/// The highest weight version `run` ever published, if it recorded one.
pub fn published(run: &Path) -> Result<Option<u64>, CheckpointError> {
    let path = run.join(PUBLISHED);
    match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|e| CheckpointError::Invalid(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&path)(e)),
    }
}

/// The step of a checkpoint directory named `step-NNNNNNNN`.
fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The run's checkpoints, the one to resume from first: the one `latest` names, then the
/// older ones, newest first (the fallbacks when it turns out unreadable). Without a usable
/// `latest` every checkpoint directory counts, newest first. Empty when the run has none.
pub fn candidates(run: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let root = run.join("checkpoints");
    let mut steps: Vec<(u64, PathBuf)> = match std::fs::read_dir(&root) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let step = step_of(&e.file_name().to_string_lossy())?;
                e.path().is_dir().then(|| (step, e.path()))
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io(&root)(e)),
    };
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    let pointer = root.join(LATEST);
    let named = std::fs::read_to_string(&pointer)
        .ok()
        .and_then(|name| step_of(name.trim()));
    match named {
        Some(latest) => {
            let mut out = vec![step_dir(run, latest)];
            out.extend(
                steps
                    .into_iter()
                    .filter(|(s, _)| *s < latest)
                    .map(|(_, p)| p),
            );
            Ok(out)
        }
        None => Ok(steps.into_iter().map(|(_, p)| p).collect()),
    }
}

/// What a checkpoint holds, loaded.
pub struct Loaded {
    pub dir: PathBuf,
    pub policy: Trainable,
    pub opt: AdamW,
    pub state: TrainerState,
}

/// Loads the run's newest intact checkpoint: the one `latest` names or, when that one is
/// missing, truncated or corrupt, the newest older one that loads (with a warning naming
/// what was skipped and why). `None` when the run has no checkpoint; an error naming the
/// first failure when none loads.
pub fn load_newest(run: &Path, device: &Device) -> Result<Option<Loaded>, CheckpointError> {
    let mut first_error = None;
    for dir in candidates(run)? {
        match load(&dir, device) {
            Ok((policy, opt, state)) => {
                if let Some(e) = &first_error {
                    tracing::warn!(checkpoint = %dir.display(), skipped = %e, "the newest checkpoint is unreadable; resuming from the newest intact one");
                }
                return Ok(Some(Loaded {
                    dir,
                    policy,
                    opt,
                    state,
                }));
            }
            Err(e) => {
                tracing::warn!(checkpoint = %dir.display(), error = %e, "checkpoint unreadable");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(None),
    }
}

/// Loads a checkpoint directory: trainable policy, optimizer and trainer state.
pub fn load(
    dir: &Path,
    device: &Device,
) -> Result<(Trainable, AdamW, TrainerState), CheckpointError> {
    let corrupt = |path: PathBuf| {
        move |e: &dyn std::fmt::Display| CheckpointError::Corrupt {
            path,
            reason: e.to_string(),
        }
    };
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| corrupt(state_path.clone())(&e))?;
    let policy = Trainable::load(dir, device).map_err(|e| corrupt(dir.to_path_buf())(&e))?;
    let optimizer_path = dir.join(OPTIMIZER_FILE);
    let tensors = candle_core::safetensors::load(&optimizer_path, &Device::Cpu)
        .map_err(|e| corrupt(optimizer_path.clone())(&e))?;
    let mut opt = AdamW::new(state.adamw);
    opt.steps = state.optimizer_steps;
    let mut by_name: HashMap<String, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
    for (key, t) in tensors {
        let (kind, name) = key
            .split_once('.')
            .ok_or_else(|| corrupt(optimizer_path.clone())(&format!("tensor `{key}`")))?;
        let slot = by_name.entry(name.to_owned()).or_default();
        match kind {
            "m" => slot.0 = Some(t),
            "v" => slot.1 = Some(t),
            _ => return Err(corrupt(optimizer_path.clone())(&format!("tensor `{key}`"))),
        }
    }
    for (name, slot) in by_name {
        match slot {
            (Some(m), Some(v)) => {
                let host = |t: Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
                opt.moments.insert(name, (host(m)?, host(v)?));
            }
            _ => {
                let what = format!("moments of `{name}` incomplete");
                return Err(corrupt(optimizer_path.clone())(&what));
            }
        }
    }
    Ok((policy, opt, state))
}
