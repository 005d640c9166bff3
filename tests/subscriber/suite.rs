//! DynamicSubscriber end to end over real TCP: publishers appear, disappear, move,
//! restart; stale removals; discovery failures; fairness; the memory bound; the address
//! filter; shutdown; exact topics.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use eventplane::discovery::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream,
    FaultDiscovery, Instance, MemoryDiscovery, Query, Registration, Transport,
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{Delivery, DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket};
use support::within;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Polls `condition` every 10 ms until it holds (stats cannot be awaited).
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A publisher we control at the socket level, registered by hand.
struct RawPub {
    socket: PubSocket,
    id: ChannelId,
}

impl RawPub {
    async fn bind(port: u16, id: ChannelId) -> RawPub {
        let socket = PubSocket::bind(&format!("tcp://127.0.0.1:{port}"), Config::default())
            .await
            .unwrap();
        RawPub { socket, id }
    }

    fn endpoint(&self) -> String {
        self.socket.local_endpoint().unwrap().to_owned()
    }

    async fn register(&self, d: &dyn Discovery) -> Registration {
        d.register(self.id.clone(), Transport::zmq(self.endpoint()))
            .await
            .unwrap()
    }

    fn send(&self, topic: &str, seq: u64, payload: &[u8]) {
        self.socket.send(Message::from_parts([
            Bytes::copy_from_slice(topic.as_bytes()),
            Bytes::copy_from_slice(&self.id.publisher_id().to_be_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ]));
    }
}

fn id(n: u64) -> ChannelId {
    ChannelId::new("ns", "worker", "kv", n).unwrap()
}

fn subscriber(d: Arc<dyn Discovery>) -> DynamicSubscriber {
    DynamicSubscriber::builder(d, Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicPublisherSeq)
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(100))
        .rewatch_backoff(Duration::from_millis(10), Duration::from_millis(100))
        .spawn()
        .unwrap()
}

async fn next(sub: &mut DynamicSubscriber) -> Delivery {
    within(sub.recv()).await.expect("subscriber ended")
}

#[tokio::test]
async fn publishers_appear_disappear_move_and_restart() {
    let memory = MemoryDiscovery::new();
    let d: Arc<dyn Discovery> = Arc::new(memory.clone());
    let mut sub = subscriber(d.clone());

    // Two EventPublishers appear.
    let p1 = EventPublisher::builder(d.clone(), "ns", "worker", "kv")
        .build()
        .await
        .unwrap();
    let p2 = EventPublisher::builder(d.clone(), "ns", "worker", "kv")
        .build()
        .await
        .unwrap();
    within(p1.wait_for_subscribers(1)).await;
    within(p2.wait_for_subscribers(1)).await;
    for i in 0..10u8 {
        p1.publish(vec![i]);
        p2.publish(vec![100 + i]);
    }
    let mut seqs: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for _ in 0..20 {
        let d = next(&mut sub).await;
        seqs.entry(d.source.id.publisher_id())
            .or_default()
            .push(d.sequence.unwrap());
    }
    assert_eq!(seqs.len(), 2);
    assert!(seqs.values().all(|s| *s == (0..10).collect::<Vec<_>>()));

    // One disappears.
    p2.shutdown().await;
    let h = sub.handle();
    eventually("p2 dropped from stats", || h.stats().publishers.len() == 1).await;

    // A raw publisher registers, then re-registers the same id on a new port.
    let a = RawPub::bind(0, id(7)).await;
    let _old = a.register(&*d).await;
    within(a.socket.wait_for_subscribers(1)).await;
    a.send("kv", 0, b"from-a");
    assert_eq!(next(&mut sub).await.message.get(3).unwrap(), b"from-a");
    let b = RawPub::bind(0, id(7)).await;
    let moved = b.register(&*d).await;
    within(b.socket.wait_for_subscribers(1)).await;
    eventually("the old endpoint's connection closed", || {
        a.socket.stats().connections == 0
    })
    .await;
    b.send("kv", 0, b"from-b");
    let got = next(&mut sub).await;
    assert_eq!(got.message.get(3).unwrap(), b"from-b");
    assert_eq!(got.source.incarnation, moved.instance().incarnation);

    // B restarts on the same port: reconnect, resubscribe, sequence reset is no gap.
    let port = b.socket.local_addr().unwrap().port();
    // `close` waits for the listener task, so the port is free to bind again.
    b.socket.close(Duration::ZERO).await;
    let b2 = RawPub::bind(port, id(7)).await;
    within(b2.socket.wait_for_subscribers(1)).await;
    b2.send("kv", 0, b"restarted");
    assert_eq!(next(&mut sub).await.message.get(3).unwrap(), b"restarted");
    // Then a jump: 4 messages missing.
    b2.send("kv", 5, b"jump");
    assert_eq!(next(&mut sub).await.sequence, Some(5));
    let stats = sub.stats();
    let s7 = &stats
        .publishers
        .iter()
        .find(|(i, _)| *i == id(7))
        .unwrap()
        .1;
    assert!(s7.reconnects >= 1, "{s7:?}");
    assert_eq!((s7.gaps, s7.gap_messages), (1, 4), "{s7:?}");
    p1.shutdown().await;
}

