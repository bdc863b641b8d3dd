//! Helpers for the cross-crate tests in `tests/`: fixture paths, tensor comparisons, and
//! the repository's pages and metric names as the documentation tests read them.

use std::collections::BTreeSet;
use std::path::PathBuf;

use candle_core::Tensor;

/// `tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

/// Largest |a − b| over all elements, both compared in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap();
    let b = b
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap();
    let a = a.to_vec1::<f32>().unwrap();
    let b = b.to_vec1::<f32>().unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` (`ext`) file under `rel`, recursively.
fn files_under(rel: &str, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![repo_root().join(rel)];
    while let Some(path) = stack.pop() {
        if path.is_dir() {
            stack.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
    out
}

/// The README, `deploy/README.md` and every page of the book (`docs/`), sorted.
pub fn book_pages() -> Vec<PathBuf> {
    let mut pages = vec![
        repo_root().join("README.md"),
        repo_root().join("deploy/README.md"),
    ];
    pages.extend(files_under("docs", "md"));
    pages.sort();
    pages
}

/// A name with the prefix of one of the services' metrics.
pub fn is_metric_name(name: &str) -> bool {
    ["learner_", "rollout_", "reward_", "grpc_tls_"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// The crates that record metrics, by source folder.
const METRIC_SOURCES: [&str; 6] = [
    "learner/src",
    "rookworld-generation/src",
    "rollout-worker/src",
    "reward-server/src",
    "rookworld-chess/src",
    "rookworld-service/src",
];

/// Where a metric name is written in the sources: each string literal that is a metric
/// name (`"learner_…"`, `"rollout_…"`, `"reward_…"`, `"grpc_tls_…"`), with its file and
/// whether it is a constant's value (`const X: &str = "…"`) or something else (a literal
/// given straight to a metric macro or `build_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricLiteral {
    pub name: String,
    pub file: PathBuf,
    pub constant: bool,
}

/// Every metric-name literal in the sources of the crates that record metrics.
pub fn metric_literals() -> Vec<MetricLiteral> {
    let mut out = Vec::new();
    for dir in METRIC_SOURCES {
        for path in files_under(dir, "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            let pieces: Vec<&str> = text.split('"').collect();
            for pair in pieces.windows(2).step_by(2) {
                let (before, piece) = (pair[0].trim_end(), pair[1]);
                let constant = before.ends_with("&str =");
                let named = constant || before.ends_with("!(") || before.ends_with("build_info(");
                if named
                    && is_metric_name(piece)
                    && piece.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                {
                    out.push(MetricLiteral {
                        name: piece.to_owned(),
                        file: path.clone(),
                        constant,
                    });
                }
            }
        }
    }
    out
}

/// Metric names in the sources of every crate that records metrics.
pub fn metric_names_in_sources() -> BTreeSet<String> {
    metric_literals().into_iter().map(|l| l.name).collect()
}
