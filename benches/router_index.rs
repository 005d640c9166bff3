//! `kv::router::RouterIndex` on a Mooncake-shaped trace (`router_index_trace.rs`): 256 workers
//! of 20,000 blocks each, requests from 300 system prompts of 20–200 blocks (Zipf
//! popularity) and their multi-turn sessions, up to 400 blocks a prompt; every worker
//! stores what it lacks of a prompt (chunks of 64 blocks, then one event per output
//! block) and evicts its least recently used leaf blocks past its capacity.
//!
//! Reported, as `router_index: …` lines, from one load of the whole trace into a
//! fresh index:
//! - memory per indexed block (one per worker holding one): `RouterIndex::bytes()`
//!   over `stats().blocks`, and the process's RSS growth and peak RSS growth (VmHWM,
//!   reset first) over the load;
//! - the time in `Stored` and in `Removed` events (each event timed on its own), and
//!   the index's largest size on the way;
//!
//! and checked: every event applies (no refusal), the index holds exactly the blocks
//! the simulated engines hold at the end, and `find_matches` returns exactly the
//! overlap scores the simulation gives (1,000 queries; all of them in test mode).
//!
//! Then criterion: `router_index/apply/trace` (the whole trace into a fresh index,
//! throughput in events) and `router_index/find_matches/prompts` (one query each, the
//! sampled prompts in turn against the loaded index, throughput in queries).
//!
//! In criterion's test mode (`-- --test`, as `.ci/run` runs every bench) the trace is
//! tiny (16 workers of 1,000 blocks, 3,000 requests; evictions included) and every
//! check still runs. `ROUTER_INDEX_WORKERS`, `ROUTER_INDEX_CAPACITY` and
//! `ROUTER_INDEX_REQUESTS` change the trace's size. The same trace through Dynamo
//! 1.6.1's `RadixTree`, side by side: `benches/vs-dynamo-index/`.
//!
//! ```text
//! cargo bench -p eventplane-benches --bench router_index
//! ```
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "common/procfs.rs"]
mod procfs;

#[path = "common/watchdog.rs"]
mod watchdog;

#[path = "router_index_trace.rs"]
mod trace;

use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::kv::{KvEventData, RouterEvent, router::RouterIndex};
use procfs::status_kib;
use trace::{Trace, TraceConfig};

/// Queries whose scores are checked against the simulation (all of them in test mode).
const CHECKED_QUERIES: usize = 1_000;

fn apply_all(index: &mut RouterIndex, events: &[RouterEvent]) {
    for e in events {
        if let Err(refusal) = index.apply(Some(e.worker_id), e) {
            panic!("event {} refused: {refusal}", e.event.id);
        }
    }
}

