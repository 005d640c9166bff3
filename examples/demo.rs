//! `demo`: the event plane end to end, in one process, with embedded defaults only.
//!
//! ```text
//! cargo run --release --example demo -- [--engines N] [--seconds S] [--rate EVENTS_PER_SEC]
//! ```
//! - N simulated inference engines publish real msgpack KV event batches (vLLM's
//!   tagged-array layout, with prefixes shared across engines) on ZMQ PUB sockets.
//! - Each engine has a worker pipeline, a `kv::pipeline::Worker` (`EngineListener → Processor →
//!   EventPlaneSink → EventPublisher`), its publisher registered in a `MemoryDiscovery`
//!   with the worker's identity.
//! - A router `DynamicSubscriber` discovers every worker's publisher, merges their
//!   streams, and decodes the router events into a small block index.
//! - Each worker keeps its recovery log (`kv::pipeline::SharedWorkerLog`, served by a
//!   `kv::pipeline::RecoveryServer` registered with its publisher): the router rebuilds every
//!   worker from a dump when it first sees it, and a third of the way through the demo
//!   makes it lose one message of worker 1, which it repairs from that worker's log
//!   instead of forgetting the worker's blocks (`kv::router::RecoveryDriver`).
//! - Halfway through, one engine leaves and a new one joins: discovery-driven fan-in.
//!
//! Prints a progress line every second and a final table; exits 0.

use eventplane::wire::Dialect;
use eventplane_cli as common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use eventplane::BoxFuture;
use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
use eventplane::kv::{
    KvEventData, RouterEvent, WorkerId,
    engine::{EngineEvent, EngineListenerConfig, EngineListenerStats, encode_engine_batch},
    pipeline::{
        EventPlaneSink, EventSink, MAX_BLOCKS_PER_MESSAGE, MAX_EVENTS_PER_MESSAGE, ProcessorConfig,
        RecoveryServer, SharedWorkerLog, SinkError, Worker, WorkerLogConfig, split_messages,
    },
    router::{IndexFeed, RecoveryClientConfig, RecoveryDriver},
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{DynamicSubscriber, Item, Layout};
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
    /// Reach the workers' publishers only through an event broker (feature `tunnel`):
    /// an in-process TLS event bus (the repository's test certificates) and broker,
    /// with the router forbidden to dial them directly.
    #[arg(long)]
    tunnel: bool,
    /// With --tunnel: half of the workers (the odd ids) dial out to the bus as
    /// sources (DESIGN §7.4) and announce their publishers there, the other half
    /// sit behind the broker.
    #[arg(long, requires = "tunnel")]
    sources: bool,
    /// At the end, how long a drain waits without progress before what is still on
    /// its way counts as lost (seconds; it waits only while something is missing).
    #[arg(long = "drain-secs", default_value_t = 2)]
    drain_secs: u64,
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
    engine_pub: Arc<PubSocket>,
    generator: tokio::task::JoinHandle<u64>,
    publisher: Arc<EventPublisher>,
    /// `EngineListener → Processor → LedgerSink → publisher`.
    worker: Worker,
    /// A worker dialling out: its session with the bus.
    source: Option<tunnel::SourceHandle>,
    /// Serves the worker's recovery log (kept by its pipeline before publishing).
    recovery: RecoveryServer,
    log: SharedWorkerLog,
}

/// Where workers make themselves known: discovery (reached directly or through the
/// broker), or, for those that dial out, the bus.
#[derive(Clone)]
struct Plane {
    discovery: Arc<dyn Discovery>,
    dial_out: Option<tunnel::DialOut>,
}

/// Which event-plane message carried how many router events: the sink adds a
/// message's count when it publishes it, the router takes off what it decoded. Either
/// side may come first (the router can decode a message before its sink has written
/// it down), so a message's balance is signed and settles at zero whatever the order:
/// an event is never counted both as applied and as lost. What is left owing once the
/// router has stopped was lost on the way (publisher drop, lane drop, sequence gap,
/// undecodable), and the ledger says exactly how many events that was.
#[derive(Default)]
struct Ledger {
    balance: std::sync::Mutex<HashMap<(u64, u64), i64>>,
    /// Events in messages the sink could not publish at all.
    unsent: AtomicU64,
}

impl Ledger {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(u64, u64), i64>> {
        self.balance.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `delta` to one message's balance; a settled message leaves the ledger.
    fn settle(map: &mut HashMap<(u64, u64), i64>, key: (u64, u64), delta: i64) {
        let balance = map.entry(key).or_insert(0);
        *balance += delta;
        if *balance == 0 {
            map.remove(&key);
        }
    }

    /// The router decoded `events` events from this message.
    fn decoded(&self, publisher_id: u64, seq: u64, events: u64) {
        Self::settle(&mut self.lock(), (publisher_id, seq), -(events as i64));
    }

