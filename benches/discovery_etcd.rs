//! `EtcdDiscovery` on a real local etcd (started like the tests start it):
//! - register latency (one `register` call, default settings), beside a bare
//!   `etcd-client` put under a lease (the floor) and `MemoryDiscovery`;
//! - watch notify latency: from the `register` call until 1 or 100 watchers (each its
//!   own etcd watch) have received the `Added`;
//! - after the criterion groups, convergence after an etcd restart: etcd is killed and
//!   restarted 5 times with a watcher open (default backoff 250 ms → 5 s); printed per
//!   restart are the time from the kill until etcd answers health checks again, and the
//!   gap from then until the watcher delivered its `Resync`.
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

#[path = "common/watchdog.rs"]
mod watchdog;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use etcd_support::EtcdServer;
use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryEvent, DiscoveryStream, EtcdDiscovery, MemoryDiscovery, Query,
    Transport,
};
use tokio_util::sync::CancellationToken;

fn id(n: u64) -> ChannelId {
    ChannelId::new("bench", "worker", "kv-events", n).unwrap()
}

fn endpoint(n: u64) -> Transport {
    Transport::zmq(format!("tcp://10.0.0.5:{}", 20_000 + n % 40_000))
}

async fn added(s: &mut DiscoveryStream) {
    loop {
        if let DiscoveryEvent::Added(_) = s.next().await.unwrap().unwrap() {
            return;
        }
    }
}

async fn synced(s: &mut DiscoveryStream) {
    loop {
        if let DiscoveryEvent::Resync(_) = s.next().await.unwrap().unwrap() {
            return;
        }
    }
}

fn register_latency(c: &mut Criterion, rt: &tokio::runtime::Runtime, url: &str) {
    let etcd = rt.block_on(EtcdDiscovery::connect([url])).unwrap();
    let memory = MemoryDiscovery::new();
    let mut raw = rt
        .block_on(etcd_client::Client::connect([url], None))
        .unwrap();
    // Long enough for the whole run (no keep-alive here).
    let raw_lease = rt.block_on(raw.lease_grant(3600, None)).unwrap().id();
    let mut g = c.benchmark_group("register");
    g.bench_function("etcd_discovery", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let etcd = etcd.clone();
            async move {
                let mut total = Duration::ZERO;
                for n in 0..iters {
                    let start = Instant::now();
                    let reg = etcd.register(id(n), endpoint(n)).await.unwrap();
                    total += start.elapsed();
                    reg.unregister().await.unwrap();
                }
                total
            }
        });
    });
    g.bench_function("bare_etcd_client_put", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let mut raw = raw.clone();
            async move {
                let mut total = Duration::ZERO;
                for n in 0..iters {
                    let key = format!("/bench-raw/{n:x}");
                    let value = format!(r#"{{"transport":{{"endpoint":"tcp://10.0.0.5:{n}"}}}}"#);
                    let start = Instant::now();
                    let lease = etcd_client::PutOptions::new().with_lease(raw_lease);
                    raw.put(key.clone(), value, Some(lease)).await.unwrap();
                    total += start.elapsed();
                    raw.delete(key, None).await.unwrap();
                }
                total
            }
        });
    });
    g.bench_function("memory_discovery", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let memory = memory.clone();
            async move {
                let mut total = Duration::ZERO;
                for n in 0..iters {
                    let start = Instant::now();
                    let reg = memory.register(id(n), endpoint(n)).await.unwrap();
                    total += start.elapsed();
                    reg.unregister().await.unwrap();
                }
                total
            }
        });
    });
    g.finish();
    rt.block_on(etcd.close());
    let _ = rt.block_on(raw.delete(
        "/bench-raw/",
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    ));
}

fn notify_latency(c: &mut Criterion, rt: &tokio::runtime::Runtime, url: &str) {
    let mut g = c.benchmark_group("notify");
    for watchers in [1usize, 100] {
        let writer = rt.block_on(EtcdDiscovery::connect([url])).unwrap();
        let reader = rt.block_on(EtcdDiscovery::connect([url])).unwrap();
        let streams: Vec<DiscoveryStream> = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..watchers {
                let mut s = reader
                    .watch(Query::new("bench"), CancellationToken::new())
                    .await
                    .unwrap();
                synced(&mut s).await;
                v.push(s);
            }
            v
        });
        let streams = Arc::new(tokio::sync::Mutex::new(streams));
        g.bench_with_input(
            BenchmarkId::new("etcd_discovery", watchers),
            &watchers,
            |b, _| {
                b.to_async(rt).iter_custom(|iters| {
                    let writer = writer.clone();
                    let streams = Arc::clone(&streams);
                    async move {
                        let mut streams = streams.lock().await;
                        let mut total = Duration::ZERO;
                        for n in 0..iters {
                            let start = Instant::now();
                            let reg = writer.register(id(n), endpoint(n)).await.unwrap();
                            for s in streams.iter_mut() {
                                added(s).await;
                            }
                            total += start.elapsed();
                            reg.unregister().await.unwrap();
                        }
                        total
                    }
                });
            },
        );
        drop(streams);
        rt.block_on(writer.close());
        rt.block_on(reader.close());
    }
    g.finish();
}

/// Kill/restart etcd with a watcher open; time from etcd healthy to the Resync.
fn restart_convergence(rt: &tokio::runtime::Runtime, server: &mut EtcdServer) {
    let url = server.url();
    let writer = rt.block_on(EtcdDiscovery::connect([&url])).unwrap();
    let watcher = rt.block_on(EtcdDiscovery::connect([&url])).unwrap();
    let _reg = rt.block_on(writer.register(id(1), endpoint(1))).unwrap();
    let mut s = rt
        .block_on(watcher.watch(Query::new("bench"), CancellationToken::new()))
        .unwrap();
    rt.block_on(synced(&mut s));
    let mut gaps = Vec::new();
    for n in 1..=5 {
        let killed = Instant::now();
        server.stop();
        rt.block_on(server.restart());
        let healthy = killed.elapsed();
        rt.block_on(synced(&mut s));
        let converged = killed.elapsed();
        // Per restart: the watcher's lag is measured from this restart's own health.
        let gap = converged - healthy;
        println!(
            "etcd restart {n}: kill → healthy {healthy:?}, healthy → watcher Resync {gap:?} \
             (default backoff 250 ms → 5 s)"
        );
        // The watcher's first retry after the kill waits one backoff step (250 ms):
        // it reads afresh within that step of health, plus the read itself, which a
        // loaded CI machine stretched to 350 ms once. A watcher that waited out a
        // second, doubled step would lag by 500 ms or more.
        assert!(
            gap < Duration::from_millis(500),
            "restart {n}: Resync {gap:?} after health"
        );
        gaps.push(gap);
    }
    gaps.sort();
    println!(
        "etcd restarts: healthy → Resync gap min {:?}, median {:?}, max {:?}",
        gaps[0], gaps[2], gaps[4]
    );
}

fn main() {
    watchdog::arm("discovery_etcd", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut server = rt.block_on(EtcdServer::start());
    let mut c = Criterion::default().configure_from_args();
    register_latency(&mut c, &rt, &server.url());
    notify_latency(&mut c, &rt, &server.url());
    c.final_summary();
    restart_convergence(&rt, &mut server);
}
