//! The tap's side of the recorder: observers keep `Bytes` handles (refcount bumps, never
//! copies) and hand one record per exchange to a bounded queue; a full queue or an exhausted
//! memory bound drops the record and counts it, so forwarding is never slowed. Under the
//! `block` policy a full queue instead holds back the end of that one response (through
//! [`ExchangeObserver::poll_ready`]) until the writer makes room; no thread ever waits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::PollSemaphore;

use super::{CaptureConfig, FullPolicy};
use crate::tap::{ExchangeEnd, ExchangeObserver, ExchangeSink, ExchangeStart};

/// Counters shared by the sink, the writer and [`super::Recorder::stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub records_written: AtomicU64,
    pub records_dropped: AtomicU64,
    pub records_lost_write_failed: AtomicU64,
    pub records_lost_retry_wait: AtomicU64,
    pub write_errors: AtomicU64,
    pub bytes_raw: AtomicU64,
    pub bytes_stored: AtomicU64,
}

/// State shared between the sink and the writer.
#[derive(Debug)]
pub(crate) struct Shared {
    pub counters: Counters,
    /// Body bytes held by observers and the queue; never above `memory_bound`.
    pub held_bytes: AtomicU64,
    pub memory_bound: u64,
    /// One permit per record the queue may hold (`queue_capacity`): a record takes one before
    /// it is sent, the writer gives it back once the record is written. A semaphore rather
    /// than a bounded channel, so that the `block` policy can wait for room asynchronously
    /// while the writer thread keeps its blocking receive with a timeout.
    pub slots: Arc<Semaphore>,
    closed: AtomicBool,
    /// Unbounded by itself; every `Exchange` on it holds a slot.
    tx: Sender<Msg>,
    /// Held by tests to keep the writer from taking records, as a stuck disk would.
    pub(crate) hold: parking_lot::Mutex<bool>,
    pub(crate) hold_changed: parking_lot::Condvar,
}

/// What travels from the sink to the writer.
pub(crate) enum Msg {
    Exchange(Box<Captured>),
    /// Sent once by `Recorder::finish`: everything before it is written, then the writer ends.
    Close,
}

/// One finished exchange, as the observer saw it.
pub(crate) struct Captured {
    pub id: u64,
    pub start: ExchangeStart,
    /// `request_body` was left out (memory bound); its length is kept here.
    pub request_len: usize,
    pub head: Option<(http::StatusCode, http::HeaderMap, Instant)>,
    /// Every forwarded frame's time and length (kept even when the bytes are not).
    pub frame_times: Vec<(Instant, usize)>,
    /// The frames' bytes, unless the memory bound cut them.
    pub frames: Vec<Bytes>,
    pub end: ExchangeEnd,
    pub end_at: Instant,
    pub drop_reason: Option<&'static str>,
    /// Bytes of this record counted in `held_bytes`; released by whoever drops it.
    pub held: u64,
}

/// The queue handle the sink sends on.
pub(crate) struct Queue {
    pub shared: Arc<Shared>,
}

/// Creates the queue for `config`: a channel with `queue_capacity` slots.
pub(crate) fn queue(config: &CaptureConfig) -> (Queue, Receiver<Msg>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        counters: Counters::default(),
        held_bytes: AtomicU64::new(0),
        memory_bound: config.memory_bound_bytes,
        slots: Arc::new(Semaphore::new(
            config.queue_capacity.min(Semaphore::MAX_PERMITS),
        )),
        closed: AtomicBool::new(false),
        tx,
        hold: parking_lot::Mutex::new(false),
        hold_changed: parking_lot::Condvar::new(),
    });
    (Queue { shared }, rx)
}

impl Shared {
    /// Counts `n` more body bytes as held, unless that would pass the memory bound.
    fn try_hold(&self, n: u64) -> bool {
        let mut cur = self.held_bytes.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(n);
            if next > self.memory_bound {
                return false;
            }
            match self.held_bytes.compare_exchange_weak(
                cur,
                next,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Returns `n` held bytes.
    pub(crate) fn release(&self, n: u64) {
        self.held_bytes.fetch_sub(n, Ordering::AcqRel);
    }

    fn dropped(&self, captured: Box<Captured>) {
        self.release(captured.held);
        self.counters
            .records_dropped
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Stops accepting records and tells the writer to finish once it has written the
    /// records queued before; exchanges waiting for room give up (their records are counted
    /// as dropped). Never blocks: `Close` needs no slot.
    pub(crate) fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.slots.close();
            let _ = self.tx.send(Msg::Close);
        }
    }

    /// Gives back the slot of a record the writer has taken off the queue.
    pub(crate) fn slot_freed(&self) {
        self.slots.add_permits(1);
    }

    /// Blocks the writer thread while a test holds it (see `Recorder::hold_writer`).
    pub(crate) fn wait_while_held(&self) {
        let mut held = self.hold.lock();
        while *held {
            self.hold_changed.wait(&mut held);
        }
    }
}

/// The [`ExchangeSink`] the proxy reports to.
pub(crate) struct RecorderSink {
    shared: Arc<Shared>,
    policy: FullPolicy,
    next_id: AtomicU64,
}

impl RecorderSink {
    pub(crate) fn new(config: &CaptureConfig, queue: Queue) -> Self {
        RecorderSink {
            shared: queue.shared,
            policy: config.full_policy,
            next_id: AtomicU64::new(1),
        }
    }
}

impl ExchangeSink for RecorderSink {
    fn start(&self, mut start: ExchangeStart) -> Box<dyn ExchangeObserver> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let request_len = start.request_body.len();
        let mut held = 0;
        let mut drop_reason = None;
        if self.shared.try_hold(request_len as u64) {
            held = request_len as u64;
        } else {
            start.request_body = Bytes::new();
            drop_reason = Some("memory_bound");
        }
        Box::new(Observer {
            shared: self.shared.clone(),
            policy: self.policy,
            captured: Some(Box::new(Captured {
                id,
                start,
                request_len,
                head: None,
                frame_times: Vec::new(),
                frames: Vec::new(),
                end: ExchangeEnd::Complete,
                end_at: Instant::now(),
                drop_reason,
                held,
            })),
            spare: 0,
            slot: None,
            waiting: None,
        })
    }
}

