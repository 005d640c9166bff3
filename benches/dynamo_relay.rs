//! The worker job as a process, side by side with Dynamo's: engine KV events in, Dynamo
//! frames out, through a real etcd (feature `etcd`).
//!
//! - `eventplane`: the `kv-relay` service users run, `kv-relay --wire dynamo --etcd …`
//!   (`target/release/kv-relay`, built by `cargo build --release -p eventplane-services`: a
//!   current-thread `EngineListener → Processor → EventPlaneSink → EventPublisher` on
//!   Dynamo's wire, Dynamo's records in etcd);
//! - `dynamo`: NVIDIA Dynamo 1.6.1's own worker (`KvEventPublisher` relaying the
//!   engine, `tests/dynamo_live/dynamo_worker.py`; PyPI `ai-dynamo-runtime` in
//!   `target/dynamo-venv`, which `.ci/run` installs).
//!
//! Both relay an engine PUB in this process and are followed here by a
//! `DynamicSubscriber` on Dynamo's records and wire. Two stream shapes ([`Shape`]):
//! today's vLLM batches of 16 events (stores of 4 chained blocks, then their removes;
//! windows of 1,024 events) and decode-time streams of single-block stores with a
//! batched remove every 8–64 stores (64–256 events per batch; windows of ~4,100
//! events). Each sent two ways ([`Mode`]): flooded, windows back to back, and paced at
//! 50,000 engine events per second, batch by batch. One iteration sends a window and
//! a sentinel store and waits until the sentinel's router event arrives: a lossless
//! closed loop, checked as one: every delivery is decoded and each window must bring
//! exactly its stored and removed blocks (and the sentinel's) with no sequence gap
//! and no drop, and `kv_relay`, stopped with SIGTERM, must report every batch decoded,
//! every event processed and nothing dropped. Criterion reports engine events per
//! wall-clock second; the bench reads each worker's CPU time (all its threads) from
//! `/proc` and prints engine events per CPU-second (`dynamo_relay: SHAPE MODE WHO:`
//! lines), what a worker pays per event. A window not through within 30 s fails the
//! bench. `EVENTPLANE_KV_RELAY_BEFORE=path` adds another build of the relay (an
//! earlier commit's, with etcd), to compare two versions in one run.
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
#[path = "common/procfs.rs"]
mod procfs;
#[path = "common/relay.rs"]
mod relay;

#[path = "common/watchdog.rs"]
mod watchdog;

use eventplane::wire::Dialect;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use etcd_support::EtcdServer;
use eventplane::discovery::{Discovery, EtcdDiscovery, Query};
use eventplane::kv::KvEventData;
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket};
use procfs::cpu_time;
use relay::{Stderr, Tally, assert_relay_lossless, terminate_for_stats};
use serde_json::json;

/// Engine events per second in the paced mode: below what either worker can take, so
/// the CPU time measured is what relaying costs at a steady rate (each batch its own
/// wake-up), not what a backlog amortizes.
const PACED_EVENTS_PER_SECOND: f64 = 50_000.0;
const DEADLINE: Duration = Duration::from_secs(30);
/// Hashes of sentinels: far from any window's.
const SENTINEL_HASHES: u64 = 1 << 50;

/// What the engine sends.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// Today's vLLM-shaped batches of 16 events: 8 stores of 4 chained blocks (block
    /// size 4), then the 8 removes of them.
    FourBlock,
    /// vLLM at decode time: each `BlockStored` carries one block (block size 16),
    /// chained to the one before; every 8–64 stores, one `BlockRemoved` evicts them;
    /// 64–256 events per engine batch.
    SingleBlock,
}

/// One window of engine batches: what it stores it also removes, so neither worker's
/// state grows across windows and every window can be sent again unchanged.
struct Window {
    batches: Vec<(Vec<u8>, u64)>,
    events: u64,
    blocks: u64,
}

