//! `agentrace proxy` as a child process: what the allocator, signals and `kill -9` do can
//! only be seen in the real binary, not in a proxy started inside the test.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};

/// A running proxy binary and the addresses it announced.
pub struct ProxyProcess {
    pub child: Child,
    pub pid: u32,
    pub addr: String,
    pub admin: String,
    /// The rest of its standard output.
    pub stdout: Lines<BufReader<ChildStdout>>,
}

impl ProxyProcess {
    /// Starts `agentrace proxy --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 ARGS` and
    /// waits (up to 30 s) for its announcement.
    pub async fn spawn(args: &[&str]) -> ProxyProcess {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentrace"));
        command
            .args([
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .args(args);
        ProxyProcess::start(command).await
    }

    /// Starts `command` (the binary with its arguments, set up as the test needs: flags
    /// before `proxy`, piped stderr, limits) and waits (up to 30 s) for its announcement.
    pub async fn start(mut command: tokio::process::Command) -> ProxyProcess {
        let mut child = command
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the agentrace binary starts");
        let pid = child.id().expect("a running child");
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .expect("the proxy announces its addresses within 30 s")
            .unwrap()
            .expect("the proxy exited before listening");
        // "agentrace proxy listening on ADDR (admin ADMIN)"
        let words: Vec<&str> = line.split_whitespace().collect();
        assert!(
            line.starts_with("agentrace proxy listening on ") && words.len() >= 7,
            "unexpected announcement: {line}"
        );
        ProxyProcess {
            pid,
            addr: words[4].to_string(),
            admin: words[6].trim_end_matches(')').to_string(),
            child,
            stdout,
        }
    }

    /// The process's resident memory now, KiB (`VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .expect("the proxy process is alive");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }
}
