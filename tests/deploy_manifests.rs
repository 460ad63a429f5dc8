//! The Kubernetes manifests under `config/k8s/` parse, fit together (ports, names, selectors),
//! and carry a proxy configuration that agentrace accepts.

use std::path::Path;

use agentrace::proxy::ProxyConfig;
use serde_yaml::Value;

fn manifest(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/k8s")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for key in path {
        cur = &cur[*key];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("missing string at {}", path.join(".")))
}

#[test]
fn manifests_parse_with_the_expected_kinds() {
    for (file, kind) in [
        ("deployment.yaml", "Deployment"),
        ("service.yaml", "Service"),
        ("configmap.yaml", "ConfigMap"),
        ("servicemonitor.yaml", "ServiceMonitor"),
    ] {
        let m = manifest(file);
        assert_eq!(str_at(&m, &["kind"]), kind, "{file}");
        assert_eq!(
            str_at(&m, &["metadata", "name"]),
            "agentrace-proxy",
            "{file}"
        );
    }
}

#[test]
fn configmap_holds_a_valid_proxy_config_matching_the_ports() {
    let cm = manifest("configmap.yaml");
    let config = ProxyConfig::from_toml_str(str_at(&cm, &["data", "proxy.toml"]))
        .expect("the ConfigMap's proxy.toml must load");
    config
        .validate()
        .expect("the ConfigMap's proxy.toml must validate");
    assert!(config.backends.len() >= 2);

    let deployment = manifest("deployment.yaml");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let port = |name: &str| {
        container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("container port {name} missing"))
    };
    assert_eq!(port("http"), u64::from(config.listen.port()));
    assert_eq!(port("admin"), u64::from(config.admin.listen.port()));
    let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap();
    assert!(
        grace > config.shutdown_grace_secs,
        "pods must outlive the proxy's drain"
    );
    assert_eq!(
        str_at(
            &deployment,
            &["spec", "selector", "matchLabels", "app.kubernetes.io/name"]
        ),
        str_at(
            &deployment,
            &[
                "spec",
                "template",
                "metadata",
                "labels",
                "app.kubernetes.io/name"
            ]
        )
    );
}

#[test]
fn service_and_monitor_point_at_the_admin_port() {
    let service = manifest("service.yaml");
    let names: Vec<&str> = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(names.contains(&"http") && names.contains(&"admin"));
    let monitor = manifest("servicemonitor.yaml");
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"].as_str(), Some("admin"));
    assert_eq!(endpoint["path"].as_str(), Some("/metrics"));
}

/// The container named `name` among a pod spec's containers and init containers.
fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    ["containers", "initContainers"]
        .iter()
        .filter_map(|k| pod[*k].as_sequence())
        .flatten()
        .find(|c| c["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn capture_dir_arg(proxy: &Value) -> &str {
    let args: Vec<&str> = proxy["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let at = args
        .iter()
        .position(|a| *a == "--capture")
        .expect("--capture");
    args[at + 1]
}

fn mount<'a>(c: &'a Value, volume: &str) -> &'a Value {
    c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str() == Some(volume))
        .unwrap_or_else(|| panic!("no mount of {volume}"))
}

fn has_pod_name_env(c: &Value) -> bool {
    c["env"].as_sequence().is_some_and(|env| {
        env.iter().any(|e| {
            e["name"].as_str() == Some("POD_NAME")
                && e["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("metadata.name")
        })
    })
}

/// Seconds of an rclone duration such as `90s` or `2m`.
fn seconds(d: &str) -> u64 {
    let (n, unit) = d.split_at(d.find(|c: char| !c.is_ascii_digit()).unwrap_or(d.len()));
    let n: u64 = n.parse().unwrap();
    match unit {
        "s" => n,
        "m" => n * 60,
        _ => panic!("unexpected duration {d}"),
    }
}

// The sidecar variant: the proxy records into a volume the rclone sidecar reads, the sidecar
// ships only segments older than the rotation age plus the flush interval (so only closed
// ones) under the pod's name, runs as a native sidecar (outlives the proxy and ships the last
// segment), and the pod outlives the proxy's drain.
#[test]
fn capture_sidecar_ships_only_closed_segments_under_the_pod_name() {
    let cm = manifest("configmap.yaml");
    let config = ProxyConfig::from_toml_str(str_at(&cm, &["data", "proxy.toml"])).unwrap();
    let closed_after = config.capture.rotate_age_secs + config.capture.flush_interval_ms / 1000 + 1;
    assert!(
        config.capture.rotate_age_secs <= 300,
        "segments wait too long to ship"
    );

    let d = manifest("deployment-capture-sidecar.yaml");
    assert_eq!(str_at(&d, &["kind"]), "Deployment");
    let pod = &d["spec"]["template"]["spec"];
    let proxy = container(pod, "proxy");
    let sidecar = container(pod, "ship-captures");
    assert_eq!(sidecar["restartPolicy"].as_str(), Some("Always"));
    let dir = capture_dir_arg(proxy);
    assert_eq!(str_at(mount(proxy, "captures"), &["mountPath"]), dir);
    assert_eq!(str_at(mount(sidecar, "captures"), &["mountPath"]), dir);
    assert!(pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|v| v["name"].as_str() == Some("captures") && v["emptyDir"].is_mapping()));
    assert!(has_pod_name_env(sidecar));
    let script = sidecar["args"][0].as_str().unwrap();
    assert!(script.contains("rclone copy") && script.contains("$POD_NAME"));
    let min_age = script
        .split("--min-age ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("the periodic copy sets --min-age");
    assert!(
        seconds(min_age) > closed_after,
        "--min-age {min_age} must exceed rotate_age_secs + flush interval ({closed_after} s)"
    );
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() > config.shutdown_grace_secs);
}

