//! The engine decoder's fast path: batches in the form engines send (`[ts, events,
//! dp_rank?]`, each event a tagged array of integer hashes and token ids) decoded
//! straight from the bytes, with no value tree and no allocation per field. Anything
//! else — a batch or event as a map, binary or negative hashes, a container where a
//! scalar is expected, an unknown tag, a field of the wrong type, the element budget
//! reached, bytes that are not msgpack — makes it step aside (`None`), and the general
//! decoder reads the batch from its start. The two agree on every input: the same
//! events, raw ids and counters (checked over the fuzz corpus by a unit test, and by
//! the `engine_batch` fuzz target).

use super::{EngineDecoder, tier_named};
use crate::kv::{BlockHash, KvEventData, PlacementEvent, StorageTier};
use crate::msgpack::{read_array_len, read_str, read_uint, skip_value, uint_at};
use crate::reader::Reader;

/// Token ids (and stored hashes) kept between batches, 8 bytes each: a larger scratch
/// buffer is given back after the batch that needed it.
const KEPT_TOKENS: usize = 1 << 14;

/// Capacity the event list starts with, whatever the batch declares.
const INITIAL_EVENTS: usize = 1024;

/// Takes `n` from the element budget.
fn spend(budget: &mut usize, n: usize) -> Option<()> {
    *budget = budget.checked_sub(n)?;
    Some(())
}

/// The value is `nil`.
fn read_nil(r: &mut Reader<'_>) -> bool {
    let mut probe = *r;
    if probe.u8() == Some(0xc0) {
        *r = probe;
        return true;
    }
    false
}

/// Steps over one value that is not a container (the general decoder's budget
/// charges it one element, like a scalar).
fn skip_scalar(r: &mut Reader<'_>) -> Option<()> {
    match r.peek_rest().first()? {
        0x80..=0x9f | 0xdc..=0xdf => None,
        _ => skip_value(r).ok(),
    }
}

/// An array of non-negative integers, each pushed through `push` (after `out` is
/// cleared and sized); the general decoder's budget: one for the array, one per
/// integer.
fn read_array<T>(
    r: &mut Reader<'_>,
    budget: &mut usize,
    out: &mut Vec<T>,
    item: impl Fn(u64) -> Option<T>,
) -> Option<()> {
    let n = read_array_len(r)?;
    spend(budget, n.checked_add(1)?)?;
    let bytes = r.peek_rest();
    // Every integer takes at least a byte: nothing is reserved that is not there.
    if n > bytes.len() {
        return None;
    }
    out.clear();
    out.reserve(n);
    let mut at = 0;
    for _ in 0..n {
        let (v, len) = uint_at(bytes, at)?;
        out.push(item(v)?);
        at += len;
    }
    r.take(at).map(drop)
}

/// Token ids: each must fit in a `u32` (the general decoder fails the event
/// otherwise: here the batch steps aside).
fn read_tokens(r: &mut Reader<'_>, budget: &mut usize, out: &mut Vec<u64>) -> Option<()> {
    read_array(r, budget, out, |t| (t <= u64::from(u32::MAX)).then_some(t))
}

fn read_hashes(r: &mut Reader<'_>, budget: &mut usize, out: &mut Vec<BlockHash>) -> Option<()> {
    read_array(r, budget, out, |h| Some(BlockHash(h)))
}

/// A medium: `nil` or a string (anything else steps aside).
fn read_medium(r: &mut Reader<'_>) -> Option<StorageTier> {
    if read_nil(r) {
        return Some(StorageTier::Device);
    }
    read_str(r).map(tier_named)
}

/// Steps over fields `from..len` of an event, reading the medium at `medium`.
fn rest_of_event(
    r: &mut Reader<'_>,
    budget: &mut usize,
    from: usize,
    len: usize,
    medium: usize,
) -> Option<StorageTier> {
    let mut tier = StorageTier::Device;
    for i in from..len {
        spend(budget, 1)?;
        if i == medium {
            tier = read_medium(r)?;
        } else {
            skip_scalar(r)?;
        }
    }
    Some(tier)
}

impl EngineDecoder {
    /// Decodes `payload` if it is in the form engines send; `None` (having changed
    /// nothing) otherwise.
    pub(super) fn decode_streamed(&mut self, payload: &[u8]) -> Option<Vec<PlacementEvent>> {
        let saved = (self.stats, self.next_raw_id);
        let decoded = self.streamed(payload);
        if decoded.is_none() {
            (self.stats, self.next_raw_id) = saved;
        }
        self.tokens.clear();
        if self.tokens.capacity() > KEPT_TOKENS {
            self.tokens = Vec::new();
        }
        self.hashes.clear();
        if self.hashes.capacity() > KEPT_TOKENS {
            self.hashes = Vec::new();
        }
        decoded
    }

