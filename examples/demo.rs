//! `demo`: the event plane end to end, in one process, with embedded defaults only.
//!
//! ```text
//! cargo run --release --example demo -- [--engines N] [--seconds S] [--rate EVENTS_PER_SEC]
//! ```
//! - N simulated inference engines publish real msgpack KV event batches (vLLM's
//!   tagged-array layout, with prefixes shared across engines) on ZMQ PUB sockets.
//! - Each engine has a worker pipeline: `EngineListener → Processor → EventPlaneSink →
//!   EventPublisher`, registered in a `MemoryDiscovery`.
//! - A router `DynamicSubscriber` discovers every worker's publisher, merges their
//!   streams, and decodes the router events into a small block index.
//! - Halfway through, one engine leaves and a new one joins: discovery-driven fan-in.
//!
//! Prints a progress line every second and a final table; exits 0.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
use eventplane::kv::{
    BlockHash, EngineEvent, EngineListener, EngineListenerConfig, EngineListenerHandle,
    EventPlaneSink, KvEventData, Processor, ProcessorConfig, ProcessorHandle, StorageTier,
    WorkerId, decode_router_events, encode_engine_batch,
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "Simulated engines → KV pipelines → event plane → router index")]
struct Args {
    /// Simulated engines (one worker pipeline each).
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// How long to run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Engine events per second, across all engines.
    #[arg(long, default_value_t = 40_000)]
    rate: u64,
}

const BLOCK_SIZE: usize = 16;
const ENGINE_TOPIC: &str = "kv";
const NAMESPACE: &str = "demo";
const PREFIXES: u64 = 256;
const EVENTS_PER_BATCH: usize = 32;
const ENGINE_CAPACITY_BLOCKS: usize = 4096;

/// A block hash shared by every engine that caches the same prompt prefix.
fn prefix_hash(prefix: u64, depth: u64) -> u64 {
    (prefix << 20 | depth).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// One simulated engine: its ZMQ PUB, and its worker pipeline.
struct Engine {
    id: u64,
    stop: CancellationToken,
    pipeline_stop: CancellationToken,
    publisher: Arc<EventPublisher>,
    listener: EngineListenerHandle,
    processor: ProcessorHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

#[derive(Default)]
struct Totals {
    engine_events: AtomicU64,
}

async fn start_engine(
    id: u64,
    discovery: Arc<dyn Discovery>,
    per_engine_rate: u64,
    totals: Arc<Totals>,
) -> anyhow::Result<Engine> {
    // The engine's own PUB, as vLLM or SGLang would bind it.
    let engine_pub = Arc::new(PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?);
    let endpoint = engine_pub.local_endpoint().unwrap_or_default().to_owned();

    // The worker pipeline for this engine.
    let publisher = Arc::new(
        EventPublisher::builder(discovery, NAMESPACE, "worker", "kv-events")
            .build()
            .await?,
    );
    let pipeline_stop = CancellationToken::new();
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let listener = EngineListener::new(
        EngineListenerConfig::new(endpoint, ENGINE_TOPIC, WorkerId(id), BLOCK_SIZE),
        tx,
    );
    let listener_handle = listener.handle();
    let processor = Processor::new(
        ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(10)))?,
        rx,
        Arc::new(EventPlaneSink::new(publisher.clone())),
    )
    .with_cancellation(pipeline_stop.clone());
    let processor_handle = processor.handle();
    let mut tasks = vec![
        tokio::spawn({
            let stop = pipeline_stop.clone();
            async move {
                listener.run(stop).await;
            }
        }),
        tokio::spawn(async move {
            processor.run().await;
        }),
    ];

    // PUB/SUB has no memory for late joiners: start the engine once the router has
    // subscribed to this worker's publisher, so the final table can add up exactly.
    if tokio::time::timeout(Duration::from_secs(5), publisher.wait_for_subscribers(1))
        .await
        .is_err()
    {
        eprintln!("engine {id}: the router did not subscribe within 5 s; starting anyway");
    }

    // The engine's KV event generator.
    let stop = CancellationToken::new();
    tasks.push(tokio::spawn(generate(
        id,
        engine_pub,
        per_engine_rate,
        stop.clone(),
        totals,
    )));
    Ok(Engine {
        id,
        stop,
        pipeline_stop,
        publisher,
        listener: listener_handle,
        processor: processor_handle,
        tasks,
    })
}

