//! Discovery at 10 000 instances: `list` (one component of 10 publishers) and a by-id
//! lookup, on 1 and 2 threads, each beside a naive `RwLock<HashMap>` that scans for
//! `list`; and register → notify latency with 1, 100 and 1000 watchers (from the
//! `register` call until every watcher has received its `Added`).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

#[path = "common/watchdog.rs"]
mod watchdog;

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryEvent, Instance, MemoryDiscovery, Query, Registration, Transport,
};
use tokio_util::sync::CancellationToken;

const INSTANCES: u64 = 10_000;
const PER_COMPONENT: u64 = 10;

fn id(n: u64) -> ChannelId {
    ChannelId::new(
        "prod",
        format!("worker-{}", n / PER_COMPONENT),
        "kv-events",
        n,
    )
    .unwrap()
}

/// The straightforward alternative: one map, `list` scans it.
struct Naive {
    map: RwLock<HashMap<ChannelId, Instance>>,
}

impl Naive {
    fn list(&self, q: &Query) -> Vec<Instance> {
        self.map
            .read()
            .unwrap()
            .values()
            .filter(|i| q.matches(&i.id))
            .cloned()
            .collect()
    }

    fn get(&self, id: &ChannelId) -> Option<Instance> {
        self.map.read().unwrap().get(id).cloned()
    }
}

/// Runs `op(i)` `iters` times split across `threads` threads; wall-clock time.
fn on_threads(threads: u64, iters: u64, op: impl Fn(u64) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let op = &op;
            s.spawn(move || {
                for i in (t..iters).step_by(threads as usize) {
                    op(i);
                }
            });
        }
    });
    start.elapsed()
}

fn lookups(c: &mut Criterion) {
    watchdog::arm("discovery", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let memory = MemoryDiscovery::new();
    let naive = Naive {
        map: RwLock::new(HashMap::new()),
    };
    let mut guards: Vec<Registration> = Vec::new();
    rt.block_on(async {
        for n in 0..INSTANCES {
            let g = memory
                .register(
                    id(n),
                    Transport::zmq(format!("tcp://10.0.{}.{}:5557", n / 250, n % 250)),
                )
                .await
                .unwrap();
            naive
                .map
                .write()
                .unwrap()
                .insert(g.instance().id.clone(), g.instance().clone());
            guards.push(g);
        }
    });
    let queries: Vec<Query> = (0..INSTANCES / PER_COMPONENT)
        .map(|k| Query::new("prod").component(format!("worker-{k}")))
        .collect();
    let ids: Vec<ChannelId> = (0..INSTANCES).map(id).collect();
    let components = INSTANCES / PER_COMPONENT;

    let mut group = c.benchmark_group("discovery/10k");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(2));
    for threads in [1u64, 2] {
        group.bench_function(BenchmarkId::new("list/memory", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |i| {
                    let q = queries[(i % components) as usize].clone();
                    let out = std::hint::black_box(futures_executor_lite(memory.list(q)).unwrap());
                    assert_eq!(out.len(), PER_COMPONENT as usize);
                })
            })
        });
        group.bench_function(BenchmarkId::new("list/naive_scan", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |i| {
                    let out = std::hint::black_box(naive.list(&queries[(i % components) as usize]));
                    assert_eq!(out.len(), PER_COMPONENT as usize);
                })
            })
        });
        group.bench_function(BenchmarkId::new("get/memory", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |i| {
                    std::hint::black_box(memory.get(&ids[(i % INSTANCES) as usize]).unwrap());
                })
            })
        });
        group.bench_function(BenchmarkId::new("get/naive_map", threads), |b| {
            b.iter_custom(|iters| {
                on_threads(threads, iters, |i| {
                    std::hint::black_box(naive.get(&ids[(i % INSTANCES) as usize]).unwrap());
                })
            })
        });
    }
    group.finish();
    drop(guards);
}

/// `MemoryDiscovery::list`'s future is ready on first poll; drive it without a runtime.
fn futures_executor_lite<T>(fut: impl std::future::Future<Output = T>) -> T {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("memory discovery futures complete at once"),
    }
}

fn notify_latency(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("discovery/register_notify");
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(2));
    for watchers in [1usize, 100, 1000] {
        let memory = MemoryDiscovery::new();
        let mut streams = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..watchers {
                let mut s = memory
                    .watch(Query::new("prod"), CancellationToken::new())
                    .await
                    .unwrap();
                assert!(matches!(
                    s.next().await,
                    Some(Ok(DiscoveryEvent::Resync(_)))
                ));
                v.push(s);
            }
            v
        });
        group.bench_function(BenchmarkId::from_parameter(watchers), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut timed = Duration::ZERO;
                    for n in 0..iters {
                        let start = Instant::now();
                        let g = memory
                            .register(id(n % INSTANCES), Transport::zmq("tcp://10.0.0.1:5557"))
                            .await
                            .unwrap();
                        for s in streams.iter_mut() {
                            let ev = s.next().await.unwrap().unwrap();
                            assert!(matches!(ev, DiscoveryEvent::Added(_)));
                        }
                        timed += start.elapsed();
                        drop(g);
                        for s in streams.iter_mut() {
                            s.next().await.unwrap().unwrap();
                        }
                    }
                    timed
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, lookups, notify_latency);
criterion_main!(benches);
