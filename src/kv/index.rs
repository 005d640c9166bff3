//! The router's KV index ([`RouterIndex`]) and the local block hashes it is queried
//! with ([`local_block_hashes`]).

use std::collections::BTreeMap;
use std::mem::size_of;

use smallvec::SmallVec;

use super::event::{
    BlockHash, DpRank, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
    tokens_hash,
};
use crate::hash::{FastMap, FastSet};

mod bulk;
mod room;
mod tree;
mod types;
use tree::{ROOT, Tree, table_bytes};
pub use types::{
    Attribution, IndexRefusal, OverlapScore, OverlapScores, RouterIndexConfig, RouterIndexStats,
};

/// The local block hashes of a request's tokens, as Dynamo's router computes them
/// (`compute_block_hash_for_seq` without LoRA, multimodal or namespace inputs): each
/// full block of `block_size` tokens hashed with [`tokens_hash`]; a last block with
/// fewer tokens is left out (no engine has stored it). A `block_size` of 0 gives no
/// hashes.
///
/// ```
/// use eventplane::kv::{tokens_hash, router::local_block_hashes};
/// let tokens: Vec<u32> = (0..10).collect();
/// let hashes = local_block_hashes(&tokens, 4);
/// assert_eq!(hashes, vec![tokens_hash(&tokens[..4]), tokens_hash(&tokens[4..8])]);
/// assert!(local_block_hashes(&tokens, 0).is_empty());
/// ```
pub fn local_block_hashes(tokens: &[u32], block_size: usize) -> Vec<TokensHash> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens.chunks_exact(block_size).map(tokens_hash).collect()
}