// The shared-volume variant: one ReadWriteMany claim, each pod in its own sub-directory named
// after the pod, the proxy recording into that mount.
#[test]
fn capture_shared_volume_gives_each_pod_its_own_directory() {
    let pvc = manifest("capture-pvc.yaml");
    assert_eq!(str_at(&pvc, &["kind"]), "PersistentVolumeClaim");
    let modes: Vec<&str> = pvc["spec"]["accessModes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(modes, ["ReadWriteMany"]);
    let d = manifest("deployment-capture-shared.yaml");
    let pod = &d["spec"]["template"]["spec"];
    let proxy = container(pod, "proxy");
    let m = mount(proxy, "captures");
    assert_eq!(str_at(m, &["mountPath"]), capture_dir_arg(proxy));
    assert_eq!(str_at(m, &["subPathExpr"]), "$(POD_NAME)");
    assert!(has_pod_name_env(proxy));
    let claim = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("captures"))
        .unwrap();
    assert_eq!(
        str_at(claim, &["persistentVolumeClaim", "claimName"]),
        str_at(&pvc, &["metadata", "name"])
    );
}

/// Every document of a multi-document manifest.
fn documents(name: &str) -> Vec<Value> {
    use serde::Deserialize as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/k8s")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

#[test]
fn the_inference_pool_names_the_epp_service_whose_pods_run_agentrace_epp_on_its_port() {
    let pool = manifest("epp-inferencepool.yaml");
    assert_eq!(str_at(&pool, &["kind"]), "InferencePool");
    assert_eq!(
        str_at(&pool, &["apiVersion"]),
        "inference.networking.k8s.io/v1"
    );
    assert!(!pool["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .unwrap()
        .is_empty());
    assert!(pool["spec"]["targetPorts"][0]["number"].as_u64().is_some());
    let picker = &pool["spec"]["endpointPickerRef"];
    let service = manifest("epp-service.yaml");
    assert_eq!(
        str_at(picker, &["name"]),
        str_at(&service, &["metadata", "name"])
    );
    let grpc = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .expect("a grpc service port");
    assert_eq!(picker["port"]["number"], grpc["port"]);

    let deployment = manifest("epp-deployment.yaml");
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        service["spec"]["selector"], pod["metadata"]["labels"],
        "the Service selects the picker's pods"
    );
    let container = &pod["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "epp");
    let listen = args[args.iter().position(|a| *a == "--listen").unwrap() + 1];
    let container_port = |name: &str| {
        container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap()
    };
    assert!(listen.ends_with(&format!(":{}", container_port("grpc"))));
    for (probe, service) in [
        ("readinessProbe", "readiness"),
        ("livenessProbe", "liveness"),
    ] {
        assert_eq!(container[probe]["grpc"]["service"], service, "{probe}");
        assert_eq!(
            container[probe]["grpc"]["port"].as_u64(),
            Some(container_port("grpc"))
        );
    }

    let cm = manifest("epp-configmap.yaml");
    let config = ProxyConfig::from_toml_str(str_at(&cm, &["data", "proxy.toml"]))
        .expect("the picker's proxy.toml must load");
    config.validate().unwrap();
    agentrace::epp::check_source(&config).expect("endpoints from one source");
    assert_eq!(
        container_port("admin"),
        u64::from(config.admin.listen.port())
    );
    let watched = config
        .epp
        .inference_pool
        .as_ref()
        .expect("the picker reads its endpoints from the InferencePool");
    assert_eq!(watched.name, str_at(&pool, &["metadata", "name"]));
    assert!(
        pool["metadata"]["namespace"].is_null() && watched.namespace.is_none(),
        "pool and picker in one namespace: the picker's own"
    );
}

#[test]
fn the_epp_service_account_may_only_read_pods_and_inference_pools() {
    let docs = documents("epp-rbac.yaml");
    let kinds: Vec<&str> = docs.iter().map(|d| str_at(d, &["kind"])).collect();
    assert_eq!(kinds, ["ServiceAccount", "Role", "RoleBinding"]);
    let deployment = manifest("epp-deployment.yaml");
    let account = str_at(
        &deployment,
        &["spec", "template", "spec", "serviceAccountName"],
    );
    assert_eq!(str_at(&docs[0], &["metadata", "name"]), account);
    for rule in docs[1]["rules"].as_sequence().unwrap() {
        let verbs: Vec<&str> = rule["verbs"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(verbs, ["get", "list", "watch"], "read-only");
    }
    let resources: Vec<&str> = docs[1]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r["resources"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
        })
        .collect();
    assert_eq!(resources, ["pods", "inferencepools"]);
    assert_eq!(
        str_at(&docs[2], &["roleRef", "name"]),
        str_at(&docs[1], &["metadata", "name"])
    );
    assert_eq!(docs[2]["subjects"][0]["name"].as_str(), Some(account));
}
