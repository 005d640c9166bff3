//! What a worker keeps so routers can recover what they lost of it (sans-IO): its last
//! router events, and the blocks it holds now.
//!
//! A router that misses some of a worker's events (an id gap) asks for *the events
//! since id S*; one that starts, or whose gap the ring no longer covers, asks for *a
//! dump*: every block the worker holds, as `Stored` events, with the id the dump is
//! current at. [`WorkerLog`] answers both; it is the worker's
//! [`LocalIndex`](super::LocalIndex), so it is kept in step before events are
//! published (a router never hears of an event the log does not hold).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::{
    BlockHash, DpRank, IndexError, KvEvent, KvEventData, LocalIndex, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId,
};
use crate::config::{self, ConfigError};
use crate::hash::FastMap;

/// Router events a worker keeps for recovery by default: its last 1,024 (as Dynamo's
/// worker does).
///
/// ```
/// assert_eq!(eventplane::kv::pipeline::DEFAULT_RECOVERY_EVENTS, 1024);
/// ```
pub const DEFAULT_RECOVERY_EVENTS: usize = 1024;

/// Blocks the kept events may carry in all, by default: 2^18 (beyond, the oldest
/// events go first, whatever their number).
///
/// ```
/// assert_eq!(eventplane::kv::pipeline::DEFAULT_RECOVERY_EVENT_BLOCKS, 1 << 18);
/// ```
pub const DEFAULT_RECOVERY_EVENT_BLOCKS: usize = 1 << 18;

/// Blocks a worker's log holds for dumps by default: 2^22 (about 200 MiB at most).
/// Blocks stored beyond it are published but not dumped, counted in
/// [`WorkerLogStats::untracked_blocks`]; a dump from such a log says it is partial.
pub(crate) const DEFAULT_MAX_LOG_BLOCKS: usize = 1 << 22;

/// Most blocks in one `Stored` event of a dump (as the sink splits messages).
const DUMP_EVENT_BLOCKS: usize = 8192;

/// Bounds of a [`WorkerLog`].
///
/// ```
/// use eventplane::kv::pipeline::WorkerLogConfig;
/// let config = WorkerLogConfig::default().events(4096);
/// assert!(config.validate().is_ok());
/// assert_eq!(WorkerLogConfig::default().events(0).validate().unwrap_err().field(), "events");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct WorkerLogConfig {
    events: usize,
    event_blocks: usize,
    max_blocks: usize,
}

impl Default for WorkerLogConfig {
    fn default() -> Self {
        WorkerLogConfig {
            events: DEFAULT_RECOVERY_EVENTS,
            event_blocks: DEFAULT_RECOVERY_EVENT_BLOCKS,
            max_blocks: DEFAULT_MAX_LOG_BLOCKS,
        }
    }
}

impl WorkerLogConfig {
    /// Router events kept (default [`DEFAULT_RECOVERY_EVENTS`]).
    pub fn events(mut self, events: usize) -> Self {
        self.events = events;
        self
    }

    /// Blocks the kept events may carry in all (default
    /// [`DEFAULT_RECOVERY_EVENT_BLOCKS`]).
    pub fn event_blocks(mut self, blocks: usize) -> Self {
        self.event_blocks = blocks;
        self
    }

    /// Blocks held for dumps (default 2^22).
    pub fn max_blocks(mut self, blocks: usize) -> Self {
        self.max_blocks = blocks;
        self
    }

    /// The first zero value, named as its setter.
    pub fn validate(&self) -> Result<(), ConfigError> {
        config::nonzero("events", self.events)?;
        config::nonzero("event_blocks", self.event_blocks)?;
        config::nonzero("max_blocks", self.max_blocks)?;
        Ok(())
    }
}

/// Counters of a [`WorkerLog`].
///
/// ```
/// let stats = eventplane::kv::pipeline::WorkerLog::default().stats();
/// assert_eq!((stats.events, stats.blocks, stats.last_id), (0, 0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct WorkerLogStats {
    /// Router events kept now.
    pub events: usize,
    /// The oldest kept event's id (0 with none).
    pub oldest_id: u64,
    /// The newest event's id (0 before any).
    pub last_id: u64,
    /// Blocks held now.
    pub blocks: usize,
    /// Blocks stored past [`WorkerLogConfig::max_blocks`]: published, not dumped.
    pub untracked_blocks: u64,
    /// Events that arrived with an id other than the next one (the log then keeps only
    /// what follows).
    pub id_breaks: u64,
}