fn engine_batch(events: &[serde_json::Value]) -> Vec<u8> {
    rmp_serde::to_vec(&json!([1_700_000_000.5, events, 0])).unwrap()
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::FourBlock => "4_block",
            Shape::SingleBlock => "1_block",
        }
    }

    fn block_size(self) -> u64 {
        match self {
            Shape::FourBlock => 4,
            Shape::SingleBlock => 16,
        }
    }

    fn store(self, hashes: &[u64], parent: Option<u64>, tier: &str) -> serde_json::Value {
        let size = self.block_size();
        let tokens: Vec<u64> = (0..hashes.len() as u64 * size)
            .map(|t| (hashes[0] * size + t) % 50_000)
            .collect();
        json!([
            "BlockStored",
            hashes,
            parent,
            tokens,
            size,
            null,
            tier,
            null
        ])
    }

    fn window(self) -> Window {
        let mut events = Vec::new();
        let mut blocks = 0;
        let mut next = 1u64 << 40;
        let mut batches = Vec::new();
        match self {
            Shape::FourBlock => {
                for _ in 0..64 {
                    let mut batch = Vec::new();
                    let firsts: Vec<u64> = (0..8).map(|i| next + i * 4).collect();
                    next += 32;
                    for &first in &firsts {
                        let hashes: Vec<u64> = (first..first + 4).collect();
                        batch.push(self.store(&hashes, None, "GPU"));
                        blocks += 4;
                    }
                    for &first in &firsts {
                        let hashes: Vec<u64> = (first..first + 4).collect();
                        batch.push(json!(["BlockRemoved", hashes, "GPU"]));
                    }
                    batches.push((engine_batch(&batch), batch.len() as u64));
                }
            }
            Shape::SingleBlock => {
                // Groups of k single-block stores, each chained to the one before,
                // then one remove of all k.
                let mut group = 0u64;
                while events.len() < 4096 {
                    let k = 8 + group * 13 % 57;
                    group += 1;
                    let hashes: Vec<u64> = (next..next + k).collect();
                    next += k;
                    for (i, &h) in hashes.iter().enumerate() {
                        let parent = i.checked_sub(1).map(|p| hashes[p]);
                        events.push(self.store(&[h], parent, "GPU"));
                    }
                    events.push(json!(["BlockRemoved", hashes, "GPU"]));
                    blocks += k;
                }
                // 64–256 events per batch; a rest under 64 joins the last batch.
                let mut rest = &events[..];
                let mut b = 0u64;
                while !rest.is_empty() {
                    let mut n = (64 + b as usize * 37 % 193).min(rest.len());
                    b += 1;
                    if rest.len() - n < 64 {
                        n = rest.len();
                    }
                    let (head, tail) = rest.split_at(n);
                    batches.push((engine_batch(head), n as u64));
                    rest = tail;
                }
            }
        }
        let events = batches.iter().map(|(_, n)| n).sum();
        Window {
            batches,
            events,
            blocks,
        }
    }

    fn sentinel(self, hash: u64) -> Vec<u8> {
        engine_batch(&[self.store(&[hash], None, "CPU")])
    }
}

/// How the engine sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Batches back to back: what a worker does at most.
    Flood,
    /// [`PACED_EVENTS_PER_SECOND`], batch by batch (tokio's timer has 1 ms steps, so
    /// small batches go a few at a time).
    Paced,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Flood => "flood",
            Mode::Paced => "paced",
        }
    }
}

/// The engine, a worker process relaying it, and our subscriber following the worker.
struct Rig {
    which: &'static str,
    shape: Shape,
    window: Window,
    engine: PubSocket,
    seq: u64,
    events_sent: u64,
    next_hash: u64,
    worker: Child,
    stderr: Option<Stderr>,
    sub: DynamicSubscriber,
    tally: Tally,
    /// Engine events in measured windows, and the worker's CPU time over them.
    measured: (u64, Duration),
}

