//! KV events: the model here, and one module per role.
//!
//! | module | role | entry points |
//! |---|---|---|
//! | [`engine`] | engine ingress: what vLLM, SGLang and TensorRT-LLM publish (the format below) | [`EngineListener`], [`EngineDecoder`] |
//! | [`pipeline`] | the worker's side: sans-IO stages ([`Coalescer`], [`DedupFilter`], dense ids; composed by [`Pipeline`]), the async [`Processor`] and [`EventPlaneSink`] around them, the recovery log | [`Worker`], which wires engine to publisher |
//! | [`router`] | the router's side: every worker's blocks, scored against a request's prefix, kept current through loss and recovery | [`RouterIndex`], [`IndexFeed`] |
//!
//! Router events travel in one [`Dialect`](crate::wire::Dialect): ours or Dynamo's
//! ([`Dialect::encode_router_events`](crate::wire::Dialect::encode_router_events)).
//!
//! ```
//! use eventplane::kv::{BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, StorageTier, WorkerId};
//! use eventplane::kv::pipeline::Pipeline;
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
//!
//! # The engine's format
//! What [`EngineListener`] (and `kv_listen`, `kv-relay`) read: the KV events vLLM and
//! SGLang publish, as [`EngineDecoder`] decodes them.
//!
//! **Messages.** A ZMQ PUB (ZMTP 3.0 or 3.1, NULL security) sends messages of exactly
//! three frames: `[topic, seq, batch]`. `topic` is the configured topic, byte for byte
//! (the listener subscribes to it); `seq` is 8 bytes, a big-endian `u64` the engine
//! counts up by one per batch; `batch` is msgpack. Any other shape is counted in
//! [`EngineListenerStats::malformed_messages`] and skipped. A `seq` that skips
//! forward counts a gap (`seq_gaps`), one that starts again at 0 on a new connection
//! or goes back counts a reset (`seq_resets`): either, or a connection that ends,
//! makes the listener send `Cleared` for what it forwarded (see [`EngineListener`]).
//!
//! **Batch.** `[ts, events, dp_rank]` — vLLM's `KVEventBatch` as an array — or a map
//! with the same names (SGLang; `data_parallel_rank` is accepted for `dp_rank`):
//!
//! | field | msgpack type | use |
//! |---|---|---|
//! | `ts` | float (or anything) | ignored |
//! | `events` | array of events | decoded in order |
//! | `dp_rank` | unsigned int ≤ 2^32 − 1, nil, or absent | the data-parallel rank of every event (default 0; anything else rejects the batch) |
//!
//! Extra array elements and unknown map keys are ignored. A batch that is not msgpack,
//! not one of these shapes, or over the per-batch budgets
//! ([`EngineListenerConfig::batch_limits`]: 2^19 msgpack elements, 2^16 events) is
//! rejected whole and counted (`malformed_batches`, `oversized_batches`), never
//! allocated at the size it declares.
//!
//! **Events.** Each is a tagged array (vLLM ≤ 0.23) or a map with a `"type"` key
//! (vLLM ≥ 0.24, SGLang); fields are read by position from an array, by name from a
//! map:
//!
//! | position | name | type | use |
//! |---|---|---|---|
//! | 0 | `type` | `"BlockStored"` | |
//! | 1 | `block_hashes` | array of hashes | the stored blocks, in chain order |
//! | 2 | `parent_block_hash` | hash or nil | the block before the first one |
//! | 3 | `token_ids` | array of unsigned ints ≤ 2^32 − 1 | `block_size` tokens per stored block |
//! | 4 | `block_size` | int | ignored (the listener's configured block size rules) |
//! | 5 | `lora_id` | any | ignored |
//! | 6 | `medium` | string, nil or absent | the storage tier (below) |
//! | 7… | `lora_name`, … | any | ignored |
//!
//! | position | name | type | use |
//! |---|---|---|---|
//! | 0 | `type` | `"BlockRemoved"` | |
//! | 1 | `block_hashes` | array of hashes | the evicted blocks |
//! | 2 | `medium` | string, nil or absent | the storage tier |
//!
//! `["AllBlocksCleared"]` (or `{"type": "AllBlocksCleared"}`): the rank holds nothing
//! (further fields ignored).
//!
//! - **Hashes** are unsigned ints, negative ints (their two's-complement bits:
//!   vLLM's Python hashes may be negative), or byte or text strings (folded to a `u64`
//!   with xxh3-64, seed 0).
//! - **`medium`** → [`StorageTier`]: absent, nil, `""` or `GPU` → `Device`; `CPU` or
//!   `CPU_PINNED` → `HostPinned`; `DISK` or `NVME` → `Disk`; any other string (or a
//!   non-string) → `External`. Case is ignored.
//! - **Stored blocks** must each have exactly `block_size` tokens (the listener's
//!   setting, the engine's block size): a stored event is cut at its first block
//!   without a full set of tokens (`truncated_events`), and dropped when its hashes
//!   repeat, parent included (`self_referencing`). Each block's tokens are hashed
//!   with [`tokens_hash`] (what Dynamo's router computes).
//! - An event with an unknown `type`, or whose fields have the wrong types, fails
//!   alone (`failed_events`); the rest of its batch is kept. Unknown map keys and
//!   extra array elements are ignored.
//!
//! **An engine to copy.** `examples/engine.py` publishes this format from Python
//! (pyzmq and msgpack), driven line by line from stdin; the test suite uses it as the
//! engine in front of `kv-relay`. Its core (a PUB drops what it sends while nobody
//! subscribes, so `engine.py` binds an XPUB and waits for the first subscription):
//!
//! ```python
//! import struct, time
//! import msgpack, zmq
//! sock = zmq.Context.instance().socket(zmq.XPUB)
//! sock.bind("tcp://127.0.0.1:5557")
//! while sock.recv()[:1] != b"\x01":  # a subscription: 0x01 + topic
//!     pass
//! seq = 0
//! def publish(events, dp_rank=0):
//!     global seq
//!     batch = msgpack.packb([time.time(), events, dp_rank])
//!     sock.send_multipart([b"kv-events", struct.pack(">Q", seq), batch])
//!     seq += 1
//! block_size = 4
//! publish([["BlockStored", [101, 102], None, list(range(2 * block_size)), block_size, None, "GPU", None]])
//! publish([["BlockRemoved", [102], "GPU"]])
//! publish([["AllBlocksCleared"]])
//! ```
//!
//! From Rust, [`encode_engine_batch`] writes the array forms (for simulators and
//! tests).

