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
use rookworld_lm::checkpoint::{self, write_atomic};
use serde::{Deserialize, Serialize};

use crate::optim::{AdamW, AdamWConfig, Schedule};
use crate::policy::Trainable;
use crate::prompts::Cursor;
use crate::queue::QueueSnapshot;

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

    checkpoint::save(&policy.model, &tmp, DType::F32)?;
    rookworld_lm::Tokenizer::gpt2().save(&tmp)?;
    let mut moments: Vec<(String, Tensor)> = Vec::new();
    let shapes: HashMap<&str, candle_core::Shape> = policy
        .vars
        .iter()
        .map(|(n, v)| (n.as_str(), v.shape().clone()))
        .collect();
    for (name, (m, v)) in &opt.moments {
        let shape = shapes
            .get(name.as_str())
            .cloned()
            .unwrap_or_else(|| candle_core::Shape::from(m.len()));
        for (kind, values) in [("m", m), ("v", v)] {
            let t = Tensor::from_slice(values, shape.clone(), &Device::Cpu)?;
            moments.push((format!("{kind}.{name}"), t));
        }
    }
    moments.sort_by(|a, b| a.0.cmp(&b.0));
    let bytes = safetensors::serialize(moments, None).map_err(rookworld_lm::Error::from)?;
    write_atomic(&tmp.join(OPTIMIZER_FILE), &bytes)?;
    let json = serde_json::to_vec_pretty(state).expect("state serialises");
    write_atomic(&tmp.join(STATE_FILE), &json)?;
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

/// The newest complete checkpoint of `run`, if any.
pub fn latest(run: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let pointer = run.join("checkpoints").join(LATEST);
    if !pointer.exists() {
        return Ok(None);
    }
    let name = std::fs::read_to_string(&pointer).map_err(io(&pointer))?;
    let dir = run.join("checkpoints").join(name.trim());
    if !dir.join(STATE_FILE).is_file() {
        return Err(CheckpointError::Invalid(format!(
            "{} names {}, which is not a complete checkpoint",
            pointer.display(),
            dir.display()
        )));
    }
    Ok(Some(dir))
}

/// Loads a checkpoint directory: trainable policy, optimizer and trainer state.
pub fn load(
    dir: &Path,
    device: &Device,
) -> Result<(Trainable, AdamW, TrainerState), CheckpointError> {
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| CheckpointError::Invalid(format!("{}: {e}", state_path.display())))?;
    let policy = Trainable::load(dir, device)?;
    let tensors = candle_core::safetensors::load(dir.join(OPTIMIZER_FILE), &Device::Cpu)?;
    let mut opt = AdamW::new(state.adamw);
    opt.steps = state.optimizer_steps;
    let mut by_name: HashMap<String, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
    for (key, t) in tensors {
        let (kind, name) = key
            .split_once('.')
            .ok_or_else(|| CheckpointError::Invalid(format!("optimizer tensor `{key}`")))?;
        let slot = by_name.entry(name.to_owned()).or_default();
        match kind {
            "m" => slot.0 = Some(t),
            "v" => slot.1 = Some(t),
            _ => {
                return Err(CheckpointError::Invalid(format!(
                    "optimizer tensor `{key}`"
                )));
            }
        }
    }
    for (name, slot) in by_name {
        match slot {
            (Some(m), Some(v)) => {
                let host = |t: Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
                opt.moments.insert(name, (host(m)?, host(v)?));
            }
            _ => {
                return Err(CheckpointError::Invalid(format!(
                    "optimizer moments of `{name}` incomplete"
                )));
            }
        }
    }
    Ok((policy, opt, state))
}
