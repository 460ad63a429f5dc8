//! Routing: the session key of a request, its rendezvous ranking, bounded load, where a new
//! session starts, and the session table.
//!
//! Placement is weighted rendezvous (highest-random-weight) hashing over the pool: every backend
//! gets a score from a published 64-bit hash of (session key, backend name) and the highest
//! score wins. Two proxies with the same backend names therefore agree without talking, removing
//! a backend moves only its sessions (each to its own second choice, so they spread), and adding
//! one takes about 1/(N+1) of the sessions. Hashing alone places a handful of sessions unevenly
//! (20 over 4 backends can land 7/8/3/2), and the crowded backend then evicts its own sessions'
//! prefixes. So a session's first turn stays with its first choice only while that backend
//! holds at most `context_factor` times its share of the active context (the body bytes of
//! sessions with a turn in flight or ended within the active window), else goes to whichever of its first `choices`
//! rendezvous choices holds the least. On top sit a bounded-load escape on requests in flight,
//! for sessions with no cache yet, and a session table that remembers, with an idle TTL and an
//! LRU bound, where every session is, so a session stays with the cache it built.
//!
//! A known session leaves a healthy backend only on evidence that staying costs more than a
//! full prefill elsewhere, as moving throws its cache away: the backend failed or was
//! removed; its reported usage shows it evicted the session's cache (the next turn then goes
//! to the backend holding the least active context among those it fits within, or, where none
//! has room, joins the backend furthest over its KV cache, so the loss stays in one place); or
//! the queue wait its answers show is longer than the session's prefill elsewhere
//! (`evidence`). Load alone is no evidence, nor is a KV cache of unknown size. Every move is
//! counted with its reason. Draining stops new sessions only.
//!
//! Layout: `hash` (published hashes), `key` (session keys and turns), this file (backends,
//! pool, decisions), `table` (the session table), `usage` (the cache a response reports),
//! `evidence` (queue wait against prefill).

mod evidence;
mod hash;
mod key;
mod order;
mod response_ids;
mod table;
#[cfg(test)]
mod tests;
mod usage;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use http::HeaderName;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::time::Instant;

use super::config::{AffinityConfig, BackendUrl, HealthConfig, Policy};
use super::metrics::BackendMetrics;

pub(crate) use evidence::Waits;
pub(crate) use hash::hash64;
use hash::{rendezvous_draw, rendezvous_score};
pub(crate) use key::{
    fingerprint_applies, fingerprint_key, header_key, session_key, SessionKey, Turn, TurnScan,
};
pub(crate) use response_ids::{previous_response_id, IdLearner, Origin, ResponseIds};
pub(crate) use table::{SessionId, SessionTable};
pub(crate) use usage::UsageScan;

// ---------------------------------------------------------------------------------------------
// Backends and the pool

/// Counts a request in flight on a backend until released (its response's last bytes went to
/// the client) or dropped (abandoned): what bounded load and the per-backend gauge read.
pub(crate) struct InFlight {
    backend: Arc<Backend>,
    counted: bool,
}

impl InFlight {
    /// Counts one more request on `backend`.
    pub(crate) fn new(backend: Arc<Backend>) -> Self {
        backend.in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            backend,
            counted: true,
        }
    }

    /// The backend the request is counted on.
    pub(crate) fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// The request no longer counts (once, however often called); the backend stays held.
    pub(crate) fn release(&mut self) {
        if std::mem::replace(&mut self.counted, false) {
            self.backend.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.release();
    }
}

