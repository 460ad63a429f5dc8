//! Which backend created each Responses API response: a request naming it in
//! `previous_response_id` must go there, as only that backend holds the conversation it
//! continues (another replica answers "not found", or worse, starts afresh).
//!
//! The id is read from the response as it streams past, never by holding the body: the first
//! `"id"` string of the body is the response's own (`response.created`'s `response.id` in a
//! stream; the top-level `id` of a JSON answer, which vLLM, SGLang, llama.cpp and the OpenAI
//! API all write before the output items that carry ids of their own).
//!
//! The table is bounded like the session table (its `max_sessions` entries, its idle TTL):
//! oldest ids go first, and each eviction is counted.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memchr::memmem::Finder;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::tap::KeySource;

/// Longer ids are not remembered: no server makes them, and a table entry stays small.
const MAX_ID_BYTES: usize = 256;
/// Longer session keys are not inherited by the requests that continue a response.
const MAX_KEY_BYTES: usize = 256;
/// A body whose first this-many bytes hold no id has none worth looking for.
const SCAN_LIMIT: u64 = 64 * 1024;

/// Where a response was created, and the session it was part of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The backend's name.
    pub backend: Arc<str>,
    /// The session key of the request that created it, for the requests that continue it.
    pub session: Option<(String, KeySource)>,
}

struct Entry {
    origin: Origin,
    at: Instant,
}

#[derive(Default)]
struct Ids {
    by_id: HashMap<Box<str>, Entry>,
    /// Insertion order, for the bound and the TTL.
    order: VecDeque<(Box<str>, Instant)>,
}

/// Response id → origin, bounded in entries and age.
pub(crate) struct ResponseIds {
    ids: Mutex<Ids>,
    max: usize,
    ttl: Duration,
    evicted: AtomicU64,
}

impl ResponseIds {
    /// A table of at most `max` ids, each forgotten `ttl` after it was learnt.
    pub(crate) fn new(max: usize, ttl: Duration) -> Self {
        Self {
            ids: Mutex::new(Ids::default()),
            max: max.max(1),
            ttl,
            evicted: AtomicU64::new(0),
        }
    }

    /// Remembers that `id` was created as `origin` says.
    pub(crate) fn learn(&self, id: &str, mut origin: Origin, now: Instant) {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return;
        }
        if origin
            .session
            .as_ref()
            .is_some_and(|(k, _)| k.len() > MAX_KEY_BYTES)
        {
            origin.session = None;
        }
        let mut ids = self.ids.lock();
        ids.by_id.insert(id.into(), Entry { origin, at: now });
        ids.order.push_back((id.into(), now));
        let mut evicted = 0;
        while let Some((oldest, at)) = ids.order.front() {
            let expired = now.duration_since(*at) > self.ttl;
            if !expired && ids.by_id.len() <= self.max {
                break;
            }
            let (oldest, at) = (oldest.clone(), *at);
            ids.order.pop_front();
            // A later `learn` of the same id replaced its entry: that one stays.
            if ids.by_id.get(&oldest).is_some_and(|e| e.at == at) {
                ids.by_id.remove(&oldest);
                evicted += 1;
            }
        }
        self.evicted.fetch_add(evicted, Ordering::Relaxed);
    }

    /// Where `id` was created, if it is remembered and not past its TTL.
    pub(crate) fn origin(&self, id: &str, now: Instant) -> Option<Origin> {
        let ids = self.ids.lock();
        let e = ids.by_id.get(id)?;
        (now.duration_since(e.at) <= self.ttl).then(|| e.origin.clone())
    }

    /// Ids remembered now.
    pub(crate) fn len(&self) -> usize {
        self.ids.lock().by_id.len()
    }

    /// Ids forgotten for the bound or their age, since start.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Appends the table's two series to a Prometheus text exposition.
    pub(crate) fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = write!(
            out,
            "# HELP agentrace_response_ids Responses API response ids remembered with the backend that created them.\n\
             # TYPE agentrace_response_ids gauge\n\
             agentrace_response_ids {}\n\
             # HELP agentrace_response_ids_evicted_total Response ids forgotten for the table's bound (affinity.max_sessions) or age (affinity.session_ttl_secs).\n\
             # TYPE agentrace_response_ids_evicted_total counter\n\
             agentrace_response_ids_evicted_total {}\n",
            self.len(),
            self.evicted()
        );
    }
}

/// Reads one response for its id and tells the table where it was created, as soon as the
/// id has passed: the client may send the request continuing it before the stream ends.
pub(crate) struct IdLearner {
    scan: IdScan,
    table: Arc<ResponseIds>,
    origin: Option<Origin>,
}

impl IdLearner {
    /// A learner telling `table` that the response read was created as `origin` says.
    pub(crate) fn new(table: Arc<ResponseIds>, origin: Origin) -> Self {
        Self {
            scan: IdScan::default(),
            table,
            origin: Some(origin),
        }
    }

    /// Reads the next frame of the response.
    pub(crate) fn feed(&mut self, frame: &[u8]) {
        if self.origin.is_none() {
            return;
        }
        if let Some(id) = self.scan.feed(frame) {
            if let Some(origin) = self.origin.take() {
                self.table.learn(&id, origin, Instant::now());
            }
        }
    }
}

