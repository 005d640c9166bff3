//! Fan-in throughput: 1, 16 and 128 in-process `PubSocket`s → `DynamicSubscriber`
//! (MemoryDiscovery, `TopicSeq` layout) → a consumer using `recv_many`, beside one bare
//! `SubSocket` reading from one `PubSocket` in the same run. Messages are
//! `[4 B topic, 8 B seq, 100 B payload]`. Both paths run the same closed loop: each
//! publisher sends a batch of 512, then waits until the consumer has received every
//! batch but the last one of every publisher (`Window`). So at most two batches per
//! publisher are in flight, the lanes never overflow, and both paths are lossless:
//! the bench asserts zero drops, so the figures compare like with like.
//!
//! Then, outside criterion's timing: peak RSS while 128 publishers flood a subscriber
//! whose consumer never reads, asserted against the budgets (printed as
//! `subscriber_merge: …` lines).
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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::discovery::{
    ChannelId, Discovery, MemoryDiscovery, Query, Registration, Transport,
};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use procfs::status_kib;

const BATCH: u64 = 512;
/// Generous bound on what the flood waits for (its budget filled), so a bug fails the
/// run instead of hanging it. Not a timing assertion.
const DEADLINE: Duration = Duration::from_secs(30);

fn message(seq: u64) -> Message {
    Message::from_parts([
        Bytes::from_static(b"kvev"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from_static(&[0xab; 100]),
    ])
}

/// What the consumer has received, for the publishers' closed loop.
#[derive(Default)]
struct Window {
    received: AtomicU64,
    progress: tokio::sync::Notify,
}

impl Window {
    fn add(&self, n: u64) {
        self.received.fetch_add(n, Ordering::Release);
        self.progress.notify_waiters();
    }

    async fn reach(&self, n: u64) {
        loop {
            let notified = self.progress.notified();
            if self.received.load(Ordering::Acquire) >= n {
                return;
            }
            notified.await;
        }
    }
}

/// Sends `count` messages in batches of `BATCH`; before batch k, waits until the
/// consumer has received batches 0..k-1 of all `publishers` (counted from `base`).
async fn pump(
    socket: &PubSocket,
    start: u64,
    count: u64,
    window: &Window,
    base: u64,
    publishers: u64,
) {
    let mut sent = 0;
    while sent < count {
        window
            .reach(base + sent.saturating_sub(BATCH) * publishers)
            .await;
        let n = BATCH.min(count - sent);
        for i in 0..n {
            let report = socket.send(message(start + sent + i));
            assert_eq!(report.dropped, 0, "the publisher's queue overflowed");
        }
        sent += n;
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
        let id = ChannelId::new("bench", "worker", "kvev", i as u64).unwrap();
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

/// `iters` messages (rounded up to a share per publisher) from every publisher of
/// `fleet` to `sub`'s consumer through the closed loop; returns the time it took.
async fn fan_in(
    sub: &mut DynamicSubscriber,
    fleet: &mut Fleet,
    window: &Arc<Window>,
    received: &mut u64,
    iters: u64,
) -> Duration {
    let publishers = fleet.sockets.len() as u64;
    let share = iters.div_ceil(publishers);
    let total = share * publishers;
    let start = Instant::now();
    let from = fleet.sent;
    let base = *received;
    let senders: Vec<_> = fleet
        .sockets
        .iter()
        .cloned()
        .map(|s| {
            let window = window.clone();
            tokio::spawn(async move { pump(&s, from, share, &window, base, publishers).await })
        })
        .collect();
    let mut got = 0u64;
    let mut buf = Vec::with_capacity(1024);
    while got < total {
        buf.clear();
        let n = tokio::time::timeout(Duration::from_secs(10), sub.recv_many(&mut buf, 1024))
            .await
            .expect("lossless: every message arrives") as u64;
        got += n;
        window.add(n);
    }
    for s in senders {
        s.await.unwrap();
    }
    fleet.sent += share;
    *received += got;
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    watchdog::arm("subscriber_merge", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // First, so the process's peak RSS (VmHWM) is this scenario's.
    rss_under_flood(&rt);
    let mut report = Vec::new();
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
    let bare_window = Arc::new(Window::default());
    group.bench_function("bare_sub_socket/1", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                let p = bare_pub.clone();
                let from = bare_sent;
                let window = bare_window.clone();
                let sender =
                    tokio::spawn(async move { pump(&p, from, iters, &window, from, 1).await });
                let mut got = 0u64;
                let mut buf = Vec::with_capacity(1024);
                while got < iters {
                    buf.clear();
                    let n = tokio::time::timeout(
                        Duration::from_secs(10),
                        bare_sub.recv_many(&mut buf, 1024),
                    )
                    .await
                    .expect("lossless: every message arrives")
                    .unwrap() as u64;
                    got += n;
                    bare_window.add(n);
                }
                sender.await.unwrap();
                bare_sent += iters;
                start.elapsed()
            })
        })
    });
    let bare = bare_pub.stats();
    report.push(format!(
        "bare: sent {}, received {bare_sent}, dropped {}",
        bare.messages, bare.dropped
    ));
    assert_eq!(bare.dropped, 0);

    for publishers in [1usize, 16, 128] {
        let memory = MemoryDiscovery::new();
        let mut fleet = rt.block_on(fleet(&memory, publishers, Config::default()));
        let mut sub = {
            let _guard = rt.enter();
            DynamicSubscriber::builder(Arc::new(memory.clone()), Query::new("bench"))
                .topic("kvev")
                .layout(Layout::TopicSeq)
                // Two batches of 512 per publisher fit in each lane.
                .lane_bytes(1 << 20)
                .max_buffered_bytes(publishers << 20)
                .spawn()
                .unwrap()
        };
        rt.block_on(async {
            for s in &fleet.sockets {
                s.wait_for_subscribers(1).await;
            }
        });
        let window = Arc::new(Window::default());
        let mut received = 0u64;
        // Under load before timing (criterion's test mode runs one message per
        // iteration): 32 batches per publisher through the same loop, lossless.
        rt.block_on(fan_in(
            &mut sub,
            &mut fleet,
            &window,
            &mut received,
            32 * BATCH * publishers as u64,
        ));
        assert_eq!(sub.stats().total.dropped(), 0, "{:?}", sub.stats().total);
        group.bench_function(BenchmarkId::new("dynamic_subscriber", publishers), |b| {
            b.iter_custom(|iters| {
                rt.block_on(fan_in(&mut sub, &mut fleet, &window, &mut received, iters))
            })
        });
        let stats = sub.stats();
        report.push(format!(
            "{publishers} publishers: delivered {}, dropped {}, copied under retention {}",
            stats.total.delivered,
            stats.total.dropped(),
            stats.copied_messages
        ));
        // Lossless on both sides: no drop here, no gap (a publisher-side drop).
        assert_eq!(
            (stats.total.dropped(), stats.total.gap_messages),
            (0, 0),
            "{:?}",
            stats.total
        );
        assert_eq!(stats.total.delivered, received);
        drop(sub);
    }
    group.finish();
    for line in report {
        eprintln!("subscriber_merge: {line}");
    }
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
            .unwrap()
    };
    rt.block_on(async {
        for s in &fleet.sockets {
            s.wait_for_subscribers(1).await;
        }
    });
    let before = status_kib("self", "VmRSS:");
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
        // At least 3 s, and until the flood has filled half the budget (the premise
        // of the bound below), for at most DEADLINE.
        let flooding = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            max_buffered = max_buffered.max(sub.stats().buffered_bytes);
            let elapsed = flooding.elapsed();
            if (elapsed >= Duration::from_secs(3) && max_buffered > BUDGET / 2)
                || elapsed >= DEADLINE
            {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
    });
    let stats = sub.stats();
    let peak = status_kib("self", "VmHWM:");
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
    // The bound the process must hold: the lanes' budget, the retained read buffers
    // (8 MiB by default), and per publisher its own queue (256 KiB here) plus the
    // fixed connection buffers on both ends (at most 4 × 64 KiB), plus allocator slack.
    let per_publisher = (256 << 10) + 4 * (64 << 10);
    let bound = BUDGET + (8 << 20) + 128 * per_publisher + (32 << 20);
    let grown = (peak.saturating_sub(before) as usize) << 10;
    assert!(
        grown <= bound,
        "peak RSS grew by {} MiB, over the {} MiB the budgets allow",
        grown >> 20,
        bound >> 20
    );
    assert!(max_buffered <= BUDGET, "{max_buffered} > {BUDGET}");
    assert!(
        max_buffered > BUDGET / 2,
        "the flood buffered at most {max_buffered} B in {DEADLINE:?}, never half the \
         {BUDGET} B budget: the bound above proves nothing"
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
