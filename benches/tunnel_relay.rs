//! The tunnel beside a direct connection, in the same run (feature `tunnel`):
//! - throughput: 100 B messages `[topic, seq, payload]`, a closed loop of up to 1,000
//!   in flight (below the PUB's per-subscriber queue, so nothing drops), received with
//!   `recv_many`: through the tunnel (router `SubSocket` ← HTTP/2 + TLS ← broker ←
//!   publisher), from a source (router `SubSocket` ← HTTP/2 + TLS ← the source's
//!   `PubSocket` serving the stream itself, DESIGN §7.4) and directly (`SubSocket` ←
//!   publisher);
//! - added latency: one message sent and received at a time, both ways;
//! - the broker's memory with 1,000 open streams: the `event-broker` service in its own
//!   process (`target/release/event-broker`, built by `cargo build --release -p eventplane-services`),
//!   its RSS read from `/proc` once every stream carries ZMTP and has relayed a 64 KiB
//!   message (so every relay's read buffer was filled), asserted at most
//!   [`MAX_KIB_PER_STREAM`] per stream over its idle RSS. In criterion's test mode
//!   (`-- --test`, as `.ci/run` runs it) 256 streams: more than hyper's default of 200
//!   concurrent HTTP/2 streams, within a 1,024-descriptor limit.
//!
//! Bus, publishers and sockets are in this process on loopback; for the first two the
//! broker runs in-process too. TLS uses the repository's test certificates.
//!
//! ```text
//! cargo build --release -p eventplane-services
//! cargo bench --features tunnel --bench tunnel_relay
//! ```
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Registration, Transport};
use eventplane::tunnel::{
    AnnouncedSource, Broker, BrokerConfig, BusClients, EventBus, EventBusConfig, Secret, Source,
    SourceConfig, TokenDigest, TunnelStream, client_tls, server_tls,
};
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use tokio::io::{AsyncRead, AsyncWrite};

const TOKEN: &str = "tunnel-relay-bench-token";
const SOURCE_TOKEN: &str = "tunnel-relay-bench-source-token";
const WINDOW: u64 = 1_000;
/// What one open stream may cost the broker process once it relayed a 64 KiB message:
/// its 16 KiB relay read buffer, the HTTP/2 stream's state and receive window, the
/// publisher connection and the allocator's share (64 KiB read buffers make it 70 KiB
/// or more).
const MAX_KIB_PER_STREAM: u64 = 48;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tunnel")
        .join(name)
}

fn test_mode() -> bool {
    std::env::args().any(|a| a == "--test")
}

async fn bus() -> EventBus {
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    EventBus::bind(
        "127.0.0.1:0",
        tls,
        BusClients::shared(&Secret::new(TOKEN).unwrap(), vec!["bench".to_owned()])
            .unwrap()
            .source(
                "bench-source",
                TokenDigest::of(&Secret::new(SOURCE_TOKEN).unwrap()),
                vec!["bench".to_owned()],
            )
            .unwrap(),
        EventBusConfig::default(),
    )
    .await
    .unwrap()
}

async fn publisher(view: &MemoryDiscovery, n: u64) -> (PubSocket, String, Registration) {
    let socket = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = socket.local_endpoint().unwrap().to_owned();
    let registration = view
        .register(
            ChannelId::new("bench", "worker", "t", n).unwrap(),
            Transport::zmq(endpoint.clone()),
        )
        .await
        .unwrap();
    (socket, endpoint, registration)
}

fn message() -> Message {
    Message::from_parts([
        Bytes::from_static(b"t"),
        Bytes::from_static(&[0; 8]),
        Bytes::from(vec![7u8; 100]),
    ])
}

/// Sends and receives `n` messages, at most `WINDOW` in flight.
async fn closed_loop<S>(
    publisher: &PubSocket,
    sub: &mut SubSocket<S>,
    n: u64,
    batch: &mut Vec<Message>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let m = message();
    let (mut sent, mut got) = (0u64, 0u64);
    while got < n {
        while sent < n && sent - got < WINDOW {
            publisher.send(m.clone());
            sent += 1;
        }
        batch.clear();
        got += sub.recv_many(batch, 1024).await.unwrap() as u64;
    }
}

/// One message at a time: the time from send to receipt, `n` times.
async fn ping<S>(publisher: &PubSocket, sub: &mut SubSocket<S>, n: u64) -> Duration
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let m = message();
    let start = Instant::now();
    for _ in 0..n {
        publisher.send(m.clone());
        sub.recv().await.unwrap();
    }
    start.elapsed()
}