/// One backend with its live state; shared by the router, the forwarding path and health checks.
///
/// Every request reads every backend's name hash, weight and health, and writes one backend's
/// requests in flight and active context from whichever worker serves it. Those two counters
/// sit on cache lines of their own (which also gives the `Arc` holding a backend counts of
/// their own), so a write by one worker does not take the fields all workers read away from
/// the other core.
#[derive(Debug)]
pub(crate) struct Backend {
    /// Configured name (seeds the rendezvous hash).
    pub name: Arc<str>,
    /// Where requests go.
    pub url: BackendUrl,
    /// Rendezvous weight.
    pub weight: f64,
    /// `hash64` of the name: combined with each key's hash for its score.
    pub seed: u64,
    /// Requests sent and not yet finished (body fully forwarded or aborted).
    pub in_flight: CachePadded<AtomicU64>,
    /// Sessions the session table places here.
    pub sessions: AtomicI64,
    /// Body bytes of the last request of each session placed here with a turn in flight or
    /// one ended within the active window: the context this backend must hold for its live
    /// sessions.
    pub active_bytes: CachePadded<AtomicI64>,
    /// Its KV cache in tokens, as its engine stated it (0 until then, or if it does not).
    pub kv_cache_tokens: AtomicU64,
    /// Request body bytes per prompt token, learnt from the usage its responses report, in
    /// thousandths (0 until a report): what turns its KV cache size into the body bytes
    /// active context is counted in.
    pub bytes_per_token_milli: AtomicU32,
    /// How far the health checker got learning `kv_cache_tokens` from the engine.
    pub kv_cache: crate::proxy::capacity::KvSizeState,
    /// Takes new requests only while healthy.
    pub healthy: AtomicBool,
    /// Draining: known sessions continue here, new sessions go elsewhere.
    pub draining: AtomicBool,
    /// Hysteresis counters of the health checker.
    pub health: Mutex<HealthCounters>,
    /// 5xx responses (or failed sends) in a row on the data path.
    pub consecutive_5xx: AtomicU32,
    /// The queue wait and prefill rate its answers showed: evidence for moving a session.
    pub waits: Waits,
    /// This backend's metric handles.
    pub metrics: BackendMetrics,
}

/// Consecutive probe and response outcomes, for hysteresis.
#[derive(Debug, Default)]
pub(crate) struct HealthCounters {
    /// Failed probes in a row.
    pub probe_failures: u32,
    /// Good probes in a row.
    pub probe_successes: u32,
    /// When the backend was last taken out (None while healthy, or until the checker sees it).
    pub out_since: Option<std::time::Instant>,
}

impl Backend {
    /// A healthy, undrained backend.
    pub(crate) fn new(name: &str, url: BackendUrl, weight: f64, metrics: BackendMetrics) -> Self {
        Self {
            name: Arc::from(name),
            url,
            weight,
            seed: hash64(0x5EED, name.as_bytes()),
            in_flight: CachePadded::new(AtomicU64::new(0)),
            sessions: AtomicI64::new(0),
            active_bytes: CachePadded::new(AtomicI64::new(0)),
            kv_cache_tokens: AtomicU64::new(0),
            bytes_per_token_milli: AtomicU32::new(0),
            kv_cache: Default::default(),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            health: Mutex::new(HealthCounters::default()),
            consecutive_5xx: AtomicU32::new(0),
            waits: Waits::default(),
            metrics,
        }
    }

