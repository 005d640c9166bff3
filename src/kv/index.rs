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

mod types;
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
/// use eventplane::kv::{local_block_hashes, tokens_hash};
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

/// The root node's slot.
const ROOT: u32 = 0;

/// One position in the tree: a block's tokens under its parent's position.
#[derive(Debug)]
struct Node {
    parent: u32,
    tokens: TokensHash,
    /// Child edges (in `RouterIndex::edges`).
    children: u32,
    /// The rank slots holding this block, sorted.
    holders: SmallVec<[u32; 2]>,
}

/// One (worker, rank)'s blocks: its block hashes and the nodes they are at.
#[derive(Debug)]
struct Rank {
    key: (WorkerId, DpRank),
    blocks: FastMap<BlockHash, u32>,
    /// The largest capacity `blocks` has had since it was made or last shrunk: what
    /// its allocation is counted at (`capacity()` dips while removals leave
    /// tombstones, the allocation does not).
    cap_seen: usize,
}

/// Bytes a hash table of `capacity` entries of `entry` bytes takes (its control
/// bytes and a load factor of 7/8 included).
fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = (capacity.saturating_mul(8) / 7).next_power_of_two();
    buckets.saturating_mul(entry + 1)
}

const EDGE_ENTRY: usize = size_of::<((u32, TokensHash), u32)>();
const BLOCK_ENTRY: usize = size_of::<(BlockHash, u32)>();

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
/// blocks per (worker, rank) (default 2^20), blocks in the whole index (default
/// 2^24) and bytes in the whole index (default 2 GiB, counted from the tables'
/// capacities, so the figure includes their spare room). A `Stored` event past a
/// cap keeps its leading blocks that fit and refuses the rest, counted by cause. No
/// entry exists without a block behind it: a rank that holds no block has no entry,
/// and a node no rank holds is freed as soon as nothing below it is held either.
/// Memory: about 104 bytes per held block on a Mooncake-shaped trace of 256 workers
/// (`benches/router_index.rs`; Dynamo 1.6.1's compressed tree takes about 62 on the
/// same trace, `benches/vs-dynamo-index`); [`RouterIndex::bytes`] gives the live
/// figure, spare table capacity included.
///
/// # Cost of each operation
/// | operation | cost |
/// |---|---|
/// | `Stored` of n blocks | O(n) |
/// | `Removed` of n hashes (known or not) | O(n), plus the positions it frees |
/// | `Cleared`, [`clear_rank`](RouterIndex::clear_rank) | O(blocks the rank holds) |
/// | [`remove_worker`](RouterIndex::remove_worker) | O(blocks the worker holds, every rank) |
/// | [`find_matches`](RouterIndex::find_matches) of n hashes | O(n × workers matching) |
///
/// A hostile event costs what its own size says: empty lists create nothing,
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
/// use eventplane::kv::{
///     local_block_hashes, BlockHash, KvEvent, KvEventData, RouterEvent, RouterIndex, StorageTier,
///     StoredBlock, WorkerId,
/// };
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
/// # Ok::<(), eventplane::kv::IndexRefusal>(())
/// ```
#[derive(Debug)]
pub struct RouterIndex {
    config: RouterIndexConfig,
    /// Node arena; `ROOT` is the root. Freed slots are reused from `free_nodes`.
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// (parent node, tokens hash) → child node.
    edges: FastMap<(u32, TokensHash), u32>,
    /// Rank slots (a node's holders name them); `None` is free for reuse.
    ranks: Vec<Option<Rank>>,
    free_ranks: Vec<u32>,
    /// (worker, rank) → rank slot, ordered (a worker's ranks are one range).
    rank_of: BTreeMap<(WorkerId, DpRank), u32>,
    /// Blocks held, over every rank.
    blocks: usize,
    /// Bytes of the rank tables (each counted at its `cap_seen`) and of holder lists
    /// past their inline room.
    rank_table_bytes: usize,
    /// The largest capacity `edges` has had since it was made or last shrunk.
    edges_cap_seen: usize,
    holder_heap_bytes: usize,
    /// A stored chain's hashes, to refuse one that repeats itself (kept between
    /// events; emptied after each).
    scratch: FastSet<BlockHash>,
    stats: RouterIndexStats,
}

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
            nodes: vec![Node {
                parent: ROOT,
                tokens: TokensHash(0),
                children: 0,
                holders: SmallVec::new(),
            }],
            free_nodes: Vec::new(),
            edges: FastMap::default(),
            ranks: Vec::new(),
            free_ranks: Vec::new(),
            rank_of: BTreeMap::new(),
            blocks: 0,
            rank_table_bytes: 0,
            edges_cap_seen: 0,
            holder_heap_bytes: 0,
            scratch: FastSet::default(),
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

    /// Drops every block of one (worker, rank): what a `Cleared` event does, and
    /// what a router does when it lost track of that rank. O(blocks it holds).
    pub fn clear_rank(&mut self, worker_id: WorkerId, dp_rank: DpRank) {
        self.stats.cleared_ranks += 1;
        if let Some(slot) = self.rank_of.remove(&(worker_id, dp_rank)) {
            self.drop_rank(slot);
        }
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
    }

    /// Every (worker, rank) holding the leading blocks of `sequence` (local block
    /// hashes, [`local_block_hashes`]), with how many leading blocks each holds.
    /// O(`sequence.len()` × ranks matching).
    pub fn find_matches(&self, sequence: &[TokensHash]) -> OverlapScores {
        let mut scores = Vec::new();
        let mut candidates: Vec<u32> = Vec::new();
        let mut kept: Vec<u32> = Vec::new();
        // Blocks every remaining candidate holds.
        let mut matched = 0;
        let mut at = ROOT;
        for (depth, tokens) in sequence.iter().enumerate() {
            let Some(node) = self
                .edges
                .get(&(at, *tokens))
                .and_then(|&child| self.nodes.get(child as usize).map(|n| (child, n)))
            else {
                break;
            };
            let (child, node) = node;
            if depth == 0 {
                candidates.extend_from_slice(&node.holders);
            } else if node.holders.as_slice() != candidates.as_slice() {
                // Both sorted: a merge keeps the candidates still holding this block,
                // and scores those that dropped out with the blocks they held.
                kept.clear();
                let mut holders = node.holders.iter().peekable();
                for &c in &candidates {
                    while holders.next_if(|&&h| h < c).is_some() {}
                    if holders.next_if(|&&h| h == c).is_some() {
                        kept.push(c);
                    } else {
                        self.push_score(&mut scores, c, depth);
                    }
                }
                std::mem::swap(&mut candidates, &mut kept);
            }
            if candidates.is_empty() {
                break;
            }
            matched = depth + 1;
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
            nodes: (self.nodes.len() - 1 - self.free_nodes.len()) as u64,
            ranks: self.rank_of.len() as u64,
            bytes: self.bytes() as u64,
            ..self.stats
        }
    }

    /// Bytes the index's tables take now, spare capacity included: the figure
    /// [`RouterIndexConfig::max_bytes`] caps.
    pub fn bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.free_nodes.capacity() * size_of::<u32>()
            + table_bytes(self.edges_cap_seen, EDGE_ENTRY)
            + self.ranks.capacity() * size_of::<Option<Rank>>()
            + self.free_ranks.capacity() * size_of::<u32>()
            + self.rank_of.len() * (size_of::<((WorkerId, DpRank), u32)>() + 16)
            + self.rank_table_bytes
            + self.holder_heap_bytes
            + table_bytes(self.scratch.capacity(), size_of::<BlockHash>())
    }

    /// Blocks one (worker, rank) holds.
    pub fn rank_blocks(&self, worker_id: WorkerId, dp_rank: DpRank) -> usize {
        self.rank_of
            .get(&(worker_id, dp_rank))
            .and_then(|&s| self.ranks.get(s as usize))
            .and_then(Option::as_ref)
            .map_or(0, |r| r.blocks.len())
    }

    /// Whether one (worker, rank) holds the block `hash`.
    pub fn holds(&self, worker_id: WorkerId, dp_rank: DpRank, hash: BlockHash) -> bool {
        self.rank_of
            .get(&(worker_id, dp_rank))
            .and_then(|&s| self.rank(s))
            .is_some_and(|r| r.blocks.contains_key(&hash))
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
            .flat_map(|r| r.blocks.keys().copied())
    }

    /// The (worker, rank)s holding at least one block, ordered.
    pub fn ranks(&self) -> impl Iterator<Item = (WorkerId, DpRank)> + '_ {
        self.rank_of.keys().copied()
    }

    fn push_score(&self, scores: &mut Vec<OverlapScore>, slot: u32, blocks: usize) {
        if let Some(Some(rank)) = self.ranks.get(slot as usize) {
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
        if blocks.len() > 1 || parent.is_some() {
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
        let mut at = match parent {
            None => ROOT,
            Some(p) => match slot
                .and_then(|s| self.rank(s))
                .and_then(|r| r.blocks.get(&p))
            {
                Some(&node) => node,
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
        for (i, block) in blocks.iter().enumerate() {
            let held = self
                .rank(slot)
                .and_then(|r| r.blocks.get(&block.block_hash))
                .copied();
            let child = self.edges.get(&(at, block.tokens_hash)).copied();
            if let Some(c) = child
                && self
                    .node(c)
                    .is_some_and(|n| n.holders.binary_search(&slot).is_ok())
            {
                // Held already: the same block again, or another hash for it (the
                // first one stays). The chain goes on from it either way.
                if held == Some(c) {
                    self.stats.duplicate_blocks += 1;
                } else {
                    self.stats.conflicting_blocks += 1;
                }
                at = c;
                continue;
            }
            if held.is_none()
                && let Err(refusal) = self.room_for_block(slot, child.is_none(), blocks.len() - i)
            {
                self.drop_rank_if_empty(slot, key);
                return Err(refusal);
            }
            if let Some(node) = held {
                if node == at {
                    // The chain would hang under the block it moves.
                    self.stats.refused_invalid_chain += 1;
                    self.drop_rank_if_empty(slot, key);
                    return Err(IndexRefusal::InvalidChain);
                }
                // The hash moves: the rank no longer holds it where it was.
                self.release(slot, node);
                if let Some(r) = self.rank_mut(slot) {
                    r.blocks.remove(&block.block_hash);
                }
                self.blocks -= 1;
            }
            // The release above frees no node the rank holds (so not `at`), but may
            // have freed an empty position below it: look the child up again.
            let child = self.edges.get(&(at, block.tokens_hash)).copied();
            let node = match child {
                Some(c) => c,
                None => self.new_node(at, block.tokens_hash),
            };
            self.hold(slot, node);
            if let Some(r) = self.ranks.get_mut(slot as usize).and_then(Option::as_mut) {
                r.blocks.insert(block.block_hash, node);
                let cap = r.blocks.capacity();
                if cap > r.cap_seen {
                    self.rank_table_bytes = self.rank_table_bytes + table_bytes(cap, BLOCK_ENTRY)
                        - table_bytes(r.cap_seen, BLOCK_ENTRY);
                    r.cap_seen = cap;
                }
            }
            self.blocks += 1;
            self.stats.stored_blocks += 1;
            at = node;
        }
        self.drop_rank_if_empty(slot, key);
        Ok(())
    }

    /// Whether one more block fits; counts and says why not (`left` blocks refused).
    fn room_for_block(
        &mut self,
        slot: u32,
        new_node: bool,
        left: usize,
    ) -> Result<(), IndexRefusal> {
        let rank_len = self.rank(slot).map_or(0, |r| r.blocks.len());
        if rank_len >= self.config.max_blocks_per_rank {
            self.stats.refused_rank_full_blocks += left as u64;
            return Err(IndexRefusal::RankFull { refused: left });
        }
        if self.blocks >= self.config.max_blocks
            || self.bytes_after_block(slot, new_node) > self.config.max_bytes
        {
            self.stats.refused_index_full_blocks += left as u64;
            return Err(IndexRefusal::IndexFull { refused: left });
        }
        Ok(())
    }

    /// [`bytes`](Self::bytes) once one more block is held (tables that would grow
    /// counted at their grown size).
    fn bytes_after_block(&self, slot: u32, new_node: bool) -> usize {
        let grown = |len: usize, cap: usize, entry: usize| {
            if len >= cap {
                table_bytes((cap * 2).max(4), entry) - table_bytes(cap, entry)
            } else {
                0
            }
        };
        let mut extra = self.rank(slot).map_or(0, |r| {
            grown(r.blocks.len(), r.blocks.capacity(), BLOCK_ENTRY)
        });
        if new_node {
            extra += grown(self.edges.len(), self.edges.capacity(), EDGE_ENTRY);
            if self.free_nodes.is_empty() && self.nodes.len() == self.nodes.capacity() {
                extra += self.nodes.capacity().max(4) * size_of::<Node>();
            }
        }
        self.bytes() + extra + 2 * size_of::<u32>()
    }

    fn remove(&mut self, key: (WorkerId, DpRank), hashes: &[BlockHash]) {
        let Some(slot) = self.rank_of.get(&key).copied() else {
            self.stats.unknown_removed_blocks += hashes.len() as u64;
            return;
        };
        for hash in hashes {
            let node = self.rank_mut(slot).and_then(|r| r.blocks.remove(hash));
            match node {
                Some(node) => {
                    self.release(slot, node);
                    self.blocks -= 1;
                    self.stats.removed_blocks += 1;
                }
                None => self.stats.unknown_removed_blocks += 1,
            }
        }
        // Give back a table that emptied out.
        if let Some(r) = self.ranks.get_mut(slot as usize).and_then(Option::as_mut) {
            let len = r.blocks.len();
            if r.cap_seen > 64 && len < r.cap_seen / 4 {
                r.blocks.shrink_to(len * 2);
                let after = r.blocks.capacity();
                self.rank_table_bytes = self.rank_table_bytes
                    - table_bytes(r.cap_seen, BLOCK_ENTRY)
                    + table_bytes(after, BLOCK_ENTRY);
                r.cap_seen = after;
            }
        }
        self.drop_rank_if_empty(slot, key);
    }

    fn rank(&self, slot: u32) -> Option<&Rank> {
        self.ranks.get(slot as usize).and_then(Option::as_ref)
    }

    fn rank_mut(&mut self, slot: u32) -> Option<&mut Rank> {
        self.ranks.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn node(&self, node: u32) -> Option<&Node> {
        self.nodes.get(node as usize)
    }

    fn new_rank(&mut self, key: (WorkerId, DpRank)) -> u32 {
        let rank = Rank {
            key,
            blocks: FastMap::default(),
            cap_seen: 0,
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

    /// Releases every block of a rank slot (already out of `rank_of`) and frees it.
    fn drop_rank(&mut self, slot: u32) {
        let Some(rank) = self.ranks.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        self.rank_table_bytes -= table_bytes(rank.cap_seen, BLOCK_ENTRY);
        self.blocks -= rank.blocks.len();
        self.stats.removed_blocks += rank.blocks.len() as u64;
        for (_, node) in rank.blocks {
            self.release(slot, node);
        }
        self.free_ranks.push(slot);
    }

    fn new_node(&mut self, parent: u32, tokens: TokensHash) -> u32 {
        let node = Node {
            parent,
            tokens,
            children: 0,
            holders: SmallVec::new(),
        };
        let id = match self.free_nodes.pop() {
            Some(id) => {
                if let Some(cell) = self.nodes.get_mut(id as usize) {
                    *cell = node;
                }
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.edges.insert((parent, tokens), id);
        self.edges_cap_seen = self.edges_cap_seen.max(self.edges.capacity());
        if let Some(p) = self.nodes.get_mut(parent as usize) {
            p.children += 1;
        }
        id
    }

    /// Adds a rank to a node's holders.
    fn hold(&mut self, slot: u32, node: u32) {
        let Some(n) = self.nodes.get_mut(node as usize) else {
            return;
        };
        if let Err(at) = n.holders.binary_search(&slot) {
            let before = holder_heap(&n.holders);
            n.holders.insert(at, slot);
            self.holder_heap_bytes = self.holder_heap_bytes - before + holder_heap(&n.holders);
        }
    }

    /// Takes a rank off a node's holders, and frees the node, then its ancestors,
    /// while one is held by no rank and has no child.
    fn release(&mut self, slot: u32, node: u32) {
        if let Some(n) = self.nodes.get_mut(node as usize)
            && let Ok(at) = n.holders.binary_search(&slot)
        {
            let before = holder_heap(&n.holders);
            n.holders.remove(at);
            if n.holders.spilled() && n.holders.len() <= n.holders.inline_size() {
                n.holders.shrink_to_fit();
            }
            self.holder_heap_bytes = self.holder_heap_bytes - before + holder_heap(&n.holders);
        }
        let mut at = node;
        while at != ROOT {
            let Some(n) = self.nodes.get(at as usize) else {
                return;
            };
            if !n.holders.is_empty() || n.children > 0 {
                return;
            }
            let (parent, tokens) = (n.parent, n.tokens);
            self.edges.remove(&(parent, tokens));
            self.free_nodes.push(at);
            if let Some(p) = self.nodes.get_mut(parent as usize) {
                p.children -= 1;
            }
            at = parent;
        }
        let len = self.edges.len();
        if self.edges_cap_seen > 1024 && len < self.edges_cap_seen / 4 {
            self.edges.shrink_to(len * 2);
            self.edges_cap_seen = self.edges.capacity();
        }
    }
}

/// Heap bytes of a holder list past its inline room.
fn holder_heap(holders: &SmallVec<[u32; 2]>) -> usize {
    if holders.spilled() {
        holders.capacity() * size_of::<u32>()
    } else {
        0
    }
}

#[cfg(test)]
mod tests;