struct Pair {
    direct_pub: PubSocket,
    direct: SubSocket,
    tunnel_pub: PubSocket,
    tunnel: SubSocket<TunnelStream>,
    source_pub: PubSocket,
    source: SubSocket<TunnelStream>,
    _regs: Vec<Registration>,
    _broker: Broker,
    _source: Source,
    _bus: EventBus,
}

async fn pair() -> Pair {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (direct_pub, direct_ep, r1) = publisher(&view, 1).await;
    let (tunnel_pub, tunnel_ep, r2) = publisher(&view, 2).await;
    let broker = Broker::spawn(
        BrokerConfig::new(
            format!("https://localhost:{}", bus.local_addr().port()),
            "bench-broker",
            vec!["bench".to_owned()],
            Secret::new(TOKEN).unwrap(),
            client_tls(fixture("ca.pem")).unwrap(),
            view.clone() as Arc<dyn Discovery>,
        )
        // The publishers are on loopback, which a broker refuses by default.
        .addr_filter(
            eventplane::net::AddrFilter::strict().allow_cidr("127.0.0.0/8".parse().unwrap()),
        ),
    )
    .unwrap();
    while bus.brokers_for("bench").is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stream = bus.open_stream("bench", 2, &tunnel_ep).await.unwrap();
    let mut tunnel = SubSocket::handshake(stream, Config::default())
        .await
        .unwrap();
    tunnel.subscribe("t").await.unwrap();
    let mut direct = SubSocket::connect(&direct_ep, Config::default())
        .await
        .unwrap();
    direct.subscribe("t").await.unwrap();
    // A source announcing publisher 3, served from its own socket.
    let source_pub = PubSocket::new(Config::default());
    let announcer = Source::spawn(SourceConfig::new(
        format!("https://localhost:{}", bus.local_addr().port()),
        "bench-source",
        vec!["bench".to_owned()],
        Secret::new(SOURCE_TOKEN).unwrap(),
        client_tls(fixture("ca.pem")).unwrap(),
    ))
    .unwrap();
    let id = ChannelId::new("bench", "worker", "t", 3).unwrap();
    announcer
        .announce(
            AnnouncedSource::new(&id, eventplane::wire::Dialect::EventPlane),
            source_pub.acceptor(),
        )
        .unwrap();
    while bus.stats().announced_sources == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stream = bus.open_announced(&id).await.unwrap();
    let mut source = SubSocket::handshake(stream, Config::default())
        .await
        .unwrap();
    source.subscribe("t").await.unwrap();
    direct_pub.wait_for_subscribers(1).await;
    tunnel_pub.wait_for_subscribers(1).await;
    source_pub.wait_for_subscribers(1).await;
    Pair {
        direct_pub,
        direct,
        tunnel_pub,
        tunnel,
        source_pub,
        source,
        _regs: vec![r1, r2],
        _broker: broker,
        _source: announcer,
        _bus: bus,
    }
}

fn relay(c: &mut Criterion) {
    watchdog::arm("tunnel_relay", std::time::Duration::from_secs(2700));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut p = rt.block_on(pair());
    let mut batch = Vec::with_capacity(1024);

    let mut group = c.benchmark_group("tunnel_relay/100B");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function(BenchmarkId::new("throughput", "direct"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            rt.block_on(closed_loop(&p.direct_pub, &mut p.direct, iters, &mut batch));
            start.elapsed()
        })
    });
    group.bench_function(BenchmarkId::new("throughput", "tunnel"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            rt.block_on(closed_loop(&p.tunnel_pub, &mut p.tunnel, iters, &mut batch));
            start.elapsed()
        })
    });
    group.bench_function(BenchmarkId::new("throughput", "source"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            rt.block_on(closed_loop(&p.source_pub, &mut p.source, iters, &mut batch));
            start.elapsed()
        })
    });
    group.bench_function(BenchmarkId::new("latency", "direct"), |b| {
        b.iter_custom(|iters| rt.block_on(ping(&p.direct_pub, &mut p.direct, iters)))
    });
    group.bench_function(BenchmarkId::new("latency", "tunnel"), |b| {
        b.iter_custom(|iters| rt.block_on(ping(&p.tunnel_pub, &mut p.tunnel, iters)))
    });
    group.bench_function(BenchmarkId::new("latency", "source"), |b| {
        b.iter_custom(|iters| rt.block_on(ping(&p.source_pub, &mut p.source, iters)))
    });
    group.finish();
    drop(p);
    broker_memory(&rt);
}

/// The `event-broker` service next to this bench's binary.
fn event_broker() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("event-broker");
    path.exists().then_some(path)
}

