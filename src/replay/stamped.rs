//! The replay client's TCP stream, read with `recvmsg` so that every read carries the kernel's
//! receive time of its bytes ([`crate::sockstamp`]). A task that waits for a core before it
//! reads would otherwise stamp a response late by that wait; the kernel stamps in softirq, as
//! the packet comes in, whatever the task is doing.
//!
//! The stream is what TLS runs over, so the stamp is always that of the TCP bytes: a TLS
//! record decrypted from an earlier read keeps that read's stamp, which is when its bytes came.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::sockstamp;

/// The most one read asks for: each read is one byte range with one stamp, and the part of
/// the buffer a read is given is zeroed first, so it stays small.
const MAX_READ: usize = 16 * 1024;

/// Reads of response bytes that came without a kernel stamp (stamping off or refused, a
/// clock step) and were stamped when read instead; the first one is logged.
static UNSTAMPED: AtomicU64 = AtomicU64::new(0);
static UNSTAMPED_LOGGED: AtomicBool = AtomicBool::new(false);

/// Says, at the end of a run, how many reads the kernel did not stamp, if any did not.
pub(crate) fn log_unstamped_reads() {
    let n = UNSTAMPED.load(Ordering::Relaxed);
    if n > 0 {
        tracing::info!(
            "{n} response reads had no kernel receive timestamp and were stamped when read"
        );
    }
}

/// When the bytes of the latest read on a [`StampedTcp`] arrived; shared with the connection
/// that reads through TLS or directly.
#[derive(Debug, Default)]
pub(crate) struct LastRead(Mutex<Option<Instant>>);

impl LastRead {
    /// The kernel's receive time of the latest read's first packet, on the monotonic clock;
    /// else now, counted (and logged the first time) as a read the kernel did not stamp.
    pub(crate) fn at(&self) -> Instant {
        if let Some(at) = *self.0.lock() {
            return at;
        }
        UNSTAMPED.fetch_add(1, Ordering::Relaxed);
        if !UNSTAMPED_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "a response read came without a kernel receive timestamp: such reads are \
                 stamped when read (counted, logged once)"
            );
        }
        Instant::now()
    }
}

/// A client TCP stream whose reads record their kernel receive time in a [`LastRead`].
#[derive(Debug)]
pub(crate) struct StampedTcp {
    tcp: TcpStream,
    last: Arc<LastRead>,
}

impl StampedTcp {
    /// Turns on receive stamping for `tcp` (reads are stamped when read where the kernel
    /// refuses) and returns the stream with the handle its stamps are read from.
    pub(crate) fn new(tcp: TcpStream) -> (Self, Arc<LastRead>) {
        if !sockstamp::enable(&tcp) {
            tracing::debug!("no kernel receive timestamps on the replay connection");
        }
        let last = Arc::new(LastRead::default());
        (
            Self {
                tcp,
                last: last.clone(),
            },
            last,
        )
    }
}

impl AsyncRead for StampedTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            ready!(this.tcp.poll_read_ready(cx))?;
            let dst = buf.initialize_unfilled_to(buf.remaining().min(MAX_READ));
            let tcp = &this.tcp;
            match tcp.try_io(Interest::READABLE, || sockstamp::recv(tcp, dst, false)) {
                Ok((n, stamp)) => {
                    if n > 0 {
                        *this.last.0.lock() = stamp.and_then(sockstamp::instant_of);
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for StampedTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // Bytes left unread for 30 ms carry the time they arrived, not the time they were read;
    // the kernel turns stamping on host-wide a moment after the first socket asks, so the
    // first tries may come unstamped and are sent again.
    #[tokio::test]
    async fn a_read_carries_the_time_its_bytes_arrived_not_when_it_ran() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let (mut client, last) = StampedTcp::new(tcp);
        for _ in 0..100 {
            server.write_all(b"data: x\n\n").await.unwrap();
            let sent = Instant::now();
            tokio::time::sleep(Duration::from_millis(30)).await;
            let mut got = [0u8; 64];
            let n = client.read(&mut got).await.unwrap();
            let read_at = Instant::now();
            assert_eq!(&got[..n], b"data: x\n\n");
            let Some(at) = *last.0.lock() else {
                continue;
            };
            assert!(
                at >= sent - Duration::from_millis(1),
                "stamped before it was sent"
            );
            assert!(
                at <= sent + Duration::from_millis(1),
                "{:?} late",
                at - sent
            );
            assert!(read_at - at >= Duration::from_millis(30));
            return;
        }
        panic!("no kernel timestamp in 100 tries");
    }
}
