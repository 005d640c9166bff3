//! KV events: the model, and the sans-IO stages that turn engine events into router
//! events — [`Coalescer`], [`DedupFilter`] and dense id stamping, composed by
//! [`Pipeline`] — with the async parts around them ([`EngineListener`], [`Processor`],
//! [`EventPlaneSink`]) and [`Worker`], which wires those into one worker process.
//! On the router's side, [`RouterIndex`] keeps every worker's blocks and scores a
//! request's prefix overlap per worker ([`RouterIndex::find_matches`]).
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
mod dedup;
mod dynamo;
#[cfg(feature = "dynamo-recovery")]
pub mod dynamo_recovery;
mod engine;
mod error;
mod event;
mod feed;
mod index;
mod listener;
mod pipeline;
mod processor;
mod recovery;
mod replay;
mod schema;
mod sink;
mod stale;
mod worker;

pub use coalesce::Coalescer;
pub(crate) use coalesce::DEFAULT_MAX_BATCH_BLOCKS;
pub(crate) use dedup::{DEFAULT_MAX_TRACKED_HASHES, DEFAULT_MAX_TRACKED_RANKS};
pub use dedup::{DedupFilter, DedupMode};
pub use dynamo::{decode_dynamo_router_events, dynamo_storage_tier, encode_dynamo_router_events};
pub(crate) use engine::{DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_BATCH_EVENTS};
pub use engine::{EngineDecoder, EngineEvent, EngineStats, encode_engine_batch};
pub use error::{EncodeError, EngineDecodeError, IndexError, KvDecodeError, SinkError};
pub use event::{
    BlockHash, DpRank, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId, tokens_hash,
};
pub use feed::{IndexFeed, IndexFeedStats, RecoveryAnswer, RecoveryNeed, Wipe, Wiped};
pub use index::{
    Attribution, IndexRefusal, OverlapScore, OverlapScores, RouterIndex, RouterIndexConfig,
    RouterIndexStats, local_block_hashes,
};
pub use listener::{
    ENGINE_HEARTBEAT, EngineListener, EngineListenerConfig, EngineListenerHandle,
    EngineListenerStats,
};
pub use pipeline::Pipeline;
pub use processor::{
    EventSink, LocalIndex, Processor, ProcessorConfig, ProcessorHandle, ProcessorStats,
};
pub(crate) use recovery::DEFAULT_MAX_LOG_BLOCKS;
pub use recovery::{
    DEFAULT_RECOVERY_EVENT_BLOCKS, DEFAULT_RECOVERY_EVENTS, Dump, Recovered, RecoveryAcceptor,
    RecoveryClientConfig, RecoveryDriver, RecoveryError, RecoveryRequest, RecoveryServer,
    RecoveryServerStats, SharedWorkerLog, Since, WorkerLog, WorkerLogConfig, WorkerLogStats,
    recover, recover_over,
};
pub use replay::{EngineReplayStats, ReplayFallback, ReplayFallbacks};
pub use sink::{
    EventPlaneSink, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE, decode_router_events,
    decode_router_payload, encode_router_events, encode_router_payload, split_messages,
};
pub use worker::{Worker, WorkerBuilder, WorkerHandle, WorkerStats};

#[cfg(test)]
mod tests;
