//! Block events per second through Coalescer + DedupFilter + id stamping (the sans-IO
//! `kv::pipeline::Pipeline`) into a null sink, one core: chained stores, removes of hashes never
//! stored (dedup has nothing to hold back: they pass, coalesced), and a mixed stream whose removes all hit stored
//! blocks. Every iteration starts from a fresh `Pipeline`. Throughput is in block events (a stored or removed block each).
//!
//! Then engine batch decode (`EngineDecoder`) in events per second for both wire
//! shapes (vLLM tagged arrays, tagged maps), and the full path: engine msgpack →
//! decode → pipeline → router-event msgpack, again from a fresh `Pipeline` per
//! iteration, so every remove in it hits a block stored earlier in its batch and is
//! encoded.
//!
//! Then the router side per event-plane message (128 router events of 4 blocks, as the
//! sink cuts them), in our schema and in Dynamo's: payload encode and decode, and for
//! Dynamo the whole message (frames parsed, envelope checked, payload decoded).
#![allow(missing_docs, clippy::unwrap_used, clippy::indexing_slicing)]

#[path = "common/watchdog.rs"]
mod watchdog;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId,
    engine::{EngineDecoder, EngineEvent, encode_engine_batch},
    pipeline::Pipeline,
};
use eventplane::wire::{Dialect, Layout};
use serde::Serialize;

const AT: Placement = Placement {
    worker_id: WorkerId(1),
    dp_rank: 0,
    tier: StorageTier::Device,
};

const EVENTS: usize = 10_000;
const BLOCKS_PER_EVENT: u64 = 4;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn ev(id: u64, data: KvEventData) -> PlacementEvent {
    PlacementEvent {
        placement: AT,
        event: KvEvent {
            id,
            dp_rank: 0,
            data,
        },
    }
}

/// Stores that extend one chain (they coalesce), `BLOCKS_PER_EVENT` blocks each.
fn chained_stores() -> Vec<PlacementEvent> {
    (0..EVENTS as u64)
        .map(|i| {
            let first = i * BLOCKS_PER_EVENT + 1;
            let parent = (i > 0).then(|| BlockHash(first - 1));
            let blocks = (first..first + BLOCKS_PER_EVENT)
                .map(|h| StoredBlock {
                    block_hash: BlockHash(h),
                    tokens_hash: TokensHash(h),
                })
                .collect();
            ev(
                i,
                KvEventData::Stored {
                    parent_hash: parent,
                    blocks,
                },
            )
        })
        .collect()
}

/// Removes of random hashes, none of them stored: dedup passes them (it holds back only
/// removes of blocks still referenced), and they coalesce into few router events.
fn untracked_removes() -> Vec<PlacementEvent> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..EVENTS as u64)
        .map(|i| {
            let hashes = (0..BLOCKS_PER_EVENT)
                .map(|_| BlockHash(xorshift(&mut x) % 50_000))
                .collect();
            ev(
                i,
                KvEventData::Removed {
                    block_hashes: hashes,
                },
            )
        })
        .collect()
}

