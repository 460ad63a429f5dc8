//! The session table's order of last use: a queue to which every use of a session appends,
//! oldest first. A use that a later use of the same session (or its eviction) has replaced
//! stays behind as a stale mark, told by its sequence number no longer being the entry's, and
//! is skipped; the queue is compacted once stale marks outnumber the live ones. Marking a use
//! is then one append, where an ordered map would remove and insert a node on every request.

use std::collections::VecDeque;

use tokio::time::Instant;

use super::table::SessionId;

/// One use of a session: its sequence number in the shard, and when.
#[derive(Debug, Clone, Copy)]
pub(super) struct Use {
    pub(super) seq: u64,
    pub(super) id: SessionId,
    pub(super) at: Instant,
}

/// Uses in the order they happened (`seq` ascending), stale ones included.
#[derive(Debug, Default)]
pub(super) struct UseOrder {
    queue: VecDeque<Use>,
}

/// Stale marks kept before a compaction, beyond one per live entry.
const SLACK: usize = 64;

impl UseOrder {
    /// Appends a use; its `seq` is above every one before it.
    pub(super) fn push(&mut self, used: Use) {
        debug_assert!(self.queue.back().is_none_or(|last| last.seq < used.seq));
        self.queue.push_back(used);
    }

    /// The oldest live use (`live` tells), dropping the stale marks in front of it.
    pub(super) fn oldest(&mut self, live: impl Fn(&Use) -> bool) -> Option<Use> {
        while let Some(front) = self.queue.front() {
            if live(front) {
                return Some(*front);
            }
            self.queue.pop_front();
        }
        None
    }

    /// The uses from sequence number `seq` on, oldest first, stale ones included.
    pub(super) fn since(&self, seq: u64) -> impl Iterator<Item = &Use> {
        let start = self.queue.partition_point(|u| u.seq < seq);
        self.queue.range(start..)
    }

    /// Drops the stale marks once there are more of them than `live_count` (the live
    /// entries) plus a little slack, so the queue stays within twice the table's size.
    pub(super) fn compact(&mut self, live_count: usize, live: impl Fn(&Use) -> bool) {
        if self.queue.len() > 2 * live_count + SLACK {
            self.queue.retain(live);
        }
    }

    /// Forgets every use.
    pub(super) fn clear(&mut self) {
        self.queue.clear();
    }

    /// Marks held, stale ones included.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn id(n: u64) -> SessionId {
        SessionId { hash: n, tag: n }
    }

    /// A toy table: the latest seq of each session.
    struct Latest(HashMap<SessionId, u64>);

    impl Latest {
        fn live(&self) -> impl Fn(&Use) -> bool + '_ {
            |u| self.0.get(&u.id) == Some(&u.seq)
        }
    }

    #[test]
    fn the_oldest_live_use_skips_uses_made_stale_by_later_ones() {
        let now = Instant::now();
        let mut order = UseOrder::default();
        let mut latest = Latest(HashMap::new());
        for (seq, session) in [(0, 1), (1, 2), (2, 1), (3, 3)] {
            order.push(Use {
                seq,
                id: id(session),
                at: now,
            });
            latest.0.insert(id(session), seq);
        }
        // Session 1's first use is stale; session 2 is now the least recently used.
        let oldest = order.oldest(latest.live()).unwrap();
        assert_eq!((oldest.seq, oldest.id), (1, id(2)));
        latest.0.remove(&id(2));
        assert_eq!(order.oldest(latest.live()).unwrap().seq, 2);
        let walked: Vec<u64> = order.since(2).map(|u| u.seq).collect();
        assert_eq!(walked, vec![2, 3]);
    }

    #[test]
    fn repeated_uses_of_few_sessions_keep_the_queue_within_twice_their_number() {
        let now = Instant::now();
        let mut order = UseOrder::default();
        let mut latest = Latest(HashMap::new());
        for seq in 0..100_000u64 {
            let session = id(seq % 10);
            order.push(Use {
                seq,
                id: session,
                at: now,
            });
            latest.0.insert(session, seq);
            order.compact(latest.0.len(), latest.live());
        }
        assert!(order.len() <= 2 * 10 + SLACK + 1, "{} marks", order.len());
        // Compaction kept every live use, in order.
        let live: Vec<u64> = order
            .since(0)
            .filter(|u| latest.live()(u))
            .map(|u| u.seq)
            .collect();
        assert_eq!(live, (99_990..100_000).collect::<Vec<_>>());
    }
}
