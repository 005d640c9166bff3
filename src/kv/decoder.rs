//! Engine ingress: the KV event batches vLLM and SGLang publish over ZMQ, decoded into
//! [`PlacementEvent`]s. The format, field by field, is documented publicly in the
//! `kv` module's docs ("The engine's format"); keep the two in step.

use super::event::tokens_hash_wide;
use super::{
    BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, StorageTier, StoredBlock, WorkerId,
};
use super::{EncodeError, EngineDecodeError};
use crate::config::{self, ConfigError};
use crate::msgpack::{self, MsgpackError, Value};

mod streamed;

/// Counters of an [`EngineDecoder`].
///
/// ```
/// use eventplane::kv::{WorkerId, engine::{encode_engine_batch, EngineDecoder, EngineEvent}};
/// let mut decoder = EngineDecoder::new(WorkerId(1), 4)?;
/// let batch = encode_engine_batch(0.0, 0, 4, &[EngineEvent::Cleared])?;
/// decoder.decode_batch(&batch)?;
/// assert!(decoder.decode_batch(b"not msgpack").is_err());
/// let stats = decoder.stats();
/// assert_eq!((stats.batches, stats.malformed_batches, stats.events), (1, 1, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EngineStats {
    /// Batches decoded.
    pub batches: u64,
    /// Batches rejected whole (not msgpack, not a batch).
    pub malformed_batches: u64,
    /// Of those, batches over [`EngineDecoder::with_limits`]' element or event
    /// budget (rejected before decoding what they declare).
    pub oversized_batches: u64,
    /// Events decoded.
    pub events: u64,
    /// Events that failed alone (unknown tag, wrong shape).
    pub failed_events: u64,
    /// Of those, `BlockRemoved` events of the wrong shape: the blocks they named
    /// cannot be removed, so the listener clears what it forwarded (see
    /// [`EngineListener`](super::EngineListener)).
    pub failed_removals: u64,
    /// Stored events cut at their first block without exactly `block_size` tokens.
    pub truncated_events: u64,
    /// Stored events dropped because their hashes repeat (self-referencing).
    pub self_referencing: u64,
}

/// Decodes engine batches for one worker, sans-IO.
///
/// ```
/// use eventplane::kv::{KvEventData, WorkerId, engine::EngineDecoder};
/// // [ts, [["AllBlocksCleared"]], 0] as msgpack:
/// let payload = b"\x93\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x91\x91\xb0AllBlocksCleared\x00";
/// let mut decoder = EngineDecoder::new(WorkerId(1), 16)?;
/// let events = decoder.decode_batch(payload)?;
/// assert_eq!(events[0].event.data, KvEventData::Cleared);
/// assert!(EngineDecoder::new(WorkerId(1), 0).is_err()); // no zero block size
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct EngineDecoder {
    worker_id: WorkerId,
    block_size: usize,
    next_raw_id: u64,
    max_elements: usize,
    max_events: usize,
    stats: EngineStats,
    /// Token ids of the event being decoded (the fast path's scratch).
    tokens: Vec<u64>,
    /// Hashes of the stored event being decoded (the fast path's scratch).
    hashes: Vec<BlockHash>,
}

/// Default budget of msgpack elements decoded per batch (each value, and each
/// integer of an integer array, costs one): 2^19. A decoded element costs at most
/// 64 bytes (a 32-byte value in a vector grown by doubling), so a batch costs at most
/// 32 MiB while it is decoded, whatever it declares. A realistic vLLM batch (64
/// stored events of 32 blocks of 16 tokens) has about 35 000.
pub(crate) const DEFAULT_MAX_BATCH_ELEMENTS: usize = 1 << 19;

/// Default cap on events in one batch: 2^16.
pub(crate) const DEFAULT_MAX_BATCH_EVENTS: usize = 1 << 16;

impl EngineDecoder {
    /// A decoder for `worker_id` whose engine uses `block_size` tokens per block;
    /// [`ConfigError::Zero`] when `block_size` is zero.
    pub fn new(worker_id: WorkerId, block_size: usize) -> Result<EngineDecoder, ConfigError> {
        Ok(EngineDecoder {
            worker_id,
            block_size: config::nonzero("block_size", block_size)?,
            next_raw_id: 0,
            max_elements: DEFAULT_MAX_BATCH_ELEMENTS,
            max_events: DEFAULT_MAX_BATCH_EVENTS,
            stats: EngineStats::default(),
            tokens: Vec::new(),
            hashes: Vec::new(),
        })
    }

