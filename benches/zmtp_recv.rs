//! Receive throughput: the same pre-encoded stream of `[4 B topic, 8 B seq, payload]`
//! messages, written over loopback as fast as possible, received by
//! - `eventplane/recv`: our `SubSocket::recv`, one message per call;
//! - `eventplane/recv_many`: our `SubSocket::recv_many`, up to 256 per call;
//! - `zeromq`: the zeromq crate's `SubSocket`;
//! - `libzmq`: libzmq's own SUB in C (`benches/libzmq_sub.c`), when
//!   `EVENTPLANE_LIBZMQ_SUB` names the built program (`benches/libzmq_compare.sh`);
//! - `raw_read`: a plain read-and-discard of the same bytes in 64 KiB reads. A
//!   reference for the cost of the socket and the writer alone, not an upper bound:
//!   a reader with different read sizes or timing can beat it, especially when the
//!   single writer thread is the bottleneck (large messages).
//!
//! - `zmtp_session/{payload}B`: the sans-IO core alone, no socket: our PUB `Session`
//!   encodes 256 messages, our SUB `Session` decodes them, through a `zmtp::Pair`.
//!   What the sockets above add to it is I/O and scheduling.
//!
//! Every variant times from its first message to its last, so connection set-up is
//! excluded. Throughput is reported in messages/s; multiply by the message's wire size
//! (printed per group) for bytes/s.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

#[path = "common/blaster.rs"]
mod blaster;

#[path = "common/watchdog.rs"]
mod watchdog;

use std::time::{Duration, Instant};

use blaster::{Blaster, TOPIC};
use bytes::{BufMut, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::zmtp::codec::encode_greeting;
use eventplane::zmtp::{Config, Event, Message, Pair, Side, SubSocket};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv};

const PAYLOADS: [usize; 4] = [16, 100, 1024, 16 << 10];

fn ours(rt: &tokio::runtime::Runtime, b: &Blaster, iters: u64, batch: Option<usize>) -> Duration {
    let server = b.serve(iters + 1);
    let elapsed = rt.block_on(async {
        let mut sub = SubSocket::connect(&b.endpoint, Config::default())
            .await
            .unwrap();
        sub.subscribe(&TOPIC[..]).await.unwrap();
        sub.recv().await.unwrap();
        let start = Instant::now();
        match batch {
            None => {
                for _ in 0..iters {
                    std::hint::black_box(sub.recv().await.unwrap());
                }
            }
            Some(max) => {
                let mut got = 0u64;
                let mut buf = Vec::with_capacity(max);
                while got < iters {
                    let want = max.min((iters - got) as usize);
                    got += sub.recv_many(&mut buf, want).await.unwrap() as u64;
                    buf.clear();
                }
            }
        }
        start.elapsed()
    });
    server.join().unwrap();
    elapsed
}

/// `recv_many` by a consumer that keeps the last 65 536 messages (about 7 MiB at
/// 100 B) alive: with `max_retained_bytes` at 1 MiB the socket copies small frames out
/// once the read buffers they pin pass it; with it unbounded every message stays a
/// slice (and pins its 64 KiB read buffer). The difference is the price of the copy.
fn hoarding(rt: &tokio::runtime::Runtime, b: &Blaster, iters: u64, retained: usize) -> Duration {
    const KEEP: usize = 1 << 16;
    let server = b.serve(iters + 1);
    let config = Config::builder()
        .max_retained_bytes(retained)
        .build()
        .unwrap();
    let elapsed = rt.block_on(async {
        let mut sub = SubSocket::connect(&b.endpoint, config).await.unwrap();
        sub.subscribe(&TOPIC[..]).await.unwrap();
        sub.recv().await.unwrap();
        let mut kept = std::collections::VecDeque::with_capacity(KEEP);
        let start = Instant::now();
        let mut got = 0u64;
        let mut buf = Vec::with_capacity(256);
        while got < iters {
            let want = 256.min((iters - got) as usize);
            got += sub.recv_many(&mut buf, want).await.unwrap() as u64;
            for m in buf.drain(..) {
                if kept.len() == KEEP {
                    kept.pop_front();
                }
                kept.push_back(m);
            }
        }
        start.elapsed()
    });
    server.join().unwrap();
    elapsed
}

fn zeromq_crate(rt: &tokio::runtime::Runtime, b: &Blaster, iters: u64) -> Duration {
    let server = b.serve(iters + 1);
    let elapsed = rt.block_on(async {
        let mut sub = zeromq::SubSocket::new();
        sub.subscribe("").await.unwrap();
        sub.connect(&b.endpoint).await.unwrap();
        sub.recv().await.unwrap();
        let start = Instant::now();
        for _ in 0..iters {
            std::hint::black_box(sub.recv().await.unwrap());
        }
        let elapsed = start.elapsed();
        drop(sub);
        elapsed
    });
    server.join().unwrap();
    elapsed
}

