//! Every byte a peer makes us hold is capped and charged, proven through the real
//! sockets: PING floods that never read the PONGs, small messages pinning large read
//! buffers, oversized or premature frames from subscribers, connection floods,
//! libzmq-style commands between the frames of a message, heartbeats checked after
//! the socket was not polled, publishers that keep sending after they left discovery,
//! and engine batches that declare more than they hold.
//!
//! Each attack is checked against the component's own accounting (held bytes,
//! refusals, stalls); where the test owns the process (the examples, run as child
//! processes) the growth of its peak RSS (VmHWM, reset when the attack starts) is
//! asserted against the budgets in play for that attack plus `support::RSS_SLACK`
//! (2 MiB). In-process claims (hoarding, pending PONGs) are counted by allocation in
//! `tests/allocations.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Error, Message, PubSocket, SubSocket, TimeoutKind};
use support::{DEADLINE, RSS_SLACK, proc_status_bytes, reset_peak_rss, wire, within};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::Child;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
/// A connection's read buffer (`zmtp::io`), and what one write batch holds.
const READ_BUFFER: u64 = 64 * KIB;

/// Asserts that `process` grew (peak RSS over its RSS when the peak was reset) by at
/// most `budget`, the bounds in play for this attack, plus [`RSS_SLACK`].
#[track_caller]
fn assert_within_budget(process: &str, grown: u64, budget: u64) {
    // One line per figure, for tools/figures.py.
    eprintln!(
        "figure: {process}: +{} KiB peak RSS (bound {} KiB)",
        grown / KIB,
        (budget + RSS_SLACK) / KIB
    );
    assert!(
        grown <= budget + RSS_SLACK,
        "{process} grew by {} KiB, over its budget of {} KiB + {} KiB slack",
        grown / KIB,
        budget / KIB,
        RSS_SLACK / KIB
    );
}

/// The `publish` example sending 10 messages a second on `t`: (child, pid, host:port).
async fn spawn_publish() -> (Child, u32, String) {
    let args = [
        "--bind",
        "tcp://127.0.0.1:0",
        "--topic",
        "t",
        "--rate",
        "10",
    ];
    let (child, endpoint) = support::spawn_example("publish", &args, true).await;
    let pid = child.id().unwrap();
    (child, pid, addr(&endpoint.unwrap()))
}

fn addr(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_owned()
}

/// Polls `check` every 10 ms until it holds, failing after [`DEADLINE`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Writes `chunk` again and again until `total` bytes went out, the peer closed, or
/// one write stayed blocked for `blocked` (the peer stopped reading). `stop` is
/// consulted between chunks. Returns the bytes written: `Err` when a write was
/// blocked for `blocked`.
async fn flood(
    stream: &mut TcpStream,
    chunk: &[u8],
    total: u64,
    blocked: Duration,
    mut stop: impl FnMut() -> bool,
) -> Result<u64, u64> {
    let mut written = 0u64;
    while written < total && !stop() {
        match tokio::time::timeout(blocked, stream.write_all(chunk)).await {
            Ok(Ok(())) => written += chunk.len() as u64,
            Ok(Err(_)) => break,
            Err(_) => return Err(written),
        }
    }
    Ok(written)
}

fn ping_chunk() -> Vec<u8> {
    // 40 000 PINGs with a 16-byte context: 1 MB.
    wire::ping(&[0x5a; 16]).repeat(40_000)
}

// ---------------------------------------------------------------------------------
// PING floods: at most one PONG pending, reading stops, a stalled peer is dropped.
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn ping_flood_does_not_grow_the_publish_process() {
    let (_child, pid, endpoint) = spawn_publish().await;
    let mut s = TcpStream::connect(&endpoint).await.unwrap();
    let mut hello = wire::hello("SUB");
    hello.extend(wire::subscribe(b"t"));
    s.write_all(&hello).await.unwrap();
    let before = reset_peak_rss(pid);
    // What a PING flood may make it hold: the connection's read buffer, one write
    // batch and one PONG pending.
    let budget = 2 * READ_BUFFER + KIB;
    // 1.3 GB of PINGs, never reading a PONG (stop early once the bound is broken).
    let over = || proc_status_bytes(pid, "VmRSS") > before + budget + RSS_SLACK;
    // A publisher that reads on is never blocked for long; one that stopped reading
    // is the failure this test is for, told apart from a slow machine by DEADLINE.
    let written = flood(&mut s, &ping_chunk(), 1300 * MIB, DEADLINE, over)
        .await
        .unwrap_or_else(|written| {
            panic!(
                "publisher read nothing for {} s after {} MiB",
                DEADLINE.as_secs(),
                written / MIB
            )
        });
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    assert_within_budget(
        "publish, 1.3 GB of PINGs never reading a PONG",
        grown,
        budget,
    );
    // The whole flood went in and was answered (one PONG pending at a time): the
    // bound held under the full attack, not because the attacker gave up.
    assert!(written >= 1300 * MIB, "only {} MiB written", written / MIB);
}

