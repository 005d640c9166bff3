//! Interop with real libzmq (Debian's python3-zmq), both directions.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use support::{PyPeer, within};

fn payload(seq: u64, size: usize) -> Vec<u8> {
    (0..size).map(|i| ((seq + i as u64) % 251) as u8).collect()
}

async fn start_pub(extra: &[&str]) -> (PyPeer, String) {
    let mut args = vec!["pub"];
    args.extend_from_slice(extra);
    let mut peer = PyPeer::spawn(&args);
    let line = peer.line().await;
    let port = line.strip_prefix("port ").unwrap().to_owned();
    (peer, format!("tcp://127.0.0.1:{port}"))
}

/// Receives until a warmup arrived on every topic in `topics`.
async fn await_warm(sub: &mut SubSocket, topics: &[&str]) {
    let mut missing: Vec<&str> = topics.to_vec();
    while !missing.is_empty() {
        let m = within(sub.recv()).await.unwrap();
        if m.get(1) == Some(b"warmup") {
            missing.retain(|t| m.get(0).unwrap() != t.as_bytes());
        }
    }
}

/// Receives until `ends` topics sent their end marker; returns the data messages.
async fn collect_until_end(sub: &mut SubSocket, ends: usize) -> Vec<Message> {
    let mut out = Vec::new();
    let mut seen_end = 0;
    while seen_end < ends {
        let m = within(sub.recv()).await.unwrap();
        match m.get(1) {
            Some(b"warmup") => {}
            Some(b"end") => seen_end += 1,
            _ => out.push(m),
        }
    }
    out
}

fn check_stream(msgs: &[Message], topic: &str, count: u64, size: usize) {
    let mine: Vec<&Message> = msgs
        .iter()
        .filter(|m| m.get(0).unwrap() == topic.as_bytes())
        .collect();
    assert_eq!(mine.len() as u64, count, "topic {topic}");
    for (i, m) in mine.iter().enumerate() {
        assert_eq!(m.len(), 3);
        assert_eq!(m.get(1).unwrap(), &(i as u64).to_be_bytes());
        assert_eq!(m.get(2).unwrap(), &payload(i as u64, size)[..]);
    }
}

#[tokio::test]
async fn libzmq_pub_to_our_sub_with_filtering() {
    let (mut peer, endpoint) = start_pub(&[
        "--topics",
        "alpha,beta,alphabet,gamma",
        "--count",
        "500",
        "--size",
        "300",
    ])
    .await;
    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    assert_eq!(sub.peer().unwrap().socket_type(), Some(&b"PUB"[..]));
    sub.subscribe("alpha").await.unwrap();
    sub.subscribe("beta").await.unwrap();
    await_warm(&mut sub, &["alpha", "beta", "alphabet"]).await;
    peer.send_line("go").await;
    // "alpha" is a prefix of "alphabet": both arrive; "gamma" never does.
    let msgs = collect_until_end(&mut sub, 3).await;
    check_stream(&msgs, "alpha", 500, 300);
    check_stream(&msgs, "beta", 500, 300);
    check_stream(&msgs, "alphabet", 500, 300);
    assert_eq!(msgs.len(), 1500);
    // libzmq filtered on its side: no gamma (nor anything else) crossed the wire only
    // to be dropped by our local filter.
    assert_eq!(sub.stats().filtered, 0, "{:?}", sub.stats());
    assert_eq!(peer.line().await, "done");
    peer.send_line("exit").await;
    assert!(peer.wait().await.success());
}

#[tokio::test]
async fn libzmq_pub_unsubscribe_stops_topic() {
    let (mut peer, endpoint) = start_pub(&["--topics", "a,b", "--count", "200"]).await;
    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("a").await.unwrap();
    sub.subscribe("b").await.unwrap();
    await_warm(&mut sub, &["a", "b"]).await;
    sub.unsubscribe("b").await.unwrap();
    // After the cancel, b's warmups already in flight are filtered locally; a
    // round-trip on "a" proves the cancel reached libzmq before "go".
    await_warm(&mut sub, &["a"]).await;
    await_warm(&mut sub, &["a"]).await;
    let filtered = sub.stats().filtered;
    peer.send_line("go").await;
    let msgs = collect_until_end(&mut sub, 1).await;
    check_stream(&msgs, "a", 200, 16);
    assert_eq!(msgs.len(), 200);
    // Our local filter would hide b's 200 messages even if CANCEL never reached
    // libzmq; its counter shows none of them crossed the wire.
    assert_eq!(sub.stats().filtered, filtered, "{:?}", sub.stats());
    peer.send_line("exit").await;
    peer.wait().await;
}

