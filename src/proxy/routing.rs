//! Routing: the session key of a request, its rendezvous ranking, bounded load and the session table.
//!
//! Placement is weighted rendezvous (highest-random-weight) hashing over the pool: every backend
//! gets a score from a stable 64-bit hash of (session key, backend name) and the highest score
//! wins. Two proxies with the same backend names therefore agree without talking, removing a
//! backend moves only its sessions (each to its own second choice, so they spread), and adding
//! one takes about 1/(N+1) of the sessions. On top of the hash sit a bounded-load escape and a
//! session table that remembers, with an idle TTL and an LRU bound, every placement that differs
//! from the plain hash, so a session stays with the cache it built.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use parking_lot::{Mutex, MutexGuard, RwLock};
use serde::Serialize;
use tokio::time::Instant;

use super::config::{AffinityConfig, BackendUrl, HealthConfig, Policy};
use super::fields::Fields;
use super::metrics::BackendMetrics;
use super::tap::KeySource;

// ---------------------------------------------------------------------------------------------
// Hashing

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;

/// The xxHash64 final avalanche: every input bit flips about half the output bits.
#[inline]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// A stable, fast 64-bit hash: a single-lane xxHash64-style loop over little-endian 8-byte
/// words (tail zero-padded, length mixed in) and the xxHash64 avalanche. It is our own
/// definition, frozen by the test vectors below, so every build and every replica places a
/// key identically; it is not the published xxHash64 output and is not for adversarial input.
pub fn hash64(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed ^ P3 ^ (bytes.len() as u64).wrapping_mul(P1);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let word = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        h ^= word.wrapping_mul(P2).rotate_left(31).wrapping_mul(P1);
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut tail = [0u8; 8];
        tail[..rest.len()].copy_from_slice(rest);
        h ^= u64::from_le_bytes(tail)
            .wrapping_mul(P2)
            .rotate_left(31)
            .wrapping_mul(P1);
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
    }
    avalanche(h)
}

/// Rendezvous score of a key for a backend: `-weight / ln(u)` with `u` uniform in (0, 1) drawn
/// from the hash of (key, backend), the form that gives each backend a share proportional to
/// its weight.
#[inline]
pub fn rendezvous_score(key_hash: u64, backend_seed: u64, weight: f64) -> f64 {
    let h = avalanche(key_hash ^ backend_seed);
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -weight / u.ln()
}

// ---------------------------------------------------------------------------------------------
// Session keys

/// A request's session key with its precomputed hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionKey {
    /// The key as shown in the admin API (a header value, or `fp:` + 16 hex digits).
    pub text: String,
    /// `hash64(0, text)`: the input of every rendezvous score.
    pub hash: u64,
    /// Where the key came from.
    pub source: KeySource,
}

impl SessionKey {
    /// A key from its text (hash computed here).
    pub fn new(text: String, source: KeySource) -> Self {
        let hash = hash64(0, text.as_bytes());
        Self { text, hash, source }
    }
}

#[derive(serde::Deserialize)]
struct ChatHead<'a> {
    #[serde(borrow, default)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    messages: Vec<ChatMessage<'a>>,
}

#[derive(serde::Deserialize)]
struct ChatMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a serde_json::value::RawValue>,
}

/// The session key of a request: the first configured header present and non-empty, else
/// (when enabled) the conversation fingerprint of a `POST …/chat/completions` body.
pub fn session_key(
    headers: &impl Fields,
    names: &[HeaderName],
    fingerprint: bool,
    method: &Method,
    path: &str,
    body: &[u8],
) -> Option<SessionKey> {
    for name in names {
        if let Some(bytes) = headers.first(name.as_str()) {
            if !bytes.is_empty() {
                let text = String::from_utf8_lossy(bytes).into_owned();
                return Some(SessionKey::new(text, KeySource::Header));
            }
        }
    }
    if fingerprint && method == Method::POST && path.ends_with("/chat/completions") {
        return conversation_fingerprint(body)
            .map(|fp| SessionKey::new(format!("fp:{fp:016x}"), KeySource::Fingerprint));
    }
    None
}

/// Hash of the model, the first system message and the first user message of a chat body:
/// the part of a conversation that every later turn repeats verbatim. Contents are hashed as
/// raw JSON text, so a client must serialise them the same way on every turn (they do).
pub fn conversation_fingerprint(body: &[u8]) -> Option<u64> {
    let head: ChatHead<'_> = serde_json::from_slice(body).ok()?;
    let mut system = None;
    let mut user = None;
    for m in &head.messages {
        match m.role.as_deref() {
            Some("system") | Some("developer") if system.is_none() => system = m.content,
            Some("user") if user.is_none() => user = m.content,
            _ => {}
        }
        if system.is_some() && user.is_some() {
            break;
        }
    }
    if system.is_none() && user.is_none() {
        return None;
    }
    let part = |i: u64, raw: Option<&serde_json::value::RawValue>| {
        raw.map_or(0, |r| hash64(i, r.get().as_bytes()))
    };
    let mut h = part(1, head.model);
    h = avalanche(h ^ part(2, system));
    h = avalanche(h.wrapping_add(part(3, user)));
    Some(h)
}