impl Rig {
    async fn start(which: &'static str, shape: Shape, etcd: &str) -> Rig {
        let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let engine_ep = engine.local_endpoint().unwrap().to_owned();
        let namespace = format!("bench-{which}-{}", shape.name());
        let block_size = shape.block_size().to_string();
        let mut worker = match which {
            "eventplane" | "eventplane_before" => Command::new(kv_relay(which))
                .args([
                    "--connect",
                    &engine_ep,
                    "--topic",
                    "kv",
                    "--block-size",
                    &block_size,
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
                .args(["--block-size", &block_size])
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
            "eventplane" | "eventplane_before" => line.starts_with("tcp://"),
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
            .dialect(Dialect::Dynamo)
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
            shape,
            window: shape.window(),
            engine,
            seq: 0,
            events_sent: 0,
            next_hash: SENTINEL_HASHES,
            worker,
            stderr: Some(stderr),
            sub,
            tally: Tally::default(),
            measured: (0, Duration::ZERO),
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
        self.send(self.shape.sentinel(hash), 1);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Ok(Some(d)) = tokio::time::timeout_at(deadline, self.sub.recv()).await else {
                return false;
            };
            let events = Dialect::Dynamo
                .decode_router_events(&d.payload().unwrap())
                .unwrap();
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

    /// One window of engine events and its sentinel, sent as `mode` says; asserts
    /// that exactly its blocks came out, with no gap or drop.
    async fn window(&mut self, mode: Mode) {
        let before = self.tally;
        let start = tokio::time::Instant::now();
        let mut sent = 0;
        for i in 0..self.window.batches.len() {
            if mode == Mode::Paced {
                let due = Duration::from_secs_f64(sent as f64 / PACED_EVENTS_PER_SECOND);
                tokio::time::sleep_until(start + due).await;
            }
            let (payload, events) = self.window.batches[i].clone();
            self.send(payload, events);
            sent += events;
        }
        assert!(
            self.sentinel_round(DEADLINE).await,
            "a window did not come through"
        );
        let came = self.tally.since(&before);
        let total = self.sub.handle().stats().total;
        assert_eq!(
            (came.stored_blocks, came.removed_blocks),
            (self.window.blocks + 1, self.window.blocks),
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

    /// Prints what `mode` cost the worker per engine event, and starts counting anew.
    fn report(&mut self, mode: Mode) {
        let (events, cpu) = std::mem::take(&mut self.measured);
        if events == 0 {
            return; // filtered out
        }
        let per_cpu_second = if cpu >= Duration::from_millis(100) {
            format!("{:.3} M", events as f64 / cpu.as_secs_f64() / 1e6)
        } else {
            "too little CPU time to tell".to_owned()
        };
        eprintln!(
            "dynamo_relay: {} {} {}: {events} engine events in {:.2} CPU-s of the worker: \
             {per_cpu_second} per CPU-second",
            self.shape.name(),
            mode.name(),
            self.which,
            cpu.as_secs_f64(),
        );
    }

    async fn stop(mut self) {
        self.sub.handle().shutdown().await;
        let stderr = self.stderr.take().unwrap();
        if self.which == "eventplane" {
            // SIGTERM: it publishes what it holds, deletes its records, prints stats.
            let stats = terminate_for_stats(&mut self.worker, stderr);
            assert_relay_lossless("kv_relay", &stats, self.seq, self.events_sent);
        } else if self.which == "eventplane_before" {
            // Another build's stats need not have today's fields: its output was checked.
            drop(relay::terminate(&mut self.worker, stderr));
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

/// The `kv-relay` service next to this bench's binary (`cargo build --release -p
/// eventplane-services`).
fn kv_relay(which: &str) -> PathBuf {
    if which == "eventplane_before" {
        return PathBuf::from(std::env::var_os("EVENTPLANE_KV_RELAY_BEFORE").unwrap());
    }
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("kv-relay");
    assert!(
        path.exists(),
        "{} missing: cargo build --release -p eventplane-services",
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
    for shape in [Shape::FourBlock, Shape::SingleBlock] {
        let mut group = c.benchmark_group(format!("worker_process/{}", shape.name()));
        group.sample_size(10);
        group.measurement_time(Duration::from_secs(10));
        group.throughput(Throughput::Elements(shape.window().events));
        // Another build of kv_relay (with feature `etcd`) to compare in the same run.
        let before = std::env::var_os("EVENTPLANE_KV_RELAY_BEFORE").map(|_| "eventplane_before");
        for which in ["eventplane"].into_iter().chain(before).chain(["dynamo"]) {
            let mut rig = Some(rt.block_on(Rig::start(which, shape, &url)));
            for mode in [Mode::Flood, Mode::Paced] {
                group.bench_function(format!("{}/{which}", mode.name()), |b| {
                    b.iter_custom(|iters| {
                        let rig = rig.as_mut().unwrap();
                        rt.block_on(async {
                            let pid = rig.worker.id();
                            let (start, cpu) = (Instant::now(), cpu_time(pid));
                            for _ in 0..iters {
                                rig.window(mode).await;
                            }
                            rig.measured.0 += iters * rig.window.events;
                            rig.measured.1 += cpu_time(pid).saturating_sub(cpu);
                            start.elapsed()
                        })
                    })
                });
                rig.as_mut().unwrap().report(mode);
            }
            rt.block_on(rig.take().unwrap().stop());
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
