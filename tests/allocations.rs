//! In-process memory claims, checked by counting allocations rather than by the
//! sockets' own counters: a consumer that hoards small messages past
//! `max_retained_bytes`, and a publisher flooded with PINGs whose PONGs are never read.
//! This binary's global allocator counts every byte allocated; each test reads how
//! far past its starting point the process went (sampled while the attack runs) and
//! caps the process (for the PING flood, at the bound itself), so that any
//! allocation past the cap aborts it. The hoarding test also shows its premise (with
//! the limit lifted, each hoarded message pins a read buffer). The tests take turns
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

/// What the process allocated past `base`, at its most over the samples taken, with
/// a cap on the process past which any allocation aborts it.
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

const ROUNDS: usize = 100;
const BIG: usize = 8 << 20;

/// A SUB with `max_retained_bytes = retain` hoards the small message of each of
/// [`ROUNDS`] rounds of [an 8 MiB message, a 2 KB one]: what stays allocated between
/// rounds at its most (sampled after each), and how many it copied out.
async fn hoard(publisher: &PubSocket, retain: usize, cap: usize) -> (usize, u64) {
    let config = Config::builder()
        .max_retained_bytes(retain)
        .build()
        .unwrap();
    let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap(), config)
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // A frame that large gets an allocation of its own, so the small message after it
    // lands in a fresh read buffer each round: sliced, each keeps its 64 KiB alive.
    let big = Message::from_parts([Bytes::from_static(b"tzz"), Bytes::from(vec![9u8; BIG])]);
    let small = Message::from_parts([Bytes::from_static(b"t"), Bytes::from(vec![1u8; 2000])]);
    let mut kept = Vec::with_capacity(ROUNDS);
    let mut round = async |kept: &mut Vec<Message>| {
        publisher.send(big.clone());
        publisher.send(small.clone());
        loop {
            let m = within(sub.recv()).await.unwrap();
            if m.get(0) == Some(b"t") {
                kept.push(m);
                return;
            }
        }
    };
    // Warm: what the connection keeps for life.
    for _ in 0..2 {
        round(&mut Vec::new()).await;
    }
    let mut peak = Peak::start(cap);
    for _ in 0..ROUNDS {
        round(&mut kept).await;
        peak.sample();
    }
    let held = peak.stop();
    assert!(kept.iter().all(|m| m == &small));
    let copied = sub.buffers().copied_messages;
    drop((kept, sub));
    within(async {
        while publisher.stats().connections > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    (held, copied)
}

/// Runs `test` on a runtime of its own, built only once the other test is done: the
/// runtime's set-up allocates too, and must not land in the other test's count.
fn in_turn<F: std::future::Future<Output = ()>>(test: impl FnOnce() -> F) {
    let _counting = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test());
}

#[test]
fn hoarded_small_messages_cost_the_retention_limit_not_a_read_buffer_each() {
    in_turn(hoarded_small_messages);
}

async fn hoarded_small_messages() {
    const RETAIN: usize = MIB;
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    // What it may keep between rounds: the retention limit, the hoard's own copies, two
    // read buffers, and 256 KiB of the runtime's working set. Within a round the large
    // message is in flight on both sides (the cap, past which the process aborts,
    // leaves room for it several times over).
    let bound = RETAIN + ROUNDS * (2000 + 256) + 2 * READ_BUFFER + 256 * KIB;
    let (held, copied) = hoard(&publisher, RETAIN, bound + 8 * BIG).await;
    eprintln!(
        "figure: a SUB hoarding {ROUNDS} small messages, each after an 8 MiB one (1 MiB \
         retention limit): {} KiB allocated at most (bound {} KiB)",
        held / KIB,
        bound / KIB
    );
    assert!(held <= bound, "{held} > {bound}");
    // Copied from the moment the limit was passed (about 16 rounds in), every time.
    let pinned_before_limit = RETAIN / READ_BUFFER + 2;
    assert!(
        copied >= (ROUNDS - pinned_before_limit) as u64,
        "only {copied} of {ROUNDS} copied"
    );

    // The premise, shown: with the limit lifted, each hoarded message does keep a
    // read buffer of its own alive.
    let (held, copied) = hoard(
        &publisher,
        usize::MAX >> 1,
        2 * ROUNDS * READ_BUFFER + 8 * BIG,
    )
    .await;
    assert_eq!(copied, 0);
    assert!(
        held >= ROUNDS * READ_BUFFER / 2,
        "sliced, {ROUNDS} hoarded messages held only {} KiB: they did not each pin a buffer",
        held / KIB
    );
}

