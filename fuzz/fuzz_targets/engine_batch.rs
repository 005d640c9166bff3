//! The KV path with oracles. The first byte picks the mode:
//! - even: the rest is raw bytes, decoded as an engine batch and as a router-event
//!   payload. Neither may panic; the engine decoder's fast path must give what its
//!   full parse gives; a batch that decodes goes through the pipeline.
//! - odd: the rest describes engine events (see `engine_events`), which are encoded the
//!   way vLLM publishes them and decoded back: every event must come back with its
//!   block hashes, parent and token hashes.
//!
//! In both modes, whatever reaches the pipeline must balance: events in = events out +
//! merged + deduplicated, with dense outbound ids from 1; and the router events out
//! must survive their own wire format: decode(encode(x)) == x.
#![no_main]

use eventplane::kv::{
    BlockHash, KvEventData, PlacementEvent, RouterEvent, WorkerId,
    engine::{EngineDecoder, EngineEvent, encode_engine_batch},
    pipeline::Pipeline,
    tokens_hash,
};
use eventplane::wire::Dialect;
use std::collections::{HashMap, HashSet};

use libfuzzer_sys::fuzz_target;

/// Engine events from `bytes`: per event a tag byte (stored, removed or cleared) and,
/// for stored and removed, a block count (0–7) and 2 bytes per block hash.
fn engine_events(bytes: &[u8], block_size: usize) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while let Some((&tag, tail)) = rest.split_first() {
        rest = tail;
        if tag % 8 == 0 {
            out.push(EngineEvent::Cleared);
            continue;
        }
        let Some((&count, tail)) = rest.split_first() else {
            break;
        };
        let count = usize::from(count % 8);
        if tail.len() < 2 * count {
            break;
        }
        let (hashes, tail) = tail.split_at(2 * count);
        rest = tail;
        let block_hashes: Vec<u64> = hashes
            .chunks(2)
            .map(|c| u64::from(u16::from_be_bytes([c[0], c[1]])))
            .collect();
        if tag % 2 == 1 {
            // Tokens derived from the hashes, `block_size` per block.
            let token_ids = block_hashes
                .iter()
                .flat_map(|&h| (0..block_size as u32).map(move |k| h as u32 ^ k))
                .collect();
            out.push(EngineEvent::Stored {
                parent_block_hash: (tag & 4 != 0).then_some(u64::from(tag)),
                block_hashes,
                token_ids,
                medium: (tag & 2 != 0).then(|| "GPU".to_owned()),
            });
        } else {
            out.push(EngineEvent::Removed {
                block_hashes,
                medium: None,
            });
        }
    }
    out
}

/// The decoded event matches the engine event it came from.
fn same_event(engine: &EngineEvent, decoded: &KvEventData, block_size: usize) -> bool {
    match (engine, decoded) {
        (EngineEvent::Cleared, KvEventData::Cleared) => true,
        (
            EngineEvent::Removed { block_hashes, .. },
            KvEventData::Removed {
                block_hashes: got, ..
            },
        ) => got.iter().map(|h| h.0).eq(block_hashes.iter().copied()),
        (
            EngineEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            },
            KvEventData::Stored {
                parent_hash,
                blocks,
            },
        ) => {
            *parent_hash == parent_block_hash.map(BlockHash)
                && blocks.len() == block_hashes.len()
                && blocks
                    .iter()
                    .zip(block_hashes)
                    .zip(token_ids.chunks(block_size))
                    .all(|((b, &h), tokens)| {
                        b.block_hash == BlockHash(h) && b.tokens_hash == tokens_hash(tokens)
                    })
        }
        _ => false,
    }
}

/// The blocks each placement holds, as (dp_rank, tier) → hashes.
type View = HashMap<(u32, String), HashSet<u64>>;

/// A reference for what the router must end up believing, computed from the engine
/// events alone: a block is present while its stores outnumber its removes (a remove
/// of an absent block is a no-op), and a clear empties the placement.
fn reference_view(events: &[PlacementEvent]) -> View {
    let mut counts: HashMap<(u32, String), HashMap<u64, u64>> = HashMap::new();
    for ev in events {
        let key = (ev.placement.dp_rank, format!("{:?}", ev.placement.tier));
        match &ev.event.data {
            KvEventData::Stored { blocks, .. } => {
                let held = counts.entry(key).or_default();
                for b in blocks {
                    *held.entry(b.block_hash.0).or_default() += 1;
                }
            }
            KvEventData::Removed { block_hashes } => {
                if let Some(held) = counts.get_mut(&key) {
                    for h in block_hashes {
                        if let Some(n) = held.get_mut(&h.0) {
                            *n -= 1;
                            if *n == 0 {
                                held.remove(&h.0);
                            }
                        }
                    }
                }
            }
            KvEventData::Cleared => {
                counts.remove(&key);
            }
            _ => {}
        }
    }
    counts
        .into_iter()
        .map(|(k, held)| (k, held.into_keys().collect::<HashSet<_>>()))
        .filter(|(_, held)| !held.is_empty())
        .collect()
}