    /// Healthy and not draining: may take new sessions.
    pub(crate) fn takes_new(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    fn load(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The active context this backend holds, in request bytes.
    fn held(&self) -> f64 {
        self.active_bytes.load(Ordering::Relaxed).max(0) as f64
    }

    /// The active context this backend holds, per unit of weight.
    fn held_per_weight(&self) -> f64 {
        self.held() / self.weight
    }

    /// Request body bytes per prompt token: as learnt from reported usage, else
    /// [`BYTES_PER_TOKEN`].
    pub(crate) fn bytes_per_token(&self) -> f64 {
        match self.bytes_per_token_milli.load(Ordering::Relaxed) {
            0 => BYTES_PER_TOKEN as f64,
            milli => f64::from(milli) / 1000.0,
        }
    }

    /// Learns from one response that a request body of `bytes` came to `prompt_tokens`
    /// tokens: a moving average over about the last eight reports, as prompts of one
    /// backend's tokenizer vary little in their ratio. Racing reports may lose one another's
    /// update, which the average absorbs.
    pub(crate) fn learn_bytes_per_token(&self, bytes: u64, prompt_tokens: u64) {
        if bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let ratio = (bytes as f64 / prompt_tokens as f64).clamp(0.5, 64.0);
        let learnt = match self.bytes_per_token_milli.load(Ordering::Relaxed) {
            0 => ratio,
            milli => {
                let old = f64::from(milli) / 1000.0;
                old + (ratio - old) / 8.0
            }
        };
        let milli = (learnt * 1000.0).round() as u32;
        // Settled, the average stays put: a store would still take the line from the other
        // workers, which read it.
        if self.bytes_per_token_milli.load(Ordering::Relaxed) != milli {
            self.bytes_per_token_milli.store(milli, Ordering::Relaxed);
        }
    }

    pub(crate) fn hold(&self, bytes: u64) {
        self.active_bytes.fetch_add(bytes as i64, Ordering::Relaxed);
    }

    pub(crate) fn release(&self, bytes: u64) {
        self.active_bytes.fetch_sub(bytes as i64, Ordering::Relaxed);
    }

    /// A session active here now counts `to` bytes where it counted `from`: one write, none
    /// when its size did not change.
    pub(crate) fn resize(&self, from: u64, to: u64) {
        if from != to {
            self.active_bytes
                .fetch_add(to as i64 - from as i64, Ordering::Relaxed);
        }
    }
}

/// Affinity settings in the form the hot path uses.
#[derive(Debug, Clone)]
pub(crate) struct AffinitySettings {
    /// Placement policy.
    pub policy: Policy,
    /// Session headers, parsed.
    pub headers: Vec<HeaderName>,
    /// Conversation fingerprint on or off.
    pub fingerprint: bool,
    /// Bounded-load factor (0: off).
    pub load_factor: f64,
    /// A new session whose first choice holds more than this multiple of its share of the
    /// active context starts elsewhere (0: never).
    pub context_factor: f64,
    /// ... on the backend holding the least active context among this many of its first
    /// rendezvous choices (1: the first choice always).
    pub choices: usize,
    /// Below this share of the previous prompt served from cache, a session's cache counts as
    /// lost on its backend (0: never judged).
    pub lost_cache_share: f64,
    /// The shortest queue wait that is evidence for moving a known session, in seconds.
    pub min_queue_wait_secs: f64,
    /// `affinity.kv_cache_tokens` (0: unknown).
    pub kv_cache_tokens: u64,
}

impl AffinitySettings {
    /// From a validated config section.
    pub(crate) fn from_config(c: &AffinityConfig) -> Self {
        Self {
            policy: c.policy,
            headers: c
                .headers
                .iter()
                .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
                .collect(),
            fingerprint: c.fingerprint,
            load_factor: c.load_factor,
            context_factor: c.context_factor,
            choices: c.choices,
            lost_cache_share: c.lost_cache_share,
            min_queue_wait_secs: c.min_queue_wait_ms / 1000.0,
            kv_cache_tokens: c.kv_cache_tokens,
        }
    }
}

/// An immutable snapshot of the backends and affinity settings; a reload swaps in a new one.
#[derive(Debug, Clone)]
pub(crate) struct Pool {
    /// The backends in configured order.
    pub backends: Vec<Arc<Backend>>,
    /// How to place requests.
    pub affinity: AffinitySettings,
    /// Probe and ejection settings (reloaded with the pool).
    pub health: HealthConfig,
}

impl Pool {
    /// The backend with this name.
    pub(crate) fn backend(&self, name: &str) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| &*b.name == name)
    }

    /// The rendezvous scores of `key_hash`, or values in the same order: with every weight
    /// equal, the draws the scores come from (exact in an `f64`), which saves a logarithm
    /// per backend and request.
    fn scorer(&self) -> impl Fn(u64, &Backend) -> f64 {
        let equal = self
            .backends
            .windows(2)
            .all(|pair| pair[0].weight == pair[1].weight);
        move |key_hash, b| {
            if equal {
                rendezvous_draw(key_hash, b.seed) as f64
            } else {
                rendezvous_score(key_hash, b.seed, b.weight)
            }
        }
    }

    /// The first entry of [`Pool::ranking`], without ranking the rest.
    pub(crate) fn first_choice(&self, key_hash: u64) -> usize {
        let score_of = self.scorer();
        let mut best: Option<(f64, usize)> = None;
        for (i, b) in self.backends.iter().enumerate() {
            let score = score_of(key_hash, b);
            let better = best.is_none_or(|(s, j)| {
                score
                    .total_cmp(&s)
                    .then_with(|| self.backends[j].name.cmp(&b.name))
                    .is_gt()
            });
            if better {
                best = Some((score, i));
            }
        }
        best.map_or(0, |(_, i)| i)
    }

    /// Backend indices by descending rendezvous score for `key_hash`.
    pub(crate) fn ranking(&self, key_hash: u64) -> Vec<usize> {
        let score_of = self.scorer();
        let mut scored: Vec<(f64, usize)> = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| (score_of(key_hash, b), i))
            .collect();
        scored.sort_unstable_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then_with(|| self.backends[a.1].name.cmp(&self.backends[b.1].name))
        });
        scored.into_iter().map(|(_, i)| i).collect()
    }
}

