//! The Kubernetes manifests.

use std::collections::BTreeMap;

use yaml_rust2::Yaml;

use crate::{deploy, known_env, s, yaml};

/// Every Kubernetes object of the manifests, by `kind/name`.
fn k8s_objects() -> BTreeMap<String, Yaml> {
    let mut objects = BTreeMap::new();
    for file in [
        "namespace.yaml",
        "token-secret.yaml",
        "reward-server.yaml",
        "learner.yaml",
        "worker.yaml",
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
        let ports: BTreeMap<String, String> = container["ports"]
            .as_vec()
            .unwrap()
            .iter()
            .map(|p| (s(&p["name"]), s(&p["containerPort"])))
            .collect();
        for probe in ["readinessProbe", "livenessProbe"] {
            let port = s(&container[probe]["grpc"]["port"]);
            assert_eq!(ports.get("grpc"), Some(&port), "{key}: {probe}");
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
                .find(|v| !v["secret"].is_badvalue())
                .unwrap_or_else(|| panic!("{key}: no secret volume"));
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
