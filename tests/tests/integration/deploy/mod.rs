//! The deployment files agree with each other and with the services: every environment
//! variable the compose file, the Dockerfile and the Kubernetes manifests set is one the
//! service's command line reads; ports, health checks, secrets, volumes and scrape targets
//! line up; the Grafana provisioning and dashboard are well-formed and only query metrics
//! the services export. (`deploy/e2e.sh` runs the stack itself on a Docker engine;
//! `.ci/run` also validates the manifests against the Kubernetes schemas.)
//!
//! - `compose`: the compose file, the images' Dockerfile and Prometheus's scrape config.
//! - `grafana`: the provisioned datasource and dashboard.
//! - `k8s`: the Kubernetes manifests.
//! - `metrics`: the book's table of every metric (`docs/operations/metrics.md`).

mod compose;
mod grafana;
mod k8s;
mod metrics;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::{Args, Command};
use yaml_rust2::{Yaml, YamlLoader};

pub fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every YAML document of a file.
pub fn yaml(rel: &str) -> Vec<Yaml> {
    let path = deploy().join(rel);
    YamlLoader::load_from_str(&read(&path)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

pub fn s(y: &Yaml) -> String {
    match y {
        Yaml::String(v) => v.clone(),
        Yaml::Integer(v) => v.to_string(),
        Yaml::Real(v) => v.clone(),
        Yaml::Boolean(v) => v.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// The environment variables a command's arguments read.
pub fn env_names(cmd: Command) -> BTreeSet<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect()
}

/// What each service binary's running command reads from the environment, plus what
/// every binary reads (`RUST_LOG`, the log format) and what its `health` check reads (the
/// client TLS files).
pub fn known_env() -> BTreeMap<&'static str, BTreeSet<String>> {
    let with_common = |mut set: BTreeSet<String>| {
        set.extend(env_names(
            rookworld_service::logging::LogArgs::augment_args(Command::new("logging")),
        ));
        set.extend(env_names(
            rookworld_service::probe::HealthArgs::augment_args(Command::new("health")),
        ));
        set.extend(env_names(
            rookworld_service::run_file::RunFileArgs::augment_args(Command::new("run-file")),
        ));
        set.insert("RUST_LOG".into());
        set
    };
    BTreeMap::from([
        (
            "learner",
            with_common(env_names(learner::train::TrainArgs::augment_args(
                Command::new("train"),
            ))),
        ),
        (
            "rollout-worker",
            with_common(env_names(
                rollout_worker::serve_cmd::ServeArgs::augment_args(Command::new("serve")),
            )),
        ),
        (
            "reward-server",
            with_common(env_names(reward_server::cli::ServeArgs::augment_args(
                Command::new("serve"),
            ))),
        ),
    ])
}