async fn generate(
    id: u64,
    pub_socket: Arc<PubSocket>,
    rate: u64,
    stop: CancellationToken,
    totals: Arc<Totals>,
) {
    tokio::select! {
        () = stop.cancelled() => return,
        () = pub_socket.wait_for_subscribers(1) => {}
    }
    let mut x = 0x2545_F491_4F6C_DD1D ^ (id + 1).wrapping_mul(0x9E37_79B9);
    let mut rng = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut cached: Vec<u64> = Vec::new();
    let mut cached_set: HashSet<u64> = HashSet::new();
    let start = tokio::time::Instant::now();
    let mut sent_events = 0u64;
    let mut seq = 0u64;
    while !stop.is_cancelled() {
        let mut events = Vec::with_capacity(EVENTS_PER_BATCH);
        for _ in 0..EVENTS_PER_BATCH {
            if cached.len() > ENGINE_CAPACITY_BLOCKS || rng() % 4 == 0 && !cached.is_empty() {
                // Evict a few blocks.
                let mut gone = Vec::new();
                for _ in 0..(1 + rng() % 4) {
                    if cached.is_empty() {
                        break;
                    }
                    let k = (rng() as usize) % cached.len();
                    let h = cached.swap_remove(k);
                    cached_set.remove(&h);
                    gone.push(h);
                }
                events.push(EngineEvent::Removed {
                    block_hashes: gone,
                    medium: Some("GPU".into()),
                });
            } else {
                // A request with a (shared) prompt prefix: a chain of 1–8 blocks.
                let prefix = rng() % PREFIXES;
                let depth = 1 + rng() % 8;
                let hashes: Vec<u64> = (0..depth).map(|d| prefix_hash(prefix, d)).collect();
                for h in &hashes {
                    if cached_set.insert(*h) {
                        cached.push(*h);
                    }
                }
                let tokens: Vec<u32> = (0..depth as u32 * BLOCK_SIZE as u32)
                    .map(|t| (prefix as u32).wrapping_mul(131) ^ t)
                    .collect();
                events.push(EngineEvent::Stored {
                    block_hashes: hashes,
                    parent_block_hash: None,
                    token_ids: tokens,
                    medium: Some("GPU".into()),
                });
            }
        }
        let Ok(payload) = encode_engine_batch(0.0, 0, BLOCK_SIZE as u32, &events) else {
            return;
        };
        pub_socket.send(Message::from_parts([
            Bytes::from_static(ENGINE_TOPIC.as_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ]));
        seq += 1;
        sent_events += EVENTS_PER_BATCH as u64;
        totals
            .engine_events
            .fetch_add(EVENTS_PER_BATCH as u64, Ordering::Relaxed);
        // Pace to the configured rate.
        let due = start + Duration::from_secs_f64(sent_events as f64 / rate.max(1) as f64);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(due) => {}
        }
    }
}

impl Engine {
    /// Stops the engine and drains its pipeline, waits (up to 2 s) until the router
    /// has every router event this worker emitted, then unregisters its publisher.
    /// Returns `(engine→worker seq gaps, publisher drops, events in, router events out)`.
    async fn stop(self, per_worker: &PerWorker) -> (u64, u64, u64, u64) {
        self.stop.cancel();
        // Let the pipeline drain what the engine already sent, then stop it.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.pipeline_stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        let gaps = self.listener.stats().seq_gaps;
        let dropped = self.publisher.stats().dropped;
        let processed = self.processor.stats();
        let deadline = Instant::now() + Duration::from_secs(2);
        while per_worker.get(self.id) < processed.output_events && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Ok(p) = Arc::try_unwrap(self.publisher) {
            p.shutdown().await;
        }
        (
            gaps,
            dropped,
            processed.input_events,
            processed.output_events,
        )
    }
}

/// Router events received per worker.
#[derive(Default)]
struct PerWorker(std::sync::Mutex<HashMap<u64, u64>>);

impl PerWorker {
    fn add(&self, worker: WorkerId, n: u64) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(worker.0)
            .or_default() += n;
    }

    fn get(&self, worker: u64) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&worker)
            .copied()
            .unwrap_or(0)
    }
}

/// The router's view: which blocks each worker holds.
#[derive(Default)]
struct Index {
    blocks: HashMap<(WorkerId, StorageTier), HashSet<BlockHash>>,
}