/// A pool of equal-weight backends named `names` (none reachable), placing by plain hash
/// with one choice: what the tests of routing and of what reads the pool start from.
#[cfg(test)]
pub(crate) fn pool_of(names: &[&str], load_factor: f64) -> Pool {
    let metrics = crate::proxy::metrics::ProxyMetrics::new();
    Pool {
        backends: names
            .iter()
            .map(|n| {
                Arc::new(Backend::new(
                    n,
                    BackendUrl::parse("http://127.0.0.1:1").unwrap(),
                    1.0,
                    metrics.backend(n),
                ))
            })
            .collect(),
        affinity: AffinitySettings {
            policy: Policy::Session,
            headers: vec![HeaderName::from_static("x-session-id")],
            fingerprint: true,
            load_factor,
            context_factor: 0.0,
            choices: 1,
            lost_cache_share: 0.5,
            min_queue_wait_secs: 0.0,
            kv_cache_tokens: 0,
        },
        health: HealthConfig::default(),
    }
}

// ---------------------------------------------------------------------------------------------
// Decisions

/// Why a request went where it went (the `outcome` label of the decision counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Outcome {
    /// The session's first rendezvous choice.
    Hash,
    /// The session table kept the session where an earlier spill or failover put it.
    Bound,
    /// The first choice was above the load bound; the next choice under it took the session.
    Spill,
    /// A new session's first choice held more than its bound of active context; another of its
    /// first `choices` backends, holding the least, took the session.
    Placed,
    /// The session's backend had lost its cache (the usage it reported); the backend holding
    /// the least active context took the session, as its next prefill is a full one anyway.
    Moved,
    /// The first choice was unhealthy, draining, removed or failed; the next choice took it.
    Failover,
    /// No session key (or policy `least_loaded`): fewest requests in flight.
    LeastLoaded,
    /// Policy `round_robin`: next backend in turn.
    RoundRobin,
}

impl Outcome {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Hash => "hash",
            Outcome::Bound => "bound",
            Outcome::Spill => "spill",
            Outcome::Placed => "placed",
            Outcome::Moved => "moved",
            Outcome::Failover => "failover",
            Outcome::LeastLoaded => "least_loaded",
            Outcome::RoundRobin => "round_robin",
        }
    }
}

/// Why a known session left the backend holding its cache (the `reason` label of the moves
/// counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoveReason {
    /// Its backend is unhealthy, or failed this request.
    Failed,
    /// Its backend is no longer in the pool.
    Removed,
    /// Its backend's reported usage showed the session's cache evicted.
    CacheLost,
    /// Its backend's queue wait is longer than the session's prefill elsewhere.
    QueueWait,
}

/// Every move reason, in the order the counter registers them.
pub(crate) const MOVE_REASONS: [MoveReason; 4] = [
    MoveReason::Failed,
    MoveReason::Removed,
    MoveReason::CacheLost,
    MoveReason::QueueWait,
];

impl MoveReason {
    /// Label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MoveReason::Failed => "failed",
            MoveReason::Removed => "removed",
            MoveReason::CacheLost => "cache_lost",
            MoveReason::QueueWait => "queue_wait",
        }
    }
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub(crate) struct Decision {
    /// Index into the pool's backends.
    pub index: usize,
    /// Why.
    pub outcome: Outcome,
    /// The session the table placed, when it did: what the response's usage reports on.
    pub session: Option<SessionId>,
    /// Why the session left the backend the table had it on, when it did.
    pub moved: Option<MoveReason>,
}

/// What the session table learns from a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Commit {
    /// Nothing: a question about where a request would go.
    Nothing,
    /// The placement.
    Placement,
    /// The placement, and that a turn of the session is now in flight: the caller ends it
    /// when the response does.
    Turn,
}

/// The router: the current pool, the session table and the round-robin cursor.
pub(crate) struct Router {
    pool: RwLock<Arc<Pool>>,
    /// Remembered sessions (shared with the forwarding workers' views).
    pub sessions: Arc<SessionTable>,
    /// Which backend created each Responses API response, bounded like the sessions.
    pub response_ids: Arc<ResponseIds>,
    cursor: AtomicUsize,
}