#[tokio::test]
async fn a_subscriber_that_reads_nothing_is_dropped_as_stalled() {
    let config = Config::builder()
        .write_stall_timeout(Some(Duration::from_millis(300)))
        .build()
        .unwrap();
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", config).await.unwrap();
    let mut s = TcpStream::connect(addr(publisher.local_endpoint().unwrap()))
        .await
        .unwrap();
    let mut hello = wire::hello("SUB");
    hello.extend(wire::subscribe(b"t"));
    s.write_all(&hello).await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // Data it never reads: the kernel buffers fill, then the write batch, then the
    // queue (up to send_queue_bytes, the rest dropped), and nothing moves for 300 ms.
    let payload = Bytes::from(vec![0u8; 64 << 10]);
    let mut max_pending = 0;
    eventually("the reader of nothing dropped as stalled", || {
        for _ in 0..64 {
            publisher.send(Message::from_parts([
                Bytes::from_static(b"t"),
                payload.clone(),
            ]));
        }
        let stats = publisher.stats();
        max_pending = max_pending.max(stats.pending_bytes);
        stats.stalled == 1
    })
    .await;
    let stats = publisher.stats();
    assert_eq!((stats.connections, stats.failed), (0, 1), "{stats:?}");
    assert!(stats.dropped > 0);
    // Queue, write buffer and control replies together never pass the bound.
    assert!(max_pending <= 16 << 20, "{max_pending}");
}

#[tokio::test]
async fn a_sub_socket_whose_publisher_reads_nothing_fails_as_stalled() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        // PINGs until the subscriber stops reading them, and never a byte read.
        s.write_all(&wire::hello("PUB")).await.unwrap();
        let _ = flood(
            &mut s,
            &ping_chunk(),
            u64::MAX,
            Duration::from_secs(2),
            || false,
        )
        .await;
        std::future::pending::<()>().await;
        drop(s);
    });
    let config = Config::builder()
        .write_stall_timeout(Some(Duration::from_millis(300)))
        .build()
        .unwrap();
    let mut sub = SubSocket::connect(&endpoint, config).await.unwrap();
    // 32 768 subscriptions of 1 KiB: 32 MiB of SUBSCRIBE commands nobody reads (more
    // than the kernel buffers take). Each call records its subscription and tries
    // one flush.
    let mut failed = None;
    for i in 0..32_768u32 {
        let mut prefix = i.to_be_bytes().to_vec();
        prefix.resize(1024, b's');
        // An awaited subscribe whose bytes cannot go out fails once nothing has moved
        // for the stall timeout.
        if let Err(e) = within(sub.subscribe(prefix)).await {
            failed = Some(e);
            break;
        }
    }
    let err = match failed {
        Some(e) => e,
        None => {
            within(async {
                loop {
                    match tokio::time::timeout(Duration::from_millis(20), sub.recv()).await {
                        Err(_) => {}
                        Ok(Ok(m)) => panic!("unexpected message {m:?}"),
                        Ok(Err(e)) => break e,
                    }
                }
            })
            .await
        }
    };
    assert!(
        matches!(err, Error::Timeout(TimeoutKind::WriteStall)),
        "{err:?}"
    );
}

// ---------------------------------------------------------------------------------
// Inbound frames from a subscriber: capped at the subscription limit, commands only
// before READY, a connection limit.
// ---------------------------------------------------------------------------------

/// Reads until EOF or error; `true` when the peer closed within the deadline.
async fn closed_by_peer(s: &mut TcpStream) -> bool {
    let mut sink = vec![0u8; 64 << 10];
    tokio::time::timeout(DEADLINE, async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    })
    .await
    .unwrap_or(false)
}

