//! When a request's first bytes reached this host: the kernel's receive time of the first byte
//! waiting on a client socket (`SO_TIMESTAMPNS`, read with a one-byte `MSG_PEEK`, so nothing is
//! consumed). A proxy thread that waits for a core before reading would otherwise stamp the
//! request late, and the recorder would lengthen the wait before it by as much.
//!
//! Used only while a recorder is on, on plain TCP connections; TLS connections (whose bytes
//! rustls may already have read) and HTTP/2 ones keep the stamp taken when the head is parsed.

use std::future::Future;

use tokio::io::Interest;
use tokio::net::TcpStream;

pub(crate) use crate::sockstamp::{enable, instant_of};

/// A client connection whose requests' first bytes the kernel may have stamped.
pub(crate) trait Arrivals {
    /// When the first byte now waiting arrived (ns since the Unix epoch), once one is there;
    /// `None` at once where no stamp can be read.
    fn first_byte(&self) -> impl Future<Output = Option<u128>> + Send {
        std::future::ready(None)
    }
}

impl Arrivals for TcpStream {
    fn first_byte(&self) -> impl Future<Output = Option<u128>> + Send {
        first_byte(self)
    }
}

/// rustls may hold bytes already read from the socket, which a peek would not see.
impl Arrivals for tokio_rustls::server::TlsStream<TcpStream> {}

/// When the first byte now waiting on `stream` arrived, as wall-clock nanoseconds since the
/// Unix epoch; waits until a byte is there. `None` when the peer closed, the socket failed,
/// or no timestamp came with the byte.
pub(crate) async fn first_byte(stream: &TcpStream) -> Option<u128> {
    let mut byte = [0u8; 1];
    loop {
        stream.readable().await.ok()?;
        match stream.try_io(Interest::READABLE, || {
            crate::sockstamp::recv(stream, &mut byte, true)
        }) {
            Ok((0, _)) => return None,
            Ok((_, stamp)) => return stamp,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    use tokio::io::AsyncWriteExt;
    use tokio::time::Instant;

    // A request's first byte is stamped when the kernel received it, not when it is read:
    // bytes left waiting 50 ms are stamped 50 ms back, and peeking consumes nothing. The kernel
    // turns stamping on for the whole host a moment after the first socket asks (a deferred
    // work item), so the first bytes may come unstamped: those are read and sent again.
    #[tokio::test]
    async fn first_byte_is_stamped_when_the_kernel_received_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        assert!(enable(&server));
        let now_ns = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        };
        for _ in 0..100 {
            client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            let sent = now_ns();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let stamp = first_byte(&server).await;
            let read_at = now_ns();
            let mut got = [0u8; 16];
            server.try_read(&mut got).unwrap();
            assert_eq!(&got, b"GET / HTTP/1.1\r\n");
            let Some(stamp) = stamp else {
                continue;
            };
            assert!(
                stamp <= sent + 1_000_000,
                "stamped {} ns late",
                stamp - sent
            );
            assert!(read_at - stamp >= 50_000_000, "{} ns", read_at - stamp);
            let at = instant_of(stamp).unwrap();
            assert!(Instant::now() - at >= Duration::from_millis(50));
            assert_eq!(instant_of(u128::MAX), None);
            return;
        }
        panic!("no kernel timestamp in 100 tries");
    }
}
