//! eventplane's `kv::router::RouterIndex` and Dynamo 1.6.1's `RadixTree` (crate
//! `dynamo-kv-router`), one thread each in turn, on the same synthetic Mooncake-shaped
//! trace (`../router_index_trace.rs`, shared with `benches/router_index.rs`).
//!
//! For each index: heap bytes per indexed block (what a counting global allocator saw
//! the index keep once the whole trace was applied, the events themselves built and
//! dropped inside the window); apply throughput over the whole trace into a fresh
//! index (best of `--rounds`, default 3); the time in stores and in removes (each event
//! timed on its own, one more round); `find_matches` throughput over the sampled
//! prompts against the loaded index (best of `--rounds` passes). Timed rounds
//! alternate between the two indexes. Then both answer the same `--check` queries
//! (default 1,000) and must return the same scores, equal to what the trace's
//! simulation gives.
//!
//! ```text
//! cargo run --release --manifest-path benches/vs-dynamo-index/Cargo.toml
//! cargo run --release --manifest-path benches/vs-dynamo-index/Cargo.toml -- --tiny
//! ```
//! `ROUTER_INDEX_WORKERS`, `ROUTER_INDEX_CAPACITY`, `ROUTER_INDEX_REQUESTS` change the
//! trace's size.

#[path = "../../router_index_trace.rs"]
mod trace;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent as DynamoEvent,
};
use eventplane::kv::{KvEventData, RouterEvent, TokensHash, router::RouterIndex};
use trace::{Trace, TraceConfig};

/// Counts heap bytes while `COUNTING` is set (a relaxed load otherwise, so the timed
/// rounds run with it off).
struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static HEAP: AtomicIsize = AtomicIsize::new(0);