    /// Events in messages published but not decoded by the router (so far).
    fn missing(&self) -> u64 {
        self.lock().values().map(|&n| n.max(0) as u64).sum()
    }

    fn missing_from(&self, publisher_id: u64) -> u64 {
        self.lock()
            .iter()
            .filter(|((p, _), _)| *p == publisher_id)
            .map(|(_, &n)| n.max(0) as u64)
            .sum()
    }

    /// Events the router decoded from messages no sink recorded (0 unless the demo
    /// itself is wrong; shown as unaccounted).
    fn surplus(&self) -> u64 {
        self.lock().values().map(|&n| n.min(0).unsigned_abs()).sum()
    }
}

/// `EventPlaneSink`, with every message's event count written in the ledger.
struct LedgerSink {
    inner: EventPlaneSink,
    publisher: Arc<EventPublisher>,
    ledger: Arc<Ledger>,
}

impl EventSink for LedgerSink {
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
        // The sink publishes synchronously, one sequence number per message, in the
        // order `split_messages` cuts them.
        let first = self.publisher.next_sequence();
        let result = self.inner.publish(events);
        let sent = self.publisher.next_sequence() - first;
        let id = self.publisher.publisher_id();
        let mut ledger = self.ledger.lock();
        for (i, message) in
            split_messages(events, MAX_EVENTS_PER_MESSAGE, MAX_BLOCKS_PER_MESSAGE).enumerate()
        {
            let n = message.len() as u64;
            if (i as u64) < sent {
                Ledger::settle(&mut ledger, (id, first + i as u64), n as i64);
            } else {
                self.ledger.unsent.fetch_add(n, Ordering::Relaxed);
            }
        }
        result
    }
}

/// The loss the demo injects: one message the router discards, and what it carried.
#[derive(Default)]
struct Injected {
    armed: std::sync::atomic::AtomicBool,
    reported: std::sync::atomic::AtomicBool,
    worker: AtomicU64,
    events: AtomicU64,
}

impl Injected {
    /// Whether to discard this message: once armed, the first one of 8 events or more
    /// from worker 1 (followed since the start; worker 0 leaves halfway, and a loss of
    /// its last message would never show as a gap; a worker that joins is rebuilt
    /// from its dump anyway).
    fn take(&self, worker: Option<eventplane::discovery::WorkerIdentity>, events: u64) -> bool {
        if events < 8
            || worker.is_none_or(|w| w.worker_id.0 != 1)
            || !self.armed.swap(false, Ordering::Relaxed)
        {
            return false;
        }
        self.worker.store(
            worker.map_or(u64::MAX, |w| w.worker_id.0),
            Ordering::Relaxed,
        );
        self.events.store(events, Ordering::Relaxed);
        true
    }
}

#[derive(Default)]
struct Totals {
    engine_events: AtomicU64,
}

/// Where every engine event of one (stopped) engine went.
#[derive(Default, Clone, Copy)]
struct Account {
    /// Events in batches lost between engine and worker (dropped by the engine's PUB
    /// queue, seen by the worker as sequence gaps).
    engine_lost: u64,
    /// Events the worker's decoder rejected (failed, self-referencing, bad batches).
    rejected: u64,
    /// `Cleared` events the worker added itself after losing track of its engine (a
    /// sequence gap): router events that no engine event stands for.
    added: u64,
    /// Events into the worker pipeline.
    pipeline_in: u64,
    merged: u64,
    deduplicated: u64,
    withheld: u64,
    /// Router events emitted.
    emitted: u64,
    /// Engine→worker sequence gaps.
    gaps: u64,
    /// Event-plane messages the worker's publisher dropped.
    publisher_dropped: u64,
    /// Subscriber connections the worker's publisher accepted.
    publisher_accepted: u64,
    /// Workers whose blocks the router held exactly when they stopped.
    exact: u64,
}

impl Account {
    fn add(&mut self, o: &Account) {
        self.engine_lost += o.engine_lost;
        self.rejected += o.rejected;
        self.added += o.added;
        self.pipeline_in += o.pipeline_in;
        self.merged += o.merged;
        self.deduplicated += o.deduplicated;
        self.withheld += o.withheld;
        self.emitted += o.emitted;
        self.gaps += o.gaps;
        self.publisher_dropped += o.publisher_dropped;
        self.publisher_accepted += o.publisher_accepted;
        self.exact += o.exact;
    }
}

