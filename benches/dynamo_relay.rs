//! The worker job as a process, side by side with Dynamo's: engine KV events in, Dynamo
//! frames out, through a real etcd (feature `etcd`).
//!
//! - `eventplane`: the `kv_relay` example users run, `kv_relay --wire dynamo --etcd …`
//!   (`target/release/examples/kv_relay`, built with `--features etcd`: a
//!   current-thread `EngineListener → Processor → EventPlaneSink → EventPublisher` on
//!   Dynamo's wire, Dynamo's records in etcd);
//! - `dynamo`: NVIDIA Dynamo 1.6.1's own worker (`KvEventPublisher` relaying the
//!   engine, `tests/dynamo_live/dynamo_worker.py`; PyPI `ai-dynamo-runtime` in
//!   `target/dynamo-venv`, which `.ci/run` installs).
//!
//! Both relay an engine PUB in this process and are followed here by a
//! `DynamicSubscriber` on Dynamo's records and wire. One iteration sends a window of
//! 1024 engine events (64 vLLM batches of 16: stores of 4 chained blocks, then removes
//! of them) and a sentinel store, and waits until the sentinel's router event arrives:
//! a lossless closed loop, checked as one: every delivery is decoded and each window
//! must bring exactly its 2,048 stored and 2,048 removed blocks (and the sentinel's)
//! with no sequence gap and no drop, and `kv_relay`, stopped with SIGTERM, must report
//! every batch decoded, every event processed and nothing dropped. Throughput in
//! engine events per second through the whole process. A window not through within
//! 30 s fails the bench.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    dead_code,
    unreachable_pub
)]

#[path = "../tests/support/etcd.rs"]
mod etcd_support;
#[path = "common/relay.rs"]
mod relay;

#[path = "common/watchdog.rs"]
mod watchdog;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use etcd_support::EtcdServer;
use eventplane::discovery::{Discovery, DynamoRecords, EtcdDiscovery, Query, RecordFormat};
use eventplane::kv::{KvEventData, decode_dynamo_router_events};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket};
use relay::{Stderr, Tally, assert_relay_lossless, terminate_for_stats};
use serde_json::json;

const WINDOW_BATCHES: u64 = 64;
const BATCH_EVENTS: u64 = 16;
const WINDOW_EVENTS: u64 = WINDOW_BATCHES * BATCH_EVENTS;
/// Blocks a window stores, and then removes.
const WINDOW_BLOCKS: u64 = WINDOW_BATCHES * BATCH_EVENTS / 2 * 4;
const DEADLINE: Duration = Duration::from_secs(30);

/// One engine batch, vLLM ≤ 0.23 arrays: 8 stores of 4 chained blocks, then the 8
/// removes of those blocks (so neither worker's state grows across windows).
fn batch(base: u64) -> Vec<u8> {
    let mut events = Vec::new();
    for i in 0..BATCH_EVENTS / 2 {
        let first = base + i * 4;
        let hashes: Vec<u64> = (first..first + 4).collect();
        let tokens: Vec<u64> = (0..16).map(|t| (first * 16 + t) % 50_000).collect();
        events.push(json!([
            "BlockStored",
            hashes,
            null,
            tokens,
            4,
            null,
            "GPU",
            null
        ]));
    }
    for i in 0..BATCH_EVENTS / 2 {
        let first = base + i * 4;
        let hashes: Vec<u64> = (first..first + 4).collect();
        events.push(json!(["BlockRemoved", hashes, "GPU"]));
    }
    rmp_serde::to_vec(&json!([1_700_000_000.5, events, 0])).unwrap()
}

fn sentinel(hash: u64) -> Vec<u8> {
    let event = json!([
        "BlockStored",
        [hash],
        null,
        [1, 2, 3, 4],
        4,
        null,
        "CPU",
        null
    ]);
    rmp_serde::to_vec(&json!([1_700_000_000.5, [event], 0])).unwrap()
}

/// The engine, a worker process relaying it, and our subscriber following the worker.
struct Rig {
    which: &'static str,
    engine: PubSocket,
    seq: u64,
    events_sent: u64,
    next_hash: u64,
    worker: Child,
    stderr: Option<Stderr>,
    sub: DynamicSubscriber,
    tally: Tally,
}

