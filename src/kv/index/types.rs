//! The index's settings, refusals, scores and counters.

use super::super::event::{DpRank, WorkerId};
#[cfg(doc)]
use super::RouterIndex;

/// Settings of a [`RouterIndex`]: its caps, and whom an event is attributed to.
///
/// ```
/// use eventplane::kv::{router::{Attribution, RouterIndex, RouterIndexConfig}};
/// let config = RouterIndexConfig::default()
///     .max_blocks_per_rank(100_000)
///     .max_blocks(10_000_000)
///     .max_bytes(1 << 30)
///     .attribution(Attribution::Strict);
/// let index = RouterIndex::new(config);
/// assert_eq!(index.stats().blocks, 0);
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct RouterIndexConfig {
    pub(super) max_blocks_per_rank: usize,
    pub(super) max_blocks_per_worker: usize,
    pub(super) max_blocks: usize,
    pub(super) max_bytes: usize,
    pub(super) attribution: Attribution,
}

impl Default for RouterIndexConfig {
    fn default() -> Self {
        RouterIndexConfig {
            max_blocks_per_rank: 1 << 20,
            max_blocks_per_worker: 1 << 23,
            max_blocks: 1 << 24,
            max_bytes: 2 << 30,
            attribution: Attribution::Publisher,
        }
    }
}

impl RouterIndexConfig {
    /// Blocks one (worker, rank) may hold in the index. Default 2^20 (1,048,576: a
    /// large engine's whole device cache); 0 indexes nothing. Stored blocks past it
    /// are refused and counted ([`IndexRefusal::RankFull`]).
    pub fn max_blocks_per_rank(mut self, blocks: usize) -> Self {
        self.max_blocks_per_rank = blocks;
        self
    }

    /// Blocks one worker may hold in the index, over all its ranks. Default 2^23
    /// (8,388,608: eight ranks at their default cap), so that one worker with many
    /// ranks cannot take the whole index from the others. Stored blocks past it are
    /// refused and counted ([`IndexRefusal::WorkerFull`]).
    pub fn max_blocks_per_worker(mut self, blocks: usize) -> Self {
        self.max_blocks_per_worker = blocks;
        self
    }

    /// Blocks (one per (worker, rank) holding one) in the whole index. Default 2^24
    /// (16,777,216). Past it: [`IndexRefusal::IndexFull`].
    pub fn max_blocks(mut self, blocks: usize) -> Self {
        self.max_blocks = blocks;
        self
    }

    /// Bytes the index's tables may take, spare capacity included. Default 2 GiB.
    /// A store that would grow a table past it is refused ([`IndexRefusal::IndexFull`]).
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Whom an event is indexed under. Default [`Attribution::Publisher`].
    pub fn attribution(mut self, attribution: Attribution) -> Self {
        self.attribution = attribution;
        self
    }
}

/// Whose blocks an event may write, given the identity the router knows for the
/// publisher that sent it (discovery's record, or what the bus granted a source).
///
/// Either way, an event naming another worker than its publisher's known identity is
/// refused ([`IndexRefusal::ForeignWorker`]): a credential for worker 7 cannot write
/// worker 8's blocks. The choice is only how strict to be with publishers the router
/// knows no identity for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attribution {
    /// Events from a publisher with a known identity must name that worker; events
    /// from a publisher without one (a static endpoint list, a record that names no
    /// worker) are indexed under the worker they name.
    #[default]
    Publisher,
    /// As `Publisher`, and events from a publisher without a known identity are
    /// refused ([`IndexRefusal::Unidentified`]).
    Strict,
}

