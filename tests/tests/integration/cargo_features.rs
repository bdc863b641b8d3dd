//! The `cuda` feature reaches every crate that has one: a crate whose `cuda` feature
//! leaves out a dependency's would build that dependency without its CUDA code when
//! built alone (`-p learner --features cuda`), silently losing what only the joint build
//! turns on (the worker's NVML gauges and device UUID, for one).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

#[test]
fn every_cuda_feature_enables_its_dependencies_cuda_features() {
    let root = rookworld_tests::repo_root();
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(&root)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().unwrap();
    // Each workspace crate's `cuda` feature, where it has one.
    let cuda: BTreeMap<&str, BTreeSet<&str>> = packages
        .iter()
        .filter_map(|p| {
            let list = p["features"].get("cuda")?.as_array()?;
            Some((
                p["name"].as_str().unwrap(),
                list.iter().filter_map(|f| f.as_str()).collect(),
            ))
        })
        .collect();
    assert!(cuda.contains_key("rookworld-lm") && cuda.contains_key("learner"));
    let mut missing = Vec::new();
    for p in packages {
        let name = p["name"].as_str().unwrap();
        let Some(enabled) = cuda.get(name) else {
            continue;
        };
        for dep in p["dependencies"].as_array().unwrap() {
            let dep_name = dep["name"].as_str().unwrap();
            // Normal dependencies only: a test's dependency does not ship in the binary.
            if !dep["kind"].is_null() || !cuda.contains_key(dep_name) {
                continue;
            }
            if !enabled.contains(format!("{dep_name}/cuda").as_str()) {
                missing.push(format!("{name}'s cuda feature leaves out {dep_name}/cuda"));
            }
        }
    }
    assert!(missing.is_empty(), "{missing:#?}");
}