/// Follows one exchange; sends its record when it ends.
struct Observer {
    shared: Arc<Shared>,
    policy: FullPolicy,
    captured: Option<Box<Captured>>,
    /// Bytes reserved against the memory bound but not used yet: frames are counted in
    /// chunks, not one shared atomic update per frame.
    spare: u64,
    /// Under `block`: the queue slot this record will take, once `poll_ready` got one.
    slot: Option<OwnedSemaphorePermit>,
    /// Under `block`: the wait for a slot, kept across polls.
    waiting: Option<PollSemaphore>,
}

impl Observer {
    /// Reserves room for at least `len` more bytes (a chunk, when the bound allows).
    fn reserve(&mut self, len: u64) -> bool {
        let chunk = (self.shared.memory_bound / 64).clamp(1, 64 * 1024);
        let want = len.max(chunk);
        let got = if self.shared.try_hold(want) {
            want
        } else if want > len && self.shared.try_hold(len) {
            len
        } else {
            return false;
        };
        if let Some(c) = self.captured.as_mut() {
            c.held += got;
        }
        self.spare += got;
        true
    }
}

impl ExchangeObserver for Observer {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.policy != FullPolicy::Block || self.slot.is_some() || self.captured.is_none() {
            return Poll::Ready(());
        }
        let waiting = self
            .waiting
            .get_or_insert_with(|| PollSemaphore::new(self.shared.slots.clone()));
        match waiting.poll_acquire(cx) {
            Poll::Pending => Poll::Pending,
            // `None`: the recorder is closing; `end` counts the record as dropped.
            Poll::Ready(permit) => {
                self.slot = permit;
                self.waiting = None;
                Poll::Ready(())
            }
        }
    }

    fn response_head(&mut self, status: http::StatusCode, headers: &http::HeaderMap, at: Instant) {
        if let Some(c) = self.captured.as_mut() {
            c.head = Some((status, headers.clone(), at));
        }
    }

    fn response_frame(&mut self, data: &Bytes, at: Instant) {
        let len = data.len() as u64;
        match self.captured.as_mut() {
            None => return,
            Some(c) => {
                c.frame_times.push((at, data.len()));
                if c.drop_reason.is_some() {
                    return;
                }
            }
        }
        let fits = self.spare >= len || self.reserve(len);
        let Some(c) = self.captured.as_mut() else {
            return;
        };
        if fits {
            self.spare -= len;
            c.frames.push(data.clone());
        } else {
            // Keep the timings and the request, let go of every response byte.
            c.frames.clear();
            let request = c.start.request_body.len() as u64;
            self.shared.release(c.held - request);
            c.held = request;
            self.spare = 0;
            c.drop_reason = Some("memory_bound");
        }
    }

    fn end(mut self: Box<Self>, end: ExchangeEnd, at: Instant) {
        let Some(mut c) = self.captured.take() else {
            return;
        };
        c.end = end;
        c.end_at = at;
        send(&self.shared, c, self.slot.take());
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        if let Some(c) = self.captured.take() {
            // Dropped without `end`: the proxy promises not to, but never leak held bytes.
            self.shared.dropped(c);
        }
    }
}

/// Queues a finished record in `slot`, or in a free slot taken now; with neither, or once the
/// recorder is closing, the record is dropped and counted.
fn send(shared: &Shared, captured: Box<Captured>, slot: Option<OwnedSemaphorePermit>) {
    if shared.closed.load(Ordering::Acquire) {
        shared.dropped(captured);
        return;
    }
    match slot {
        Some(permit) => permit.forget(),
        None => match shared.slots.try_acquire() {
            Ok(permit) => permit.forget(),
            Err(_) => {
                shared.dropped(captured);
                return;
            }
        },
    }
    if let Err(std::sync::mpsc::SendError(Msg::Exchange(c))) =
        shared.tx.send(Msg::Exchange(captured))
    {
        shared.dropped(c);
    }
}
