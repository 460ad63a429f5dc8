//! The process-wide budget for request bodies held in memory.
//!
//! Every request body is held whole until its request has been forwarded (for the session
//! fingerprint and for a retry), and `max_request_body_bytes` bounds only one of them: many
//! clients each sending an allowed body would otherwise hold that many times the limit. So
//! bodies are counted against `request_body_budget_bytes` as the parts holding them are
//! allocated, at most one part ahead of the bytes received (never as a `Content-Length`
//! declares them), and released when the request is done with them.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;

/// The first bytes of every body are never refused: small requests keep flowing while large
/// uploads fill the budget. As much as a request head may take, so that a connection holding
/// a small body holds no more than one holding a large head.
pub(crate) const ALWAYS_ADMITTED: u64 = 64 * 1024;

/// How long a client refused for the budget is told to wait (`Retry-After`, seconds): bodies
/// are released as soon as their requests have been forwarded, so room comes back quickly.
pub(crate) const RETRY_AFTER_SECS: u64 = 1;

/// Request body bytes held by all requests together, and the most they may hold.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    limit: u64,
    /// On a line of its own: every request with a body writes it, from every worker, and
    /// the proxy's read-mostly state sits next to it.
    held: CachePadded<AtomicU64>,
}

impl BodyBudget {
    /// A budget of `limit` bytes, none held.
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            held: CachePadded::new(AtomicU64::new(0)),
        }
    }

    /// Bytes held now by request bodies.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// The most bytes bodies may hold together.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// An empty charge for one body, which grows as the body's bytes arrive.
    pub(crate) fn charge(&self) -> BodyCharge<'_> {
        Charge::on(self)
    }
}

/// The bytes one request body holds against the budget reached through `B`; given back when
/// dropped. Borrowed ([`BodyCharge`]) where the body lives within one call; through an owner
/// of the budget where the body outlives it (the endpoint picker holds one across messages).
#[derive(Debug)]
pub(crate) struct Charge<B: Deref<Target = BodyBudget>> {
    budget: B,
    bytes: u64,
}

/// A charge borrowing the budget.
pub(crate) type BodyCharge<'a> = Charge<&'a BodyBudget>;

impl<B: Deref<Target = BodyBudget>> Charge<B> {
    /// An empty charge on the budget `budget` leads to.
    pub(crate) fn on(budget: B) -> Self {
        Self { budget, bytes: 0 }
    }

    /// Counts `n` more bytes of this body. Refused (nothing counted) when the body is past
    /// [`ALWAYS_ADMITTED`] and all bodies together would hold more than the budget. One atomic
    /// add per call, and one more to take it back only when refused.
    pub(crate) fn try_add(&mut self, n: u64) -> bool {
        if n == 0 {
            return true;
        }
        let before = self.budget.held.fetch_add(n, Ordering::Relaxed);
        let total = self.bytes + n;
        if total > ALWAYS_ADMITTED && before + n > self.budget.limit {
            self.budget.held.fetch_sub(n, Ordering::Relaxed);
            return false;
        }
        self.bytes = total;
        true
    }

    /// Bytes counted for this body so far.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<B: Deref<Target = BodyBudget>> Drop for Charge<B> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.held.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_past_the_first_bytes_are_refused_only_beyond_the_budget() {
        let budget = BodyBudget::new(ALWAYS_ADMITTED * 4);
        let mut large = budget.charge();
        assert!(large.try_add(ALWAYS_ADMITTED * 3));
        let mut second = budget.charge();
        assert!(second.try_add(ALWAYS_ADMITTED / 2));
        assert!(!second.try_add(ALWAYS_ADMITTED), "past the budget");
        assert_eq!(
            second.bytes(),
            ALWAYS_ADMITTED / 2,
            "a refusal counts nothing"
        );
        assert_eq!(budget.held(), ALWAYS_ADMITTED * 7 / 2);

        // A small body fits even with the budget full.
        assert!(large.try_add(ALWAYS_ADMITTED / 2));
        let mut small = budget.charge();
        assert!(small.try_add(ALWAYS_ADMITTED));
        assert!(!small.try_add(1));
        assert_eq!(budget.held(), ALWAYS_ADMITTED * 5);

        drop(large);
        drop(small);
        assert_eq!(budget.held(), ALWAYS_ADMITTED / 2);
        drop(second);
        assert_eq!(budget.held(), 0);
    }
}