async fn start_engine(
    id: u64,
    plane: Plane,
    per_engine_rate: u64,
    totals: Arc<Totals>,
    ledger: Arc<Ledger>,
) -> anyhow::Result<Engine> {
    // The engine's own PUB, as vLLM or SGLang would bind it.
    let engine_pub = Arc::new(PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?);
    let endpoint = engine_pub.local_endpoint().unwrap_or_default().to_owned();

    // The worker's recovery log: its last router events and the blocks it holds,
    // kept before each event is published, served to a router that lost some.
    let log = SharedWorkerLog::new(WorkerLogConfig::default());
    let recovery = RecoveryServer::bind("tcp://127.0.0.1:0", log.clone()).await?;
    // The worker pipeline for this engine: registered in discovery with its recovery
    // endpoint, or announced on the bus with its recovery log by a worker that dials
    // out.
    let dial_out = plane.dial_out.filter(|d| d.dials_out(id));
    let publisher = Arc::new(match &dial_out {
        None => {
            EventPublisher::builder(plane.discovery, NAMESPACE, "worker", "kv-events")
                .worker(id, 0)
                .recovery(recovery.local_endpoint())
                .build()
                .await?
        }
        Some(_) => EventPublisher::unregistered("kv-events").build().await?,
    });
    let source = match &dial_out {
        Some(d) => Some(d.announce(id, &publisher, &recovery)?),
        None => None,
    };
    // A sink of our own (the ledger's), so `Worker::with_sink`; a worker that only
    // publishes uses `Worker::builder(engine, publisher)`.
    let worker = Worker::with_sink(
        EngineListenerConfig::new(endpoint, ENGINE_TOPIC, WorkerId(id), BLOCK_SIZE),
        Arc::new(LedgerSink {
            inner: EventPlaneSink::new(publisher.clone()),
            publisher: publisher.clone(),
            ledger,
        }),
    )
    .processor(ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(10))))
    .local_index(Box::new(log.clone()))
    .spawn()?;

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
    let generator = tokio::spawn(generate(
        id,
        engine_pub.clone(),
        per_engine_rate,
        stop.clone(),
        totals,
    ));
    Ok(Engine {
        id,
        stop,
        engine_pub,
        generator,
        publisher,
        worker,
        source,
        recovery,
        log,
    })
}

async fn generate(
    id: u64,
    pub_socket: Arc<PubSocket>,
    rate: u64,
    stop: CancellationToken,
    totals: Arc<Totals>,
) -> u64 {
    tokio::select! {
        () = stop.cancelled() => return 0,
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
            return seq;
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
            () = stop.cancelled() => return seq,
            () = tokio::time::sleep_until(due) => {}
        }
    }
    seq
}

/// Waits until `remaining()` is 0, or it has not gone down for `patience`; returns
/// what was still remaining then (0: drained).
async fn wait_while_progressing(patience: Duration, remaining: impl Fn() -> u64) -> u64 {
    let mut last = remaining();
    let mut since = Instant::now();
    while last > 0 && since.elapsed() < patience {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = remaining();
        if now < last {
            since = Instant::now();
        }
        last = now;
    }
    last
}

impl Engine {
    /// Stops the engine, lets its worker decode every batch that is on its way, stops
    /// the listener and lets the processor drain, waits until the router has decoded every message this worker
    /// published (each wait gives up after 2 s without progress: what is missing then
    /// was lost), then unregisters the publisher. Returns where the engine's events
    /// went.
    /// Its recovery endpoint goes to `retired`, which the demo keeps until the router
    /// has stopped (a router that lost the worker's last messages may still ask).
    async fn stop(
        self,
        ledger: &Ledger,
        patience: Duration,
        index: &Mutex<IndexFeed>,
        retired: &Mutex<Vec<RecoveryServer>>,
    ) -> Account {
        self.stop.cancel();
        let batches = self.generator.await.unwrap_or(0);
        let engine_dropped = self.engine_pub.stats().dropped;
        // Every batch the engine sent is decoded, rejected or lost (its PUB dropped
        // it; the worker sees most such drops as sequence gaps, never more).
        let settled = |s: EngineListenerStats| {
            s.decoder.batches
                + s.decoder.malformed_batches
                + s.malformed_messages
                + engine_dropped.max(s.seq_gap_batches)
        };
        let left = wait_while_progressing(patience, || {
            batches.saturating_sub(settled(self.worker.stats().listener))
        })
        .await;
        if left > 0 {
            println!(
                "engine {}: drain gave up after {} s without progress, {left} batches not yet seen by its worker",
                self.id,
                patience.as_secs()
            );
        }
        // The listener stops first; the processor publishes what was queued, then stops.
        let stats = self.worker.shutdown().await;
        let (listened, processed) = (stats.listener, stats.processor);
        let publisher_id = self.publisher.publisher_id();
        let left = wait_while_progressing(patience, || ledger.missing_from(publisher_id)).await;
        if left > 0 {
            println!(
                "engine {}: drain gave up after {} s without progress, {left} router events not yet decoded (lost unless they arrive before the router stops)",
                self.id,
                patience.as_secs()
            );
        }
        // Everything it published has arrived (or is lost): the router holds what the
        // worker holds, block for block, unless a loss went unrepaired.
        let differs = wait_while_progressing(patience, || {
            let recovering = index
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .stats()
                .recovering;
            u64::from(recovering > 0 || held_by_log(&self.log) != held_by_router(index, self.id))
        })
        .await;
        if differs > 0 {
            println!(
                "engine {}: the router's index differs from the worker's own log",
                self.id
            );
        }
        let (publisher_dropped, publisher_accepted) = {
            let s = self.publisher.stats();
            (s.dropped, s.accepted)
        };
        if let Ok(p) = Arc::try_unwrap(self.publisher) {
            p.shutdown().await;
        }
        tunnel::stop_source(self.source).await;
        retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.recovery);
        let per_batch = EVENTS_PER_BATCH as u64;
        let d = listened.decoder;
        Account {
            // The engine's PUB has one subscriber, this worker: every batch it drops is
            // lost to the worker, which sees most of them as sequence gaps (not those
            // at the very end). Either count, never both.
            engine_lost: engine_dropped.max(listened.seq_gap_batches) * per_batch,
            rejected: d.failed_events
                + d.self_referencing
                + listened.discarded_events
                + (d.malformed_batches + listened.malformed_messages) * per_batch,
            added: listened.stale_clears,
            pipeline_in: processed.input_events,
            merged: processed.merged_events,
            deduplicated: processed.deduplicated_events,
            withheld: processed.withheld_events,
            emitted: processed.output_events,
            gaps: listened.seq_gaps,
            publisher_dropped,
            publisher_accepted,
            exact: u64::from(differs == 0),
        }
    }
}