/// Why an event, or part of it, was not indexed. Each is counted in
/// [`RouterIndexStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexRefusal {
    /// The event names another worker than the identity of the publisher it came
    /// from. Nothing was applied.
    #[error("event for worker {} from the publisher of worker {}", named.0, sender.0)]
    ForeignWorker {
        /// The worker the event names.
        named: WorkerId,
        /// The worker its publisher is known as.
        sender: WorkerId,
    },
    /// The publisher has no known identity and the index is [`Attribution::Strict`].
    /// Nothing was applied.
    #[error("event from a publisher with no known worker identity")]
    Unidentified,
    /// A `Stored` event's parent is not a block this (worker, rank) holds. Nothing
    /// was applied.
    #[error("stored blocks under a parent the rank does not hold")]
    UnknownParent,
    /// A `Stored` event repeats a block hash, or names one of its own blocks as its
    /// parent. Nothing was applied.
    #[error("stored chain repeats a block hash")]
    InvalidChain,
    /// The (worker, rank) holds its cap of blocks; `refused` stored blocks (the
    /// event's last ones) were not indexed.
    #[error("rank at its block cap: {refused} stored blocks refused")]
    RankFull {
        /// Blocks not indexed.
        refused: usize,
    },
    /// The worker holds its cap of blocks over all its ranks; `refused` stored
    /// blocks (the event's last ones) were not indexed.
    #[error("worker at its block cap: {refused} stored blocks refused")]
    WorkerFull {
        /// Blocks not indexed.
        refused: usize,
    },
    /// The index holds its cap of blocks or bytes; `refused` stored blocks (the
    /// event's last ones) were not indexed.
    #[error("index at its cap: {refused} stored blocks refused")]
    IndexFull {
        /// Blocks not indexed.
        refused: usize,
    },
}

/// One (worker, rank)'s overlap with a sequence: how many of its leading blocks the
/// rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OverlapScore {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// Leading blocks of the sequence it holds (at least 1).
    pub blocks: u32,
}

/// What [`RouterIndex::find_matches`] found: every (worker, rank) holding at least
/// the sequence's first block, ordered by worker then rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub(super) scores: Vec<OverlapScore>,
}

impl OverlapScores {
    /// Every score, ordered by worker then rank.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &OverlapScore> + '_ {
        self.scores.iter()
    }

    /// The score of one (worker, rank), 0 when it holds none of the leading blocks.
    pub fn get(&self, worker_id: WorkerId, dp_rank: DpRank) -> u32 {
        self.scores
            .binary_search_by(|s| (s.worker_id, s.dp_rank).cmp(&(worker_id, dp_rank)))
            .ok()
            .and_then(|i| self.scores.get(i))
            .map_or(0, |s| s.blocks)
    }

    /// The highest score (the lowest worker and rank among equals), if any.
    pub fn best(&self) -> Option<OverlapScore> {
        self.scores
            .iter()
            .copied()
            .min_by_key(|s| (std::cmp::Reverse(s.blocks), s.worker_id, s.dp_rank))
    }

    /// How many (worker, rank)s scored.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// No (worker, rank) holds the sequence's first block.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }
}

impl IntoIterator for OverlapScores {
    type Item = OverlapScore;
    type IntoIter = std::vec::IntoIter<OverlapScore>;

    fn into_iter(self) -> Self::IntoIter {
        self.scores.into_iter()
    }
}

/// Counters and sizes of a [`RouterIndex`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouterIndexStats {
    /// Blocks indexed now (one per (worker, rank) holding one).
    pub blocks: u64,
    /// Distinct nodes (block positions) in the tree now.
    pub nodes: u64,
    /// (worker, rank)s holding at least one block now.
    pub ranks: u64,
    /// Bytes the index's tables take now, spare capacity included.
    pub bytes: u64,
    /// Events applied (in whole or in part).
    pub events: u64,
    /// Blocks stored (indexed).
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
    /// Removed hashes the rank did not hold (nothing to do; counted).
    pub unknown_removed_blocks: u64,
    /// Ranks cleared: `Cleared` events, [`RouterIndex::clear_rank`].
    pub cleared_ranks: u64,
    /// Workers removed ([`RouterIndex::remove_worker`]).
    pub removed_workers: u64,
    /// Stored blocks already held at that place by the rank (a duplicate store).
    pub duplicate_blocks: u64,
    /// Stored blocks whose node the rank already holds under another block hash
    /// (refused: the first hash stays).
    pub conflicting_blocks: u64,
    /// Events for a tier this index does not score (not device).
    pub other_tier_events: u64,
    /// Events refused: payload naming another worker than its publisher.
    pub refused_foreign: u64,
    /// Events refused: publisher without identity, under [`Attribution::Strict`].
    pub refused_unidentified: u64,
    /// Events refused: unknown parent.
    pub refused_unknown_parent: u64,
    /// Events refused: a chain repeating a hash.
    pub refused_invalid_chain: u64,
    /// Stored blocks refused: the rank at its cap.
    pub refused_rank_full_blocks: u64,
    /// Stored blocks refused: the worker at its cap (over all its ranks).
    pub refused_worker_full_blocks: u64,
    /// Stored blocks refused: the index at its block or byte cap.
    pub refused_index_full_blocks: u64,
}
