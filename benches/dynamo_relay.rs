//! The worker job as a process, side by side with Dynamo's: engine KV events in, Dynamo
//! frames out, through a real etcd (feature `etcd`).
//!
//! - `eventplane`: this bench re-executed as a child process running what `kv_relay
//!   --wire dynamo --etcd …` runs (`EngineListener → Processor → EventPlaneSink →
//!   EventPublisher` on Dynamo's wire, Dynamo's records in etcd);
//! - `dynamo`: NVIDIA Dynamo 1.6.1's own worker (`KvEventPublisher` relaying the
//!   engine, `tests/dynamo_live/dynamo_worker.py`; PyPI `ai-dynamo-runtime` in
//!   `target/dynamo-venv`, which `.ci/run` installs).
//!
//! Both relay an engine PUB in this process and are followed here by a
//! `DynamicSubscriber` on Dynamo's records and wire. One iteration sends a window of
//! 1024 engine events (64 vLLM batches of 16: stores of 4 chained blocks, then removes
//! of them) and a sentinel store, and waits until the sentinel's router event arrives:
//! a lossless closed loop; throughput in engine events per second through the whole
//! process. A window not through within 30 s fails the bench.
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

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use etcd_support::EtcdServer;
use eventplane::discovery::{Discovery, DynamoRecords, EtcdDiscovery, Query, RecordFormat};
use eventplane::kv::{
    EngineListener, EngineListenerConfig, EventPlaneSink, KvEventData, Processor, ProcessorConfig,
    WorkerId, decode_dynamo_router_events,
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::wire::Wire;
use eventplane::zmtp::{Config, Message, PubSocket};
use serde_json::json;

const CHILD_ENV: &str = "EVENTPLANE_BENCH_RELAY";
const WINDOW_BATCHES: u64 = 64;
const BATCH_EVENTS: u64 = 16;
const WINDOW_EVENTS: u64 = WINDOW_BATCHES * BATCH_EVENTS;
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
    engine: PubSocket,
    seq: u64,
    next_hash: u64,
    worker: Child,
    sub: DynamicSubscriber,
}

impl Rig {
    async fn start(which: &str, etcd: &str) -> Rig {
        let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let engine_ep = engine.local_endpoint().unwrap().to_owned();
        let namespace = format!("bench-{which}");
        let mut worker = match which {
            "eventplane" => Command::new(std::env::current_exe().unwrap())
                .env(CHILD_ENV, format!("{etcd} {namespace} {engine_ep}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
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
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        };
        let mut line = String::new();
        BufReader::new(worker.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "{which} worker did not start");
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
            engine,
            seq: 0,
            next_hash: 1 << 40,
            worker,
            sub,
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

    fn send(&mut self, payload: Vec<u8>) {
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
    }

    /// Sends a sentinel and waits (at most `wait`) for its router event.
    async fn sentinel_round(&mut self, wait: Duration) -> bool {
        let hash = self.next_hash;
        self.next_hash += 1;
        self.send(sentinel(hash));
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Ok(Some(d)) = tokio::time::timeout_at(deadline, self.sub.recv()).await else {
                return false;
            };
            let events = decode_dynamo_router_events(&d.payload().unwrap()).unwrap();
            let seen = events.iter().any(|e| match &e.event.data {
                KvEventData::Stored { blocks, .. } => blocks.iter().any(|b| b.block_hash.0 == hash),
                _ => false,
            });
            if seen {
                return true;
            }
        }
    }

    /// One window of engine events and its sentinel.
    async fn window(&mut self) {
        for _ in 0..WINDOW_BATCHES {
            let base = self.next_hash;
            self.next_hash += BATCH_EVENTS * 4;
            self.send(batch(base));
        }
        assert!(
            self.sentinel_round(DEADLINE).await,
            "a window did not come through"
        );
    }

    async fn stop(mut self) {
        let stats = self.sub.handle().stats().total;
        assert_eq!(stats.dropped(), 0, "{stats:?}");
        self.sub.handle().shutdown().await;
        drop(self.worker.stdin.take()); // EOF: the worker stops and unregisters
        let _ = self.worker.wait();
    }
}

/// The repository's root: this bench's crate is its `benches/` folder.
fn repo_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
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

/// The child: what `kv_relay --wire dynamo --etcd URL --namespace NS --component
/// kvworker` runs, until stdin closes.
fn run_relay(spec: &str) {
    let mut parts = spec.split(' ');
    let (etcd, namespace, engine) = (
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let discovery = EtcdDiscovery::builder([etcd])
            .record_format(RecordFormat::Dynamo(
                DynamoRecords::new().endpoint("generate").worker(77, 0),
            ))
            .connect()
            .await
            .unwrap();
        let publisher = EventPublisher::builder(
            Arc::new(discovery.clone()),
            namespace,
            "kvworker",
            "kv-events",
        )
        .wire(Wire::Dynamo)
        .build()
        .await
        .unwrap();
        let publisher = Arc::new(publisher);
        let sink = Arc::new(EventPlaneSink::new(publisher.clone()));
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let cancel = tokio_util::sync::CancellationToken::new();
        let listener = EngineListener::new(
            EngineListenerConfig::new(&engine, "kv", WorkerId(77), 4),
            tx,
        )
        .unwrap();
        let processor = Processor::new(ProcessorConfig::default(), rx, sink)
            .unwrap()
            .cancellation(&cancel);
        let listener = tokio::spawn(listener.cancellation(&cancel).run());
        let processor = tokio::spawn(processor.run());
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "ready").unwrap();
            out.flush().unwrap();
        }
        // Until the parent closes our stdin.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        })
        .await;
        cancel.cancel();
        let _ = listener.await;
        let _ = processor.await;
        if let Ok(p) = Arc::try_unwrap(publisher) {
            p.shutdown().await;
        }
        discovery.close().await;
    });
}

criterion_group!(benches, bench);

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        run_relay(&spec);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