/// A publisher with the default configuration on a loopback port, and its address.
async fn bound_publisher() -> (PubSocket, std::net::SocketAddr) {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let addr = publisher.local_addr().unwrap();
    (publisher, addr)
}

#[test]
fn a_ping_flood_costs_a_publisher_one_pending_pong() {
    in_turn(ping_flood);
}

async fn ping_flood() {
    let (publisher, endpoint) = bound_publisher().await;
    let mut s = TcpStream::connect(endpoint).await.unwrap();
    let mut hello = wire::hello("SUB");
    hello.extend(wire::subscribe(b"t"));
    s.write_all(&hello).await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // 40 000 PINGs with a 16-byte context: 1 MB a chunk, allocated once, before.
    let chunk = wire::ping(&[0x5a; 16]).repeat(40_000);
    s.write_all(&chunk).await.unwrap();
    // Read in: the read buffer has grown to its full chunk (it doubles from 1 KiB
    // with each read that fills it) before the count starts.
    within(async {
        while publisher
            .subscriber_stats()
            .first()
            .is_none_or(|p| p.session.pings_received < 40_000)
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;

    // The PONGs of 7.5 M PINGs, never read (each PONG kept would be 12 B: 90 MB). The
    // connection's read buffer, write batch and one PONG are already allocated: past
    // that, the publisher may allocate a write batch again and a PONG, no more. The
    // cap is the bound: one allocation past it aborts the process, between samples
    // or not.
    let bound = READ_BUFFER + 2 * KIB;
    let mut peak = Peak::start(bound);
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

#[test]
fn a_message_sent_to_64_subscribers_is_held_once_not_once_per_subscriber() {
    in_turn(fan_out_held_once);
}

/// 64 subscribers that read nothing (each with a 4 KiB receive buffer; the kernel
/// still takes a few MiB per connection): every message sent to all of them is queued
/// 64 times, and must be held in memory once, with a quarter of slack and 8 KiB per
/// subscriber. A copy per subscriber into its write buffer (as before) costs 64 ×
/// 64 KiB on top, past the bound.
async fn fan_out_held_once() {
    const SUBSCRIBERS: usize = 64;
    const MESSAGES: usize = 8000;
    const SIZE: usize = 1000;
    let (publisher, endpoint) = bound_publisher().await;
    let mut subscribers = Vec::new();
    for _ in 0..SUBSCRIBERS {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(endpoint).await.unwrap();
        let mut hello = wire::hello("SUB");
        hello.extend(wire::subscribe(b"t"));
        s.write_all(&hello).await.unwrap();
        subscribers.push(s);
    }
    within(publisher.wait_for_subscribers(SUBSCRIBERS)).await;
    let payload = Bytes::from(vec![0x5a; SIZE]);
    let sent = MESSAGES * (SIZE + 12); // as encoded: two frames, headers of 2 and 9 B
    let bound = sent + sent / 4 + SUBSCRIBERS * 8 * KIB;
    let mut peak = Peak::start(bound + 64 * MIB);
    for _ in 0..MESSAGES {
        publisher.send(Message::from_parts([
            Bytes::from_static(b"t"),
            payload.clone(),
        ]));
        peak.sample();
    }
    // Let every writer write what the kernel takes and stop there.
    for _ in 0..20 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        peak.sample();
    }
    let held = peak.stop();
    let stats = publisher.subscriber_stats();
    let queued: usize = stats.iter().map(|s| s.queue_len * SIZE).sum();
    eprintln!(
        "figure: {MESSAGES} messages of {SIZE} B sent to {SUBSCRIBERS} subscribers reading \
         nothing, each queued {SUBSCRIBERS} times: {} KiB allocated at most (bound {} KiB); \
         {} KiB queued in all",
        held / KIB,
        bound / KIB,
        queued / KIB
    );
    // The premise: what waits in the publisher for all of them (the kernel took some)
    // is many times what it may hold.
    assert!(queued >= 8 * bound, "only {queued} B queued");
    assert_eq!(publisher.stats().dropped, 0);
    assert!(held <= bound, "{held} > {bound}");
    drop(subscribers);
}
