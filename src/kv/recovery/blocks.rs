//! The `blocks` payload of a dump answer (sans-IO): router events packed as fixed-width
//! little-endian integers, 16 bytes a stored block, instead of the msgpack maps live
//! events travel as (42 bytes a block). A dump is most of what a restarted router
//! reads; this is what it reads it in.
//!
//! A payload is the events' shared `worker_id u64` and `id u64`, then records to its
//! end, each `tag u8, tier u8, dp_rank u32, count u32` and then:
//!
//! | tag | event | then |
//! |---|---|---|
//! | 0 | `Stored` from the root | `count` × (`block_hash u64`, `tokens_hash u64`) |
//! | 1 | `Stored` under a parent | `parent u64`, then as tag 0 |
//! | 2 | `Removed` | `count` × `block_hash u64` |
//! | 3 | `Cleared` | nothing (`count` is 0) |
//!
//! Tiers are numbered device 0, host_pinned 1, disk 2, external 3. Decoding reads what
//! the payload holds and allocates no more than that: a count larger than the bytes
//! left is refused before anything is reserved.

use bytes::Bytes;

use crate::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
};

/// Bytes of a payload's header (worker id, event id).
const HEADER: usize = 16;

/// Bytes of a record's header (tag, tier, rank, count).
const RECORD: usize = 10;

/// Why a `blocks` payload was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Undecodable {
    /// Not a `blocks` payload.
    Malformed,
    /// Its events would take more memory than the caller allows, decoded.
    OverBudget,
}

use Undecodable::Malformed;

/// What `n` events carrying `blocks` blocks take in memory, decoded.
pub(super) fn decoded_size(events: usize, blocks: usize) -> usize {
    events
        .saturating_mul(size_of::<RouterEvent>())
        .saturating_add(blocks.saturating_mul(size_of::<StoredBlock>()))
}

fn tier_code(tier: StorageTier) -> u8 {
    match tier {
        StorageTier::HostPinned => 1,
        StorageTier::Disk => 2,
        StorageTier::External => 3,
        _ => 0,
    }
}

fn tier_of(code: u8) -> Option<StorageTier> {
    Some(match code {
        0 => StorageTier::Device,
        1 => StorageTier::HostPinned,
        2 => StorageTier::Disk,
        3 => StorageTier::External,
        _ => return None,
    })
}

/// Packs `events` into payloads of at most `max_blocks` blocks each (an event with
/// more goes alone). Consecutive events with the same worker and id share a payload.
pub(super) fn encode(events: &[RouterEvent], max_blocks: usize) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut payload: Vec<u8> = Vec::new();
    let mut head = (WorkerId(0), 0);
    let mut blocks = 0usize;
    for ev in events {
        let n = ev.event.data.block_count();
        let same = (ev.worker_id, ev.event.id) == head;
        if !payload.is_empty() && (!same || blocks + n > max_blocks) {
            out.push(Bytes::from(std::mem::take(&mut payload)));
            blocks = 0;
        }
        if payload.is_empty() {
            head = (ev.worker_id, ev.event.id);
            payload.reserve(HEADER + RECORD + 8 + 16 * n.min(max_blocks));
            payload.extend_from_slice(&ev.worker_id.0.to_le_bytes());
            payload.extend_from_slice(&ev.event.id.to_le_bytes());
        }
        blocks += n;
        let (tag, count) = match &ev.event.data {
            KvEventData::Stored {
                parent_hash: None,
                blocks,
            } => (0u8, blocks.len()),
            KvEventData::Stored { blocks, .. } => (1, blocks.len()),
            KvEventData::Removed { block_hashes } => (2, block_hashes.len()),
            KvEventData::Cleared => (3, 0),
        };
        payload.push(tag);
        payload.push(tier_code(ev.tier));
        payload.extend_from_slice(&ev.event.dp_rank.to_le_bytes());
        // A dump's events hold at most 8,192 blocks (`DUMP_EVENT_BLOCKS`), and the
        // client refuses answers past 2^22: a count past u32 cannot occur.
        payload.extend_from_slice(&u32::try_from(count).unwrap_or(u32::MAX).to_le_bytes());
        match &ev.event.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                if let Some(p) = parent_hash {
                    payload.extend_from_slice(&p.0.to_le_bytes());
                }
                for b in blocks {
                    payload.extend_from_slice(&b.block_hash.0.to_le_bytes());
                    payload.extend_from_slice(&b.tokens_hash.0.to_le_bytes());
                }
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    payload.extend_from_slice(&h.0.to_le_bytes());
                }
            }
            KvEventData::Cleared => {}
        }
    }
    if !payload.is_empty() {
        out.push(Bytes::from(payload));
    }
    out
}

