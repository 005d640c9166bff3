//! KV events: the model, and the sans-IO stages that turn engine events into router
//! events — [`Coalescer`], [`DedupFilter`] and dense id stamping, composed by
//! [`Pipeline`] — with the async parts around them ([`EngineListener`], [`Processor`],
//! [`EventPlaneSink`]) and [`Worker`], which wires those into one worker process.
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
mod error;
mod event;
mod listener;
mod pipeline;
mod processor;
mod sink;
mod worker;

pub use coalesce::{Coalescer, DEFAULT_MAX_BATCH_BLOCKS};
pub use dedup::{DEFAULT_MAX_TRACKED_HASHES, DEFAULT_MAX_TRACKED_RANKS, DedupFilter, DedupMode};
pub use dynamo::{decode_dynamo_router_events, dynamo_storage_tier, encode_dynamo_router_events};
pub use engine::{
    DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_BATCH_EVENTS, EngineDecoder, EngineEvent, EngineStats,
    encode_engine_batch,
};
pub use error::{EncodeError, EngineDecodeError, IndexError, KvDecodeError, SinkError};
pub use event::{
    BlockHash, DpRank, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TOKENS_HASH_SEED, TokensHash, WorkerId, tokens_hash,
};
pub use listener::{
    EngineListener, EngineListenerConfig, EngineListenerHandle, EngineListenerStats,
};
pub use pipeline::Pipeline;
pub use processor::{
    EventSink, LocalIndex, MAX_BATCH_TIMEOUT, Processor, ProcessorConfig, ProcessorHandle,
    ProcessorStats,
};
pub use sink::{
    EventPlaneSink, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE, decode_router_events,
    decode_router_payload, encode_router_events, encode_router_payload, split_messages,
};
pub use worker::{DEFAULT_WORKER_QUEUE, Worker, WorkerBuilder, WorkerStats};

#[cfg(test)]
mod tests;
