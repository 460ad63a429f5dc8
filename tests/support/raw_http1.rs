//! A raw HTTP/1 client and backend for tests that put exact bytes on the wire, where a
//! library client or server would refuse to produce them or would tidy up what they read.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentrace::proxy::ProxyConfig;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
/// Upper bound on any single wait: a hang guard, never a synchronisation point.
pub const GUARD: Duration = Duration::from_secs(10);

pub async fn guarded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("no progress within {GUARD:?}: {what}"))
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The value of `name` in a head's `name: value` lines (case-insensitive name).
pub fn header_in(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

// -------------------------------------------------------------------------------------------
// A raw HTTP/1 client

/// One response as read off the wire.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Status line and header lines, without the final blank line.
    pub head: String,
    /// The body with its transfer framing removed.
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<String> {
        header_in(&self.head, name)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&self.body)))
    }
}

/// A client connection that writes raw bytes and parses what comes back, minimally.
pub struct Client {
    pub stream: TcpStream,
    pub buf: Vec<u8>,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Self {
        Self {
            stream: guarded("connect", TcpStream::connect(addr)).await.unwrap(),
            buf: Vec::new(),
        }
    }

    /// A connection whose receive buffer holds only about `bytes`, so that a client which
    /// stops reading soon leaves the proxy unable to write.
    pub async fn connect_with_receive_buffer(addr: SocketAddr, bytes: u32) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(bytes).unwrap();
        Self {
            stream: guarded("connect", socket.connect(addr)).await.unwrap(),
            buf: Vec::new(),
        }
    }

    pub async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        guarded("write", self.stream.write_all(bytes.as_ref()))
            .await
            .expect("write to the proxy");
    }

    /// One read into the buffer; false at EOF.
    pub async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 16 * 1024];
        let n = guarded("read", self.stream.read(&mut chunk))
            .await
            .expect("read from the proxy");
        self.buf.extend_from_slice(&chunk[..n]);
        n > 0
    }

    /// Everything up to and including `delim`; fails at EOF.
    pub async fn take_through(&mut self, delim: &[u8]) -> Vec<u8> {
        loop {
            if let Some(at) = find(&self.buf, delim) {
                return self.buf.drain(..at + delim.len()).collect();
            }
            assert!(
                self.fill().await,
                "EOF before {:?}; had {:?}",
                text(delim),
                text(&self.buf)
            );
        }
    }

    pub async fn take_exact(&mut self, n: usize) -> Vec<u8> {
        while self.buf.len() < n {
            assert!(
                self.fill().await,
                "EOF {} bytes into a {n}-byte body",
                self.buf.len()
            );
        }
        self.buf.drain(..n).collect()
    }

    /// Reads one response head: (status, head without the blank line).
    pub async fn head(&mut self) -> (u16, String) {
        let raw = self.take_through(b"\r\n\r\n").await;
        let head = text(&raw[..raw.len() - 4]);
        assert!(
            head.starts_with("HTTP/1.1 "),
            "not a response head: {head:?}"
        );
        let status = head[9..12]
            .parse()
            .unwrap_or_else(|_| panic!("no status code in {head:?}"));
        (status, head)
    }

    /// Reads one response to a request other than HEAD.
    pub async fn reply(&mut self) -> Reply {
        self.reply_to(false).await
    }

    /// Reads one response, framed as RFC 9112 §6.3 says (`head_request`: it answers a HEAD).
    pub async fn reply_to(&mut self, head_request: bool) -> Reply {
        let (status, head) = self.head().await;
        let chunked = header_in(&head, "transfer-encoding")
            .is_some_and(|te| te.to_ascii_lowercase().ends_with("chunked"));
        let length = header_in(&head, "content-length").map(|v| {
            v.parse::<usize>()
                .unwrap_or_else(|_| panic!("bad content-length in {head:?}"))
        });
        let body = if head_request || (100..200).contains(&status) || status == 204 || status == 304
        {
            Vec::new()
        } else if chunked {
            assert!(length.is_none(), "both framings in {head:?}");
            self.chunked_body().await
        } else if let Some(n) = length {
            self.take_exact(n).await
        } else {
            self.rest_until_eof().await
        };
        Reply { status, head, body }
    }

    pub async fn chunked_body(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line = text(&self.take_through(b"\r\n").await);
            let size = line.trim_end().split(';').next().unwrap().trim();
            let size = usize::from_str_radix(size, 16)
                .unwrap_or_else(|_| panic!("bad chunk-size line {line:?}"));
            if size == 0 {
                while self.take_through(b"\r\n").await != b"\r\n" {}
                return body;
            }
            body.extend(self.take_exact(size).await);
            assert_eq!(self.take_exact(2).await, b"\r\n", "chunk not ended by CRLF");
        }
    }

    /// Whatever is left until the proxy closes.
    pub async fn rest_until_eof(&mut self) -> Vec<u8> {
        while self.fill().await {}
        std::mem::take(&mut self.buf)
    }

    /// The proxy closes the connection and sends nothing more.
    pub async fn assert_closed(&mut self) {
        let rest = self.rest_until_eof().await;
        assert!(
            rest.is_empty(),
            "bytes after the response: {:?}",
            text(&rest)
        );
    }
}