/// What a router applying `out` as sets ends up believing.
fn router_view(out: &[RouterEvent]) -> View {
    let mut view: View = HashMap::new();
    for ev in out {
        let key = (ev.event.dp_rank, format!("{:?}", ev.tier));
        match &ev.event.data {
            KvEventData::Stored { blocks, .. } => {
                view.entry(key)
                    .or_default()
                    .extend(blocks.iter().map(|b| b.block_hash.0));
            }
            KvEventData::Removed { block_hashes } => {
                if let Some(held) = view.get_mut(&key) {
                    for h in block_hashes {
                        held.remove(&h.0);
                    }
                }
            }
            KvEventData::Cleared => {
                view.remove(&key);
            }
            _ => {}
        }
    }
    view.retain(|_, held| !held.is_empty());
    view
}

/// Runs decoded events through a pipeline and checks it against the reference view,
/// its accounting, and the router-event wire format.
fn pipeline_balances(events: Vec<PlacementEvent>) {
    let expected = reference_view(&events);
    let mut pipeline = Pipeline::default();
    let mut out = Vec::new();
    let pushed = events.len() as u64;
    for ev in events {
        pipeline.push(ev, &mut out);
    }
    pipeline.flush(&mut out);
    assert!(!pipeline.has_pending());
    // Coalescing and dedup may change the events, never what the router concludes
    // (unless a dedup cap made it forget, which these inputs are far too small for).
    if pipeline.dedup_resets() == 0 {
        assert_eq!(
            router_view(&out),
            expected,
            "the router would believe otherwise"
        );
    }
    assert_eq!(
        pushed,
        out.len() as u64 + pipeline.merged() + pipeline.deduplicated(),
        "events in != out + merged + deduplicated"
    );
    for (i, ev) in out.iter().enumerate() {
        assert_eq!(ev.event.id, i as u64 + 1, "outbound ids are dense from 1");
    }
    let payload = Dialect::EventPlane.encode_router_events(&out).unwrap();
    assert_eq!(
        Dialect::EventPlane.decode_router_events(&payload).unwrap(),
        out
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let block_size = usize::from(control >> 1 & 15) + 1;
    let mut decoder = EngineDecoder::new(WorkerId(1), block_size).unwrap();
    if control & 1 == 0 {
        // The fast path (batches as engines send them) must agree with the full parse.
        let mut reference = decoder.clone();
        let decoded = decoder.decode_batch(rest);
        // The canary (tools/fuzz.sh --canary): a fast path that loses a batch's last
        // event. The fast-path-equals-full-parse oracle must catch it.
        #[cfg(fuzz_canary)]
        let decoded = decoded.map(|mut e| {
            if e.len() > 1 {
                e.pop();
            }
            e
        });
        assert_eq!(
            decoded,
            reference.decode_batch_parsed(rest),
            "fast path ≠ full parse"
        );
        assert_eq!(decoder.stats(), reference.stats(), "fast path ≠ full parse");
        if let Ok(events) = decoded {
            pipeline_balances(events);
        }
        let _ = Dialect::EventPlane.decode_router_events(rest);
        return;
    }
    let engine = engine_events(rest, block_size);
    let batch = encode_engine_batch(1.5, 3, block_size as u32, &engine).unwrap();
    let decoded = decoder.decode_batch(&batch).unwrap();
    // A store of no block carries nothing and is skipped; a store whose chain repeats a
    // hash (or its parent) is dropped and counted; every other event comes back.
    let self_referencing = |e: &EngineEvent| match e {
        EngineEvent::Stored {
            block_hashes,
            parent_block_hash,
            ..
        } => {
            let mut seen: HashSet<u64> = parent_block_hash.iter().copied().collect();
            !block_hashes.iter().all(|h| seen.insert(*h))
        }
        _ => false,
    };
    let empty_store = |e: &EngineEvent| matches!(e, EngineEvent::Stored { block_hashes, .. } if block_hashes.is_empty());
    let kept: Vec<&EngineEvent> = engine
        .iter()
        .filter(|e| !self_referencing(e) && !empty_store(e))
        .collect();
    assert_eq!(
        decoder.stats().self_referencing,
        engine.iter().filter(|e| self_referencing(e)).count() as u64
    );
    assert_eq!(decoded.len(), kept.len(), "{engine:?} → {decoded:?}");
    assert_eq!(decoder.stats().failed_events, 0);
    for (e, d) in kept.into_iter().zip(&decoded) {
        assert_eq!(d.event.dp_rank, 3);
        assert!(
            same_event(e, &d.event.data, block_size),
            "{e:?} → {:?}",
            d.event.data
        );
    }
    let ids: Vec<u64> = decoded.iter().map(|d| d.event.id).collect();
    assert!(ids.windows(2).all(|w| w[0] + 1 == w[1]), "raw ids {ids:?}");
    pipeline_balances(decoded);
});
