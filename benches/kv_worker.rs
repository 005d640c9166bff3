//! The KV worker as a process: the `kv-relay` service (`EngineListener → Processor →
//! EventPlaneSink → EventPublisher`, our wire, no discovery) relaying an engine that
//! this bench plays in Rust (a `PubSocket`, so nothing here is Python).
//!
//! The stream is vLLM-shaped: batches of 64 `BlockStored` events of 4 chained blocks
//! each, every store batch followed by a batch of the 64 `BlockRemoved` that undo it
//! (so the worker's state does not grow). One iteration sends a window of
//! [`WINDOW_BATCHES`] batches and a sentinel store, then waits until a plain
//! `SubSocket` on the relay's output sees the sentinel's router event: a lossless
//! closed loop, and checked as one: every message on the relay's output is decoded,
//! each window must bring exactly its 8,192 stored and 8,192 removed blocks (and the
//! sentinel's), with no sequence gap, and at the end the relay (stopped with SIGTERM)
//! must report every batch decoded, every event processed and nothing dropped.
//! Criterion reports engine events per wall-clock second through the whole process;
//! the bench also reads the relay's CPU time from `/proc` and prints engine events per
//! CPU-second (`kv_worker: …` lines), the figure that says what a worker pays per
//! event.
//!
//! Build it first (`cargo build --release -p eventplane-services`; `.ci/run` does).
//! `EVENTPLANE_KV_RELAY_BEFORE=path` adds another build of it (an earlier commit's
//! `kv_relay` example), to compare two versions in one run.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "common/procfs.rs"]
mod procfs;
#[path = "common/relay.rs"]
mod relay;

#[path = "common/watchdog.rs"]
mod watchdog;

use eventplane::wire::Dialect;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::kv::KvEventData;
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use procfs::{cpu_time, status_kib};
use relay::{Stderr, Tally, assert_relay_lossless, terminate, terminate_for_stats};
use serde_json::json;

/// Engine events per batch.
const BATCH_EVENTS: u64 = 64;
/// Batches per window: half stores, half removes.
const WINDOW_BATCHES: u64 = 64;
const WINDOW_EVENTS: u64 = WINDOW_BATCHES * BATCH_EVENTS;
const BLOCKS: u64 = 4;
/// Blocks a window stores, and then removes.
const WINDOW_BLOCKS: u64 = WINDOW_BATCHES / 2 * BATCH_EVENTS * BLOCKS;
const DEADLINE: Duration = Duration::from_secs(30);

/// 64 stores of 4 chained blocks from `base` on, vLLM ≤ 0.23 arrays.
fn stores(base: u64) -> Vec<u8> {
    let events: Vec<_> = (0..BATCH_EVENTS)
        .map(|i| {
            let first = base + i * BLOCKS;
            let hashes: Vec<u64> = (first..first + BLOCKS).collect();
            let tokens: Vec<u64> = (0..BLOCKS * 16)
                .map(|t| (first * 16 + t) % 50_000)
                .collect();
            let parent = (i > 0).then_some(first - 1);
            json!(["BlockStored", hashes, parent, tokens, 16, null, "GPU", null])
        })
        .collect();
    rmp_serde::to_vec(&json!([1_700_000_000.5, events, 0])).unwrap()
}

/// The 64 removes undoing [`stores`]`(base)`.
fn removes(base: u64) -> Vec<u8> {
    let events: Vec<_> = (0..BATCH_EVENTS)
        .map(|i| {
            let first = base + i * BLOCKS;
            let hashes: Vec<u64> = (first..first + BLOCKS).collect();
            json!(["BlockRemoved", hashes, "GPU"])
        })
        .collect();
    rmp_serde::to_vec(&json!([1_700_000_000.5, events, 0])).unwrap()
}

fn sentinel(hash: u64) -> Vec<u8> {
    let tokens: Vec<u64> = (1..=16).collect();
    let event = json!(["BlockStored", [hash], null, tokens, 16, null, "CPU", null]);
    rmp_serde::to_vec(&json!([1_700_000_000.5, [event], 0])).unwrap()
}

/// The engine, one relay process and a subscriber on its output.
struct Rig {
    engine: PubSocket,
    seq: u64,
    next_hash: u64,
    relay: Child,
    stderr: Option<Stderr>,
    sub: SubSocket,
    batch: Vec<Message>,
    /// Engine events in measured windows.
    events: u64,
    /// Engine events sent in all (sentinels included).
    events_sent: u64,
    /// What came out, from every message on the relay's output.
    tally: Tally,
    /// The relay's next output sequence number, once one was seen.
    next_out_seq: Option<u64>,
    /// Output sequence numbers skipped.
    gaps: u64,
    cpu: Duration,
}

