//! Puts one session's turns in order. The session's turns arrive sorted by start time (the
//! replicas' clocks); a turn is held until a turn starting more than the clock-skew allowance
//! after it has arrived (or the session ends), then released in start order, except that a
//! turn whose history is a strict prefix of an earlier-stamped one of its session goes
//! first: the history's growth outranks clocks that disagree with it.

use std::collections::{BTreeMap, HashMap};

use super::apis::Chains;
use super::export::{Builder, Turn};

/// Turns waiting for their session's earlier turns.
pub(crate) struct Window {
    skew_ns: u64,
    seq: u64,
    pending: BTreeMap<(u64, u64), Turn>,
    by_session: HashMap<String, Vec<(u64, u64)>>,
    /// Turns released before one with an earlier start, because their history says so.
    pub ordered_by_history: u64,
    /// Responses turns continued on the server, put back together as they arrive (in start
    /// order: a continuing request starts after the response it continues).
    chains: Chains,
}

impl Window {
    /// A window tolerating clocks up to `skew_ns` apart.
    pub(super) fn new(skew_ns: u64) -> Window {
        Window {
            skew_ns,
            seq: 0,
            pending: BTreeMap::new(),
            by_session: HashMap::new(),
            ordered_by_history: 0,
            chains: Chains::default(),
        }
    }

    /// Takes `turn`, read when its session's turns stood at `watermark_ns` (the start of the
    /// turn just read), and hands `builder` every turn no earlier one can precede now.
    pub(super) fn push(&mut self, mut turn: Turn, watermark_ns: u64, builder: &mut Builder) {
        self.chains.stitch(&mut turn);
        self.seq += 1;
        let k = (turn.start_unix_ns, self.seq);
        if let Some(s) = &turn.key {
            self.by_session.entry(s.clone()).or_default().push(k);
        }
        self.pending.insert(k, turn);
        while let Some((&(start, _), _)) = self.pending.first_key_value() {
            if start.saturating_add(self.skew_ns) >= watermark_ns {
                break;
            }
            self.release_first(builder);
        }
    }

    /// Hands every held turn to `builder`.
    pub(super) fn finish(&mut self, builder: &mut Builder) {
        while !self.pending.is_empty() {
            self.release_first(builder);
        }
    }

    fn release_first(&mut self, builder: &mut Builder) {
        let Some((&first, turn)) = self.pending.first_key_value() else {
            return;
        };
        let mut pick = first;
        if let Some(keys) = turn.key.as_ref().and_then(|s| self.by_session.get(s)) {
            let mut shortest = turn.messages.len();
            for k in keys.iter().filter(|k| **k != first) {
                let other = &self.pending[k];
                if other.messages.len() < shortest && turn.messages.starts_with(&other.messages) {
                    shortest = other.messages.len();
                    pick = *k;
                }
            }
        }
        if pick != first {
            self.ordered_by_history += 1;
        }
        let turn = self.pending.remove(&pick).expect("picked from pending");
        if let Some(s) = &turn.key {
            if let Some(keys) = self.by_session.get_mut(s) {
                keys.retain(|k| *k != pick);
                if keys.is_empty() {
                    self.by_session.remove(s);
                }
            }
        }
        builder.add_turn(turn);
    }
}
