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
    fn stop(self) -> usize {
        ALLOCATOR.set_limit(usize::MAX).unwrap();
        self.max
    }
}

#[tokio::test(flavor = "current_thread")]
// The guard keeps the other test's allocations out of this count: held across
// awaits on purpose (each test has a runtime of its own).
#[allow(clippy::await_holding_lock)]
async fn hoarded_small_messages_cost_the_retention_limit_not_a_read_buffer_each() {
    // Set-up allocates too: the whole test takes its turn.
    let _counting = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    const ROUNDS: usize = 100;
    const RETAIN: usize = MIB;
    const BIG: usize = 8 << 20;
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
    // Each round: an 8 MiB message (a frame that large gets an allocation of its own),
    // then a 2 KB one the consumer keeps. The small one lands in a fresh read buffer
    // each time: sliced, each would keep its 64 KiB buffer alive (ROUNDS × 64 KiB).
    let big = Message::from_parts([Bytes::from_static(b"tzz"), Bytes::from(vec![9u8; BIG])]);
    let small = Message::from_parts([Bytes::from_static(b"t"), Bytes::from(vec![1u8; 2000])]);
    let mut hoard = Vec::with_capacity(ROUNDS);
    let mut round = async |hoard: &mut Vec<Message>| {
        publisher.send(big.clone());
        publisher.send(small.clone());
        loop {
            let m = within(sub.recv()).await.unwrap();
            if m.get(0) == Some(b"t") {
                hoard.push(m);
                return;
            }
        }
    };
    // Warm: what the connection keeps for life.
    for _ in 0..2 {
        round(&mut Vec::new()).await;
    }

    // What it may keep between rounds (sampled after each): the retention limit, the
    // hoard's own copies, two read buffers, and 256 KiB of the runtime's working set.
    // Within a round the large message is in flight on both sides (the cap, past which
    // the process aborts, leaves room for it several times over).
    let bound = RETAIN + ROUNDS * (2000 + 256) + 2 * READ_BUFFER + 256 * KIB;
    let mut peak = Peak::start(bound + 8 * BIG);
    for _ in 0..ROUNDS {
        round(&mut hoard).await;
        peak.sample();
    }
    let held = peak.stop();
    eprintln!(
        "figure: a SUB hoarding {ROUNDS} small messages, each after an 8 MiB one (1 MiB \
         retention limit): {} KiB allocated at most (bound {} KiB)",
        held / KIB,
        bound / KIB
    );
    assert!(held <= bound, "{held} > {bound}");
    assert!(hoard.iter().all(|m| m == &small));
    let buffers = sub.buffers();
    assert!(buffers.copied_messages > 0, "{buffers:?}");
}

#[tokio::test(flavor = "current_thread")]
#[allow(clippy::await_holding_lock)]
async fn a_ping_flood_costs_a_publisher_one_pending_pong() {
    let _counting = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
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