// ---------------------------------------------------------------------------------------------
// Backends and the pool

/// One backend with its live state; shared by the router, the forwarding path and health checks.
#[derive(Debug)]
pub struct Backend {
    /// Configured name (seeds the rendezvous hash).
    pub name: Arc<str>,
    /// The name as the `X-Agentrace-Backend` response header carries it (none if not ASCII).
    pub name_header: Option<http::HeaderValue>,
    /// Where requests go.
    pub url: BackendUrl,
    /// Rendezvous weight.
    pub weight: f64,
    /// `hash64` of the name: combined with each key's hash for its score.
    pub seed: u64,
    /// Requests sent and not yet finished (body fully forwarded or aborted).
    pub in_flight: AtomicU64,
    /// Sessions the session table places here.
    pub sessions: AtomicI64,
    /// Takes new requests only while healthy.
    pub healthy: AtomicBool,
    /// Draining: known sessions continue here, new sessions go elsewhere.
    pub draining: AtomicBool,
    /// Hysteresis counters of the health checker.
    pub health: Mutex<HealthCounters>,
    /// 5xx responses (or failed sends) in a row on the data path.
    pub consecutive_5xx: AtomicU32,
    /// This backend's metric handles.
    pub metrics: BackendMetrics,
}

/// Consecutive probe and response outcomes, for hysteresis.
#[derive(Debug, Default)]
pub struct HealthCounters {
    /// Failed probes in a row.
    pub probe_failures: u32,
    /// Good probes in a row.
    pub probe_successes: u32,
    /// When the backend was last taken out (None while healthy, or until the checker sees it).
    pub out_since: Option<std::time::Instant>,
}

impl Backend {
    /// A healthy, undrained backend.
    pub fn new(name: &str, url: BackendUrl, weight: f64, metrics: BackendMetrics) -> Self {
        Self {
            name: Arc::from(name),
            name_header: http::HeaderValue::from_str(name).ok(),
            url,
            weight,
            seed: hash64(0x5EED, name.as_bytes()),
            in_flight: AtomicU64::new(0),
            sessions: AtomicI64::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            health: Mutex::new(HealthCounters::default()),
            consecutive_5xx: AtomicU32::new(0),
            metrics,
        }
    }

    /// Healthy and not draining: may take new sessions.
    pub fn takes_new(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.draining.load(Ordering::Relaxed)
    }

    fn load(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// Affinity settings in the form the hot path uses.
#[derive(Debug, Clone)]
pub struct AffinitySettings {
    /// Placement policy.
    pub policy: Policy,
    /// Session headers, parsed.
    pub headers: Vec<HeaderName>,
    /// Conversation fingerprint on or off.
    pub fingerprint: bool,
    /// Bounded-load factor (0: off).
    pub load_factor: f64,
}

impl AffinitySettings {
    /// From a validated config section.
    pub fn from_config(c: &AffinityConfig) -> Self {
        Self {
            policy: c.policy,
            headers: c
                .headers
                .iter()
                .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
                .collect(),
            fingerprint: c.fingerprint,
            load_factor: c.load_factor,
        }
    }
}

/// An immutable snapshot of the backends and affinity settings; a reload swaps in a new one.
#[derive(Debug)]
pub struct Pool {
    /// The backends in configured order.
    pub backends: Vec<Arc<Backend>>,
    /// How to place requests.
    pub affinity: AffinitySettings,
    /// Probe and ejection settings (reloaded with the pool).
    pub health: HealthConfig,
}

impl Pool {
    /// The backend with this name.
    pub fn backend(&self, name: &str) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| &*b.name == name)
    }

    fn index_of(&self, backend: &Arc<Backend>) -> Option<usize> {
        self.backends.iter().position(|b| Arc::ptr_eq(b, backend))
    }

    /// The first entry of [`Pool::ranking`], without ranking the rest.
    pub fn first_choice(&self, key_hash: u64) -> usize {
        let mut best: Option<(f64, usize)> = None;
        for (i, b) in self.backends.iter().enumerate() {
            let score = rendezvous_score(key_hash, b.seed, b.weight);
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
    pub fn ranking(&self, key_hash: u64) -> Vec<usize> {
        let mut scored: Vec<(f64, usize)> = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| (rendezvous_score(key_hash, b.seed, b.weight), i))
            .collect();
        scored.sort_unstable_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then_with(|| self.backends[a.1].name.cmp(&self.backends[b.1].name))
        });
        scored.into_iter().map(|(_, i)| i).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Decisions

/// Why a request went where it went (the `outcome` label of the decision counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The session's first rendezvous choice.
    Hash,
    /// The session table kept the session where an earlier spill or failover put it.
    Bound,
    /// The first choice was above the load bound; the next choice under it took the session.
    Spill,
    /// The first choice was unhealthy, draining, removed or failed; the next choice took it.
    Failover,
    /// No session key (or policy `least_loaded`): fewest requests in flight.
    LeastLoaded,
    /// Policy `round_robin`: next backend in turn.
    RoundRobin,
}