impl Router {
    /// A router over `pool` with a session table bounded by `max_sessions` and `ttl`.
    pub(crate) fn new(pool: Pool, max_sessions: usize, ttl: Duration) -> Self {
        Self {
            pool: RwLock::new(Arc::new(pool)),
            sessions: Arc::new(SessionTable::new(max_sessions, ttl)),
            response_ids: Arc::new(ResponseIds::new(max_sessions, ttl)),
            cursor: AtomicUsize::new(0),
        }
    }

    /// The current pool snapshot (a refcount bump).
    pub(crate) fn pool(&self) -> Arc<Pool> {
        self.pool.read().clone()
    }

    /// Swaps in a new pool (reload); requests already routed keep their snapshot.
    pub(crate) fn replace_pool(&self, pool: Pool) {
        *self.pool.write() = Arc::new(pool);
    }

    /// Chooses a backend for a request; `tried` lists backends that already failed for it.
    /// The session table learns what `commit` says.
    pub(crate) fn route(
        &self,
        pool: &Pool,
        key: Option<&SessionKey>,
        tried: &[usize],
        commit: Commit,
    ) -> Option<Decision> {
        if pool.backends.is_empty() {
            return None;
        }
        match (pool.affinity.policy, key) {
            (Policy::RoundRobin, _) => self.round_robin(pool, tried),
            (Policy::LeastLoaded, _) | (Policy::Session, None) => self.least_loaded(pool, tried),
            (Policy::Session, Some(key)) => self.by_session(pool, key, tried, commit),
        }
    }

    /// Sends a request to backend `index`, whatever its health or load: it continues a
    /// response that only that backend holds. Its session, if any, is placed there.
    pub(crate) fn route_to(
        &self,
        pool: &Pool,
        index: usize,
        key: Option<&SessionKey>,
        commit: Commit,
    ) -> Decision {
        let session = key.map(|key| {
            let id = self.sessions.id(key);
            if commit != Commit::Nothing {
                let mut slot = self.sessions.slot(id, Instant::now());
                let pinned = index != pool.first_choice(key.hash);
                let backend = &pool.backends[index];
                slot.place(backend, pinned, Outcome::Bound, key.turn.context_bytes);
                if commit == Commit::Turn {
                    slot.start_turn();
                }
            }
            id
        });
        Decision {
            index,
            outcome: Outcome::Bound,
            session,
            moved: None,
        }
    }

    fn usable(pool: &Pool, i: usize, tried: &[usize]) -> bool {
        pool.backends[i].takes_new() && !tried.contains(&i)
    }

    /// When nothing is healthy, sending somewhere beats refusing: pick among the untried
    /// undrained backends (health checks may simply be wrong).
    fn panic_usable(pool: &Pool, i: usize, tried: &[usize]) -> bool {
        !pool.backends[i].draining.load(Ordering::Relaxed) && !tried.contains(&i)
    }

    fn round_robin(&self, pool: &Pool, tried: &[usize]) -> Option<Decision> {
        let n = pool.backends.len();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let pick = |ok: &dyn Fn(usize) -> bool| (0..n).map(|k| (start + k) % n).find(|&i| ok(i));
        pick(&|i| Self::usable(pool, i, tried))
            .or_else(|| pick(&|i| Self::panic_usable(pool, i, tried)))
            .map(|index| Decision {
                index,
                outcome: Outcome::RoundRobin,
                session: None,
                moved: None,
            })
    }

    fn least_loaded(&self, pool: &Pool, tried: &[usize]) -> Option<Decision> {
        let n = pool.backends.len();
        // Rotate the starting point so ties do not all land on the first backend.
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let pick = |ok: &dyn Fn(usize) -> bool| {
            (0..n)
                .map(|k| (start + k) % n)
                .filter(|&i| ok(i))
                .min_by_key(|&i| pool.backends[i].load())
        };
        pick(&|i| Self::usable(pool, i, tried))
            .or_else(|| pick(&|i| Self::panic_usable(pool, i, tried)))
            .map(|index| Decision {
                index,
                outcome: Outcome::LeastLoaded,
                session: None,
                moved: None,
            })
    }

