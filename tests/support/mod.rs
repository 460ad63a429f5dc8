//! Shared fixtures for the integration tests: real servers on `127.0.0.1:0`, never mocks.
//! Each test binary uses a subset, so unused items are expected here.
#![allow(dead_code)]

pub mod backends;
pub mod capture;
pub mod dataset;
pub mod docs;
pub mod engine;
pub mod envoy;
pub mod epp;
pub mod epp_process;
pub mod proxy_process;
pub mod raw_h2;
pub mod raw_http1;
pub mod replay;
pub mod sim;
pub mod truth;
pub mod wire_server;

/// Says that `test` skipped, and why, where a reader of `cargo test` output sees it. The test
/// harness captures `print!` and `eprint!` and shows them only for failing tests, so a skip
/// reported that way is invisible; this writes to the process's stderr directly, one line per
/// skip, beside the harness's own `test … ok`.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped {test}: {why}");
}

/// A loopback address nothing answers on, as `http://…`, held unanswered while the socket
/// lives: bound but never listening, so a connect is refused and no other server, in this
/// test binary or another, can take the port meanwhile (a port freed at once can be).
pub fn refusing_address() -> (socket2::Socket, String) {
    let (socket, addr) = refusing_socket_addr();
    (socket, format!("http://{addr}"))
}

/// [`refusing_address`] as a socket address, for configurations that take one.
pub fn refusing_socket_addr() -> (socket2::Socket, std::net::SocketAddr) {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    socket.bind(&any.into()).unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    (socket, addr)
}
