//! `DedupFilter`: reference-counted suppression of removals (DESIGN §4.2).

use std::collections::HashMap;

use super::event::{BlockHash, DpRank, KvEventData, Placement, StorageTier};

/// How removals are filtered.
///
/// ```
/// use eventplane::kv::{DedupMode, ProcessorConfig};
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

/// Reference-counted dedup per `(dp_rank, tier)`, sans-IO.
///
/// Each stored block hash counts +1 (repeats within one event too). A removed hash
/// passes only when its count reaches 0, and is then forgotten; hashes never stored
/// pass. A `Removed` whose hashes are all filtered disappears (and so consumes no id).
/// `Cleared` forgets the counts of its own `(dp_rank, tier)` only.
///
/// ```
/// use eventplane::kv::{BlockHash, DedupFilter, DedupMode, KvEventData, Placement, StorageTier, StoredBlock, TokensHash, WorkerId};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// let store = KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(1), tokens_hash: TokensHash(0) }] };
/// let remove = || KvEventData::Removed { block_hashes: vec![BlockHash(1)] };
/// let mut dedup = DedupFilter::new(DedupMode::RefCounted);
/// dedup.filter(&at, store.clone());
/// dedup.filter(&at, store);
/// assert_eq!(dedup.filter(&at, remove()), None); // still stored once
/// assert_eq!(dedup.filter(&at, remove()), Some(remove()));
/// ```
#[derive(Debug, Clone, Default)]
pub struct DedupFilter {
    mode: DedupMode,
    counts: HashMap<(DpRank, StorageTier), HashMap<BlockHash, u32>>,
    suppressed: u64,
}

impl DedupFilter {
    /// A filter in `mode`.
    pub fn new(mode: DedupMode) -> DedupFilter {
        DedupFilter {
            mode,
            counts: HashMap::new(),
            suppressed: 0,
        }
    }

    /// Hashes currently tracked (all ranks and tiers).
    pub fn tracked(&self) -> usize {
        self.counts.values().map(HashMap::len).sum()
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
                let counts = self.counts.entry(key).or_default();
                for b in &blocks {
                    *counts.entry(b.block_hash).or_insert(0) += 1;
                }
                Some(KvEventData::Stored {
                    parent_hash,
                    blocks,
                })
            }
            KvEventData::Removed { mut block_hashes } => {
                if let Some(counts) = self.counts.get_mut(&key) {
                    block_hashes.retain(|h| match counts.get_mut(h) {
                        None => true,
                        Some(n) => {
                            *n -= 1;
                            if *n == 0 {
                                counts.remove(h);
                                true
                            } else {
                                false
                            }
                        }
                    });
                    if counts.is_empty() {
                        self.counts.remove(&key);
                    }
                }
                if block_hashes.is_empty() {
                    self.suppressed += 1;
                    return None;
                }
                Some(KvEventData::Removed { block_hashes })
            }
            KvEventData::Cleared => {
                self.counts.remove(&key);
                Some(KvEventData::Cleared)
            }
        }
    }
}