    fn by_session(
        &self,
        pool: &Pool,
        key: &SessionKey,
        tried: &[usize],
        commit: Commit,
    ) -> Option<Decision> {
        let plain = pool.first_choice(key.hash);
        // The full ranking is needed only when the first choice will not do.
        let mut ranking: Option<Vec<usize>> = None;
        let id = self.sessions.id(key);
        // Read and written under one lock of the session's shard.
        let mut slot = self.sessions.slot(id, Instant::now());
        let known = slot.known(&pool.backends);
        let removed = known.is_none() && slot.remembered();

        // A known session stays where it is while that backend is healthy, even when draining
        // (draining only stops new sessions) and even when a backend added since has taken its
        // key: only evidence moves it.
        let stays = known.filter(|k| {
            pool.backends[k.index].healthy.load(Ordering::Relaxed) && !tried.contains(&k.index)
        });
        let (index, outcome, moved) = match stays {
            Some(k) => {
                let bytes = key.turn.context_bytes;
                let lost = k
                    .cache_lost
                    .then(|| new_home(pool, k.index, bytes, tried))
                    .flatten();
                let queued = || evidence::cheaper_elsewhere(pool, k.index, bytes, tried);
                if let Some(i) = lost {
                    (i, Outcome::Moved, Some(MoveReason::CacheLost))
                } else if let Some(i) = queued() {
                    (i, Outcome::Moved, Some(MoveReason::QueueWait))
                } else if k.index == plain {
                    (k.index, Outcome::Hash, None)
                } else {
                    (k.index, Outcome::Bound, None)
                }
            }
            None => {
                let i = if Self::usable(pool, plain, tried) {
                    plain
                } else {
                    let ranked = ranking.get_or_insert_with(|| pool.ranking(key.hash));
                    ranked
                        .iter()
                        .copied()
                        .find(|&i| Self::usable(pool, i, tried))
                        .or_else(|| {
                            ranked
                                .iter()
                                .copied()
                                .find(|&i| Self::panic_usable(pool, i, tried))
                        })?
                };
                let moved = if known.is_some() {
                    Some(MoveReason::Failed)
                } else if removed {
                    Some(MoveReason::Removed)
                } else {
                    None
                };
                // A session nobody has placed yet starts where the least context is held.
                let fresh = known.is_none()
                    && !removed
                    && tried.is_empty()
                    && i == plain
                    && !key.turn.continues
                    && pool.affinity.choices > 1;
                let (mut i, mut outcome) = if fresh {
                    let ranked = ranking.get_or_insert_with(|| pool.ranking(key.hash));
                    let start = starting_backend(pool, ranked, key.turn.context_bytes);
                    let outcome = if start == plain {
                        Outcome::Hash
                    } else {
                        Outcome::Placed
                    };
                    (start, outcome)
                } else if i == plain && tried.is_empty() {
                    (i, Outcome::Hash)
                } else {
                    (i, Outcome::Failover)
                };
                // Bounded load, for a session with no cache anywhere yet: moving it costs
                // nothing. A continuing conversation the table does not know has its cache
                // where the hash put it.
                if known.is_none() && !removed && !key.turn.continues {
                    if let Some(limit) = load_limit(pool) {
                        if pool.backends[i].load() + 1 > limit {
                            let ranked = ranking.get_or_insert_with(|| pool.ranking(key.hash));
                            if let Some(next) = ranked.iter().copied().find(|&j| {
                                j != i
                                    && Self::usable(pool, j, tried)
                                    && pool.backends[j].load() < limit
                            }) {
                                i = next;
                                outcome = Outcome::Spill;
                            }
                        }
                    }
                }
                (i, outcome, moved)
            }
        };

        if commit != Commit::Nothing {
            if let Some(reason) = moved {
                tracing::debug!(
                    session = %format_args!("{:016x}", id.hash),
                    to = %pool.backends[index].name,
                    reason = reason.as_str(),
                    "session moved"
                );
            }
            let pinned = index != plain;
            slot.place(
                &pool.backends[index],
                pinned,
                outcome,
                key.turn.context_bytes,
            );
            if commit == Commit::Turn {
                slot.start_turn();
            }
        }
        Some(Decision {
            index,
            outcome,
            session: Some(id),
            moved,
        })
    }
}

