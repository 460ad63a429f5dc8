//! The configuration references cannot drift from the code: every key the proxy and the
//! recorder accept is in their reference tables (README.md, captures/README.md), and every
//! key those tables name is accepted.

use std::collections::BTreeSet;

use agentrace::capture::CaptureConfig;
use agentrace::proxy::ProxyConfig;

/// Dotted keys of a serialized config (tables flattened, arrays of tables skipped).
fn keys(value: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let toml::Value::Table(table) = value {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(_) => keys(v, &key, out),
                _ => {
                    out.insert(key);
                }
            }
        }
    }
}

/// Backticked keys in the first column of the markdown table that follows `heading`.
fn table_keys(doc: &str, heading: &str) -> BTreeSet<String> {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    let mut out = BTreeSet::new();
    let mut in_table = false;
    for line in doc[start..].lines().skip(1) {
        if line.starts_with('|') {
            in_table = true;
            let first = line.split('|').nth(1).unwrap_or("");
            for part in first.split('`').skip(1).step_by(2) {
                out.insert(part.to_string());
            }
        } else if in_table {
            break;
        }
    }
    out
}

#[test]
fn proxy_reference_table_lists_exactly_the_proxy_keys() {
    let readme = include_str!("../README.md");
    let documented = table_keys(readme, "### Config reference");
    let mut accepted = BTreeSet::new();
    keys(
        &toml::Value::try_from(ProxyConfig::default()).unwrap(),
        "",
        &mut accepted,
    );
    // Sections documented elsewhere or optional tables with no default.
    accepted.retain(|k| !k.starts_with("capture.") && k != "backends");
    let optional = [
        "tls.cert_file",
        "tls.key_file",
        "admin.token",
        "admin.token_file",
        "upstream.ca_file",
        "epp.inference_pool.name",
        "epp.inference_pool.namespace",
        "epp.inference_pool.api_server",
        "epp.inference_pool.token_file",
        "epp.inference_pool.ca_file",
        "epp.inference_pool.max_pods",
        "epp.inference_pool.max_event_bytes",
    ];
    for key in &accepted {
        assert!(
            documented.contains(key),
            "README config reference lacks `{key}`"
        );
    }
    for key in &documented {
        let known = accepted.contains(key)
            || optional.contains(&key.as_str())
            || key.starts_with("[[backends]]")
            || ["name", "url", "weight", "[capture]"].contains(&key.as_str());
        assert!(
            known,
            "README config reference names `{key}`, which the proxy does not accept"
        );
        if optional.contains(&key.as_str()) || key.contains('.') {
            let (section, field) = key.split_once('.').unwrap_or(("", key));
            let snippet = match (section, field) {
                ("tls", _) => continue,
                (s, "token") => format!("[{s}]\ntoken = \"t0ken\"\n"),
                (s, "token_file") => format!("[{s}]\ntoken_file = \"/tmp/x\"\n"),
                (s, "ca_file") => format!("[{s}]\nca_file = \"/tmp/ca.pem\"\n"),
                _ => continue,
            };
            let snippet =
                format!("{snippet}[[backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\n");
            ProxyConfig::from_toml_str(&snippet)
                .unwrap_or_else(|e| panic!("`{key}` is documented but rejected: {e}"));
        }
    }
}

#[test]
fn capture_reference_table_lists_exactly_the_recorder_keys() {
    let doc = include_str!("../captures/README.md");
    let documented = table_keys(doc, "## Recorder settings");
    let mut accepted = BTreeSet::new();
    keys(
        &toml::Value::try_from(CaptureConfig::default()).unwrap(),
        "",
        &mut accepted,
    );
    assert_eq!(
        documented, accepted,
        "captures/README.md drifted from CaptureConfig"
    );
}