    /// Per-batch budgets: msgpack elements decoded (default
    /// 2^19) and events (default
    /// 2^16). A batch over either is rejected whole and
    /// counted in `oversized_batches`; what it declares is never allocated. Neither
    /// may be zero.
    ///
    /// ```
    /// use eventplane::kv::{WorkerId, engine::{encode_engine_batch, EngineDecoder, EngineEvent}};
    /// let mut decoder = EngineDecoder::new(WorkerId(1), 4)?.with_limits(1 << 20, 2)?;
    /// let batch = encode_engine_batch(0.0, 0, 4, &[EngineEvent::Cleared, EngineEvent::Cleared, EngineEvent::Cleared])?;
    /// assert!(decoder.decode_batch(&batch).is_err());
    /// assert_eq!(decoder.stats().oversized_batches, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_limits(
        mut self,
        max_elements: usize,
        max_events: usize,
    ) -> Result<EngineDecoder, ConfigError> {
        self.max_elements = config::nonzero("max_elements", max_elements)?;
        self.max_events = config::nonzero("max_events", max_events)?;
        Ok(self)
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Decodes one batch payload. Events get consecutive raw ids; an event that fails
    /// alone is counted and skipped, the rest of the batch is kept.
    ///
    /// Batches in the form engines send (tagged arrays of integers) are read straight
    /// from the bytes; any other form is parsed in full first. Both give the same
    /// events and counters.
    pub fn decode_batch(
        &mut self,
        payload: &[u8],
    ) -> Result<Vec<PlacementEvent>, EngineDecodeError> {
        match self.decode_streamed(payload) {
            Some(events) => Ok(events),
            None => self.decode_parsed(payload),
        }
    }

    /// [`decode_batch`](Self::decode_batch) through the full parse alone (the fuzz
    /// target's reference for the fast path).
    #[cfg(any(test, fuzzing))]
    #[doc(hidden)]
    pub fn decode_batch_parsed(
        &mut self,
        payload: &[u8],
    ) -> Result<Vec<PlacementEvent>, EngineDecodeError> {
        self.decode_parsed(payload)
    }

    fn decode_parsed(&mut self, payload: &[u8]) -> Result<Vec<PlacementEvent>, EngineDecodeError> {
        let parsed = msgpack::parse(payload, self.max_elements);
        let view = parsed.as_ref().ok().and_then(batch_view);
        let oversized = matches!(parsed, Err(MsgpackError::TooManyElements))
            || view.is_some_and(|(events, _)| events.len() > self.max_events);
        let reason = match (&parsed, view) {
            _ if oversized => "more elements or events than the per-batch budget",
            (Ok(_), Some(_)) => "",
            (Ok(_), None) => "not a [ts, events, dp_rank?] batch",
            (Err(_), _) => "not msgpack",
        };
        let Some((events, dp_rank)) = view.filter(|_| !oversized) else {
            self.stats.malformed_batches += 1;
            self.stats.oversized_batches += u64::from(oversized);
            return Err(EngineDecodeError { reason });
        };
        self.stats.batches += 1;
        let mut out = Vec::with_capacity(events.len());
        for ev in events {
            match self.event(ev, dp_rank) {
                Ok(Some(pe)) => out.push(pe),
                Ok(None) => {}
                Err(()) => self.stats.failed_events += 1,
            }
        }
        Ok(out)
    }

    fn event(&mut self, ev: &Value<'_>, dp_rank: u32) -> Result<Option<PlacementEvent>, ()> {
        let fields = Fields::of(ev).ok_or(())?;
        let (data, medium) = match fields.tag {
            "BlockStored" => {
                let hashes = hash_list(fields.at(1, "block_hashes"))?;
                let parent = match fields.at(2, "parent_block_hash") {
                    None | Some(Value::Nil) => None,
                    Some(v) => Some(hash(v)?),
                };
                let tokens = token_ids(fields.at(3, "token_ids"))?;
                let medium = fields.at(6, "medium");
                match self.stored(parent, &hashes, tokens) {
                    Some(data) => (data, medium),
                    None => return Ok(None),
                }
            }
            "BlockRemoved" => {
                let Ok(hashes) = hash_list(fields.at(1, "block_hashes")) else {
                    self.stats.failed_removals += 1;
                    return Err(());
                };
                (
                    KvEventData::Removed {
                        block_hashes: hashes,
                    },
                    fields.at(2, "medium"),
                )
            }
            "AllBlocksCleared" => (KvEventData::Cleared, None),
            _ => return Err(()),
        };
        self.stats.events += 1;
        Ok(Some(self.next_event(dp_rank, tier(medium), data)))
    }

    /// A `Cleared` of `dp_rank` that the worker makes itself (it lost track of its
    /// engine), with the next raw id so that ids stay consecutive.
    pub(crate) fn cleared(&mut self, dp_rank: u32) -> PlacementEvent {
        self.next_event(dp_rank, StorageTier::Device, KvEventData::Cleared)
    }

    /// This worker's event with the next raw id.
    fn next_event(&mut self, dp_rank: u32, tier: StorageTier, data: KvEventData) -> PlacementEvent {
        let id = self.next_raw_id;
        self.next_raw_id += 1;
        PlacementEvent {
            placement: Placement {
                worker_id: self.worker_id,
                dp_rank,
                tier,
            },
            event: KvEvent { id, dp_rank, data },
        }
    }

    /// Builds a stored event with exactly `block_size` tokens per block; `None` when it
    /// must be dropped.
    fn stored(
        &mut self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        tokens: &[u64],
    ) -> Option<KvEventData> {
        if !distinct(parent, hashes) {
            self.stats.self_referencing += 1;
            return None;
        }
        let mut blocks = Vec::with_capacity(hashes.len());
        for (i, h) in hashes.iter().enumerate() {
            let start = i * self.block_size;
            match tokens.get(start..start + self.block_size) {
                Some(chunk) => blocks.push(StoredBlock {
                    block_hash: *h,
                    tokens_hash: tokens_hash_wide(chunk),
                }),
                None => {
                    self.stats.truncated_events += 1;
                    break;
                }
            }
        }
        if blocks.is_empty() {
            return None;
        }
        Some(KvEventData::Stored {
            parent_hash: parent,
            blocks,
        })
    }
}