/// The broker process's RSS with `n` open streams, each carrying a ZMTP connection.
fn broker_memory(rt: &tokio::runtime::Runtime) {
    let Some(program) = event_broker() else {
        // In test mode (.ci/run) a missing binary is a failure, not a skipped claim.
        assert!(
            !test_mode(),
            "target/release/event-broker is missing: \
             cargo build --release -p eventplane-services"
        );
        eprintln!(
            "tunnel_relay: target/release/event-broker is missing \
             (cargo build --release -p eventplane-services); skipping the broker's RSS"
        );
        return;
    };
    let n: u64 = if test_mode() { 256 } else { 1000 };
    rt.block_on(async move {
        let bus = bus().await;
        let view = MemoryDiscovery::new();
        let mut publishers = Vec::new();
        for i in 0..n {
            publishers.push(publisher(&view, i).await);
        }
        let dir = std::env::temp_dir().join(format!("tunnel-relay-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), TOKEN).unwrap();
        let endpoints: Vec<String> = publishers.iter().map(|p| format!("{:?}", p.1)).collect();
        let config = format!(
            "bus_url = \"https://localhost:{}\"\nclient_id = \"rss\"\nca_file = {:?}\n\
             token_file = {:?}\ndrain_deadline_ms = 100\nallowed_cidrs = [\"127.0.0.0/8\"]\n\
             [discovery]\nnamespaces = [\"bench\"]\n\
             static_endpoints = [{}]\n",
            bus.local_addr().port(),
            fixture("ca.pem"),
            dir.join("token"),
            endpoints.join(", ")
        );
        std::fs::write(dir.join("broker.toml"), config).unwrap();
        let mut child = tokio::process::Command::new(program)
            .arg("--config")
            .arg(dir.join("broker.toml"))
            .env("RUST_LOG", "off")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap().to_string();
        while bus.brokers_for("bench").is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let idle = procfs::status_kib(&pid, "VmRSS:");
        let mut subs = Vec::new();
        for (i, (_, endpoint, _)) in publishers.iter().enumerate() {
            let stream = bus.open_stream("bench", i as u64, endpoint).await.unwrap();
            let mut sub = SubSocket::handshake(stream, Config::default())
                .await
                .unwrap();
            sub.subscribe("t").await.unwrap();
            subs.push(sub);
        }
        for (p, _, _) in &publishers {
            p.wait_for_subscribers(1).await;
            p.send(message());
        }
        for sub in &mut subs {
            sub.recv().await.unwrap();
        }
        // Then 64 KiB through each stream, so every relay's read buffer has been filled
        // (a buffer never written to is not resident, whatever its size).
        // 64 streams at a time: all at once would queue more than the session's 64 MiB
        // in the broker (and reset streams, as it should).
        let big = Message::from_parts([Bytes::from_static(b"t"), Bytes::from(vec![5u8; 64 << 10])]);
        for (ps, ss) in publishers.chunks(64).zip(subs.chunks_mut(64)) {
            for (p, _, _) in ps {
                p.send(big.clone());
            }
            for sub in ss {
                sub.recv().await.unwrap();
            }
        }
        let rss = procfs::status_kib(&pid, "VmRSS:");
        let hwm = procfs::status_kib(&pid, "VmHWM:");
        eprintln!(
            "tunnel_relay: broker with {n} open streams: RSS {:.1} MiB (idle {:.1} MiB, \
             {:.1} KiB per stream), peak {:.1} MiB; bus streams opened {}",
            rss as f64 / 1024.0,
            idle as f64 / 1024.0,
            rss.saturating_sub(idle) as f64 / n as f64,
            hwm as f64 / 1024.0,
            bus.stats().streams_opened
        );
        assert_eq!(bus.stats().streams_opened, n);
        let per_stream = rss.saturating_sub(idle) as f64 / n as f64;
        assert!(
            rss.saturating_sub(idle) <= n * MAX_KIB_PER_STREAM,
            "broker RSS {rss} KiB for {n} streams ({per_stream:.1} KiB each, over {MAX_KIB_PER_STREAM})"
        );
        // The peak too: the 64 KiB round did not pass through more than the streams hold.
        assert!(
            hwm.saturating_sub(idle) <= n * MAX_KIB_PER_STREAM + 16 * 1024,
            "broker peak {hwm} KiB for {n} streams"
        );
        let _ = child.kill().await;
        let _ = std::fs::remove_dir_all(&dir);
        bus.shutdown().await;
    });
}

criterion_group!(benches, relay);
criterion_main!(benches);