/// Stores of random short chains, removes of earlier stored blocks, occasional clears.
fn mixed() -> Vec<PlacementEvent> {
    let mut x = 0xD1B5_4A32_D192_ED03u64;
    let mut stored: Vec<u64> = Vec::new();
    (0..EVENTS as u64)
        .map(|i| {
            let r = xorshift(&mut x);
            let data = if r % 100 == 0 {
                stored.clear();
                KvEventData::Cleared
            } else if r % 2 == 0 || stored.len() < 8 {
                let first = xorshift(&mut x) % 1_000_000;
                let blocks: Vec<StoredBlock> = (first..first + BLOCKS_PER_EVENT)
                    .map(|h| StoredBlock {
                        block_hash: BlockHash(h),
                        tokens_hash: TokensHash(h),
                    })
                    .collect();
                stored.extend(first..first + BLOCKS_PER_EVENT);
                KvEventData::Stored {
                    parent_hash: None,
                    blocks,
                }
            } else {
                let hashes = (0..BLOCKS_PER_EVENT)
                    .map(|_| {
                        let k = (xorshift(&mut x) as usize) % stored.len();
                        BlockHash(stored.swap_remove(k))
                    })
                    .collect();
                KvEventData::Removed {
                    block_hashes: hashes,
                }
            };
            ev(i, data)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    watchdog::arm("kv_processor", std::time::Duration::from_secs(2700));
    let mut group = c.benchmark_group("kv_pipeline");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(3));
    // The untracked stream is what its name says: every removed block reaches the
    // router (none was referenced), coalesced into lists of at most 128 blocks.
    let mut pipeline = Pipeline::default();
    let mut out = Vec::new();
    for e in untracked_removes() {
        pipeline.push(e, &mut out);
    }
    pipeline.flush(&mut out);
    let blocks: usize = out.iter().map(|e| e.event.data.block_count()).sum();
    assert_eq!(blocks, EVENTS * BLOCKS_PER_EVENT as usize);
    assert_eq!(pipeline.deduplicated(), 0);
    for (name, input) in [
        ("chained_stores", chained_stores()),
        ("untracked_removes", untracked_removes()),
        ("mixed", mixed()),
    ] {
        let blocks: u64 = input
            .iter()
            .map(|e| e.event.data.block_count() as u64)
            .sum();
        group.throughput(Throughput::Elements(blocks.max(1)));
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let mut out = Vec::with_capacity(EVENTS);
            b.iter_batched(
                || input.clone(),
                |events| {
                    let mut pipeline = Pipeline::default();
                    // Lists of 16 engine events, flushed at each boundary.
                    for (i, e) in events.into_iter().enumerate() {
                        pipeline.push(e, &mut out);
                        if i % 16 == 15 {
                            pipeline.flush(&mut out);
                            out.clear();
                        }
                    }
                    pipeline.flush(&mut out);
                    out.clear();
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

/// Engine events per batch and tokens per block in the decode benchmarks.
const BATCH_EVENTS: usize = 64;
const BLOCK_TOKENS: usize = 16;

/// A generated engine event: `(is_store, hashes, parent, tokens)`.
type GenEvent = (bool, Vec<u64>, Option<u64>, Vec<u32>);

/// vLLM ≥ 0.24 / SGLang events: tagged maps.
#[derive(Serialize)]
#[serde(untagged)]
enum MapEvent {
    Stored {
        #[serde(rename = "type")]
        kind: &'static str,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        medium: &'static str,
    },
    Removed {
        #[serde(rename = "type")]
        kind: &'static str,
        block_hashes: Vec<u64>,
        medium: &'static str,
    },
}

/// 3 of 4 events store a chain of 1–4 blocks, 1 of 4 removes 2 blocks.
fn engine_events(seed: u64) -> Vec<GenEvent> {
    let mut x = seed | 1;
    let mut next_hash = seed * 1_000_000;
    (0..BATCH_EVENTS)
        .map(|i| {
            if i % 4 == 3 {
                (false, vec![next_hash - 1, next_hash - 2], None, vec![])
            } else {
                let n = 1 + (xorshift(&mut x) % 4) as usize;
                let parent = (next_hash > seed * 1_000_000).then(|| next_hash - 1);
                let hashes: Vec<u64> = (0..n as u64).map(|k| next_hash + k).collect();
                next_hash += n as u64;
                let tokens = (0..(n * BLOCK_TOKENS) as u32).collect();
                (true, hashes, parent, tokens)
            }
        })
        .collect()
}

fn array_batch(seed: u64) -> Vec<u8> {
    let events: Vec<EngineEvent> = engine_events(seed)
        .into_iter()
        .map(|(stored, hashes, parent, tokens)| {
            if stored {
                EngineEvent::Stored {
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids: tokens,
                    medium: Some("GPU".into()),
                }
            } else {
                EngineEvent::Removed {
                    block_hashes: hashes,
                    medium: Some("GPU".into()),
                }
            }
        })
        .collect();
    encode_engine_batch(1.5, 0, BLOCK_TOKENS as u32, &events).unwrap()
}

fn map_batch(seed: u64) -> Vec<u8> {
    let events: Vec<MapEvent> = engine_events(seed)
        .into_iter()
        .map(|(stored, hashes, parent, tokens)| {
            if stored {
                MapEvent::Stored {
                    kind: "BlockStored",
                    block_hashes: hashes,
                    parent_block_hash: parent,
                    token_ids: tokens,
                    block_size: BLOCK_TOKENS as u32,
                    lora_id: None,
                    medium: "GPU",
                }
            } else {
                MapEvent::Removed {
                    kind: "BlockRemoved",
                    block_hashes: hashes,
                    medium: "GPU",
                }
            }
        })
        .collect();
    rmp_serde::to_vec_named(&(1.5f64, events, 0u32)).unwrap()
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_engine");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Elements(BATCH_EVENTS as u64 * 16));
    for (shape, make) in [
        ("arrays", array_batch as fn(u64) -> Vec<u8>),
        ("maps", map_batch),
    ] {
        let batches: Vec<Vec<u8>> = (1..=16).map(make).collect();
        let mut decoder = EngineDecoder::new(WorkerId(1), BLOCK_TOKENS).unwrap();
        assert_eq!(
            decoder.decode_batch(&batches[0]).unwrap().len(),
            BATCH_EVENTS
        );
        group.bench_function(BenchmarkId::new("decode", shape), |b| {
            b.iter(|| {
                for batch in &batches {
                    std::hint::black_box(decoder.decode_batch(batch).unwrap());
                }
            })
        });
        // A fresh pipeline per iteration: with one kept across iterations, every
        // store after the first pass would only bump a refcount and every remove would
        // be deduplicated away, never encoded.
        let removed_blocks = |pipeline: &mut Pipeline| {
            let mut out = Vec::new();
            let mut removed = 0;
            for batch in &batches {
                for ev in EngineDecoder::new(WorkerId(1), BLOCK_TOKENS)
                    .unwrap()
                    .decode_batch(batch)
                    .unwrap()
                {
                    pipeline.push(ev, &mut out);
                }
                pipeline.flush(&mut out);
                for e in out.drain(..) {
                    if let KvEventData::Removed { block_hashes } = e.event.data {
                        removed += block_hashes.len();
                    }
                }
            }
            removed
        };
        // Every engine remove (2 blocks, 1 event in 4) reaches the router and is encoded.
        let expected = 16 * (BATCH_EVENTS / 4) * 2;
        assert_eq!(removed_blocks(&mut Pipeline::default()), expected);
        group.bench_function(BenchmarkId::new("full_path", shape), |b| {
            let mut out = Vec::new();
            b.iter_batched_ref(
                Pipeline::default,
                |pipeline| {
                    for batch in &batches {
                        for ev in decoder.decode_batch(batch).unwrap() {
                            pipeline.push(ev, &mut out);
                        }
                        pipeline.flush(&mut out);
                        std::hint::black_box(
                            Dialect::EventPlane.encode_router_events(&out).unwrap(),
                        );
                        out.clear();
                    }
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// One event-plane message as the sink cuts it: 128 router events, stores of 4 blocks
/// chained on a parent and removes of 4 blocks, alternating.
fn router_message() -> Vec<RouterEvent> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..128u64)
        .map(|i| {
            let hashes: Vec<BlockHash> = (0..4).map(|_| BlockHash(xorshift(&mut x))).collect();
            let data = if i % 2 == 0 {
                KvEventData::Stored {
                    parent_hash: Some(BlockHash(xorshift(&mut x))),
                    blocks: hashes
                        .into_iter()
                        .map(|h| StoredBlock {
                            block_hash: h,
                            tokens_hash: TokensHash(h.0.rotate_left(17)),
                        })
                        .collect(),
                }
            } else {
                KvEventData::Removed {
                    block_hashes: hashes,
                }
            };
            RouterEvent {
                worker_id: WorkerId(77),
                tier: StorageTier::Device,
                event: KvEvent {
                    id: i + 1,
                    dp_rank: 0,
                    data,
                },
            }
        })
        .collect()
}

fn router_wire(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_router_wire");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(3));
    let events = router_message();
    group.throughput(Throughput::Elements(events.len() as u64));
    let ours = Dialect::EventPlane.encode_router_events(&events).unwrap();
    let dynamo = Dialect::Dynamo.encode_router_events(&events).unwrap();
    assert_eq!(
        Dialect::EventPlane.decode_router_events(&ours).unwrap(),
        events
    );
    assert_eq!(
        Dialect::Dynamo.decode_router_events(&dynamo).unwrap(),
        events
    );
    let topic = bytes::Bytes::from_static(b"kv-events");
    let message = Dialect::Dynamo.encode(&topic, 42, 1, bytes::Bytes::from(dynamo.clone()));
    group.bench_function(BenchmarkId::new("encode", "eventplane"), |b| {
        b.iter(|| std::hint::black_box(Dialect::EventPlane.encode_router_events(&events).unwrap()))
    });
    group.bench_function(BenchmarkId::new("encode", "dynamo"), |b| {
        b.iter(|| {
            let payload = Dialect::Dynamo.encode_router_events(&events).unwrap();
            std::hint::black_box(Dialect::Dynamo.encode(&topic, 42, 1, bytes::Bytes::from(payload)))
        })
    });
    group.bench_function(BenchmarkId::new("decode", "eventplane"), |b| {
        b.iter(|| std::hint::black_box(Dialect::EventPlane.decode_router_events(&ours).unwrap()))
    });
    group.bench_function(BenchmarkId::new("decode", "dynamo"), |b| {
        b.iter(|| {
            let framed = Layout::Dynamo.parse(Some(b"kv-events"), &message).unwrap();
            std::hint::black_box(
                Dialect::Dynamo
                    .decode_router_events(&framed.payload.unwrap())
                    .unwrap(),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench, decode, router_wire);
criterion_main!(benches);
