//! Storing many blocks at once: tables sized ahead for a dump, and fresh chains
//! appended without a cap check per block.

use super::tree::{MAX_RUN, table_bytes};
use super::{BLOCK_ENTRY, DpRank, FastMap, IndexRefusal, Key, RouterIndex, StoredBlock, WorkerId};

impl RouterIndex {
    /// Says that about `blocks` more blocks of one (worker, rank) are about to be
    /// stored (a dump being applied), so that its table is sized once rather than
    /// doubled on the way. Within the caps: never beyond the rank's block cap, its
    /// worker's, the index's, or what the byte cap has room for once the hints
    /// before it are counted (a hint past them is cut down or ignored); at most
    /// [`MAX_RESERVED`] hints. Good until [`end_reserve`](Self::end_reserve), which
    /// gives back what the blocks did not fill.
    pub(crate) fn reserve(&mut self, worker_id: WorkerId, dp_rank: DpRank, blocks: usize) {
        if self.reserved.len() >= MAX_RESERVED {
            return;
        }
        let key = (worker_id, dp_rank);
        let (len, cap) = self
            .rank_of
            .get(&key)
            .and_then(|&s| self.rank(s))
            .map_or((0, 0), |r| (r.blocks.len(), r.blocks.capacity()));
        let hinted = |pick: &dyn Fn(&(WorkerId, DpRank)) -> bool| {
            self.reserved
                .iter()
                .filter(|(k, _, _)| pick(k))
                .map(|(_, n, _)| *n)
                .sum::<usize>()
        };
        let worker_held = self.worker_blocks.get(&worker_id).copied().unwrap_or(0);
        let want = blocks
            .min(self.config.max_blocks_per_rank.saturating_sub(len))
            .min(
                self.config
                    .max_blocks_per_worker
                    .saturating_sub(worker_held + hinted(&|k| k.0 == worker_id)),
            )
            .min(
                self.config
                    .max_blocks
                    .saturating_sub(self.blocks + hinted(&|_| true)),
            );
        let target = len + want;
        if want == 0 || target <= cap {
            return;
        }
        // Leave the byte cap's room to the blocks themselves: a table that would
        // take more than half of what is left (the hints before it counted) is
        // grown as they come instead.
        let pending: usize = self
            .reserved
            .iter()
            .map(|(_, n, _)| table_bytes(*n, BLOCK_ENTRY))
            .sum();
        let left = self.config.max_bytes.saturating_sub(self.bytes() + pending);
        if table_bytes(target, BLOCK_ENTRY) > left / 2 {
            return;
        }
        let slot = self.rank_of.get(&key).copied();
        self.reserved.push((key, want, slot));
        if let Some(slot) = slot {
            self.grow_table(slot, want);
        }
    }

    /// The hints of [`reserve`](Self::reserve) are spent: a table they sized that
    /// its blocks filled less than a quarter of is shrunk back.
    pub(crate) fn end_reserve(&mut self) {
        for (key, _, _) in std::mem::take(&mut self.reserved) {
            if let Some(&slot) = self.rank_of.get(&key) {
                self.shrink_table(slot);
            }
        }
    }

    /// Gives back most of a rank's table once it holds less than a quarter of what
    /// it had room for.
    pub(super) fn shrink_table(&mut self, slot: u32) {
        let Some(r) = self.ranks.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        let len = r.blocks.len();
        if r.cap_seen > 64 && len < r.cap_seen / 4 {
            r.blocks.shrink_to(len * 2);
            let after = r.blocks.capacity();
            self.rank_table_bytes = self.rank_table_bytes - table_bytes(r.cap_seen, BLOCK_ENTRY)
                + table_bytes(after, BLOCK_ENTRY);
            r.cap_seen = after;
        }
    }

    /// A new rank's table: sized as a hint asked, if one did.
    pub(super) fn new_table(&mut self, key: (WorkerId, DpRank)) -> (FastMap<Key, u32>, usize) {
        let Some(blocks) = self
            .reserved
            .iter()
            .find(|(k, _, slot)| *k == key && slot.is_none())
            .map(|(_, n, _)| *n)
        else {
            return (FastMap::default(), 0);
        };
        let table = FastMap::with_capacity_and_hasher(blocks, Default::default());
        let cap = table.capacity();
        self.rank_table_bytes += table_bytes(cap, BLOCK_ENTRY);
        (table, cap)
    }

    fn grow_table(&mut self, slot: u32, more: usize) {
        let Some(r) = self.ranks.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        r.blocks.reserve(more);
        let cap = r.blocks.capacity();
        if cap > r.cap_seen {
            self.rank_table_bytes = self.rank_table_bytes + table_bytes(cap, BLOCK_ENTRY)
                - table_bytes(r.cap_seen, BLOCK_ENTRY);
            r.cap_seen = cap;
        }
    }

    /// Stores `blocks` (the first of them has no position in the tree under
    /// `cursor`, and the rank does not hold it) as new positions: the caps are
    /// checked once for as many as one run takes, then each block that the rank does
    /// not hold yet is appended to the run the first one starts or ends. Returns how
    /// many were stored (at least 1).
    pub(super) fn store_fresh(
        &mut self,
        slot: u32,
        cursor: &mut Option<u32>,
        blocks: &[StoredBlock],
    ) -> Result<usize, IndexRefusal> {
        let Some(first) = blocks.first() else {
            return Ok(0);
        };
        // Room for a run's worth; near the byte cap (where a run's growth terms may
        // not fit though one block's do), as the one-block path would have it.
        let left = blocks.len();
        let fit = match self.fit(slot, left.min(MAX_RUN), left, true) {
            Err(IndexRefusal::IndexFull { .. }) if left > 1 => self.room(slot, 1, left, true)?,
            fit => fit.inspect_err(|refusal| self.count_refusal(*refusal))?,
        };
        let Some(mut at) = self.tree.new_position(*cursor, first.tokens_hash, slot) else {
            return Ok(1);
        };
        self.remember(slot, first.block_hash, at);
        *cursor = Some(at);
        let mut stored = 1;
        while let Some(b) = blocks.get(stored).filter(|_| stored < fit) {
            let key = Key::from(b.block_hash);
            if self.rank(slot).is_none_or(|r| r.blocks.contains_key(&key)) {
                break;
            }
            let more = fit - stored - 1;
            let Some(p) = self.tree.append(at, b.tokens_hash, slot, more) else {
                break;
            };
            self.remember(slot, b.block_hash, p);
            *cursor = Some(p);
            at = p;
            stored += 1;
        }
        Ok(stored)
    }
}

/// Ranks one dump may announce ahead ([`RouterIndex::reserve`]); more are grown as
/// their blocks come.
pub(crate) const MAX_RESERVED: usize = 64;