    fn streamed(&mut self, payload: &[u8]) -> Option<Vec<PlacementEvent>> {
        let mut r = Reader::new(payload);
        let mut budget = self.max_elements;
        let fields = read_array_len(&mut r)?;
        if !(2..=3).contains(&fields) {
            return None;
        }
        spend(&mut budget, 2)?;
        skip_scalar(&mut r)?; // the timestamp
        let n = read_array_len(&mut r)?;
        spend(&mut budget, 1)?;
        if n > self.max_events || n > budget || n > r.remaining() {
            return None;
        }
        let mut out = Vec::with_capacity(n.min(INITIAL_EVENTS));
        for _ in 0..n {
            if let Some(event) = self.streamed_event(&mut r, &mut budget)? {
                out.push(event);
            }
        }
        let dp_rank = if fields == 3 {
            spend(&mut budget, 1)?;
            if read_nil(&mut r) {
                0
            } else {
                u32::try_from(read_uint(&mut r)?).ok()?
            }
        } else {
            0
        };
        if r.remaining() != 0 {
            return None;
        }
        for ev in &mut out {
            ev.placement.dp_rank = dp_rank;
            ev.event.dp_rank = dp_rank;
        }
        self.stats.batches += 1;
        Some(out)
    }

    /// One event: `Some(None)` when it is dropped as the general decoder drops it.
    fn streamed_event(
        &mut self,
        r: &mut Reader<'_>,
        budget: &mut usize,
    ) -> Option<Option<PlacementEvent>> {
        let len = read_array_len(r)?;
        if len == 0 {
            return None;
        }
        spend(budget, 2)?; // the event and its tag
        let tag = read_str(r)?;
        let (data, tier) = match tag {
            b"BlockStored" if len >= 4 => {
                // Hashes and token ids go to scratch: the blocks are built from them.
                let (mut hashes, mut tokens) = (
                    std::mem::take(&mut self.hashes),
                    std::mem::take(&mut self.tokens),
                );
                let store = self.streamed_store(r, budget, len, &mut hashes, &mut tokens);
                (self.hashes, self.tokens) = (hashes, tokens);
                match store? {
                    (Some(data), tier) => (data, tier),
                    (None, _) => return Some(None),
                }
            }
            b"BlockRemoved" if len >= 2 => {
                let mut block_hashes = Vec::new();
                read_hashes(r, budget, &mut block_hashes)?;
                let tier = rest_of_event(r, budget, 2, len, 2)?;
                (KvEventData::Removed { block_hashes }, tier)
            }
            b"AllBlocksCleared" => {
                rest_of_event(r, budget, 1, len, usize::MAX)?;
                (KvEventData::Cleared, StorageTier::Device)
            }
            _ => return None,
        };
        self.stats.events += 1;
        Some(Some(self.next_event(0, tier, data)))
    }

