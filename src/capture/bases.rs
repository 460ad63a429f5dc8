//! The delta bases of one segment: the previous request body of each session, which the next
//! request of that session is stored as a delta against. The writer and the reader keep them
//! through this one type, so the reader drops exactly the bases the writer dropped and its
//! memory per segment stays within the bound the writer wrote into the segment header.
//!
//! The rule (documented in `captures/README.md`): after each exchange line with a session key,
//! that session's base becomes the request body the line holds (empty when the body was not
//! kept), costing its key's length plus the body's length in bytes; then, while the total is
//! above the bound and more than one session is kept, the session whose base was set longest
//! ago is forgotten. A request of a forgotten session is stored whole.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;

use super::spill::{BaseSpill, Kept};
use super::CaptureError;

struct Base {
    body: Kept,
    /// The body's length, wherever it is kept.
    len: u64,
    /// When the base was last set, in exchanges of this segment: its place in `order`.
    set_at: u64,
}

/// The delta bases of one segment, least recently set forgotten first above `bound` bytes.
pub(crate) struct DeltaBases {
    /// `None`: never forget (segments written before the bound was recorded).
    bound: Option<u64>,
    bases: HashMap<Arc<str>, Base>,
    /// Sessions by when their base was set, oldest first; the key is shared, not copied.
    order: BTreeMap<u64, Arc<str>>,
    bytes: u64,
    sets: u64,
    /// Where bodies go beyond the memory an export gives them (readers of an export only).
    spill: Option<BaseSpill>,
}

impl DeltaBases {
    /// Empty bases that stay within `bound` bytes (keys and bodies), or grow without one.
    pub(super) fn new(bound: Option<u64>) -> Self {
        Self::with_spill(bound, None)
    }

    /// As [`DeltaBases::new`], keeping the bodies through `spill` when there is one: the bound
    /// (the writer's rule) decides which bases exist, the spill where their bodies are.
    pub(super) fn with_spill(bound: Option<u64>, spill: Option<BaseSpill>) -> Self {
        DeltaBases {
            bound,
            bases: HashMap::new(),
            order: BTreeMap::new(),
            bytes: 0,
            sets: 0,
            spill,
        }
    }

    /// The base of `session`'s next delta; `None` when there is none or it is empty. Bases
    /// without a spill only (the writer's): a spilled body is read with [`DeltaBases::fetch`].
    pub(super) fn get(&self, session: &str) -> Option<&Bytes> {
        match &self.bases.get(session)?.body {
            Kept::Memory(b) if !b.is_empty() => Some(b),
            _ => None,
        }
    }

    /// The base of `session`'s next delta, read back from the spill file when it went there;
    /// `None` when there is none or it is empty.
    pub(super) fn fetch(&self, session: &str) -> Result<Option<Bytes>, CaptureError> {
        let Some(base) = self.bases.get(session).filter(|b| b.len > 0) else {
            return Ok(None);
        };
        match (&base.body, &self.spill) {
            (Kept::Memory(b), _) => Ok(Some(b.clone())),
            (Kept::Slot(slot), Some(spill)) => spill.read(*slot).map(Some),
            (Kept::Slot(_), None) => unreachable!("only a spill makes slots"),
        }
    }

    /// Makes `body` the base of `session`'s next request, then forgets the least recently
    /// set bases while above the bound. Bases without a spill only (they do no I/O).
    pub(super) fn set(&mut self, session: &str, body: Bytes) {
        debug_assert!(self.spill.is_none(), "spilled bases are set with try_set");
        if let Err(e) = self.try_set(session, body) {
            unreachable!("bases kept in memory do no I/O: {e}");
        }
    }

    /// As [`DeltaBases::set`]; fails when the body cannot be written to the spill file.
    pub(super) fn try_set(&mut self, session: &str, body: Bytes) -> Result<(), CaptureError> {
        self.sets += 1;
        let set_at = self.sets;
        let len = body.len() as u64;
        // The body it replaces goes first, so that the new one may take its memory.
        if let Some(old) = self.bases.get_mut(session) {
            let replaced = std::mem::replace(&mut old.body, Kept::Memory(Bytes::new()));
            if let Some(spill) = &self.spill {
                spill.release(&replaced);
            }
        }
        let body = match &self.spill {
            Some(spill) if len > 0 => spill.keep(body)?,
            _ => Kept::Memory(body),
        };
        self.bytes += len;
        if let Some(old) = self.bases.get_mut(session) {
            self.bytes -= old.len;
            let key = self
                .order
                .remove(&old.set_at)
                .expect("every base is in order");
            old.body = body;
            old.len = len;
            old.set_at = set_at;
            self.order.insert(set_at, key);
        } else {
            // The key is held too, and a client may make it as long as a header (64 KiB).
            let key: Arc<str> = Arc::from(session);
            self.bytes += key.len() as u64;
            if let Some(spill) = &self.spill {
                spill.hold(key.len() as u64);
            }
            self.order.insert(set_at, key.clone());
            self.bases.insert(key, Base { body, len, set_at });
        }
        let Some(bound) = self.bound else {
            return Ok(());
        };
        while self.bytes > bound && self.bases.len() > 1 {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some(base) = self.bases.remove(&key) {
                self.bytes -= key.len() as u64 + base.len;
                self.release(&base.body);
                if let Some(spill) = &self.spill {
                    spill.unhold(key.len() as u64);
                }
            }
        }
        Ok(())
    }

    /// Hands a body that is no longer a base back to the spill's accounting.
    fn release(&self, body: &Kept) {
        if let Some(spill) = &self.spill {
            spill.release(body);
        }
    }

    /// Bytes kept: every kept session's key plus its base body.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether `session` has a base (possibly empty).
    #[cfg(test)]
    pub(super) fn contains(&self, session: &str) -> bool {
        self.bases.contains_key(session)
    }
}

impl Drop for DeltaBases {
    /// A segment read to its end lets go of its bases' share of the export's memory.
    fn drop(&mut self) {
        let Some(spill) = self.spill.take() else {
            return;
        };
        for (key, base) in self.bases.drain() {
            spill.release(&base.body);
            spill.unhold(key.len() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_set_bases_go_first_above_the_bound() {
        let mut bases = DeltaBases::new(Some(100));
        bases.set("a", Bytes::from(vec![1; 30])); // 31
        bases.set("b", Bytes::from(vec![2; 30])); // 62
        bases.set("a", Bytes::from(vec![3; 40])); // 72: `a` is now the newer
        bases.set("c", Bytes::from(vec![4; 30])); // 103 → `b` goes
        assert!(!bases.contains("b"));
        assert!(bases.contains("a") && bases.contains("c"));
        assert_eq!(bases.bytes(), 41 + 31);
        // One base over the bound on its own is kept: it is the only one.
        bases.set("d", Bytes::from(vec![5; 500]));
        assert!(bases.contains("d") && !bases.contains("a") && !bases.contains("c"));
        assert_eq!(bases.bytes(), 501);
        // An empty base is no base, but its key is counted.
        bases.set("e", Bytes::new());
        assert_eq!(bases.get("e"), None);
        assert!(bases.contains("e"));
    }

    #[test]
    fn without_a_bound_nothing_is_forgotten() {
        let mut bases = DeltaBases::new(None);
        for i in 0..100 {
            bases.set(&format!("s{i}"), Bytes::from(vec![0; 1000]));
        }
        assert!((0..100).all(|i| bases.contains(&format!("s{i}"))));
    }
}
