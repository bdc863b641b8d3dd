//! The record of a run: `RUN/config.toml`, every setting of `learner train` as resolved
//! (defaults, run file, environment, flags) with where the run came from — the binary's
//! version and commit, the model source (directory and BLAKE3 of its weights, or preset and
//! seed) and the device — in a `[record]` table that run files do not read. The same text is
//! kept in every checkpoint, and `learner train --config RUN/config.toml` runs it again.

use std::path::Path;

/// The file in the run directory and in each checkpoint.
pub const FILE: &str = "config.toml";

/// Where a run came from.
#[derive(Debug, Clone)]
pub struct Origin {
    /// `checkpoint DIR`, `preset NAME (seed N)`, or the checkpoint a run resumed from.
    pub model: String,
    /// BLAKE3 of the starting weights file, when the model is a directory.
    pub weights_blake3: Option<String>,
    pub device: String,
}

impl Origin {
    /// The origin of a run starting from `model` (a directory) or a preset.
    pub fn of(model: Option<&Path>, preset: &str, seed: u64, device: &str) -> Self {
        match model {
            Some(model) => {
                let dir = rookworld_lm::hub::resolve(model).ok();
                Self {
                    model: match &dir {
                        Some(dir) if dir != model => {
                            format!("{} ({})", model.display(), dir.display())
                        }
                        _ => model.display().to_string(),
                    },
                    weights_blake3: dir.as_deref().and_then(weights_hash),
                    device: device.to_owned(),
                }
            }
            None => Self {
                model: format!("preset {preset} (seed {seed})"),
                weights_blake3: None,
                device: device.to_owned(),
            },
        }
    }
}

/// Writes `RUN/config.toml` for a run started with `settings` from `origin`, and returns
/// its text. On a `resumed` run, each setting that differs from the record of the run's
/// last start is logged first.
pub fn write(
    run_dir: &Path,
    settings: &toml::Table,
    origin: &Origin,
    resumed: bool,
) -> rookworld_lm::Result<String> {
    let path = run_dir.join(FILE);
    if resumed
        && let Some(old) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| settings_of(&t))
    {
        for change in diff(&old, settings) {
            tracing::info!(%change, "setting changed since the run's last start");
        }
    }
    let text = render(settings, Some(origin));
    rookworld_lm::model_io::write_atomic(&path, text.as_bytes())?;
    tracing::info!(record = %path.display(), "run settings recorded");
    Ok(text)
}

/// BLAKE3 of `DIR/model.safetensors`, `None` when it cannot be read.
fn weights_hash(dir: &Path) -> Option<String> {
    let file = std::fs::File::open(dir.join("model.safetensors")).ok()?;
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(file).ok()?;
    Some(hasher.finalize().to_hex().to_string())
}

/// The commit this binary was built from (`unknown` outside a git checkout).
pub fn commit() -> &'static str {
    option_env!("ROOKWORLD_COMMIT").unwrap_or("unknown")
}

/// The text of a record: a header, the settings, then `[record]` when `origin` is known.
pub fn render(settings: &toml::Table, origin: Option<&Origin>) -> String {
    let mut out = String::from(
        "# learner train: every setting as resolved (defaults < run file < environment < flags).\n\
         # Run it again with `learner train --config THIS_FILE`; [record] is not read.\n\n",
    );
    out += &toml::to_string(settings).expect("a table serialises");
    let mut record = toml::Table::new();
    record.insert("version".into(), env!("CARGO_PKG_VERSION").into());
    record.insert("commit".into(), commit().into());
    if let Some(o) = origin {
        record.insert("model".into(), o.model.clone().into());
        if let Some(h) = &o.weights_blake3 {
            record.insert("weights_blake3".into(), h.clone().into());
        }
        record.insert("device".into(), o.device.clone().into());
        record.insert(
            "cpu_kernels".into(),
            rookworld_lm::cpu_gemm::kernels_line().into(),
        );
    }
    let mut wrapper = toml::Table::new();
    wrapper.insert("record".into(), toml::Value::Table(record));
    out.push('\n');
    out += &toml::to_string(&wrapper).expect("a table serialises");
    out
}

/// The settings of a record's text (its `[record]` left out).
pub fn settings_of(text: &str) -> Option<toml::Table> {
    let mut t: toml::Table = text.parse().ok()?;
    t.remove("record");
    Some(t)
}

/// Each key whose value differs between `old` and `new`, as `key: old → new` (a key only
/// one of them has shows `—` on the other side), sorted by key.
pub fn diff(old: &toml::Table, new: &toml::Table) -> Vec<String> {
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort();
    keys.dedup();
    let show = |v: Option<&toml::Value>| v.map_or("—".to_owned(), |v| v.to_string());
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| format!("{k}: {} → {}", show(old.get(k)), show(new.get(k))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_without_its_origin_and_diffs_name_each_key() {
        let mut s = toml::Table::new();
        s.insert("group_size".into(), 8.into());
        s.insert("lr".into(), 0.001.into());
        s.insert("device".into(), "cpu".into());
        let origin = Origin::of(None, "tiny", 3, "cpu");
        let text = render(&s, Some(&origin));
        assert!(text.contains("model = \"preset tiny (seed 3)\""), "{text}");
        assert_eq!(settings_of(&text).unwrap(), s);
        let mut t = s.clone();
        t.insert("lr".into(), 0.002.into());
        t.remove("device");
        assert_eq!(
            diff(&s, &t),
            vec![
                "device: \"cpu\" → —".to_owned(),
                "lr: 0.001 → 0.002".to_owned()
            ]
        );
    }
}