/// What a worker can tell a router about its events since an id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Since {
    /// The events after the asked id, up to the newest (empty when none followed).
    Events(Vec<RouterEvent>),
    /// The asked id is older than what is kept (ask for a dump); the oldest id kept.
    TooOld {
        /// The oldest event id kept (0 with none).
        oldest: u64,
    },
}

/// Every block a worker holds, as `Stored` events, and the id it is current at: a
/// router that applies it and then the events after `current_id` holds what the
/// worker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Dump {
    /// `Stored` events, parents before children; their ids are `current_id`.
    pub events: Vec<RouterEvent>,
    /// The id of the last event the dump includes.
    pub current_id: u64,
    /// `false` when the log stopped tracking blocks past its bound: the dump holds
    /// fewer blocks than the worker.
    pub complete: bool,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    parent: Option<BlockHash>,
    tokens_hash: TokensHash,
    /// When it was stored: a parent is stored before its children.
    order: u64,
    /// Blocks stored under it that are still kept (held or ghosts).
    children: u32,
    /// Removed, but kept because blocks under it are held: a router that rebuilds from
    /// a dump needs it to place them, then removes it.
    ghost: bool,
}

/// The recovery log of one worker: its last router events and the blocks it holds.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId, pipeline::{LocalIndex, Since, WorkerLog}};
/// let stored = |id, hash: u64, parent: Option<u64>| RouterEvent {
///     worker_id: WorkerId(7),
///     tier: StorageTier::Device,
///     event: KvEvent { id, dp_rank: 0, data: KvEventData::Stored {
///         parent_hash: parent.map(BlockHash),
///         blocks: vec![StoredBlock { block_hash: BlockHash(hash), tokens_hash: TokensHash(hash) }],
///     }},
/// };
/// let mut log = WorkerLog::default();
/// log.apply(&stored(1, 10, None))?;
/// log.apply(&stored(2, 11, Some(10)))?;
/// // A router that saw id 1 asks for what followed:
/// let Since::Events(events) = log.since(1) else { unreachable!() };
/// assert_eq!(events.len(), 1);
/// // A router that starts asks for a dump: both blocks, current at id 2.
/// let dump = log.dump();
/// assert_eq!((dump.current_id, dump.events.len()), (2, 1)); // one chain, one event
/// # Ok::<(), eventplane::kv::pipeline::IndexError>(())
/// ```
#[derive(Debug)]
pub struct WorkerLog {
    config: WorkerLogConfig,
    ring: VecDeque<RouterEvent>,
    ring_blocks: usize,
    blocks: FastMap<(DpRank, StorageTier, BlockHash), Held>,
    worker_id: Option<WorkerId>,
    next_order: u64,
    /// Blocks kept as ghosts (removed, with blocks under them held).
    ghosts: usize,
    stats: WorkerLogStats,
}

impl Default for WorkerLog {
    fn default() -> Self {
        WorkerLog::new(WorkerLogConfig::default())
    }
}

impl WorkerLog {
    /// An empty log with these bounds (zero bounds are raised to 1; call
    /// [`WorkerLogConfig::validate`] to refuse them).
    pub fn new(config: WorkerLogConfig) -> WorkerLog {
        WorkerLog {
            config: WorkerLogConfig {
                events: config.events.max(1),
                event_blocks: config.event_blocks.max(1),
                max_blocks: config.max_blocks.max(1),
            },
            ring: VecDeque::new(),
            ring_blocks: 0,
            blocks: FastMap::default(),
            worker_id: None,
            next_order: 0,
            ghosts: 0,
            stats: WorkerLogStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> WorkerLogStats {
        WorkerLogStats {
            events: self.ring.len(),
            oldest_id: self.ring.front().map_or(0, |e| e.event.id),
            blocks: self.blocks.len() - self.ghosts,
            ..self.stats
        }
    }

    /// The events after id `after`, or [`Since::TooOld`] when some of them are no
    /// longer kept.
    pub fn since(&self, after: u64) -> Since {
        let last = self.stats.last_id;
        if after == last {
            return Since::Events(Vec::new());
        }
        let oldest = self.ring.front().map_or(0, |e| e.event.id);
        if after > last {
            // Further than this log ever went: another process's ids (a restart): only
            // a dump says what it holds.
            return Since::TooOld { oldest };
        }
        if self.ring.is_empty() || after.saturating_add(1) < oldest {
            return Since::TooOld { oldest };
        }
        Since::Events(
            self.ring
                .iter()
                .filter(|e| e.event.id > after)
                .cloned()
                .collect(),
        )
    }

    /// Every block held now, as `Stored` events (consecutive blocks of one chain in
    /// one event, up to 8,192), parents first. A removed block with blocks under it
    /// still held is stored too (so a router places them where the worker's events
    /// placed them), then removed by a `Removed` event at the end.
    pub fn dump(&self) -> Dump {
        self.snapshot().into_dump()
    }

    /// What a dump is made of, copied (no sorting or packing: the caller does that
    /// outside whatever lock guards the log).
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            blocks: self.blocks.iter().map(|(k, h)| (*k, *h)).collect(),
            current_id: self.stats.last_id,
            worker_id: self.worker_id.unwrap_or(WorkerId(0)),
            complete: self.stats.untracked_blocks == 0,
        }
    }
}