// -------------------------------------------------------------------------------------------
// A raw HTTP/1 backend

/// What a raw backend does after answering a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// Reads the next request on the same connection.
    KeepServing,
    /// Closes the connection.
    Close,
    /// Reads the next request on the same connection and closes it without an answer.
    DropTheNext,
    /// Closes the connection this long after the answer, without reading more: a server that
    /// closes after each response while advertising keep-alive (llama-server after a stream).
    ClosesSoon(Duration),
    /// Closes the connection when the next request's first bytes arrive, without reading
    /// them: its kernel then resets the connection, the close crossing that request.
    ResetsTheNext,
}

/// A backend on `127.0.0.1:0` that answers every request with the same bytes, written piece
/// by piece, and records what it was sent.
pub struct RawBackend {
    pub addr: SocketAddr,
    accepted: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    reset_unread: Arc<AtomicU64>,
    requests: Arc<Mutex<Vec<Vec<u8>>>>,
    closed: mpsc::UnboundedReceiver<()>,
}

impl RawBackend {
    pub async fn spawn(reply: &[&[u8]], after: After) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pieces: Arc<Vec<Vec<u8>>> = Arc::new(reply.iter().map(|p| p.to_vec()).collect());
        let accepted = Arc::new(AtomicU64::new(0));
        let answered = Arc::new(AtomicU64::new(0));
        let reset_unread = Arc::new(AtomicU64::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (closed_tx, closed) = mpsc::unbounded_channel();
        let (acc, ans, resets, reqs) = (
            accepted.clone(),
            answered.clone(),
            reset_unread.clone(),
            requests.clone(),
        );
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                acc.fetch_add(1, Ordering::SeqCst);
                let (pieces, ans, resets, reqs, closed_tx) = (
                    pieces.clone(),
                    ans.clone(),
                    resets.clone(),
                    reqs.clone(),
                    closed_tx.clone(),
                );
                tokio::spawn(async move {
                    if serve_raw(stream, &pieces, after, &ans, &reqs).await {
                        resets.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = closed_tx.send(());
                });
            }
        });
        Self {
            addr,
            accepted,
            answered,
            reset_unread,
            requests,
            closed,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }

    /// Connections closed with a request unread ([`After::ResetsTheNext`]).
    pub fn reset_unread(&self) -> u64 {
        self.reset_unread.load(Ordering::SeqCst)
    }

    pub fn requests(&self) -> Vec<Vec<u8>> {
        self.requests.lock().clone()
    }

    /// Waits until the backend has closed one more connection.
    pub async fn wait_closed(&mut self) {
        guarded("the backend to close a connection", self.closed.recv())
            .await
            .expect("backend task alive");
    }
}

/// Serves one connection as `after` says; true when it closed with a request unread.
pub async fn serve_raw(
    mut stream: TcpStream,
    pieces: &[Vec<u8>],
    after: After,
    answered: &AtomicU64,
    requests: &Mutex<Vec<Vec<u8>>>,
) -> bool {
    let mut buf = Vec::new();
    let mut served = 0;
    while let Some(request) = read_raw_request(&mut stream, &mut buf).await {
        requests.lock().push(request);
        if after == After::DropTheNext && served == 1 {
            return false;
        }
        for piece in pieces {
            if stream.write_all(piece).await.is_err() || stream.flush().await.is_err() {
                return false;
            }
        }
        answered.fetch_add(1, Ordering::SeqCst);
        served += 1;
        if after == After::Close {
            let _ = stream.shutdown().await;
            return false;
        }
        if let After::ClosesSoon(delay) = after {
            tokio::time::sleep(delay).await;
            return false;
        }
        if after == After::ResetsTheNext {
            let mut first = [0u8; 1];
            return matches!(stream.peek(&mut first).await, Ok(n) if n > 0);
        }
    }
    false
}

/// Reads one request (head, then a `Content-Length` body); `None` at EOF.
pub async fn read_raw_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(at) = find(buf, b"\r\n\r\n") {
            break at + 4;
        }
        match stream.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    };
    let length: usize = header_in(&text(&buf[..head_end]), "content-length")
        .map_or(0, |v| v.parse().expect("numeric content-length"));
    while buf.len() < head_end + length {
        match stream.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
    Some(buf.drain(..head_end + length).collect())
}

/// A recorded request split into its head (text) and body.
pub fn split_request(raw: &[u8]) -> (String, Vec<u8>) {
    let at = find(raw, b"\r\n\r\n").expect("a whole head") + 4;
    (text(&raw[..at - 4]), raw[at..].to_vec())
}

// -------------------------------------------------------------------------------------------
// Proxy helpers

/// A proxy config over `(name, url)` backends, health checks off.
pub fn config_over(backends: &[(&str, String)]) -> ProxyConfig {
    let mut toml = String::from(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n",
    );
    for (name, url) in backends {
        toml.push_str(&format!(
            "[[backends]]\nname = \"{name}\"\nurl = \"{url}\"\n"
        ));
    }
    ProxyConfig::from_toml_str(&toml).unwrap()
}

/// A bodiless `GET` of `path` with a valid `Host`.
pub fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: proxy.test\r\n\r\n")
}