impl Outcome {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Hash => "hash",
            Outcome::Bound => "bound",
            Outcome::Spill => "spill",
            Outcome::Failover => "failover",
            Outcome::LeastLoaded => "least_loaded",
            Outcome::RoundRobin => "round_robin",
        }
    }
}

/// Where one request goes.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Index into the pool's backends.
    pub index: usize,
    /// Why.
    pub outcome: Outcome,
}

/// The router: the current pool, the session table and the round-robin cursor.
pub struct Router {
    pool: RwLock<Arc<Pool>>,
    /// Remembered sessions.
    pub sessions: SessionTable,
    cursor: AtomicUsize,
}

impl Router {
    /// A router over `pool` with a session table bounded by `max_sessions` and `ttl`.
    pub fn new(pool: Pool, max_sessions: usize, ttl: Duration) -> Self {
        Self {
            pool: RwLock::new(Arc::new(pool)),
            sessions: SessionTable::new(max_sessions, ttl),
            cursor: AtomicUsize::new(0),
        }
    }

    /// The current pool snapshot (a refcount bump).
    pub fn pool(&self) -> Arc<Pool> {
        self.pool.read().clone()
    }

    /// Swaps in a new pool (reload); requests already routed keep their snapshot.
    pub fn replace_pool(&self, pool: Pool) {
        *self.pool.write() = Arc::new(pool);
    }

    /// Chooses a backend for a request; `tried` lists backends that already failed for it.
    /// With `commit`, the session table learns the placement.
    pub fn route(
        &self,
        pool: &Pool,
        key: Option<&SessionKey>,
        tried: &[usize],
        commit: bool,
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
            })
    }

    fn by_session(
        &self,
        pool: &Pool,
        key: &SessionKey,
        tried: &[usize],
        commit: bool,
    ) -> Option<Decision> {
        let plain = pool.first_choice(key.hash);
        // The full ranking is needed only when the first choice will not do.
        let mut ranking: Option<Vec<usize>> = None;
        let id = self.sessions.id(key);
        let known = self
            .sessions
            .get(id)
            .and_then(|(backend, pinned)| pool.index_of(&backend).map(|i| (i, pinned)));

        // A known session stays where it is while that backend is healthy, even when draining:
        // draining only stops new sessions. An unpinned entry follows the hash (a backend added
        // since may have taken the key).
        let sticky = known.filter(|&(i, pinned)| {
            (pinned || i == plain)
                && pool.backends[i].healthy.load(Ordering::Relaxed)
                && !tried.contains(&i)
        });
        let (mut index, mut outcome) = match sticky {
            Some((i, true)) => (i, Outcome::Bound),
            Some((i, false)) => (i, Outcome::Hash),
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
                let outcome = if i == plain && tried.is_empty() {
                    Outcome::Hash
                } else {
                    Outcome::Failover
                };
                (i, outcome)
            }
        };

        if let Some(limit) = load_limit(pool) {
            if pool.backends[index].load() + 1 > limit {
                let ranked = ranking.get_or_insert_with(|| pool.ranking(key.hash));
                if let Some(i) = ranked.iter().copied().find(|&i| {
                    i != index && Self::usable(pool, i, tried) && pool.backends[i].load() < limit
                }) {
                    index = i;
                    outcome = Outcome::Spill;
                }
            }
        }

        if commit {
            let pinned = index != plain;
            self.sessions
                .put(id, &pool.backends[index], pinned, outcome);
        }
        Some(Decision { index, outcome })
    }
}

/// The most requests a backend may have in flight before a session spills to its next choice:
/// `ceil(load_factor × (in flight + 1) / backends taking new sessions)`.
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
    Some((factor * (total + 1) as f64 / n as f64).ceil() as u64)
}

// ---------------------------------------------------------------------------------------------
// Session table

const SHARDS: usize = 16;

/// Which of `n` shards holds `key`.
fn shard_index(id: SessionId, n: usize) -> usize {
    (id.tag as usize) % n
}

/// How the table names a session: a fixed-size digest of its key, never the key itself, so
/// that an entry costs the same whatever the length of the key a client sends (a header value
/// may be 64 KiB). 128 bits: the key's placement hash, plus SipHash-1-3 of the key under a
/// random key of the table's own, which no client can compute, so no client can make its key
/// collide with another session's to move or take over that session's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId {
    /// `SessionKey::hash`.
    hash: u64,
    /// The keyed hash; also picks the shard, so no client can crowd one shard either.
    tag: u64,
}