#[tokio::test]
async fn libzmq_pub_heartbeats_are_answered() {
    // libzmq pings every 100 ms and drops us if no PONG comes within 300 ms; it stays
    // quiet for 1.5 s before publishing. Our heartbeats are off, so nothing but our
    // PONGs reaches libzmq in that time: only they keep the stream alive.
    let (mut peer, endpoint) = start_pub(&[
        "--topics",
        "hb",
        "--count",
        "100",
        "--heartbeat-ivl",
        "100",
        "--heartbeat-timeout",
        "300",
        "--quiet-ms",
        "1500",
    ])
    .await;
    let config = Config::builder().heartbeat_interval(None).build().unwrap();
    let mut sub = within(SubSocket::connect(&endpoint, config)).await.unwrap();
    sub.subscribe("hb").await.unwrap();
    await_warm(&mut sub, &["hb"]).await;
    peer.send_line("go").await;
    let msgs = collect_until_end(&mut sub, 1).await;
    check_stream(&msgs, "hb", 100, 16);
    let stats = sub.stats();
    // Our heartbeats were off: what kept libzmq's 300 ms timeout from closing the
    // connection through 1.5 s of quiet can only have been our PONGs.
    assert_eq!(stats.pings_sent, 0, "{stats:?}");
    assert!(stats.pings_received >= 10, "{stats:?}");
    peer.send_line("exit").await;
    peer.wait().await;
}

#[tokio::test]
async fn our_pub_heartbeats_are_answered_by_libzmq() {
    // Our PUB pings every 100 ms and drops a subscriber silent for 300 ms; the libzmq
    // SUB has no heartbeat of its own and sends nothing after its subscription, so
    // only its PONGs keep it connected through 1.5 s of quiet.
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_millis(100)))
        .heartbeat_timeout(Some(Duration::from_millis(300)))
        .build()
        .unwrap();
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", config).await.unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let mut peer = PyPeer::spawn(&[
        "sub",
        "--endpoint",
        &endpoint,
        "--topics",
        "hb",
        "--count",
        "50",
    ]);
    warm_libzmq_sub(&publisher, &mut peer, &["hb"]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for seq in 0..50u64 {
        let report = publisher.send(Message::from_parts([
            Bytes::from("hb"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload(seq, 16)),
        ]));
        assert_eq!(
            (report.queued, report.dropped),
            (1, 0),
            "the subscriber is gone"
        );
    }
    for seq in 0..50u64 {
        let line = peer.line().await;
        let frames: Vec<&str> = line.strip_prefix("msg ").unwrap().split(' ').collect();
        assert_eq!(hex(frames[1]), seq.to_be_bytes());
    }
    let subscriber = &publisher.subscriber_stats()[0];
    let session = subscriber.session;
    assert_eq!(session.pings_received, 0, "{session:?}");
    assert!(session.pings_sent >= 10, "{session:?}");
    assert!(session.pongs_received >= 10, "{session:?}");
    assert_eq!(publisher.stats().failed, 0, "{:?}", publisher.stats());
    assert_eq!(peer.line().await, "done");
    assert!(peer.wait().await.success());
}