impl Index {
    fn apply(&mut self, ev: &eventplane::kv::RouterEvent) {
        let set = self.blocks.entry((ev.worker_id, ev.tier)).or_default();
        match &ev.event.data {
            KvEventData::Stored { blocks, .. } => set.extend(blocks.iter().map(|b| b.block_hash)),
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    set.remove(h);
                }
            }
            _ => set.clear(),
        }
    }

    /// A worker left: forget its blocks, as a router does on its removal.
    fn forget(&mut self, worker: WorkerId) {
        self.blocks.retain(|(w, _), _| *w != worker);
    }

    fn size(&self) -> usize {
        self.blocks.values().map(HashSet::len).sum()
    }

    fn distinct(&self) -> usize {
        self.blocks.values().flatten().collect::<HashSet<_>>().len()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let engines_n = args.engines.max(1);
    let per_engine_rate = (args.rate / engines_n as u64).max(1);
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let totals = Arc::new(Totals::default());

    // The router: every worker's events, merged and decoded into an index.
    let mut router =
        DynamicSubscriber::builder(discovery.clone(), Query::new(NAMESPACE).component("worker"))
            .topic("kv-events")
            .layout(Layout::TopicPublisherSeq)
            .spawn();
    let router_stats = router.handle();
    let index = Arc::new(std::sync::Mutex::new(Index::default()));
    let router_events = Arc::new(AtomicU64::new(0));
    let malformed = Arc::new(AtomicU64::new(0));
    let per_worker = Arc::new(PerWorker::default());
    let consumer = tokio::spawn({
        let (index, router_events, malformed, per_worker) = (
            index.clone(),
            router_events.clone(),
            malformed.clone(),
            per_worker.clone(),
        );
        async move {
            let mut batch = Vec::with_capacity(256);
            loop {
                batch.clear();
                if router.recv_many(&mut batch, 256).await == 0 {
                    return;
                }
                let mut idx = index.lock().unwrap_or_else(|p| p.into_inner());
                for d in &batch {
                    match d.message.get(3).map(|p| decode_router_events(p)) {
                        Some(Ok(events)) => {
                            router_events.fetch_add(events.len() as u64, Ordering::Relaxed);
                            for ev in &events {
                                idx.apply(ev);
                                per_worker.add(ev.worker_id, 1);
                            }
                        }
                        _ => {
                            malformed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
    });

    println!(
        "eventplane demo: {engines_n} engines, {} engine events/s, {} s (Ctrl-C to stop early)",
        args.rate, args.seconds
    );
    let mut engines = Vec::new();
    for id in 0..engines_n as u64 {
        engines.push(start_engine(id, discovery.clone(), per_engine_rate, totals.clone()).await?);
    }
    let mut next_id = engines_n as u64;
    let mut retired = (0u64, 0u64, 0u64, 0u64); // gaps, publisher drops, engine inputs, engine outputs
    let started = Instant::now();
    let mut last = (0u64, 0u64, started);
    let mut swapped = false;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.tick().await;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    for second in 1..=args.seconds {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = &mut ctrl_c => break,
        }
        if !swapped && second >= args.seconds.div_ceil(2) && !engines.is_empty() {
            swapped = true;
            let leaving = engines.remove(0);
            let left_id = leaving.id;
            let (gaps, dropped, events_in, events_out) = leaving.stop(&per_worker).await;
            retired.0 += gaps;
            retired.1 += dropped;
            retired.2 += events_in;
            retired.3 += events_out;
            // Its last events are on their way; once delivered, forget the worker.
            tokio::time::sleep(Duration::from_millis(100)).await;
            index
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .forget(WorkerId(left_id));
            engines.push(
                start_engine(next_id, discovery.clone(), per_engine_rate, totals.clone()).await?,
            );
            println!("  engine {left_id} left; engine {next_id} joined");
            next_id += 1;
        }
        let now = Instant::now();
        let (inn, out) = (
            totals.engine_events.load(Ordering::Relaxed),
            router_events.load(Ordering::Relaxed),
        );
        let dt = now.duration_since(last.2).as_secs_f64().max(1e-9);
        let s = router_stats.stats();
        let idx = index.lock().unwrap_or_else(|p| p.into_inner()).size();
        println!(
            "t={second:>3}s  in {:>8.0} ev/s  out {:>8.0} router ev/s  drops {:>5}  gaps {:>3}  publishers {:>2}  index {:>7} blocks",
            (inn - last.0) as f64 / dt,
            (out - last.1) as f64 / dt,
            s.total.dropped(),
            s.total.gaps,
            s.publishers.len(),
            idx
        );
        last = (inn, out, now);
    }

    // Wind down: engines stop, pipelines drain, the router catches up.
    let mut processed = (retired.2, retired.3);
    let (mut gaps, mut pub_drops) = (retired.0, retired.1);
    for e in engines {
        let (g, d, events_in, events_out) = e.stop(&per_worker).await;
        gaps += g;
        pub_drops += d;
        processed.0 += events_in;
        processed.1 += events_out;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = router_stats.stats();
    router_stats.shutdown().await;
    let _ = consumer.await;
    let elapsed = started.elapsed().as_secs_f64();
    let idx = index.lock().unwrap_or_else(|p| p.into_inner());
    let engine_events = totals.engine_events.load(Ordering::Relaxed);
    let out = router_events.load(Ordering::Relaxed);
    println!();
    println!("{:<44} {:>14}", "engine events published", engine_events);
    println!(
        "{:<44} {:>14}",
        "engine events decoded by workers", processed.0
    );
    println!(
        "{:<44} {:>14}",
        "router events emitted (coalesced, deduped)", processed.1
    );
    println!("{:<44} {:>14}", "router events received by the router", out);
    println!(
        "{:<44} {:>14}",
        "event-plane messages delivered", s.total.delivered
    );
    println!(
        "{:<44} {:>14}",
        "drops (router lanes, all reasons)",
        s.total.dropped()
    );
    println!("{:<44} {:>14}", "drops (worker publishers)", pub_drops);
    println!("{:<44} {:>14}", "sequence gaps (engines → workers)", gaps);
    println!(
        "{:<44} {:>14}",
        "sequence gaps (workers → router)", s.total.gaps
    );
    println!(
        "{:<44} {:>14}",
        "malformed router payloads",
        malformed.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>14.0}",
        "engine events/s",
        engine_events as f64 / elapsed
    );
    println!(
        "{:<44} {:>14}",
        "index entries (worker × block)",
        idx.size()
    );
    println!(
        "{:<44} {:>14}",
        "distinct blocks in the index",
        idx.distinct()
    );
    Ok(())
}
