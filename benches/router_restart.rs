//! A router restarted against N workers that hold M blocks each: how long until its
//! index holds every block again, and the bytes that moved. Each worker keeps its
//! blocks in a `kv::pipeline::WorkerLog` served by a `kv::pipeline::RecoveryServer` on loopback; the
//! router is an `IndexFeed` that sees every publisher connect (first sight: a dump),
//! its requests made by a `kv::router::RecoveryDriver` (16 at once), each answer applied as it
//! comes. Blocks are in chains of 64 (a worker's distinct prompts).
//!
//! Then gap repair: a worker's log moves on by three events and the router gets only
//! the third (two lost on the way): the time from the gap seen to the index repaired
//! (events since it asked, answered, applied), one worker at a time, then every worker
//! at once (the driver's 16 at a time).
//!
//! `cargo bench -p eventplane-benches --bench router_restart [-- --workers N --blocks M]`
//! (default 1,000 × 10,000; criterion's `--test` mode runs 20 × 1,000 and checks the
//! index).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use eventplane::discovery::{ChannelId, Instance, Transport, WorkerIdentity};
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
    pipeline::{LocalIndex, RecoveryServer, SharedWorkerLog, WorkerLogConfig},
    router::{IndexFeed, RecoveryClientConfig, RecoveryDriver, RouterIndexConfig},
};
use eventplane::subscriber::Notice;

const CHAIN: u64 = 64;

fn arg(name: &str) -> Option<u64> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

/// Event `id` of `worker`: a chain of `len` blocks from `first`.
fn chain_event(worker: u64, id: u64, first: u64, len: u64) -> RouterEvent {
    let blocks = (first..first + len)
        .map(|h| StoredBlock {
            block_hash: BlockHash(h),
            tokens_hash: TokensHash(h),
        })
        .collect();
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks,
            },
        },
    }
}

/// The p50 and p99 of `samples`, in milliseconds.
fn percentiles(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e3
    };
    (at(0.5), at(0.99))
}

/// A worker's log holding `blocks` blocks, in chains of [`CHAIN`].
fn worker_log(worker: u64, blocks: u64) -> SharedWorkerLog {
    let log = SharedWorkerLog::new(WorkerLogConfig::default());
    let mut keeper = log.clone();
    let base = worker << 32;
    let mut id = 0;
    let mut stored = 0;
    while stored < blocks {
        let len = CHAIN.min(blocks - stored);
        id += 1;
        keeper
            .apply(&chain_event(worker, id, base + stored, len))
            .unwrap();
        stored += len;
    }
    log
}

