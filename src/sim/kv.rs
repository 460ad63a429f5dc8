//! KV block pool with prefix caching, after vLLM v1's `BlockPool`: refcounted blocks, an
//! index of cached full blocks by chained hash, and a free list in LRU order whose head is
//! evicted by allocation.

use std::collections::HashMap;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    prev: u32,
    next: u32,
}

/// A fixed pool of KV blocks.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// Cached full blocks by chained hash; a free block stays here until reused.
    index: HashMap<u64, BlockId>,
    head: u32,
    tail: u32,
    free: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free, uncached blocks.
    pub(crate) fn new(num_blocks: usize) -> BlockPool {
        let n = num_blocks as u32;
        let blocks = (0..n)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
            })
            .collect();
        BlockPool {
            blocks,
            index: HashMap::new(),
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            free: num_blocks,
        }
    }

    /// Blocks on the free list (cached or not).
    pub(crate) fn free_blocks(&self) -> usize {
        self.free
    }

    /// Blocks referenced by a running request.
    pub(crate) fn used_blocks(&self) -> usize {
        self.blocks.len() - self.free
    }

    /// Share of blocks in use, as vLLM's `kv_cache_usage_perc` (0..=1).
    #[cfg(test)]
    pub(crate) fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            self.used_blocks() as f64 / self.blocks.len() as f64
        }
    }

    /// The longest cached prefix of `hashes`, capped so that at least one of the prompt's
    /// `num_tokens` tokens is computed.
    pub(crate) fn lookup(
        &self,
        hashes: &[u64],
        num_tokens: usize,
        block_size: usize,
    ) -> Vec<BlockId> {
        let cap = num_tokens.saturating_sub(1) / block_size;
        hashes
            .iter()
            .take(cap)
            .map_while(|h| self.index.get(h).copied())
            .collect()
    }

    /// How many of `hit` sit on the free list: touching them takes them off it.
    pub(crate) fn free_among(&self, hit: &[BlockId]) -> usize {
        hit.iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count()
    }

    /// Takes a reference on cache hits.
    pub(crate) fn touch(&mut self, hit: &[BlockId]) {
        for &b in hit {
            if self.blocks[b as usize].ref_cnt == 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].ref_cnt += 1;
        }
    }

    /// Allocates `n` blocks from the LRU head, evicting their cached hashes; `None` (and no
    /// change) when fewer than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            let block = &mut self.blocks[b as usize];
            if let Some(h) = block.hash.take() {
                if self.index.get(&h) == Some(&b) {
                    self.index.remove(&h);
                }
            }
            block.ref_cnt = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Marks a computed full block as cached under `hash` (the first block cached under a
    /// hash stays the one the index points to).
    pub(crate) fn cache(&mut self, block: BlockId, hash: u64) {
        let slot = &mut self.blocks[block as usize];
        if slot.hash.is_some() {
            return;
        }
        slot.hash = Some(hash);
        self.index.entry(hash).or_insert(block);
    }

    /// Drops a request's references, last block first, so a sequence's tail is evicted
    /// before its head.
    pub(crate) fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            debug_assert!(block.ref_cnt > 0);
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.push_tail(b);
            }
        }
    }

    /// Forgets every cached hash (vLLM's `reset_prefix_cache`); blocks in use stay allocated.
    pub(crate) fn reset(&mut self) {
        self.index.clear();
        for block in &mut self.blocks {
            block.hash = None;
        }
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = {
            let block = &self.blocks[b as usize];
            (block.prev, block.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let block = &mut self.blocks[b as usize];
        block.prev = NIL;
        block.next = NIL;
        self.free -= 1;
    }

    fn push_tail(&mut self, b: u32) {
        let old_tail = self.tail;
        {
            let block = &mut self.blocks[b as usize];
            block.prev = old_tail;
            block.next = NIL;
        }
        if old_tail == NIL {
            self.head = b;
        } else {
            self.blocks[old_tail as usize].next = b;
        }
        self.tail = b;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_stay_hittable_until_reused_lru_first() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(2).unwrap();
        pool.cache(a[0], 10);
        pool.cache(a[1], 11);
        pool.free(&a);
        assert_eq!(pool.free_blocks(), 4);
        // Tail-first freeing puts a[1] ahead of a[0] in the queue, after the never-used blocks.
        assert_eq!(pool.lookup(&[10, 11], 100, 16), a);
        let b = pool.allocate(3).unwrap();
        assert_eq!(b[2], a[1]);
        assert_eq!(pool.lookup(&[10, 11], 100, 16), vec![a[0]]);
        assert_eq!(pool.usage(), 0.75);
    }

    #[test]
    fn lookup_leaves_at_least_one_token_to_compute() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(2).unwrap();
        pool.cache(a[0], 1);
        pool.cache(a[1], 2);
        assert_eq!(pool.lookup(&[1, 2], 32, 16).len(), 1);
        assert_eq!(pool.lookup(&[1, 2], 33, 16).len(), 2);
    }

    #[test]
    fn touching_a_free_hit_takes_it_off_the_free_list() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.cache(a[0], 7);
        pool.free(&a);
        let hit = pool.lookup(&[7], 100, 16);
        assert_eq!(pool.free_among(&hit), 1);
        pool.touch(&hit);
        assert_eq!(pool.free_blocks(), 1);
        assert!(pool.allocate(2).is_none());
        assert_eq!(pool.allocate(1).unwrap().len(), 1);
        pool.reset();
        assert!(pool.lookup(&[7], 100, 16).is_empty());
    }
}
