//! Our PubSocket and SubSocket together: fan-out, per-subscriber bounded queues with
//! counted drops, subscription matching, linger, and heartbeats in paused time.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use tokio::io::DuplexStream;

use std::time::Duration;

use bytes::Bytes;
use eventplane::zmtp::{Config, Error, Message, PubSocket, SubSocket, TimeoutKind};
use support::within;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn msg(topic: &str, seq: u64, size: usize) -> Message {
    Message::from_parts([
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(vec![seq as u8; size]),
    ])
}

async fn tcp_pair(config: Config, topics: &[&str]) -> (PubSocket, Vec<SubSocket>) {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", config.clone())
        .await
        .unwrap();
    let ep = publisher.local_endpoint().unwrap().to_owned();
    let mut subs = Vec::new();
    for t in topics {
        let mut s = within(SubSocket::connect(&ep, config.clone()))
            .await
            .unwrap();
        s.subscribe(t.to_string()).await.unwrap();
        subs.push(s);
    }
    within(publisher.wait_for_subscribers(topics.len())).await;
    (publisher, subs)
}

#[tokio::test]
async fn fan_out_with_prefix_filtering() {
    let (publisher, mut subs) = tcp_pair(Config::default(), &["a", "ab", ""]).await;
    for seq in 0..100 {
        for t in ["a", "abc", "b"] {
            publisher.send(msg(t, seq, 10));
        }
    }
    let expect = [200usize, 100, 300];
    for (sub, n) in subs.iter_mut().zip(expect) {
        let mut got = Vec::new();
        while got.len() < n {
            within(sub.recv_many(&mut got, 64)).await.unwrap();
        }
        assert_eq!(got.len(), n);
    }
    let stats = publisher.stats();
    assert_eq!(stats.messages, 300);
    assert_eq!(stats.queued, 600);
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.connections, 3);
}

