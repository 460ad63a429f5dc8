//! The peers a proxy attack can also run against, in the same run: HAProxy and nginx in front
//! of the same backend, each configured as a user would put it before an inference server
//! (bodies up to the proxy's own limit, long timeouts). Their figures show what the attack
//! costs the machine itself, so agentrace's are read as a ratio to theirs.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

/// A peer's name as `--peer` takes it.
pub const NAMES: [&str; 2] = ["haproxy", "nginx"];

/// The attacks that make sense for a peer: plain HTTP/1.1 through a proxy, no agentrace
/// metrics or commands needed.
pub const ATTACKS: [&str; 6] = [
    "baseline",
    "early-413",
    "session-keys",
    "big-bodies",
    "slowloris",
    "idle-conns",
];

/// `name`'s binary on `PATH` (or the sbin directories Debian installs it in).
pub fn find(name: &str) -> PathBuf {
    assert!(
        NAMES.contains(&name),
        "--peer: no peer {name}; there are {}",
        NAMES.join(", ")
    );
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("--peer {name}: not installed (apt-get install -y {name})"))
}

/// Which peer `bin` is, if it is one.
pub fn of(bin: &Path) -> Option<&'static str> {
    let file = bin.file_name()?.to_str()?;
    NAMES.iter().copied().find(|n| *n == file)
}

/// The command line and config that start `peer` in the foreground, as one process, listening
/// on a free port of 127.0.0.1 and forwarding to `backend`.
pub fn command(
    peer: &str,
    bin: &Path,
    dir: &Path,
    backend: SocketAddr,
) -> (tokio::process::Command, SocketAddr) {
    let listen = free_port();
    let config = dir.join(format!("{peer}.conf"));
    let mut command = tokio::process::Command::new(bin);
    match peer {
        "haproxy" => {
            std::fs::write(&config, haproxy_config(listen, backend)).unwrap();
            command.arg("-db").arg("-f").arg(&config);
        }
        _ => {
            let root = dir.join("nginx");
            std::fs::create_dir_all(&root).unwrap();
            std::fs::write(&config, nginx_config(listen, backend, &root)).unwrap();
            command.arg("-p").arg(&root).arg("-c").arg(&config);
        }
    }
    (command, listen)
}

fn haproxy_config(listen: SocketAddr, backend: SocketAddr) -> String {
    format!(
        "global\n  maxconn 9000\n\
         defaults\n  mode http\n  timeout connect 5s\n  timeout client 120s\n  timeout server 120s\n  timeout http-request 120s\n\
         frontend bench\n  bind {listen}\n  default_backend backends\n\
         backend backends\n  http-reuse always\n  server b {backend}\n"
    )
}

/// nginx holds a request body whole before forwarding it (`proxy_request_buffering on`, its
/// default), as agentrace does, but on disk past `client_body_buffer_size`.
fn nginx_config(listen: SocketAddr, backend: SocketAddr, root: &Path) -> String {
    let root = root.display();
    format!(
        "daemon off;\nmaster_process off;\npid {root}/nginx.pid;\nerror_log {root}/error.log warn;\n\
         worker_rlimit_nofile 65536;\n\
         events {{ worker_connections 9000; }}\n\
         http {{\n  access_log off;\n  client_max_body_size 64m;\n  large_client_header_buffers 4 64k;\n\
           client_body_temp_path {root}/body;\n  proxy_temp_path {root}/proxy;\n\
           fastcgi_temp_path {root}/fastcgi;\n  uwsgi_temp_path {root}/uwsgi;\n  scgi_temp_path {root}/scgi;\n\
           upstream backends {{ server {backend}; keepalive 64; }}\n\
           server {{\n    listen {listen} backlog=4096;\n\
             location / {{ proxy_pass http://backends; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_read_timeout 120s; proxy_send_timeout 120s; }}\n  }}\n}}\n"
    )
}

/// A port free now; the peer binds it a moment later (peers cannot report a port they chose).
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}
