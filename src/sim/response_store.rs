//! The conversations behind `previous_response_id`, per replica, bounded in entries and bytes
//! whatever clients send: the oldest response is forgotten first (a chain's newest response is
//! its only one a client continues, so first-in-first-out is what least-recently-used would
//! evict too).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::Value;

use super::metrics::Metrics;

/// A stored conversation: chat-form messages, input and output, without the instructions
/// (which, as OpenAI documents, a continuation does not inherit).
pub(crate) type Conversation = Arc<Vec<Value>>;

/// One replica's stored responses.
pub(crate) struct ResponseStore {
    /// Most responses kept; 0 keeps none.
    max_entries: usize,
    /// Most bytes (of the conversations as JSON) kept.
    max_bytes: usize,
    inner: Mutex<Inner>,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, (Conversation, usize)>,
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    pub(crate) fn new(max_entries: usize, max_bytes: usize, metrics: Arc<Metrics>) -> Self {
        ResponseStore {
            max_entries,
            max_bytes,
            inner: Mutex::new(Inner::default()),
            metrics,
        }
    }

    /// The conversation of response `id`, if it is still kept.
    pub(crate) fn get(&self, id: &str) -> Option<Conversation> {
        self.inner.lock().by_id.get(id).map(|(c, _)| c.clone())
    }

    /// Keeps `conversation` as response `id`, forgetting the oldest responses to make room.
    /// One larger than the whole byte bound is not kept (and counts as evicted).
    pub(crate) fn insert(&self, id: String, conversation: Vec<Value>) {
        let size = serde_json::to_vec(&conversation).map_or(usize::MAX, |b| b.len());
        let mut inner = self.inner.lock();
        let mut evicted = 0;
        if self.max_entries == 0 || size > self.max_bytes {
            evicted += 1;
        } else {
            while inner.by_id.len() >= self.max_entries || inner.bytes + size > self.max_bytes {
                let Some(old) = inner.order.pop_front() else {
                    break;
                };
                if let Some((_, b)) = inner.by_id.remove(&old) {
                    inner.bytes -= b;
                    evicted += 1;
                }
            }
            inner.bytes += size;
            inner.order.push_back(id.clone());
            inner.by_id.insert(id, (Arc::new(conversation), size));
        }
        let m = &self.metrics;
        m.responses_stored.store(inner.by_id.len() as u64, Relaxed);
        m.responses_stored_bytes.store(inner.bytes as u64, Relaxed);
        m.responses_evicted.fetch_add(evicted, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn store(entries: usize, bytes: usize) -> ResponseStore {
        ResponseStore::new(entries, bytes, Arc::new(Metrics::new("m", 16, 16, false)))
    }

    #[test]
    fn oldest_response_goes_first_when_full() {
        let s = store(2, 1 << 20);
        for i in 0..3 {
            s.insert(
                format!("resp_{i}"),
                vec![json!({"role": "user", "content": "x"})],
            );
        }
        assert!(s.get("resp_0").is_none());
        assert!(s.get("resp_1").is_some() && s.get("resp_2").is_some());
        assert_eq!(s.metrics.responses_evicted.load(Relaxed), 1);
        assert_eq!(s.metrics.responses_stored.load(Relaxed), 2);
    }

    #[test]
    fn byte_bound_holds_and_an_oversized_conversation_is_not_kept() {
        let s = store(100, 200);
        let big = vec![json!({"role": "user", "content": "y".repeat(150)})];
        s.insert("resp_a".into(), big.clone());
        s.insert("resp_b".into(), big);
        assert!(s.get("resp_a").is_none() && s.get("resp_b").is_some());
        s.insert("resp_c".into(), vec![json!("z".repeat(300))]);
        assert!(s.get("resp_c").is_none());
        assert!(s.inner.lock().bytes <= 200);
    }
}
