//! In-process memory claims, checked by counting allocations rather than by the
//! sockets' own counters: a consumer that hoards small messages past
//! `max_retained_bytes`, and a publisher flooded with PINGs whose PONGs are never read.
//! This binary's global allocator counts every byte allocated; each test reads how
//! far past its starting point the process went (sampled while the attack runs) and
//! caps the process at twice its bound, so a runaway aborts it. The tests take turns
//! (the count is process-wide).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::alloc::System;
use std::sync::Mutex;

use bytes::Bytes;
use cap::Cap;
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use support::{wire, within};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// A connection's read buffer, and a publisher's write batch.
const READ_BUFFER: usize = 64 * KIB;

/// Held while a test counts (the count and the cap are process-wide).
static COUNTING: Mutex<()> = Mutex::new(());

/// What the process allocated past `base`, at its most, over the samples taken.
struct Peak {
    base: usize,
    max: usize,
}

impl Peak {
    /// Starts counting from what is allocated now, and caps the process at `cap`
    /// bytes past it.
    fn start(cap: usize) -> Peak {
        let base = ALLOCATOR.allocated();
        ALLOCATOR.set_limit(base + cap).unwrap();
        Peak { base, max: 0 }
    }

    fn sample(&mut self) {
        self.max = self
            .max
            .max(ALLOCATOR.allocated().saturating_sub(self.base));
    }

    /// Lifts the cap; the most seen past the start.
    fn stop(mut self) -> usize {
        self.sample();
        ALLOCATOR.set_limit(usize::MAX).unwrap();
        self.max
    }
}

#[tokio::test(flavor = "current_thread")]
// The guard keeps the other test's allocations out of this count: held across
// awaits on purpose (each test has a runtime of its own).
#[allow(clippy::await_holding_lock)]
async fn hoarded_small_messages_cost_the_retention_limit_not_a_read_buffer_each() {
    const HOARD: usize = 1000;
    const RETAIN: usize = MIB;
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let config = Config::builder()
        .max_retained_bytes(RETAIN)
        .build()
        .unwrap();
    let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap(), config)
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let payload = Bytes::from(vec![1u8; 2000]);
    let message = Message::from_parts([Bytes::from_static(b"t"), payload]);
    // Warm: the first round trips allocate what the connection keeps for life.
    for _ in 0..4 {
        publisher.send(message.clone());
        within(sub.recv()).await.unwrap();
    }
    let mut hoard = Vec::with_capacity(HOARD);

    let _counting = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    // One message per round trip, so each arrives in a read of its own: sliced, each
    // would keep its 64 KiB read buffer alive (HOARD × 64 KiB = 62.5 MiB).
    let bound = RETAIN + HOARD * (2000 + 256) + 2 * READ_BUFFER + 256 * KIB;
    let mut peak = Peak::start(2 * bound);
    for _ in 0..HOARD {
        publisher.send(message.clone());
        hoard.push(within(sub.recv()).await.unwrap());
        peak.sample();
    }
    let held = peak.stop();
    eprintln!(
        "figure: a SUB hoarding {HOARD} small messages, each read alone (1 MiB retention \
         limit): {} KiB allocated at most (bound {} KiB)",
        held / KIB,
        bound / KIB
    );
    assert!(held <= bound, "{held} > {bound}");
    let buffers = sub.buffers();
    assert!(buffers.copied_messages > 0, "{buffers:?}");
    assert!(hoard.iter().all(|m| m == &message));
}

#[tokio::test(flavor = "current_thread")]
#[allow(clippy::await_holding_lock)]
async fn a_ping_flood_costs_a_publisher_one_pending_pong() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher
        .local_endpoint()
        .unwrap()
        .trim_start_matches("tcp://");
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    let mut hello = wire::hello("SUB");
    hello.extend(wire::subscribe(b"t"));
    s.write_all(&hello).await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // 40 000 PINGs with a 16-byte context: 1 MB a chunk, allocated once, before.
    let chunk = wire::ping(&[0x5a; 16]).repeat(40_000);
    s.write_all(&chunk).await.unwrap();

    let _counting = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    // The PONGs of 7.5 M PINGs, never read: what the publisher holds is its read
    // buffer, one write batch and one PONG (each PONG kept would be 12 B: 90 MB).
    let bound = 2 * READ_BUFFER + KIB + 256 * KIB;
    let mut peak = Peak::start(2 * bound);
    let mut written = 0;
    while written < 300 * MIB {
        s.write_all(&chunk).await.unwrap();
        written += chunk.len();
        peak.sample();
    }
    let held = peak.stop();
    eprintln!(
        "figure: a publisher under {} MiB of PINGs whose PONGs are never read: {} KiB \
         allocated at most (bound {} KiB)",
        written / MIB,
        held / KIB,
        bound / KIB
    );
    assert!(held <= bound, "{held} > {bound}");
    let stats = publisher.stats();
    assert_eq!((stats.connections, stats.failed), (1, 0), "{stats:?}");
}
