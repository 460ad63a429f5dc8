//! llama.cpp's `llama-server` as a test backend: found where `scripts/real-engine.sh` put it,
//! started on `127.0.0.1:0` with the tiny random-weight model, and killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The server binary and the model, from `AGENTRACE_LLAMA_SERVER` / `AGENTRACE_TINY_GGUF` or
/// the `env` file the script writes in its cache; `None` (with a visible skip line) if absent,
/// unless `AGENTRACE_REQUIRE_REAL_ENGINE` is set (as CI sets it): then the test fails.
pub fn artefacts(test: &str) -> Option<(PathBuf, PathBuf)> {
    let from_env = || {
        Some((
            PathBuf::from(std::env::var_os("AGENTRACE_LLAMA_SERVER")?),
            PathBuf::from(std::env::var_os("AGENTRACE_TINY_GGUF")?),
        ))
    };
    let from_cache = || {
        let cache = std::env::var_os("AGENTRACE_ENGINE_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                let base = std::env::var_os("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .or_else(|| Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache")))?;
                Some(base.join("agentrace").join("real-engine"))
            })?;
        let text = std::fs::read_to_string(cache.join("env")).ok()?;
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .map(PathBuf::from)
        };
        Some((get("AGENTRACE_LLAMA_SERVER")?, get("AGENTRACE_TINY_GGUF")?))
    };
    match from_env().or_else(from_cache) {
        Some((server, model)) if server.is_file() && model.is_file() => Some((server, model)),
        _ if std::env::var_os("AGENTRACE_REQUIRE_REAL_ENGINE").is_some() => panic!(
            "{test}: AGENTRACE_REQUIRE_REAL_ENGINE is set but no llama-server is built \
             (scripts/real-engine.sh, or AGENTRACE_LLAMA_SERVER and AGENTRACE_TINY_GGUF)"
        ),
        _ => {
            super::skip(
                test,
                "no llama-server built (run scripts/real-engine.sh, or set \
                 AGENTRACE_LLAMA_SERVER and AGENTRACE_TINY_GGUF)",
            );
            None
        }
    }
}

/// A running `llama-server`.
pub struct Engine {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Engine {
    /// Starts one server with `slots` parallel sequences and prompt caching on, and waits
    /// until it says it listens and its `/health` answers 200.
    pub async fn start(server: &std::path::Path, model: &std::path::Path, slots: usize) -> Self {
        Self::start_with(server, model, slots, &[]).await
    }

    /// As [`Engine::start`], with `extra` flags for the server (e.g. `--ignore-eos`).
    pub async fn start_with(
        server: &std::path::Path,
        model: &std::path::Path,
        slots: usize,
        extra: &[&str],
    ) -> Self {
        let mut child = Command::new(server)
            .args(["--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0", "--jinja", "--metrics"])
            .args(["--ctx-size", &(8192 * slots).to_string()])
            .args(["--parallel", &slots.to_string(), "--threads", "1"])
            .args(["--alias", "tiny"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("llama-server starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).split(b'\n') {
                let Ok(line) = line else { break };
                let line = String::from_utf8_lossy(&line);
                let addr = line
                    .split("listening on http://")
                    .nth(1)
                    .and_then(|a| a.trim().parse::<SocketAddr>().ok());
                if let Some(addr) = addr {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
                // Keep draining so the server never blocks on a full pipe.
            }
        });
        let addr = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(60)))
            .await
            .unwrap()
            .unwrap_or_else(|e| {
                panic!(
                    "llama-server printed no address ({e}); exit: {:?}",
                    child.try_wait()
                )
            });
        let engine = Engine { child, addr };
        let client = super::capture::client();
        let health = format!("http://{addr}/health");
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let req = http::Request::get(&health)
                    .body(http_body_util::Full::new(bytes::Bytes::new()))
                    .unwrap();
                if let Ok(resp) = client.request(req).await {
                    if resp.status() == 200 {
                        return;
                    }
                }
                // The model loads in the background; /health says 503 until then.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("llama-server healthy within 60 s");
        engine
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}
