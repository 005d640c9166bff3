//! `DedupFilter`: reference-counted suppression of removals.

use crate::hash::FastMap;

use super::event::{BlockHash, DpRank, KvEventData, Placement, StorageTier};
use crate::config::{self, ConfigError};

/// How removals are filtered.
///
/// ```
/// use eventplane::kv::{pipeline::{DedupMode, ProcessorConfig}};
/// assert_eq!(DedupMode::default(), DedupMode::RefCounted);
/// let config = ProcessorConfig::default().dedup(DedupMode::SetLike);
/// # let _ = config;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DedupMode {
    /// Count stores per block hash; a removal passes only when the count reaches 0.
    #[default]
    RefCounted,
    /// No bookkeeping: everything passes.
    SetLike,
}

/// Default cap on hashes tracked, all `(dp_rank, tier)` pairs together: 2^21. A
/// tracked hash costs at most about 36 bytes (hash table slack included), so this is
/// about 72 MiB at worst.
pub(crate) const DEFAULT_MAX_TRACKED_HASHES: usize = 1 << 21;

/// Default cap on distinct `(dp_rank, tier)` pairs tracked: 64.
pub(crate) const DEFAULT_MAX_TRACKED_RANKS: usize = 64;

/// Largest table kept for reuse once its pair emptied.
const SPARE_CAPACITY: usize = 1 << 16;

/// Reference-counted dedup per `(dp_rank, tier)`, sans-IO.
///
/// Each stored block hash counts +1 (repeats within one event too; counts saturate).
/// A removed hash passes only when its count reaches 0, and is then forgotten; hashes
/// never stored pass. A `Removed` whose hashes are all filtered disappears (and so
/// consumes no id). `Cleared` forgets the counts of every tier of its `dp_rank` (a
/// router takes a clear to empty that rank in every tier: [`KvEventData::Cleared`]),
/// and no other rank's.
///
/// Memory is bounded: at most `max_hashes` hashes across all pairs and `max_ranks`
/// pairs (defaults 2^21 and 64). A
/// store that would pass a cap first forgets what was tracked (the pair tracking the
/// most hashes for the hash cap, every pair for the rank cap), gives the table's
/// memory back, and counts a [`reset`](Self::resets): removals of blocks stored
/// before it then pass, which a router tolerates (it may drop a block another copy
/// still holds), where an unbounded table would not be tolerated at all.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEventData, Placement, StorageTier, StoredBlock, TokensHash, WorkerId, pipeline::{DedupFilter, DedupMode}};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// let store = KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(1), tokens_hash: TokensHash(0) }] };
/// let remove = || KvEventData::Removed { block_hashes: vec![BlockHash(1)] };
/// let mut dedup = DedupFilter::new(DedupMode::RefCounted);
/// dedup.filter(&at, store.clone());
/// dedup.filter(&at, store);
/// assert_eq!(dedup.filter(&at, remove()), None); // still stored once
/// assert_eq!(dedup.filter(&at, remove()), Some(remove()));
/// ```
#[derive(Debug, Clone)]
pub struct DedupFilter {
    mode: DedupMode,
    counts: FastMap<(DpRank, StorageTier), FastMap<BlockHash, u32>>,
    suppressed: u64,
    /// Hashes in `counts`, all pairs together.
    tracked: usize,
    max_hashes: usize,
    max_ranks: usize,
    resets: u64,
    /// The table of a pair that emptied, kept for the next pair that needs one (a
    /// worker's pair empties and refills all the time: without it, each refill
    /// allocates and grows a table again). Empty, and shrunk to room for
    /// [`SPARE_CAPACITY`] entries when larger, so it adds at most about 2.5 MiB to the
    /// caps' bound.
    spare: FastMap<BlockHash, u32>,
}

impl Default for DedupFilter {
    fn default() -> Self {
        DedupFilter::new(DedupMode::default())
    }
}

impl DedupFilter {
    /// A filter in `mode`, with the default caps.
    pub fn new(mode: DedupMode) -> DedupFilter {
        DedupFilter {
            mode,
            counts: FastMap::default(),
            suppressed: 0,
            tracked: 0,
            max_hashes: DEFAULT_MAX_TRACKED_HASHES,
            max_ranks: DEFAULT_MAX_TRACKED_RANKS,
            resets: 0,
            spare: FastMap::default(),
        }
    }