#[tokio::test]
async fn publisher_refuses_frames_above_the_subscription_limit_at_the_header() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = addr(publisher.local_endpoint().unwrap());
    // The largest subscription message (0x01 + 1024 bytes) is fine.
    let mut ok = TcpStream::connect(&endpoint).await.unwrap();
    let mut script = wire::hello("SUB");
    let mut sub = vec![1u8];
    sub.extend_from_slice(&[b'p'; 1024]);
    script.extend(wire::frame(&sub, false));
    ok.write_all(&script).await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // An 8 MiB message header is refused before its body is read.
    let mut big = TcpStream::connect(&endpoint).await.unwrap();
    let mut script = wire::hello("SUB");
    script.push(0x02);
    script.extend_from_slice(&(8u64 << 20).to_be_bytes());
    script.extend_from_slice(&[0u8; 4096]);
    big.write_all(&script).await.unwrap();
    assert!(closed_by_peer(&mut big).await);
    // So is a message frame before READY, however small.
    let mut early = TcpStream::connect(&endpoint).await.unwrap();
    let mut script = support::greeting(3, 1, b"NULL");
    script.extend(wire::frame(b"\x01t", false));
    early.write_all(&script).await.unwrap();
    assert!(closed_by_peer(&mut early).await);
    eventually("both refusals counted", || publisher.stats().failed == 2).await;
    assert_eq!(publisher.stats().subscribed, 1);
}

#[tokio::test]
async fn publisher_refuses_connections_past_its_limit() {
    let config = Config::builder().max_connections(3).build().unwrap();
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", config).await.unwrap();
    let endpoint = addr(publisher.local_endpoint().unwrap());
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(&endpoint).await.unwrap();
        s.write_all(&wire::hello("SUB")).await.unwrap();
        held.push(s);
    }
    eventually("three connections served", || {
        publisher.stats().connections == 3
    })
    .await;
    for _ in 0..2 {
        let mut s = TcpStream::connect(&endpoint).await.unwrap();
        assert!(closed_by_peer(&mut s).await);
    }
    assert_eq!(publisher.stats().refused, 2);
    // Room again once one leaves.
    drop(held.pop());
    eventually("a connection left", || publisher.stats().connections == 2).await;
    let mut s = TcpStream::connect(&endpoint).await.unwrap();
    s.write_all(&wire::hello("SUB")).await.unwrap();
    eventually("the newcomer served", || publisher.stats().connections == 3).await;
    assert_eq!(publisher.stats().refused, 2);
}

