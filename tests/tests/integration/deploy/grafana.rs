//! The Grafana provisioning files and the dashboard.

use std::collections::BTreeSet;

use super::{deploy, read, s, yaml};

/// Metric names in the services' sources.
pub fn exported_metrics() -> BTreeSet<String> {
    rookworld_tests::metric_names_in_sources()
}

/// Metric names an expression uses, without the histogram suffixes.
fn metrics_in(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| rookworld_tests::is_metric_name(w))
        .map(|w| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| w.strip_suffix(suffix))
                .unwrap_or(w)
                .to_owned()
        })
        .collect()
}

#[test]
fn grafana_dashboard_queries_exported_metrics_from_the_provisioned_datasource() {
    let datasources = &yaml("grafana/provisioning/datasources/prometheus.yml")[0];
    let uid = s(&datasources["datasources"][0]["uid"]);
    assert_eq!(
        s(&datasources["datasources"][0]["url"]),
        "http://prometheus:9090"
    );
    let providers = &yaml("grafana/provisioning/dashboards/rookworld.yml")[0];
    let path = s(&providers["providers"][0]["options"]["path"]);
    let compose = &yaml("docker-compose.yml")[0];
    let mounts: Vec<String> = compose["services"]["grafana"]["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert!(
        mounts.contains(&format!("./grafana/dashboards:{path}:ro")),
        "the provider's path {path} is where compose mounts the dashboards: {mounts:?}"
    );

    let text = read(&deploy().join("grafana/dashboards/rookworld.json"));
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    assert_eq!(dash["uid"], "rookworld-grpo");
    let exported = exported_metrics();
    let mut used = BTreeSet::new();
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate panel id"
        );
        let pos = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| pos[k].as_u64().unwrap());
        assert!(x + w <= 24, "{pos}: wider than the grid");
        for cell in (x..x + w).flat_map(|cx| (y..y + h).map(move |cy| (cx, cy))) {
            assert!(cells.insert(cell), "{pos} overlaps another panel");
        }
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().unwrap();
        assert_eq!(panel["datasource"]["uid"], uid.as_str(), "{title}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], uid.as_str(), "{title}");
            let expr = t["expr"].as_str().unwrap();
            let names = metrics_in(expr);
            assert!(
                !names.is_empty(),
                "{title}: {expr} queries no metric of ours"
            );
            for name in names {
                assert!(
                    exported.contains(&name),
                    "{title}: {name} is not exported by any service"
                );
                used.insert(name);
            }
        }
    }
    // What the dashboard is for.
    for name in [
        "learner_reward_mean",
        "learner_reward_std",
        "learner_reward_component",
        "learner_loss",
        "learner_kl",
        "rollout_tokens_generated_total",
        "learner_queue_pending",
        "learner_queue_leased",
        "learner_queue_scored",
        "learner_staleness_mean_versions",
        "learner_weight_push_seconds",
        "learner_step_seconds",
        "reward_verdicts_total",
        "rollout_gpu_memory_used_bytes",
        "rollout_gpu_utilization_ratio",
        "learner_workers",
        "rollout_peer_reachable",
        "rollout_weight_updates_total",
        "learner_queue_scored_bytes",
    ] {
        assert!(used.contains(name), "the dashboard shows no {name}");
    }
}