/// A copy of a log's blocks, to build a dump from.
#[derive(Debug)]
pub(crate) struct Snapshot {
    blocks: Vec<((DpRank, StorageTier, BlockHash), Held)>,
    current_id: u64,
    worker_id: WorkerId,
    complete: bool,
}

impl Snapshot {
    /// The dump (see [`WorkerLog::dump`]).
    pub(crate) fn into_dump(self) -> Dump {
        let current_id = self.current_id;
        // Sorted by when each was stored, as (order, index) pairs: a quarter of the
        // bytes to move that sorting the entries themselves would.
        let mut by_order: Vec<(u64, usize)> = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, (_, h))| (h.order, i))
            .collect();
        by_order.sort_unstable();
        let held = by_order
            .iter()
            .filter_map(|&(_, i)| self.blocks.get(i))
            .map(|(k, h)| (k, h));
        let worker_id = self.worker_id;
        let mut events: Vec<RouterEvent> = Vec::new();
        for (&(dp_rank, tier, block_hash), h) in held {
            let block = StoredBlock {
                block_hash,
                tokens_hash: h.tokens_hash,
            };
            if let Some(last) = events.last_mut() {
                if last.tier == tier && last.event.dp_rank == dp_rank {
                    if let KvEventData::Stored { blocks, .. } = &mut last.event.data {
                        let continues = blocks.last().map(|b| b.block_hash) == h.parent;
                        if continues && h.parent.is_some() && blocks.len() < DUMP_EVENT_BLOCKS {
                            blocks.push(block);
                            continue;
                        }
                    }
                }
            }
            events.push(RouterEvent {
                worker_id,
                tier,
                event: KvEvent {
                    id: current_id,
                    dp_rank,
                    data: KvEventData::Stored {
                        parent_hash: h.parent,
                        blocks: vec![block],
                    },
                },
            });
        }
        // Ghosts placed the blocks under them; now they go, as they went.
        let mut ghosts: Vec<(&(DpRank, StorageTier, BlockHash), &Held)> = self
            .blocks
            .iter()
            .filter(|(_, h)| h.ghost)
            .map(|(k, h)| (k, h))
            .collect();
        ghosts.sort_unstable_by_key(|(k, h)| (k.0, k.1 as u8, h.order));
        for (&(dp_rank, tier, block_hash), _) in ghosts {
            if let Some(last) = events.last_mut() {
                if last.tier == tier && last.event.dp_rank == dp_rank {
                    if let KvEventData::Removed { block_hashes } = &mut last.event.data {
                        if block_hashes.len() < DUMP_EVENT_BLOCKS {
                            block_hashes.push(block_hash);
                            continue;
                        }
                    }
                }
            }
            events.push(RouterEvent {
                worker_id,
                tier,
                event: KvEvent {
                    id: current_id,
                    dp_rank,
                    data: KvEventData::Removed {
                        block_hashes: vec![block_hash],
                    },
                },
            });
        }
        Dump {
            events,
            current_id,
            complete: self.complete,
        }
    }
}

impl WorkerLog {
    fn keep(&mut self, ev: &RouterEvent) {
        if self.stats.last_id != 0 && ev.event.id != self.stats.last_id.saturating_add(1) {
            // What was kept no longer leads up to this event.
            self.stats.id_breaks += 1;
            self.ring.clear();
            self.ring_blocks = 0;
        }
        self.stats.last_id = ev.event.id;
        self.ring_blocks += ev.event.data.block_count();
        self.ring.push_back(ev.clone());
        while self.ring.len() > self.config.events
            || (self.ring_blocks > self.config.event_blocks && self.ring.len() > 1)
        {
            if let Some(old) = self.ring.pop_front() {
                self.ring_blocks -= old.event.data.block_count();
            }
        }
    }