/// `(events, dp_rank)` of a batch: `[ts, events, dp_rank?]` or a map with those names.
fn batch_view<'v, 'a>(root: &'v Value<'a>) -> Option<(&'v [Value<'a>], u32)> {
    let (events, rank) = match root {
        Value::Array(items) => (items.get(1)?, items.get(2)),
        Value::Map(_) => (
            root.get("events")?,
            root.get("dp_rank")
                .or_else(|| root.get("data_parallel_rank")),
        ),
        _ => return None,
    };
    let dp_rank = match rank {
        None | Some(Value::Nil) => 0,
        Some(v) => u32::try_from(v.as_u64()?).ok()?,
    };
    Some((events.as_array()?, dp_rank))
}

/// An event's fields, by position (tagged array) or by name (tagged map).
struct Fields<'v, 'a> {
    tag: &'a str,
    value: &'v Value<'a>,
}

impl<'v, 'a> Fields<'v, 'a> {
    fn of(value: &'v Value<'a>) -> Option<Self> {
        let tag = match value {
            Value::Array(items) => items.first()?.as_str()?,
            Value::Map(_) => value.get("type")?.as_str()?,
            _ => return None,
        };
        Some(Fields { tag, value })
    }

    fn at(&self, index: usize, name: &str) -> Option<&'v Value<'a>> {
        match self.value {
            Value::Array(items) => items.get(index),
            _ => self.value.get(name),
        }
    }
}