// ---------------------------------------------------------------------------------
// Read buffers pinned by what we keep: copied out past the retention limit.
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn prefixes_and_ignored_messages_do_not_grow_the_publish_process() {
    let (_child, pid, endpoint) = spawn_publish().await;
    let before = reset_peak_rss(pid);
    // The attack: 40 × [an 8 MiB message, a unique 1000-byte subscription].
    // The header of the 8 MiB message now closes the connection; the attacker dials
    // again each time.
    for i in 0..40u32 {
        let mut s = TcpStream::connect(&endpoint).await.unwrap();
        let mut script = wire::hello("SUB");
        script.extend(wire::frame(&vec![7u8; 8 << 20], false));
        let mut prefix = vec![1u8];
        prefix.extend_from_slice(&i.to_be_bytes());
        prefix.resize(1001, b'x');
        script.extend(wire::frame(&prefix, false));
        let _ = s.write_all(&script).await;
        assert!(closed_by_peer(&mut s).await);
    }
    // The same without large frames: 4096 unique subscriptions, each after 64 KiB of
    // ignored messages, so each arrives in a different read buffer. Stored as slices
    // they would pin 4096 × 64 KiB; copied they cost their size.
    let mut s = TcpStream::connect(&endpoint).await.unwrap();
    s.write_all(&wire::hello("SUB")).await.unwrap();
    let ignored = wire::frame(&[2u8; 1000], false).repeat(64);
    for i in 0..4096u32 {
        let mut prefix = vec![1u8];
        prefix.extend_from_slice(&i.to_be_bytes());
        prefix.resize(1001, b'y');
        let mut chunk = ignored.clone();
        chunk.extend(wire::frame(&prefix, false));
        s.write_all(&chunk).await.unwrap();
    }
    // A round trip: a PING answered means everything before it was processed.
    s.write_all(&wire::ping(b"done")).await.unwrap();
    let pong = wire::command(b"\x04PONGdone");
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    within(async {
        while !seen.windows(pong.len()).any(|w| w == &pong[..]) {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "publisher closed the connection");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    // What it may hold: the 4096 subscriptions it keeps (1001 B each, and their
    // entries), a read buffer and a write batch; each 8 MiB header closes its
    // connection before the body (+24.9 MiB when bodies were read, +257.7 MiB when each
    // prefix pinned its read buffer).
    let budget = 4096 * (1001 + 64) + 2 * READ_BUFFER;
    assert_within_budget(
        "publish, 40 × [8 MiB message, 1000-byte subscription], then 4096 × [64 KiB ignored, 1000-byte subscription]",
        grown,
        budget,
    );
}

/// [8 MiB on `tzz`][2 KB on `t`] × `rounds`, paced so nothing is dropped at the
/// publisher.
async fn big_then_small(publisher: &PubSocket, rounds: u64) {
    let big = Bytes::from(vec![9u8; 8 << 20]);
    let small = Bytes::from(vec![1u8; 2000]);
    for seq in 0..rounds {
        let seq_frame = Bytes::copy_from_slice(&seq.to_be_bytes());
        let report = publisher.send(Message::from_parts([
            Bytes::from_static(b"tzz"),
            seq_frame.clone(),
            big.clone(),
        ]));
        assert_eq!(report.dropped, 0);
        publisher.send(Message::from_parts([
            Bytes::from_static(b"t"),
            seq_frame,
            small.clone(),
        ]));
        assert!(publisher.flush(DEADLINE).await);
    }
}

/// A publisher and a subscriber to `t` over TCP whose retention limit is `limit`.
async fn subscribed_with_retention_limit(limit: usize) -> (PubSocket, SubSocket) {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let config = Config::builder().max_retained_bytes(limit).build().unwrap();
    let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap(), config)
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    (publisher, sub)
}

#[tokio::test]
async fn a_consumer_that_keeps_up_never_pays_for_a_copy() {
    let (publisher, mut sub) = subscribed_with_retention_limit(1 << 20).await;
    let rounds = 50;
    let sending = big_then_small(&publisher, rounds);
    let receiving = async {
        let mut small = 0;
        while small < rounds {
            let m = sub.recv().await.unwrap();
            small += u64::from(m.get(0) == Some(b"t"));
        }
    };
    within(async { tokio::join!(sending, receiving) }).await;
    // 8 MiB frames own their allocation (their holder is charged for them), so even a
    // stream of them leaves nothing retained once dropped.
    let buffers = sub.buffers();
    assert_eq!(buffers.copied_messages, 0, "{buffers:?}");
    assert!(buffers.retained <= 2 * (64 << 10), "{buffers:?}");
}

#[tokio::test]
async fn unfinished_multipart_messages_do_not_pin_read_buffers() {
    let (_child, pid, endpoint) = spawn_publish().await;
    let before = reset_peak_rss(pid);
    // Each connection starts a message (an empty frame with MORE) and never ends it,
    // putting 64 KiB of PONG commands after each of its 64 parts: 4 MiB per
    // connection that would stay pinned if each part kept its read buffer.
    let mut script = wire::hello("SUB");
    let pongs = wire::command(b"\x04PONG").repeat((64 << 10) / 7);
    for _ in 0..64 {
        script.extend(wire::frame(b"", true));
        script.extend_from_slice(&pongs);
    }
    script.extend(wire::ping(b"sync"));
    let pong = wire::command(b"\x04PONGsync");
    let mut held = Vec::new();
    for _ in 0..100 {
        let mut s = TcpStream::connect(&endpoint).await.unwrap();
        s.write_all(&script).await.unwrap();
        // The PING after it all is answered: every byte was processed.
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 4096];
        within(async {
            while !seen.windows(pong.len()).any(|w| w == &pong[..]) {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "publisher closed the connection");
                seen.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        held.push(s);
    }
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    // 100 connections × a read buffer and a PONG each; before the fix, 100 × 4 MiB.
    let budget = 100 * (READ_BUFFER + KIB);
    assert_within_budget(
        "publish, 100 connections each leaving a 64-part message unfinished, 64 KiB of commands after every part",
        grown,
        budget,
    );
}

#[tokio::test]
async fn watch_with_a_slow_reader_stays_within_its_budgets() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let (mut child, _) = support::spawn_example(
        "watch",
        &[
            "--static",
            &endpoint,
            "--namespace",
            "ns",
            "--topic",
            "t",
            "--layout",
            "topic-seq",
        ],
        false,
    )
    .await;
    let pid = child.id().unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let before = reset_peak_rss(pid);
    // The consumer reads a line every 5 ms: slow, not stalled.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let reader = tokio::spawn(async move {
        let mut n = 0u64;
        while n < 400 {
            let Ok(Some(_)) = lines.next_line().await else {
                break;
            };
            n += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        n
    });
    within(big_then_small(&publisher, 400)).await;
    assert_eq!(within(reader).await.unwrap(), 400);
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    let stats = support::terminate_for_stats(child).await;
    // The budgets in play: lanes (at most 400 × (2 KB + 170) here), retained read
    // buffers (8 MiB by default), and one 8 MiB frame being assembled plus the half
    // it grew from. Before the fix: 3.1 GB.
    let budget = 8 * MIB + 12 * MIB + 400 * 2200;
    assert_within_budget(
        "watch, 400 × [8 MiB on a topic it drops, 2 KB on its topic], a line read per 5 ms",
        grown,
        budget,
    );
    assert_eq!(stats["total"]["delivered"], 400, "{stats}");
    assert!(
        stats["retained_bytes"].as_u64().unwrap() <= (8 << 20) + (128 << 10),
        "{stats}"
    );
}

