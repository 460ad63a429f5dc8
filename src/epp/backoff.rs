//! Growing delays between attempts at the API server, so a server that answers at once with
//! nothing (a watch closed as soon as opened, empty list pages, expired continue tokens)
//! costs a few requests a minute instead of a busy loop.

use std::time::Duration;

use crate::random::Rng;

/// Exponential backoff with jitter, capped: each delay is half to all of the current step,
/// which doubles up to `max`; `reset` starts over from `min` after real progress.
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    step: Duration,
    /// Jitter, so pickers restarted together do not retry in step against one API server.
    rng: Rng,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        Self {
            min,
            max,
            step: min,
            rng: Rng::new(seed),
        }
    }

    /// The delay before the next attempt; the step after it is twice as long (up to `max`).
    pub(crate) fn next_delay(&mut self) -> Duration {
        let step = self.step;
        self.step = (step * 2).min(self.max);
        step.mul_f64(0.5 + 0.5 * self.rng.f64())
    }

    /// Progress was made: the next delay is the shortest again.
    pub(crate) fn reset(&mut self) {
        self.step = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_within_their_jitter_up_to_the_cap_and_reset_to_the_minimum() {
        let (min, max) = (Duration::from_millis(200), Duration::from_secs(30));
        let mut b = Backoff::new(min, max);
        let mut step = min;
        for _ in 0..12 {
            let d = b.next_delay();
            assert!(
                d >= step / 2 && d <= step,
                "{d:?} outside {step:?}/2..={step:?}"
            );
            step = (step * 2).min(max);
        }
        assert_eq!(step, max);
        b.reset();
        assert!(b.next_delay() <= min);
    }
}
