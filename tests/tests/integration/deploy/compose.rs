//! The compose file, the images' Dockerfile and Prometheus's scrape configuration.

use std::collections::{BTreeMap, BTreeSet};

use yaml_rust2::Yaml;

use super::{deploy, known_env, read, s, yaml};

/// `NAME` of `NAME=value` and `NAME: value` entries.
pub fn env_of_compose(service: &Yaml) -> BTreeMap<String, String> {
    match &service["environment"] {
        Yaml::Hash(h) => h
            .iter()
            .map(|(k, v)| {
                let v = if v.is_null() { String::new() } else { s(v) };
                (s(k), v)
            })
            .collect(),
        Yaml::BadValue => BTreeMap::new(),
        other => panic!("environment should be a map: {other:?}"),
    }
}

pub const COMPOSE_SERVICES: [(&str, &str, u16, u16); 3] = [
    // (compose service, binary, gRPC port, metrics port)
    ("learner", "learner", 50051, 9091),
    ("worker", "rollout-worker", 50053, 9093),
    ("reward-server", "reward-server", 50052, 9092),
];

/// `ENV` names per Dockerfile stage, and each stage's base.
pub fn dockerfile_stages() -> BTreeMap<String, BTreeSet<String>> {
    let text = read(&deploy().join("image/Dockerfile")).replace("\\\n", " ");
    let mut stages = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("FROM ") {
            current = rest.split_whitespace().last().unwrap().to_owned();
            stages.insert(current.clone(), BTreeSet::new());
        } else if let Some(rest) = line.strip_prefix("ENV ") {
            let names = rest
                .split_whitespace()
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_owned()));
            stages.get_mut(&current).unwrap().extend(names);
        }
    }
    stages
}

#[test]
fn dockerfile_sets_only_settings_the_services_read() {
    let known = known_env();
    let stages = dockerfile_stages();
    for (_, binary, grpc, metrics) in COMPOSE_SERVICES {
        let names = &stages[binary];
        assert!(!names.is_empty(), "stage {binary} sets no ENV");
        for name in names {
            assert!(
                known[binary].contains(name),
                "Dockerfile stage {binary} sets {name}, which `{binary}` does not read"
            );
        }
        let text = read(&deploy().join("image/Dockerfile"));
        for port in [grpc, metrics] {
            assert!(
                text.contains(&format!("0.0.0.0:{port}")),
                "stage {binary} listens on {port}"
            );
        }
    }
    assert!(stages["base"].contains("RUST_LOG"));
}

#[test]
fn compose_services_are_configured_for_their_binaries() {
    let doc = &yaml("docker-compose.yml")[0];
    let services = &doc["services"];
    let known = known_env();
    for name in [
        "learner",
        "worker",
        "reward-server",
        "prometheus",
        "grafana",
    ] {
        assert!(!services[name].is_badvalue(), "no service {name}");
        assert!(
            !services[name]["restart"].is_badvalue(),
            "{name} has no restart policy"
        );
        assert!(
            services[name]["healthcheck"]["test"].as_vec().is_some(),
            "{name} has no health check"
        );
    }
    for (service, binary, grpc, _) in COMPOSE_SERVICES {
        let svc = &services[service];
        assert_eq!(
            s(&svc["build"]["target"]),
            binary,
            "{service}: image target"
        );
        for name in env_of_compose(svc).keys() {
            assert!(
                known[binary].contains(name),
                "compose sets {name} on {service}, which `{binary}` does not read"
            );
        }
        let test: Vec<String> = svc["healthcheck"]["test"]
            .as_vec()
            .unwrap_or_else(|| panic!("{service}: no healthcheck"))
            .iter()
            .map(s)
            .collect();
        assert_eq!(
            test,
            ["CMD", binary, "health", &format!("http://127.0.0.1:{grpc}")],
            "{service}: healthcheck"
        );
    }
    // Every service has the token secret: the learner's queue, the workers' Generate and
    // pushes, the reward server's Score are all behind it.
    for service in ["learner", "worker", "reward-server"] {
        let svc = &services[service];
        let secrets: Vec<String> = svc["secrets"].as_vec().unwrap().iter().map(s).collect();
        assert_eq!(secrets, ["rookworld_token"], "{service}: secrets");
        assert_eq!(
            env_of_compose(svc)["ROOKWORLD_TOKEN_FILE"],
            "/run/secrets/rookworld_token"
        );
    }
    assert!(!doc["secrets"]["rookworld_token"]["file"].is_badvalue());
    // Two workers by default.
    assert_eq!(s(&services["worker"]["scale"]), "${WORKERS:-2}");
    // The reward server is healthy before the learner and the workers start.
    for service in ["learner", "worker"] {
        assert_eq!(
            s(&services[service]["depends_on"]["reward-server"]["condition"]),
            "service_healthy"
        );
    }
}