/// A discovery whose single watch replays scripted events.
#[derive(Debug)]
struct Scripted {
    events: std::sync::Mutex<Option<mpsc::Receiver<DiscoveryEvent>>>,
}

impl Discovery for Scripted {
    fn register_with(
        &self,
        _: ChannelId,
        _: Transport,
        _: Option<eventplane::discovery::WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async {
            Err(DiscoveryError::Unsupported {
                operation: "register",
            })
        })
    }
    fn list(&self, _: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async { Ok(vec![]) })
    }
    fn watch(
        &self,
        _: Query,
        _: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        let rx = self.events.lock().unwrap().take();
        Box::pin(async move {
            let rx = rx.ok_or(DiscoveryError::Closed)?;
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|e| (Ok(e), rx))
            });
            Ok(DiscoveryStream::new(stream))
        })
    }
}

#[tokio::test]
async fn late_removal_of_an_older_incarnation_keeps_the_connection() {
    let (tx, rx) = mpsc::channel(16);
    let scripted: Arc<dyn Discovery> = Arc::new(Scripted {
        events: std::sync::Mutex::new(Some(rx)),
    });
    let p = RawPub::bind(0, id(1)).await;
    let current = Instance::new(id(1), Transport::zmq(p.endpoint()), 5);
    let mut sub = subscriber(scripted);
    tx.send(DiscoveryEvent::Added(current.clone()))
        .await
        .unwrap();
    tx.send(DiscoveryEvent::Resync(vec![current]))
        .await
        .unwrap();
    within(p.socket.wait_for_subscribers(1)).await;
    tx.send(DiscoveryEvent::Removed {
        id: id(1),
        incarnation: 3,
    })
    .await
    .unwrap();
    p.send("kv", 0, b"still here");
    assert_eq!(next(&mut sub).await.message.get(3).unwrap(), b"still here");
    assert_eq!(p.socket.stats().accepted, 1);
    assert_eq!(sub.stats().total.reconnects, 0);
    // The current incarnation's removal does cut it.
    tx.send(DiscoveryEvent::Removed {
        id: id(1),
        incarnation: 5,
    })
    .await
    .unwrap();
    eventually("connection closed", || p.socket.stats().connections == 0).await;
}