/// `true` when no hash repeats, the parent included: a short list (as engines send)
/// is compared pairwise without allocating, a longer one through a set.
fn distinct(parent: Option<BlockHash>, hashes: &[BlockHash]) -> bool {
    const PAIRWISE: usize = 32;
    if hashes.len() <= PAIRWISE {
        return hashes
            .iter()
            .enumerate()
            .all(|(i, h)| Some(*h) != parent && !hashes.get(..i).unwrap_or_default().contains(h));
    }
    let mut seen =
        crate::hash::FastSet::with_capacity_and_hasher(hashes.len() + 1, Default::default());
    seen.extend(parent);
    hashes.iter().all(|h| seen.insert(*h))
}

fn hash(v: &Value<'_>) -> Result<BlockHash, ()> {
    match v {
        Value::UInt(u) => Ok(BlockHash(*u)),
        Value::NegInt(i) => Ok(BlockHash(*i as u64)),
        Value::Bin(b) | Value::Str(b) => Ok(BlockHash(xxhash_rust::xxh3::xxh3_64(b))),
        _ => Err(()),
    }
}

fn hash_list(v: Option<&Value<'_>>) -> Result<Vec<BlockHash>, ()> {
    let v = v.ok_or(())?;
    if let Some(ints) = v.as_uints() {
        return Ok(ints.iter().map(|&h| BlockHash(h)).collect());
    }
    v.as_array().ok_or(())?.iter().map(hash).collect()
}

/// The token ids of a stored event, each checked to fit in a `u32`.
fn token_ids<'v>(v: Option<&'v Value<'_>>) -> Result<&'v [u64], ()> {
    let v = v.ok_or(())?;
    if let Some(ints) = v.as_uints() {
        if ints.iter().any(|&t| u32::try_from(t).is_err()) {
            return Err(());
        }
        return Ok(ints);
    }
    // An empty array parses generically.
    match v.array_len() {
        Some(0) => Ok(&[]),
        _ => Err(()),
    }
}

fn tier(medium: Option<&Value<'_>>) -> StorageTier {
    match medium {
        None | Some(Value::Nil) => StorageTier::Device,
        Some(Value::Str(name)) => tier_named(name),
        Some(_) => StorageTier::External,
    }
}

/// The tier a medium's name stands for, in any case; an unknown name (or one that is
/// not UTF-8) is [`StorageTier::External`].
fn tier_named(name: &[u8]) -> StorageTier {
    let is = |known: &[&str]| {
        known
            .iter()
            .any(|k| name.eq_ignore_ascii_case(k.as_bytes()))
    };
    if name.is_empty() || is(&["GPU"]) {
        StorageTier::Device
    } else if is(&["CPU", "CPU_PINNED"]) {
        StorageTier::HostPinned
    } else if is(&["DISK", "NVME"]) {
        StorageTier::Disk
    } else {
        StorageTier::External
    }
}