#[test]
fn the_tls_override_makes_every_connection_mutual_tls() {
    let doc = &yaml("compose.tls.yml")[0];
    let known = known_env();
    let mut urls = 0;
    for (service, binary, grpc, _) in COMPOSE_SERVICES {
        let svc = &doc["services"][service];
        let env = env_of_compose(svc);
        for name in env.keys() {
            assert!(
                known[binary].contains(name),
                "compose.tls.yml sets {name} on {service}, which `{binary}` does not read"
            );
        }
        let file = |key: &str| {
            env.get(key)
                .map(String::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(
            file("ROOKWORLD_TLS_CERT"),
            format!("/run/tls/{service}.crt")
        );
        assert_eq!(file("ROOKWORLD_TLS_KEY"), format!("/run/tls/{service}.key"));
        assert_eq!(
            file("ROOKWORLD_TLS_CLIENT_CA"),
            "/run/tls/ca.crt",
            "{service}: mTLS"
        );
        assert_eq!(file("ROOKWORLD_TLS_CA"), "/run/tls/ca.crt");
        assert_eq!(
            file("ROOKWORLD_TLS_CLIENT_CERT"),
            format!("/run/tls/{service}.crt")
        );
        // Every peer URL it is given is https.
        for (k, v) in &env {
            if v.contains("://") {
                assert!(v.starts_with("https://"), "{service}: {k}={v}");
                urls += 1;
            }
        }
        let test: Vec<String> = svc["healthcheck"]["test"]
            .as_vec()
            .unwrap()
            .iter()
            .map(s)
            .collect();
        assert_eq!(
            test,
            [
                "CMD",
                binary,
                "health",
                &format!("https://127.0.0.1:{grpc}")
            ]
        );
        let mounts: Vec<String> = svc["volumes"].as_vec().unwrap().iter().map(s).collect();
        assert!(
            mounts.iter().any(|m| m.ends_with(":/run/tls:ro")),
            "{service}: {mounts:?}"
        );
    }
    assert_eq!(
        urls, 3,
        "the learner's reward URL, the workers' learner and reward URLs"
    );
    // The workers share one certificate; the learner checks them by its name.
    let learner = env_of_compose(&doc["services"]["learner"]);
    assert_eq!(learner["LEARNER_PUSH_TLS_NAME"], "worker");
    // The certificates the override names are the ones make-certs.sh makes by default.
    let script = read(&deploy().join("tls/make-certs.sh"));
    assert!(script.contains("set -- learner reward-server worker operator"));
}

#[test]
fn the_gpu_override_gives_the_workers_a_gpu_and_nvml() {
    let doc = &yaml("compose.gpu.yml")[0];
    let services = doc["services"].as_hash().unwrap();
    assert_eq!(services.len(), 1, "the override changes the workers only");
    let worker = &doc["services"]["worker"];
    let env = env_of_compose(worker);
    assert_eq!(env["ROOKWORLD_DEVICE"], "cuda");
    // NVML (the GPU utilisation metrics) comes with the driver's `utility` capability.
    let caps = &env["NVIDIA_DRIVER_CAPABILITIES"];
    assert!(
        caps.contains("compute") && caps.contains("utility"),
        "{caps}"
    );
    let known = &known_env()["rollout-worker"];
    for name in env.keys().filter(|n| !n.starts_with("NVIDIA_")) {
        assert!(
            known.contains(name),
            "compose.gpu.yml sets {name}, which the worker does not read"
        );
    }
    let device = &worker["deploy"]["resources"]["reservations"]["devices"][0];
    assert_eq!(s(&device["driver"]), "nvidia");
    assert!(
        !device["device_ids"].is_badvalue(),
        "the GPU is named, not counted"
    );
    assert_eq!(s(&worker["build"]["args"]["BIN"]), "bin-cuda");
}

/// Seconds of a compose duration such as `2m`, `90s` or `1m30s`.
fn duration_seconds(text: &str) -> f64 {
    let mut total = 0.0;
    let mut number = String::new();
    for c in text.chars() {
        match c {
            '0'..='9' | '.' => number.push(c),
            'h' | 'm' | 's' => {
                let unit = match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                total += number.parse::<f64>().expect("number") * unit;
                number.clear();
            }
            _ => panic!("duration {text}"),
        }
    }
    total
}

#[test]
fn the_learner_keeps_its_checkpoints_across_a_stop() {
    let doc = &yaml("docker-compose.yml")[0];
    let learner = &doc["services"]["learner"];
    let env = env_of_compose(learner);
    // Room to drain (the run file's drain timeout) and to write the final checkpoint.
    let run: toml::Table = read(&deploy().join("run.toml")).parse().unwrap();
    let drain = run["learner"]["train"]["drain_timeout"]
        .as_float()
        .or_else(|| {
            run["learner"]["train"]["drain_timeout"]
                .as_integer()
                .map(|i| i as f64)
        })
        .unwrap();
    let grace = duration_seconds(&s(&learner["stop_grace_period"]));
    assert!(
        grace >= drain + 60.0,
        "stop_grace_period {grace} s < drain {drain} s + 60 s"
    );
    assert_eq!(env["LEARNER_RESUME"], "true");
    // Every service reads the one run file, mounted; the environment restates no default.
    for service in ["learner", "worker", "reward-server"] {
        let svc = &doc["services"][service];
        let env = env_of_compose(svc);
        assert_eq!(
            env["ROOKWORLD_CONFIG"], "/etc/rookworld/run.toml",
            "{service}"
        );
        let volumes: Vec<String> = svc["volumes"].as_vec().unwrap().iter().map(s).collect();
        assert!(
            volumes.contains(&"${RUN_FILE:-./run.toml}:/etc/rookworld/run.toml:ro".to_owned()),
            "{service}: {volumes:?}"
        );
        let settings = ["LEARNER_", "ROLLOUT_", "REWARD_"];
        for (name, value) in env
            .iter()
            .filter(|(n, _)| settings.iter().any(|p| n.starts_with(p)))
        {
            let restated = value.starts_with(&format!("${{{name}:-")) && !value.ends_with(":-}");
            assert!(
                !restated,
                "{service}: {name} restates a default ({value}); put it in run.toml"
            );
        }
    }
    // The run directory (set by the image) and the dumps live on named volumes.
    let stages = dockerfile_stages();
    assert!(stages["learner"].contains("LEARNER_RUN_DIR"));
    let dockerfile = read(&deploy().join("image/Dockerfile"));
    assert!(dockerfile.contains("LEARNER_RUN_DIR=/data/run"));
    let volumes: Vec<String> = learner["volumes"].as_vec().unwrap().iter().map(s).collect();
    assert!(volumes.contains(&"checkpoints:/data/run".to_owned()));
    assert!(volumes.contains(&"rollouts:/data/rollouts".to_owned()));
    assert!(env["LEARNER_LOG_JSONL"].starts_with("/data/run/"));
    assert!(env["LEARNER_ROLLOUT_DUMP"].starts_with("/data/rollouts/"));
    for volume in ["checkpoints", "rollouts"] {
        assert!(!doc["volumes"][volume].is_badvalue(), "volume {volume}");
    }
}

#[test]
fn prometheus_loads_the_stall_alert_on_the_learners_gauge() {
    let doc = &yaml("prometheus/prometheus.yml")[0];
    let files: Vec<String> = doc["rule_files"].as_vec().unwrap().iter().map(s).collect();
    assert_eq!(files, ["/etc/prometheus/alerts.yml"]);
    let compose = &yaml("docker-compose.yml")[0];
    let mounts: Vec<String> = compose["services"]["prometheus"]["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert!(mounts.contains(&"./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro".into()));
    let alerts = &yaml("prometheus/alerts.yml")[0];
    let rules = alerts["groups"][0]["rules"].as_vec().unwrap();
    let stalled = rules
        .iter()
        .find(|r| s(&r["alert"]) == "LearnerStalled")
        .expect("a LearnerStalled rule");
    assert!(s(&stalled["expr"]).contains("learner_step_idle_seconds"));
}

#[test]
fn prometheus_scrapes_every_service() {
    let doc = &yaml("prometheus/prometheus.yml")[0];
    let mut targets = BTreeMap::new();
    for job in doc["scrape_configs"].as_vec().unwrap() {
        let name = s(&job["job_name"]);
        let target = if let Some(statics) = job["static_configs"].as_vec() {
            s(&statics[0]["targets"][0])
        } else {
            let dns = &job["dns_sd_configs"][0];
            format!("{}:{}", s(&dns["names"][0]), s(&dns["port"]))
        };
        targets.insert(name, target);
    }
    for (service, binary, _, metrics) in COMPOSE_SERVICES {
        assert_eq!(
            targets.get(binary),
            Some(&format!("{service}:{metrics}")),
            "scrape job {binary}"
        );
    }
}
