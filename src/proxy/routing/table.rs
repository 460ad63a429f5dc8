//! The session table: where each remembered session is, and how much context each backend's
//! recently active sessions make it hold.

use std::collections::HashMap;
use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;
use tokio::time::Instant;

use super::key::SessionKey;
use super::order::{Use, UseOrder};
use super::usage::CacheUsage;
use super::{Backend, Outcome};

const SHARDS: usize = 16;

/// The active window until configured: `affinity.active_secs`'s default.
const DEFAULT_ACTIVE: Duration = Duration::from_secs(20);

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
pub(crate) struct SessionId {
    /// `SessionKey::hash`.
    pub(super) hash: u64,
    /// The keyed hash; also picks the shard, so no client can crowd one shard either.
    pub(super) tag: u64,
}

/// What the table knows about one session.
#[derive(Debug, Clone)]
struct Entry {
    backend: Arc<Backend>,
    pinned: bool,
    outcome: Outcome,
    seq: u64,
    last_used: Instant,
    /// Body bytes of the session's last request: the context its backend holds for it.
    bytes: u64,
    /// Counted in its backend's active context (a turn in flight, or one ended within the
    /// active window).
    active: bool,
    /// Turns of the session in flight: while any is, the session is active however long the
    /// turn takes (a long prefill must not make its context look free).
    turns: u32,
    /// The prompt size its backend reported for its last request there (none yet since it
    /// was placed there): what the next turn should find cached.
    prompt_tokens: Option<u64>,
    /// Its backend served a continuing turn mostly uncached: the cache is gone from there.
    cache_lost: bool,
}

/// Where a known session is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Known {
    /// The index of the backend the table places it on.
    pub index: usize,
    /// That backend no longer holds the session's cache.
    pub cache_lost: bool,
}

#[derive(Default)]
struct Shard {
    /// Seeded per process, and several times cheaper than SipHash (the ids are keyed already).
    map: HashMap<SessionId, Entry, foldhash::fast::RandomState>,
    /// Entries by last use: the first live one is the least recently used (and the idlest).
    order: UseOrder,
    next_seq: u64,
    /// Entries with a lower `seq` are no longer active: the idle walk resumes here.
    active_from: u64,
    /// When the use the idle walk last stopped at was made (none: walk): until that is past
    /// the active window, so is every later use, and the walk would read the queue for nothing.
    walk_stopped_at: Option<Instant>,
}

/// A session as shown by `GET /admin/sessions/{key}`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SessionView {
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
pub(crate) struct SessionTable {
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
    active_ms: AtomicU64,
    bound: AtomicI64,
}

/// Marks `e` (the entry of `id`) used at `now`: it moves to the end of `order`, the most
/// recently used.
fn use_now(order: &mut UseOrder, next_seq: &mut u64, id: SessionId, e: &mut Entry, now: Instant) {
    e.seq = *next_seq;
    *next_seq += 1;
    e.last_used = now;
    order.push(Use {
        seq: e.seq,
        id,
        at: now,
    });
}

/// Whether `used` is its session's latest use, not a stale mark.
fn is_live(map: &HashMap<SessionId, Entry, foldhash::fast::RandomState>, used: &Use) -> bool {
    map.get(&used.id).is_some_and(|e| e.seq == used.seq)
}

impl Shard {
    /// The least recently used entry's last use.
    fn oldest(&mut self) -> Option<Use> {
        let map = &self.map;
        self.order.oldest(|u| is_live(map, u))
    }