/// Publishes warmups on `topics` every 20 ms until the libzmq SUB reports each.
async fn warm_libzmq_sub(publisher: &PubSocket, peer: &mut PyPeer, topics: &[&'static str]) {
    let mut warm = 0;
    let mut ticker = tokio::time::interval(Duration::from_millis(20));
    within(async {
        while warm < topics.len() {
            tokio::select! {
                _ = ticker.tick() => {
                    for t in topics {
                        publisher.send(Message::from_parts([*t, "warmup"]));
                    }
                }
                line = peer.line() => {
                    assert!(line.starts_with("warm "), "{line}");
                    warm += 1;
                }
            }
        }
    })
    .await;
}

#[tokio::test]
async fn libzmq_heartbeat_between_the_frames_of_large_messages() {
    // libzmq's heartbeat timer switches the engine's next frame to a PING regardless
    // of MORE: with a 1 ms interval, 10-frame messages of ~160 KB get PINGs between
    // their frames. Every message must arrive whole, in order.
    let (mut peer, endpoint) = start_pub(&[
        "--topics",
        "hb",
        "--count",
        "3000",
        "--parts",
        "10",
        "--size",
        "20000",
        "--heartbeat-ivl",
        "1",
        "--heartbeat-timeout",
        "10000",
        "--heartbeat-ttl",
        "10000",
    ])
    .await;
    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("hb").await.unwrap();
    await_warm(&mut sub, &["hb"]).await;
    peer.send_line("go").await;
    // Checked as they arrive (3000 × 160 KB is not kept).
    let mut seq = 0u64;
    loop {
        let m = within(sub.recv()).await.unwrap();
        match m.get(1) {
            Some(b"warmup") => continue,
            Some(b"end") => break,
            _ => {}
        }
        assert_eq!(m.len(), 10);
        assert_eq!(m.get(1).unwrap(), &seq.to_be_bytes());
        for k in 0..8u64 {
            assert_eq!(m.get(2 + k as usize).unwrap(), &payload(seq + k, 20000)[..]);
        }
        seq += 1;
    }
    assert_eq!(seq, 3000);
    let stats = sub.stats();
    eprintln!(
        "libzmq heartbeat: {} PINGs, {} between the frames of a message",
        stats.pings_received, stats.commands_between_frames
    );
    assert!(stats.pings_received > 0, "{stats:?}");
    assert_eq!(
        stats.pongs_sent + stats.pongs_coalesced,
        stats.pings_received
    );
    peer.send_line("exit").await;
    peer.wait().await;
}

#[tokio::test]
async fn libzmq_pub_restarted_mid_stream() {
    let (mut first, endpoint) = start_pub(&["--topics", "r", "--count", "-1"]).await;
    let port = endpoint.rsplit(':').next().unwrap().to_owned();
    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("r").await.unwrap();
    await_warm(&mut sub, &["r"]).await;
    first.send_line("go").await;
    let mut last_seq = None;
    for _ in 0..1000 {
        let m = within(sub.recv()).await.unwrap();
        if m.len() == 3 {
            last_seq = Some(m.part(1).unwrap());
        }
    }
    assert!(last_seq.is_some());
    first.child.start_kill().unwrap();
    // Everything buffered is delivered, then a typed I/O error, never a panic.
    let err = within(async {
        loop {
            if let Err(e) = sub.recv().await {
                break e;
            }
        }
    })
    .await;
    assert!(err.is_io(), "{err:?}");
    first.wait().await;

    // The restarted publisher on the same port: a new connection resumes the stream.
    let (mut second, endpoint2) =
        start_pub(&["--topics", "r", "--count", "50", "--port", &port]).await;
    assert_eq!(endpoint, endpoint2);
    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("r").await.unwrap();
    await_warm(&mut sub, &["r"]).await;
    second.send_line("go").await;
    let msgs = collect_until_end(&mut sub, 1).await;
    check_stream(&msgs, "r", 50, 16);
    second.send_line("exit").await;
    second.wait().await;
}

#[tokio::test]
async fn our_pub_to_libzmq_sub_with_filtering() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    const COUNT: u64 = 300;
    let mut peer = PyPeer::spawn(&[
        "sub",
        "--endpoint",
        &endpoint,
        "--topics",
        "alpha,beta",
        "--count",
        &(2 * COUNT).to_string(),
    ]);
    // Warm up until libzmq has seen both subscriptions take effect.
    warm_libzmq_sub(&publisher, &mut peer, &["alpha", "beta"]).await;
    // libzmq's SUB filters again on its side, so what it prints cannot show that our
    // PUB filtered: each send's report says how many subscribers it was queued to.
    for seq in 0..COUNT {
        for t in ["alpha", "gamma", "beta", "alphabet"] {
            let report = publisher.send(Message::from_parts([
                Bytes::from(t),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload(seq, 100)),
            ]));
            let expected = usize::from(t != "gamma");
            assert_eq!((report.queued, report.dropped), (expected, 0), "{t} {seq}");
        }
    }
    let mut per_topic: HashMap<String, Vec<u64>> = HashMap::new();
    loop {
        let line = peer.line().await;
        if line == "done" {
            break;
        }
        assert!(!line.starts_with("LEAK"), "{line}");
        let frames: Vec<&str> = line.strip_prefix("msg ").unwrap().split(' ').collect();
        assert_eq!(frames.len(), 3, "{line}");
        let topic = String::from_utf8(hex(frames[0])).unwrap();
        let seq = u64::from_be_bytes(hex(frames[1]).try_into().unwrap());
        assert_eq!(hex(frames[2]), payload(seq, 100));
        per_topic.entry(topic).or_default().push(seq);
    }
    // The libzmq SUB exits after 2 × COUNT messages: alpha, beta and alphabet
    // (prefix "alpha") interleave in send order, so each got exactly seq 0..2/3 COUNT.
    let expected: Vec<u64> = (0..2 * COUNT / 3).collect();
    assert_eq!(per_topic.len(), 3, "{:?}", per_topic.keys());
    for t in ["alpha", "beta", "alphabet"] {
        assert_eq!(per_topic[t], expected, "{t}");
    }
    assert!(peer.wait().await.success());
    let stats = publisher.stats();
    assert_eq!(stats.dropped, 0);
}

fn hex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
