//! Dynamo's wire with oracles. The first byte picks the mode:
//! - even: the rest is raw bytes, read as a Dynamo event frame (frame 3 of a message
//!   whose frames 0–2 agree with what the envelope claims, then with a sequence that
//!   does not) and as a Dynamo router-event payload. Nothing may panic; a frame that
//!   parses must parse the same inside a message, and must be refused (identity) when
//!   frame 2 disagrees; a payload that decodes must survive its own encoder.
//! - odd: the rest describes router events (see `router_events`), which are encoded in
//!   Dynamo's schema, framed, parsed and decoded back: they must come back equal, and
//!   every truncation of the frame must be refused by its length.
#![no_main]

use bytes::Bytes;
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
};
use eventplane::wire::{Dialect, Layout, WireError, parse_dynamo_frame};
use eventplane::zmtp::Message;
use libfuzzer_sys::fuzz_target;

/// Router events from `bytes`: per event a tag byte (kind, tier, dp rank) and, for
/// stored and removed, a block count (0–7) and 2 bytes per block hash.
fn router_events(bytes: &[u8]) -> Vec<RouterEvent> {
    let mut out = Vec::new();
    let mut rest = bytes;
    let tiers = [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ];
    while let Some((&tag, tail)) = rest.split_first() {
        rest = tail;
        let data = if tag % 3 == 0 {
            KvEventData::Cleared
        } else {
            let Some((&count, tail)) = rest.split_first() else {
                break;
            };
            let count = usize::from(count % 8);
            if tail.len() < 2 * count {
                break;
            }
            let (hashes, tail) = tail.split_at(2 * count);
            rest = tail;
            let hashes: Vec<u64> = hashes
                .chunks_exact(2)
                .map(|c| u64::from(u16::from_le_bytes([c[0], c[1]])) << (tag % 64))
                .collect();
            if tag % 3 == 1 {
                KvEventData::Stored {
                    parent_hash: (tag & 0x80 != 0).then_some(BlockHash(u64::from(tag))),
                    blocks: hashes
                        .iter()
                        .map(|&h| StoredBlock {
                            block_hash: BlockHash(h),
                            tokens_hash: TokensHash(!h),
                        })
                        .collect(),
                }
            } else {
                KvEventData::Removed {
                    block_hashes: hashes.into_iter().map(BlockHash).collect(),
                }
            }
        };
        out.push(RouterEvent {
            worker_id: WorkerId(u64::from(tag) * 0x0101_0101_0101),
            tier: tiers[usize::from(tag >> 6)],
            event: KvEvent {
                id: out.len() as u64 + 1,
                dp_rank: u32::from(tag >> 4),
                data,
            },
        });
    }
    out
}

fn message(topic: &[u8], id: u64, seq: u64, frame: &[u8]) -> Message {
    Message::from_parts([
        Bytes::copy_from_slice(topic),
        Bytes::copy_from_slice(&id.to_be_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(frame),
    ])
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Ok(envelope) = parse_dynamo_frame(rest) {
            let m = message(
                envelope.topic.as_bytes(),
                envelope.publisher_id,
                envelope.sequence,
                rest,
            );
            let framed = Layout::Dynamo
                .parse(None, &m)
                .expect("a parsed frame parses in its message");
            assert_eq!(framed.payload.as_deref(), Some(envelope.payload));
            let lying = message(
                envelope.topic.as_bytes(),
                envelope.publisher_id,
                envelope.sequence ^ 1,
                rest,
            );
            assert_eq!(
                Layout::Dynamo.parse(None, &lying).unwrap_err(),
                WireError::Identity("sequence")
            );
        }
        if let Ok(events) = Dialect::Dynamo.decode_router_events(rest) {
            let again = Dialect::Dynamo
                .encode_router_events(&events)
                .expect("decoded events encode");
            assert_eq!(
                Dialect::Dynamo
                    .decode_router_events(&again)
                    .expect("our encoding decodes"),
                events
            );
        }
        return;
    }
    let events = router_events(rest);
    let payload = Dialect::Dynamo
        .encode_router_events(&events)
        .expect("events encode");
    #[allow(unused_mut)]
    let mut decoded = Dialect::Dynamo
        .decode_router_events(&payload)
        .expect("our payload decodes");
    // The canary (tools/fuzz.sh --canary): a decoder that loses the last event of
    // a payload. The round-trip oracle must catch it.
    #[cfg(fuzz_canary)]
    if decoded.len() > 1 {
        decoded.pop();
    }
    assert_eq!(decoded, events);
    let m = Dialect::Dynamo.encode(
        &Bytes::from_static(b"kv-events"),
        42,
        u64::from(mode),
        Bytes::from(payload.clone()),
    );
    let framed = Layout::Dynamo
        .parse(Some(b"kv-events"), &m)
        .expect("our message parses");
    assert_eq!(framed.payload.as_deref(), Some(&payload[..]));
    let frame = m.get(3).expect("four frames");
    let cut = usize::from(mode) * 7 % frame.len();
    match parse_dynamo_frame(&frame[..cut]) {
        Err(WireError::Header { .. }) => assert!(cut < 5),
        Err(WireError::Length { .. }) => {}
        other => panic!("a frame cut at {cut} of {} parsed: {other:?}", frame.len()),
    }
});