fn count(delta: isize) {
    if COUNTING.load(Ordering::Relaxed) {
        HEAP.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` with the caller's arguments.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Heap bytes `f` leaves allocated, and what it returns.
fn heap_kept<T>(f: impl FnOnce() -> T) -> (T, isize) {
    HEAP.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let out = f();
    COUNTING.store(false, Ordering::Relaxed);
    (out, HEAP.load(Ordering::Relaxed))
}

/// The trace's ops as Dynamo router events.
fn dynamo_events(trace: &Trace) -> Vec<DynamoEvent> {
    trace
        .ops
        .iter()
        .enumerate()
        .map(|(id, op)| {
            let blocks = &trace.blocks[op.start..op.end];
            let data = if op.store {
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: op.parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|&(b, t)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(b),
                            tokens_hash: LocalBlockHash(t),
                            mm_extra_info: None,
                        })
                        .collect(),
                })
            } else {
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: blocks
                        .iter()
                        .map(|&(b, _)| ExternalSequenceBlockHash(b))
                        .collect(),
                })
            };
            DynamoEvent::new(
                trace::worker_id(op.worker),
                KvCacheEvent {
                    event_id: id as u64 + 1,
                    data,
                    dp_rank: 0,
                },
            )
        })
        .collect()
}

fn dynamo_queries(trace: &Trace) -> Vec<Vec<LocalBlockHash>> {
    trace
        .queries
        .iter()
        .map(|q| q.tokens.iter().map(|&t| LocalBlockHash(t)).collect())
        .collect()
}

/// One index behind the operations the comparison needs.
trait Index: Sized {
    type Event;
    const NAME: &'static str;
    fn new() -> Self;
    fn events(trace: &Trace) -> Vec<Self::Event>;
    fn is_store(event: &Self::Event) -> bool;
    /// Applies one event (consumed), which must be accepted.
    fn apply(&mut self, event: Self::Event);
    /// Held blocks, one per (worker, rank) holding one.
    fn blocks(&self) -> usize;
    /// Query, prepared as the index takes it.
    type Query: Clone;
    fn queries(trace: &Trace) -> Vec<Self::Query>;
    /// `(worker id, score)` of every worker scoring, by worker id.
    fn scores(&self, query: Self::Query) -> Vec<(u64, u32)>;
    /// The query, answer dropped.
    fn find(&self, query: Self::Query);
}

impl Index for RouterIndex {
    type Event = RouterEvent;
    const NAME: &'static str = "eventplane RouterIndex";
    fn new() -> Self {
        RouterIndex::default()
    }
    fn events(trace: &Trace) -> Vec<RouterEvent> {
        trace.router_events()
    }
    fn is_store(event: &RouterEvent) -> bool {
        matches!(event.event.data, KvEventData::Stored { .. })
    }
    fn apply(&mut self, event: RouterEvent) {
        if let Err(e) = RouterIndex::apply(self, Some(event.worker_id), &event) {
            panic!("eventplane refused event {}: {e}", event.event.id);
        }
    }
    fn blocks(&self) -> usize {
        self.stats().blocks as usize
    }
    type Query = Vec<TokensHash>;
    fn queries(trace: &Trace) -> Vec<Vec<TokensHash>> {
        trace.query_hashes()
    }
    fn scores(&self, query: Vec<TokensHash>) -> Vec<(u64, u32)> {
        self.find_matches(&query)
            .iter()
            .map(|s| (s.worker_id.0, s.blocks))
            .collect()
    }
    fn find(&self, query: Vec<TokensHash>) {
        std::hint::black_box(self.find_matches(&query));
    }
}

impl Index for RadixTree {
    type Event = DynamoEvent;
    const NAME: &'static str = "Dynamo 1.6.1 RadixTree";
    fn new() -> Self {
        RadixTree::new()
    }
    fn events(trace: &Trace) -> Vec<DynamoEvent> {
        dynamo_events(trace)
    }
    fn is_store(event: &DynamoEvent) -> bool {
        matches!(event.event.data, KvCacheEventData::Stored(_))
    }
    fn apply(&mut self, event: DynamoEvent) {
        let id = event.event.event_id;
        if let Err(e) = self.apply_event(event) {
            panic!("Dynamo refused event {id}: {e:?}");
        }
    }
    fn blocks(&self) -> usize {
        self.current_size()
    }
    type Query = Vec<LocalBlockHash>;
    fn queries(trace: &Trace) -> Vec<Vec<LocalBlockHash>> {
        dynamo_queries(trace)
    }
    fn scores(&self, query: Vec<LocalBlockHash>) -> Vec<(u64, u32)> {
        let mut scores: Vec<(u64, u32)> = self
            .find_matches(query, false)
            .scores
            .into_iter()
            .filter(|&(_, s)| s > 0)
            .map(|(w, s)| {
                assert_eq!(w.dp_rank, 0);
                (w.worker_id, s)
            })
            .collect();
        scores.sort_unstable();
        scores
    }
    fn find(&self, query: Vec<LocalBlockHash>) {
        std::hint::black_box(self.find_matches(query, false));
    }
}

/// What was measured of one index.
struct Figures {
    name: &'static str,
    load: Duration,
    store: Duration,
    remove: Duration,
    find: Duration,
    heap: isize,
    blocks: usize,
}

impl Figures {
    fn new(name: &'static str) -> Figures {
        Figures {
            name,
            load: Duration::MAX,
            store: Duration::ZERO,
            remove: Duration::ZERO,
            find: Duration::MAX,
            heap: 0,
            blocks: 0,
        }
    }
}

/// Index `I` with the whole trace applied, and the heap it kept: everything
/// allocated in the window, events included, less what was freed in it (the events,
/// dropped at its end).
fn load<I: Index>(trace: &Trace, figures: &mut Figures) -> I {
    let (index, heap) = heap_kept(|| {
        let events = I::events(trace);
        let mut index = I::new();
        for e in events {
            index.apply(e);
        }
        index
    });
    figures.heap = heap;
    figures.blocks = index.blocks();
    assert_eq!(
        figures.blocks,
        trace.held_blocks(),
        "{}: blocks held",
        I::NAME
    );
    eprintln!(
        "{}: heap kept after the trace: {:.1} MiB for {} blocks ({:.1} B/block)",
        I::NAME,
        heap as f64 / 1048576.0,
        figures.blocks,
        heap as f64 / figures.blocks as f64
    );
    index
}

/// One whole load into a fresh index, timed (events built before, the index dropped
/// after).
fn time_load<I: Index>(trace: &Trace, figures: &mut Figures) {
    let events = I::events(trace);
    let mut fresh = I::new();
    let started = Instant::now();
    for e in events {
        fresh.apply(e);
    }
    let took = started.elapsed();
    eprintln!("{}: apply: {:.3} s", I::NAME, took.as_secs_f64());
    figures.load = figures.load.min(took);
}

/// Stores and removes apart: each event timed on its own.
fn time_kinds<I: Index>(trace: &Trace, figures: &mut Figures) {
    let events = I::events(trace);
    let mut fresh = I::new();
    for e in events {
        let is_store = I::is_store(&e);
        let started = Instant::now();
        fresh.apply(e);
        let took = started.elapsed();
        if is_store {
            figures.store += took;
        } else {
            figures.remove += took;
        }
    }
}

/// One pass of every query (prepared before) against the loaded index.
fn time_find<I: Index>(trace: &Trace, index: &I, figures: &mut Figures) {
    let queries = I::queries(trace);
    let started = Instant::now();
    for q in queries {
        index.find(q);
    }
    let took = started.elapsed();
    eprintln!(
        "{}: find_matches: {:.3} s for {} queries",
        I::NAME,
        took.as_secs_f64(),
        trace.queries.len()
    );
    figures.find = figures.find.min(took);
}

/// The 1-minute load average (other processes share the cores and the cache).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut tiny = false;
    let mut rounds = 3;
    let mut check = 1_000;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--tiny" => tiny = true,
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--rounds N")
            }
            "--check" => check = args.next().and_then(|v| v.parse().ok()).expect("--check N"),
            _ => panic!("usage: vs-dynamo-index [--tiny] [--rounds N] [--check N]"),
        }
    }
    let started = Instant::now();
    let trace = Trace::generate(TraceConfig::from_env(tiny));
    eprintln!(
        "trace: {} (generated in {:.1} s)",
        trace.describe(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("load average before: {}", loadavg());
    let mut ours = Figures::new(<RouterIndex as Index>::NAME);
    let mut theirs = Figures::new(<RadixTree as Index>::NAME);
    let eventplane: RouterIndex = load(&trace, &mut ours);
    let dynamo: RadixTree = load(&trace, &mut theirs);
    // Rounds alternate between the two, so that a noisy neighbour hits both alike.
    for _ in 0..rounds {
        time_load::<RouterIndex>(&trace, &mut ours);
        time_load::<RadixTree>(&trace, &mut theirs);
    }
    time_kinds::<RouterIndex>(&trace, &mut ours);
    time_kinds::<RadixTree>(&trace, &mut theirs);
    for _ in 0..rounds {
        time_find(&trace, &eventplane, &mut ours);
        time_find(&trace, &dynamo, &mut theirs);
    }
    eprintln!("load average after: {}", loadavg());
    eprintln!(
        "eventplane: bytes() says {:.1} B/block",
        eventplane.bytes() as f64 / ours.blocks as f64
    );

    // Same scores, and the simulation's.
    let check = check.min(trace.queries.len());
    let ep_queries = <RouterIndex as Index>::queries(&trace);
    let dy_queries = <RadixTree as Index>::queries(&trace);
    let mut scored = 0;
    for q in 0..check {
        let expected = trace.expected(q);
        let ep = Index::scores(&eventplane, ep_queries[q].clone());
        let dy = Index::scores(&dynamo, dy_queries[q].clone());
        assert_eq!(ep, dy, "query {q}: eventplane and Dynamo differ");
        assert_eq!(ep, expected, "query {q}: both differ from the simulation");
        scored += ep.len();
    }
    assert!(scored > 0, "no query scored");

    let events = trace.ops.len() as f64;
    let moved = (trace.stored_blocks + trace.removed_blocks) as f64;
    let queries = trace.queries.len() as f64;
    println!(
        "\n{} events ({} stores of {} blocks, {} removes of {} blocks), {} queries, one \
         thread; {check} queries' scores equal in both (and to the simulation's)\n",
        trace.ops.len(),
        trace.store_ops,
        trace.stored_blocks,
        trace.remove_ops,
        trace.removed_blocks,
        trace.queries.len()
    );
    println!(
        "| index | apply events/s | apply blocks/s | stores/s | removes/s | find_matches/s | \
         heap B/block |"
    );
    println!("|---|---|---|---|---|---|---|");
    for f in [&ours, &theirs] {
        println!(
            "| {} | {:.2} M | {:.1} M | {:.2} M | {:.2} M | {:.0} k | {:.1} |",
            f.name,
            events / f.load.as_secs_f64() / 1e6,
            moved / f.load.as_secs_f64() / 1e6,
            trace.store_ops as f64 / f.store.as_secs_f64() / 1e6,
            trace.remove_ops as f64 / f.remove.as_secs_f64() / 1e6,
            queries / f.find.as_secs_f64() / 1e3,
            f.heap as f64 / f.blocks as f64,
        );
    }
    println!(
        "\neventplane / Dynamo: apply ×{:.2}, find_matches ×{:.2}, heap per block ×{:.2}",
        theirs.load.as_secs_f64() / ours.load.as_secs_f64(),
        theirs.find.as_secs_f64() / ours.find.as_secs_f64(),
        ours.heap as f64 / theirs.heap as f64,
    );
    // Dropped in the same order each run; Dynamo's tree drops iteratively.
    drop(dynamo);
    drop(eventplane);
}
