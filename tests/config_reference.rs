//! The configuration reference cannot drift from the code: every key the proxy and the
//! recorder accept is in the tables of `docs/src/reference/proxy-config.md`, every key those
//! tables name is accepted, and each Default cell states the default the code has.

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

const PAGE: &str = include_str!("../docs/src/reference/proxy-config.md");

/// The sections of the page whose tables hold the proxy's own keys (dotted, from the top).
const PROXY_SECTIONS: [&str; 10] = [
    "## Top level",
    "## tls",
    "## client",
    "## admin",
    "## upstream",
    "## affinity",
    "## health",
    "## backends",
    "## Other sections",
    "## epp",
];

/// `(keys, default cell)` of each row of the markdown table that follows `heading`.
fn table_rows(doc: &str, heading: &str) -> Vec<(Vec<String>, String)> {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?}"));
    let mut rows = Vec::new();
    let mut in_table = false;
    for line in doc[start + 1..].lines().skip(1) {
        if line.starts_with('|') {
            in_table = true;
            let cells: Vec<&str> = line.split('|').collect();
            let keys = cells[1]
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            rows.push((keys, cells.get(2).unwrap_or(&"").trim().to_string()));
        } else if in_table {
            break;
        }
    }
    rows
}

/// Backticked keys in the first column of the markdown table that follows `heading`.
fn table_keys(doc: &str, heading: &str) -> BTreeSet<String> {
    table_rows(doc, heading)
        .into_iter()
        .flat_map(|(keys, _)| keys)
        .collect()
}

/// Dotted key → the default as the table writes it (a string without its quotes).
fn defaults(value: &toml::Value, prefix: &str, out: &mut Vec<(String, String)>) {
    if let toml::Value::Table(table) = value {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(_) => defaults(v, &key, out),
                toml::Value::String(s) => out.push((key, s.clone())),
                toml::Value::Array(_) => {}
                other => out.push((key, other.to_string())),
            }
        }
    }
}

/// Every scalar default of `config` is the first code span of its row's Default cell.
fn check_defaults(config: toml::Value, prefix: &str, doc: &str, heading: &str) {
    let rows = table_rows(doc, heading);
    let mut values = Vec::new();
    defaults(&config, "", &mut values);
    let mut wrong = Vec::new();
    for (key, value) in values {
        let Some((_, cell)) = rows
            .iter()
            .find(|(keys, _)| keys.len() == 1 && keys[0] == key)
        else {
            continue;
        };
        let stated = cell.split('`').nth(1);
        // An empty string default is written as what it stands for (e.g. the host name).
        if value.is_empty() && stated.is_none_or(|s| s == "\"\"") {
            continue;
        }
        let same_number = matches!(
            (stated.map(str::parse::<f64>), value.parse::<f64>()),
            (Some(Ok(a)), Ok(b)) if a == b
        );
        if stated != Some(value.as_str()) && !same_number {
            wrong.push(format!(
                "`{prefix}{key}`: the code's default is `{value}`, the page says {cell:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{heading}: wrong defaults:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn proxy_reference_table_lists_exactly_the_proxy_keys() {
    let documented: BTreeSet<String> = PROXY_SECTIONS
        .iter()
        .flat_map(|h| table_keys(PAGE, h))
        .collect();
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
            "the config reference lacks `{key}`"
        );
    }
    for key in &documented {
        let known = accepted.contains(key)
            || optional.contains(&key.as_str())
            || key.starts_with("[[backends]]")
            || ["name", "url", "weight", "[capture]", "[epp]"].contains(&key.as_str());
        assert!(
            known,
            "the config reference names `{key}`, which the proxy does not accept"
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
    let documented = table_keys(PAGE, "## capture");
    let mut accepted = BTreeSet::new();
    keys(
        &toml::Value::try_from(CaptureConfig::default()).unwrap(),
        "",
        &mut accepted,
    );
    assert_eq!(
        documented, accepted,
        "the [capture] table drifted from CaptureConfig"
    );
}

#[test]
fn reference_defaults_are_the_code_defaults() {
    let proxy = toml::Value::try_from(ProxyConfig::default()).unwrap();
    for heading in PROXY_SECTIONS {
        check_defaults(proxy.clone(), "", PAGE, heading);
    }
    let capture = toml::Value::try_from(CaptureConfig::default()).unwrap();
    check_defaults(capture, "capture.", PAGE, "## capture");
}

/// Dotted keys a TOML file sets, commented-out `# key = …` lines of its top level included.
fn file_keys(path: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let mut out = BTreeSet::new();
    keys(&toml::from_str::<toml::Value>(&text).unwrap(), "", &mut out);
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(s) = line.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = format!("{s}.");
        } else if let Some(rest) = line.strip_prefix("# ") {
            let word = rest.split(" = ").next().unwrap_or("");
            if rest.contains(" = ") && word.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                out.insert(format!("{section}{word}"));
            }
        }
    }
    out
}

#[test]
fn replay_reference_lists_exactly_the_replay_keys_and_real_flags() {
    let page = include_str!("../docs/src/reference/replay-config.md");
    let rows: Vec<(String, String)> = page
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (cells[1].trim_matches('`').to_string(), cells[2].to_string())
        })
        .collect();
    let documented: BTreeSet<String> = rows.iter().map(|(k, _)| k.clone()).collect();
    let mut accepted = BTreeSet::new();
    let default = toml::Value::try_from(agentrace::replay::ReplayConfig::default()).unwrap();
    for key in default.as_table().unwrap().keys() {
        accepted.insert(key.clone());
    }
    // Options with no default are left out of the serialized default.
    let optional = [
        "dataset",
        "model",
        "model_name",
        "model_params",
        "num_trajectories",
        "api_key_env",
        "accuracy_threshold",
        "osl_band",
        "slo",
        "gpus",
    ];
    accepted.extend(optional.iter().map(|k| k.to_string()));
    assert_eq!(
        documented, accepted,
        "replay-config.md drifted from ReplayConfig"
    );
    for file in ["config/replay-qwen.toml", "config/replay-kimi.toml"] {
        for key in file_keys(file) {
            assert!(
                documented.contains(&key),
                "{file} sets `{key}`, which the page lacks"
            );
        }
    }
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["replay", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for (key, flag) in rows {
        let Some(flag) = flag.split('`').nth(1) else {
            assert!(flag == "file only", "`{key}`: flag cell {flag:?}");
            continue;
        };
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "`{key}`: `agentrace replay` has no {flag}"
        );
    }
}

#[test]
fn sim_reference_lists_every_key_of_the_example_files() {
    let page = include_str!("../docs/src/reference/sim-config.md");
    for file in [
        "config/sim-h100.toml",
        "config/sim-h200-demo.toml",
        "config/sim-faults.toml",
    ] {
        for key in file_keys(file) {
            assert!(
                page.contains(&format!("| `{key}` |")),
                "{file} sets `{key}`, which sim-config.md lacks"
            );
        }
    }
}
