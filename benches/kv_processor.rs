//! Block events per second through Coalescer + DedupFilter + id stamping (the sans-IO
//! `kv::Pipeline`) into a null sink, one core: chained stores, random removes, and a
//! mixed stream. Throughput is in block events (a stored or removed block each).
#![allow(missing_docs, clippy::unwrap_used, clippy::indexing_slicing)]

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, Pipeline, Placement, PlacementEvent, StorageTier, StoredBlock,
    TokensHash, WorkerId,
};

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

/// Removes of random (mostly untracked) hashes.
fn random_removes() -> Vec<PlacementEvent> {
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
    let mut group = c.benchmark_group("kv_pipeline");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(3));
    for (name, input) in [
        ("chained_stores", chained_stores()),
        ("random_removes", random_removes()),
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

criterion_group!(benches, bench);
criterion_main!(benches);