/// The router's KV index: which worker already holds the longest prefix of a request?
///
/// [`RouterIndex`] keeps every worker's blocks, per (worker, data-parallel rank), in one
/// prefix tree keyed by the blocks' [`TokensHash`]es, and answers
/// [`find_matches`](RouterIndex::find_matches): for a request's sequence of local
/// block hashes ([`local_block_hashes`]), how many *leading* blocks each (worker,
/// rank) holds. That is the overlap score a KV-aware router ranks workers by, with
/// the semantics of NVIDIA Dynamo 1.6.1's `RadixTree` (checked against the real one
/// in `tests/router_index_dynamo.rs`):
///
/// - a `Stored` event attaches its blocks, in chain order, under its `parent_hash`
///   as *that worker and rank* stored it (no parent: at the root). A parent the rank
///   does not hold — stored by another rank, removed, lost in a gap — refuses the
///   whole event ([`IndexRefusal::UnknownParent`]), as Dynamo's tree does
///   (`ParentBlockNotFound`): attaching the blocks anywhere else would credit the
///   worker with a prefix it may not hold. Send the chain again from a known parent
///   (or from the root) and it is indexed.
/// - blocks are shared between workers by their tokens hash: two workers storing the
///   same tokens under the same prefix hold the same node, whatever their engines'
///   block hashes are (a worker's block hashes are its own, looked up per rank).
/// - a score counts leading blocks only: a worker that holds blocks 2 and 3 of a
///   sequence but not block 1 scores 0 for it; one that holds 1 and 3 scores 1.
/// - `Removed` and `Cleared` apply to the event's rank;
///   [`remove_worker`](RouterIndex::remove_worker) to every rank of a worker.
/// - only [`StorageTier::Device`] blocks are scored (Dynamo's radix tree scores the
///   device tier; its lower tiers have indexers of their own). Events for other tiers
///   are counted ([`RouterIndexStats::other_tier_events`]) and left out.
///
/// Where this index differs from Dynamo 1.6.1's tree, it is where Dynamo's result
/// depends on how its tree happened to compress edges, or leaves state no event can
/// reach again: removing a block that has descendants keeps the descendants held
/// (Dynamo drops the rest of a compressed edge, but not child edges, from the
/// worker's view); a block hash stored again under another parent moves there
/// (Dynamo leaves the old position scored and unremovable); a second block hash for
/// a node the rank already holds is refused and counted
/// ([`RouterIndexStats::conflicting_blocks`]; Dynamo records it but can then remove
/// neither). Engines that chain block hashes (vLLM, SGLang, TensorRT-LLM) never do
/// the latter two.
///
/// # Bounded by design
/// Nothing a worker sends grows the index past its caps ([`RouterIndexConfig`]):
/// blocks per (worker, rank) (default 2^20), per worker over its ranks (default
/// 2^23), blocks in the whole index (default
/// 2^24) and bytes in the whole index (default 2 GiB, counted from the tables'
/// capacities, so the figure includes their spare room). A `Stored` event past a
/// cap keeps its leading blocks that fit and refuses the rest, counted by cause. No
/// entry exists without a block behind it: a rank that holds no block has no entry,
/// and a position no rank holds is freed as soon as nothing below it is held either.
/// A position no rank holds stays while blocks below it are held (a rank that evicts
/// a prefix but keeps its tail, or moves a block hash, leaves one): such positions
/// count against the byte cap, not against a rank's blocks. Room freed en masse
/// comes back: once three quarters of the tables' slots are free, positions and runs
/// are renumbered (O(what the index holds), paid for by the frees before it).
///
/// # How it is laid out
/// Positions (a tokens hash under its parent position) live in *runs*: consecutive
/// positions of one path held by the same ranks, at most 128 to a run. A query
/// compares a run's tokens hashes as one slice and merges its holders once, so it
/// costs one table probe per run, not per block; a rank's table maps its block
/// hashes to positions. A run splits where a rank starts or stops holding part of
/// it and merges back when neighbours have the same holders again; a split or a
/// merge moves at most one run. Memory: about 39 bytes per held block on a
/// Mooncake-shaped trace of 256 workers (`benches/vs-dynamo-index`, where Dynamo
/// 1.6.1's `RadixTree` takes about 62 on the same trace); [`RouterIndex::bytes`]
/// gives the live figure, spare table capacity included.
///
/// # Cost of each operation
/// | operation | cost |
/// |---|---|
/// | `Stored` of n blocks | O(n) table operations, plus two splits at most per stretch of the chain over positions other ranks hold |
/// | `Removed` of n hashes (known or not) | O(n) table operations, plus two splits at most per stretch of consecutive blocks |
/// | `Cleared`, [`clear_rank`](RouterIndex::clear_rank) | O(blocks the rank holds) |
/// | [`remove_worker`](RouterIndex::remove_worker) | O(blocks the worker holds, every rank) |
/// | [`find_matches`](RouterIndex::find_matches) of n hashes | O(n + runs on its path × ranks holding them) |
///
/// A split or a merge moves one run at most (128 positions), so a hostile event
/// costs what its own size says: empty lists create nothing,
/// removing unknown hashes allocates nothing, a chain that repeats a hash or names
/// its own block as parent is refused before anything is applied.
///
/// # One writer
/// `RouterIndex` is a plain value (`Send + Sync`, no interior locking): one task
/// applies events; a router that also answers queries from other tasks puts it
/// behind a `RwLock` and applies a few events per write lock, so readers wait for at
/// most those (a position is freed once, when nothing holds it or anything below
/// it: freeing costs are paid once per position stored).
///
/// ```
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, WorkerId, router::{local_block_hashes, RouterIndex}};
///
/// let block_size = 4;
/// let prompt: Vec<u32> = (0..12).collect(); // three blocks of tokens
/// let local = local_block_hashes(&prompt, block_size);
/// assert_eq!(local.len(), 3);
///
/// // Worker 7 stored the first two blocks of that prompt (its engine's hashes 71, 72).
/// let blocks = [71, 72].iter().zip(&local).map(|(&h, &t)| StoredBlock {
///     block_hash: BlockHash(h),
///     tokens_hash: t,
/// });
/// let stored = RouterEvent {
///     worker_id: WorkerId(7),
///     tier: StorageTier::Device,
///     event: KvEvent {
///         id: 1,
///         dp_rank: 0,
///         data: KvEventData::Stored { parent_hash: None, blocks: blocks.collect() },
///     },
/// };
/// let mut index = RouterIndex::default();
/// // Applied as sent by worker 7's publisher (discovery's identity for it).
/// index.apply(Some(WorkerId(7)), &stored)?;
///
/// let scores = index.find_matches(&local);
/// let best = scores.best().unwrap();
/// assert_eq!((best.worker_id, best.dp_rank, best.blocks), (WorkerId(7), 0, 2));
/// # Ok::<(), eventplane::kv::router::IndexRefusal>(())
/// ```
#[derive(Debug)]
pub struct RouterIndex {
    config: RouterIndexConfig,
    tree: Tree,
    /// Rank slots (a run's holders name them); `None` is free for reuse.
    ranks: Vec<Option<Rank>>,
    free_ranks: Vec<u32>,
    /// (worker, rank) → rank slot, ordered (a worker's ranks are one range).
    rank_of: BTreeMap<(WorkerId, DpRank), u32>,
    /// Blocks held, over every rank.
    blocks: usize,
    /// Blocks held per worker (over its ranks); no entry at 0.
    worker_blocks: FastMap<WorkerId, usize>,
    /// Bytes of the rank tables (each counted at its `cap_seen`).
    rank_table_bytes: usize,
    /// A stored chain's hashes, to refuse one that repeats itself (kept between
    /// events; emptied after each).
    scratch: FastSet<BlockHash>,
    /// Blocks announced for ranks a dump is about to fill, and the rank slot when it
    /// existed already (`bulk.rs`).
    reserved: Vec<((WorkerId, DpRank), usize, Option<u32>)>,
    stats: RouterIndexStats,
}