    fn hold(&mut self, ev: &RouterEvent) {
        let (rank, tier) = (ev.event.dp_rank, ev.tier);
        match &ev.event.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let mut parent = *parent_hash;
                for b in blocks {
                    self.store(rank, tier, parent, b);
                    parent = Some(b.block_hash);
                }
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    self.remove(rank, tier, *h);
                }
            }
            KvEventData::Cleared => {
                self.blocks.retain(|&(r, _, _), _| r != rank);
                self.ghosts = self.blocks.values().filter(|h| h.ghost).count();
            }
        }
    }

    fn store(
        &mut self,
        rank: DpRank,
        tier: StorageTier,
        parent: Option<BlockHash>,
        b: &StoredBlock,
    ) {
        let key = (rank, tier, b.block_hash);
        if let Some(held) = self.blocks.get_mut(&key) {
            if std::mem::take(&mut held.ghost) {
                // Stored again where it was: held once more.
                self.ghosts -= 1;
            }
            return;
        }
        if self.blocks.len() >= self.config.max_blocks {
            self.stats.untracked_blocks += 1;
            return;
        }
        if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&(rank, tier, p))) {
            p.children += 1;
        }
        self.next_order += 1;
        self.blocks.insert(
            key,
            Held {
                parent,
                tokens_hash: b.tokens_hash,
                order: self.next_order,
                children: 0,
                ghost: false,
            },
        );
    }

    /// Removes a block: kept as a ghost while blocks under it are kept; a ghost whose
    /// last child goes goes too.
    fn remove(&mut self, rank: DpRank, tier: StorageTier, hash: BlockHash) {
        let mut key = (rank, tier, hash);
        let Some(held) = self.blocks.get_mut(&key) else {
            return;
        };
        if held.ghost {
            return;
        }
        if held.children > 0 {
            held.ghost = true;
            self.ghosts += 1;
            return;
        }
        loop {
            let Some(gone) = self.blocks.remove(&key) else {
                return;
            };
            if gone.ghost {
                self.ghosts -= 1;
            }
            let Some(parent) = gone.parent else {
                return;
            };
            key = (rank, tier, parent);
            let Some(p) = self.blocks.get_mut(&key) else {
                return;
            };
            p.children = p.children.saturating_sub(1);
            if !(p.ghost && p.children == 0) {
                return;
            }
        }
    }
}

impl LocalIndex for WorkerLog {
    fn apply(&mut self, event: &RouterEvent) -> Result<(), IndexError> {
        self.worker_id = Some(event.worker_id);
        self.keep(event);
        self.hold(event);
        Ok(())
    }
}

/// A [`WorkerLog`] shared between the processor that keeps it and whatever serves it
/// (a recovery endpoint): clone it, give one clone to
/// [`Processor::with_local_index`](super::Processor::with_local_index), read the other.
///
/// ```
/// use eventplane::kv::{pipeline::{SharedWorkerLog, WorkerLogConfig}};
/// let log = SharedWorkerLog::new(WorkerLogConfig::default());
/// let for_processor = log.clone();
/// assert_eq!(log.stats().events, 0);
/// # drop(for_processor);
/// ```
#[derive(Debug, Clone)]
pub struct SharedWorkerLog(Arc<Mutex<WorkerLog>>);

impl SharedWorkerLog {
    /// An empty shared log.
    pub fn new(config: WorkerLogConfig) -> SharedWorkerLog {
        SharedWorkerLog(Arc::new(Mutex::new(WorkerLog::new(config))))
    }

    /// Runs `f` on the log (the processor waits meanwhile: keep it short).
    pub fn with<R>(&self, f: impl FnOnce(&WorkerLog) -> R) -> R {
        f(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// [`WorkerLog::stats`].
    pub fn stats(&self) -> WorkerLogStats {
        self.with(WorkerLog::stats)
    }

    /// [`WorkerLog::dump`], with the log locked only while its blocks are copied
    /// (sorting and packing them happen after).
    pub fn dump(&self) -> Dump {
        self.with(WorkerLog::snapshot).into_dump()
    }
}

impl LocalIndex for SharedWorkerLog {
    fn apply(&mut self, event: &RouterEvent) -> Result<(), IndexError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .apply(event)
    }
}

mod blocks;
mod driver;
mod endpoint;

pub use driver::RecoveryDriver;
pub use endpoint::{
    Recovered, RecoveryAcceptor, RecoveryClientConfig, RecoveryError, RecoveryRequest,
    RecoveryServer, RecoveryServerStats, recover, recover_over,
};

#[cfg(test)]
#[path = "recovery_tests.rs"]
mod tests;
