//! What the binary prints when it cannot start: the cause, once.

use std::process::Command;

/// A listen address already taken names the address and the OS's reason, and the reason
/// appears once, not once per layer of the error that carries it.
#[test]
fn a_taken_listen_address_prints_its_cause_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(["proxy", "--listen", &addr, "--admin-listen", "127.0.0.1:0"])
        .args(["--backend", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started on a taken address: {stderr}"
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line: {stderr}"));
    assert!(line.contains(&addr), "the address is not named: {line}");
    let reason = std::io::Error::from(std::io::ErrorKind::AddrInUse)
        .kind()
        .to_string();
    let times = line.matches("(os error 98)").count();
    assert_eq!(
        times, 1,
        "the cause ({reason}) is printed {times} times: {line}"
    );
}

/// Starts the binary with `args` and returns the first line it prints, then stops it (by its
/// PID); `None`, with what it wrote to stderr, if it exited without printing one.
fn first_line_of(args: &[&str]) -> Result<String, String> {
    use std::io::BufRead as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentrace"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    // Either the announcement arrives or the process exits, closing its stdout.
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    if line.is_empty() {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    } else {
        Ok(line)
    }
}

/// A config file without `[[backends]]` that writes `[affinity]` only.
fn config_without_backends() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "[affinity]\npolicy = \"session\"\n").unwrap();
    file
}

/// `--backend` replaces the file's backends, as `--help` says, so a file that has none is
/// complete once the flag is applied: validation comes after the flags.
#[test]
fn backend_flags_complete_a_proxy_config_file_without_backends() {
    let file = config_without_backends();
    let config = file.path().to_str().unwrap();
    let line = first_line_of(&[
        "proxy",
        "--config",
        config,
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--backend",
        "http://127.0.0.1:9",
    ])
    .unwrap_or_else(|stderr| panic!("the proxy refused the flags' backends: {stderr}"));
    assert!(line.starts_with("agentrace proxy listening on "), "{line}");
    // Without the flag the file is still refused, naming the field.
    let stderr = first_line_of(&["proxy", "--config", config]).unwrap_err();
    assert!(
        stderr.contains("backends: at least one backend"),
        "{stderr}"
    );
}

/// The endpoint picker reads the proxy's file and flags the same way.
#[test]
fn backend_flags_complete_an_epp_config_file_without_backends() {
    let file = config_without_backends();
    let line = first_line_of(&[
        "epp",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--config",
        file.path().to_str().unwrap(),
        "--backend",
        "http://127.0.0.1:9",
    ])
    .unwrap_or_else(|stderr| panic!("the picker refused the flags' backends: {stderr}"));
    assert!(line.starts_with("agentrace epp listening on "), "{line}");
}