// ---------------------------------------------------------------------------------
// libzmq puts commands between the frames of a message; heartbeats after a pause.
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn commands_between_frames_of_a_message_are_handled() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut script = wire::hello("PUB");
        script.extend(wire::frame(b"t", true));
        script.extend(wire::ping(b"ctx1"));
        script.extend(wire::frame(b"middle", true));
        script.extend(wire::command(b"\x04PONG"));
        script.extend(wire::frame(b"last", false));
        s.write_all(&script).await.unwrap();
        // Our PING must be answered even though it came mid-message.
        let pong = wire::command(b"\x04PONGctx1");
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(pong.len()).any(|w| w == &pong[..]) {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            seen.extend_from_slice(&buf[..n]);
        }
        s
    });
    let mut sub = SubSocket::connect(&endpoint, Config::default())
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    let msg = within(sub.recv()).await.unwrap();
    assert_eq!(msg, Message::from_parts(["t", "middle", "last"]));
    let _server = within(server).await.unwrap();
    let stats = sub.stats();
    assert_eq!(
        (stats.pongs_sent, stats.pongs_received),
        (1, 1),
        "{stats:?}"
    );
}

#[tokio::test]
async fn a_subscriber_not_polled_for_a_while_reads_before_declaring_a_timeout() {
    // We ping every 200 ms and expect an answer within 200 ms, but tell the publisher
    // (our TTL) to tolerate 30 s of silence from us.
    let heartbeat = Config::builder()
        .heartbeat_interval(Some(Duration::from_millis(200)))
        .heartbeat_ttl(Some(Duration::from_secs(30)))
        .build()
        .unwrap();
    // The publisher pings every 200 ms with a 600 ms TTL but tolerates our silence.
    let patient = Config::builder()
        .heartbeat_interval(Some(Duration::from_millis(200)))
        .heartbeat_timeout(Some(Duration::from_secs(30)))
        .heartbeat_ttl(Some(Duration::from_millis(600)))
        .build()
        .unwrap();
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", patient).await.unwrap();
    let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap(), heartbeat)
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // Both sides ping (our PING's deadline is 200 ms, the publisher's TTL 600 ms).
    let idle = tokio::time::timeout(Duration::from_millis(1000), sub.recv()).await;
    assert!(idle.is_err(), "{idle:?}");
    assert!(sub.stats().pings_sent > 0);
    // The application is busy elsewhere: the socket is not polled for 2 s, past both
    // deadlines, while the publisher's PONGs and PINGs wait in the kernel.
    tokio::time::sleep(Duration::from_secs(2)).await;
    publisher.send(Message::from_parts(["t", "after the pause"]));
    let msg = within(sub.recv()).await.unwrap();
    assert_eq!(msg.get(1), Some(&b"after the pause"[..]));
}