/// One (worker, rank)'s blocks: its block hashes and the positions they are at.
#[derive(Debug)]
struct Rank {
    key: (WorkerId, DpRank),
    blocks: FastMap<Key, u32>,
    /// The largest capacity `blocks` has had since it was made or last shrunk: what
    /// its allocation is counted at (`capacity()` dips while removals leave
    /// tombstones, the allocation does not).
    cap_seen: usize,
}

/// A block hash as a rank's table keys it: two halves, so that an entry with its
/// position takes 12 bytes, not 16 (the tables are most of the index's memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key(u32, u32);

impl From<BlockHash> for Key {
    fn from(h: BlockHash) -> Key {
        Key((h.0 >> 32) as u32, h.0 as u32)
    }
}

impl From<Key> for BlockHash {
    fn from(k: Key) -> BlockHash {
        BlockHash(u64::from(k.0) << 32 | u64::from(k.1))
    }
}

const BLOCK_ENTRY: usize = size_of::<(Key, u32)>();

/// Chains up to this long are checked for a repeated hash pair by pair (no table).
const SHORT_CHAIN: usize = 16;

impl Default for RouterIndex {
    fn default() -> Self {
        RouterIndex::new(RouterIndexConfig::default())
    }
}

impl RouterIndex {
    /// An empty index.
    pub fn new(config: RouterIndexConfig) -> RouterIndex {
        RouterIndex {
            config,
            tree: Tree::new(),
            ranks: Vec::new(),
            free_ranks: Vec::new(),
            rank_of: BTreeMap::new(),
            blocks: 0,
            worker_blocks: FastMap::default(),
            rank_table_bytes: 0,
            scratch: FastSet::default(),
            reserved: Vec::new(),
            stats: RouterIndexStats::default(),
        }
    }

    /// Applies one router event, sent by the publisher the router knows as `sender`
    /// (`None`: a publisher with no known identity; see [`Attribution`]).
    ///
    /// `Ok` when the event was applied whole. A refusal says why: for
    /// [`RankFull`](IndexRefusal::RankFull) and [`IndexFull`](IndexRefusal::IndexFull)
    /// the event's leading blocks that fit were indexed; for the others nothing was
    /// applied. Every refusal is also counted in [`stats`](Self::stats).
    pub fn apply(
        &mut self,
        sender: Option<WorkerId>,
        event: &RouterEvent,
    ) -> Result<(), IndexRefusal> {
        match (sender, self.config.attribution) {
            (Some(sender), _) if sender != event.worker_id => {
                self.stats.refused_foreign += 1;
                return Err(IndexRefusal::ForeignWorker {
                    named: event.worker_id,
                    sender,
                });
            }
            (None, Attribution::Strict) => {
                self.stats.refused_unidentified += 1;
                return Err(IndexRefusal::Unidentified);
            }
            _ => {}
        }
        let key = (event.worker_id, event.event.dp_rank);
        let result = match &event.event.data {
            KvEventData::Cleared => {
                self.clear_rank(key.0, key.1);
                Ok(())
            }
            _ if event.tier != StorageTier::Device => {
                self.stats.other_tier_events += 1;
                return Ok(());
            }
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => self.store(key, *parent_hash, blocks),
            KvEventData::Removed { block_hashes } => {
                self.remove(key, block_hashes);
                Ok(())
            }
        };
        self.stats.events += 1;
        result
    }

