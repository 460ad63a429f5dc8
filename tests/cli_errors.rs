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
