//! Sleeps that end on time: tokio's timer (millisecond ticks, serviced between task polls)
//! raced against one timer thread that parks with the kernel's high-resolution timeout.
//!
//! The thread only wakes the sleeping task; the sleep ends when `tokio::time::Instant::now()`
//! has reached the deadline, so under a paused test clock it ends exactly when tokio's sleep
//! would (the thread is not asked once the test clock has moved away from the real one).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Waits until `deadline`, waking within tens of microseconds of it rather than on tokio's
/// next millisecond tick. No spinning: the wait costs one heap entry and one wake-up.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        coarse: Box::pin(tokio::time::sleep_until(deadline)),
        alarm: None,
    }
}

/// The future of [`sleep_until`].
#[derive(Debug)]
pub struct Sleep {
    deadline: Instant,
    coarse: Pin<Box<tokio::time::Sleep>>,
    /// Set while the timer thread holds our waker; `None` once it has rung or was never set.
    alarm: Option<Arc<Alarm>>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let now = Instant::now();
        if now >= self.deadline || self.coarse.as_mut().poll(cx).is_ready() {
            self.disarm();
            return Poll::Ready(());
        }
        match &self.alarm {
            Some(alarm) => {
                // After the thread rang with the tokio clock short of the deadline (a paused
                // test clock), tokio's own timer finishes the wait.
                if let Some(w) = alarm.waker.lock().as_mut() {
                    w.clone_from(cx.waker());
                }
            }
            None => {
                // A test clock that has moved away from the real one gets tokio's timer alone.
                let real_now = std::time::Instant::now();
                let now_std = now.into_std();
                let skew = now_std
                    .checked_duration_since(real_now)
                    .unwrap_or_else(|| real_now - now_std);
                if skew < Duration::from_millis(1) {
                    let alarm = Arc::new(Alarm {
                        waker: Mutex::new(Some(cx.waker().clone())),
                    });
                    timer().arm(self.deadline.into_std(), alarm.clone());
                    self.alarm = Some(alarm);
                }
            }
        }
        Poll::Pending
    }
}

impl Sleep {
    fn disarm(&mut self) {
        if let Some(alarm) = self.alarm.take() {
            alarm.waker.lock().take();
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.disarm();
    }
}

#[derive(Debug)]
struct Alarm {
    waker: Mutex<Option<Waker>>,
}

struct Entry {
    at: std::time::Instant,
    seq: u64,
    alarm: Arc<Alarm>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The one timer thread: a heap of deadlines, parked until the earliest.
struct Timer {
    heap: Mutex<(BinaryHeap<Reverse<Entry>>, u64)>,
    thread: std::thread::Thread,
}

fn timer() -> &'static Arc<Timer> {
    static TIMER: OnceLock<Arc<Timer>> = OnceLock::new();
    TIMER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("agentrace-timer".into())
            .spawn(move || {
                let timer = Arc::new(Timer {
                    heap: Mutex::new((BinaryHeap::new(), 0)),
                    thread: std::thread::current(),
                });
                let _ = tx.send(timer.clone());
                timer.run();
            })
            .expect("spawn the timer thread");
        rx.recv().expect("the timer thread starts")
    })
}

impl Timer {
    fn arm(&self, at: std::time::Instant, alarm: Arc<Alarm>) {
        let mut guard = self.heap.lock();
        let (heap, seq) = &mut *guard;
        *seq += 1;
        let earliest = heap.peek().is_none_or(|Reverse(e)| at < e.at);
        heap.push(Reverse(Entry {
            at,
            seq: *seq,
            alarm,
        }));
        drop(guard);
        if earliest {
            self.thread.unpark();
        }
    }

    fn run(&self) {
        let mut due = Vec::new();
        loop {
            let next = {
                let mut guard = self.heap.lock();
                let now = std::time::Instant::now();
                while guard.0.peek().is_some_and(|Reverse(e)| e.at <= now) {
                    if let Some(Reverse(e)) = guard.0.pop() {
                        due.push(e.alarm);
                    }
                }
                guard.0.peek().map(|Reverse(e)| e.at - now)
            };
            for alarm in due.drain(..) {
                if let Some(waker) = alarm.waker.lock().take() {
                    waker.wake();
                }
            }
            match next {
                Some(wait) => std::thread::park_timeout(wait),
                None => std::thread::park(),
            }
        }
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