// ---------------------------------------------------------------------------------
// The dynamic subscriber: drained publishers are cut, the publisher cap is counted.
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn a_removed_publisher_that_keeps_sending_is_cut_after_the_grace() {
    let memory = MemoryDiscovery::new();
    let d: Arc<dyn Discovery> = Arc::new(memory);
    let publisher = Arc::new(
        PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap(),
    );
    let id = ChannelId::new("ns", "c", "t", 1).unwrap();
    let registration = d
        .register(id, Transport::zmq(publisher.local_endpoint().unwrap()))
        .await
        .unwrap();
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("t")
        .layout(Layout::Raw)
        .spawn()
        .unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let sender = {
        let publisher = publisher.clone();
        tokio::spawn(async move {
            loop {
                publisher.send(Message::from_parts(["t", "x"]));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    within(sub.recv()).await.unwrap();
    let removed = std::time::Instant::now();
    registration.unregister().await.unwrap();
    // Drained for 500 ms, then cut, although it never stops sending.
    eventually("the departed publisher's connection cut", || {
        publisher.stats().connections == 0
    })
    .await;
    support::assert_fired_at(
        "the drain grace",
        removed.elapsed(),
        Duration::from_millis(500),
    );
    sender.abort();
    let stats = sub.stats();
    assert!(stats.publishers.is_empty(), "{stats:?}");
    assert!(stats.total.received > 0);
}

#[tokio::test]
async fn publishers_beyond_the_cap_are_refused_and_counted() {
    let memory = MemoryDiscovery::new();
    let d: Arc<dyn Discovery> = Arc::new(memory);
    let mut publishers = Vec::new();
    let mut registrations = Vec::new();
    for n in 0..3 {
        let p = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let id = ChannelId::new("ns", "c", "t", n).unwrap();
        registrations.push(
            d.register(id, Transport::zmq(p.local_endpoint().unwrap()))
                .await
                .unwrap(),
        );
        publishers.push(p);
    }
    let sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("t")
        .max_publishers(2)
        .spawn()
        .unwrap();
    eventually("two followed, one refused", || {
        let stats = sub.stats();
        stats.publishers.len() == 2 && stats.refused_publishers >= 1
    })
    .await;
    let connected: usize = publishers.iter().map(|p| p.stats().connections).sum();
    assert!(connected <= 2, "{connected}");
    drop(registrations);
}

// ---------------------------------------------------------------------------------
// Engine batches that declare more than they hold.
// ---------------------------------------------------------------------------------

/// `[ts, events: array32 of `n` nils, dp_rank 0]`: declares (and holds) `n` events.
fn nil_batch(n: u32) -> Vec<u8> {
    let mut b = vec![0x93, 0xcb];
    b.extend_from_slice(&0f64.to_be_bytes());
    b.push(0xdd);
    b.extend_from_slice(&n.to_be_bytes());
    b.resize(b.len() + n as usize, 0xc0);
    b.push(0x00);
    b
}

#[tokio::test]
async fn an_engine_batch_of_millions_of_nils_does_not_grow_kv_listen() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let (mut child, _) = support::spawn_example(
        "kv_listen",
        &[
            "--connect",
            &endpoint,
            "--topic",
            "kv",
            "--block-size",
            "4",
            "--worker-id",
            "1",
        ],
        false,
    )
    .await;
    let pid = child.id().unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let before = reset_peak_rss(pid);
    // 8 388 500 nils: just under the 8 MiB frame limit.
    let hostile = Bytes::from(nil_batch(8_388_500));
    for seq in 0..5u64 {
        publisher.send(Message::from_parts([
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            hostile.clone(),
        ]));
        assert!(publisher.flush(DEADLINE).await);
    }
    // Still serving: a valid batch after them comes out as a router event.
    let cleared = eventplane::kv::engine::encode_engine_batch(
        0.0,
        0,
        4,
        &[eventplane::kv::engine::EngineEvent::Cleared],
    )
    .unwrap();
    publisher.send(Message::from_parts([
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&5u64.to_be_bytes()),
        Bytes::from(cleared),
    ]));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = within(lines.next_line()).await.unwrap().unwrap();
    assert!(line.contains("cleared"), "{line}");
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    // Two 8 MiB frames: the message being decoded and the next one being read, each
    // allocated at its checked length; the batch is rejected at its array header
    // (+296 MiB when its 8.4 M elements were decoded).
    let budget = 16 * MIB + 2 * READ_BUFFER;
    assert_within_budget(
        "kv_listen, five engine batches of 8.4 M nils",
        grown,
        budget,
    );
}
