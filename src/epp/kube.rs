//! A small Kubernetes API client for the pool watch: one HTTP/1.1 connection per request
//! (the crate's codec over rustls, verified with the service account's CA), a bearer token
//! re-read at each request, JSON bodies read up to a bound, and watch streams split into one
//! event per line.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Method};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use crate::http1::{self, BodyDecoder, Decoded, H1Error};
use crate::remote::{self, ServerUrl, TlsConfigError, Trust};

/// How long connecting (TCP and TLS) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a GET or list page may take, head and body.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The API server ends a watch after this long (`timeoutSeconds`); it is then reopened.
pub(crate) const WATCH_SECONDS: u64 = 290;
/// A watch silent for this long (no event, no bookmark) is taken as dead.
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_SECONDS + 60);
/// The largest token file read.
const MAX_TOKEN_BYTES: u64 = 64 * 1024;

/// Why a request to the API server failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeError {
    /// TCP or TLS connection failed or timed out.
    #[error("cannot connect to the API server {server}: {reason}")]
    Connect { server: String, reason: String },
    /// The CA file could not be used.
    #[error("epp.inference_pool.ca_file {}: {reason}", path.display())]
    Ca { path: PathBuf, reason: String },
    /// The token file could not be read.
    #[error("epp.inference_pool.token_file {}: {reason}", path.display())]
    Token { path: PathBuf, reason: String },
    /// The HTTP exchange failed midway.
    #[error("{what}: HTTP error: {reason}")]
    Http { what: String, reason: String },
    /// The API server answered with an error status.
    #[error("{what}: HTTP {status}: {message}")]
    Status {
        what: String,
        status: u16,
        message: String,
    },
    /// A body or a watch line exceeded its bound.
    #[error("{what}: longer than {limit} bytes")]
    TooLong { what: String, limit: usize },
    /// A body or a watch line is not the JSON expected.
    #[error("{what}: not a valid object: {reason}")]
    Json { what: String, reason: String },
    /// Nothing arrived in time.
    #[error("{what}: no answer within {0:?}", after)]
    Timeout { what: String, after: Duration },
}

impl KubeError {
    /// `410 Gone`: the resource version is too old; list again.
    pub(crate) fn is_gone(&self) -> bool {
        matches!(self, KubeError::Status { status: 410, .. })
    }
}

/// Where the API server is and how to authenticate to it.
pub(crate) struct ApiClient {
    server: ServerUrl,
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    token_file: PathBuf,
    max_event_bytes: usize,
}

impl ApiClient {
    /// A client for `server`; for https the CA file is read now (so a rotated CA is picked up
    /// by the next client).
    pub(crate) fn new(
        server: ServerUrl,
        ca_file: &Path,
        token_file: &Path,
        max_event_bytes: usize,
    ) -> Result<Self, KubeError> {
        let tls = if server.tls {
            let name = server.server_name().map_err(|e| KubeError::Connect {
                server: server.to_string(),
                reason: format!("not a TLS server name: {e}"),
            })?;
            Some((tls_connector(ca_file)?, name))
        } else {
            None
        };
        Ok(Self {
            server,
            tls,
            token_file: token_file.to_path_buf(),
            max_event_bytes,
        })
    }

