//! The Kubernetes manifests.

use std::collections::BTreeMap;

use yaml_rust2::Yaml;

use super::{deploy, known_env, read, s, yaml};

/// Every Kubernetes object of the manifests, by `kind/name`.
fn k8s_objects() -> BTreeMap<String, Yaml> {
    let mut objects = BTreeMap::new();
    for file in [
        "namespace.yaml",
        "run-config.yaml",
        "token-secret.yaml",
        "reward-server.yaml",
        "learner.yaml",
        "worker.yaml",
        "network-policies.yaml",
        "certificates.yaml",
    ] {
        for doc in yaml(&format!("k8s/{file}")) {
            let key = format!("{}/{}", s(&doc["kind"]), s(&doc["metadata"]["name"]));
            objects.insert(key, doc);
        }
    }
    objects
}

#[test]
fn kubernetes_manifests_reference_each_other_consistently() {
    let objects = k8s_objects();
    let kustomization = &yaml("k8s/kustomization.yaml")[0];
    let listed: Vec<String> = kustomization["resources"]
        .as_vec()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    for file in &listed {
        assert!(deploy().join("k8s").join(file).is_file(), "{file}");
    }
    // One run file for every pod: deploy/run.toml's text in a ConfigMap, mounted where
    // ROOKWORLD_CONFIG points.
    let run = &objects["ConfigMap/rookworld-run"];
    assert_eq!(
        s(&run["data"]["run.toml"]),
        read(&deploy().join("run.toml"))
    );
    assert!(listed.contains(&"run-config.yaml".to_owned()));
    // Kept out, so that an apply never blanks a token set by hand.
    assert!(!listed.contains(&"token-secret.yaml".to_owned()));
    let secret = s(&objects["Secret/rookworld-token"]["metadata"]["name"]);
    let known = known_env();
    let workloads = [
        ("StatefulSet/learner", "learner"),
        ("Deployment/worker", "rollout-worker"),
        ("Deployment/reward-server", "reward-server"),
    ];
    for (key, binary) in workloads {
        let w = &objects[key];
        assert_eq!(s(&w["metadata"]["namespace"]), "rookworld", "{key}");
        let pod = &w["spec"]["template"];
        let labels = &pod["metadata"]["labels"];
        for (k, v) in w["spec"]["selector"]["matchLabels"].as_hash().unwrap() {
            assert_eq!(&labels[s(k).as_str()], v, "{key}: selector matches the pod");
        }
        let container = &pod["spec"]["containers"][0];
        assert!(s(&container["image"]).starts_with(&format!("rookworld/{binary}:")));
        let env: Vec<(String, String)> = container["env"]
            .as_vec()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    s(&e["name"]),
                    e["value"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        assert!(
            env.contains(&("ROOKWORLD_CONFIG".into(), "/etc/rookworld/run.toml".into())),
            "{key}: the run file"
        );
        let run_volume = pod["spec"]["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .any(|v| v["configMap"]["name"].as_str() == Some("rookworld-run"));
        assert!(run_volume, "{key}: mounts the run file's ConfigMap");
        let ports: BTreeMap<String, String> = container["ports"]
            .as_vec()
            .unwrap()
            .iter()
            .map(|p| (s(&p["name"]), s(&p["containerPort"])))
            .collect();
        // kubelet's gRPC probes cannot speak TLS: the binary's own health check does.
        for probe in ["readinessProbe", "livenessProbe"] {
            let command: Vec<String> = container[probe]["exec"]["command"]
                .as_vec()
                .unwrap_or_else(|| panic!("{key}: {probe} is no exec probe"))
                .iter()
                .map(s)
                .collect();
            let url = format!("https://127.0.0.1:{}", ports["grpc"]);
            assert_eq!(command, [binary, "health", url.as_str()], "{key}: {probe}");
        }
        let env: BTreeMap<String, String> = container["env"]
            .as_vec()
            .unwrap()
            .iter()
            .map(|e| {
                let value = if e["value"].is_badvalue() {
                    String::new()
                } else {
                    s(&e["value"])
                };
                (s(&e["name"]), value)
            })
            .collect();
        for name in env.keys() {
            assert!(
                known[binary].contains(name) || name.starts_with("POD_"),
                "{key} sets {name}, which `{binary}` does not read"
            );
        }
        if let Some(file) = env.get("ROOKWORLD_TOKEN_FILE") {
            let volume = pod["spec"]["volumes"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| s(&v["secret"]["secretName"]) == secret)
                .unwrap_or_else(|| panic!("{key}: no token volume"));
            assert_eq!(s(&volume["secret"]["secretName"]), secret);
            let mount = container["volumeMounts"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|m| m["name"] == volume["name"])
                .unwrap();
            let dir = s(&mount["mountPath"]);
            assert_eq!(
                file,
                &format!("{dir}/token"),
                "{key}: token file in the mount"
            );
        }
        // Mutual TLS from the Secret of its cert-manager Certificate, every URL https.
        let name = s(&w["metadata"]["name"]);
        let tls_secret = format!("rookworld-{name}-tls");
        let volume = pod["spec"]["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|v| v["secret"]["secretName"].as_str() == Some(tls_secret.as_str()))
            .unwrap_or_else(|| panic!("{key}: no volume of Secret {tls_secret}"));
        let mount = container["volumeMounts"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|m| m["name"] == volume["name"])
            .unwrap_or_else(|| panic!("{key}: {tls_secret} not mounted"));
        let dir = s(&mount["mountPath"]);
        for (var, file) in [
            ("ROOKWORLD_TLS_CERT", "tls.crt"),
            ("ROOKWORLD_TLS_KEY", "tls.key"),
            ("ROOKWORLD_TLS_CLIENT_CA", "ca.crt"),
            ("ROOKWORLD_TLS_CA", "ca.crt"),
            ("ROOKWORLD_TLS_CLIENT_CERT", "tls.crt"),
            ("ROOKWORLD_TLS_CLIENT_KEY", "tls.key"),
        ] {
            assert_eq!(env.get(var), Some(&format!("{dir}/{file}")), "{key}: {var}");
        }
        for (var, value) in &env {
            assert!(
                !value.contains("http://"),
                "{key}: {var}={value} is plaintext"
            );
        }
        let cert = &objects[&format!("Certificate/{tls_secret}")]["spec"];
        assert_eq!(s(&cert["secretName"]), tls_secret);
        let list = |y: &Yaml| -> Vec<String> { y.as_vec().unwrap().iter().map(s).collect() };
        let dns = list(&cert["dnsNames"]);
        assert!(
            dns.contains(&name) && dns.contains(&"localhost".to_owned()),
            "{key}: {dns:?}"
        );
        assert!(list(&cert["ipAddresses"]).contains(&"127.0.0.1".to_owned()));
        let usages = list(&cert["usages"]);
        assert!(usages.contains(&"server auth".into()) && usages.contains(&"client auth".into()));
        assert_eq!(s(&cert["issuerRef"]["name"]), "rookworld-ca");

        // A Service of the same name selects these pods by name port.
        let service = &objects[&format!("Service/{}", s(&w["metadata"]["name"]))];
        for (k, v) in service["spec"]["selector"].as_hash().unwrap() {
            assert_eq!(&labels[s(k).as_str()], v, "{key}: its Service selects it");
        }
        for port in service["spec"]["ports"].as_vec().unwrap() {
            let target = s(&port["targetPort"]);
            assert!(
                ports.contains_key(&target),
                "{key}: Service targetPort {target}"
            );
        }
    }
    // The learner keeps its run on a claim, mounted where the run directory points.
    let learner = &objects["StatefulSet/learner"];
    assert_eq!(
        s(&learner["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]),
        "data"
    );
    assert!(
        learner["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap()
            >= 80
    );
    // Workers are reached by the learner at their pod IP.
    let worker_env =
        &objects["Deployment/worker"]["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        worker_env
            .as_vec()
            .unwrap()
            .iter()
            .any(|e| s(&e["name"]) == "ROLLOUT_ADVERTISE" && s(&e["value"]).contains("$(POD_IP)"))
    );
}

/// Only workers reach the learner's queue, workers and the learner the reward server, the
/// learner the workers' push port; the metrics ports stay open to Prometheus.
#[test]
fn network_policies_let_each_port_be_reached_only_by_its_callers() {
    let objects = k8s_objects();
    let listed: Vec<String> = yaml("k8s/kustomization.yaml")[0]["resources"]
        .as_vec()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert!(listed.contains(&"network-policies.yaml".to_owned()));
    let callers = [
        ("learner", "50051", "9091", vec!["worker"]),
        ("reward-server", "50052", "9092", vec!["worker", "learner"]),
        ("worker", "50053", "9093", vec!["learner"]),
    ];
    for (name, grpc, metrics, from) in callers {
        let policy = &objects[&format!("NetworkPolicy/{name}")]["spec"];
        assert_eq!(
            s(&policy["podSelector"]["matchLabels"]["app.kubernetes.io/name"]),
            name
        );
        let types: Vec<String> = policy["policyTypes"]
            .as_vec()
            .unwrap()
            .iter()
            .map(s)
            .collect();
        assert_eq!(types, ["Ingress"]);
        let rules = policy["ingress"].as_vec().unwrap();
        assert_eq!(rules.len(), 2, "{name}: the gRPC rule and the metrics rule");
        let port_of = |r: &Yaml| s(&r["ports"][0]["port"]);
        let grpc_rule = rules.iter().find(|r| port_of(r) == grpc).unwrap();
        let mut got: Vec<String> = grpc_rule["from"]
            .as_vec()
            .unwrap_or_else(|| panic!("{name}: its gRPC port is open to all"))
            .iter()
            .map(|f| s(&f["podSelector"]["matchLabels"]["app.kubernetes.io/name"]))
            .collect();
        got.sort();
        let mut want: Vec<String> = from.iter().map(|f| f.to_string()).collect();
        want.sort();
        assert_eq!(got, want, "{name}: who reaches port {grpc}");
        let metrics_rule = rules.iter().find(|r| port_of(r) == metrics).unwrap();
        assert!(
            metrics_rule["from"].is_badvalue(),
            "{name}: Prometheus may scrape"
        );
    }
    // The learner checks the workers by the name their shared certificate carries.
    let learner = &objects["StatefulSet/learner"]["spec"]["template"]["spec"]["containers"][0];
    let push_name = learner["env"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|e| s(&e["name"]) == "LEARNER_PUSH_TLS_NAME")
        .map(|e| s(&e["value"]))
        .unwrap();
    let worker_cert = &objects["Certificate/rookworld-worker-tls"]["spec"]["dnsNames"];
    assert!(
        worker_cert
            .as_vec()
            .unwrap()
            .iter()
            .any(|d| s(d) == push_name),
        "{push_name} is not on the workers' certificate"
    );
}