/// Reads little-endian integers off the front of a slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Undecodable> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or(Malformed)?;
        self.0 = rest;
        Ok(*head)
    }

    fn u64(&mut self) -> Result<u64, Undecodable> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, Undecodable> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    fn u8(&mut self) -> Result<u8, Undecodable> {
        self.take::<1>().map(|[b]| b)
    }

    /// `count` items of `size` bytes fit in what is left.
    fn holds(&self, count: usize, size: usize) -> Result<(), Undecodable> {
        if count.checked_mul(size).is_some_and(|n| n <= self.0.len()) {
            Ok(())
        } else {
            Err(Malformed)
        }
    }
}

/// Unpacks one payload, appending its events to `out`, as long as they take at most
/// `budget` bytes decoded ([`decoded_size`]: a record of an empty event is 10 bytes on
/// the wire, several times that in memory). Returns what they take; on a refusal
/// `out` is left with what came before the payload.
pub(super) fn decode(
    payload: &[u8],
    out: &mut Vec<RouterEvent>,
    budget: usize,
) -> Result<usize, Undecodable> {
    let before = out.len();
    let result = decode_into(payload, out, budget);
    if result.is_err() {
        out.truncate(before);
    }
    result
}

fn decode_into(
    payload: &[u8],
    out: &mut Vec<RouterEvent>,
    budget: usize,
) -> Result<usize, Undecodable> {
    let mut spent = 0usize;
    let mut r = Reader(payload);
    let worker_id = WorkerId(r.u64()?);
    let id = r.u64()?;
    while !r.0.is_empty() {
        let tag = r.u8()?;
        let tier = tier_of(r.u8()?).ok_or(Malformed)?;
        let dp_rank = r.u32()?;
        let count = usize::try_from(r.u32()?).map_err(|_| Malformed)?;
        // A count past what the payload holds is malformed, whatever the budget.
        let (item, parent) = match tag {
            0 => (16, 0),
            1 => (16, 8),
            2 => (8, 0),
            _ => (0, 0),
        };
        r.holds(count, item)?;
        if r.0.len() < parent + count * item {
            return Err(Malformed);
        }
        spent = spent.saturating_add(decoded_size(1, count));
        if spent > budget {
            return Err(Undecodable::OverBudget);
        }
        let data = match tag {
            0 | 1 => {
                let parent_hash = if tag == 1 {
                    Some(BlockHash(r.u64()?))
                } else {
                    None
                };
                r.holds(count, 16)?;
                let mut blocks = Vec::with_capacity(count);
                for _ in 0..count {
                    blocks.push(StoredBlock {
                        block_hash: BlockHash(r.u64()?),
                        tokens_hash: TokensHash(r.u64()?),
                    });
                }
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                }
            }
            2 => {
                r.holds(count, 8)?;
                let mut block_hashes = Vec::with_capacity(count);
                for _ in 0..count {
                    block_hashes.push(BlockHash(r.u64()?));
                }
                KvEventData::Removed { block_hashes }
            }
            3 if count == 0 => KvEventData::Cleared,
            _ => return Err(Malformed),
        };
        out.push(RouterEvent {
            worker_id,
            tier,
            event: KvEvent { id, dp_rank, data },
        });
    }
    Ok(spent)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block whose tokens hash is its block hash inverted.
    fn block(h: &u64) -> StoredBlock {
        StoredBlock {
            block_hash: BlockHash(*h),
            tokens_hash: TokensHash(!h),
        }
    }

    fn stored(worker: u64, id: u64, parent: Option<u64>, hashes: &[u64]) -> RouterEvent {
        let data = KvEventData::Stored {
            parent_hash: parent.map(BlockHash),
            blocks: hashes.iter().map(block).collect(),
        };
        RouterEvent {
            worker_id: WorkerId(worker),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: 3,
                data,
            },
        }
    }

    fn every_kind() -> Vec<RouterEvent> {
        let mut removed = stored(7, 9, None, &[]);
        removed.tier = StorageTier::Disk;
        removed.event.data = KvEventData::Removed {
            block_hashes: vec![BlockHash(1), BlockHash(u64::MAX)],
        };
        let mut cleared = stored(7, 9, None, &[]);
        cleared.tier = StorageTier::External;
        cleared.event.data = KvEventData::Cleared;
        let mut pinned = stored(7, 9, Some(5), &[6]);
        pinned.tier = StorageTier::HostPinned;
        vec![
            stored(7, 9, None, &[1, 2, 3]),
            stored(7, 9, Some(3), &[4, 5]),
            pinned,
            removed,
            cleared,
            stored(8, 9, None, &[1]),
            stored(8, 10, None, &[]),
        ]
    }

    fn decode_all(payloads: &[Bytes]) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        for p in payloads {
            decode(p, &mut out, usize::MAX).unwrap();
        }
        out
    }

    #[test]
    fn every_kind_of_event_round_trips() {
        let events = every_kind();
        let payloads = encode(&events, 8192);
        // A payload per (worker, id): 7/9, 8/9, 8/10.
        assert_eq!(payloads.len(), 3);
        assert_eq!(decode_all(&payloads), events);
    }

    #[test]
    fn payloads_hold_at_most_the_blocks_asked() {
        let events: Vec<_> = (0..10).map(|i| stored(1, 2, None, &[i, i + 100])).collect();
        let payloads = encode(&events, 5);
        // Two events (4 blocks) a payload: a third would make 6.
        assert_eq!(payloads.len(), 5);
        assert_eq!(decode_all(&payloads), events);
        // 16 bytes a stored block, the header and a record's 10 besides.
        assert_eq!(payloads[0].len(), 16 + 2 * (10 + 2 * 16));
    }

    #[test]
    fn a_count_past_the_payload_is_refused_before_reserving() {
        let mut p = encode(&[stored(1, 2, None, &[1])], 8192)[0].to_vec();
        // The record's count says 2^32 - 1 blocks; one is there.
        p[16 + 6..16 + 10].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut out = vec![stored(9, 9, None, &[9])];
        assert_eq!(decode(&p, &mut out, usize::MAX), Err(Malformed));
        assert_eq!(
            out.len(),
            1,
            "what came before stays, nothing of this payload"
        );
    }

    #[test]
    fn every_truncation_and_bad_tag_or_tier_is_refused() {
        let kinds = every_kind();
        let whole = encode(&kinds[..5], 8192)[0].to_vec();
        // Where records end: a cut there is a shorter valid payload; anywhere else
        // it is refused, nothing kept.
        let ends: Vec<usize> = std::iter::once(16)
            .chain((1..5).map(|k| encode(&kinds[..k], 8192)[0].len()))
            .collect();
        for cut in 1..whole.len() {
            let mut out = Vec::new();
            let r = decode(&whole[..cut], &mut out, usize::MAX);
            match ends.iter().position(|&e| e == cut) {
                Some(k) => {
                    assert!(r.is_ok(), "cut at a record's end, {cut}");
                    assert_eq!(out, kinds[..k]);
                }
                None => {
                    assert_eq!(r, Err(Malformed), "cut at {cut}");
                    assert!(out.is_empty());
                }
            }
        }
        let mut bad_tag = whole.clone();
        bad_tag[16] = 4;
        assert_eq!(
            decode(&bad_tag, &mut Vec::new(), usize::MAX),
            Err(Malformed)
        );
        let mut bad_tier = whole.clone();
        bad_tier[17] = 4;
        assert_eq!(
            decode(&bad_tier, &mut Vec::new(), usize::MAX),
            Err(Malformed)
        );
        let mut cleared_with_count = encode(&every_kind()[4..5], 8192)[0].to_vec();
        cleared_with_count[16 + 6] = 1;
        assert_eq!(
            decode(&cleared_with_count, &mut Vec::new(), usize::MAX),
            Err(Malformed)
        );
    }

    #[test]
    fn events_past_the_budget_decoded_are_refused_as_they_come() {
        // A thousand empty events: 10 bytes each on the wire, far more in memory.
        let cleared = |i| {
            let mut e = stored(1, 2, None, &[]);
            e.event.data = KvEventData::Cleared;
            e.event.dp_rank = i;
            e
        };
        let events: Vec<_> = (0..1000).map(cleared).collect();
        let p = &encode(&events, 8192)[0];
        assert_eq!(p.len(), 16 + 1000 * 10);
        let need = decoded_size(1000, 0);
        let mut out = Vec::new();
        assert_eq!(decode(p, &mut out, need), Ok(need));
        assert_eq!(out.len(), 1000);
        let mut out = Vec::new();
        assert_eq!(decode(p, &mut out, need - 1), Err(Undecodable::OverBudget));
        assert!(out.is_empty());
        // Blocks count too, before their room is reserved.
        let one = &encode(&[stored(1, 2, None, &[5, 6])], 8192)[0];
        let need = decoded_size(1, 2);
        assert_eq!(
            decode(one, &mut Vec::new(), need - 1),
            Err(Undecodable::OverBudget)
        );
    }

    #[test]
    fn random_bytes_never_panic_nor_allocate_past_the_payload() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..2000 {
            let payload: Vec<u8> = (0..len % 97)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Mostly small values, so tags, tiers and counts are often valid.
                    (x % 7) as u8
                })
                .collect();
            let mut out = Vec::new();
            if decode(&payload, &mut out, usize::MAX).is_ok() {
                let blocks: usize = out.iter().map(|e| e.event.data.block_count()).sum();
                assert!(8 * blocks <= payload.len());
            }
        }
    }
}