    /// GETs `path` and parses its JSON body, read up to `limit` bytes.
    pub(crate) async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        limit: usize,
    ) -> Result<T, KubeError> {
        let what = format!("GET {path}");
        let work = async {
            let mut body = self.send(path, &what).await?;
            let mut bytes = Vec::new();
            while let Some(data) = body.data(&what).await? {
                if bytes.len() + data.len() > limit {
                    return Err(KubeError::TooLong { what, limit });
                }
                bytes.extend_from_slice(&data);
            }
            serde_json::from_slice(&bytes).map_err(|e| KubeError::Json {
                what: what.clone(),
                reason: e.to_string(),
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, work)
            .await
            .map_err(|_| KubeError::Timeout {
                what: format!("GET {path}"),
                after: REQUEST_TIMEOUT,
            })?
    }

    /// Opens a watch (`path` has `watch=true`): its events, one per line.
    pub(crate) async fn watch(&self, path: &str) -> Result<WatchStream, KubeError> {
        let what = format!("watch {path}");
        let body = tokio::time::timeout(REQUEST_TIMEOUT, self.send(path, &what))
            .await
            .map_err(|_| KubeError::Timeout {
                what: what.clone(),
                after: REQUEST_TIMEOUT,
            })??;
        Ok(WatchStream {
            what,
            body,
            buf: Vec::new(),
            limit: self.max_event_bytes,
            deadline: Instant::now() + WATCH_IDLE,
        })
    }

    /// Sends a GET and returns the body of a 2xx answer; other statuses are errors carrying
    /// the API server's message.
    async fn send(&self, path: &str, what: &str) -> Result<ApiBody, KubeError> {
        let token = self.token()?;
        let server = self.server.to_string();
        let connect_err = |reason: String| KubeError::Connect {
            server: server.clone(),
            reason,
        };
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect((self.server.host.as_str(), self.server.port)),
        )
        .await
        .map_err(|_| connect_err(format!("timed out after {CONNECT_TIMEOUT:?}")))?
        .map_err(|e| connect_err(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let mut io: Box<dyn ApiStream> = match &self.tls {
            Some((connector, name)) => Box::new(
                tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name.clone(), tcp))
                    .await
                    .map_err(|_| connect_err(format!("TLS timed out after {CONNECT_TIMEOUT:?}")))?
                    .map_err(|e| connect_err(format!("TLS: {e}")))?,
            ),
            None => Box::new(tcp),
        };
        let http_err = |reason: String| KubeError::Http {
            what: what.to_string(),
            reason,
        };
        let host = HeaderValue::from_str(self.server.authority.as_str()).map_err(|_| {
            http_err(format!(
                "host {:?}: not a Host value",
                self.server.authority
            ))
        })?;
        let bearer = token.map(|t| format!("Bearer {t}"));
        let mut fields: Vec<(&[u8], &[u8])> = vec![(b"accept", b"application/json")];
        if let Some(bearer) = &bearer {
            fields.push((b"authorization", bearer.as_bytes()));
        }
        let mut request = Vec::with_capacity(512);
        http1::put_request_head(&mut request, &Method::GET, &[path], &host, fields, None);
        io.write_all(&request)
            .await
            .map_err(|e| http_err(e.to_string()))?;
        let (status, mut body) = ApiBody::read_head(io, what).await?;
        if status.is_success() {
            return Ok(body);
        }
        // The API server's `Status` object says why; a few KiB of it is plenty.
        let mut message = Vec::new();
        while let Ok(Some(data)) = body.data(what).await {
            message.extend_from_slice(&data[..data.len().min(4096 - message.len().min(4096))]);
            if message.len() >= 4096 {
                break;
            }
        }
        let message = serde_json::from_slice::<StatusObject>(&message)
            .map(|s| s.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&message).trim().to_string());
        Err(KubeError::Status {
            what: what.to_string(),
            status: status.as_u16(),
            message,
        })
    }

    /// The bearer token, re-read each time (kubelet rotates projected tokens). Over plain
    /// http a missing file means no token.
    fn token(&self) -> Result<Option<String>, KubeError> {
        use std::io::Read as _;
        let err = |reason: String| KubeError::Token {
            path: self.token_file.clone(),
            reason,
        };
        let file = match std::fs::File::open(&self.token_file) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !self.server.tls => {
                return Ok(None)
            }
            Err(e) => return Err(err(e.to_string())),
        };
        let mut text = String::new();
        file.take(MAX_TOKEN_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| err(e.to_string()))?;
        let token = text.trim();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err("not a token (empty, or not printable ASCII)".into()));
        }
        Ok(Some(token.to_string()))
    }
}

/// The connection to the API server: TCP, or TLS over it.
trait ApiStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> ApiStream for T {}

/// A response body being read off its connection, de-framed by the crate's codec.
struct ApiBody {
    io: Box<dyn ApiStream>,
    buf: BytesMut,
    decoder: BodyDecoder,
    eof: bool,
}

impl ApiBody {
    /// Reads the final response head (passing over interim 1xx ones); the body follows.
    async fn read_head(
        mut io: Box<dyn ApiStream>,
        what: &str,
    ) -> Result<(http::StatusCode, ApiBody), KubeError> {
        let mut buf = BytesMut::with_capacity(16 * 1024);
        loop {
            let n = http1::read_some(&mut io, &mut buf)
                .await
                .map_err(|e| protocol(what, e.to_string()))?;
            while let Some(head) =
                http1::parse_response(&mut buf, false).map_err(|e| protocol(what, e.to_string()))?
            {
                if head.status.is_informational() {
                    continue;
                }
                let body = ApiBody {
                    io,
                    buf,
                    decoder: BodyDecoder::new(head.framing),
                    eof: false,
                };
                return Ok((head.status, body));
            }
            if n == 0 {
                return Err(protocol(
                    what,
                    "connection closed before the response head".into(),
                ));
            }
        }
    }

