//! KV events: the model, and the sans-IO stages that turn engine events into router
//! events — [`Coalescer`], [`DedupFilter`] and dense id stamping, composed by
//! [`Pipeline`].
//!
//! ```
//! use eventplane::kv::{BlockHash, KvEvent, KvEventData, Pipeline, Placement, PlacementEvent, StorageTier, WorkerId};
//! let at = Placement { worker_id: WorkerId(7), dp_rank: 0, tier: StorageTier::Device };
//! let mut pipeline = Pipeline::default();
//! let mut out = Vec::new();
//! for (raw_id, hash) in [(40, 1), (41, 2)] {
//!     let event = KvEvent { id: raw_id, dp_rank: 0, data: KvEventData::Removed { block_hashes: vec![BlockHash(hash)] } };
//!     pipeline.push(PlacementEvent { placement: at, event }, &mut out);
//! }
//! pipeline.flush(&mut out);
//! assert_eq!(out.len(), 1);
//! assert_eq!(out[0].event.id, 1); // dense outbound ids from 1
//! ```

mod coalesce;
mod dedup;
mod dynamo;
mod engine;
mod event;
mod listener;
mod processor;
mod sink;

pub use coalesce::{Coalescer, DEFAULT_MAX_BATCH_BLOCKS};
pub use dedup::{DEFAULT_MAX_TRACKED_HASHES, DEFAULT_MAX_TRACKED_RANKS, DedupFilter, DedupMode};
pub use dynamo::{decode_dynamo_router_events, dynamo_storage_tier, encode_dynamo_router_events};
pub use engine::{
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_BATCH_EVENTS, EncodeError, EngineDecodeError,
    EngineDecoder, EngineEvent, EngineStats, encode_engine_batch,
};
pub use event::{
    BlockHash, DpRank, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TOKENS_HASH_SEED, TokensHash, WorkerId, tokens_hash,
};
pub use listener::{
    EngineListener, EngineListenerConfig, EngineListenerHandle, EngineListenerStats,
};
pub use processor::{
    EventSink, IndexError, LocalIndex, MAX_BATCH_TIMEOUT, Processor, ProcessorConfig,
    ProcessorConfigError, ProcessorHandle, ProcessorStats, SinkError,
};
pub use sink::{
    EventPlaneSink, KvDecodeError, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE,
    decode_router_events, decode_router_payload, encode_router_events, encode_router_payload,
    split_messages,
};

/// Coalescer → dedup → dense id stamping, sans-IO. Ids start at 1 and are stamped at
/// emission, so an event that dedup drops consumes none.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData, Pipeline, Placement, PlacementEvent, StorageTier, WorkerId};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// let removed = |id, h| PlacementEvent {
///     placement: at,
///     event: KvEvent { id, dp_rank: 0, data: KvEventData::Removed { block_hashes: vec![BlockHash(h)] } },
/// };
/// let mut pipeline = Pipeline::default();
/// let mut out = Vec::new();
/// pipeline.push(removed(100, 1), &mut out);
/// pipeline.push(removed(101, 2), &mut out); // merges with the first
/// pipeline.flush(&mut out);
/// assert_eq!(out.len(), 1);
/// assert_eq!(out[0].event.id, 1); // dense outbound ids
/// assert_eq!(pipeline.merged(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct Pipeline {
    coalescer: Coalescer,
    dedup: DedupFilter,
    next_id: u64,
}

impl Default for Pipeline {
    fn default() -> Self {
        Pipeline::new(DEFAULT_MAX_BATCH_BLOCKS, DedupMode::RefCounted)
    }
}

impl Pipeline {
    /// A pipeline with these settings.
    pub fn new(max_batch_blocks: usize, mode: DedupMode) -> Pipeline {
        Pipeline::with_dedup(max_batch_blocks, DedupFilter::new(mode))
    }

    /// A pipeline with its own dedup filter (for example with other caps).
    ///
    /// ```
    /// use eventplane::kv::{DedupFilter, DedupMode, Pipeline};
    /// let pipeline = Pipeline::with_dedup(128, DedupFilter::new(DedupMode::RefCounted).with_limits(1 << 16, 8));
    /// assert_eq!(pipeline.dedup_resets(), 0);
    /// ```
    pub fn with_dedup(max_batch_blocks: usize, dedup: DedupFilter) -> Pipeline {
        Pipeline {
            coalescer: Coalescer::new(max_batch_blocks),
            dedup,
            next_id: 1,
        }
    }

    /// Feeds one engine event; router events completed by it are appended to `out`.
    pub fn push(&mut self, input: PlacementEvent, out: &mut Vec<RouterEvent>) {
        let Pipeline {
            coalescer,
            dedup,
            next_id,
        } = self;
        coalescer.push(input.placement, input.event.data, &mut |p, d| {
            stamp(dedup, next_id, p, d, out)
        });
    }

    /// Emits whatever is pending.
    pub fn flush(&mut self, out: &mut Vec<RouterEvent>) {
        let Pipeline {
            coalescer,
            dedup,
            next_id,
        } = self;
        coalescer.flush(&mut |p, d| stamp(dedup, next_id, p, d, out));
    }

    /// `true` when an event waits in the coalescer.
    pub fn has_pending(&self) -> bool {
        self.coalescer.has_pending()
    }

    /// Input events merged into another by coalescing so far.
    pub fn merged(&self) -> u64 {
        self.coalescer.merged()
    }

    /// Events dedup removed entirely so far.
    pub fn deduplicated(&self) -> u64 {
        self.dedup.suppressed()
    }

    /// Times a dedup cap made the filter forget what it tracked.
    pub fn dedup_resets(&self) -> u64 {
        self.dedup.resets()
    }

    /// The id the next emitted event will get.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }
}

fn stamp(
    dedup: &mut DedupFilter,
    next_id: &mut u64,
    placement: Placement,
    data: KvEventData,
    out: &mut Vec<RouterEvent>,
) {
    if let Some(data) = dedup.filter(&placement, data) {
        out.push(RouterEvent {
            worker_id: placement.worker_id,
            tier: placement.tier,
            event: KvEvent {
                id: *next_id,
                dp_rank: placement.dp_rank,
                data,
            },
        });
        *next_id += 1;
    }
}

#[cfg(test)]
mod tests;