    /// Drops stale marks from `order` once they outnumber the entries.
    fn compact(&mut self) {
        let map = &self.map;
        self.order.compact(map.len(), |u| is_live(map, u));
    }
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
    pub(crate) fn new(max_sessions: usize, ttl: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            tag_key: std::hash::RandomState::new(),
            in_use: AtomicUsize::new(shards_for(max_sessions)),
            max_sessions: AtomicUsize::new(max_sessions),
            ttl_ms: AtomicU64::new(ttl.as_millis() as u64),
            active_ms: AtomicU64::new(DEFAULT_ACTIVE.as_millis() as u64),
            bound: AtomicI64::new(0),
        }
    }

    /// Applies new bounds (reload). A new size limit takes effect at once: when it changes
    /// how many shards are used, every entry moves to its new shard, and entries over the
    /// limit are evicted least recently used first, so the counts stay true. A new TTL takes
    /// effect as entries are touched or swept.
    pub(crate) fn set_limits(&self, max_sessions: usize, ttl: Duration) {
        self.ttl_ms.store(ttl.as_millis() as u64, Ordering::Relaxed);
        // In index order, as nothing else ever holds two shard locks.
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        self.max_sessions.store(max_sessions, Ordering::Relaxed);
        let n = shards_for(max_sessions);
        if n != self.in_use.load(Ordering::Relaxed) {
            let mut entries: Vec<(SessionId, Entry)> = Vec::new();
            for shard in guards.iter_mut() {
                shard.order.clear();
                shard.active_from = 0;
                shard.walk_stopped_at = None;
                entries.extend(shard.map.drain());
            }
            // Oldest first, so each shard's order stays least recently used first.
            entries.sort_by_key(|(_, e)| e.last_used);
            for (id, mut entry) in entries {
                let shard = &mut *guards[shard_index(id, n)];
                let at = entry.last_used;
                use_now(&mut shard.order, &mut shard.next_seq, id, &mut entry, at);
                shard.map.insert(id, entry);
            }
            self.in_use.store(n, Ordering::Release);
        }
        let cap = (max_sessions / n).max(1);
        for shard in guards.iter_mut() {
            while shard.map.len() > cap {
                let Some(oldest) = shard.oldest() else {
                    break;
                };
                self.evict(shard, oldest.id);
            }
        }
    }

    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Relaxed))
    }

    /// How the table names the session of `key`: what [`SessionTable::get`] and
    /// [`SessionTable::put`] take, computed once per request.
    pub(crate) fn id(&self, key: &SessionKey) -> SessionId {
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

    /// Where among `backends` the session is, unless unknown or idle past the TTL.
    #[cfg(test)]
    pub(crate) fn get(&self, id: SessionId, backends: &[Arc<Backend>]) -> Option<Known> {
        self.slot(id, Instant::now()).known(backends)
    }

    /// The session's entry, locked at `now`: what one request reads and writes of it under a
    /// single lock, as every lock of a shard moves its cache lines between the cores.
    pub(crate) fn slot(&self, id: SessionId, now: Instant) -> Slot<'_> {
        let (shard, cap) = self.lock(id);
        Slot {
            table: self,
            shard,
            cap,
            id,
            now,
        }
    }

    /// Records a placement of a request of `bytes` at `now` and refreshes the session's last
    /// use.
    pub(crate) fn put(
        &self,
        id: SessionId,
        backend: &Arc<Backend>,
        pinned: bool,
        outcome: Outcome,
        bytes: u64,
        now: Instant,
    ) {
        self.slot(id, now).place(backend, pinned, outcome, bytes);
    }

    /// A read-only view for the admin API.
    pub(crate) fn view(&self, id: SessionId) -> Option<SessionView> {
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

    /// How long after its last turn ended a session still counts in its backend's active
    /// context.
    pub(crate) fn set_active_window(&self, window: Duration) {
        self.active_ms
            .store(window.as_millis() as u64, Ordering::Relaxed);
    }

    /// Takes sessions idle past the active window out of their backends' active context,
    /// oldest first, resuming where the last walk stopped.
    fn deactivate_idle(&self, shard: &mut Shard, now: Instant) {
        let window = Duration::from_millis(self.active_ms.load(Ordering::Relaxed));
        if shard
            .walk_stopped_at
            .is_some_and(|at| now.saturating_duration_since(at) <= window)
        {
            return;
        }
        let mut from = shard.active_from;
        let mut stopped_at = None;
        for used in shard.order.since(from) {
            if now.saturating_duration_since(used.at) <= window {
                stopped_at = Some(used.at);
                break;
            }
            // A session with a turn in flight stays active; the turn's end re-enters it
            // into this walk's order, past `from`. A stale mark has a later use past it.
            if let Some(e) = shard.map.get_mut(&used.id) {
                if e.seq == used.seq && e.active && e.turns == 0 {
                    e.active = false;
                    e.backend.release(e.bytes);
                }
            }
            from = used.seq + 1;
        }
        shard.active_from = from;
        shard.walk_stopped_at = stopped_at;
    }

    /// Forgets the session `id`; its marks in `order` go stale.
    fn evict(&self, shard: &mut Shard, id: SessionId) {
        if let Some(e) = shard.map.remove(&id) {
            e.backend.sessions.fetch_sub(1, Ordering::Relaxed);
            if e.active {
                e.backend.release(e.bytes);
            }
            if e.pinned {
                self.bound.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Drops every session idle past the TTL (run periodically so counts stay true).
    pub(crate) fn sweep(&self) {
        let ttl = self.ttl();
        let now = Instant::now();
        for shard in &self.shards {
            let mut shard = shard.lock();
            while let Some(oldest) = shard.oldest() {
                if now.saturating_duration_since(oldest.at) <= ttl {
                    break;
                }
                self.evict(&mut shard, oldest.id);
            }
            self.deactivate_idle(&mut shard, now);
        }
    }

    /// Sessions remembered.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Sessions whose placement overrides the plain hash.
    pub(crate) fn bound(&self) -> u64 {
        self.bound.load(Ordering::Relaxed).max(0) as u64
    }
}

/// One session's entry with its shard locked, at one instant; the lock goes with it.
pub(crate) struct Slot<'a> {
    table: &'a SessionTable,
    shard: MutexGuard<'a, Shard>,
    cap: usize,
    id: SessionId,
    now: Instant,
}

impl Slot<'_> {
    /// Where among `backends` the session is, unless unknown, idle past the TTL (then
    /// forgotten) or on a backend not among them. Compared by address, not cloned: a clone
    /// would write the backend's reference count, which every worker shares.
    pub(crate) fn known(&mut self, backends: &[Arc<Backend>]) -> Option<Known> {
        let entry = self.shard.map.get(&self.id)?;
        if self.now.saturating_duration_since(entry.last_used) > self.table.ttl() {
            self.table.evict(&mut self.shard, self.id);
            return None;
        }
        let index = backends
            .iter()
            .position(|b| Arc::ptr_eq(b, &entry.backend))?;
        Some(Known {
            index,
            cache_lost: entry.cache_lost,
        })
    }

    /// Whether the table has an entry for the session at all: after [`Slot::known`] found
    /// none among the pool's backends, one on a backend since removed.
    pub(crate) fn remembered(&self) -> bool {
        self.shard.map.contains_key(&self.id)
    }

    /// Records a placement of a request of `bytes` and refreshes the session's last use.
    pub(crate) fn place(
        &mut self,
        backend: &Arc<Backend>,
        pinned: bool,
        outcome: Outcome,
        bytes: u64,
    ) {
        let (table, id, now) = (self.table, self.id, self.now);
        let Shard {
            map,
            order,
            next_seq,
            ..
        } = &mut *self.shard;
        match map.get_mut(&id) {
            Some(e) => {
                use_now(order, next_seq, id, e, now);
                let same = Arc::ptr_eq(&e.backend, backend);
                if e.active && same {
                    backend.resize(e.bytes, bytes);
                } else {
                    if e.active {
                        e.backend.release(e.bytes);
                    }
                    backend.hold(bytes);
                }
                e.active = true;
                e.bytes = bytes;
                if !same {
                    e.backend.sessions.fetch_sub(1, Ordering::Relaxed);
                    backend.sessions.fetch_add(1, Ordering::Relaxed);
                    e.backend = backend.clone();
                    e.prompt_tokens = None;
                    e.cache_lost = false;
                }
                if e.pinned != pinned {
                    table
                        .bound
                        .fetch_add(if pinned { 1 } else { -1 }, Ordering::Relaxed);
                    e.pinned = pinned;
                }
                e.outcome = outcome;
            }
            None => {
                backend.sessions.fetch_add(1, Ordering::Relaxed);
                backend.hold(bytes);
                if pinned {
                    table.bound.fetch_add(1, Ordering::Relaxed);
                }
                let mut entry = Entry {
                    backend: backend.clone(),
                    pinned,
                    outcome,
                    seq: 0,
                    last_used: now,
                    bytes,
                    active: true,
                    turns: 0,
                    prompt_tokens: None,
                    cache_lost: false,
                };
                use_now(order, next_seq, id, &mut entry, now);
                map.insert(id, entry);
            }
        }
        // Make room and drop what has idled out, oldest first.
        let ttl = table.ttl();
        let shard = &mut *self.shard;
        while let Some(oldest) = shard.oldest() {
            if shard.map.len() > self.cap || now.saturating_duration_since(oldest.at) > ttl {
                table.evict(shard, oldest.id);
            } else {
                break;
            }
        }
        shard.compact();
        table.deactivate_idle(shard, now);
    }

    /// A turn of the session went out: it stays active until [`Slot::end_turn`].
    pub(crate) fn start_turn(&mut self) {
        if let Some(e) = self.shard.map.get_mut(&self.id) {
            e.turns += 1;
        }
    }

    /// Learns from the usage `backend` reported for the session's request whether that
    /// backend still held the session's cache: a continuing turn there with fewer than
    /// `lost_share` of the previous turn's prompt tokens served from cache marks it lost (for
    /// the next turn to move), while the first turn on a backend only sets the expectation.
    /// The backend also learns its queue wait from the answer's first byte, `ttfb` after the
    /// request went out, when known. Usage from a backend the session has since left is
    /// ignored.
    pub(crate) fn report_cache(
        &mut self,
        backend: &Arc<Backend>,
        usage: CacheUsage,
        lost_share: f64,
        ttfb: Option<Duration>,
    ) {
        let Some(e) = self.shard.map.get_mut(&self.id) else {
            return;
        };
        if !Arc::ptr_eq(&e.backend, backend) {
            return;
        }
        backend.learn_bytes_per_token(e.bytes, usage.prompt_tokens);
        if let Some(ttfb) = ttfb {
            backend.waits.learn(usage, ttfb);
        }
        if let Some(previous) = e.prompt_tokens {
            e.cache_lost = (usage.cached_tokens as f64) < lost_share * previous as f64;
        }
        e.prompt_tokens = Some(usage.prompt_tokens);
    }

    /// A turn of the session ended: its idle time starts now, so a turn that outlasts the
    /// active window leaves the session active for a whole window after it, as the backend
    /// still holds its context then.
    pub(crate) fn end_turn(&mut self) {
        let (id, now) = (self.id, self.now);
        let Shard {
            map,
            order,
            next_seq,
            ..
        } = &mut *self.shard;
        let Some(e) = map.get_mut(&id) else {
            return;
        };
        e.turns = e.turns.saturating_sub(1);
        use_now(order, next_seq, id, e, now);
        if !e.active {
            e.active = true;
            e.backend.hold(e.bytes);
        }
        self.shard.compact();
    }
}
