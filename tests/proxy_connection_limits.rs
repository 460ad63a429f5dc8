//! The listener's own limits, through a real proxy and backend on `127.0.0.1:0`.
//!
//! Invariants: the listening socket's accept queue is `listen_backlog` long (capped by the
//! kernel's `somaxconn`), not the 128 a plain bind asks for, so a connect burst is queued
//! rather than dropped; at most `client.max_connections` client connections are open at once,
//! one more gets a `503` with `Retry-After` and `Connection: close` and is closed without being
//! served (counted in `agentrace_client_connections_refused_total{reason="max_connections"}`),
//! the held ones keep working, and once one closes a new one is served again.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::backends::*;
use support::raw_http1::*;

/// Sum of `agentrace_worker_connections` over the workers: client connections open now.
fn open_connections(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("agentrace_worker_connections{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn counter(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

const REFUSED: &str = "agentrace_client_connections_refused_total{reason=\"max_connections\"}";

#[tokio::test]
async fn a_connection_over_max_connections_gets_503_and_the_cap_frees_as_one_closes() {
    let backend = TestBackend::spawn("b").await;
    let mut config = config_for(&[&backend]);
    config.client.max_connections = 3;
    config.workers = 2;
    let proxy = start_proxy(config).await;

    // Three held connections, each served once (so each is counted open).
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut client = Client::connect(proxy.addr).await;
        client.send(get("/v1/models")).await;
        assert_eq!(client.reply().await.status, 200);
        held.push(client);
    }

    // The fourth is answered at once, without a request, and closed.
    let mut over = Client::connect(proxy.addr).await;
    let reply = over.reply().await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.header("retry-after").as_deref(), Some("1"));
    assert_eq!(reply.header("connection").as_deref(), Some("close"));
    assert_eq!(reply.json()["error"]["type"], "overloaded");
    over.assert_closed().await;
    let metrics = proxy.metrics().await;
    assert_eq!(counter(&metrics, REFUSED), 1.0);
    assert_eq!(
        open_connections(&metrics),
        3.0,
        "the refused one is not counted"
    );

    // The held connections are unaffected.
    for client in &mut held {
        client.send(get("/v1/models")).await;
        assert_eq!(client.reply().await.status, 200);
    }

    // One closes; once the proxy has seen it go, a new connection is served.
    drop(held.pop());
    guarded("the closed connection to be let go", async {
        while open_connections(&proxy.metrics().await) != 2.0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let mut again = Client::connect(proxy.addr).await;
    again.send(get("/v1/models")).await;
    assert_eq!(again.reply().await.status, 200);
    assert_eq!(counter(&proxy.metrics().await, REFUSED), 1.0);
    proxy.shutdown().await;
}

/// The accept queue's length as the kernel holds it: for a listening socket, sock_diag's
/// `idiag_wqueue` is its `sk_max_ack_backlog` (what `ss -lnt` shows as Send-Q).
#[cfg(target_os = "linux")]
fn listen_backlog_of(addr: SocketAddr) -> u32 {
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const TCP_LISTEN: u32 = 10;
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // nlmsghdr, then inet_diag_req_v2: family, protocol, ext, pad, states, sockid (48 bytes).
    let mut request = [0u8; 16 + 56];
    let length = request.len() as u32;
    request[0..4].copy_from_slice(&length.to_ne_bytes());
    request[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request[6..8].copy_from_slice(&flags.to_ne_bytes());
    request[16] = family as u8;
    request[17] = libc::IPPROTO_TCP as u8;
    request[20..24].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    // SAFETY: plain socket calls on a descriptor this function owns, with buffers it owns.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        );
        assert!(
            fd >= 0,
            "netlink socket: {}",
            std::io::Error::last_os_error()
        );
        let mut kernel: libc::sockaddr_nl = std::mem::zeroed();
        kernel.nl_family = libc::AF_NETLINK as u16;
        let sent = libc::sendto(
            fd,
            request.as_ptr().cast(),
            request.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        assert_eq!(sent, request.len() as isize, "sock_diag request");
        let mut buf = vec![0u8; 64 * 1024];
        let mut found = None;
        'reading: loop {
            let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
            assert!(
                n > 0,
                "sock_diag reply: {}",
                std::io::Error::last_os_error()
            );
            let mut at = 0;
            while at + 16 <= n as usize {
                let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
                let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().unwrap());
                match kind {
                    NLMSG_DONE => break 'reading,
                    NLMSG_ERROR => panic!("sock_diag refused the request"),
                    _ => {}
                }
                // inet_diag_msg: family, state, timer, retrans, sockid (sport first, big
                // endian), expires, rqueue, wqueue.
                let msg = &buf[at + 16..at + len];
                let port = u16::from_be_bytes([msg[4], msg[5]]);
                if port == addr.port() {
                    found = Some(u32::from_ne_bytes(msg[60..64].try_into().unwrap()));
                }
                at += (len + 3) & !3;
            }
        }
        libc::close(fd);
        found.unwrap_or_else(|| panic!("no listening socket on {addr}"))
    }
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_listening_socket_queues_listen_backlog_connections() {
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let backend = TestBackend::spawn("b").await;
    for backlog in [None, Some(1234), Some(200)] {
        let mut config = config_for(&[&backend]);
        if let Some(backlog) = backlog {
            config.listen_backlog = backlog;
        }
        let expected = config.listen_backlog.min(somaxconn);
        let proxy = start_proxy(config).await;
        assert_eq!(
            listen_backlog_of(proxy.addr),
            expected,
            "listen_backlog {backlog:?} (somaxconn {somaxconn})"
        );
        proxy.shutdown().await;
    }
}
