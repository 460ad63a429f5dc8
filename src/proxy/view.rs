//! What a forwarding worker reads for every request: the backend pool, its upstream
//! connections and the session table, kept per worker. A request takes its worker's view with
//! one reference count that no other worker's requests touch, where reading the router's
//! shared pool and the shared list of upstream pools wrote two locks and two counts that both
//! workers write on every request, each write taking the cache line from the other core.

use std::sync::Arc;

use crossbeam_utils::CachePadded;
use http::HeaderValue;
use parking_lot::RwLock;

use super::pool::WorkerPool;
use super::routing::{Pool, SessionTable};

/// One worker's view. The pool is the worker's own copy of the router's (its backends are
/// shared, so health, drain and load stay one state); a reload swaps in a new view, and a
/// request keeps the view it started with.
pub(crate) struct WorkerView {
    /// The backends and affinity settings.
    pub(crate) pool: Pool,
    /// The worker's upstream connections.
    pub(crate) upstream: Arc<WorkerPool>,
    /// The router's session table.
    pub(crate) sessions: Arc<SessionTable>,
    /// Each backend's name as the `X-Agentrace-Backend` response header carries it (none if
    /// not a valid value), by index in `pool`: copies of this worker's own, as cloning a
    /// header value writes a reference count, which no other worker should share.
    pub(crate) name_headers: Vec<Option<HeaderValue>>,
}

/// Every worker's view, each on cache lines of its own.
pub(crate) struct WorkerViews(Vec<CachePadded<RwLock<Arc<WorkerView>>>>);

impl WorkerViews {
    /// A view of `pool` for each of `upstream`'s pools, one per worker.
    pub(crate) fn new(
        pool: &Pool,
        upstream: Vec<Arc<WorkerPool>>,
        sessions: &Arc<SessionTable>,
    ) -> Self {
        Self(
            upstream
                .into_iter()
                .map(|upstream| CachePadded::new(RwLock::new(view(pool, upstream, sessions))))
                .collect(),
        )
    }

    /// Worker `worker`'s view now.
    pub(crate) fn get(&self, worker: usize) -> Arc<WorkerView> {
        self.0[worker].read().clone()
    }

    /// Workers served.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Every worker's upstream pool.
    pub(crate) fn upstream_pools(&self) -> Vec<Arc<WorkerPool>> {
        self.0.iter().map(|v| v.read().upstream.clone()).collect()
    }

    /// Swaps in views of `pool` over `upstream` (one per worker, as many as before).
    pub(crate) fn replace(&self, pool: &Pool, upstream: Vec<Arc<WorkerPool>>) {
        for (slot, upstream) in self.0.iter().zip(upstream) {
            let sessions = slot.read().sessions.clone();
            *slot.write() = view(pool, upstream, &sessions);
        }
    }
}

fn view(pool: &Pool, upstream: Arc<WorkerPool>, sessions: &Arc<SessionTable>) -> Arc<WorkerView> {
    Arc::new(WorkerView {
        pool: pool.clone(),
        upstream,
        sessions: sessions.clone(),
        name_headers: pool
            .backends
            .iter()
            .map(|b| HeaderValue::from_str(&b.name).ok())
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::proxy::config::UpstreamConfig;
    use crate::proxy::pool::connection_pool;
    use crate::proxy::routing::pool_of;

    fn upstream(n: usize) -> Vec<Arc<WorkerPool>> {
        let config = UpstreamConfig::default();
        (0..n)
            .map(|_| Arc::new(connection_pool(&config, false).unwrap()))
            .collect()
    }

    fn names(view: &WorkerView) -> Vec<String> {
        view.pool
            .backends
            .iter()
            .map(|b| b.name.to_string())
            .collect()
    }

    /// A reload reaches every worker: each view shows the new backends and the new upstream
    /// pool of its own worker, and all keep the one session table; the backends themselves
    /// are shared, so a backend's live state is one state whichever worker reads it.
    #[test]
    fn a_replacement_reaches_every_workers_view_and_keeps_one_session_table() {
        let sessions = Arc::new(SessionTable::new(10, Duration::from_secs(60)));
        let first = pool_of(&["a", "b"], 0.0);
        let views = WorkerViews::new(&first, upstream(3), &sessions);
        let headers = &views.get(1).name_headers;
        assert_eq!(
            headers,
            &[
                Some(HeaderValue::from_static("a")),
                Some(HeaderValue::from_static("b"))
            ]
        );
        assert!(Arc::ptr_eq(
            &views.get(0).pool.backends[0],
            &first.backends[0]
        ));
        let old_upstream = views.upstream_pools();

        let second = pool_of(&["c"], 0.0);
        let fresh = upstream(3);
        views.replace(&second, fresh.clone());
        for worker in 0..views.len() {
            let view = views.get(worker);
            assert_eq!(names(&view), ["c"], "worker {worker}");
            assert!(Arc::ptr_eq(&view.pool.backends[0], &second.backends[0]));
            assert!(Arc::ptr_eq(&view.upstream, &fresh[worker]));
            assert!(!Arc::ptr_eq(&view.upstream, &old_upstream[worker]));
            assert!(Arc::ptr_eq(&view.sessions, &sessions));
            assert_eq!(view.name_headers, [Some(HeaderValue::from_static("c"))]);
        }
    }
}
