//! Fan-in throughput: 1, 16 and 128 in-process `PubSocket`s → `DynamicSubscriber`
//! (MemoryDiscovery, `TopicSeq` layout) → a consumer using `recv_many`, beside one bare
//! `SubSocket` reading from one `PubSocket` in the same run. Messages are
//! `[4 B topic, 8 B seq, 100 B payload]`; publishers send in batches of 512 and wait
//! for their socket queue to drain, so they go as fast as the reader takes them.
//!
//! Then, outside criterion's timing: peak RSS while 128 publishers flood a subscriber
//! whose consumer never reads (printed as `subscriber_merge: …` lines).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::discovery::{
    ChannelId, Discovery, MemoryDiscovery, Query, Registration, Transport,
};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};

const BATCH: u64 = 512;

fn message(seq: u64) -> Message {
    Message::from_parts([
        Bytes::from_static(b"kvev"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from_static(&[0xab; 100]),
    ])
}

/// Sends `count` messages, waiting for the socket queue to drain every `BATCH`.
async fn pump(socket: &PubSocket, start: u64, count: u64) {
    let mut sent = 0;
    while sent < count {
        let n = BATCH.min(count - sent);
        for i in 0..n {
            socket.send(message(start + sent + i));
        }
        sent += n;
        socket.flush(Duration::from_secs(30)).await;
    }
}

struct Fleet {
    sockets: Vec<Arc<PubSocket>>,
    _guards: Vec<Registration>,
    sent: u64,
}

async fn fleet(d: &MemoryDiscovery, n: usize, config: Config) -> Fleet {
    let mut sockets = Vec::new();
    let mut guards = Vec::new();
    for i in 0..n {
        let s = PubSocket::bind("tcp://127.0.0.1:0", config.clone())
            .await
            .unwrap();
        let id = ChannelId::new("bench", "worker", "kv", i as u64).unwrap();
        guards.push(
            d.register(id, Transport::zmq(s.local_endpoint().unwrap()))
                .await
                .unwrap(),
        );
        sockets.push(Arc::new(s));
    }
    Fleet {
        sockets,
        _guards: guards,
        sent: 0,
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // First, so the process's peak RSS (VmHWM) is this scenario's.
    rss_under_flood(&rt);
    let mut group = c.benchmark_group("subscriber_merge/100B");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));

    // One bare SubSocket on one PubSocket.
    let (bare_pub, mut bare_sub) = rt.block_on(async {
        let p = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let mut s = SubSocket::connect(p.local_endpoint().unwrap(), Config::default())
            .await
            .unwrap();
        s.subscribe("kvev").await.unwrap();
        p.wait_for_subscribers(1).await;
        (Arc::new(p), s)
    });
    let mut bare_sent = 0u64;
    group.bench_function("bare_sub_socket/1", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                let p = bare_pub.clone();
                let from = bare_sent;
                let sender = tokio::spawn(async move { pump(&p, from, iters).await });
                let mut got = 0u64;
                let mut buf = Vec::with_capacity(1024);
                while got < iters {
                    buf.clear();
                    got += bare_sub.recv_many(&mut buf, 1024).await.unwrap() as u64;
                }
                sender.await.unwrap();
                bare_sent += iters;
                start.elapsed()
            })
        })
    });

    let mut report = Vec::new();
    for publishers in [1usize, 16, 128] {
        let memory = MemoryDiscovery::new();
        let mut fleet = rt.block_on(fleet(&memory, publishers, Config::default()));
        let mut sub = {
            let _guard = rt.enter();
            DynamicSubscriber::builder(Arc::new(memory.clone()), Query::new("bench"))
                .topic("kvev")
                .layout(Layout::TopicSeq)
                .spawn()
        };
        rt.block_on(async {
            for s in &fleet.sockets {
                s.wait_for_subscribers(1).await;
            }
        });
        group.bench_function(BenchmarkId::new("dynamic_subscriber", publishers), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let share = iters.div_ceil(publishers as u64);
                    let total = share * publishers as u64;
                    let start = Instant::now();
                    let from = fleet.sent;
                    let senders: Vec<_> = fleet
                        .sockets
                        .iter()
                        .cloned()
                        .map(|s| tokio::spawn(async move { pump(&s, from, share).await }))
                        .collect();
                    let dropped_before = sub.stats().total.dropped();
                    let mut got = 0u64;
                    let mut buf = Vec::with_capacity(1024);
                    // Delivered or dropped: the subscriber never blocks its publishers,
                    // so when the consumer falls behind some messages are dropped (and
                    // counted) rather than delayed.
                    while got < total {
                        buf.clear();
                        let polled = tokio::time::timeout(
                            Duration::from_millis(20),
                            sub.recv_many(&mut buf, 1024),
                        )
                        .await;
                        match polled {
                            Ok(n) => got += n as u64,
                            Err(_) => {
                                let dropped = sub.stats().total.dropped() - dropped_before;
                                if got + dropped >= total {
                                    break;
                                }
                            }
                        }
                    }
                    for s in senders {
                        s.await.unwrap();
                    }
                    fleet.sent += share;
                    // Report delivered messages per second: scale the time by
                    // sent / delivered (drops are printed separately).
                    start.elapsed().mul_f64(total as f64 / got.max(1) as f64)
                })
            })
        });
        let stats = sub.stats();
        report.push(format!(
            "{publishers} publishers: delivered {}, dropped {}",
            stats.total.delivered,
            stats.total.dropped()
        ));
        drop(sub);
    }
    group.finish();
    for line in report {
        eprintln!("subscriber_merge: {line}");
    }
}

