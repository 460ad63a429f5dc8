//! Kernel receive timestamps of socket reads (`SO_TIMESTAMPNS`): the time the network stack
//! took each arriving packet off the wire, in softirq, whatever the reading task was doing.
//! Shared by the proxy's arrivals and the replay client's responses.
//!
//! The kernel stamps on the wall clock (`CLOCK_REALTIME`); everything here is returned on the
//! monotonic clock of `tokio::time::Instant` (`CLOCK_MONOTONIC`, the clock of `events.jsonl`),
//! by how long ago the wall clock says the packet came. That age is measured right after the
//! read, when it is microseconds to milliseconds: the two clocks run at the same rate (NTP
//! slews both alike), so only a step of the wall clock in that window could mislead it, and a
//! stamp from the future or older than [`MAX_AGE`] is refused as one.

use std::io::IoSliceMut;
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::socket::{self, sockopt, ControlMessageOwned, MsgFlags};
use tokio::time::Instant;

/// The longest a byte may have waited before its stamp is believed: a kernel time further
/// back is taken for a step of the wall clock, and the caller stamps the read instead.
const MAX_AGE: Duration = Duration::from_secs(300);

/// How far in the future a stamp may seem before it is refused: the width of the two clock
/// reads that measure the age, with room to spare.
const MAX_AHEAD: Duration = Duration::from_micros(50);

/// Asks the kernel to stamp every packet `socket` receives; false if it refuses. A listening
/// socket passes it on to the sockets it accepts. The kernel turns stamping on for the whole
/// host a moment after the first socket asks (deferred work) and off once the last one
/// closes, so the first packets after that may come unstamped.
pub(crate) fn enable(socket: &impl AsFd) -> bool {
    socket::setsockopt(socket, sockopt::ReceiveTimestampns, &true).is_ok()
}

/// One `recvmsg` into `buf` without waiting: the bytes read and, when the kernel sent one, the
/// receive time (ns since the Unix epoch) of the first packet among them. A read that
/// coalesces several packets gets the first one's time: its first byte is what a reader acts
/// on, and the later packets are at most as late as the read itself.
pub(crate) fn recv(
    socket: &impl AsFd,
    buf: &mut [u8],
    peek: bool,
) -> std::io::Result<(usize, Option<u128>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let flags = if peek {
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
    } else {
        MsgFlags::MSG_DONTWAIT
    };
    let msg = socket::recvmsg::<()>(
        socket.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        flags,
    )
    .map_err(std::io::Error::from)?;
    let mut stamp = None;
    if let Ok(cmsgs) = msg.cmsgs() {
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmTimestampns(t) = cmsg {
                let (secs, nanos) = (t.tv_sec(), t.tv_nsec());
                if secs > 0 && nanos >= 0 {
                    stamp = Some(secs as u128 * 1_000_000_000 + nanos as u128);
                }
            }
        }
    }
    Ok((msg.bytes, stamp))
}

/// The monotonic instant of a kernel receive time (ns since the Unix epoch): now, less the
/// age the wall clock gives it. The wall clock is read between two monotonic reads and set
/// against their midpoint, so the conversion errs by half their gap (tens of ns). `None` when
/// the stamp lies in the future or further back than [`MAX_AGE`] (a clock step).
pub(crate) fn instant_of(unix_ns: u128) -> Option<Instant> {
    let before = Instant::now();
    let wall = SystemTime::now();
    let after = Instant::now();
    let mid = before + (after - before) / 2;
    let wall_ns = wall.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    if unix_ns > wall_ns {
        let ahead = Duration::from_nanos(u64::try_from(unix_ns - wall_ns).ok()?);
        return (ahead <= MAX_AHEAD).then_some(mid);
    }
    let age = Duration::from_nanos(u64::try_from(wall_ns - unix_ns).ok()?);
    (age <= MAX_AGE).then(|| mid.checked_sub(age)).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_from_the_future_or_the_far_past_are_refused() {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        assert_eq!(instant_of(u128::MAX), None);
        assert_eq!(instant_of(now_ns + 1_000_000_000), None);
        assert_eq!(instant_of(now_ns - 2 * MAX_AGE.as_nanos()), None);
        let at = instant_of(now_ns - 10_000_000).expect("10 ms back is believed");
        let back = Instant::now() - at;
        assert!(back >= Duration::from_millis(10), "{back:?}");
    }
}