    /// Caps on hashes tracked (all pairs together) and on distinct `(dp_rank, tier)`
    /// pairs; [`ConfigError::Zero`] names a zero cap.
    ///
    /// ```
    /// use eventplane::kv::{BlockHash, KvEventData, Placement, StorageTier, StoredBlock, TokensHash, WorkerId, pipeline::{DedupFilter, DedupMode}};
    /// let mut dedup = DedupFilter::new(DedupMode::RefCounted).with_limits(2, 1)?;
    /// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
    /// let store = |h| KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(h), tokens_hash: TokensHash(0) }] };
    /// for h in 0..3 { dedup.filter(&at, store(h)); } // the third store passes the cap
    /// assert_eq!((dedup.tracked(), dedup.resets()), (1, 1));
    /// # Ok::<(), eventplane::ConfigError>(())
    /// ```
    pub fn with_limits(
        mut self,
        max_hashes: usize,
        max_ranks: usize,
    ) -> Result<DedupFilter, ConfigError> {
        self.max_hashes = config::nonzero("max_hashes", max_hashes)?;
        self.max_ranks = config::nonzero("max_ranks", max_ranks)?;
        Ok(self)
    }

    /// Times a cap made the filter forget what it tracked.
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// Hashes currently tracked (all ranks and tiers).
    pub fn tracked(&self) -> usize {
        self.tracked
    }

    /// Forgets the pair tracking the most hashes, giving its memory back.
    fn reset_largest(&mut self) {
        let largest = self
            .counts
            .iter()
            .max_by_key(|(_, c)| c.len())
            .map(|(k, _)| *k);
        if let Some(key) = largest {
            self.forget(&key);
        }
        self.spare = FastMap::default();
        self.resets += 1;
    }

    /// Forgets one pair's counts.
    fn forget(&mut self, key: &(DpRank, StorageTier)) {
        if let Some(counts) = self.counts.remove(key) {
            self.tracked -= counts.len();
        }
    }

    /// Events that disappeared so far (removals whose every hash was still stored
    /// elsewhere).
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }

    /// Filters one event; `None` means it disappears.
    pub fn filter(&mut self, placement: &Placement, data: KvEventData) -> Option<KvEventData> {
        if self.mode == DedupMode::SetLike {
            return Some(data);
        }
        let key = (placement.dp_rank, placement.tier);
        match data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                if !self.counts.contains_key(&key) && self.counts.len() >= self.max_ranks {
                    self.counts = FastMap::default();
                    self.spare = FastMap::default();
                    self.tracked = 0;
                    self.resets += 1;
                }
                if self.tracked.saturating_add(blocks.len()) <= self.max_hashes {
                    // No cap can be reached by this event: one table lookup, then one
                    // entry per hash.
                    if !blocks.is_empty() {
                        let counts = table(&mut self.counts, &mut self.spare, key);
                        for b in &blocks {
                            count(counts, &mut self.tracked, b.block_hash);
                        }
                    }
                } else {
                    for b in &blocks {
                        let known = self
                            .counts
                            .get(&key)
                            .is_some_and(|c| c.contains_key(&b.block_hash));
                        if !known && self.tracked >= self.max_hashes {
                            self.reset_largest();
                        }
                        let counts = table(&mut self.counts, &mut self.spare, key);
                        count(counts, &mut self.tracked, b.block_hash);
                    }
                }
                Some(KvEventData::Stored {
                    parent_hash,
                    blocks,
                })
            }
            KvEventData::Removed { mut block_hashes } => {
                if let Some(counts) = self.counts.get_mut(&key) {
                    let before = counts.len();
                    // Not `entry`: it reserves room for an absent key, and a removal
                    // must not grow the table.
                    block_hashes.retain(|h| match counts.get_mut(h) {
                        None => true,
                        Some(n) => {
                            *n = n.saturating_sub(1);
                            if *n == 0 {
                                counts.remove(h);
                                true
                            } else {
                                false
                            }
                        }
                    });
                    self.tracked -= before - counts.len();
                    if counts.is_empty() {
                        if let Some(mut emptied) = self.counts.remove(&key) {
                            // A table grown past SPARE_CAPACITY is reallocated down
                            // (rarely); a smaller one is kept as it is.
                            emptied.shrink_to(SPARE_CAPACITY);
                            self.spare = emptied;
                        }
                    }
                }
                if block_hashes.is_empty() {
                    self.suppressed += 1;
                    return None;
                }
                Some(KvEventData::Removed { block_hashes })
            }
            KvEventData::Cleared => {
                let rank = placement.dp_rank;
                let mut forgotten = 0;
                self.counts.retain(|(r, _), counts| {
                    let keep = *r != rank;
                    if !keep {
                        forgotten += counts.len();
                    }
                    keep
                });
                self.tracked -= forgotten;
                Some(KvEventData::Cleared)
            }
        }
    }
}