/// One engine event, for [`encode_engine_batch`].
///
/// ```
/// use eventplane::kv::{KvEventData, WorkerId, engine::{encode_engine_batch, EngineDecoder, EngineEvent}};
/// let batch = encode_engine_batch(0.0, 0, 2, &[EngineEvent::Removed {
///     block_hashes: vec![5, 6],
///     medium: Some("CPU".into()),
/// }])?;
/// let events = EngineDecoder::new(WorkerId(1), 2)?.decode_batch(&batch)?;
/// assert_eq!(events[0].event.data.block_count(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineEvent {
    /// `BlockStored`: `token_ids` holds `block_size` tokens per hash.
    Stored {
        /// The stored blocks' hashes, in chain order.
        block_hashes: Vec<u64>,
        /// The block before the first one.
        parent_block_hash: Option<u64>,
        /// All tokens of the stored blocks.
        token_ids: Vec<u32>,
        /// The medium (`GPU`, `CPU`, `DISK`, …); `None` to omit it.
        medium: Option<String>,
    },
    /// `BlockRemoved`.
    Removed {
        /// The evicted blocks' hashes.
        block_hashes: Vec<u64>,
        /// The medium; `None` to omit it.
        medium: Option<String>,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]`.
type StoredWire<'a> = (
    &'static str,
    &'a [u64],
    Option<u64>,
    &'a [u32],
    u32,
    Option<u32>,
    Option<&'a str>,
);

#[derive(serde::Serialize)]
#[serde(untagged)]
enum Wire<'a> {
    Stored(StoredWire<'a>),
    Removed((&'static str, &'a [u64], Option<&'a str>)),
    Cleared((&'static str,)),
}

/// Encodes a batch the way vLLM ≤ 0.23 publishes it: `[ts, events, dp_rank]` with
/// tagged-array events — for engine simulators and tests.
///
/// ```
/// use eventplane::kv::{KvEventData, WorkerId, engine::{encode_engine_batch, EngineDecoder, EngineEvent}};
/// let batch = encode_engine_batch(0.0, 0, 2, &[
///     EngineEvent::Stored { block_hashes: vec![7], parent_block_hash: None,
///         token_ids: vec![1, 2], medium: None },
///     EngineEvent::Cleared,
/// ])?;
/// let events = EngineDecoder::new(WorkerId(1), 2)?.decode_batch(&batch)?;
/// assert_eq!(events.len(), 2);
/// assert_eq!(events[1].event.data, KvEventData::Cleared);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn encode_engine_batch(
    ts: f64,
    dp_rank: u32,
    block_size: u32,
    events: &[EngineEvent],
) -> Result<Vec<u8>, EncodeError> {
    let wire: Vec<Wire<'_>> = events
        .iter()
        .map(|e| match e {
            EngineEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                medium,
            } => Wire::Stored((
                "BlockStored",
                block_hashes,
                *parent_block_hash,
                token_ids,
                block_size,
                None,
                medium.as_deref(),
            )),
            EngineEvent::Removed {
                block_hashes,
                medium,
            } => Wire::Removed(("BlockRemoved", block_hashes, medium.as_deref())),
            EngineEvent::Cleared => Wire::Cleared(("AllBlocksCleared",)),
        })
        .collect();
    rmp_serde::to_vec(&(ts, wire, dp_rank)).map_err(|e| EncodeError::new("the engine batch", e))
}

#[cfg(test)]
mod budget_tests {
    use super::*;

    /// `[0.0, [nil × n], 0]`: n + 4 elements.
    fn nils(n: u32) -> Vec<u8> {
        let mut b = vec![0x93, 0xcb];
        b.extend_from_slice(&0f64.to_be_bytes());
        b.push(0xdd);
        b.extend_from_slice(&n.to_be_bytes());
        b.resize(b.len() + n as usize, 0xc0);
        b.push(0x00);
        b
    }

    #[test]
    fn a_batch_at_the_element_budget_decodes_one_more_is_refused() {
        let budget = 1 << 16;
        let n = budget as u32 - 4;
        let mut d = EngineDecoder::new(WorkerId(1), 4)
            .and_then(|d| d.with_limits(budget, usize::MAX))
            .unwrap();
        // Decoded element by element (each nil event fails alone)...
        assert_eq!(d.decode_batch(&nils(n)).map(|e| e.len()), Ok(0));
        assert_eq!(d.stats().failed_events, u64::from(n));
        // ...and one element more is refused whole.
        assert!(d.decode_batch(&nils(n + 1)).is_err());
        assert_eq!(d.stats().oversized_batches, 1);
    }

    #[test]
    fn events_over_their_cap_refuse_the_batch() {
        let mut d = EngineDecoder::new(WorkerId(1), 4)
            .and_then(|d| d.with_limits(usize::MAX, 100))
            .unwrap();
        assert!(d.decode_batch(&nils(100)).is_ok());
        assert!(d.decode_batch(&nils(101)).is_err());
        assert_eq!(d.stats().oversized_batches, 1);
    }

    #[test]
    fn repeated_hashes_are_caught_on_both_paths() {
        for n in [4u64, 32, 33, 100] {
            let hashes: Vec<BlockHash> = (1..=n).map(BlockHash).collect();
            assert!(distinct(None, &hashes), "{n}");
            assert!(distinct(Some(BlockHash(0)), &hashes), "{n}");
            assert!(
                !distinct(Some(BlockHash(n)), &hashes),
                "{n}: the parent repeats"
            );
            let mut repeated = hashes.clone();
            repeated.push(BlockHash(1));
            assert!(!distinct(None, &repeated), "{n}: the first hash repeats");
        }
    }
}