fn libzmq(program: &str, b: &Blaster, iters: u64) -> Duration {
    let server = b.serve(iters + 1);
    let out = std::process::Command::new(program)
        .arg(&b.endpoint)
        .arg((iters + 1).to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    server.join().unwrap();
    let ns: u64 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    Duration::from_nanos(ns)
}

fn raw_read(rt: &tokio::runtime::Runtime, b: &Blaster, iters: u64) -> Duration {
    let server = b.serve(iters + 1);
    let elapsed = rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(&b.endpoint[6..])
            .await
            .unwrap();
        s.set_nodelay(true).unwrap();
        // Greeting, READY and a subscription, as a SUB; then count raw bytes. The
        // publisher's greeting (64 B) and READY (27 B) precede the stream.
        let mut hello = BytesMut::new();
        encode_greeting(&mut hello);
        hello.put_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
        hello.put_slice(b"\x04\x0a\x09SUBSCRIBE");
        s.write_all(&hello).await.unwrap();
        let first = 64 + 27 + b.msg_len;
        let total = first + iters as usize * b.msg_len;
        let mut buf = vec![0u8; 64 << 10];
        let mut seen = 0;
        let mut start = None;
        while seen < total {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            seen += n;
            if start.is_none() && seen >= first {
                start = Some(Instant::now());
            }
        }
        start.unwrap().elapsed()
    });
    server.join().unwrap();
    elapsed
}

/// `iters` messages from our PUB session to our SUB session through a [`Pair`], 256
/// per drive; the SUB's events are counted and dropped.
fn session_pair(payload: usize, iters: u64) -> Duration {
    let mut pair = Pair::new(&Config::default(), &Config::default(), Instant::now());
    pair.sub.subscribe(bytes::Bytes::from_static(TOPIC));
    pair.drive().unwrap();
    pair.take_events(Side::Sub);
    let msg = Message::from_parts([
        bytes::Bytes::from_static(TOPIC),
        bytes::Bytes::from(vec![0u8; 8]),
        bytes::Bytes::from(vec![7u8; payload]),
    ]);
    let mut received = 0u64;
    let start = Instant::now();
    while received < iters {
        for _ in 0..256.min(iters - received) {
            pair.publ.send_message(&msg);
        }
        pair.drive().unwrap();
        received += pair
            .take_events(Side::Sub)
            .iter()
            .filter(|e| matches!(e, Event::Message(_)))
            .count() as u64;
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    watchdog::arm("zmtp_recv", std::time::Duration::from_secs(2700));
    for payload in [16, 1024] {
        let mut group = c.benchmark_group(format!("zmtp_session/{payload}B"));
        group.throughput(Throughput::Elements(1));
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(2));
        group.bench_function("pair", |bch| {
            bch.iter_custom(|iters| session_pair(payload, iters))
        });
        group.finish();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let libzmq_sub = std::env::var("EVENTPLANE_LIBZMQ_SUB").ok();
    if libzmq_sub.is_none() {
        eprintln!(
            "zmtp_recv: EVENTPLANE_LIBZMQ_SUB not set, skipping libzmq (see benches/libzmq_compare.sh)"
        );
    }
    for payload in PAYLOADS {
        let blaster = Blaster::new(payload);
        let mut group = c.benchmark_group(format!("zmtp_recv/{payload}B"));
        eprintln!(
            "zmtp_recv/{payload}B: {} wire bytes per message",
            blaster.msg_len
        );
        group.throughput(Throughput::Elements(1));
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(3));
        group.bench_function(BenchmarkId::new("eventplane", "recv"), |bch| {
            bch.iter_custom(|iters| ours(&rt, &blaster, iters, None))
        });
        group.bench_function(BenchmarkId::new("eventplane", "recv_many"), |bch| {
            bch.iter_custom(|iters| ours(&rt, &blaster, iters, Some(256)))
        });
        group.bench_function(BenchmarkId::new("eventplane", "hoard_copied"), |bch| {
            bch.iter_custom(|iters| hoarding(&rt, &blaster, iters, 1 << 20))
        });
        group.bench_function(BenchmarkId::new("eventplane", "hoard_sliced"), |bch| {
            bch.iter_custom(|iters| hoarding(&rt, &blaster, iters, 1 << 40))
        });
        group.bench_function("zeromq", |bch| {
            bch.iter_custom(|iters| zeromq_crate(&rt, &blaster, iters))
        });
        if let Some(program) = &libzmq_sub {
            group.bench_function("libzmq", |bch| {
                bch.iter_custom(|iters| libzmq(program, &blaster, iters))
            });
        }
        group.bench_function("raw_read", |bch| {
            bch.iter_custom(|iters| raw_read(&rt, &blaster, iters))
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
