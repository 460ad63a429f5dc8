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
