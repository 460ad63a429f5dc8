//! `agentrace epp` as a child process, on a config file of its own: what a gateway talks to
//! when the picker is a separate program (and stopping it is stopping a process).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

/// A running picker binary; killed when dropped.
pub struct EppProcess {
    /// The gRPC listener it announced.
    pub addr: SocketAddr,
    /// The admin listener it announced (`/metrics`, `/admin/*`).
    pub admin: SocketAddr,
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl EppProcess {
    /// Writes `toml` to a file and starts `agentrace epp --listen 127.0.0.1:0 --admin-listen
    /// 127.0.0.1:0 --config FILE`, waiting (up to 30 s) for its announcement.
    pub async fn spawn(toml: &str) -> EppProcess {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("epp.toml");
        std::fs::write(&config, toml).unwrap();
        // Its log stays beside its config, out of the test output.
        let log = std::fs::File::create(dir.path().join("epp.log")).unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"))
            .args([
                "epp",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--config")
            .arg(&config)
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("the agentrace binary starts");
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .expect("the picker announces its address within 30 s")
            .unwrap()
            .expect("the picker exited before listening");
        // "agentrace epp listening on ADDR (admin ADMIN)"
        let words: Vec<&str> = line.split_whitespace().collect();
        let parse = |i: usize| -> SocketAddr {
            assert!(
                line.starts_with("agentrace epp listening on ") && words.len() >= 7,
                "unexpected announcement: {line}"
            );
            words[i]
                .trim_end_matches(')')
                .parse()
                .unwrap_or_else(|_| panic!("unexpected announcement: {line}"))
        };
        EppProcess {
            addr: parse(4),
            admin: parse(6),
            child,
            _dir: dir,
        }
    }

    /// Its `/metrics`.
    pub async fn metrics(&self) -> String {
        String::from_utf8(super::sim::get(self.admin, "/metrics").await.body()).unwrap()
    }

    /// Kills this process (by its own handle) and waits until it has exited.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A picker config file over `endpoints` (`name`, address), probing every 250 ms with room
/// for a loaded machine (a probe may take 250 ms; three failures in a row mark an endpoint
/// down), with `[epp]` lines `epp` added.
pub fn config_toml(endpoints: &[(String, SocketAddr)], epp: &str) -> String {
    let mut toml = String::from(
        "[health]\ninterval_ms = 250\ntimeout_ms = 250\nunhealthy_threshold = 3\nhealthy_threshold = 1\n\n[epp]\n",
    );
    toml.push_str(epp);
    for (name, addr) in endpoints {
        toml.push_str(&format!(
            "\n[[backends]]\nname = \"{name}\"\nurl = \"http://{addr}\"\n"
        ));
    }
    toml
}
