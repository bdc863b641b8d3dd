//! Models by any name: a checkpoint directory, a run directory (its newest checkpoint, as
//! `RUN/checkpoints/latest` names it) or that pointer itself, or a Hugging Face id —
//! `--model jrahn/RookWorld-LM-124M` (optionally `@revision`) resolves through the standard
//! Hugging Face cache (`HF_HOME`, else `~/.cache/huggingface`) to a checkpoint directory,
//! downloading only the files that are missing and only when allowed (`HF_HUB_OFFLINE`
//! unset). A path that exists is always local, never a name.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};
use crate::model_io::{CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE};

/// Files a checkpoint may have beside its weights (taken when present, never required).
const OPTIONAL: [&str; 1] = ["tokenizer.json"];

/// A Hugging Face model repository id with its revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId {
    pub id: String,
    /// `main` unless given after `@`.
    pub revision: String,
}

impl RepoId {
    /// `owner/name` or `owner/name@revision`, in the characters the Hub allows; `None` for
    /// anything else (a path).
    pub fn parse(s: &str) -> Option<Self> {
        let (id, revision) = match s.split_once('@') {
            Some((id, rev)) if !rev.is_empty() => (id, rev),
            Some(_) => return None,
            None => (s, "main"),
        };
        let (owner, name) = id.split_once('/')?;
        let ok = |part: &str| {
            !part.is_empty()
                && !part.starts_with('.')
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        (ok(owner) && ok(name)).then(|| Self {
            id: id.to_owned(),
            revision: revision.to_owned(),
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.id.clone(), RepoType::Model, self.revision.clone())
    }
}

/// Whether `HF_HUB_OFFLINE` forbids downloads (`1`, `true`, `yes`, `on`).
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The checkpoint directory `model` names: the directory itself when it exists, else the
/// Hugging Face cache's snapshot of the repository it names (see [`resolve_in`]), with the
/// cache and offline mode from the environment.
pub fn resolve(model: &Path) -> Result<PathBuf> {
    resolve_in(model, &Cache::from_env(), offline_from_env())
}

/// The pointer to a run's newest checkpoint: `RUN/checkpoints/latest`, a file naming the
/// checkpoint directory beside it (`step-00000012`).
pub const LATEST_POINTER: &str = "latest";
/// Where a run directory keeps its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";

/// What `--model` accepts, for errors that must say it.
pub const MODEL_NAMES: &str = "a checkpoint directory (config.json and model.safetensors: a local Hugging Face download, `learner init`/`export` output, RUN/checkpoints/step-N), a run directory of `learner train`/`sft` or its checkpoints/latest (the newest checkpoint), or a Hugging Face id owner/name[@revision]";

/// [`resolve`] with a given cache and offline mode.
pub fn resolve_in(model: &Path, cache: &Cache, offline: bool) -> Result<PathBuf> {
    if model.exists() {
        return local(model);
    }
    let Some(repo) = model.to_str().and_then(RepoId::parse) else {
        return Err(Error::MissingFile(format!(
            "model {} does not exist; --model takes {MODEL_NAMES}",
            model.display()
        )));
    };
    if let Some(dir) = cached(&repo, cache) {
        return Ok(dir);
    }
    if offline {
        return Err(Error::MissingFile(format!(
            "{} (revision {}) is not in the Hugging Face cache {} and HF_HUB_OFFLINE forbids downloading it: download it where there is network (`hf download {}`), unset HF_HUB_OFFLINE, or give --model a local checkpoint or run directory",
            repo.id,
            repo.revision,
            cache.path().display(),
            repo.id
        )));
    }
    download(&repo, cache)
}

/// The checkpoint directory a local path names: itself when it holds `config.json`; a run
/// directory's newest checkpoint (`RUN/checkpoints/latest`); the checkpoint a `latest`
/// pointer file names.
fn local(model: &Path) -> Result<PathBuf> {
    if model.is_file() {
        let named = (model.file_name() == Some(LATEST_POINTER.as_ref()))
            .then(|| std::fs::read_to_string(model).ok())
            .flatten();
        return match named {
            Some(name) => local(&model.with_file_name(name.trim())),
            None => Err(Error::MissingFile(format!(
                "model {} is a file; --model takes {MODEL_NAMES}",
                model.display()
            ))),
        };
    }
    if model.join(CONFIG_FILE).is_file() {
        return Ok(model.to_path_buf());
    }
    let pointer = model.join(CHECKPOINTS_DIR).join(LATEST_POINTER);
    if pointer.exists() {
        return local(&pointer);
    }
    let what = if model.join(CHECKPOINTS_DIR).is_dir() {
        "a run directory without a finished checkpoint (no checkpoints/latest)"
    } else {
        "a directory without config.json"
    };
    Err(Error::MissingFile(format!(
        "model {} is {what}; --model takes {MODEL_NAMES}",
        model.display()
    )))
}

/// The snapshot directory holding the config and every weights file, if the cache has them.
fn cached(repo: &RepoId, cache: &Cache) -> Option<PathBuf> {
    let get = |file: &str| -> Option<PathBuf> {
        cache.repo(repo.repo()).get(file).or_else(|| {
            // A commit hash has a snapshot but no ref.
            let p = cache
                .path()
                .join(repo.repo().folder_name())
                .join("snapshots")
                .join(&repo.revision)
                .join(file);
            p.is_file().then_some(p)
        })
    };
    let config = get(CONFIG_FILE)?;
    let dir = config.parent()?.to_path_buf();
    if get(WEIGHTS_FILE).is_some() {
        return Some(dir);
    }
    let index = get(WEIGHTS_INDEX_FILE)?;
    let shards = shards_of(&index).ok()?;
    shards.iter().all(|s| get(s).is_some()).then_some(dir)
}

/// The shard files a `model.safetensors.index.json` names.
fn shards_of(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|source| Error::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
        path: index.to_path_buf(),
        source,
    })?;
    let mut shards: Vec<String> = v["weight_map"]
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// Downloads the config and the weights (single file, else the index and its shards) into
/// the cache; returns the snapshot directory.
fn download(repo: &RepoId, cache: &Cache) -> Result<PathBuf> {
    let hub = |e: hf_hub::api::sync::ApiError| {
        use hf_hub::api::sync::ApiError;
        let unreachable = matches!(e, ApiError::RequestError(_) | ApiError::TooManyRetries(_));
        Error::MissingFile(format!(
            "{} (revision {}) from the Hugging Face Hub: {e}{}",
            repo.id,
            repo.revision,
            if unreachable {
                format!(
                    "; without network, give --model a local directory ({MODEL_NAMES}), or download it where there is network (`hf download {}`) into the cache {} and set HF_HUB_OFFLINE=1",
                    repo.id,
                    cache.path().display()
                )
            } else {
                String::new()
            }
        ))
    };
    tracing::info!(model = %repo.id, revision = %repo.revision, cache = %cache.path().display(), "downloading from the Hugging Face Hub");
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
        .with_progress(false)
        .build()
        .map_err(hub)?;
    let remote = api.repo(repo.repo());
    let config = remote.get(CONFIG_FILE).map_err(hub)?;
    if remote.get(WEIGHTS_FILE).is_err() {
        let index = remote.get(WEIGHTS_INDEX_FILE).map_err(hub)?;
        for shard in shards_of(&index)? {
            remote.get(&shard).map_err(hub)?;
        }
    }
    for file in OPTIONAL {
        let _ = remote.get(file);
    }
    config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| Error::MissingFile(format!("{}: no snapshot directory", repo.id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_owner_slash_name_with_an_optional_revision() {
        let r = RepoId::parse("jrahn/RookWorld-LM-124M").unwrap();
        assert_eq!(
            (r.id.as_str(), r.revision.as_str()),
            ("jrahn/RookWorld-LM-124M", "main")
        );
        let r = RepoId::parse("jrahn/RookWorld-LM-124M@v1.0").unwrap();
        assert_eq!(r.revision, "v1.0");
        for path in [
            "models/a/b",
            "./a/b",
            "/abs/dir",
            "a",
            "a/",
            "a/b@",
            "../x/y",
        ] {
            assert_eq!(RepoId::parse(path), None, "{path}");
        }
    }
}
