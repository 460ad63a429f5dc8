//! What the pool watch shows on the admin port's `/metrics`: its events by type, relists,
//! errors, backoffs, the endpoint sets it published, and how long ago it last heard from the
//! API server, so an operator sees a stuck or looping watch without reading logs.

use std::sync::Arc;

use metrics::{Counter, Gauge};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::proxy::metrics::ProxyMetrics;

/// Watch event types counted by name; any other counts as `other`.
const EVENT_TYPES: [&str; 6] = ["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "other"];

/// Why a list started over.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RelistReason {
    /// `410 Gone`: the resource version expired.
    Expired,
    /// The pool's selector or target ports changed.
    PoolChanged,
    /// The last session failed (its error is logged and counted).
    Error,
}

const RELIST_REASONS: [&str; 3] = ["expired", "pool_changed", "error"];

/// What a backoff waited after.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BackoffCase {
    /// A watch ended without moving its resource version, soon after it opened.
    WatchEndedEarly,
    /// A list page had no items but a `continue` token.
    EmptyListPage,
    /// A list's `continue` token expired (`410`) and the list started over.
    ContinueExpired,
    /// A session ended (relist or error) and the next one waits.
    SessionEnded,
}

const BACKOFF_CASES: [&str; 4] = [
    "watch_ended_early",
    "empty_list_page",
    "continue_expired",
    "session_ended",
];

/// The pool watch's metric handles.
pub(crate) struct WatchMetrics {
    events: Vec<Counter>,
    relists: Vec<Counter>,
    errors: Counter,
    backoffs: Vec<Counter>,
    endpoint_sets: Counter,
    endpoints: Gauge,
    /// When the API server last answered a list or sent a watch event (start, before that).
    last_success: Arc<Mutex<Instant>>,
}

impl WatchMetrics {
    /// Registers the watch's series in the admin port's recorder.
    pub(crate) fn new(m: &ProxyMetrics) -> Self {
        let events = EVENT_TYPES
            .iter()
            .map(|t| {
                m.counter(
                    "agentrace_epp_pool_watch_events_total",
                    &[("type", t)],
                    "InferencePool and pod watch events received, by type.",
                )
            })
            .collect();
        let relists = RELIST_REASONS
            .iter()
            .map(|r| {
                m.counter(
                    "agentrace_epp_pool_relists_total",
                    &[("reason", r)],
                    "Times the pool watch started over from a list, by reason.",
                )
            })
            .collect();
        let backoffs = BACKOFF_CASES
            .iter()
            .map(|c| {
                m.counter(
                    "agentrace_epp_pool_backoffs_total",
                    &[("after", c)],
                    "Delays the pool watch waited before asking the API server again, by what preceded them.",
                )
            })
            .collect();
        let last_success = Arc::new(Mutex::new(Instant::now()));
        let age = m.gauge(
            "agentrace_epp_pool_last_success_age_seconds",
            "Seconds since the API server last completed a list or sent a watch event (since start when it never has).",
        );
        let seen = last_success.clone();
        m.on_render(Box::new(move || {
            age.set(seen.lock().elapsed().as_secs_f64())
        }));
        Self {
            events,
            relists,
            errors: m.counter(
                "agentrace_epp_pool_watch_errors_total",
                &[],
                "Pool watch sessions that ended in an error (logged with its cause).",
            ),
            backoffs,
            endpoint_sets: m.counter(
                "agentrace_epp_pool_endpoint_sets_total",
                &[],
                "Endpoint sets the pool watch handed to placement (only when the ready set changed).",
            ),
            endpoints: m.gauge(
                "agentrace_epp_pool_endpoints",
                "Endpoints (ready pod and target port) in the last set the pool watch published.",
            ),
            last_success,
        }
    }

    pub(crate) fn event(&self, kind: &str) {
        let i = EVENT_TYPES[..5]
            .iter()
            .position(|t| *t == kind)
            .unwrap_or(5);
        self.events[i].increment(1);
        self.success();
    }

    /// The API server answered a list or a watch.
    pub(crate) fn success(&self) {
        *self.last_success.lock() = Instant::now();
    }

    pub(crate) fn relist(&self, reason: RelistReason) {
        self.relists[reason as usize].increment(1);
    }

    pub(crate) fn error(&self) {
        self.errors.increment(1);
    }

    pub(crate) fn backoff(&self, case: BackoffCase) {
        self.backoffs[case as usize].increment(1);
    }

    pub(crate) fn published(&self, endpoints: usize) {
        self.endpoint_sets.increment(1);
        self.endpoints.set(endpoints as f64);
    }
}