impl Rig {
    async fn start(which: &'static str, etcd: &str) -> Rig {
        let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let engine_ep = engine.local_endpoint().unwrap().to_owned();
        let namespace = format!("bench-{which}");
        let mut worker = match which {
            "eventplane" => Command::new(kv_relay())
                .args([
                    "--connect",
                    &engine_ep,
                    "--topic",
                    "kv",
                    "--block-size",
                    "4",
                ])
                .args(["--worker-id", "77", "--bind", "tcp://127.0.0.1:0"])
                .args([
                    "--wire",
                    "dynamo",
                    "--etcd",
                    etcd,
                    "--namespace",
                    &namespace,
                ])
                .args(["--component", "kvworker", "--endpoint", "generate"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            _ => Command::new(dynamo_python())
                .arg(repo_root().join("tests/dynamo_live/dynamo_worker.py"))
                .args([
                    "--etcd",
                    etcd,
                    "--namespace",
                    &namespace,
                    "--component",
                    "kvworker",
                ])
                .args(["--engine-endpoint", &engine_ep, "--engine-topic", "kv"])
                .env("DYN_LOG", "error")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        };
        let stderr = Stderr::drain(&mut worker);
        let mut line = String::new();
        BufReader::new(worker.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // kv_relay prints its endpoint, Dynamo's script "ready".
        let started = match which {
            "eventplane" => line.starts_with("tcp://"),
            _ => line.trim() == "ready",
        };
        if !started {
            let _ = worker.kill();
            panic!(
                "{which} worker did not start: {line:?}\n{}",
                stderr.finish()
            );
        }
        tokio::time::timeout(DEADLINE, engine.wait_for_subscribers(1))
            .await
            .expect("the worker never subscribed to the engine");
        let discovery = EtcdDiscovery::builder([etcd])
            .record_format(RecordFormat::Dynamo(DynamoRecords::new()))
            .connect()
            .await
            .unwrap();
        let sub = DynamicSubscriber::builder(
            Arc::new(discovery) as Arc<dyn Discovery>,
            Query::new(namespace),
        )
        .topic("kv-events")
        .layout(Layout::Dynamo)
        .spawn()
        .unwrap();
        let mut rig = Rig {
            which,
            engine,
            seq: 0,
            events_sent: 0,
            next_hash: 1 << 40,
            worker,
            stderr: Some(stderr),
            sub,
            tally: Tally::default(),
        };
        // Until the subscriber is through: sentinels.
        let until = Instant::now() + DEADLINE;
        loop {
            assert!(Instant::now() < until, "{which}: nothing came through");
            if rig.sentinel_round(Duration::from_millis(300)).await {
                break;
            }
        }
        rig
    }

    fn send(&mut self, payload: Vec<u8>, events: u64) {
        let report = self.engine.send(Message::from_parts([
            b"kv".to_vec(),
            self.seq.to_be_bytes().to_vec(),
            payload,
        ]));
        assert_eq!(
            report.dropped, 0,
            "the engine dropped: a worker fell behind"
        );
        self.seq += 1;
        self.events_sent += events;
    }

    /// Sends a sentinel and waits (at most `wait`) for its router event, decoding and
    /// tallying every delivery on the way.
    async fn sentinel_round(&mut self, wait: Duration) -> bool {
        let hash = self.next_hash;
        self.next_hash += 1;
        self.send(sentinel(hash), 1);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Ok(Some(d)) = tokio::time::timeout_at(deadline, self.sub.recv()).await else {
                return false;
            };
            let events = decode_dynamo_router_events(&d.payload().unwrap()).unwrap();
            self.tally.add(&events);
            let seen = events.iter().any(|e| match &e.event.data {
                KvEventData::Stored { blocks, .. } => blocks.iter().any(|b| b.block_hash.0 == hash),
                _ => false,
            });
            if seen {
                return true;
            }
        }
    }

    /// One window of engine events and its sentinel; asserts that exactly its blocks
    /// came out, with no gap or drop.
    async fn window(&mut self) {
        let before = self.tally;
        for _ in 0..WINDOW_BATCHES {
            let base = self.next_hash;
            self.next_hash += BATCH_EVENTS * 4;
            self.send(batch(base), BATCH_EVENTS);
        }
        assert!(
            self.sentinel_round(DEADLINE).await,
            "a window did not come through"
        );
        let came = self.tally.since(&before);
        let total = self.sub.handle().stats().total;
        assert_eq!(
            (came.stored_blocks, came.removed_blocks),
            (WINDOW_BLOCKS + 1, WINDOW_BLOCKS),
            "{}: a window's blocks (stored with the sentinel, removed); {total:?}",
            self.which
        );
        assert_eq!(
            (total.gaps, total.gap_messages, total.dropped()),
            (0, 0, 0),
            "{}: {total:?}",
            self.which
        );
    }

    async fn stop(mut self) {
        self.sub.handle().shutdown().await;
        let stderr = self.stderr.take().unwrap();
        if self.which == "eventplane" {
            // SIGTERM: it publishes what it holds, deletes its records, prints stats.
            let stats = terminate_for_stats(&mut self.worker, stderr);
            assert_relay_lossless("kv_relay", &stats, self.seq, self.events_sent);
        } else {
            drop(self.worker.stdin.take()); // EOF: the worker stops and unregisters
            let _ = self.worker.wait();
            drop(stderr.finish());
        }
    }
}

/// The repository's root: this bench's crate is its `benches/` folder.
fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The `kv_relay` example next to this bench's binary (a release build with feature
/// `etcd`).
fn kv_relay() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/kv_relay");
    assert!(
        path.exists(),
        "{} missing: cargo build --release --features etcd --example kv_relay",
        path.display()
    );
    path
}

fn dynamo_python() -> PathBuf {
    let path = std::env::var_os("EVENTPLANE_DYNAMO_PYTHON").map_or_else(
        || repo_root().join("target/dynamo-venv/bin/python"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "{} missing: run .ci/run (it installs Dynamo)",
        path.display()
    );
    path
}

fn bench(c: &mut Criterion) {
    watchdog::arm("dynamo_relay", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let etcd = rt.block_on(EtcdServer::start());
    let url = etcd.url();
    let mut group = c.benchmark_group("worker_process");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Elements(WINDOW_EVENTS));
    for which in ["eventplane", "dynamo"] {
        let mut rig = Some(rt.block_on(Rig::start(which, &url)));
        group.bench_function(which, |b| {
            b.iter_custom(|iters| {
                let rig = rig.as_mut().unwrap();
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        rig.window().await;
                    }
                    start.elapsed()
                })
            })
        });
        rt.block_on(rig.take().unwrap().stop());
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