fn rss_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// 128 publishers flood for 3 s while the consumer never reads. Publisher queues are
/// bounded at 256 KiB each so the publishers' own memory stays a fixed overhead.
fn rss_under_flood(rt: &tokio::runtime::Runtime) {
    const BUDGET: usize = 64 << 20;
    let memory = MemoryDiscovery::new();
    let pub_config = Config::builder()
        .send_queue_bytes(256 << 10)
        .build()
        .unwrap();
    let fleet = rt.block_on(fleet(&memory, 128, pub_config));
    let sub = {
        let _guard = rt.enter();
        DynamicSubscriber::builder(Arc::new(memory.clone()), Query::new("bench"))
            .topic("kvev")
            .layout(Layout::TopicSeq)
            .max_buffered_bytes(BUDGET)
            .spawn()
    };
    rt.block_on(async {
        for s in &fleet.sockets {
            s.wait_for_subscribers(1).await;
        }
    });
    let before = rss_kib("VmRSS:");
    let stop = Arc::new(AtomicBool::new(false));
    let mut max_buffered = 0;
    rt.block_on(async {
        let tasks: Vec<_> = fleet
            .sockets
            .iter()
            .cloned()
            .map(|s| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut seq = 0;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..64 {
                            s.send(message(seq));
                            seq += 1;
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for _ in 0..300 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            max_buffered = max_buffered.max(sub.stats().buffered_bytes);
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
    });
    let stats = sub.stats();
    let peak = rss_kib("VmHWM:");
    // Leave nothing running for the timed benchmarks.
    rt.block_on(async {
        sub.handle().shutdown().await;
        drop(sub);
        for s in fleet.sockets {
            if let Ok(s) = Arc::try_unwrap(s) {
                s.close(Duration::ZERO).await;
            }
        }
    });
    eprintln!(
        "subscriber_merge: 128-publisher flood, stalled consumer: RSS before {} MiB, peak {} MiB \
         (VmHWM), max_buffered_bytes {} MiB, buffered at most {:.1} MiB, \
         received {}, dropped {}",
        before / 1024,
        peak / 1024,
        BUDGET >> 20,
        max_buffered as f64 / (1 << 20) as f64,
        stats.total.received,
        stats.total.dropped()
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