/// What the table knows about one session.
#[derive(Debug, Clone)]
struct Entry {
    backend: Arc<Backend>,
    pinned: bool,
    outcome: Outcome,
    seq: u64,
    last_used: Instant,
}

#[derive(Default)]
struct Shard {
    /// Seeded per process, and several times cheaper than SipHash (the ids are keyed already).
    map: HashMap<SessionId, Entry, foldhash::fast::RandomState>,
    /// Entries by last use, with the id and that last use: the first is the least recently
    /// used (and the idlest), checked without a lookup in `map`.
    order: BTreeMap<u64, (SessionId, Instant)>,
    next_seq: u64,
}

/// A session as shown by `GET /admin/sessions/{key}`.
#[derive(Debug, Clone, Serialize)]
pub struct SessionView {
    /// Backend the table places the session on.
    pub backend: String,
    /// True when that placement overrides the plain hash (a binding).
    pub bound: bool,
    /// Why it was last placed there.
    pub last_outcome: Outcome,
    /// Seconds since the session's last request.
    pub idle_secs: f64,
}

/// Remembered sessions, sharded by key to keep lock hold times short. Every keyed request
/// refreshes its entry; entries that override the hash ("bound") are what make a spilled or
/// failed-over session stick. Bounded by an idle TTL and an LRU size limit; each entry has
/// the same size, as keys are kept as a [`SessionId`].
pub struct SessionTable {
    /// Always [`SHARDS`] of them; keys spread over the first `in_use`.
    shards: Vec<Mutex<Shard>>,
    /// The random key of [`SessionId::tag`], drawn when the table is made.
    tag_key: std::hash::RandomState,
    /// How many shards keys spread over: one for a small table, so that its LRU bound is
    /// exact, else all. Changed only while every shard is locked, together with moving each
    /// entry to the shard its key maps to then, so no lookup ever searches the wrong shard.
    in_use: AtomicUsize,
    max_sessions: AtomicUsize,
    ttl_ms: AtomicU64,
    bound: AtomicI64,
}

/// Shards used for a table of at most `max_sessions`.
fn shards_for(max_sessions: usize) -> usize {
    if max_sessions >= SHARDS * 1024 {
        SHARDS
    } else {
        1
    }
}