    /// Whether an event naming `worker`, sent by the publisher known as `sender`, passes
    /// attribution (see [`apply`](Self::apply)'s `ForeignWorker` and `Unidentified`).
    pub(crate) fn admits(&self, sender: Option<WorkerId>, worker: WorkerId) -> bool {
        match (sender, self.config.attribution) {
            (Some(sender), _) => sender == worker,
            (None, Attribution::Strict) => false,
            (None, _) => true,
        }
    }

    /// Drops every block of one (worker, rank): what a `Cleared` event does, and
    /// what a router does when it lost track of that rank. O(blocks it holds).
    pub fn clear_rank(&mut self, worker_id: WorkerId, dp_rank: DpRank) {
        self.stats.cleared_ranks += 1;
        if let Some(slot) = self.rank_of.remove(&(worker_id, dp_rank)) {
            self.drop_rank(slot);
        }
        self.compact_if_sparse();
    }

    /// Drops every block of every rank of a worker (it left). O(blocks it holds).
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.stats.removed_workers += 1;
        let range = (worker_id, DpRank::MIN)..=(worker_id, DpRank::MAX);
        let slots: SmallVec<[u32; 4]> = self.rank_of.range(range).map(|(_, &s)| s).collect();
        for slot in slots {
            if let Some(Some(rank)) = self.ranks.get(slot as usize) {
                let key = rank.key;
                self.rank_of.remove(&key);
            }
            self.drop_rank(slot);
        }
        self.compact_if_sparse();
    }

    /// Every (worker, rank) holding the leading blocks of `sequence` (local block
    /// hashes, [`local_block_hashes`]), with how many leading blocks each holds.
    /// O(`sequence.len()` + runs on its path × ranks holding them).
    pub fn find_matches(&self, sequence: &[TokensHash]) -> OverlapScores {
        let mut scores = Vec::new();
        let mut candidates: Vec<u32> = Vec::new();
        let mut kept: Vec<u32> = Vec::new();
        // Leading blocks every remaining candidate holds.
        let mut matched = 0;
        let mut at = ROOT;
        while let Some(node) = sequence
            .get(matched)
            .and_then(|t| self.tree.child(at, *t))
            .and_then(|child| self.tree.node(child).map(|n| (child, n)))
        {
            let (child, node) = node;
            if matched == 0 {
                candidates.extend_from_slice(&node.holders);
            } else if node.holders.as_slice() != candidates.as_slice() {
                // Both sorted: a merge keeps the candidates still holding this run,
                // and scores those that dropped out with the blocks they held.
                kept.clear();
                let mut holders = node.holders.iter().peekable();
                for &c in &candidates {
                    while holders.next_if(|&&h| h < c).is_some() {}
                    if holders.next_if(|&&h| h == c).is_some() {
                        kept.push(c);
                    } else {
                        self.push_score(&mut scores, c, matched);
                    }
                }
                std::mem::swap(&mut candidates, &mut kept);
            }
            if candidates.is_empty() {
                break;
            }
            let rest = sequence.get(matched..).unwrap_or_default();
            let run = node.tokens.len();
            let same = node
                .tokens
                .iter()
                .zip(rest)
                .take_while(|(a, b)| a == b)
                .count();
            matched += same;
            if same < run || node.children() == 0 {
                break;
            }
            at = child;
        }
        for &c in &candidates {
            self.push_score(&mut scores, c, matched);
        }
        scores.sort_unstable();
        OverlapScores { scores }
    }

    /// Counters and sizes.
    pub fn stats(&self) -> RouterIndexStats {
        RouterIndexStats {
            blocks: self.blocks as u64,
            nodes: self.tree.positions() as u64,
            ranks: self.rank_of.len() as u64,
            bytes: self.bytes() as u64,
            ..self.stats
        }
    }

    /// Bytes the index's tables take now, spare capacity included: the figure
    /// [`RouterIndexConfig::max_bytes`] caps.
    pub fn bytes(&self) -> usize {
        self.tree.bytes()
            + self.ranks.capacity() * size_of::<Option<Rank>>()
            + self.free_ranks.capacity() * size_of::<u32>()
            + self.rank_of.len() * (size_of::<((WorkerId, DpRank), u32)>() + 16)
            + self.rank_table_bytes
            + table_bytes(
                self.worker_blocks.capacity(),
                size_of::<(WorkerId, usize)>(),
            )
            + table_bytes(self.scratch.capacity(), size_of::<BlockHash>())
    }

    /// Blocks one (worker, rank) holds.
    pub fn rank_blocks(&self, worker_id: WorkerId, dp_rank: DpRank) -> usize {
        self.rank_of
            .get(&(worker_id, dp_rank))
            .and_then(|&s| self.rank(s))
            .map_or(0, |r| r.blocks.len())
    }

    /// Whether one (worker, rank) holds the block `hash`.
    pub fn holds(&self, worker_id: WorkerId, dp_rank: DpRank, hash: BlockHash) -> bool {
        self.rank_of
            .get(&(worker_id, dp_rank))
            .and_then(|&s| self.rank(s))
            .is_some_and(|r| r.blocks.contains_key(&Key::from(hash)))
    }

    /// The block hashes one (worker, rank) holds, in no particular order.
    pub fn rank_block_hashes(
        &self,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> impl Iterator<Item = BlockHash> + '_ {
        self.rank_of
            .get(&(worker_id, dp_rank))
            .and_then(|&s| self.rank(s))
            .into_iter()
            .flat_map(|r| r.blocks.keys().map(|&k| BlockHash::from(k)))
    }

    /// The (worker, rank)s holding at least one block, ordered.
    pub fn ranks(&self) -> impl Iterator<Item = (WorkerId, DpRank)> + '_ {
        self.rank_of.keys().copied()
    }

    fn push_score(&self, scores: &mut Vec<OverlapScore>, slot: u32, blocks: usize) {
        if let Some(rank) = self.rank(slot) {
            scores.push(OverlapScore {
                worker_id: rank.key.0,
                dp_rank: rank.key.1,
                blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
            });
        }
    }

    fn store(
        &mut self,
        key: (WorkerId, DpRank),
        parent: Option<BlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexRefusal> {
        // Refuse a chain that repeats itself before touching anything.
        if blocks.len() <= SHORT_CHAIN {
            let repeats = blocks.iter().enumerate().any(|(i, b)| {
                parent == Some(b.block_hash)
                    || blocks
                        .iter()
                        .skip(i + 1)
                        .any(|o| o.block_hash == b.block_hash)
            });
            if repeats {
                self.stats.refused_invalid_chain += 1;
                return Err(IndexRefusal::InvalidChain);
            }
        } else {
            let repeats = {
                let scratch = &mut self.scratch;
                let repeats = !blocks.iter().all(|b| scratch.insert(b.block_hash))
                    || parent.is_some_and(|p| scratch.contains(&p));
                scratch.clear();
                repeats
            };
            if self.scratch.capacity() > 4096 {
                self.scratch = FastSet::default();
            }
            if repeats {
                self.stats.refused_invalid_chain += 1;
                return Err(IndexRefusal::InvalidChain);
            }
        }
        let slot = self.rank_of.get(&key).copied();
        // The position the next block hangs under (`None`: the root).
        let mut cursor = match parent {
            None => None,
            Some(p) => match slot
                .and_then(|s| self.rank(s))
                .and_then(|r| r.blocks.get(&Key::from(p)))
            {
                Some(&pos) => Some(pos),
                None => {
                    self.stats.refused_unknown_parent += 1;
                    return Err(IndexRefusal::UnknownParent);
                }
            },
        };
        if blocks.is_empty() {
            return Ok(());
        }
        let slot = match slot {
            Some(s) => s,
            None => self.new_rank(key),
        };
        let result = self.store_chain(slot, &mut cursor, blocks);
        self.drop_rank_if_empty(slot, key);
        result
    }

    /// Stores `blocks` in order under `cursor` for rank `slot`.
    fn store_chain(
        &mut self,
        slot: u32,
        cursor: &mut Option<u32>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexRefusal> {
        let mut i = 0;
        while let Some(block) = blocks.get(i) {
            let held = self
                .rank(slot)
                .and_then(|r| r.blocks.get(&Key::from(block.block_hash)))
                .copied();
            let next = self.tree.next(*cursor, block.tokens_hash);
            if let Some(p) = next
                && self.tree.holds(slot, p)
            {
                // Held already: the same block again, or another hash for it (the
                // first one stays). The chain goes on from it either way.
                if held == Some(p) {
                    self.stats.duplicate_blocks += 1;
                } else {
                    self.stats.conflicting_blocks += 1;
                }
                *cursor = Some(p);
                i += 1;
                continue;
            }
            let left = blocks.len() - i;
            let next = match held {
                Some(old) => {
                    if Some(old) == *cursor {
                        // The chain would hang under the block it moves.
                        self.stats.refused_invalid_chain += 1;
                        return Err(IndexRefusal::InvalidChain);
                    }
                    // A move adds no block but may add a position (its old one
                    // stays while blocks below it are held): the byte cap.
                    self.position_room(left)?;
                    // The hash moves: the rank no longer holds it where it was. That
                    // may free positions on the chain's way: look again.
                    self.tree.release(slot, old, 1);
                    self.forget(slot, block.block_hash);
                    self.tree.next(*cursor, block.tokens_hash)
                }
                None => next,
            };
            match next {
                Some(p) => {
                    // Positions other ranks hold: take as many of the chain's next
                    // blocks as follow the run, in one go.
                    let want = self.run_length(slot, p, blocks.get(i..).unwrap_or_default());
                    let fit = if held.is_some() {
                        1
                    } else {
                        self.room(slot, want, left, false)?
                    };
                    let positions: SmallVec<[u32; 64]> = self
                        .tree
                        .run_from(p)
                        .map(|(_, pos)| pos.iter().take(fit).copied().collect())
                        .unwrap_or_default();
                    self.tree.hold_run(slot, p, positions.len());
                    for (b, &pos) in blocks.iter().skip(i).zip(&positions) {
                        self.remember(slot, b.block_hash, pos);
                        *cursor = Some(pos);
                    }
                    i += positions.len().max(1);
                }
                None if held.is_none() => {
                    i += self.store_fresh(slot, cursor, blocks.get(i..).unwrap_or_default())?;
                }
                None => {
                    if let Some(pos) = self.tree.new_position(*cursor, block.tokens_hash, slot) {
                        self.remember(slot, block.block_hash, pos);
                        *cursor = Some(pos);
                    }
                    i += 1;
                }
            }
        }
        Ok(())
    }

    /// How many of `blocks` (at least 1) follow position `p`'s run from `p` on, with
    /// hashes the rank does not hold.
    fn run_length(&self, slot: u32, p: u32, blocks: &[StoredBlock]) -> usize {
        let Some((tokens, _)) = self.tree.run_from(p) else {
            return 1;
        };
        let rank = self.rank(slot);
        let n = tokens
            .iter()
            .zip(blocks)
            .enumerate()
            .take_while(|&(j, (t, b))| {
                *t == b.tokens_hash
                    && (j == 0
                        || rank.is_none_or(|r| !r.blocks.contains_key(&Key::from(b.block_hash))))
            })
            .count();
        n.clamp(1, 64)
    }

    /// Records that rank `slot` holds `hash` at position `pos`.
    fn remember(&mut self, slot: u32, hash: BlockHash, pos: u32) {
        let Some(r) = self.ranks.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        r.blocks.insert(Key::from(hash), pos);
        *self.worker_blocks.entry(r.key.0).or_default() += 1;
        let cap = r.blocks.capacity();
        if cap > r.cap_seen {
            self.rank_table_bytes = self.rank_table_bytes + table_bytes(cap, BLOCK_ENTRY)
                - table_bytes(r.cap_seen, BLOCK_ENTRY);
            r.cap_seen = cap;
        }
        self.blocks += 1;
        self.stats.stored_blocks += 1;
    }

    /// Forgets that rank `slot` holds `hash` (its position already let go of).
    fn forget(&mut self, slot: u32, hash: BlockHash) -> Option<u32> {
        let r = self.ranks.get_mut(slot as usize).and_then(Option::as_mut)?;
        let pos = r.blocks.remove(&Key::from(hash))?;
        let worker = r.key.0;
        self.blocks -= 1;
        self.worker_let_go(worker, 1);
        Some(pos)
    }

    fn remove(&mut self, key: (WorkerId, DpRank), hashes: &[BlockHash]) {
        let Some(slot) = self.rank_of.get(&key).copied() else {
            self.stats.unknown_removed_blocks += hashes.len() as u64;
            return;
        };
        // Consecutive positions of one run (an engine lists a sequence's blocks tail
        // first, or head first) are let go of together: (run, first offset, count).
        let mut group: Option<(u32, usize, usize)> = None;
        for hash in hashes {
            let Some(pos) = self.forget(slot, *hash) else {
                self.stats.unknown_removed_blocks += 1;
                continue;
            };
            self.stats.removed_blocks += 1;
            let Some((node, off)) = self.tree.locate(pos) else {
                continue;
            };
            group = match group {
                Some((n, lo, m)) if n == node && off + 1 == lo => Some((n, off, m + 1)),
                Some((n, lo, m)) if n == node && off == lo + m => Some((n, lo, m + 1)),
                Some(g) => {
                    self.release_group(slot, g);
                    self.tree.locate(pos).map(|(n, off)| (n, off, 1))
                }
                None => Some((node, off, 1)),
            };
        }
        if let Some(g) = group {
            self.release_group(slot, g);
        }
        // Give back a table that emptied out.
        self.shrink_table(slot);
        self.drop_rank_if_empty(slot, key);
        self.compact_if_sparse();
    }

    /// Lets go of `m` consecutive positions of a run, from offset `lo`.
    fn release_group(&mut self, slot: u32, (node, lo, m): (u32, usize, usize)) {
        if let Some(&p) = self.tree.node(node).and_then(|n| n.pos.get(lo)) {
            self.tree.release(slot, p, m);
        }
    }

    /// `n` fewer blocks held by `worker`.
    fn worker_let_go(&mut self, worker: WorkerId, n: usize) {
        if let Some(held) = self.worker_blocks.get_mut(&worker) {
            *held = held.saturating_sub(n);
            if *held == 0 {
                self.worker_blocks.remove(&worker);
            }
        }
    }

    fn rank(&self, slot: u32) -> Option<&Rank> {
        self.ranks.get(slot as usize).and_then(Option::as_ref)
    }

    fn new_rank(&mut self, key: (WorkerId, DpRank)) -> u32 {
        let (blocks, cap_seen) = self.new_table(key);
        let rank = Rank {
            key,
            blocks,
            cap_seen,
        };
        let slot = match self.free_ranks.pop() {
            Some(s) => {
                if let Some(cell) = self.ranks.get_mut(s as usize) {
                    *cell = Some(rank);
                }
                s
            }
            None => {
                self.ranks.push(Some(rank));
                (self.ranks.len() - 1) as u32
            }
        };
        self.rank_of.insert(key, slot);
        slot
    }

    /// A rank left holding nothing has no entry.
    fn drop_rank_if_empty(&mut self, slot: u32, key: (WorkerId, DpRank)) {
        if self.rank(slot).is_some_and(|r| r.blocks.is_empty()) {
            self.rank_of.remove(&key);
            self.drop_rank(slot);
        }
    }

    /// Lets go of every run a rank slot (already out of `rank_of`) holds, and frees
    /// the slot. O(blocks it holds): each run is let go of whole, once (its other
    /// positions then find the slot gone from their run's holders).
    fn drop_rank(&mut self, slot: u32) {
        let Some(rank) = self.ranks.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        self.rank_table_bytes -= table_bytes(rank.cap_seen, BLOCK_ENTRY);
        self.blocks -= rank.blocks.len();
        self.worker_let_go(rank.key.0, rank.blocks.len());
        self.stats.removed_blocks += rank.blocks.len() as u64;
        for (_, pos) in rank.blocks {
            self.tree.release_run_of(slot, pos);
        }
        self.free_ranks.push(slot);
    }
}

#[cfg(test)]
mod tests;