#[tokio::test]
async fn watch_failure_rewatches_keeps_connections_and_reconciles() {
    let (d, faults) = FaultDiscovery::new(Arc::new(MemoryDiscovery::new()));
    let d: Arc<dyn Discovery> = Arc::new(d);
    let a = RawPub::bind(0, id(1)).await;
    let b = RawPub::bind(0, id(2)).await;
    let ga = a.register(&*d).await;
    let _gb = b.register(&*d).await;
    let mut sub = subscriber(d.clone());
    within(a.socket.wait_for_subscribers(1)).await;
    within(b.socket.wait_for_subscribers(1)).await;

    // The watch fails; meanwhile A leaves and C arrives.
    faults.fail_watches("injected");
    drop(ga);
    let c = RawPub::bind(0, id(3)).await;
    let _gc = c.register(&*d).await;
    // After the re-watch, its Resync drops A and adds C; B's connection is untouched.
    within(c.socket.wait_for_subscribers(1)).await;
    eventually("A's connection closed", || {
        a.socket.stats().connections == 0
    })
    .await;
    assert_eq!(b.socket.stats().accepted, 1, "B was never reconnected");
    b.send("kv", 0, b"b");
    c.send("kv", 0, b"c");
    let mut got = [next(&mut sub).await, next(&mut sub).await];
    got.sort_by_key(|d| d.source.id.publisher_id());
    assert_eq!(got[0].message.get(3).unwrap(), b"b");
    assert_eq!(got[1].message.get(3).unwrap(), b"c");
    let stats = sub.stats();
    assert!(stats.rewatches >= 1);
    assert_eq!(stats.total.reconnects, 0);

    // A backend-side Resync changes nothing when nothing changed.
    faults.inject_resync();
    b.send("kv", 1, b"b2");
    assert_eq!(next(&mut sub).await.message.get(3).unwrap(), b"b2");
    assert_eq!(b.socket.stats().accepted, 1);
}

