//! A raw HTTP/2 client for tests that need a peer no library client would be: one that never
//! acknowledges a PING (the `h2` crate acknowledges every PING itself), or that stops at
//! whatever point of the protocol a test wants.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::raw_http1::guarded;

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const ACK: u8 = 0x1;

/// One frame as read: type, flags, stream id and payload.
#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn is(&self, kind: u8) -> bool {
        self.kind == kind
    }

    pub fn is_ack(&self) -> bool {
        self.flags & ACK != 0
    }
}

/// An HTTP/2 connection driven frame by frame.
pub struct RawH2<S> {
    pub io: S,
    buf: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> RawH2<S> {
    /// A connection on which nothing has been sent yet.
    pub fn new(io: S) -> Self {
        Self {
            io,
            buf: Vec::new(),
        }
    }

    /// Sends the preface and an empty SETTINGS, and acknowledges the server's SETTINGS: the
    /// connection is then open, with nothing more owed to the server.
    pub async fn settle(io: S) -> Self {
        let mut conn = Self::new(io);
        let mut hello = PREFACE.to_vec();
        hello.extend_from_slice(&header(0, SETTINGS, 0, 0));
        conn.send_raw(&hello).await;
        guarded("the server's SETTINGS", async {
            loop {
                let frame = conn.next().await.expect("closed before its SETTINGS");
                if frame.is(SETTINGS) && !frame.is_ack() {
                    return;
                }
            }
        })
        .await;
        conn.send_raw(&header(0, SETTINGS, ACK, 0)).await;
        conn
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.unwrap();
        self.io.flush().await.unwrap();
    }

    /// The next frame; `None` once the server has closed the connection (or reset it).
    pub async fn next(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 9 {
                let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
                if self.buf.len() >= 9 + len {
                    let stream =
                        u32::from_be_bytes([self.buf[5], self.buf[6], self.buf[7], self.buf[8]])
                            & 0x7fff_ffff;
                    let frame = Frame {
                        kind: self.buf[3],
                        flags: self.buf[4],
                        stream,
                        payload: self.buf[9..9 + len].to_vec(),
                    };
                    self.buf.drain(..9 + len);
                    return Some(frame);
                }
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.io.read(&mut chunk).await {
                Ok(n) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                _ => return None,
            }
        }
    }

    /// Reads every frame until the server closes the connection, which must happen within
    /// the hang guard.
    pub async fn frames_until_closed(&mut self, what: &str) -> Vec<Frame> {
        guarded(what, async {
            let mut frames = Vec::new();
            while let Some(frame) = self.next().await {
                frames.push(frame);
            }
            frames
        })
        .await
    }
}

/// A frame header: payload length, type, flags, stream id.
pub fn header(len: usize, kind: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    let s = stream.to_be_bytes();
    [l[1], l[2], l[3], kind, flags, s[0], s[1], s[2], s[3]]
}
