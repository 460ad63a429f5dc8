//! Whether a known session's next turn costs more where its cache is than anywhere else: the
//! wait a backend's queue adds, against the prefill of the session's whole context on another
//! backend. Both come from what the proxy already sees of each answer: the time to its first
//! byte, and the prompt tokens and cached tokens its usage reports. A backend nothing has been
//! learnt of offers no evidence either way, so without usage reports no session ever moves for
//! a queue.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::usage::CacheUsage;
use super::Pool;

/// Answers a backend must have reported before its figures count: one slow answer is no queue.
const MIN_SAMPLES: u32 = 4;

/// What one backend's answers showed: moving averages, over about the last eight answers whose
/// usage was reported, of the time to the first byte and of the prompt tokens it had to
/// compute (those not served from its cache). Racing answers may lose one another's update,
/// which the averages absorb.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    /// Time to first byte, µs.
    ttfb_us: AtomicU64,
    /// Prompt tokens computed, in thousandths.
    computed_milli: AtomicU64,
    /// Answers learnt from (saturating).
    samples: AtomicU32,
}

impl Waits {
    /// Learns from one answer: `usage` as reported, its first byte `ttfb` after it was sent.
    pub(crate) fn learn(&self, usage: CacheUsage, ttfb: Duration) {
        let computed = usage.prompt_tokens.saturating_sub(usage.cached_tokens) as f64 * 1000.0;
        let ttfb = ttfb.as_micros().min(u128::from(u64::MAX)) as f64;
        let first = self.samples.load(Ordering::Relaxed) == 0;
        let average = |cell: &AtomicU64, value: f64| {
            let old = cell.load(Ordering::Relaxed) as f64;
            let new = if first {
                value
            } else {
                old + (value - old) / 8.0
            };
            cell.store(new.round() as u64, Ordering::Relaxed);
        };
        average(&self.ttfb_us, ttfb);
        average(&self.computed_milli, computed);
        let n = self.samples.load(Ordering::Relaxed);
        self.samples.store(n.saturating_add(1), Ordering::Relaxed);
    }

    /// (seconds to first byte, tokens computed) on average, once enough answers were seen.
    fn learnt(&self) -> Option<(f64, f64)> {
        if self.samples.load(Ordering::Relaxed) < MIN_SAMPLES {
            return None;
        }
        let secs = self.ttfb_us.load(Ordering::Relaxed) as f64 / 1e6;
        let tokens = self.computed_milli.load(Ordering::Relaxed) as f64 / 1000.0;
        Some((secs, tokens))
    }

    /// Prompt tokens a second, as answers showed it (queueing included, so never above the
    /// true rate: a prefill estimated from it errs long, against moving).
    fn rate(&self) -> Option<f64> {
        self.learnt()
            .and_then(|(secs, tokens)| (secs > 0.0 && tokens > 0.0).then(|| tokens / secs))
    }
}

/// The queue wait of each backend, in seconds, where learnt: its time to first byte beyond
/// what computing its prompts takes at the fastest rate any backend showed.
fn queue_waits(pool: &Pool) -> Vec<Option<f64>> {
    let peak = pool
        .backends
        .iter()
        .filter_map(|b| b.waits.rate())
        .fold(0.0_f64, f64::max);
    pool.backends
        .iter()
        .map(|b| {
            let (secs, tokens) = b.waits.learnt()?;
            let compute = if peak > 0.0 { tokens / peak } else { 0.0 };
            Some((secs - compute).max(0.0))
        })
        .collect()
}

/// The backend a known session of `bytes` on backend `from` costs less on, if the evidence
/// says one does: its queue wait plus the prefill there of the session's whole context is
/// shorter than the queue wait on `from`, and that wait is at least the pool's
/// `min_queue_wait_secs`. Only backends that take new sessions and are not in
/// `tried` are candidates; one with nothing learnt is never chosen, and nothing learnt of
/// `from` means it keeps the session.
pub(super) fn cheaper_elsewhere(
    pool: &Pool,
    from: usize,
    bytes: u64,
    tried: &[usize],
) -> Option<usize> {
    let waits = queue_waits(pool);
    let stay = waits[from].filter(|&w| w >= pool.affinity.min_queue_wait_secs)?;
    let mut best: Option<(f64, usize)> = None;
    for (i, b) in pool.backends.iter().enumerate() {
        if i == from || tried.contains(&i) || !b.takes_new() {
            continue;
        }
        let (Some(wait), Some(rate)) = (waits[i], b.waits.rate()) else {
            continue;
        };
        let prefill = bytes as f64 / b.bytes_per_token() / rate;
        let cost = wait + prefill;
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, i));
        }
    }
    best.filter(|&(cost, _)| stay > cost).map(|(_, i)| i)
}
