//! The tunnel over real sockets: an in-process TLS + HTTP/2 event bus (test
//! certificates from `tests/fixtures/tunnel/`), an in-process broker, and local TCP
//! publishers. ZMTP runs end to end through it; every refusal is named.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    TOKEN, broker_config, bus, bus_at, bus_with, connected, fixture, message, publisher, until,
};
use crate::support::{self, assert_fired_at, within};
use bytes::Bytes;
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Transport};
use eventplane::tunnel::{
    Broker, BrokerConfig, DrainReason, EventBusConfig, RefuseCode, Secret, TunnelError, client_tls,
};
use eventplane::zmtp::{Config, Message, SubSocket};

#[tokio::test]
async fn zmtp_runs_end_to_end_and_receives_what_a_direct_connection_receives() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (publisher, endpoint, _reg) = publisher(&view, 7).await;
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;

    let stream = within(bus.open_stream("prod", 7, &endpoint)).await.unwrap();
    let mut tunnelled = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    tunnelled.subscribe("kv").await.unwrap();
    let mut direct = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    direct.subscribe("kv").await.unwrap();
    within(publisher.wait_for_subscribers(2)).await;

    for i in 0..500 {
        publisher.send(message(i));
    }
    for i in 0..500 {
        let through = within(tunnelled.recv()).await.unwrap();
        let straight = within(direct.recv()).await.unwrap();
        assert_eq!(through, message(i));
        assert_eq!(straight, through);
    }
    let stats = broker.stats();
    assert_eq!((stats.sessions, stats.streams_opened), (1, 1));
    // The router lets go: the broker closes the publisher connection, silently (an
    // unsubscribe is no `stream_closed`).
    drop(tunnelled);
    until(|| publisher.stats().connections == 1).await;
    assert!(broker.stats().closed.is_empty(), "{:?}", broker.stats());
    assert!(stats.bytes_up > 500 * 20, "{stats:?}");
    assert!(
        stats.bytes_down > 0,
        "the SUB's greeting and subscription went down"
    );
    assert_eq!(bus.stats().streams_opened, 1);
    // Both ends count the same bytes: all the broker read went to the router's socket,
    // all the router wrote went to the publisher.
    let seen = bus.stats();
    assert_eq!(
        (seen.bytes_in, seen.bytes_out),
        (stats.bytes_up, stats.bytes_down)
    );
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn each_refusal_is_named() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let register = |n, endpoint: &str| {
        let view = view.clone();
        let endpoint = endpoint.to_owned();
        async move {
            view.register(
                ChannelId::new("prod", "worker", "kv", n).unwrap(),
                Transport::zmq(endpoint),
            )
            .await
            .unwrap()
        }
    };
    // Advertised, but a cloud metadata address; advertised, but no such host.
    let _metadata = register(1, "tcp://169.254.169.254:80").await;
    let _nowhere = register(2, "tcp://no-such-host.invalid:5557").await;
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;

    let refused = |result: Result<_, TunnelError>| match result {
        Err(TunnelError::Refused(code)) => code,
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Not in the broker's discovery view.
    let r = within(bus.open_stream("prod", 9, "tcp://127.0.0.1:9")).await;
    assert_eq!(refused(r), RefuseCode::TargetNotAdvertised);
    let r = within(bus.open_stream("prod", 1, "tcp://169.254.169.254:80")).await;
    assert_eq!(refused(r), RefuseCode::AddressFiltered);
    let r = within(bus.open_stream("prod", 2, "tcp://no-such-host.invalid:5557")).await;
    assert_eq!(refused(r), RefuseCode::DnsFailed);
    // No broker covers another namespace.
    assert!(matches!(
        bus.open_stream("staging", 1, "tcp://127.0.0.1:9").await,
        Err(TunnelError::NoBroker(ns)) if ns == "staging"
    ));
    let stats = broker.stats();
    let seen = bus.stats();
    for code in ["target_not_advertised", "address_filtered", "dns_failed"] {
        assert_eq!(stats.refused.get(code), Some(&1), "{code}: {stats:?}");
        assert_eq!(seen.refused.get(code), Some(&1), "{code}: {seen:?}");
    }
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn a_wrong_credential_or_ca_gets_no_session_and_plaintext_is_refused() {
    let bus = bus().await;
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut wrong = broker_config(&bus, "intruder", view.clone());
    wrong = wrong.token(Secret::new("not-the-token-0123456789").unwrap());
    let intruder = Broker::spawn(wrong).unwrap();
    within(async {
        while bus.stats().unauthorized == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(bus.stats().sessions, 0);
    within(async {
        while intruder.stats().session_failures == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    intruder.abort();

    // A bus whose certificate does not chain to the broker's CA: TLS fails.
    let mut other_ca = broker_config(&bus, "b", view.clone());
    other_ca = other_ca.tls(client_tls(fixture("other-ca.pem")).unwrap());
    let lost = Broker::spawn(other_ca).unwrap();
    within(async {
        while lost.stats().session_failures == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(bus.stats().sessions_started, 0);
    lost.abort();

    let mut plaintext = broker_config(&bus, "b", view);
    plaintext = plaintext.bus_url(format!("http://localhost:{}", bus.local_addr().port()));
    match Broker::spawn(plaintext) {
        Err(TunnelError::Config { field, .. }) => assert_eq!(field, "bus_url"),
        other => panic!("{other:?}"),
    }
    bus.shutdown().await;
}

#[tokio::test]
async fn a_new_session_with_the_same_client_id_supersedes_the_old() {
    let bus = bus().await;
    let view_memory = Arc::new(MemoryDiscovery::new());
    let view: Arc<dyn Discovery> = view_memory.clone();
    let (publisher, endpoint, _reg) = publisher(&view_memory, 1).await;
    // The first one reconnects late (30 s and more): it must not win its id back
    // before the test is done with it.
    let mut slow = broker_config(&bus, "broker-1", view.clone());
    slow = slow.reconnect_min(Duration::from_secs(30));
    slow = slow.reconnect_max(Duration::from_secs(60));
    let first = Broker::spawn(slow).unwrap();
    connected(&bus).await;
    let second = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    within(async {
        while bus.stats().superseded == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(bus.brokers_for("prod"), ["broker-1"]);
    // The newer session is the one that survived: the first broker saw its session
    // end (it is stopped before its reconnect could supersede in turn), the second
    // never lost its own, and the next stream goes through it.
    until(|| first.stats().session_failures >= 1).await;
    let old = first.stats();
    first.abort();
    let stream = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(stream.is_ok(), "{stream:?}");
    until(|| second.stats().streams_opened == 1).await;
    let new = second.stats();
    assert_eq!((old.sessions, old.streams_opened), (1, 0), "{old:?}");
    assert_eq!((new.sessions, new.session_failures), (1, 0), "{new:?}");
    assert_eq!(bus.stats().sessions, 1);
    drop((stream, publisher));
    second.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn a_router_that_never_reads_overflows_the_stream_not_the_broker() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (publisher, endpoint, _reg) = publisher(&view, 3).await;
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;
    let stream = within(bus.open_stream("prod", 3, &endpoint)).await.unwrap();
    let mut sub = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // 32 MiB toward a router that reads nothing: the broker keeps reading the
    // publisher, its 1 MiB stream budget fills, and the stream is reset.
    let big = Bytes::from(vec![7u8; 64 << 10]);
    for _ in 0..512 {
        publisher.send(Message::from_parts([
            Bytes::from_static(b"kv"),
            big.clone(),
        ]));
        tokio::task::yield_now().await;
    }
    until(|| broker.stats().closed.contains_key("buffer_overflow")).await;
    until(|| bus.stats().closed.get("buffer_overflow") == Some(&1)).await;
    // It filled the stream's own budget, never more (the session's 64 MiB cap is not
    // what stopped it). Real memory: `event_broker`'s test of the same.
    let stats = broker.stats();
    let budget = eventplane::tunnel::protocol::MAX_STREAM_BUFFER_BYTES as u64;
    assert!(
        (budget - (64 << 10)..=budget).contains(&stats.buffer_high_water),
        "not the stream budget: {stats:?}"
    );
    // The router's socket sees its stream end, and resubscribes (here: the error).
    let ended = within(async {
        loop {
            if sub.recv().await.is_err() {
                return true;
            }
        }
    })
    .await;
    assert!(ended);
    assert_eq!(
        publisher.stats().dropped,
        0,
        "the publisher never had to drop"
    );
    broker.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn a_closed_port_is_connect_failed() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (_held, port) = support::refusing_port();
    let target = format!("tcp://127.0.0.1:{port}");
    let _reg = view
        .register(
            ChannelId::new("prod", "w", "kv", 4).unwrap(),
            Transport::zmq(target.clone()),
        )
        .await
        .unwrap();
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;
    match within(bus.open_stream("prod", 4, &target)).await {
        Err(TunnelError::Refused(code)) => assert_eq!(code, RefuseCode::ConnectFailed),
        other => panic!("{other:?}"),
    }
    broker.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn a_broker_reconnects_with_backoff_and_after_a_rebalance() {
    // The bus is not up yet: the broker's first attempts fail and back off.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut config = BrokerConfig::new(
        format!("https://localhost:{port}"),
        "broker-1",
        vec!["prod".to_owned()],
        Secret::new(TOKEN).unwrap(),
        client_tls(fixture("ca.pem")).unwrap(),
        view,
    )
    .addr_filter(crate::common::loopback());
    // A 20 ms backoff: far from the 250-500 ms rebalance delay either way.
    config = config.reconnect_min(Duration::from_millis(20));
    config = config.reconnect_max(Duration::from_millis(20));
    let broker = Broker::spawn(config).unwrap();
    until(|| broker.stats().session_failures >= 1).await;
    let bus = bus_at(&format!("127.0.0.1:{port}")).await;
    connected(&bus).await;
    // The broker counts its session when it reads the welcome, after the bus sent it.
    until(|| broker.stats().sessions == 1).await;
    // The router moves this broker's share elsewhere: it drains (nothing is open, so
    // at once) and comes back after its 250-500 ms rebalance delay, not at once.
    let drained = std::time::Instant::now();
    assert!(bus.drain_broker(
        "broker-1",
        Duration::from_millis(100),
        DrainReason::Rebalance
    ));
    until(|| broker.stats().sessions == 2).await;
    let back = drained.elapsed();
    assert!(
        back >= Duration::from_millis(225)
            && back <= Duration::from_millis(500) + support::DEADLINE_SLACK,
        "back after {back:?}, not the rebalance delay"
    );
    connected(&bus).await;
    assert_eq!(broker.stats().rebalances_throttled, 0);
    // A second rebalance within a minute: the broker waits its normal backoff instead
    // (at most 20 ms here), not the rebalance delay, then comes back all the same.
    let drained = std::time::Instant::now();
    assert!(bus.drain_broker(
        "broker-1",
        Duration::from_millis(100),
        DrainReason::Rebalance
    ));
    until(|| broker.stats().sessions == 3).await;
    let back = drained.elapsed();
    assert!(
        back < Duration::from_millis(225),
        "back after {back:?}: the rebalance delay, not the backoff"
    );
    assert_eq!(broker.stats().rebalances_throttled, 1);
    connected(&bus).await;
    assert!(!bus.drain_broker("nobody", Duration::ZERO, DrainReason::Rebalance));
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn a_router_drain_lets_open_streams_finish_then_the_broker_returns() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (publisher, endpoint, _reg) = publisher(&view, 1).await;
    let mut config = broker_config(&bus, "broker-1", view.clone());
    config = config.reconnect_min(Duration::from_millis(100));
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    let stream = within(bus.open_stream("prod", 1, &endpoint)).await.unwrap();
    let mut sub = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;

    let deadline = Duration::from_millis(2000);
    let drained = std::time::Instant::now();
    assert!(bus.drain_broker("broker-1", deadline, DrainReason::Shutdown));
    // Draining: offered for no new stream...
    until(|| bus.brokers_for("prod").is_empty()).await;
    assert!(matches!(
        bus.open_stream("prod", 1, &endpoint).await,
        Err(TunnelError::NoBroker(_))
    ));
    // ...while the open one still flows, halfway to the deadline.
    tokio::time::sleep((deadline / 2).saturating_sub(drained.elapsed())).await;
    publisher.send(message(1));
    assert_eq!(within(sub.recv()).await.unwrap(), message(1));
    // Then it ends at the deadline, and the broker comes back for new streams.
    within(async { while sub.recv().await.is_ok() {} }).await;
    assert_fired_at("the drain deadline", drained.elapsed(), deadline);
    until(|| broker.stats().sessions == 2).await;
    connected(&bus).await;
    assert!(within(bus.open_stream("prod", 1, &endpoint)).await.is_ok());
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_split_the_publishers_and_one_takes_over_when_the_other_is_lost() {
    use eventplane::tunnel::protocol::rendezvous_owner;

    let bus = bus().await;
    // One discovery: the router's view and both brokers' (all inside the "cluster").
    let view = Arc::new(MemoryDiscovery::new());
    let a = Broker::spawn(broker_config(&bus, "broker-a", view.clone())).unwrap();
    let b = Broker::spawn(broker_config(&bus, "broker-b", view.clone())).unwrap();
    until(|| bus.brokers_for("prod").len() == 2).await;
    let (publishers, mut router) = followed_through(&bus, &view, &[&a, &b], 32).await;
    // Every publisher went through the broker rendezvous hashing picks for it.
    let owned_by_a = publishers
        .iter()
        .filter(|p| {
            rendezvous_owner(["broker-a", "broker-b"], p.publisher_id()) == Some("broker-a")
        })
        .count() as u64;
    assert!(
        (1..32).contains(&owned_by_a),
        "an even enough split: {owned_by_a}"
    );
    // A broker counts a stream once its open is done on its side, which may be after
    // the router already reads from it. (Its streams open now, not those it ever
    // opened: a stream opened again on a loaded machine counts twice there.)
    until(|| a.stats().streams_open + b.stats().streams_open == 32).await;
    assert_eq!(a.stats().streams_open, owned_by_a, "{:?}", b.stats());
    assert_eq!(b.stats().streams_open, 32 - owned_by_a, "{:?}", a.stats());
    for p in &publishers {
        p.publish(&b"before"[..]);
    }
    assert_eq!(receive(&mut router, 32).await.len(), 32);

    // Broker A is lost: its streams end, and each of its publishers reconnects through
    // broker B within one reconnect cycle.
    a.abort();
    // Published while A's publishers have no subscriber: those messages are lost on
    // the way, and the router must count each as a sequence gap.
    for p in &publishers {
        p.publish(&b"during"[..]);
    }
    until(|| b.stats().streams_open == 32).await;
    until(|| publishers.iter().all(|p| p.stats().subscribed > 0)).await;
    for p in &publishers {
        p.publish(&b"after"[..]);
    }
    let (mut during, mut after) = (0u64, 0u64);
    within(async {
        while after < 32 {
            match router.recv().await.unwrap().payload().as_deref() {
                Some(b"during") => during += 1,
                Some(b"after") => after += 1,
                other => panic!("{other:?}"),
            }
        }
    })
    .await;
    let stats = router.stats();
    eprintln!(
        "during the switch: {during} delivered, {} counted missing",
        stats.total.gap_messages
    );
    // Every "during" message arrived or was counted missing: nothing else was lost.
    assert_eq!(during + stats.total.gap_messages, 32, "{stats:?}");
    assert!(
        stats.total.gap_messages <= owned_by_a,
        "only A's publishers lost any"
    );
    assert_eq!(stats.total.reconnects, owned_by_a, "{stats:?}");
    assert_eq!(stats.total.dropped(), 0, "{stats:?}");
    b.abort();
    bus.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_broker_takes_over_its_share_and_nothing_else() {
    use eventplane::tunnel::protocol::rendezvous_owner;

    // Well under the 10 s default, so that a bus ignoring it moves too early or late.
    let hold = Duration::from_millis(1500);
    let mut config = EventBusConfig::default();
    config = config.join_hold_down(hold);
    let bus = bus_with(config).await;
    let view = Arc::new(MemoryDiscovery::new());
    let a = Broker::spawn(broker_config(&bus, "broker-a", view.clone())).unwrap();
    connected(&bus).await;
    let (publishers, mut router) = followed_through(&bus, &view, &[&a], 32).await;
    // (Open now: a broker counts an open once its relay reported it, and a stream
    // opened again on a loaded machine counts twice in `streams_opened`.)
    until(|| a.stats().streams_open == 32).await;

    // B joins: exactly the publishers rendezvous hashing now gives B move to it.
    let share_b = publishers
        .iter()
        .filter(|p| {
            rendezvous_owner(["broker-a", "broker-b"], p.publisher_id()) == Some("broker-b")
        })
        .count() as u64;
    assert!((1..32).contains(&share_b), "{share_b}");
    // The clock starts before B even connects: nothing may move before the hold-down
    // has passed since its welcome, B's connection counts against the slack.
    let joining = std::time::Instant::now();
    let b = Broker::spawn(broker_config(&bus, "broker-b", view.clone())).unwrap();
    until(|| bus.brokers_for("prod").len() == 2).await;
    assert_eq!(bus.stats().streams_moved, 0, "moved at the welcome");
    // Nothing moves during the hold-down; then B's share moves at once.
    until(|| bus.stats().streams_moved > 0).await;
    assert_fired_at("join_hold_down", joining.elapsed(), hold);
    until(|| b.stats().streams_open == share_b && bus.stats().streams_open == 32).await;
    assert_eq!(bus.stats().streams_moved, share_b);
    assert_eq!(
        a.stats().streams_open,
        32 - share_b,
        "A's own share stayed put"
    );
    // Every publisher has its one subscriber again; the moved ones a second
    // connection, the others still their first.
    until(|| {
        publishers.iter().all(|p| {
            let (stats, moved) = (
                p.stats(),
                rendezvous_owner(["broker-a", "broker-b"], p.publisher_id()) == Some("broker-b"),
            );
            stats.subscribed == 1
                && stats.connections == 1
                && stats.accepted == 1 + u64::from(moved)
        })
    })
    .await;
    for p in &publishers {
        p.publish(&b"after"[..]);
    }
    assert_eq!(receive(&mut router, 32).await.len(), 32);
    let stats = router.stats();
    assert_eq!(stats.total.reconnects, share_b, "{stats:?}");
    assert_eq!(stats.total.dropped(), 0, "{stats:?}");
    a.abort();
    b.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn a_publisher_its_owner_cannot_reach_is_tried_through_the_runner_up() {
    use eventplane::tunnel::protocol::rendezvous_owner;
    let bus = bus().await;
    // Broker A sees the publisher; broker B's view is empty (another zone, say).
    let view_a = Arc::new(MemoryDiscovery::new());
    let view_b: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let id = (1..)
        .find(|id| rendezvous_owner(["broker-a", "broker-b"], *id) == Some("broker-b"))
        .unwrap();
    let (_publisher, endpoint, _reg) = publisher(&view_a, id).await;
    let a = Broker::spawn(broker_config(&bus, "broker-a", view_a.clone())).unwrap();
    let b = Broker::spawn(broker_config(&bus, "broker-b", view_b)).unwrap();
    until(|| bus.brokers_for("prod").len() == 2).await;
    let stream = within(bus.open_stream("prod", id, &endpoint)).await;
    assert!(stream.is_ok(), "{stream:?}");
    assert_eq!(b.stats().refused.get("target_not_advertised"), Some(&1));
    until(|| a.stats().streams_opened == 1).await;
    assert_eq!(bus.stats().fallbacks, 1);
    // A target neither can reach: the runner-up's refusal is the answer.
    let r = within(bus.open_stream("prod", id, "tcp://127.0.0.1:9")).await;
    assert!(
        matches!(
            r,
            Err(TunnelError::Refused(RefuseCode::TargetNotAdvertised))
        ),
        "{r:?}"
    );
    assert_eq!(bus.stats().fallbacks, 2);
    drop(stream);
    a.abort();
    b.abort();
    bus.shutdown().await;
}

/// `n` publishers registered in `view`, and a router following them through `bus`,
/// once each has its subscriber. The router starts once every broker in `brokers`
/// advertises them all: a broker whose view lags refuses a subscribe
/// (`target_not_advertised`) and the runner-up carries it, which is right but not
/// the split a test expects.
async fn followed_through(
    bus: &eventplane::tunnel::EventBus,
    view: &Arc<MemoryDiscovery>,
    brokers: &[&Broker],
    n: usize,
) -> (
    Vec<eventplane::publish::EventPublisher>,
    eventplane::subscriber::DynamicSubscriber,
) {
    let mut publishers = Vec::new();
    for _ in 0..n {
        publishers.push(
            eventplane::publish::EventPublisher::builder(view.clone(), "prod", "worker", "kv")
                .build()
                .await
                .unwrap(),
        );
    }
    until(|| brokers.iter().all(|b| b.stats().advertised_endpoints >= n)).await;
    let router = eventplane::subscriber::DynamicSubscriber::builder(
        view.clone(),
        eventplane::discovery::Query::new("prod"),
    )
    .topic("kv")
    .tunnel(bus.clone())
    .spawn()
    .unwrap();
    for p in &publishers {
        p.wait_for_subscribers_within(1, support::DEADLINE)
            .await
            .unwrap();
    }
    (publishers, router)
}

async fn receive(
    router: &mut eventplane::subscriber::DynamicSubscriber,
    n: usize,
) -> Vec<eventplane::subscriber::Delivery> {
    let mut got = Vec::new();
    within(async {
        while got.len() < n {
            got.push(router.recv().await.unwrap());
        }
    })
    .await;
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_streams_than_hyper_allows_by_default_run_over_one_broker_connection() {
    // hyper's default of 200 concurrent HTTP/2 streams once stalled the 201st; the
    // bus allows what its welcome allows (max_streams), plus the session's own.
    const STREAMS: u64 = 256;
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;
    let mut publishers = Vec::new();
    for n in 0..STREAMS {
        publishers.push(publisher(&view, n).await);
    }
    until(|| broker.stats().advertised_endpoints >= STREAMS as usize).await;
    let mut subs = Vec::new();
    for (n, (_, endpoint, _)) in publishers.iter().enumerate() {
        let stream = within(bus.open_stream("prod", n as u64, endpoint))
            .await
            .unwrap();
        let mut sub = within(SubSocket::handshake(stream, Config::default()))
            .await
            .unwrap();
        sub.subscribe("kv").await.unwrap();
        subs.push(sub);
    }
    for (p, _, _) in &publishers {
        within(p.wait_for_subscribers(1)).await;
        p.send(message(3));
    }
    for sub in &mut subs {
        assert_eq!(within(sub.recv()).await.unwrap(), message(3));
    }
    // One session, one connection: every stream was a stream of it.
    let (seen, stats) = (bus.stats(), broker.stats());
    assert_eq!(
        (seen.sessions_started, seen.streams_open as u64),
        (1, STREAMS)
    );
    assert_eq!((stats.sessions, stats.streams_open), (1, STREAMS));
    drop(subs);
    broker.abort();
    bus.shutdown().await;
}

/// A worker's recovery answer through a broker is not cut when another broker joins
/// and takes over the worker's publisher: the publisher's stream moves, the recovery
/// stream runs to its end (cut, its answer would be lost and the worker wiped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_stream_stays_with_its_broker_when_another_joins() {
    use eventplane::discovery::Instance;
    use eventplane::kv::router::{IndexFeed, Recovered, RecoveryClientConfig, RecoveryDriver};
    use eventplane::subscriber::Notice;
    use eventplane::tunnel::protocol::rendezvous_owner;
    use eventplane::zmtp::DealerSocket;

    let mut config = EventBusConfig::default();
    config = config.join_hold_down(Duration::from_millis(300));
    let bus = bus_with(config).await;
    let view = Arc::new(MemoryDiscovery::new());
    let a = Broker::spawn(broker_config(&bus, "broker-a", view.clone())).unwrap();
    connected(&bus).await;
    // Publishers followed through A, some of which B will own: their moves show the
    // bus moved B's share.
    let (_publishers, _router) = followed_through(&bus, &view, &[&a], 16).await;
    // A worker whose recovery endpoint answers only when told, advertised in the view
    // with a publisher B will own.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let recovery_at = format!("tcp://{}", listener.local_addr().unwrap());
    let (asked_tx, asked) = tokio::sync::oneshot::channel::<()>();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut worker = DealerSocket::accept_as_router(stream, Config::default())
            .await
            .unwrap();
        let _dump = worker.recv().await.unwrap();
        let _ = asked_tx.send(());
        let _ = released.await;
        let end = Message::from_parts([
            Bytes::new(),
            Bytes::from_static(b"end"),
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            Bytes::from_static(&[1]),
        ]);
        let _ = worker.send(&end).await;
        // Held open until the router has read the answer.
        let _ = worker.recv().await;
    });
    let publisher_id = (1..)
        .find(|id| rendezvous_owner(["broker-a", "broker-b"], *id) == Some("broker-b"))
        .unwrap();
    let id = ChannelId::new("prod", "worker", "kv", publisher_id).unwrap();
    let worker = Instance::new(id.clone(), Transport::zmq("tcp://127.0.0.1:9"), 1)
        .with_recovery(recovery_at.as_str());
    let before = a.stats().advertised_endpoints;
    let _registered = view.register_instance(worker.clone()).await.unwrap();
    // A refuses a target its view has not taken in yet (and there is no runner-up).
    until(|| a.stats().advertised_endpoints >= before + 2).await;
    // The router's feed asks the worker for a dump when its publisher connects.
    let mut feed = IndexFeed::default();
    feed.notice(&Notice::Connected(Arc::new(worker)));
    let mut driver =
        RecoveryDriver::new(RecoveryClientConfig::default()).tunnel(bus.clone(), false);
    driver.submit(feed.take_recoveries());
    let answer = tokio::spawn(async move { driver.next().await });
    within(asked).await.unwrap();
    // B joins and its share moves.
    let b = Broker::spawn(broker_config(&bus, "broker-b", view.clone())).unwrap();
    until(|| bus.stats().streams_moved > 0).await;
    release.send(()).unwrap();
    let answer = within(answer).await.unwrap();
    assert!(
        matches!(&answer.answer, Ok(Recovered::Dump(d)) if d.complete && d.events.is_empty()),
        "{:?}",
        answer.answer
    );
    a.abort();
    b.abort();
    bus.shutdown().await;
}