fn bench(c: &mut Criterion) {
    watchdog::arm("router_index", Duration::from_secs(2700));
    let test_mode = std::env::args().any(|a| a == "--test");
    let started = Instant::now();
    let trace = Trace::generate(TraceConfig::from_env(test_mode));
    eprintln!(
        "router_index: trace: {} (generated in {:.1} s)",
        trace.describe(),
        started.elapsed().as_secs_f64()
    );
    let events = trace.router_events();
    let queries = trace.query_hashes();

    // One load, for memory: the peak is reset first (VmHWM, by clear_refs 5).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let rss_before = status_kib("self", "VmRSS:");
    let started = Instant::now();
    let mut index = RouterIndex::default();
    apply_all(&mut index, &events);
    let load = started.elapsed();
    let (rss_after, peak) = (status_kib("self", "VmRSS:"), status_kib("self", "VmHWM:"));
    let stats = index.stats();
    assert_eq!(stats.blocks as usize, trace.held_blocks());
    assert_eq!(stats.nodes as usize, trace.distinct_blocks());
    assert_eq!(stats.stored_blocks as usize, trace.stored_blocks);
    assert_eq!(stats.removed_blocks as usize, trace.removed_blocks);
    assert!(trace.removed_blocks > 0, "the trace must evict");
    assert_eq!(
        (stats.duplicate_blocks, stats.unknown_removed_blocks),
        (0, 0)
    );
    let blocks = stats.blocks as f64;
    eprintln!(
        "router_index: loaded {} events in {:.2} s ({:.2} M events/s, {:.1} M blocks/s); \
         {} blocks held ({} distinct, {} ranks): bytes() {:.1} MiB = {:.1} B/block \
         ({:.1} B/distinct block); RSS +{:.1} MiB = {:.1} B/block, peak RSS +{:.1} MiB",
        events.len(),
        load.as_secs_f64(),
        events.len() as f64 / load.as_secs_f64() / 1e6,
        (trace.stored_blocks + trace.removed_blocks) as f64 / load.as_secs_f64() / 1e6,
        stats.blocks,
        stats.nodes,
        stats.ranks,
        stats.bytes as f64 / 1048576.0,
        stats.bytes as f64 / blocks,
        stats.bytes as f64 / stats.nodes as f64,
        rss_after.saturating_sub(rss_before) as f64 / 1024.0,
        rss_after.saturating_sub(rss_before) as f64 * 1024.0 / blocks,
        peak.saturating_sub(rss_before) as f64 / 1024.0,
    );

    // The scores, against the simulation's.
    let checked = if test_mode {
        queries.len()
    } else {
        CHECKED_QUERIES.min(queries.len())
    };
    let mut scored = 0;
    let mut full_hits = 0;
    for (q, query) in queries
        .iter()
        .enumerate()
        .step_by((queries.len() / checked.max(1)).max(1))
        .take(checked)
    {
        let got: Vec<(u64, u32)> = index
            .find_matches(query)
            .iter()
            .map(|s| (s.worker_id.0, s.blocks))
            .collect();
        let expected = trace.expected(q);
        assert_eq!(
            got, expected,
            "query {q}: scores differ from the simulation's"
        );
        scored += got.len();
        full_hits += usize::from(got.iter().any(|s| s.1 as usize == query.len()));
    }
    assert!(scored > 0 && full_hits > 0, "no query scored");
    let mean_matches: f64 = queries
        .iter()
        .map(|q| index.find_matches(q).len())
        .sum::<usize>() as f64
        / queries.len() as f64;
    eprintln!(
        "router_index: {checked} queries' scores equal to the simulation's ({full_hits} held \
         whole by some worker); {mean_matches:.1} ranks scored per query on average"
    );

    // Stores and removes apart: each event timed on its own (two clock reads each);
    // and the index's largest size on the way (its tables keep the room they grew to).
    let mut fresh = RouterIndex::default();
    let (mut store, mut remove) = (Duration::ZERO, Duration::ZERO);
    let (mut peak_nodes, mut peak_bytes) = (0, 0);
    for e in &events {
        let t = Instant::now();
        fresh.apply(Some(e.worker_id), e).unwrap();
        let dt = t.elapsed();
        match e.event.data {
            KvEventData::Stored { .. } => store += dt,
            _ => remove += dt,
        }
        let s = fresh.stats();
        peak_nodes = peak_nodes.max(s.nodes);
        peak_bytes = peak_bytes.max(s.bytes);
    }
    drop(fresh);
    eprintln!(
        "router_index: at most {peak_nodes} distinct blocks and {:.1} MiB on the way \
         ({} and {:.1} MiB at the end)",
        peak_bytes as f64 / 1048576.0,
        stats.nodes,
        stats.bytes as f64 / 1048576.0,
    );
    eprintln!(
        "router_index: stores: {} events of {} blocks in {:.2} s ({:.2} M events/s, {:.1} M \
         blocks/s); removes: {} events of {} blocks in {:.2} s ({:.2} M events/s, {:.1} M \
         blocks/s)",
        trace.store_ops,
        trace.stored_blocks,
        store.as_secs_f64(),
        trace.store_ops as f64 / store.as_secs_f64() / 1e6,
        trace.stored_blocks as f64 / store.as_secs_f64() / 1e6,
        trace.remove_ops,
        trace.removed_blocks,
        remove.as_secs_f64(),
        trace.remove_ops as f64 / remove.as_secs_f64() / 1e6,
        trace.removed_blocks as f64 / remove.as_secs_f64() / 1e6,
    );

    let mut group = c.benchmark_group("router_index");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5).max(load * 12));
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function(BenchmarkId::new("apply", "trace"), |b| {
        b.iter_batched(
            RouterIndex::default,
            |mut index| {
                apply_all(&mut index, &events);
                // Dropped outside the measurement.
                index
            },
            BatchSize::PerIteration,
        )
    });
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    group.bench_function(BenchmarkId::new("find_matches", "prompts"), |b| {
        let mut next = 0;
        b.iter(|| {
            let query = &queries[next];
            next = (next + 1) % queries.len();
            std::hint::black_box(index.find_matches(query))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