    /// The fields of a `BlockStored` after its tag (`len` in all): its data (`None`
    /// when the general decoder drops it too) and tier.
    fn streamed_store(
        &mut self,
        r: &mut Reader<'_>,
        budget: &mut usize,
        len: usize,
        hashes: &mut Vec<BlockHash>,
        tokens: &mut Vec<u64>,
    ) -> Option<(Option<KvEventData>, StorageTier)> {
        read_hashes(r, budget, hashes)?;
        spend(budget, 1)?;
        let parent = if read_nil(r) {
            None
        } else {
            Some(BlockHash(read_uint(r)?))
        };
        read_tokens(r, budget, tokens)?;
        let tier = rest_of_event(r, budget, 4, len, 6)?;
        Some((self.stored(parent, hashes, tokens), tier))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{
        WorkerId,
        engine::{EngineEvent, encode_engine_batch},
    };

    /// Both paths, each from a fresh decoder: events, raw ids and counters.
    fn both(payload: &[u8], block_size: usize) -> (bool, String, String) {
        let fresh = || EngineDecoder::new(WorkerId(7), block_size).unwrap();
        let (mut fast, mut parsed) = (fresh(), fresh());
        let streamed = fresh().decode_streamed(payload).is_some();
        let a = fast.decode_batch(payload);
        let b = parsed.decode_batch_parsed(payload);
        (
            streamed,
            format!("{a:?} {:?} {:?}", fast.stats(), fast.next_raw_id),
            format!("{b:?} {:?} {:?}", parsed.stats(), parsed.next_raw_id),
        )
    }

    #[test]
    fn the_fast_path_agrees_with_the_full_parse_over_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/engine_batch");
        let mut inputs = 0;
        let mut streamed = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            let Some((&control, rest)) = data.split_first() else {
                continue;
            };
            let block_size = usize::from(control >> 1 & 15) + 1;
            // Every prefix too: truncations are where a streaming reader slips.
            for end in [rest.len(), rest.len() / 2, rest.len().saturating_sub(1)] {
                let input = rest.get(..end).unwrap_or_default();
                let (fast, a, b) = both(input, block_size);
                assert_eq!(a, b, "{input:02x?}");
                inputs += 1;
                streamed += usize::from(fast);
            }
        }
        assert!(inputs > 1000, "the corpus is there: {inputs} inputs");
        let _ = streamed; // mostly the fuzzer's raw bytes: few are engine batches
    }

    #[test]
    fn the_fast_path_agrees_with_the_full_parse_on_every_mutation_of_a_batch() {
        let events = [
            EngineEvent::Stored {
                block_hashes: vec![1, 300, 70_000],
                parent_block_hash: Some(9),
                token_ids: (0..12).collect(),
                medium: Some("GPU".into()),
            },
            EngineEvent::Removed {
                block_hashes: vec![1 << 40],
                medium: None,
            },
            EngineEvent::Cleared,
        ];
        let batch = encode_engine_batch(1.5, 1, 4, &events).unwrap();
        assert!(both(&batch, 4).0);
        let (mut inputs, mut streamed) = (0, 0);
        for at in 0..batch.len() {
            assert_eq!(both(&batch[..at], 4).1, both(&batch[..at], 4).2);
            for byte in 0..=255u8 {
                let mut input = batch.clone();
                input[at] = byte;
                let (fast, a, b) = both(&input, 4);
                assert_eq!(a, b, "byte {at} = {byte:#04x}: {input:02x?}");
                inputs += 1;
                streamed += usize::from(fast);
            }
        }
        assert!(streamed > inputs / 4, "{streamed} of {inputs} streamed");
    }

    #[test]
    fn what_engines_send_takes_the_fast_path_and_odd_forms_agree() {
        let store = |hashes: Vec<u64>, parent, medium: Option<&str>| EngineEvent::Stored {
            token_ids: (0..hashes.len() as u32 * 4).collect(),
            block_hashes: hashes,
            parent_block_hash: parent,
            medium: medium.map(str::to_owned),
        };
        let events = vec![
            store(vec![1, 2, 3], None, Some("GPU")),
            store(vec![4], Some(3), Some("cpu_pinned")),
            store(vec![5, 5], None, None), // repeats: dropped, counted
            store(vec![], None, None),     // no block: dropped
            EngineEvent::Removed {
                block_hashes: vec![1, 2],
                medium: Some("nvme".into()),
            },
            EngineEvent::Removed {
                block_hashes: vec![4],
                medium: Some("tape".into()),
            },
            EngineEvent::Cleared,
        ];
        let batch = encode_engine_batch(1.5, 2, 4, &events).unwrap();
        let (fast, a, b) = both(&batch, 4);
        assert!(fast, "an engine's batch is streamed");
        assert_eq!(a, b);
        // Tokens short of a block (truncated), and a batch without its rank.
        let short = encode_engine_batch(0.0, 0, 8, &events).unwrap();
        assert_eq!(both(&short, 8).1, both(&short, 8).2);
        let mut two = batch.clone();
        two[0] = 0x92;
        two.pop(); // dp_rank 2 is the last byte
        let (fast, a, b) = both(&two, 4);
        assert!(fast);
        assert_eq!(a, b);
        // Forms that step aside, and still agree: an event as a map, a binary hash, an
        // unknown tag, a nested timestamp, a token over u32, an empty event, trailing
        // bytes, and a batch over the element budget.
        let odd: Vec<Vec<u8>> = vec![
            b"\x93\x00\x91\x82\xa4type\xb0AllBlocksCleared\xa1x\x00\x00".to_vec(),
            b"\x93\x00\x91\x93\xacBlockRemoved\x91\xc4\x01a\xa3GPU\x00".to_vec(),
            b"\x93\x00\x91\x91\xa4Nope\x00".to_vec(),
            b"\x93\x91\x00\x91\x91\xb0AllBlocksCleared\x00".to_vec(),
            b"\x93\x00\x91\x94\xabBlockStored\x91\x01\xc0\x91\xcf\x00\x00\x00\x01\x00\x00\x00\x00\x00"
                .to_vec(),
            b"\x93\x00\x92\x90\x91\xb0AllBlocksCleared\x00".to_vec(),
            [batch.as_slice(), b"\x00"].concat(),
        ];
        for input in &odd {
            let (fast, a, b) = both(input, 1);
            assert!(!fast, "{input:02x?} stepped aside");
            assert_eq!(a, b, "{input:02x?}");
        }
        let mut tight = EngineDecoder::new(WorkerId(7), 4)
            .and_then(|d| d.with_limits(20, 1 << 16))
            .unwrap();
        let mut reference = tight.clone();
        assert_eq!(
            format!("{:?} {:?}", tight.decode_batch(&batch), tight.stats()),
            format!(
                "{:?} {:?}",
                reference.decode_batch_parsed(&batch),
                reference.stats()
            )
        );
        assert_eq!(tight.stats().oversized_batches, 1);
    }
}