static ID_KEY: std::sync::LazyLock<Finder<'static>> =
    std::sync::LazyLock::new(|| Finder::new(b"\"id\""));

/// Finds the first `"id"` string of a body read frame by frame, keeping at most a few hundred
/// bytes of it.
#[derive(Debug, Default)]
pub(crate) struct IdScan {
    held: Vec<u8>,
    seen: u64,
    done: bool,
}

impl IdScan {
    /// Reads the next frame; the id once found (then never again).
    pub(crate) fn feed(&mut self, frame: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        self.seen += frame.len() as u64;
        self.held.extend_from_slice(frame);
        match ID_KEY.find(&self.held) {
            None => {
                let keep = self.held.len().saturating_sub(3);
                self.held.drain(..keep);
            }
            Some(at) => {
                self.held.drain(..at);
                match string_value(&self.held[4..]) {
                    Value::Found(id) => {
                        self.done = true;
                        self.held = Vec::new();
                        return Some(id);
                    }
                    Value::NotYet if self.held.len() <= MAX_ID_BYTES + 16 => {}
                    _ => self.done = true,
                }
            }
        }
        if self.seen > SCAN_LIMIT {
            self.done = true;
            self.held = Vec::new();
        }
        None
    }
}

enum Value {
    Found(String),
    NotYet,
    Not,
}

/// The string after `: ` at the start of `rest`: an id is plain ASCII without escapes.
fn string_value(rest: &[u8]) -> Value {
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let mut i = rest.iter().take_while(|b| ws(b)).count();
    match rest.get(i) {
        None => return Value::NotYet,
        Some(b':') => i += 1,
        Some(_) => return Value::Not,
    }
    i += rest[i..].iter().take_while(|b| ws(b)).count();
    match rest.get(i) {
        None => return Value::NotYet,
        Some(b'"') => i += 1,
        Some(_) => return Value::Not,
    }
    let len = rest[i..]
        .iter()
        .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
        .count();
    match rest.get(i + len) {
        None => Value::NotYet,
        Some(b'"') if len > 0 && len <= MAX_ID_BYTES => {
            Value::Found(String::from_utf8_lossy(&rest[i..i + len]).into_owned())
        }
        Some(_) => Value::Not,
    }
}

/// The `previous_response_id` a Responses request body names, if any: a top-level key, which
/// no input item has, found by its unescaped quotes without parsing the body.
pub(crate) fn previous_response_id<'p>(
    parts: impl IntoIterator<Item = &'p [u8]>,
) -> Option<String> {
    static KEY: std::sync::LazyLock<Finder<'static>> =
        std::sync::LazyLock::new(|| Finder::new(b"\"previous_response_id\""));
    let mut seam: Vec<u8> = Vec::new();
    for part in parts {
        seam.extend_from_slice(part);
        if let Some(at) = KEY.find(&seam) {
            match string_value(&seam[at + 22..]) {
                Value::Found(id) => return Some(id),
                Value::NotYet if seam.len() - at <= 22 + MAX_ID_BYTES + 16 => {
                    // The value follows in the next part.
                    seam.drain(..at);
                    continue;
                }
                _ => return None,
            }
        }
        let keep = seam.len().saturating_sub(22);
        seam.drain(..keep);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_id_is_found_whatever_the_frame_boundaries() {
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_abc123\",\"output\":[{\"id\":\"msg_1\"}]}}\n\n";
        for piece in 1..stream.len() {
            let mut scan = IdScan::default();
            let found: Vec<String> = stream
                .as_bytes()
                .chunks(piece)
                .filter_map(|c| scan.feed(c))
                .collect();
            assert_eq!(found, vec!["resp_abc123".to_owned()], "{piece}");
        }
    }

    #[test]
    fn previous_response_id_is_read_across_parts_and_null_is_none() {
        let body = br#"{"model":"m","previous_response_id" : "resp_9","input":"hi"}"#;
        for piece in 1..body.len() {
            let parts: Vec<&[u8]> = body.chunks(piece).collect();
            assert_eq!(
                previous_response_id(parts),
                Some("resp_9".into()),
                "{piece}"
            );
        }
        assert_eq!(
            previous_response_id([&br#"{"previous_response_id":null}"#[..]]),
            None
        );
        assert_eq!(
            previous_response_id([&br#"{"input":"say \"previous_response_id\": \"x\""}"#[..]]),
            None
        );
    }

    #[test]
    fn the_table_keeps_its_bound_and_counts_what_it_forgets() {
        let t = ResponseIds::new(2, Duration::from_secs(60));
        let now = Instant::now();
        let o = |b: &str| Origin {
            backend: Arc::from(b),
            session: None,
        };
        t.learn("a", o("x"), now);
        t.learn("b", o("y"), now);
        t.learn("c", o("z"), now);
        assert_eq!(t.len(), 2);
        assert_eq!(t.evicted(), 1);
        assert_eq!(t.origin("a", now), None);
        assert_eq!(t.origin("c", now), Some(o("z")));
        assert_eq!(t.origin("c", now + Duration::from_secs(61)), None);
    }
}
