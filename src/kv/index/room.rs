//! What a [`RouterIndex`] lets in: the caps' room for a store, and giving room back.

use std::mem::size_of;

use super::tree::{self, table_bytes};
use super::{BLOCK_ENTRY, IndexRefusal, RouterIndex};

impl RouterIndex {
    /// How many of `want` more blocks fit (at least 1); else counts and says why not
    /// (`left` blocks refused).
    pub(super) fn room(
        &mut self,
        slot: u32,
        want: usize,
        left: usize,
        new_position: bool,
    ) -> Result<usize, IndexRefusal> {
        self.fit(slot, want, left, new_position)
            .inspect_err(|refusal| self.count_refusal(*refusal))
    }

    /// Counts a refusal of [`room`](Self::room)'s.
    pub(super) fn count_refusal(&mut self, refusal: IndexRefusal) {
        match refusal {
            IndexRefusal::RankFull { refused } => {
                self.stats.refused_rank_full_blocks += refused as u64;
            }
            IndexRefusal::WorkerFull { refused } => {
                self.stats.refused_worker_full_blocks += refused as u64;
            }
            IndexRefusal::IndexFull { refused } => {
                self.stats.refused_index_full_blocks += refused as u64;
            }
            _ => {}
        }
    }

    /// [`room`](Self::room), uncounted.
    pub(super) fn fit(
        &self,
        slot: u32,
        want: usize,
        left: usize,
        new_position: bool,
    ) -> Result<usize, IndexRefusal> {
        let Some((worker, rank_len, rank_cap)) = self
            .rank(slot)
            .map(|r| (r.key.0, r.blocks.len(), r.blocks.capacity()))
        else {
            return Err(IndexRefusal::IndexFull { refused: left });
        };
        let rank_room = self.config.max_blocks_per_rank.saturating_sub(rank_len);
        if rank_room == 0 {
            return Err(IndexRefusal::RankFull { refused: left });
        }
        let worker_len = self.worker_blocks.get(&worker).copied().unwrap_or(0);
        let worker_room = self.config.max_blocks_per_worker.saturating_sub(worker_len);
        if worker_room == 0 {
            return Err(IndexRefusal::WorkerFull { refused: left });
        }
        // What the rank's table and the tree may grow by for `want` blocks.
        let table = if rank_len + want > rank_cap {
            table_bytes((rank_cap * 2).max(rank_len + want), BLOCK_ENTRY)
        } else {
            0
        };
        let fixed = self.bytes() + table + self.tree.growth(want) + self.holder_copies();
        let per_block = if new_position {
            tree::POSITION_BYTES
        } else {
            0
        } + 1;
        let byte_room = self.config.max_bytes.saturating_sub(fixed) / per_block;
        let fit = want
            .min(rank_room)
            .min(worker_room)
            .min(self.config.max_blocks.saturating_sub(self.blocks))
            .min(byte_room);
        if fit == 0 {
            return Err(IndexRefusal::IndexFull { refused: left });
        }
        Ok(fit)
    }

    /// Whether one more position fits under the byte cap; counts and says why not.
    pub(super) fn position_room(&mut self, left: usize) -> Result<(), IndexRefusal> {
        if self.bytes() + self.tree.growth(1) + self.holder_copies() + tree::POSITION_BYTES
            > self.config.max_bytes
        {
            self.stats.refused_index_full_blocks += left as u64;
            return Err(IndexRefusal::IndexFull { refused: left });
        }
        Ok(())
    }

    /// Bytes the holder lists of two split runs may take at most (one entry per rank
    /// each).
    fn holder_copies(&self) -> usize {
        2 * self.rank_of.len() * size_of::<u32>()
    }

    /// Gives back the tables' room once most of it is free (positions and runs
    /// renumbered, every rank's table rewritten): O(what the index holds), paid once
    /// at least three quarters of the positions or runs ever made are gone.
    pub(super) fn compact_if_sparse(&mut self) {
        let Some(moved) = self.tree.compact_if_sparse() else {
            return;
        };
        for rank in self.ranks.iter_mut().flatten() {
            for pos in rank.blocks.values_mut() {
                if let Some(&new) = moved.get(*pos as usize) {
                    *pos = new;
                }
            }
        }
    }
}