mod coalesce;
mod decoder;
mod dedup;
mod dynamo;
#[cfg(feature = "dynamo-recovery")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamo-recovery")))]
pub mod dynamo_recovery;
mod error;
mod event;
mod feed;
mod index;
mod listener;
mod processor;
mod recovery;
mod replay;
mod schema;
mod sink;
mod stages;
mod stale;
mod worker;

pub use error::{EncodeError, KvDecodeError};
pub use event::{
    BlockHash, DpRank, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId, tokens_hash,
};

/// Engine ingress: what vLLM, SGLang and TensorRT-LLM publish, decoded
/// ([`EngineDecoder`]) and read off their ZMQ sockets
/// ([`EngineListener`]), with the engine's replay endpoint
/// asked for what a gap lost. The format is in [the module above](super).
pub mod engine {
    pub use super::decoder::{EngineDecoder, EngineEvent, EngineStats, encode_engine_batch};
    pub use super::error::EngineDecodeError;
    pub use super::listener::{
        ENGINE_HEARTBEAT, EngineListener, EngineListenerConfig, EngineListenerHandle,
        EngineListenerStats,
    };
    pub use super::replay::{EngineReplayStats, ReplayFallback, ReplayFallbacks};
}

/// The worker's side: engine events through the sans-IO stages
/// ([`Coalescer`], [`DedupFilter`], dense
/// ids; composed by [`Pipeline`]), the async
/// [`Processor`] around them, the
/// [`EventPlaneSink`] that publishes, the
/// [`WorkerLog`] and [`RecoveryServer`]
/// that answer a router's recovery, and [`Worker`], which wires them
/// into one worker process.
pub mod pipeline {
    pub use super::coalesce::Coalescer;
    pub use super::dedup::{DedupFilter, DedupMode};
    pub use super::error::{IndexError, SinkError};
    pub use super::processor::{
        EventSink, LocalIndex, Processor, ProcessorConfig, ProcessorHandle, ProcessorStats,
    };
    pub use super::recovery::{
        DEFAULT_RECOVERY_EVENT_BLOCKS, DEFAULT_RECOVERY_EVENTS, Dump, RecoveryAcceptor,
        RecoveryServer, RecoveryServerStats, SharedWorkerLog, Since, WorkerLog, WorkerLogConfig,
        WorkerLogStats,
    };
    pub use super::sink::{
        EventPlaneSink, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE, split_messages,
    };
    pub use super::stages::Pipeline;
    pub use super::worker::{Worker, WorkerBuilder, WorkerHandle, WorkerStats};
}

/// The router's side: [`RouterIndex`], every worker's blocks
/// scored against a request's prefix; [`IndexFeed`], which turns
/// deliveries and discovery notices into the index's updates and says when a worker
/// must be recovered; and the recovery client ([`recover`],
/// [`RecoveryDriver`]) that asks a worker for what was lost.
pub mod router {
    pub use super::feed::{IndexFeed, IndexFeedStats, RecoveryAnswer, RecoveryNeed, Wipe, Wiped};
    pub use super::index::{
        Attribution, IndexRefusal, OverlapScore, OverlapScores, RouterIndex, RouterIndexConfig,
        RouterIndexStats, local_block_hashes,
    };
    pub use super::recovery::{
        Recovered, RecoveryClientConfig, RecoveryDriver, RecoveryError, RecoveryRequest, recover,
        recover_over,
    };
}

// The crate's own paths stay flat.
pub(crate) use coalesce::DEFAULT_MAX_BATCH_BLOCKS;
pub(crate) use decoder::{DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_BATCH_EVENTS};
pub(crate) use dedup::{DEFAULT_MAX_TRACKED_HASHES, DEFAULT_MAX_TRACKED_RANKS};
pub(crate) use engine::*;
pub(crate) use pipeline::*;
pub(crate) use recovery::DEFAULT_MAX_LOG_BLOCKS;
pub(crate) use router::*;

#[cfg(test)]
mod tests;