fn main() {
    let test = std::env::args().any(|a| a == "--test");
    let (workers, blocks) = if test {
        (20, 1_000)
    } else {
        (
            arg("--workers").unwrap_or(1_000),
            arg("--blocks").unwrap_or(10_000),
        )
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let started = Instant::now();
        let mut servers = Vec::new();
        let mut bytes = 0usize;
        for w in 1..=workers {
            let log = worker_log(w, blocks);
            // What its dump weighs on the wire, packed (payloads: a 16-byte header per
            // message of at most 8,192 blocks, 10 bytes per event and 8 more for its
            // parent, 16 per block; ZMTP frames add a few bytes).
            let dump = log.dump();
            let blocks_in = |e: &RouterEvent| e.event.data.block_count();
            let total: usize = dump.events.iter().map(blocks_in).sum();
            bytes += 16 * total.div_ceil(8192)
                + dump
                    .events
                    .iter()
                    .map(|e| {
                        let parent = matches!(
                            e.event.data,
                            KvEventData::Stored {
                                parent_hash: Some(_),
                                ..
                            }
                        );
                        10 + 8 * usize::from(parent) + 16 * blocks_in(e)
                    })
                    .sum::<usize>();
            let server = RecoveryServer::bind("tcp://127.0.0.1:0", log.clone())
                .await
                .unwrap();
            servers.push((w, server, log));
        }
        println!(
            "{workers} workers × {blocks} blocks ready in {:.1} s",
            started.elapsed().as_secs_f64()
        );

        let config = RouterIndexConfig::default()
            .max_blocks_per_rank(usize::try_from(blocks).unwrap().max(1 << 20))
            .max_blocks(usize::try_from(workers * blocks).unwrap().max(1 << 24))
            .max_bytes(usize::MAX >> 1);
        let mut feed = IndexFeed::new(config);
        let restart = Instant::now();
        let mut instances = Vec::new();
        for (w, server, _) in &servers {
            let id = ChannelId::new("bench", "worker", "kv-events", *w).unwrap();
            let instance = Instance::new(id, Transport::zmq("tcp://127.0.0.1:1"), 1)
                .with_worker(WorkerIdentity::new(*w, 0))
                .with_recovery(server.local_endpoint());
            feed.notice(&Notice::Connected(Arc::new(instance.clone())));
            instances.push(instance);
        }
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        driver.submit(feed.take_recoveries());
        let mut answered = 0;
        let mut apply = Duration::ZERO;
        while answered < workers {
            let answer = driver.next().await;
            assert!(answer.answer.is_ok(), "{:?}", answer.answer);
            let t = Instant::now();
            feed.recovered(answer);
            apply += t.elapsed();
            answered += 1;
        }
        let elapsed = restart.elapsed();
        let stats = feed.stats();
        assert_eq!(stats.index.blocks, workers * blocks);
        assert_eq!(
            (stats.repairs_dump, stats.wipes_recovery_failed),
            (workers, 0)
        );
        println!(
            "router restart: {} blocks back in {:.3} s ({:.1} M blocks/s; applying {:.3} s of it), \
             {:.1} MiB of dumps moved; repair p50 {} ms, p99 {} ms",
            stats.index.blocks,
            elapsed.as_secs_f64(),
            stats.index.blocks as f64 / elapsed.as_secs_f64() / 1e6,
            apply.as_secs_f64(),
            bytes as f64 / (1 << 20) as f64,
            stats.repair_p50_ms,
            stats.repair_p99_ms,
        );

        // Gap repair: each worker's log moves on by three events; the router sees
        // only the third. A fresh driver: the restart's asked every worker a moment ago,
        // and a driver asks one publisher at most once a second (that wait, which a
        // gap right after another repair pays, is not in these figures).
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let first_id = blocks.div_ceil(CHAIN);
        let gap = |round: u64, w: u64, log: &SharedWorkerLog| {
            let mut keeper = log.clone();
            let mut last = None;
            for k in 1..=3 {
                let id = first_id + 3 * round + k;
                let ev = chain_event(w, id, (w << 32) + (1 << 31) + id * 8, 4);
                keeper.apply(&ev).unwrap();
                last = Some(ev);
            }
            last.unwrap()
        };
        let mut one_at_a_time = Vec::new();
        for ((w, _, log), instance) in servers.iter().zip(&instances) {
            let seen = gap(0, *w, log);
            let t = Instant::now();
            feed.apply(instance, &[seen]);
            driver.submit(feed.take_recoveries());
            let answer = driver.next().await;
            feed.recovered(answer);
            one_at_a_time.push(t.elapsed());
        }
        // Every worker at once: the logs move on first, then the router sees every
        // gap; each worker's time runs from its gap seen to its repair applied.
        let mut at_once = Vec::new();
        let mut driver = RecoveryDriver::new(RecoveryClientConfig::default());
        let seen: Vec<RouterEvent> = servers.iter().map(|(w, _, log)| gap(1, *w, log)).collect();
        let mut since = std::collections::HashMap::new();
        for (instance, seen) in instances.iter().zip(seen) {
            since.insert(instance.id.clone(), Instant::now());
            feed.apply(instance, &[seen]);
        }
        driver.submit(feed.take_recoveries());
        for _ in 0..workers {
            let answer = driver.next().await;
            let started = since[&answer.publisher];
            feed.recovered(answer);
            at_once.push(started.elapsed());
        }
        let stats = feed.stats();
        assert_eq!(stats.index.blocks, workers * (blocks + 24));
        assert_eq!(
            (
                stats.repairs_since,
                stats.wipes_recovery_failed,
                stats.wipes_id_gap
            ),
            (2 * workers, 0, 0)
        );
        let (p50, p99) = percentiles(one_at_a_time);
        let (all50, all99) = percentiles(at_once);
        println!(
            "gap repair (gap seen → index repaired): one worker at a time p50 {p50:.2} ms, \
             p99 {p99:.2} ms; {workers} workers at once p50 {all50:.1} ms, p99 {all99:.1} ms"
        );
    });
}