#[tokio::test]
async fn a_flood_cannot_starve_a_quiet_publisher() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let flood = Arc::new(RawPub::bind(0, id(1)).await);
    let quiet = RawPub::bind(0, id(2)).await;
    let _g1 = flood.register(&*d).await;
    let _g2 = quiet.register(&*d).await;
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicPublisherSeq)
        .lane_capacity(64)
        .spawn()
        .unwrap();
    within(flood.socket.wait_for_subscribers(1)).await;
    within(quiet.socket.wait_for_subscribers(1)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = {
        let (flood, stop) = (flood.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seq = 0;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..200 {
                    flood.send("kv", seq, &[0u8; 200]);
                    seq += 1;
                }
                tokio::task::yield_now().await;
            }
        })
    };
    // A slow consumer: one message every 2 ms, while the quiet one sends 10 msg/s.
    let mut quiet_seqs = Vec::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    let mut sent = 0;
    let mut slow = tokio::time::interval(Duration::from_millis(2));
    within(async {
        while quiet_seqs.len() < 20 {
            tokio::select! {
                _ = ticker.tick(), if sent < 20 => {
                    quiet.send("kv", sent, b"quiet");
                    sent += 1;
                }
                _ = slow.tick() => {
                    let d = next(&mut sub).await;
                    if d.source.id == id(2) {
                        quiet_seqs.push(d.sequence.unwrap());
                    }
                }
            }
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    flooder.await.unwrap();
    assert_eq!(quiet_seqs, (0..20).collect::<Vec<_>>());
    let stats = sub.stats();
    let by_id: BTreeMap<ChannelId, _> = stats.publishers.into_iter().collect();
    let (f, q) = (&by_id[&id(1)], &by_id[&id(2)]);
    assert!(f.dropped_lane_full + f.dropped_budget > 0, "{f:?}");
    assert_eq!(q.dropped(), 0, "{q:?}");
    assert_eq!((q.gaps, q.received, q.delivered), (0, 20, 20), "{q:?}");
}

#[tokio::test]
async fn thirty_two_floods_and_a_slow_consumer_stay_within_the_budget_and_balance() {
    const BUDGET: usize = 1 << 20;
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut pubs = Vec::new();
    let mut guards = Vec::new();
    for n in 0..32 {
        let p = Arc::new(RawPub::bind(0, id(n)).await);
        guards.push(p.register(&*d).await);
        pubs.push(p);
    }
    let sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicPublisherSeq)
        .lane_bytes(256 << 10)
        .max_buffered_bytes(BUDGET)
        .spawn()
        .unwrap();
    for p in &pubs {
        within(p.socket.wait_for_subscribers(1)).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for p in &pubs {
        let (p, stop) = (p.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut seq = 0;
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..50 {
                    p.send("kv", seq, &[1u8; 1024]);
                    seq += 1;
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    // A slow consumer: 64 messages every 10 ms, counted per publisher.
    let handle = sub.handle();
    let consumer_stop = Arc::new(AtomicBool::new(false));
    let consumer = {
        let stop = consumer_stop.clone();
        let mut sub = sub;
        tokio::spawn(async move {
            let mut per_publisher: BTreeMap<u64, u64> = BTreeMap::new();
            let mut buf = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                buf.clear();
                let got =
                    tokio::time::timeout(Duration::from_millis(10), sub.recv_many(&mut buf, 64));
                if got.await.is_ok() {
                    for d in &buf {
                        *per_publisher.entry(d.source.id.publisher_id()).or_default() += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (sub, per_publisher)
        })
    };
    // Sample the budget throughout.
    let mut max_seen = 0;
    for _ in 0..150 {
        let s = handle.stats();
        max_seen = max_seen.max(s.buffered_bytes);
        assert!(
            s.buffered_bytes <= BUDGET,
            "{} > {BUDGET}",
            s.buffered_bytes
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    // Quiesce before reading any counter: every publisher's output is written out,
    // then every byte of it has been read by the subscriber (nothing else is in
    // flight), then the consumer stops. From here no counter moves.
    for p in &pubs {
        assert!(p.socket.flush(Duration::from_secs(30)).await);
    }
    let written: BTreeMap<u64, u64> = pubs
        .iter()
        .map(|p| (p.id.publisher_id(), p.socket.subscriber_stats()[0].written))
        .collect();
    eventually("the subscriber read everything written", || {
        let s = handle.stats();
        s.publishers.len() == 32
            && s.publishers
                .iter()
                .all(|(id, p)| p.received == written[&id.publisher_id()])
    })
    .await;
    consumer_stop.store(true, Ordering::Relaxed);
    let (sub, consumed) = within(consumer).await.unwrap();
    let s = sub.stats();
    assert!(
        max_seen > BUDGET / 2,
        "the floods never filled the budget ({max_seen})"
    );
    assert!(
        s.total.dropped_lane_full + s.total.dropped_budget > 0,
        "{:?}",
        s.total
    );
    assert_eq!(s.publishers.len(), 32);
    // Per publisher (each its own lane here): every message read is delivered,
    // still buffered, or counted as dropped; and what the consumer counted is what
    // the subscriber says it delivered.
    for (id, p) in &s.publishers {
        assert!(p.received > 0, "{id}: {p:?}");
        assert_eq!(
            p.received,
            p.delivered + p.depth as u64 + p.dropped(),
            "{id}: {p:?}"
        );
        assert_eq!(
            consumed.get(&id.publisher_id()).copied().unwrap_or(0),
            p.delivered,
            "{id}: {p:?}"
        );
    }
    assert_eq!(
        s.total.received,
        s.total.delivered + s.total.depth as u64 + s.total.dropped(),
        "{:?}",
        s.total
    );
    assert!(s.total.delivered > 0, "the consumer never got anything");
    // Shutting down moves every publisher's counters into the total, unchanged.
    within(handle.shutdown()).await;
    let after = sub.stats().total;
    assert_eq!(
        (after.received, after.delivered, after.dropped()),
        (s.total.received, s.total.delivered, s.total.dropped()),
        "{after:?}"
    );
}

#[tokio::test]
async fn metadata_address_is_refused_and_counted_never_dialled() {
    let memory = MemoryDiscovery::new();
    let d: Arc<dyn Discovery> = Arc::new(memory);
    let _g = d
        .register(id(1), Transport::zmq("tcp://169.254.169.254:5555"))
        .await
        .unwrap();
    let _g6 = d
        .register(id(2), Transport::zmq("tcp://[::ffff:169.254.169.254]:5555"))
        .await
        .unwrap();
    let sub = subscriber(d.clone());
    let h = sub.handle();
    eventually("refusals counted", || {
        let s = h.stats();
        s.publishers.len() == 2 && s.publishers.iter().all(|(_, p)| p.refused_by_filter >= 1)
    })
    .await;
    let s = sub.stats();
    assert_eq!(
        s.total.connect_failures, 0,
        "a dial was attempted: {:?}",
        s.total
    );
}

#[tokio::test]
async fn dropping_the_subscriber_closes_every_connection() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut pubs = Vec::new();
    let mut guards = Vec::new();
    for n in 0..3 {
        let p = RawPub::bind(0, id(n)).await;
        guards.push(p.register(&*d).await);
        pubs.push(p);
    }
    let sub = subscriber(d.clone());
    for p in &pubs {
        within(p.socket.wait_for_subscribers(1)).await;
    }
    let handle = sub.handle();
    drop(sub);
    within(handle.shutdown()).await;
    eventually("publishers saw every connection close", || {
        pubs.iter().all(|p| p.socket.stats().connections == 0)
    })
    .await;
    // And the discovery watch was released.
    assert_eq!(d.stats().watchers, 0);
}

#[tokio::test]
async fn exact_topic_drops_prefix_collisions() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let p = RawPub::bind(0, id(1)).await;
    let _g = p.register(&*d).await;
    let mut sub = subscriber(d.clone());
    within(p.socket.wait_for_subscribers(1)).await;
    p.send("kv-extra", 0, b"collision");
    p.send("kv", 0, b"mine");
    let got = next(&mut sub).await;
    assert_eq!(got.message.get(0).unwrap(), b"kv");
    assert_eq!(got.message.get(3).unwrap(), b"mine");
    let s = sub.stats().total;
    assert_eq!(s.dropped_filtered_topic, 1, "{s:?}");
    // A malformed message for the layout is dropped and counted too.
    p.socket.send(Message::from_parts(["kv", "short"]));
    p.send("kv", 1, b"after");
    assert_eq!(next(&mut sub).await.sequence, Some(1));
    assert_eq!(sub.stats().total.dropped_malformed, 1);
}

#[tokio::test]
async fn a_departing_publishers_last_messages_are_all_delivered() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    // The consumer reads only after the publisher is gone: give the lane room for the
    // whole burst, so what this test measures is the connection, not the lane.
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicPublisherSeq)
        .lane_capacity(16_384)
        .spawn()
        .unwrap();
    let p = EventPublisher::builder(d.clone(), "ns", "worker", "kv")
        .build()
        .await
        .unwrap();
    within(p.wait_for_subscribers(1)).await;
    // Below the publisher's 10 000-message queue, so nothing is lost at the PUB.
    const N: u64 = 8_000;
    for i in 0..N {
        assert_eq!(p.publish(vec![(i % 251) as u8; 100]).dropped, 0);
    }
    // Drain, unregister, close — while the subscriber is still reading.
    p.shutdown().await;
    let mut got = 0;
    while got < N {
        let mut batch = Vec::new();
        let n = match tokio::time::timeout(
            std::time::Duration::from_secs(3),
            sub.recv_many(&mut batch, 1024),
        )
        .await
        {
            Ok(n) => n,
            Err(_) => panic!("stalled at {got}: {:?}", sub.stats()),
        };
        assert!(n > 0);
        got += n as u64;
    }
    let s = sub.stats();
    assert_eq!(s.total.delivered, N, "{:?}", s.total);
    assert_eq!(s.total.dropped(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_hold_read_buffers_within_the_shared_limit() {
    // 64 connections of 64 KiB read buffers would hold 4 MiB; the account's limit is
    // 1 MiB, so past it each connection gives its buffer back after every receive.
    const LIMIT: usize = 1 << 20;
    const PUBLISHERS: u64 = 64;
    const EACH: u64 = 50;
    let d = Arc::new(MemoryDiscovery::new());
    let mut pubs = Vec::new();
    let mut regs = Vec::new();
    for n in 0..PUBLISHERS {
        let p = RawPub::bind(0, id(n)).await;
        regs.push(p.register(d.as_ref()).await);
        pubs.push(p);
    }
    let zmtp = Config::builder().max_retained_bytes(LIMIT).build().unwrap();
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicPublisherSeq)
        .zmtp_config(zmtp)
        .spawn()
        .unwrap();
    for p in &pubs {
        within(p.socket.wait_for_subscribers(1)).await;
    }
    for seq in 0..EACH {
        for p in &pubs {
            p.send("kv", seq, &[7u8; 1000]);
        }
    }
    let mut got = 0;
    let mut batch = Vec::new();
    while got < PUBLISHERS * EACH {
        batch.clear();
        got += within(sub.recv_many(&mut batch, 1024)).await as u64;
    }
    drop(batch);
    let chunk = Config::default().read_chunk();
    eventually("read buffers back within the shared limit", || {
        sub.stats().read_buffer_bytes <= LIMIT + chunk
    })
    .await;
    let stats = sub.stats();
    assert_eq!(stats.total.dropped(), 0, "{:?}", stats.total);
    assert_eq!(stats.total.delivered, PUBLISHERS * EACH);
    assert!(
        stats.retained_bytes <= LIMIT + chunk,
        "{}",
        stats.retained_bytes
    );
    drop(regs);
}

/// received = delivered + dropped + depth, for live and departed publishers alike:
/// never fewer received than accounted for while messages move, equal once still.
fn assert_accounted(stats: &eventplane::subscriber::SubscriberStats, settled: bool) {
    let t = &stats.total;
    let accounted = t.delivered + t.dropped() + t.depth as u64;
    if settled {
        assert_eq!(t.received, accounted, "{t:?}");
    } else {
        assert!(t.received >= accounted, "{t:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn departed_publishers_stay_accounted_under_churn() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .lane_capacity(16_384)
        .spawn()
        .unwrap();
    const N: u64 = 1000;
    let mut got = 0u64;
    for round in 0..3u64 {
        let mut pubs = Vec::new();
        for _ in 0..2 {
            let p = EventPublisher::builder(d.clone(), "ns", "worker", "kv")
                .build()
                .await
                .unwrap();
            within(p.wait_for_subscribers(1)).await;
            pubs.push(p);
        }
        for i in 0..N {
            for p in &pubs {
                assert_eq!(p.publish(vec![(i % 251) as u8; 64]).dropped, 0);
            }
        }
        // Both leave discovery while their messages are still on the way.
        for p in pubs {
            p.shutdown().await;
        }
        while got < (round + 1) * 2 * N {
            let mut batch = Vec::new();
            got += within(sub.recv_many(&mut batch, 97)).await as u64;
            assert_accounted(&sub.stats(), false);
        }
    }
    let h = sub.handle();
    eventually("every departed publisher settled", || {
        h.stats().publishers.is_empty()
    })
    .await;
    let stats = sub.stats();
    assert_accounted(&stats, true);
    assert_eq!(stats.total.delivered, 6 * N, "{:?}", stats.total);
    assert_eq!(stats.total.received, 6 * N);
}

#[tokio::test]
async fn the_default_layout_counts_our_publishers_gaps() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    // Nothing but the topic: the defaults must read what `EventPublisher` sends.
    let mut sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .spawn()
        .unwrap();
    let p = RawPub::bind(0, id(3)).await;
    let _reg = p.register(d.as_ref()).await;
    within(p.socket.wait_for_subscribers(1)).await;
    for seq in [0, 1, 5] {
        p.send("kv", seq, b"x");
    }
    for expected in [0, 1, 5] {
        assert_eq!(next(&mut sub).await.sequence, Some(expected));
    }
    let t = sub.stats().total;
    assert_eq!(
        (t.gaps, t.gap_messages, t.dropped_malformed),
        (1, 3, 0),
        "{t:?}"
    );
}

#[tokio::test]
async fn a_publisher_on_another_topic_is_counted_not_followed() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv-events")
        .spawn()
        .unwrap();
    // A typo on the publisher's side: `kv_events`.
    let typo = EventPublisher::builder(d.clone(), "ns", "worker", "kv_events")
        .build()
        .await
        .unwrap();
    let right = EventPublisher::builder(d.clone(), "ns", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    within(right.wait_for_subscribers(1)).await;
    let h = sub.handle();
    eventually("the typo counted", || h.stats().other_topic_publishers == 1).await;
    let stats = h.stats();
    assert_eq!(
        stats.publishers.len(),
        1,
        "only the right topic is followed"
    );
    assert_eq!(typo.stats().connections, 0, "the typo is never dialled");
    typo.shutdown().await;
    eventually("the typo's departure uncounted", || {
        h.stats().other_topic_publishers == 0
    })
    .await;
    right.shutdown().await;
}

/// A subscriber with notices on, following one raw publisher (`id(n)`, topic `kv`)
/// that has its subscription.
async fn followed_with_notices(n: u64) -> (DynamicSubscriber, RawPub, Registration) {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let sub = DynamicSubscriber::builder(d.clone(), Query::new("ns"))
        .topic("kv")
        .notices(64)
        .spawn()
        .unwrap();
    let p = RawPub::bind(0, id(n)).await;
    let reg = p.register(d.as_ref()).await;
    within(p.socket.wait_for_subscribers(1)).await;
    (sub, p, reg)
}

#[tokio::test]
async fn notices_tell_a_router_when_a_publisher_connects_loses_messages_and_departs() {
    use eventplane::subscriber::Notice;
    let (mut sub, p, reg) = followed_with_notices(4).await;
    for seq in [0, 1, 5] {
        p.send("kv", seq, b"x");
    }
    for _ in 0..3 {
        next(&mut sub).await;
    }
    let mut notices = Vec::new();
    sub.take_notices(&mut notices);
    assert!(
        matches!(&notices[..], [Notice::Connected(i), Notice::Gap { id: g, missing: 3 }]
            if i.id == id(4) && *g == id(4)),
        "{notices:?}"
    );
    // It leaves discovery: a departure once its messages were all handed over.
    p.send("kv", 6, b"last");
    drop(reg);
    assert_eq!(next(&mut sub).await.sequence, Some(6));
    let h = sub.handle();
    let mut departed = Vec::new();
    eventually("the departure noticed", || {
        let _ = h.stats(); // settles departed publishers
        sub.take_notices(&mut departed);
        departed.contains(&Notice::Departed(id(4)))
    })
    .await;
    assert_eq!(sub.stats().notices_dropped, 0);
}

#[tokio::test]
async fn one_message_at_a_time_hears_of_a_departure_after_the_last_message_with_its_final_counters()
{
    use eventplane::subscriber::Notice;
    let (mut sub, p, reg) = followed_with_notices(5).await;
    for seq in 0..10 {
        p.send("kv", seq, b"x");
    }
    assert_eq!(next(&mut sub).await.sequence, Some(0));
    drop(reg);
    // The connection ends (after the drain grace) with 9 messages not yet taken.
    let h = sub.handle();
    eventually("the publisher retired", || h.stats().publishers.is_empty()).await;
    let mut notices = Vec::new();
    sub.take_notices(&mut notices);
    assert!(
        !notices
            .iter()
            .any(|n| matches!(n, Notice::Departed(_) | Notice::Retired { .. })),
        "told before its last 9 messages were taken: {notices:?}"
    );
    for seq in 1..10 {
        assert_eq!(next(&mut sub).await.sequence, Some(seq));
    }
    eventually("the departure noticed", || {
        let _ = h.stats();
        sub.take_notices(&mut notices);
        notices.contains(&Notice::Departed(id(5)))
    })
    .await;
    let retired = notices
        .iter()
        .position(|n| matches!(n, Notice::Retired { .. }));
    let departed = notices.iter().position(|n| *n == Notice::Departed(id(5)));
    assert!(retired < departed, "{notices:?}");
    let Some(Notice::Retired { id: rid, stats }) = retired.map(|i| &notices[i]) else {
        panic!("no Retired: {notices:?}");
    };
    assert_eq!(*rid, id(5));
    assert_eq!((stats.received, stats.delivered, stats.depth), (10, 10, 0));
    assert_eq!(
        (stats.first_sequence, stats.last_sequence),
        (Some(0), Some(9))
    );
}

#[tokio::test]
async fn a_departure_wakes_a_router_that_receives_nothing() {
    use eventplane::subscriber::Notice;
    let (mut sub, _publisher, reg) = followed_with_notices(9).await;
    // Nothing is ever sent: only the notices can wake the router.
    drop(reg);
    let (mut batch, mut notices) = (Vec::new(), Vec::new());
    let lifecycle = sub.handle();
    within(async {
        loop {
            tokio::select! {
                n = sub.recv_many(&mut batch, 16) => panic!("{n} deliveries from a silent publisher"),
                () = lifecycle.notice_ready() => {}
            }
            sub.take_notices(&mut notices);
            if notices.contains(&Notice::Departed(id(9))) {
                break;
            }
        }
    })
    .await;
    assert!(
        matches!(&notices[0], Notice::Connected(i) if i.id == id(9)),
        "{notices:?}"
    );
}

/// `synced` (a readiness probe's signal) is set by the first complete view only: a
/// watch whose events are held back leaves it unset, and it stays set across a
/// re-watch.
#[tokio::test]
async fn synced_waits_for_the_first_complete_view() {
    let (d, faults) = FaultDiscovery::new(Arc::new(MemoryDiscovery::new()));
    faults.delay_events(Some(Duration::from_millis(500)));
    let d: Arc<dyn Discovery> = Arc::new(d);
    let sub = subscriber(d.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!sub.stats().synced, "synced before any view arrived");
    eventually("the initial sync", || sub.stats().synced).await;
    faults.delay_events(None);
    faults.fail_watches("injected");
    eventually("a re-watch", || sub.stats().rewatches >= 1).await;
    assert!(sub.stats().synced);
}

/// What a publisher's lane holds when its connection is re-made is still delivered:
/// a reconnect is not a loss (audit H1 b: a lane emptied on reconnect, its contents
/// counted as lane drops, passed every test and the soak).
#[tokio::test]
async fn a_reconnect_keeps_what_the_lane_holds() {
    let memory = MemoryDiscovery::new();
    let d: Arc<dyn Discovery> = Arc::new(memory.clone());
    let mut sub = subscriber(d.clone());
    let h = sub.handle();
    let a = RawPub::bind(0, id(9)).await;
    let _reg = a.register(&*d).await;
    within(a.socket.wait_for_subscribers(1)).await;
    // Five messages wait in the lane: nothing reads them yet.
    for seq in 0..5u64 {
        a.send("kv", seq, &[seq as u8]);
    }
    let stats = |h: &eventplane::subscriber::SubscriberHandle| {
        h.stats()
            .publishers
            .into_iter()
            .find(|(i, _)| *i == id(9))
            .map(|(_, s)| s)
            .unwrap_or_default()
    };
    eventually("five messages in the lane", || stats(&h).depth == 5).await;
    // The publisher restarts on the same port: the subscriber dials again.
    let port = a.socket.local_addr().unwrap().port();
    a.socket.close(Duration::ZERO).await;
    let b = RawPub::bind(port, id(9)).await;
    within(b.socket.wait_for_subscribers(1)).await;
    eventually("the reconnect counted", || stats(&h).reconnects >= 1).await;
    b.send("kv", 5, &[5]);
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(next(&mut sub).await.sequence.unwrap());
    }
    assert_eq!(got, [0, 1, 2, 3, 4, 5], "every message, in order");
    let s = stats(&h);
    assert_eq!(
        (s.delivered, s.dropped_lane_full, s.gap_messages),
        (6, 0, 0),
        "{s:?}"
    );
}