/// The table of `key`, made from `spare` when it has none.
fn table<'a>(
    counts: &'a mut FastMap<(DpRank, StorageTier), FastMap<BlockHash, u32>>,
    spare: &mut FastMap<BlockHash, u32>,
    key: (DpRank, StorageTier),
) -> &'a mut FastMap<BlockHash, u32> {
    counts.entry(key).or_insert_with(|| std::mem::take(spare))
}

/// One more store of `hash` (saturating); `tracked` counts it if it is new.
fn count(counts: &mut FastMap<BlockHash, u32>, tracked: &mut usize, hash: BlockHash) {
    let n = counts.entry(hash).or_insert(0);
    if *n == 0 {
        *tracked += 1;
    }
    *n = n.saturating_add(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{StoredBlock, TokensHash, WorkerId};

    fn at(dp_rank: u32) -> Placement {
        Placement {
            worker_id: WorkerId(1),
            dp_rank,
            tier: StorageTier::Device,
        }
    }

    fn store(hashes: impl IntoIterator<Item = u64>) -> KvEventData {
        KvEventData::Stored {
            parent_hash: None,
            blocks: hashes
                .into_iter()
                .map(|h| StoredBlock {
                    block_hash: BlockHash(h),
                    tokens_hash: TokensHash(0),
                })
                .collect(),
        }
    }

    fn remove(h: u64) -> KvEventData {
        KvEventData::Removed {
            block_hashes: vec![BlockHash(h)],
        }
    }

    #[test]
    fn an_emptied_pair_leaves_its_table_for_the_next() {
        let mut d = DedupFilter::new(DedupMode::RefCounted)
            .with_limits(1000, 1)
            .unwrap();
        d.filter(&at(0), store(0..100));
        let all = KvEventData::Removed {
            block_hashes: (0..100).map(BlockHash).collect(),
        };
        assert_eq!(d.filter(&at(0), all.clone()), Some(all));
        assert_eq!(d.tracked(), 0);
        // (capacity() leaves out the removals' tombstones, which a refill clears.)
        assert!(d.spare.capacity() > 0, "kept for the next pair");
        // A store of no block tracks no pair: another rank still fits a cap of one.
        d.filter(&at(3), store(std::iter::empty()));
        d.filter(&at(1), store(0..100));
        assert_eq!((d.tracked(), d.resets(), d.spare.capacity()), (100, 0, 0));
    }

    #[test]
    fn tracked_hashes_are_capped_with_a_counted_reset() {
        let mut d = DedupFilter::new(DedupMode::RefCounted)
            .with_limits(100, 8)
            .unwrap();
        d.filter(&at(1), store(1000..1010));
        d.filter(&at(0), store(0..90));
        assert_eq!((d.tracked(), d.resets()), (100, 0));
        // Over the cap: the pair tracking the most (rank 0) is forgotten.
        d.filter(&at(0), store([100]));
        assert_eq!((d.tracked(), d.resets()), (11, 1));
        assert_eq!(d.filter(&at(1), remove(1000)), Some(remove(1000)));
        // Forgotten hashes pass on removal; the tracked one is still counted.
        assert_eq!(d.filter(&at(0), remove(5)), Some(remove(5)));
        d.filter(&at(0), store([100]));
        assert_eq!(d.filter(&at(0), remove(100)), None);
    }

    #[test]
    fn ranks_are_capped_with_a_counted_reset() {
        let mut d = DedupFilter::new(DedupMode::RefCounted)
            .with_limits(100, 4)
            .unwrap();
        for rank in 0..1000 {
            d.filter(&at(rank), store([u64::from(rank)]));
            assert!(d.counts.len() <= 4);
        }
        assert!(d.resets() >= 249, "{}", d.resets());
    }

    #[test]
    fn counts_saturate() {
        let mut d = DedupFilter::new(DedupMode::RefCounted);
        d.counts
            .entry((0, StorageTier::Device))
            .or_default()
            .insert(BlockHash(7), u32::MAX);
        d.tracked = 1;
        d.filter(&at(0), store([7])); // would overflow: saturates
        assert_eq!(d.filter(&at(0), remove(7)), None);
        assert_eq!(d.tracked(), 1);
    }
}