impl Rig {
    async fn start(program: &Path) -> Rig {
        let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let engine_ep = engine.local_endpoint().unwrap().to_owned();
        let mut relay = Command::new(program)
            .args([
                "--connect",
                &engine_ep,
                "--topic",
                "kv",
                "--block-size",
                "16",
            ])
            .args(["--worker-id", "1", "--bind", "tcp://127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Stderr::drain(&mut relay);
        let mut line = String::new();
        BufReader::new(relay.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let mut sub = SubSocket::connect(line.trim(), Config::default())
            .await
            .unwrap();
        sub.subscribe("kv-events").await.unwrap();
        tokio::time::timeout(DEADLINE, engine.wait_for_subscribers(1))
            .await
            .expect("the relay never subscribed to the engine");
        let mut rig = Rig {
            engine,
            seq: 0,
            next_hash: 1 << 40,
            relay,
            stderr: Some(stderr),
            sub,
            batch: Vec::new(),
            events: 0,
            events_sent: 0,
            tally: Tally::default(),
            next_out_seq: None,
            gaps: 0,
            cpu: Duration::ZERO,
        };
        // Until the relay's publisher has our subscription: sentinels (what the relay
        // published before it had our subscription is not ours to count).
        let until = Instant::now() + DEADLINE;
        while !rig.sentinel_round(Duration::from_millis(300)).await {
            assert!(Instant::now() < until, "nothing came through the relay");
        }
        rig
    }

    fn send(&mut self, payload: Vec<u8>, events: u64) {
        self.events_sent += events;
        let report = self.engine.send(Message::from_parts([
            b"kv".to_vec(),
            self.seq.to_be_bytes().to_vec(),
            payload,
        ]));
        assert_eq!(
            report.dropped, 0,
            "the engine dropped: the relay fell behind"
        );
        self.seq += 1;
    }

    /// Sends a sentinel and waits (at most `wait`) for its router event, decoding,
    /// tallying and sequence-checking every message on the way.
    async fn sentinel_round(&mut self, wait: Duration) -> bool {
        let hash = self.next_hash;
        self.next_hash += 1;
        self.send(sentinel(hash), 1);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            self.batch.clear();
            let Ok(received) =
                tokio::time::timeout_at(deadline, self.sub.recv_many(&mut self.batch, 256)).await
            else {
                return false;
            };
            received.unwrap();
            let mut seen = false;
            for message in &self.batch {
                let seq = u64::from_be_bytes(message.get(2).unwrap().try_into().unwrap());
                if let Some(next) = self.next_out_seq {
                    self.gaps += seq.saturating_sub(next);
                }
                self.next_out_seq = Some(seq + 1);
                let events = Dialect::EventPlane
                    .decode_router_events(message.get(3).unwrap())
                    .unwrap();
                self.tally.add(&events);
                seen |= events.iter().any(|e| match &e.event.data {
                    KvEventData::Stored { blocks, .. } => {
                        blocks.iter().any(|b| b.block_hash.0 == hash)
                    }
                    _ => false,
                });
            }
            if seen {
                return true;
            }
        }
    }

    /// One window of engine events and its sentinel; asserts that exactly its blocks
    /// came out, with no gap.
    async fn window(&mut self) {
        let before = self.tally;
        for _ in 0..WINDOW_BATCHES / 2 {
            let base = self.next_hash;
            self.next_hash += BATCH_EVENTS * BLOCKS;
            self.send(stores(base), BATCH_EVENTS);
            self.send(removes(base), BATCH_EVENTS);
        }
        assert!(
            self.sentinel_round(DEADLINE).await,
            "a window did not come through"
        );
        let came = self.tally.since(&before);
        assert_eq!(
            (came.stored_blocks, came.removed_blocks, self.gaps),
            (WINDOW_BLOCKS + 1, WINDOW_BLOCKS, 0),
            "a window's blocks (stored with the sentinel, removed) and output gaps"
        );
        self.events += WINDOW_EVENTS;
    }

    fn stop(mut self, name: &str) {
        let peak = status_kib(&self.relay.id().to_string(), "VmHWM:");
        let stderr = self.stderr.take().unwrap();
        if name == "kv_relay" {
            let stats = terminate_for_stats(&mut self.relay, stderr);
            assert_relay_lossless(name, &stats, self.seq, self.events_sent);
        } else {
            // Another build's stats need not have today's fields: its output was checked.
            drop(terminate(&mut self.relay, stderr));
        }
        let per_cpu_second = if self.cpu >= Duration::from_millis(100) {
            format!("{:.2} M", self.events as f64 / self.cpu.as_secs_f64() / 1e6)
        } else {
            "too little CPU time to tell".to_owned()
        };
        eprintln!(
            "kv_worker: {name}: {} engine events in {:.2} CPU-s of the relay: {per_cpu_second} \
             per CPU-second; relay peak RSS {:.1} MiB",
            self.events,
            self.cpu.as_secs_f64(),
            peak as f64 / 1024.0,
        );
    }
}

fn kv_relay() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("kv-relay");
    path.exists().then_some(path)
}

fn bench(c: &mut Criterion) {
    watchdog::arm("kv_worker", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut programs = Vec::new();
    match kv_relay() {
        Some(p) => programs.push(("kv_relay", p)),
        None => {
            // In test mode (.ci/run) a missing binary is a failure, not a skipped claim.
            assert!(
                !std::env::args().any(|a| a == "--test"),
                "target/release/kv-relay is missing: cargo build --release -p eventplane-services"
            );
            eprintln!(
                "kv_worker: target/release/kv-relay is missing \
                 (cargo build --release -p eventplane-services); skipping it"
            )
        }
    }
    if let Some(p) = std::env::var_os("EVENTPLANE_KV_RELAY_BEFORE") {
        programs.push(("kv_relay_before", PathBuf::from(p)));
    }
    let mut group = c.benchmark_group("kv_worker/vllm_64");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Elements(WINDOW_EVENTS));
    for (name, program) in programs {
        let mut rig = Some(rt.block_on(Rig::start(&program)));
        group.bench_function(BenchmarkId::new("eventplane", name), |b| {
            b.iter_custom(|iters| {
                let rig = rig.as_mut().unwrap();
                rt.block_on(async {
                    let (start, cpu) = (Instant::now(), cpu_time(rig.relay.id()));
                    for _ in 0..iters {
                        rig.window().await;
                    }
                    rig.cpu += cpu_time(rig.relay.id()).saturating_sub(cpu);
                    start.elapsed()
                })
            })
        });
        rig.take().unwrap().stop(name);
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
