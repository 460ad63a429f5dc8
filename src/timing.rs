//! Sleeps that end on time: tokio's timer (millisecond ticks) raced against a Linux `timerfd`
//! registered with the same runtime, which the kernel fires with high-resolution precision
//! (elsewhere tokio's timer alone).
//!
//! The `timerfd` only wakes the sleeping task; the sleep ends when `tokio::time::Instant::now()`
//! has reached the deadline, so under a paused test clock it ends exactly when tokio's sleep
//! would (no `timerfd` is made once the test clock has moved away from the real one).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

/// Waits until `deadline`, waking within tens of microseconds of it rather than on tokio's
/// next millisecond tick. No spinning and no extra thread: the runtime's own poll of its
/// sockets wakes when the kernel timer fires.
pub(crate) fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        coarse: Box::pin(tokio::time::sleep_until(deadline)),
        precise: None,
        tried: false,
    }
}

/// The future of [`sleep_until`].
pub(crate) struct Sleep {
    deadline: Instant,
    coarse: Pin<Box<tokio::time::Sleep>>,
    precise: Option<Pin<Box<Precise>>>,
    tried: bool,
}

#[cfg(target_os = "linux")]
type Precise = tokio_timerfd::Delay;
#[cfg(not(target_os = "linux"))]
type Precise = std::future::Pending<std::io::Result<()>>;

/// A kernel timer firing at `at`, if the platform has one.
fn precise_timer(at: std::time::Instant) -> Option<Precise> {
    #[cfg(target_os = "linux")]
    return tokio_timerfd::Delay::new(at).ok();
    #[cfg(not(target_os = "linux"))]
    {
        let _ = at;
        None
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline || self.coarse.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        if !self.tried {
            self.tried = true;
            // A test clock that has moved away from the real one gets tokio's timer alone.
            let now = Instant::now().into_std();
            let real_now = std::time::Instant::now();
            let skew = now
                .checked_duration_since(real_now)
                .unwrap_or_else(|| real_now - now);
            if skew < Duration::from_millis(1) {
                self.precise = precise_timer(self.deadline.into_std()).map(Box::pin);
            }
        }
        if let Some(precise) = self.precise.as_mut() {
            if precise.as_mut().poll(cx).is_ready() {
                self.precise = None;
                if Instant::now() >= self.deadline {
                    return Poll::Ready(());
                }
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sleep_never_ends_before_its_deadline() {
        for i in 0..50u64 {
            let deadline = Instant::now() + Duration::from_micros(300 + 37 * i);
            sleep_until(deadline).await;
            assert!(Instant::now() >= deadline);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn paused_clock_sleeps_exactly_like_tokio() {
        let start = Instant::now();
        let deadline = start + Duration::from_millis(1234);
        sleep_until(deadline).await;
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_sleep_leaves_nothing_to_wake() {
        let far = Instant::now() + Duration::from_secs(3600);
        let near = Instant::now() + Duration::from_millis(2);
        tokio::select! {
            _ = sleep_until(far) => panic!("an hour passed"),
            _ = sleep_until(near) => {}
        }
        assert!(Instant::now() >= near);
    }
}