/// Where a session whose backend `from` lost its cache goes, if anywhere (else it stays).
///
/// A cache holds its sessions' prefixes until their sum passes its size; past it, every
/// session there is evicted round after round, as the engine preempts and recomputes. So:
/// - to the backend holding the least active context per unit of weight among those that
///   would still hold no more than their KV cache with this session's `bytes` added (any
///   backend, where sizes are unknown), if it would hold less than `from` does now;
/// - when none has room and `from` is over its own cache, to the backend furthest over its
///   cache, if further than `from`: the loss gathers where it already is, and the others shed
///   sessions until they fit again. Spreading it would push every backend past its size.
fn new_home(pool: &Pool, from: usize, bytes: u64, tried: &[usize]) -> Option<usize> {
    if pool.affinity.lost_cache_share <= 0.0 {
        return None;
    }
    let others = || {
        pool.backends
            .iter()
            .enumerate()
            .filter(move |&(i, b)| i != from && b.takes_new() && !tried.contains(&i))
    };
    let with_room = others()
        .filter(|&(i, _)| has_room(pool, i, bytes))
        .map(|(i, b)| (b.held_per_weight() + bytes as f64 / b.weight, i))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((held, to)) = with_room {
        return (held < pool.backends[from].held_per_weight()).then_some(to);
    }
    let fill = |i: usize| kv_cache_bytes(pool, i).map(|kv| pool.backends[i].held() / kv);
    let own = fill(from).filter(|&f| f > 1.0)?;
    let (fullest, to) = others()
        .filter_map(|(i, _)| fill(i).map(|f| (f, i)))
        .max_by(|a, b| a.0.total_cmp(&b.0))?;
    (fullest > own).then_some(to)
}

/// Where a new session of `bytes` starts: its first choice (`ranked[0]`, usable) while that
/// stays within `context_factor` times its weight's share of all active context, this session's
/// included, as every replica then computes alike; past that bound, whichever of its first
/// `choices` backends holds the least active context per unit of weight (ties: rank order).
fn starting_backend(pool: &Pool, ranked: &[usize], bytes: u64) -> usize {
    let head = ranked[0];
    let factor = pool.affinity.context_factor;
    if factor <= 0.0 {
        return head;
    }
    let (held, weight) = pool
        .backends
        .iter()
        .filter(|b| b.takes_new())
        .fold((0.0, 0.0), |(h, w), b| (h + b.held(), w + b.weight));
    let first = &pool.backends[head];
    let bound = factor * (held + bytes as f64) / weight;
    if weight <= 0.0 || first.held_per_weight() + bytes as f64 / first.weight <= bound {
        return head;
    }
    let mut best = (first.held_per_weight(), head);
    for &i in ranked.iter().take(pool.affinity.choices).skip(1) {
        let b = &pool.backends[i];
        if b.takes_new() && b.held_per_weight() < best.0 {
            best = (b.held_per_weight(), i);
        }
    }
    best.1
}

/// Request bytes per token until a backend's usage reports teach it better: about what
/// English text and JSON take.
const BYTES_PER_TOKEN: u64 = 4;

/// Backend `i`'s KV cache in request bytes: `affinity.kv_cache_tokens` when set, else what its
/// `/metrics` stated; None when neither says.
fn kv_cache_bytes(pool: &Pool, i: usize) -> Option<f64> {
    let b = &pool.backends[i];
    let kv = match pool.affinity.kv_cache_tokens {
        0 => b.kv_cache_tokens.load(Ordering::Relaxed) as f64,
        set => set as f64 * b.weight,
    };
    (kv > 0.0).then_some(kv * b.bytes_per_token())
}

/// Whether backend `i` would still hold no more active context than its KV cache with `bytes`
/// more; always, when its size is unknown.
fn has_room(pool: &Pool, i: usize, bytes: u64) -> bool {
    kv_cache_bytes(pool, i).is_none_or(|kv| pool.backends[i].held() + bytes as f64 <= kv)
}

/// Requests in flight below which a backend takes any new session, whatever the others carry:
/// at low load `ceil(load_factor × average)` is 1 or 2, and a bound that low scatters new
/// sessions off their hash for no queue at all (vLLM router's `balance_abs_threshold` and SMG's
/// absolute balance threshold guard the same way).
const SPILL_FLOOR: u64 = 4;

/// The most requests a backend may have in flight before a new session spills to its next
/// choice: `ceil(load_factor × (in flight + 1) / backends taking new sessions)`, and never
/// below [`SPILL_FLOOR`].
fn load_limit(pool: &Pool) -> Option<u64> {
    let factor = pool.affinity.load_factor;
    if factor <= 0.0 {
        return None;
    }
    let (total, n) = pool
        .backends
        .iter()
        .filter(|b| b.takes_new())
        .fold((0u64, 0u64), |(t, n), b| (t + b.load(), n + 1));
    if n == 0 {
        return None;
    }
    Some(((factor * (total + 1) as f64 / n as f64).ceil() as u64).max(SPILL_FLOOR))
}