#[tokio::test]
async fn overlapping_subscriptions_deliver_once_and_cancel() {
    let (publisher, mut subs) = tcp_pair(Config::default(), &["k"]).await;
    let sub = &mut subs[0];
    sub.subscribe("kv").await.unwrap();
    sub.subscribe("").await.unwrap();
    // Wait until all three prefixes are in; then one message matching all three
    // arrives once.
    within(async {
        while publisher.subscriber_stats()[0].subscriptions != 3 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(publisher.send(msg("kv-1", 0, 1)).queued, 1);
    let first = within(sub.recv()).await.unwrap();
    assert_eq!(first.get(0).unwrap(), b"kv-1");
    sub.unsubscribe("").await.unwrap();
    sub.unsubscribe("k").await.unwrap();
    sub.unsubscribe("kv").await.unwrap();
    sub.subscribe("end").await.unwrap();
    within(async {
        while publisher.stats().subscribed != 1
            || publisher.subscriber_stats()[0].subscriptions != 1
        {
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(publisher.send(msg("kv-2", 1, 1)).queued, 0);
    publisher.send(msg("end", 2, 1));
    let second = within(sub.recv()).await.unwrap();
    assert_eq!(second.get(0).unwrap(), b"end");
}

#[tokio::test]
async fn thousands_of_subscriptions() {
    let config = Config::builder().max_subscriptions(5000).build().unwrap();
    let (publisher, mut subs) = tcp_pair(config, &["t0000", "u"]).await;
    for i in 1..3000 {
        subs[0].subscribe(format!("t{i:04}")).await.unwrap();
    }
    subs[0].subscribe("end").await.unwrap();
    subs[1].subscribe("end").await.unwrap();
    // Wait for the last subscription: "end" reaches both.
    within(async {
        loop {
            if publisher.send(Message::from_parts(["end"])).queued == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    publisher.send(msg("t2999-x", 1, 1));
    publisher.send(msg("v", 2, 1));
    publisher.send(msg("u1", 3, 1));
    publisher.send(Message::from_parts(["end", "last"]));
    let mut got0 = Vec::new();
    loop {
        let m = within(subs[0].recv()).await.unwrap();
        if m.get(1) == Some(b"last") {
            break;
        }
        if m.get(0).unwrap() != b"end" {
            got0.push(m);
        }
    }
    assert_eq!(got0.len(), 1);
    assert_eq!(got0[0].get(0).unwrap(), b"t2999-x");
    let s0 = publisher
        .subscriber_stats()
        .into_iter()
        .map(|s| s.subscriptions)
        .max()
        .unwrap();
    assert_eq!(s0, 3001);
}

/// A subscriber on an in-memory pipe that never reads after the handshake.
async fn stuck_subscriber(
    publisher: &PubSocket,
    config: &Config,
) -> SubSocket<tokio::io::DuplexStream> {
    let (a, b) = tokio::io::duplex(4096);
    publisher.accept_stream(a, "stuck");
    let mut sub = within(SubSocket::handshake(b, config.clone()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    sub
}

#[tokio::test]
async fn slow_subscriber_drops_are_counted_and_isolated() {
    let config = Config::builder().send_queue_messages(100).build().unwrap();
    let publisher = PubSocket::new(config.clone());
    let _stuck = stuck_subscriber(&publisher, &config).await;
    let (a, b) = tokio::io::duplex(1 << 20);
    publisher.accept_stream(a, "fast");
    let mut fast = within(SubSocket::handshake(b, config.clone()))
        .await
        .unwrap();
    fast.subscribe("").await.unwrap();
    within(publisher.wait_for_subscribers(2)).await;

    const N: u64 = 5000;
    let mut received = Vec::new();
    for batch in 0..(N / 50) {
        for i in 0..50 {
            publisher.send(msg("t", batch * 50 + i, 100));
        }
        // The fast subscriber keeps up: drain this batch before sending the next.
        while received.len() < ((batch + 1) * 50) as usize {
            within(fast.recv_many(&mut received, 1000)).await.unwrap();
        }
    }
    assert_eq!(received.len() as u64, N);
    for (i, m) in received.iter().enumerate() {
        assert_eq!(m.get(1).unwrap(), &(i as u64).to_be_bytes());
    }
    let per = publisher.subscriber_stats();
    let fast_stats = per.iter().find(|s| s.peer == "fast").unwrap();
    let stuck_stats = per.iter().find(|s| s.peer == "stuck").unwrap();
    assert_eq!(fast_stats.dropped, 0);
    assert!(stuck_stats.dropped > 0);
    assert!(stuck_stats.queue_len <= 100);
    // Every message is accounted for: written to the pipe, queued, or dropped.
    assert_eq!(
        stuck_stats.written + stuck_stats.queue_len as u64 + stuck_stats.dropped,
        N
    );
    assert_eq!(publisher.stats().dropped, stuck_stats.dropped);
}

#[tokio::test]
async fn byte_bound_on_subscriber_queue() {
    let config = Config::builder().send_queue_bytes(200_000).build().unwrap();
    let publisher = PubSocket::new(config.clone());
    let _stuck = stuck_subscriber(&publisher, &config).await;
    within(publisher.wait_for_subscribers(1)).await;
    for seq in 0..100 {
        publisher.send(msg("t", seq, 16 << 10));
    }
    let s = &publisher.subscriber_stats()[0];
    assert!(s.queue_bytes <= 200_000, "{s:?}");
    assert!(s.dropped > 0);
    assert_eq!(s.written + s.queue_len as u64 + s.dropped, 100);
}

#[tokio::test]
async fn close_lingers_until_queues_drain() {
    let (publisher, mut subs) = tcp_pair(Config::default(), &[""]).await;
    for seq in 0..2000 {
        publisher.send(msg("t", seq, 1000));
    }
    let reader = tokio::spawn(async move {
        let mut n = 0;
        let mut sub = subs.pop().unwrap();
        loop {
            match sub.recv().await {
                Ok(_) => n += 1,
                Err(e) => break (n, e),
            }
        }
    });
    within(publisher.close(Duration::from_secs(10))).await;
    let (n, err) = within(reader).await.unwrap();
    assert_eq!(n, 2000);
    assert!(err.is_io(), "{err:?}");
}

fn heartbeat(on: bool) -> Config {
    Config::builder()
        .heartbeat_interval(on.then_some(Duration::from_secs(1)))
        .heartbeat_timeout(on.then_some(Duration::from_secs(3)))
        .build()
        .unwrap()
}

/// A publisher and a subscribed subscriber over an in-memory pipe, each with its own
/// heartbeat setting, left idle for a minute of paused time.
async fn idle_minute(pub_pings: bool, sub_pings: bool) -> (PubSocket, SubSocket<DuplexStream>) {
    let publisher = PubSocket::new(heartbeat(pub_pings));
    let (a, b) = tokio::io::duplex(1 << 16);
    publisher.accept_stream(a, "hb");
    let mut sub = SubSocket::handshake(b, heartbeat(sub_pings)).await.unwrap();
    sub.subscribe("").await.unwrap();
    publisher.wait_for_subscribers(1).await;
    let idle = tokio::time::timeout(Duration::from_secs(60), sub.recv()).await;
    assert!(idle.is_err(), "nothing was published");
    (publisher, sub)
}

async fn still_alive(publisher: &PubSocket, sub: &mut SubSocket<DuplexStream>) {
    assert_eq!(publisher.stats().failed, 0, "{:?}", publisher.stats());
    let report = publisher.send(Message::from_parts(["still", "alive"]));
    assert_eq!(report.queued, 1);
    assert_eq!(sub.recv().await.unwrap().get(1).unwrap(), b"alive");
}

#[tokio::test(start_paused = true)]
async fn the_subscribers_pongs_alone_keep_a_pinging_publisher_from_timing_out() {
    // The subscriber sends nothing of its own after subscribing: only its PONGs show
    // the publisher it is alive, through 20 heartbeat timeouts.
    let (publisher, mut sub) = idle_minute(true, false).await;
    let stats = sub.stats();
    assert_eq!(stats.pings_sent, 0, "{stats:?}");
    assert!(stats.pings_received >= 50, "{stats:?}");
    still_alive(&publisher, &mut sub).await;
    let session = publisher.subscriber_stats()[0].session;
    assert!(session.pongs_received >= 50, "{session:?}");
    assert_eq!(session.pings_received, 0, "{session:?}");
}

#[tokio::test(start_paused = true)]
async fn the_publishers_pongs_alone_keep_a_pinging_subscriber_from_timing_out() {
    let (publisher, mut sub) = idle_minute(false, true).await;
    let stats = sub.stats();
    assert_eq!(stats.pings_received, 0, "{stats:?}");
    assert!(stats.pings_sent >= 50, "{stats:?}");
    assert!(stats.pongs_received >= 50, "{stats:?}");
    still_alive(&publisher, &mut sub).await;
    // (The subscriber's PONG count above is what proves the answers arrived; the
    // publisher only confirms it never pinged.)
    let session = publisher.subscriber_stats()[0].session;
    assert_eq!(session.pings_sent, 0, "{session:?}");
}

#[tokio::test(start_paused = true)]
async fn silent_peer_times_out() {
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_timeout(Some(Duration::from_secs(3)))
        .build()
        .unwrap();
    // A "publisher" that completes the handshake and then never answers anything.
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let peer = tokio::spawn(async move {
        let mut g = [0u8; 64];
        raw.read_exact(&mut g).await.unwrap();
        let mut ours = g;
        ours[11] = 1;
        raw.write_all(&ours).await.unwrap();
        raw.write_all(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB")
            .await
            .unwrap();
        let mut sink = vec![0u8; 4096];
        while raw.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    let start = tokio::time::Instant::now();
    let mut sub = SubSocket::handshake(b, config).await.unwrap();
    let err = sub.recv().await.unwrap_err();
    assert!(
        matches!(err, Error::Timeout(TimeoutKind::Heartbeat)),
        "{err:?}"
    );
    // First PING at 1 s, deadline 3 s after it.
    assert_eq!(start.elapsed(), Duration::from_secs(4));
    drop(sub);
    peer.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn handshake_timeout_in_paused_time() {
    let config = Config::default();
    let (_keep, b) = tokio::io::duplex(1024);
    let start = tokio::time::Instant::now();
    let err = SubSocket::handshake(b, config).await.unwrap_err();
    assert!(matches!(err, Error::Timeout(TimeoutKind::Handshake)));
    assert_eq!(start.elapsed(), Duration::from_secs(10));
}

#[tokio::test]
async fn protocol_error_on_pub_side_closes_only_that_subscriber() {
    let config = Config::builder().max_subscription_size(8).build().unwrap();
    let (publisher, mut subs) = tcp_pair(config, &["ok"]).await;
    let ep = publisher.local_endpoint().unwrap().to_owned();
    let mut bad = within(SubSocket::connect(&ep, Config::default()))
        .await
        .unwrap();
    bad.subscribe("this prefix is far too long").await.unwrap();
    let err = within(bad.recv()).await.unwrap_err();
    assert!(err.is_io(), "{err:?}");
    publisher.send(Message::from_parts(["ok", "1"]));
    assert_eq!(within(subs[0].recv()).await.unwrap().get(1).unwrap(), b"1");
    within(async {
        while publisher.stats().failed == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn flush_returns_once_a_blocked_write_completes() {
    // A small pipe makes the writer block mid-batch; when the reader drains it, the
    // completed write must count as progress so `flush` learns the queue is empty.
    let publisher = PubSocket::new(Config::default());
    let (a, b) = tokio::io::duplex(4096);
    publisher.accept_stream(a, "small-pipe");
    let mut sub = SubSocket::handshake(b, Config::default()).await.unwrap();
    sub.subscribe("").await.unwrap();
    publisher.wait_for_subscribers(1).await;
    for seq in 0..500 {
        publisher.send(msg("t", seq, 100));
    }
    let reader = tokio::spawn(async move {
        for _ in 0..500 {
            sub.recv().await.unwrap();
        }
        sub
    });
    // With paused time an unnoticed completion would run straight into the timeout.
    assert!(
        publisher.flush(Duration::from_secs(20)).await,
        "flush timed out"
    );
    let _sub = reader.await.unwrap();
}