impl SessionTable {
    /// An empty table.
    pub fn new(max_sessions: usize, ttl: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            tag_key: std::hash::RandomState::new(),
            in_use: AtomicUsize::new(shards_for(max_sessions)),
            max_sessions: AtomicUsize::new(max_sessions),
            ttl_ms: AtomicU64::new(ttl.as_millis() as u64),
            bound: AtomicI64::new(0),
        }
    }

    /// Applies new bounds (reload). A new size limit takes effect at once: when it changes
    /// how many shards are used, every entry moves to its new shard, and entries over the
    /// limit are evicted least recently used first, so the counts stay true. A new TTL takes
    /// effect as entries are touched or swept.
    pub fn set_limits(&self, max_sessions: usize, ttl: Duration) {
        self.ttl_ms.store(ttl.as_millis() as u64, Ordering::Relaxed);
        // In index order, as nothing else ever holds two shard locks.
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        self.max_sessions.store(max_sessions, Ordering::Relaxed);
        let n = shards_for(max_sessions);
        if n != self.in_use.load(Ordering::Relaxed) {
            let mut entries: Vec<(SessionId, Entry)> = Vec::new();
            for shard in guards.iter_mut() {
                shard.order.clear();
                entries.extend(shard.map.drain());
            }
            // Oldest first, so each shard's order stays least recently used first.
            entries.sort_by_key(|(_, e)| e.last_used);
            for (id, mut entry) in entries {
                let shard = &mut *guards[shard_index(id, n)];
                entry.seq = shard.next_seq;
                shard.next_seq += 1;
                shard.order.insert(entry.seq, (id, entry.last_used));
                shard.map.insert(id, entry);
            }
            self.in_use.store(n, Ordering::Release);
        }
        let cap = (max_sessions / n).max(1);
        for shard in guards.iter_mut() {
            while shard.map.len() > cap {
                let Some((&oldest, _)) = shard.order.first_key_value() else {
                    break;
                };
                self.evict(shard, oldest);
            }
        }
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Relaxed))
    }

    /// How the table names the session of `key`: what [`SessionTable::get`] and
    /// [`SessionTable::put`] take, computed once per request.
    pub fn id(&self, key: &SessionKey) -> SessionId {
        SessionId {
            hash: key.hash,
            tag: self.tag_key.hash_one(key.text.as_bytes()),
        }
    }

    /// The locked shard of `id` and the per-shard size limit.
    fn lock(&self, id: SessionId) -> (MutexGuard<'_, Shard>, usize) {
        loop {
            let n = self.in_use.load(Ordering::Acquire);
            let guard = self.shards[shard_index(id, n)].lock();
            // The layout changes only under every shard's lock: unchanged now, it holds
            // until this guard is dropped. Changed, the key may live elsewhere: look again.
            if self.in_use.load(Ordering::Acquire) == n {
                return (
                    guard,
                    (self.max_sessions.load(Ordering::Relaxed) / n).max(1),
                );
            }
        }
    }

    /// The session's backend and whether it is bound, unless unknown or idle past the TTL.
    pub fn get(&self, id: SessionId) -> Option<(Arc<Backend>, bool)> {
        let (mut shard, _) = self.lock(id);
        let entry = shard.map.get(&id)?;
        if entry.last_used.elapsed() > self.ttl() {
            let seq = entry.seq;
            self.evict(&mut shard, seq);
            return None;
        }
        Some((entry.backend.clone(), entry.pinned))
    }

    /// A read-only view for the admin API.
    pub fn view(&self, id: SessionId) -> Option<SessionView> {
        let (shard, _) = self.lock(id);
        let e = shard.map.get(&id)?;
        let idle = e.last_used.elapsed();
        (idle <= self.ttl()).then(|| SessionView {
            backend: e.backend.name.to_string(),
            bound: e.pinned,
            last_outcome: e.outcome,
            idle_secs: idle.as_secs_f64(),
        })
    }

    /// Records a placement and refreshes the session's last use.
    pub fn put(&self, id: SessionId, backend: &Arc<Backend>, pinned: bool, outcome: Outcome) {
        let now = Instant::now();
        let ttl = self.ttl();
        let (mut guard, cap) = self.lock(id);
        let Shard {
            map,
            order,
            next_seq,
        } = &mut *guard;
        let seq = *next_seq;
        *next_seq += 1;
        match map.get_mut(&id) {
            Some(e) => {
                order.remove(&e.seq);
                if !Arc::ptr_eq(&e.backend, backend) {
                    e.backend.sessions.fetch_sub(1, Ordering::Relaxed);
                    backend.sessions.fetch_add(1, Ordering::Relaxed);
                    e.backend = backend.clone();
                }
                if e.pinned != pinned {
                    self.bound
                        .fetch_add(if pinned { 1 } else { -1 }, Ordering::Relaxed);
                    e.pinned = pinned;
                }
                e.outcome = outcome;
                e.seq = seq;
                e.last_used = now;
                order.insert(seq, (id, now));
            }
            None => {
                backend.sessions.fetch_add(1, Ordering::Relaxed);
                if pinned {
                    self.bound.fetch_add(1, Ordering::Relaxed);
                }
                map.insert(
                    id,
                    Entry {
                        backend: backend.clone(),
                        pinned,
                        outcome,
                        seq,
                        last_used: now,
                    },
                );
                order.insert(seq, (id, now));
            }
        }
        // Make room and drop what has idled out, oldest first.
        let shard = &mut *guard;
        while let Some((&oldest, &(_, last_used))) = shard.order.first_key_value() {
            if shard.map.len() > cap || now.saturating_duration_since(last_used) > ttl {
                self.evict(shard, oldest);
            } else {
                break;
            }
        }
    }

    fn evict(&self, shard: &mut Shard, seq: u64) {
        if let Some((k, _)) = shard.order.remove(&seq) {
            if let Some(e) = shard.map.remove(&k) {
                e.backend.sessions.fetch_sub(1, Ordering::Relaxed);
                if e.pinned {
                    self.bound.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Drops every session idle past the TTL (run periodically so counts stay true).
    pub fn sweep(&self) {
        let ttl = self.ttl();
        let now = Instant::now();
        for shard in &self.shards {
            let mut shard = shard.lock();
            while let Some((&oldest, &(_, last_used))) = shard.order.first_key_value() {
                if now.saturating_duration_since(last_used) <= ttl {
                    break;
                }
                self.evict(&mut shard, oldest);
            }
        }
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// True when no session is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sessions whose placement overrides the plain hash.
    pub fn bound(&self) -> u64 {
        self.bound.load(Ordering::Relaxed).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::fields::WireFields;
    use crate::proxy::metrics::ProxyMetrics;

    fn pool_of(names: &[&str], load_factor: f64) -> Pool {
        let metrics = ProxyMetrics::new();
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
            },
            health: HealthConfig::default(),
        }
    }

    fn id_of(t: &SessionTable, key: &str) -> SessionId {
        t.id(&SessionKey::new(key.to_string(), KeySource::Header))
    }

    /// A session costs the table the same whatever its key's length: the table keeps a
    /// 16-byte id, equal for equal keys, different for keys that differ only in their last
    /// byte 60 KiB in, and keyed per table (another table's ids differ).
    #[test]
    fn session_ids_have_a_fixed_size_whatever_the_key() {
        assert_eq!(std::mem::size_of::<SessionId>(), 16);
        let t = SessionTable::new(10, Duration::from_secs(60));
        let long = "k".repeat(60 * 1024);
        let other = format!("{}j", &long[1..]);
        assert_eq!(id_of(&t, &long), id_of(&t, &long.clone()));
        assert_ne!(id_of(&t, &long), id_of(&t, &other));
        let elsewhere = SessionTable::new(10, Duration::from_secs(60));
        assert_ne!(id_of(&t, "s").tag, id_of(&elsewhere, "s").tag);
        assert_eq!(id_of(&t, "s").hash, id_of(&elsewhere, "s").hash);
    }

    fn router(pool: Pool) -> Router {
        Router::new(pool, 1_000_000, Duration::from_secs(1800))
    }

    fn place(r: &Router, key: &str) -> String {
        let pool = r.pool();
        let k = SessionKey::new(key.to_string(), KeySource::Header);
        let d = r.route(&pool, Some(&k), &[], true).unwrap();
        pool.backends[d.index].name.to_string()
    }

    /// Frozen vectors: a change here would move every session of every deployed proxy.
    #[test]
    fn hash_is_stable_across_builds() {
        let vectors: [(&[u8], u64); 4] = [
            (b"", 0xd8a3_1015_0df9_0781),
            (b"abc", 0xd4ed_985a_6ecd_ad96),
            (b"session-1", 0x386f_bd96_3bde_8c87),
            (b"django__django-16899__repeat_2", 0x44b0_970f_9c02_88a1),
        ];
        for (input, expected) in vectors {
            assert_eq!(
                hash64(0, input),
                expected,
                "{:?}",
                std::str::from_utf8(input)
            );
        }
        assert_ne!(hash64(0, b"abc"), hash64(1, b"abc"));
        assert_ne!(hash64(0, b"abcdefgh"), hash64(0, b"abcdefgh\0"));
    }

    #[test]
    fn same_key_always_reaches_the_same_backend() {
        let r = router(pool_of(&["a", "b", "c", "d"], 0.0));
        for i in 0..200 {
            let key = format!("s{i}");
            let first = place(&r, &key);
            for _ in 0..5 {
                assert_eq!(place(&r, &key), first);
            }
        }
    }

    /// The cheap first choice is always the head of the full ranking, weights and ties included.
    #[test]
    fn first_choice_is_the_head_of_the_ranking() {
        let mut pool = pool_of(&["a", "b", "c", "d", "e"], 1.5);
        let weighted = Arc::new(Backend::new(
            "w",
            BackendUrl::parse("http://127.0.0.1:1").unwrap(),
            3.0,
            ProxyMetrics::new().backend("w"),
        ));
        pool.backends.push(weighted);
        for k in 0..5_000 {
            let h = hash64(0, format!("key-{k}").as_bytes());
            assert_eq!(pool.first_choice(h), pool.ranking(h)[0], "key-{k}");
        }
    }

    /// 10,000 random keys over 4 equal backends land within ±10% of 2,500 each.
    #[test]
    fn random_keys_spread_evenly() {
        let r = router(pool_of(&["gpu-0", "gpu-1", "gpu-2", "gpu-3"], 0.0));
        let mut counts: HashMap<String, usize> = HashMap::new();
        let mut rng = rand::thread_rng();
        for _ in 0..10_000 {
            let key = format!("{:032x}", rand::Rng::gen::<u128>(&mut rng));
            *counts.entry(place(&r, &key)).or_default() += 1;
        }
        for (name, n) in &counts {
            assert!(
                (2250..=2750).contains(n),
                "{name}: {n} of 10000 ({counts:?})"
            );
        }
        assert_eq!(counts.len(), 4);
    }

    #[test]
    fn weights_give_proportional_shares() {
        let metrics = ProxyMetrics::new();
        let mut pool = pool_of(&["a", "b"], 0.0);
        pool.backends[1] = Arc::new(Backend::new(
            "b",
            BackendUrl::parse("http://127.0.0.1:1").unwrap(),
            3.0,
            metrics.backend("b"),
        ));
        let r = router(pool);
        let on_b = (0..8000)
            .filter(|i| place(&r, &format!("k{i}")) == "b")
            .count();
        assert!(
            (5600..=6400).contains(&on_b),
            "b got {on_b} of 8000, expected ~6000"
        );
    }

    /// Removing a backend moves exactly the keys it held, spread over all the others.
    #[test]
    fn removing_a_backend_moves_only_its_keys() {
        let before = router(pool_of(&["a", "b", "c", "d"], 0.0));
        let after = router(pool_of(&["a", "b", "d"], 0.0));
        let mut moved_to: HashMap<String, usize> = HashMap::new();
        for i in 0..4000 {
            let key = format!("key-{i}");
            let (x, y) = (place(&before, &key), place(&after, &key));
            if x == "c" {
                *moved_to.entry(y).or_default() += 1;
            } else {
                assert_eq!(x, y, "{key} moved from {x} to {y} though {x} stayed");
            }
        }
        assert_eq!(
            moved_to.len(),
            3,
            "c's keys spread over every survivor: {moved_to:?}"
        );
        for n in moved_to.values() {
            assert!(*n > 200, "{moved_to:?}");
        }
    }

    #[test]
    fn adding_a_backend_moves_about_one_in_n_plus_one() {
        let before = router(pool_of(&["a", "b", "c"], 0.0));
        let after = router(pool_of(&["a", "b", "c", "d"], 0.0));
        let mut moved = 0;
        for i in 0..4000 {
            let key = format!("key-{i}");
            let (x, y) = (place(&before, &key), place(&after, &key));
            if x != y {
                assert_eq!(y, "d", "keys only move to the new backend");
                moved += 1;
            }
        }
        assert!(
            (800..=1200).contains(&moved),
            "moved {moved} of 4000, expected ~1000"
        );
    }

    /// A session that failed over stays on its new backend when the old one recovers.
    #[test]
    fn recovered_backend_does_not_pull_sessions_back() {
        let r = router(pool_of(&["a", "b", "c"], 0.0));
        let key = "sticky-session";
        let home = place(&r, key);
        let pool = r.pool();
        let home_backend = pool.backend(&home).unwrap().clone();
        home_backend.healthy.store(false, Ordering::Relaxed);
        let away = place(&r, key);
        assert_ne!(away, home);
        assert_eq!(r.sessions.bound(), 1);
        home_backend.healthy.store(true, Ordering::Relaxed);
        assert_eq!(place(&r, key), away);
        // A key never seen before still goes to the recovered backend by hash.
        let fresh = (0..1000)
            .map(|i| format!("fresh-{i}"))
            .find(|k| {
                let p = r.pool();
                let h = SessionKey::new(k.clone(), KeySource::Header).hash;
                *p.backends[p.ranking(h)[0]].name == *home
            })
            .unwrap();
        assert_eq!(place(&r, &fresh), home);
    }

    #[test]
    fn draining_keeps_known_sessions_and_sends_new_ones_elsewhere() {
        let r = router(pool_of(&["a", "b", "c"], 0.0));
        let known = "known";
        let home = place(&r, known);
        r.pool()
            .backend(&home)
            .unwrap()
            .draining
            .store(true, Ordering::Relaxed);
        assert_eq!(place(&r, known), home);
        let pool = r.pool();
        let new_key = (0..1000)
            .map(|i| format!("new-{i}"))
            .find(|k| {
                let h = SessionKey::new(k.clone(), KeySource::Header).hash;
                *pool.backends[pool.ranking(h)[0]].name == *home
            })
            .unwrap();
        assert_ne!(place(&r, &new_key), home);
    }

    #[test]
    fn bounded_load_spills_then_the_session_sticks() {
        let r = router(pool_of(&["a", "b", "c", "d"], 1.5));
        let key = "hot";
        let home = place(&r, key);
        let pool = r.pool();
        let home_b = pool.backend(&home).unwrap().clone();
        home_b.in_flight.store(10, Ordering::Relaxed);
        let spilled = place(&r, key);
        assert_ne!(spilled, home);
        home_b.in_flight.store(0, Ordering::Relaxed);
        assert_eq!(
            place(&r, key),
            spilled,
            "the spilled session stays with its new cache"
        );
    }

    #[test]
    fn failed_backend_is_skipped_on_retry_and_session_rebinds() {
        let r = router(pool_of(&["a", "b", "c"], 0.0));
        let pool = r.pool();
        let k = SessionKey::new("retry-me".into(), KeySource::Header);
        let first = r.route(&pool, Some(&k), &[], true).unwrap();
        let second = r.route(&pool, Some(&k), &[first.index], true).unwrap();
        assert_ne!(first.index, second.index);
        assert_eq!(second.outcome, Outcome::Failover);
        let third = r.route(&pool, Some(&k), &[], true).unwrap();
        assert_eq!(third.index, second.index);
        assert_eq!(third.outcome, Outcome::Bound);
    }

    #[test]
    fn no_key_goes_to_the_least_loaded_backend() {
        let r = router(pool_of(&["a", "b", "c"], 0.0));
        let pool = r.pool();
        pool.backends[0].in_flight.store(3, Ordering::Relaxed);
        pool.backends[1].in_flight.store(1, Ordering::Relaxed);
        pool.backends[2].in_flight.store(2, Ordering::Relaxed);
        for _ in 0..5 {
            let d = r.route(&pool, None, &[], true).unwrap();
            assert_eq!(d.index, 1);
            assert_eq!(d.outcome, Outcome::LeastLoaded);
        }
    }

    #[test]
    fn session_table_evicts_least_recently_used_and_idle() {
        let pool = pool_of(&["a"], 0.0);
        let t = SessionTable::new(3, Duration::from_secs(1800));
        let b = &pool.backends[0];
        let id = |k: &str| id_of(&t, k);
        for k in ["k1", "k2", "k3"] {
            t.put(id(k), b, true, Outcome::Spill);
        }
        t.put(id("k1"), b, true, Outcome::Bound); // k2 is now the least recently used
        t.put(id("k4"), b, true, Outcome::Spill);
        assert!(t.get(id("k2")).is_none());
        assert!(t.get(id("k1")).is_some() && t.get(id("k3")).is_some());
        assert!(t.get(id("k4")).is_some());
        assert_eq!(t.len(), 3);
        assert_eq!(t.bound(), 3);
        assert_eq!(b.sessions.load(Ordering::Relaxed), 3);
        t.set_limits(3, Duration::ZERO);
        t.sweep();
        assert_eq!(t.len(), 0);
        assert_eq!(t.bound(), 0);
        assert_eq!(b.sessions.load(Ordering::Relaxed), 0);
    }

    /// A new size limit that changes how many shards are used moves every entry to its new
    /// shard (none is lost, none counted twice), and one below the count evicts the least
    /// recently used at once, with the bound and per-backend counts following.
    #[test]
    fn changing_max_sessions_keeps_entries_and_counts_true() {
        let pool = pool_of(&["a", "b"], 0.0);
        let (a, b) = (&pool.backends[0], &pool.backends[1]);
        let t = SessionTable::new(1_000_000, Duration::from_secs(1800));
        let keys: Vec<SessionId> = (0..200).map(|i| id_of(&t, &format!("k{i}"))).collect();
        for (i, k) in keys.iter().enumerate() {
            if i == 150 {
                // The last 50 are strictly more recent than the rest, even on a coarse clock.
                let before = Instant::now();
                while Instant::now() == before {}
            }
            t.put(
                *k,
                if i % 2 == 0 { a } else { b },
                i % 4 == 0,
                Outcome::Spill,
            );
        }
        let check = |present: &[SessionId]| {
            for k in present {
                assert!(t.get(*k).is_some(), "{k:?} lost");
            }
            assert_eq!(t.len(), present.len());
            let bound = present.iter().filter(|k| t.get(**k).unwrap().1).count();
            assert_eq!(t.bound(), bound as u64);
            let on_a = present
                .iter()
                .filter(|k| Arc::ptr_eq(&t.get(**k).unwrap().0, a));
            assert_eq!(a.sessions.load(Ordering::Relaxed), on_a.count() as i64);
        };
        check(&keys);
        for max in [1_000, 1_000_000, 500, 2_000_000] {
            t.set_limits(max, Duration::from_secs(1800));
            check(&keys);
        }
        // Down to 1 shard and 50 entries: the 50 most recently used stay.
        t.set_limits(50, Duration::from_secs(1800));
        check(&keys[150..]);
        assert!(t.get(keys[149]).is_none());
    }

    #[test]
    fn header_key_wins_over_fingerprint_and_first_header_wins() {
        let names = [
            HeaderName::from_static("x-session-id"),
            HeaderName::from_static("session-id"),
        ];
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        let key = |x_session_id: &str| {
            let h = WireFields::from_pairs([
                (&b"session-id"[..], &b"second"[..]),
                (b"x-session-id", x_session_id.as_bytes()),
            ]);
            let path = "/v1/chat/completions";
            session_key(&h, &names, true, &Method::POST, path, body).unwrap()
        };
        let k = key("");
        assert_eq!((k.text.as_str(), k.source), ("second", KeySource::Header));
        assert_eq!(key("first").text, "first");
    }

    #[test]
    fn fingerprint_is_the_same_for_every_turn_of_a_conversation() {
        let names = [HeaderName::from_static("x-session-id")];
        let h = WireFields::default();
        let turn1 = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"}],"stream":true}"#;
        let turn2 = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"},{"role":"assistant","content":"done"},{"role":"user","content":"now tests"}],"stream":true}"#;
        let other = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 2"}]}"#;
        let other_model = br#"{"model":"n","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"}]}"#;
        let fp = |b: &[u8]| {
            session_key(&h, &names, true, &Method::POST, "/v1/chat/completions", b).unwrap()
        };
        assert_eq!(fp(turn1), fp(turn2));
        assert_eq!(fp(turn1).source, KeySource::Fingerprint);
        assert!(fp(turn1).text.starts_with("fp:"));
        assert_ne!(fp(turn1), fp(other));
        assert_ne!(fp(turn1), fp(other_model));
        assert!(session_key(
            &h,
            &names,
            false,
            &Method::POST,
            "/v1/chat/completions",
            turn1
        )
        .is_none());
        assert!(session_key(&h, &names, true, &Method::POST, "/v1/completions", turn1).is_none());
        assert!(session_key(
            &h,
            &names,
            true,
            &Method::GET,
            "/v1/chat/completions",
            turn1
        )
        .is_none());
        assert!(session_key(
            &h,
            &names,
            true,
            &Method::POST,
            "/v1/chat/completions",
            b"not json"
        )
        .is_none());
    }
}