/// The blocks a worker's log says it holds.
fn held_by_log(log: &SharedWorkerLog) -> HashSet<u64> {
    let mut held = HashSet::new();
    for ev in log.dump().events {
        match ev.event.data {
            KvEventData::Stored { blocks, .. } => {
                held.extend(blocks.iter().map(|b| b.block_hash.0));
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    held.remove(&h.0);
                }
            }
            _ => {}
        }
    }
    held
}

/// The blocks the router's index holds for worker `id`.
fn held_by_router(index: &Mutex<IndexFeed>, id: u64) -> HashSet<u64> {
    let feed = index.lock().unwrap_or_else(|p| p.into_inner());
    feed.index()
        .rank_block_hashes(WorkerId(id), 0)
        .map(|h| h.0)
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    common::init_tracing();
    let args = Args::parse();
    let patience = Duration::from_secs(args.drain_secs.max(1));
    let engines_n = args.engines.max(1);
    let per_engine_rate = (args.rate / engines_n as u64).max(1);
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let totals = Arc::new(Totals::default());

    // The router: every worker's events, merged and decoded into an index.
    let (tunnel, followed, dial_out) =
        tunnel::start(args.tunnel, args.sources, engines_n, discovery.clone()).await?;
    let builder = DynamicSubscriber::builder(followed, Query::new(NAMESPACE).component("worker"))
        .topic("kv-events")
        .layout(Layout::TopicPublisherSeq)
        .notices(4096);
    let builder = tunnel::configure(tunnel.as_ref(), builder);
    let plane = Plane {
        discovery: discovery.clone(),
        dial_out,
    };
    let mut router = builder.spawn()?;
    let router_stats = router.handle();
    // The library's router index, fed in order (deliveries and notices in one
    // stream: a departed worker's blocks go once its last message was applied).
    let index = Arc::new(std::sync::Mutex::new(IndexFeed::default()));
    let router_events = Arc::new(AtomicU64::new(0));
    let malformed = Arc::new(AtomicU64::new(0));
    let ledger = Arc::new(Ledger::default());
    // Set a third of the way through: the router discards the next message it gets
    // (a loss), and the worker's log repairs it.
    let inject = Arc::new(Injected::default());
    // The recovery endpoints of workers that stopped, kept until the router stops.
    let retired = Arc::new(Mutex::new(Vec::new()));
    // The router asks workers for what it lost: directly, or through the bus.
    let recovery = tunnel::recovery(
        tunnel.as_ref(),
        RecoveryDriver::new(RecoveryClientConfig::default()),
    );
    let consumer = tokio::spawn({
        let (index, router_events, malformed, ledger, inject) = (
            index.clone(),
            router_events.clone(),
            malformed.clone(),
            ledger.clone(),
            inject.clone(),
        );
        let mut recovery = recovery;
        async move {
            loop {
                let needs = index
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take_recoveries();
                recovery.submit(needs);
                let item = tokio::select! {
                    item = router.recv_item() => item,
                    answer = recovery.next() => {
                        index.lock().unwrap_or_else(|p| p.into_inner()).recovered(answer);
                        continue;
                    }
                };
                let Some(item) = item else { break };
                let d = match item {
                    Item::Delivery(d) => d,
                    Item::Notice(n) => {
                        index.lock().unwrap_or_else(|p| p.into_inner()).notice(&n);
                        continue;
                    }
                    _ => continue,
                };
                match d
                    .message
                    .get(3)
                    .map(|p| Dialect::EventPlane.decode_router_events(p))
                {
                    Some(Ok(events)) if inject.take(d.source.worker, events.len() as u64) => {
                        // Discarded on purpose: settled in the ledger, counted apart.
                        if let Some(seq) = d.sequence {
                            let publisher_id = d.source.id.publisher_id();
                            ledger.decoded(publisher_id, seq, events.len() as u64);
                        }
                    }
                    Some(Ok(events)) => {
                        router_events.fetch_add(events.len() as u64, Ordering::Relaxed);
                        index
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .apply(&d.source, &events);
                        if let Some(seq) = d.sequence {
                            let publisher_id = d.source.id.publisher_id();
                            ledger.decoded(publisher_id, seq, events.len() as u64);
                        }
                    }
                    _ => {
                        malformed.fetch_add(1, Ordering::Relaxed);
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
        engines.push(
            start_engine(
                id,
                plane.clone(),
                per_engine_rate,
                totals.clone(),
                ledger.clone(),
            )
            .await?,
        );
    }
    let mut next_id = engines_n as u64;
    let mut account = Account::default();
    let started = Instant::now();
    let mut last = (0u64, 0u64, started);
    let mut swapped = false;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    // `--seconds` is a deadline for the load, whatever the swap or a slow line costs.
    let end = tokio::time::Instant::from_std(started) + Duration::from_secs(args.seconds);
    let halfway = started + Duration::from_secs(args.seconds) / 2;
    let a_third = started + Duration::from_secs(args.seconds) / 3;
    let mut injected = false;
    // The leave/join runs beside the progress lines (a departure drains for up to
    // seconds), its result collected here.
    let mut swap: Option<tokio::task::JoinHandle<anyhow::Result<(Account, Engine)>>> = None;
    while tokio::time::Instant::now() < end {
        tokio::select! {
            _ = ticker.tick() => {}
            () = tokio::time::sleep_until(end) => {}
            _ = &mut ctrl_c => break,
            done = async {
                match swap.as_mut() {
                    Some(task) => task.await,
                    None => std::future::pending().await,
                }
            }, if swap.is_some() => {
                let (left, joined) = done??;
                account.add(&left);
                engines.push(joined);
                swap = None;
                continue; // lines stay on the tick
            }
        }
        if !injected && Instant::now() >= a_third {
            injected = true;
            inject.armed.store(true, Ordering::Relaxed);
        }
        if inject.events.load(Ordering::Relaxed) > 0
            && !inject.reported.swap(true, Ordering::Relaxed)
        {
            println!(
                "  injected a loss: the router discarded a message of worker {} ({} router events)",
                inject.worker.load(Ordering::Relaxed),
                inject.events.load(Ordering::Relaxed)
            );
        }
        if !swapped && Instant::now() >= halfway && !engines.is_empty() {
            swapped = true;
            let leaving = engines.remove(0);
            let (ledger, plane, totals, index, retired) = (
                ledger.clone(),
                plane.clone(),
                totals.clone(),
                index.clone(),
                retired.clone(),
            );
            let joining = next_id;
            next_id += 1;
            swap = Some(tokio::spawn(async move {
                let left_id = leaving.id;
                // Its publisher unregisters: the router's feed drops its blocks at its
                // `Departed`, after its last message.
                let left = leaving.stop(&ledger, patience, &index, &retired).await;
                let joined = start_engine(joining, plane, per_engine_rate, totals, ledger).await?;
                println!("  engine {left_id} left; engine {joining} joined");
                Ok((left, joined))
            }));
        }
        let now = Instant::now();
        let (inn, out) = (
            totals.engine_events.load(Ordering::Relaxed),
            router_events.load(Ordering::Relaxed),
        );
        let dt = now.duration_since(last.2).as_secs_f64().max(1e-9);
        let s = router_stats.stats();
        let idx = index
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .index()
            .stats()
            .blocks;
        // Labelled with the real time since the start: under overload a line can
        // come late, and its rates are over the time it really covers.
        // Engine PUB drops (batches an engine could not hand its worker) and the
        // router's lane drops and sequence gaps, since the start.
        let engine_drops = account.engine_lost / EVENTS_PER_BATCH as u64
            + engines
                .iter()
                .map(|e| e.engine_pub.stats().dropped)
                .sum::<u64>();
        println!(
            "t={:>5.1}s  in {:>8.0} ev/s  out {:>8.0} router ev/s  engine drops {:>5}  router drops {:>5}  gaps {:>3}  publishers {:>2}  index {:>7} blocks",
            now.duration_since(started).as_secs_f64(),
            (inn - last.0) as f64 / dt,
            (out - last.1) as f64 / dt,
            engine_drops,
            s.total.dropped(),
            s.total.gaps,
            s.publishers.len(),
            idx
        );
        last = (inn, out, now);
    }

    // Wind down: every engine stops producing at once, then each pipeline drains
    // and the router catches up (draining one engine while the others still send
    // would stretch the run and mix load into the drain).
    let load_ended = Instant::now();
    // The index as the load left it (every worker then leaves, taking its blocks).
    let at_load_end = index.lock().unwrap_or_else(|p| p.into_inner()).stats();
    if let Some(task) = swap.take() {
        let (left, joined) = task.await??;
        account.add(&left);
        engines.push(joined);
    }
    for e in &engines {
        e.stop.cancel();
    }
    for e in engines {
        account.add(&e.stop(&ledger, patience, &index, &retired).await);
    }
    println!(
        "load ended at t={:.1}s; drained in {:.1}s",
        load_ended.duration_since(started).as_secs_f64(),
        load_ended.elapsed().as_secs_f64()
    );
    // The router stops once nothing is on its way (or nothing has arrived for 2 s);
    // the table is computed after it stopped, from what it decoded by then.
    let left = wait_while_progressing(patience, || ledger.missing()).await;
    if left > 0 {
        println!("router: stopping with {left} router events never decoded (lost)");
    }
    router_stats.shutdown().await;
    let _ = consumer.await;
    let s = router_stats.stats();
    // Rates are over the load, not the drain after it.
    let elapsed = load_ended.duration_since(started).as_secs_f64().max(1e-9);
    let fed = index.lock().unwrap_or_else(|p| p.into_inner()).stats();
    let engine_events = totals.engine_events.load(Ordering::Relaxed);
    let out = router_events.load(Ordering::Relaxed);
    let lost_on_plane = ledger.missing() + ledger.unsent.load(Ordering::Relaxed);
    let a = &account;
    let discarded = inject.events.load(Ordering::Relaxed);
    let accounted = a.engine_lost
        + a.rejected
        + a.merged
        + a.deduplicated
        + a.withheld
        + lost_on_plane
        + discarded
        + out;
    let row = |label: &str, value: u64| println!("{label:<52} {value:>12}");
    println!();
    row("engine events published", engine_events);
    row(
        "  lost between engine and worker (PUB drops)",
        a.engine_lost,
    );
    row("  rejected by the workers' decoders", a.rejected);
    row("  added by the workers (clears after a lost view)", a.added);
    row("engine events into worker pipelines", a.pipeline_in);
    row("  merged by coalescing", a.merged);
    row("  removed by dedup (blocks still stored)", a.deduplicated);
    row("  withheld by a fenced processor", a.withheld);
    row("router events emitted", a.emitted);
    row("  lost on the event plane (drops, gaps)", lost_on_plane);
    row(
        "  discarded by the router (the demo's injected loss)",
        discarded,
    );
    row("router events applied to the router index", out);
    // What the workers added is on the other side of the ledger.
    row(
        "unaccounted engine events",
        (engine_events + a.added).abs_diff(accounted) + ledger.surplus(),
    );
    println!();
    row("event-plane messages delivered", s.total.delivered);
    row("drops (router lanes, all reasons)", s.total.dropped());
    row("drops (worker publishers)", a.publisher_dropped);
    row("sequence gaps (engines → workers)", a.gaps);
    row("sequence gaps (workers → router)", s.total.gaps);
    row(
        "malformed router payloads",
        malformed.load(Ordering::Relaxed),
    );
    row(
        "engine events/s (while the engines ran)",
        (engine_events as f64 / elapsed).round() as u64,
    );
    row(
        "index entries (worker × block), load end",
        at_load_end.index.blocks,
    );
    row(
        "distinct blocks in the index, load end",
        at_load_end.index.nodes,
    );
    row("index bytes, load end", at_load_end.index.bytes);
    row("index entries after every worker left", fed.index.blocks);
    row(
        "index repairs from a worker's dump (first sight too)",
        fed.repairs_dump,
    );
    row(
        "index repairs from the events since a loss",
        fed.repairs_since,
    );
    row("  their latency p99 (ms)", fed.repair_p99_ms);
    row(
        "live events an answer had applied already (skipped)",
        fed.late_duplicates,
    );
    row("workers", next_id);
    row(
        "  whose blocks the index held exactly at their end",
        a.exact,
    );
    row(
        "index wipes (losses no worker's log could repair)",
        fed.wipes_id_gap
            + fed.wipes_reconnect
            + fed.wipes_recovery_failed
            + fed.wipes_held_overflow,
    );
    row("  after an id gap or ids going back", fed.wipes_id_gap);
    row("  after a reconnection", fed.wipes_reconnect);
    row("  after a failed recovery", fed.wipes_recovery_failed);
    row(
        "  after holding too many live events",
        fed.wipes_held_overflow,
    );
    row(
        "router events refused by the index",
        fed.refused_events + fed.refused_rank_events,
    );
    // Every worker's recovery endpoint is kept until here: its connections are the
    // recoveries the router made (through the bus, with --tunnel).
    let recoveries: u64 = retired
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|s| s.stats().connections)
        .sum();
    tunnel::report(tunnel, a.publisher_accepted, recoveries, row).await;
    Ok(())
}

/// `--tunnel`: an event bus and a broker in this process, the router's direct dials
/// refused by its address filter, so every worker is reached through the broker; with
/// `--sources`, the odd workers dial out to the bus instead and announce their
/// publishers (the router follows discovery and the bus's announced view, merged).
#[cfg(feature = "tunnel")]
mod tunnel {
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use eventplane::discovery::{ChannelId, Discovery, Merged, WorkerIdentity};
    use eventplane::kv::{pipeline::RecoveryServer, router::RecoveryDriver};
    use eventplane::net::AddrFilter;
    use eventplane::publish::EventPublisher;
    use eventplane::subscriber::DynamicSubscriberBuilder;
    use eventplane::tunnel::{
        AnnouncedSource, Broker, BrokerConfig, BusClients, EventBus, EventBusConfig, Secret,
        Source, SourceConfig, TokenDigest, client_tls, server_tls,
    };
    use eventplane::wire::Dialect;

    pub(super) struct Tunnel {
        bus: EventBus,
        broker: Broker,
        dial_out: Option<DialOut>,
    }

    /// How a worker dials out to the bus as a source.
    #[derive(Clone)]
    pub(super) struct DialOut {
        url: String,
        tls: Arc<rustls::ClientConfig>,
        /// Streams the sources served, for the report.
        streams: Arc<AtomicU64>,
    }

    /// A worker's source, and where its stream count goes.
    pub(super) struct SourceHandle(Source, Arc<AtomicU64>);

    fn source_token(id: u64) -> String {
        format!("demo-source-token-{id}")
    }

    impl DialOut {
        /// The odd workers dial out.
        pub(super) fn dials_out(&self, id: u64) -> bool {
            id % 2 == 1
        }

        /// Worker `id` dials the bus and announces `publisher`, with its recovery log.
        pub(super) fn announce(
            &self,
            id: u64,
            publisher: &EventPublisher,
            recovery: &RecoveryServer,
        ) -> anyhow::Result<SourceHandle> {
            let source = Source::spawn(SourceConfig::new(
                self.url.clone(),
                format!("demo-source-{id}"),
                vec![super::NAMESPACE.to_owned()],
                Secret::new(source_token(id))?,
                self.tls.clone(),
            ))?;
            let channel = ChannelId::new(
                super::NAMESPACE,
                "worker",
                "kv-events",
                publisher.publisher_id(),
            )?;
            source.announce_with_recovery(
                AnnouncedSource::new(&channel, Dialect::EventPlane)
                    .with_worker(WorkerIdentity::new(id, 0)),
                publisher.acceptor(),
                recovery.acceptor(),
            )?;
            Ok(SourceHandle(source, self.streams.clone()))
        }
    }

    /// Ends a worker's session (its publisher already closed its streams).
    pub(super) async fn stop_source(source: Option<SourceHandle>) {
        if let Some(SourceHandle(source, streams)) = source {
            streams.fetch_add(source.stats().streams_opened, Ordering::Relaxed);
            source.shutdown().await;
        }
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tunnel")
            .join(name)
    }

    /// The bus and broker (with `on`), and what the router follows: `discovery`, and
    /// with `sources` the bus's announced view too. Credentials for `engines` + 1
    /// workers that dial out (one joins halfway).
    pub(super) async fn start(
        on: bool,
        sources: bool,
        engines: usize,
        discovery: Arc<dyn Discovery>,
    ) -> anyhow::Result<(Option<Tunnel>, Arc<dyn Discovery>, Option<DialOut>)> {
        if !on {
            return Ok((None, discovery, None));
        }
        let token = Secret::new("demo-bus-token-0123456789")?;
        let mut clients = BusClients::shared(&token, vec![super::NAMESPACE.to_owned()])?;
        if sources {
            for id in (0..=engines as u64).filter(|id| id % 2 == 1) {
                clients = clients.source(
                    format!("demo-source-{id}"),
                    TokenDigest::of(&Secret::new(source_token(id))?),
                    vec![super::NAMESPACE.to_owned()],
                )?;
            }
        }
        let bus = EventBus::bind(
            "127.0.0.1:0",
            server_tls(fixture("bus.pem"), fixture("bus.key"))?,
            clients,
            EventBusConfig::default(),
        )
        .await?;
        let url = format!("https://localhost:{}", bus.local_addr().port());
        let tls = client_tls(fixture("ca.pem"))?;
        let broker = Broker::spawn(
            BrokerConfig::new(
                url.clone(),
                "demo-broker",
                vec![super::NAMESPACE.to_owned()],
                token,
                tls.clone(),
                discovery.clone(),
            )
            // The workers listen on loopback, which a broker refuses by default.
            .addr_filter(AddrFilter::strict().allow_cidr("127.0.0.0/8".parse()?)),
        )?;
        tokio::time::timeout(Duration::from_secs(10), async {
            while bus.brokers_for(super::NAMESPACE).is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .map_err(|_| anyhow::anyhow!("the broker did not join the bus within 10 s"))?;
        println!(
            "tunnel: broker joined the event bus at {}",
            bus.local_addr()
        );
        let (followed, dial_out): (Arc<dyn Discovery>, _) = if sources {
            println!("tunnel: the odd workers dial out as sources");
            (
                Arc::new(Merged::new(vec![
                    discovery,
                    Arc::new(bus.announced(Dialect::EventPlane)),
                ])),
                Some(DialOut {
                    url,
                    tls,
                    streams: Arc::new(AtomicU64::new(0)),
                }),
            )
        } else {
            (discovery, None)
        };
        Ok((
            Some(Tunnel {
                bus,
                broker,
                dial_out: dial_out.clone(),
            }),
            followed,
            dial_out,
        ))
    }

    /// The router asks workers for what it lost as it reaches them: through the bus.
    pub(super) fn recovery(tunnel: Option<&Tunnel>, driver: RecoveryDriver) -> RecoveryDriver {
        match tunnel {
            Some(t) => driver.tunnel(t.bus.clone(), false),
            None => driver,
        }
    }

    /// The router reaches workers through the bus only.
    pub(super) fn configure(
        tunnel: Option<&Tunnel>,
        builder: DynamicSubscriberBuilder,
    ) -> DynamicSubscriberBuilder {
        match tunnel {
            Some(t) => builder
                .tunnel(t.bus.clone())
                // Loopback refused: the workers are "inside the cluster".
                .addr_filter(AddrFilter::strict()),
            None => builder,
        }
    }

    /// The tunnel's rows; `accepted` is how many connections the workers' publishers
    /// accepted in all (the broker's, the sources' streams, and any the router made
    /// directly), `recoveries` how many their recovery endpoints served.
    pub(super) async fn report(
        tunnel: Option<Tunnel>,
        accepted: u64,
        recoveries: u64,
        row: impl Fn(&str, u64),
    ) {
        let Some(Tunnel {
            bus,
            broker,
            dial_out,
        }) = tunnel
        else {
            return;
        };
        let stats = broker.stats();
        let from_sources = dial_out.map_or(0, |d| d.streams.load(Ordering::Relaxed));
        row("streams through the broker", stats.streams_opened);
        if from_sources > 0 {
            row("streams from workers dialling out", from_sources);
        }
        row(
            "  recoveries among them (dumps, events since a loss)",
            recoveries,
        );
        row(
            "worker connections not through the bus",
            accepted
                .saturating_sub((stats.streams_opened + from_sources).saturating_sub(recoveries)),
        );
        row("bytes relayed publishers → router", bus.stats().bytes_in);
        row("refused or failed subscribes", bus.stats().streams_failed);
        broker.shutdown().await;
        bus.shutdown().await;
    }
}

#[cfg(not(feature = "tunnel"))]
mod tunnel {
    use std::sync::Arc;

    use eventplane::discovery::Discovery;
    use eventplane::kv::{pipeline::RecoveryServer, router::RecoveryDriver};
    use eventplane::publish::EventPublisher;
    use eventplane::subscriber::DynamicSubscriberBuilder;

    pub(super) enum Tunnel {}

    #[derive(Clone)]
    pub(super) enum DialOut {}

    pub(super) enum SourceHandle {}

    impl DialOut {
        pub(super) fn dials_out(&self, _: u64) -> bool {
            match *self {}
        }

        pub(super) fn announce(
            &self,
            _: u64,
            _: &EventPublisher,
            _: &RecoveryServer,
        ) -> anyhow::Result<SourceHandle> {
            match *self {}
        }
    }

    pub(super) async fn stop_source(_: Option<SourceHandle>) {}

    pub(super) async fn start(
        on: bool,
        _: bool,
        _: usize,
        discovery: Arc<dyn Discovery>,
    ) -> anyhow::Result<(Option<Tunnel>, Arc<dyn Discovery>, Option<DialOut>)> {
        if on {
            anyhow::bail!(
                "--tunnel needs the `tunnel` feature: cargo run --release --features tunnel --example demo -- --tunnel"
            );
        }
        Ok((None, discovery, None))
    }

    pub(super) fn configure(
        _: Option<&Tunnel>,
        builder: DynamicSubscriberBuilder,
    ) -> DynamicSubscriberBuilder {
        builder
    }

    pub(super) async fn report(_: Option<Tunnel>, _: u64, _: u64, _: impl Fn(&str, u64)) {}

    pub(super) fn recovery(_: Option<&Tunnel>, driver: RecoveryDriver) -> RecoveryDriver {
        driver
    }
}