    /// The next piece of the body, or `None` at its end. Cancel-safe: what was read stays in
    /// the buffer.
    async fn data(&mut self, what: &str) -> Result<Option<Bytes>, KubeError> {
        loop {
            match self.decoder.decode(&mut self.buf, self.eof) {
                Ok(Decoded::Data(data)) => return Ok(Some(data)),
                Ok(Decoded::Done) => return Ok(None),
                Ok(Decoded::NeedMore) => {}
                Err(H1Error::Incomplete) => {
                    return Err(protocol(what, "connection closed mid-body".into()))
                }
                Err(e) => return Err(protocol(what, e.to_string())),
            }
            let n = http1::read_some(&mut self.io, &mut self.buf)
                .await
                .map_err(|e| protocol(what, e.to_string()))?;
            self.eof = n == 0;
        }
    }
}

fn protocol(what: &str, reason: String) -> KubeError {
    KubeError::Http {
        what: what.to_string(),
        reason,
    }
}

/// A connector trusting only the certificates in `ca_file`: the cluster's CA, not the
/// platform's.
fn tls_connector(ca_file: &Path) -> Result<tokio_rustls::TlsConnector, KubeError> {
    let config = remote::client_config(Trust::CaFile(ca_file), &[]).map_err(|e| match e {
        TlsConfigError::CaFile { path, reason } => KubeError::Ca { path, reason },
        e @ TlsConfigError::Rustls(_) => KubeError::Ca {
            path: ca_file.to_path_buf(),
            reason: e.to_string(),
        },
    })?;
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The API server's error object (`kind: Status`).
#[derive(Debug, Deserialize)]
pub(crate) struct StatusObject {
    #[serde(default)]
    pub code: u16,
    #[serde(default)]
    pub message: String,
}

/// One watch event line: `{"type": ..., "object": {...}}`.
#[derive(Debug, Deserialize)]
pub(crate) struct WatchEvent {
    #[serde(rename = "type")]
    pub kind: String,
    pub object: Box<serde_json::value::RawValue>,
}

/// An open watch: a stream of newline-delimited JSON events, each at most `limit` bytes.
pub(crate) struct WatchStream {
    what: String,
    body: ApiBody,
    buf: Vec<u8>,
    limit: usize,
    /// When the watch counts as dead unless more bytes arrive.
    deadline: Instant,
}

impl WatchStream {
    /// The next event, or `None` when the API server ended the watch. Cancel-safe: bytes are
    /// kept in the buffer between calls.
    pub(crate) async fn next(&mut self) -> Result<Option<WatchEvent>, KubeError> {
        loop {
            if let Some(end) = memchr::memchr(b'\n', &self.buf) {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                if line.len() > self.limit {
                    return Err(self.too_long());
                }
                return serde_json::from_slice(line)
                    .map(Some)
                    .map_err(|e| KubeError::Json {
                        what: self.what.clone(),
                        reason: e.to_string(),
                    });
            }
            if self.buf.len() > self.limit {
                return Err(self.too_long());
            }
            let data = tokio::time::timeout_at(self.deadline, self.body.data(&self.what))
                .await
                .map_err(|_| KubeError::Timeout {
                    what: self.what.clone(),
                    after: WATCH_IDLE,
                })??;
            match data {
                None => return Ok(None),
                Some(data) => {
                    self.deadline = Instant::now() + WATCH_IDLE;
                    self.buf.extend_from_slice(&data);
                }
            }
        }
    }

    fn too_long(&self) -> KubeError {
        KubeError::TooLong {
            what: format!("{}: event", self.what),
            limit: self.limit,
        }
    }
}

/// Percent-encodes a query parameter value (everything but RFC 3986 unreserved characters).
pub(crate) fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_selector_is_encoded_for_a_query() {
        assert_eq!(
            encode("app.kubernetes.io/name=model-server,tier=a b"),
            "app.kubernetes.io%2Fname%3Dmodel-server%2Ctier%3Da%20b"
        );
    }
}
