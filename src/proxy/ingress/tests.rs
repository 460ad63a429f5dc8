//! The ingress against a real proxy and backend over an in-memory client connection.

use super::*;
use std::task::Context;
use tokio::io::{AsyncReadExt, DuplexStream, ReadBuf};
use tokio::net::TcpListener;

/// A client connection that keeps a copy of each write the proxy makes to it.
struct RecordingIo {
    io: DuplexStream,
    writes: Arc<parking_lot::Mutex<Vec<Vec<u8>>>>,
}

impl Arrivals for RecordingIo {}

impl AsyncRead for RecordingIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for RecordingIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let written = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = written {
            this.writes.lock().push(buf[..n].to_vec());
        }
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // One write, as a socket's writev would be.
        let joined: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.poll_write(cx, &joined)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// Reads from the client's side until `needle` has arrived, failing after 10 s.
/// A one-worker proxy in front of the backend at `backend_addr`, without health probes.
fn one_backend(backend_addr: std::net::SocketAddr) -> super::super::config::ProxyConfig {
    super::super::config::ProxyConfig::from_toml_str(&format!(
        "listen = \"127.0.0.1:0\"\nworkers = 1\n[admin]\nlisten = \"127.0.0.1:0\"\n\
         [health]\ninterval_ms = 0\n[[backends]]\nname = \"a\"\nurl = \"http://{backend_addr}\"\n"
    ))
    .unwrap()
}

/// A client connection served by `proxy`'s ingress, `capacity` bytes each way, and the
/// writes the proxy makes to it.
fn client_of(
    proxy: &super::super::ProxyHandle,
    shutdown: crate::shutdown::Shutdown,
    capacity: usize,
) -> (DuplexStream, Arc<parking_lot::Mutex<Vec<Vec<u8>>>>) {
    let writes = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (client, proxy_side) = tokio::io::duplex(capacity);
    let io = RecordingIo {
        io: proxy_side,
        writes: writes.clone(),
    };
    // Never bound: the in-memory client has no port; only the address's IP is forwarded.
    let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    tokio::spawn(serve(
        io,
        BytesMut::new(),
        proxy.inner.clone(),
        Arc::new(ClientConn::new(peer, false, 0)),
        shutdown,
        Instant::now(),
        None,
    ));
    (client, writes)
}

/// Reads a request head the proxy sends the backend.
async fn read_head(s: &mut tokio::net::TcpStream) {
    let mut head = Vec::new();
    while !contains(&head, "\r\n\r\n") {
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the proxy closed before sending a head");
        head.extend_from_slice(&buf[..n]);
    }
}

async fn read_until(client: &mut DuplexStream, got: &mut Vec<u8>, needle: &str) {
    let wait = async {
        while !contains(got, needle) {
            let mut buf = [0u8; 4096];
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "the proxy closed before {needle:?} arrived");
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{needle:?} did not arrive; got {:?}",
                String::from_utf8_lossy(got)
            )
        });
}

#[tokio::test]
async fn events_that_arrived_together_reach_the_client_in_one_write_and_none_waits_for_the_next() {
    let events = [
        "data: one\n\n",
        "data: two\n\n",
        "data: three\n\n",
        "data: four\n\n",
    ];
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut s, _) = backend.accept().await.unwrap();
        read_head(&mut s).await;
        // Three events in one write, as a backend's burst reaches the proxy in one read.
        let burst = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{}{}{}",
            chunk(events[0]),
            chunk(events[1]),
            chunk(events[2])
        );
        s.write_all(burst.as_bytes()).await.unwrap();
        let _ = released.await;
        s.write_all(format!("{}0\r\n\r\n", chunk(events[3])).as_bytes())
            .await
            .unwrap();
        let _ = s.read(&mut [0u8; 64]).await;
    });

    let config = one_backend(backend_addr);
    let (_trigger, shutdown) = crate::shutdown::channel();
    let proxy = super::super::start(config, shutdown.clone()).await.unwrap();
    let (mut client, writes) = client_of(&proxy, shutdown, 1 << 20);

    client
        .write_all(b"GET /v1/stream HTTP/1.1\r\nhost: agentrace\r\nx-session-id: s\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    read_until(&mut client, &mut got, events[2]).await;
    {
        let writes = writes.lock();
        assert_eq!(
            writes.len(),
            1,
            "the three events read together went out in {} writes",
            writes.len()
        );
        assert!(
            contains(&writes[0], "HTTP/1.1 200"),
            "the head leads the first write"
        );
        for event in &events[..3] {
            assert!(
                contains(&writes[0], event),
                "{event:?} missing from the first write"
            );
        }
    }
    // The fourth is only written once the client has the first three.
    release.send(()).unwrap();
    read_until(&mut client, &mut got, "0\r\n\r\n").await;
    let text = String::from_utf8_lossy(&got);
    let at: Vec<usize> = events.iter().map(|e| text.find(e).unwrap()).collect();
    assert!(
        at.windows(2).all(|w| w[0] < w[1]),
        "events out of order: {text}"
    );
}

/// Notes when each exchange it sees ended.
struct EndTimes(Arc<parking_lot::Mutex<Vec<Instant>>>);

struct EndTime(Arc<parking_lot::Mutex<Vec<Instant>>>);

impl crate::tap::ExchangeSink for EndTimes {
    fn start(&self, _: crate::tap::ExchangeStart) -> Box<dyn crate::tap::ExchangeObserver> {
        Box::new(EndTime(self.0.clone()))
    }
}

impl crate::tap::ExchangeObserver for EndTime {
    fn response_head(&mut self, _: StatusCode, _: &http::HeaderMap, _: Instant) {}
    fn response_frame(&mut self, _: &bytes::Bytes, _: Instant) {}
    fn end(self: Box<Self>, _: crate::tap::ExchangeEnd, at: Instant) {
        self.0.lock().push(at);
    }
}

// A response ends when the client connection has written its last bytes, not when they
// were handed to it: a body that arrives whole while the client is not reading ends only
// once the client has taken it (the wait the recorder computes before the next turn starts
// there).
#[tokio::test]
async fn a_response_ends_when_its_last_bytes_are_written_not_when_handed_on() {
    let body = "x".repeat(4096);
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::spawn(async move {
        let (mut s, _) = backend.accept().await.unwrap();
        read_head(&mut s).await;
        s.write_all(answer.as_bytes()).await.unwrap();
        let _ = s.read(&mut [0u8; 64]).await;
    });
    let config = one_backend(backend_addr);
    let ends = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (_trigger, shutdown) = crate::shutdown::channel();
    let proxy =
        super::super::start_with_sink(config, shutdown.clone(), Arc::new(EndTimes(ends.clone())))
            .await
            .unwrap();
    // Room for the head and a little of the body: the rest waits for the client.
    let (mut client, _) = client_of(&proxy, shutdown, 256);
    client
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: agentrace\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    read_until(&mut client, &mut got, "\r\n\r\n").await;
    // The client takes a while before reading the body.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(ends.lock().is_empty(), "ended before the body was written");
    let resumed = Instant::now();
    read_until(&mut client, &mut got, &body).await;
    // The end is reported once the last write completed, after the client read again.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(&end) = ends.lock().first() {
                return end;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the exchange ended");
    assert!(
        end >= resumed,
        "ended {:?} before the client read the body",
        resumed - end
    );
}
