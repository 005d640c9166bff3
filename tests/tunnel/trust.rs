//! The bus at the trust boundary (DESIGN §7.3), each attack through the real
//! `EventBus` and `Broker` over TLS on loopback: per-broker credentials, the
//! unauthenticated pool, unusable targets, the broker's address filter, detached
//! streams and full owners.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use crate::common::{broker_config, bus, bus_configured, connected, fixture, publisher, until};
use crate::support::{self, timed, within};
use eventplane::discovery::{Discovery, MemoryDiscovery};
use eventplane::tunnel::protocol::rendezvous_owner;
use eventplane::tunnel::{
    Broker, BrokerConfig, BusClients, Deadlines, EventBus, EventBusConfig, Limits, RefuseCode,
    Secret, TokenDigest, TunnelError, client_tls,
};

const TOKEN_A: &str = "token-of-broker-a-0123";
const TOKEN_B: &str = "token-of-broker-b-4567";

/// broker-a and broker-b, each with its own token, both granted "prod"; broker-b
/// also "dev".
fn two_brokers() -> BusClients {
    let digest = |t: &str| TokenDigest::of(&Secret::new(t).unwrap());
    BusClients::new()
        .broker("broker-a", digest(TOKEN_A), vec!["prod".into()])
        .unwrap()
        .broker(
            "broker-b",
            digest(TOKEN_B),
            vec!["prod".into(), "dev".into()],
        )
        .unwrap()
}

fn as_broker(bus: &EventBus, id: &str, token: &str, view: Arc<dyn Discovery>) -> BrokerConfig {
    let mut config = broker_config(bus, id, view);
    config = config.token(Secret::new(token).unwrap());
    config
}

#[tokio::test]
async fn an_impostor_with_a_token_of_its_own_cannot_take_another_brokers_id() {
    let bus = bus_configured("127.0.0.1:0", two_brokers(), EventBusConfig::default()).await;
    let view_memory = Arc::new(MemoryDiscovery::new());
    let view: Arc<dyn Discovery> = view_memory.clone();
    let (_publisher, endpoint, _reg) = publisher(&view_memory, 1).await;
    let real = Broker::spawn(as_broker(&bus, "broker-a", TOKEN_A, view.clone())).unwrap();
    connected(&bus).await;
    // broker-b's valid token, claiming broker-a's id, retrying fast.
    let mut impostor = as_broker(&bus, "broker-a", TOKEN_B, view.clone());
    impostor = impostor.reconnect_min(Duration::from_millis(20));
    impostor = impostor.reconnect_max(Duration::from_millis(40));
    let impostor = Broker::spawn(impostor).unwrap();
    until(|| bus.stats().denied.get("client_id_not_granted") >= Some(&3)).await;
    // Each attempt denied with its code on both sides; the real session never moved.
    let seen = impostor.stats();
    assert!(seen.denied["client_id_not_granted"] >= 1, "{seen:?}");
    assert_eq!(seen.sessions, 0, "{seen:?}");
    let stats = bus.stats();
    assert_eq!((stats.superseded, stats.sessions), (0, 1), "{stats:?}");
    assert_eq!(bus.brokers_for("prod"), ["broker-a"]);
    let stream = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(stream.is_ok(), "{stream:?}");
    until(|| real.stats().streams_opened == 1).await;
    let real_stats = real.stats();
    assert_eq!(
        (
            real_stats.sessions,
            real_stats.session_failures,
            real_stats.streams_opened
        ),
        (1, 0, 1),
        "{real_stats:?}"
    );
    impostor.abort();
    real.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn a_namespace_outside_the_grant_is_denied_and_never_tunnelled() {
    let bus = bus_configured("127.0.0.1:0", two_brokers(), EventBusConfig::default()).await;
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    // broker-a is granted "prod" only; it claims "dev" too.
    let mut greedy = as_broker(&bus, "broker-a", TOKEN_A, view.clone());
    greedy = greedy.namespaces(vec!["prod".into(), "dev".into()]);
    let greedy = Broker::spawn(greedy).unwrap();
    until(|| greedy.stats().denied.get("namespace_not_granted") == Some(&1)).await;
    let stats = bus.stats();
    assert_eq!(stats.denied["namespace_not_granted"], 1, "{stats:?}");
    assert_eq!(stats.sessions, 0, "{stats:?}");
    greedy.abort();
    // The router tunnels what some credential grants, and dials the rest.
    assert!(bus.grants("prod") && bus.grants("dev"));
    assert!(!bus.grants("staging"));
    // A shared token is granted what it is given, and no more.
    let shared = BusClients::shared(&Secret::new(TOKEN_A).unwrap(), vec!["prod".into()]).unwrap();
    assert!(shared.grants("prod") && !shared.grants("dev"));
    bus.shutdown().await;
}

#[tokio::test]
async fn a_broker_refuses_loopback_and_its_nat64_form_by_default() {
    let bus = bus().await;
    let view_memory = Arc::new(MemoryDiscovery::new());
    let view: Arc<dyn Discovery> = view_memory.clone();
    let (_publisher, endpoint, _reg) = publisher(&view_memory, 1).await;
    // BrokerConfig::new's own filter: nothing reopened.
    let config = crate::common::strict_broker_config(&bus, "broker-1", view.clone());
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    let r = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::AddressFiltered))),
        "{r:?}"
    );
    broker.abort();
    // A name that resolves to loopback's NAT64 form is refused the same way.
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let nat64: std::net::SocketAddr = format!("[64:ff9b::7f00:1]:{port}").parse().unwrap();
    let config = crate::common::strict_broker_config(&bus, "broker-2", view.clone())
        .resolver(Arc::new(crate::common::FixedResolver(vec![nat64])));
    let broker = Broker::spawn(config).unwrap();
    until(|| bus.brokers_for("prod") == ["broker-2"]).await;
    let r = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::AddressFiltered))),
        "{r:?}"
    );
    assert_eq!(broker.stats().refused["address_filtered"], 1);
    broker.abort();
    bus.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unusable_record_fails_its_stream_never_the_session() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;
    // Three publishers the router follows through the broker...
    let mut publishers = Vec::new();
    for _ in 0..3 {
        publishers.push(
            eventplane::publish::EventPublisher::builder(view.clone(), "prod", "worker", "kv")
                .build()
                .await
                .unwrap(),
        );
    }
    let mut router = eventplane::subscriber::DynamicSubscriber::builder(
        view.clone() as Arc<dyn Discovery>,
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
    // ...and one record whose endpoint is 1.1 KiB.
    let long = format!("tcp://{}.example:5557", "h".repeat(1100));
    let _poison = view
        .register(
            eventplane::discovery::ChannelId::new("prod", "worker", "kv", 999).unwrap(),
            eventplane::discovery::Transport::zmq(long.clone()),
        )
        .await
        .unwrap();
    until(|| bus.stats().bad_targets >= 2).await;
    // The others keep streaming through the one session they had.
    for round in 0..3u8 {
        for p in &publishers {
            p.publish(vec![round]);
        }
        let mut got = 0;
        within(async {
            while got < publishers.len() {
                router.recv().await.unwrap();
                got += 1;
            }
        })
        .await;
    }
    let stats = bus.stats();
    assert_eq!(stats.sessions_started, 1, "{stats:?}");
    assert_eq!(broker.stats().session_failures, 0);
    // Refused before it reached the broker, by its own code.
    let r = bus.open_stream("prod", 999, &long).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::BadTarget))),
        "{r:?}"
    );
    drop(router);
    broker.abort();
    bus.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_hundred_streams_dropped_at_once_leave_no_slot_behind() {
    // A listener that takes and holds every connection: each stream is one.
    let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", target.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = target.accept().await {
            held.push(tcp);
        }
    });
    let view = Arc::new(MemoryDiscovery::new());
    let _reg = view
        .register(
            eventplane::discovery::ChannelId::new("prod", "worker", "kv", 1).unwrap(),
            eventplane::discovery::Transport::zmq(endpoint.clone()),
        )
        .await
        .unwrap();
    let bus = bus().await;
    let mut config = broker_config(&bus, "broker-1", view.clone());
    // This test is about slots, not the open rate.
    config = config.opens_per_second(1_000_000);
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    // `n` streams opened at once, every one of them.
    let open = async |n: usize| {
        let opens = (0..n).map(|_| bus.open_stream("prod", 1, &endpoint));
        let all = within(futures_util::future::join_all(opens)).await;
        let failed: Vec<_> = all.iter().filter_map(|r| r.as_ref().err()).collect();
        assert!(
            failed.is_empty(),
            "{} failed: {:?}",
            failed.len(),
            failed.first()
        );
        all
    };
    let first = open(600).await;
    assert_eq!(bus.stats().streams_open, 600);
    // Dropped at once: every stream detaches, on both sides.
    drop(first);
    until(|| bus.stats().streams_open == 0 && broker.stats().streams_open == 0).await;
    // The default limit (1,024) takes 1,000 more.
    let second = open(1000).await;
    assert_eq!(bus.stats().streams_open, 1000);
    drop(second);
    until(|| broker.stats().streams_open == 0).await;
    broker.abort();
    bus.shutdown().await;
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_owner_is_passed_over_for_the_runner_up() {
    let limits = Limits::default().with_max_streams(2);
    let bus = bus_configured(
        "127.0.0.1:0",
        crate::common::shared_clients(),
        EventBusConfig::default().limits(limits),
    )
    .await;
    let view = Arc::new(MemoryDiscovery::new());
    // Three publishers broker-a owns.
    let owned: Vec<u64> = (1..)
        .filter(|id| rendezvous_owner(["broker-a", "broker-b"], *id) == Some("broker-a"))
        .take(3)
        .collect();
    let mut endpoints = Vec::new();
    let mut keep = Vec::new();
    for id in &owned {
        let (p, endpoint, reg) = publisher(&view, *id).await;
        endpoints.push(endpoint);
        keep.push((p, reg));
    }
    let view: Arc<dyn Discovery> = view;
    let a = Broker::spawn(broker_config(&bus, "broker-a", view.clone())).unwrap();
    let b = Broker::spawn(broker_config(&bus, "broker-b", view.clone())).unwrap();
    until(|| bus.brokers_for("prod").len() == 2).await;
    let mut streams = Vec::new();
    for (id, endpoint) in owned.iter().zip(&endpoints).take(2) {
        streams.push(
            within(bus.open_stream("prod", *id, endpoint))
                .await
                .unwrap(),
        );
    }
    until(|| a.stats().streams_opened == 2).await;
    // broker-a is full: it is not offered, and its third publisher goes through b.
    until(|| bus.brokers_for("prod") == ["broker-b"]).await;
    let third = within(bus.open_stream("prod", owned[2], &endpoints[2])).await;
    assert!(third.is_ok(), "{third:?}");
    until(|| b.stats().streams_opened == 1).await;
    assert_eq!(bus.stats().fallbacks, 1);
    drop((streams, third));
    a.abort();
    b.abort();
    bus.shutdown().await;
}

/// A connection from `source` to `bus` that is held until the bus closes it, then
/// opened again (after 100 ms), until `stop`.
/// How a flood connection behaves once connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flood {
    /// Says nothing.
    Silent,
    /// Completes TLS, then says nothing (issue 49 M5: past TLS, such connections
    /// outranked a broker still in its handshake).
    Tls,
}

async fn flood_one(
    bus: std::net::SocketAddr,
    source: std::net::Ipv4Addr,
    how: Flood,
    breath: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    use tokio::io::AsyncReadExt;
    let tls = tokio_rustls::TlsConnector::from(client_tls(fixture("ca.pem")).unwrap());
    while !stop.is_cancelled() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind((source, 0).into()).unwrap();
        let Ok(mut tcp) = socket.connect(bus).await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let mut buf = [0u8; 64];
        tokio::select! {
            () = stop.cancelled() => return,
            _ = async {
                if how == Flood::Silent {
                    let _ = tcp.read(&mut buf).await;
                    return;
                }
                let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                if let Ok(mut idle) = tls.connect(name, tcp).await {
                    let _ = idle.read(&mut buf).await;
                }
            } => {}
        }
        // Re-opened after a breath: the test's 2 cores are the bus's too.
        tokio::time::sleep(breath).await;
    }
}

/// `n` flood connections behaving as `how`, the i-th from `source(i)`, each re-opened
/// `breath` after the bus closed it.
type Flooding = (usize, fn(usize) -> std::net::Ipv4Addr, Flood, Duration);

/// 1,100 silent connections, the i-th from `source(i)`, re-opened 100 ms after the bus
/// closes them.
fn silent(source: fn(usize) -> std::net::Ipv4Addr) -> Flooding {
    (1100, source, Flood::Silent, Duration::from_millis(100))
}

/// A broker restarted into a flood of unauthenticated connections, once the bus
/// evicted `warm` of them: its first attempt gets its session (within the bus's TLS
/// handshake deadline).
async fn restart_into_a_flood(flood: Flooding, warm: u64) {
    let bus = bus().await;
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view.clone())).unwrap();
    connected(&bus).await;
    let stop = tokio_util::sync::CancellationToken::new();
    // On a runtime of its own, as another host would be.
    let (addr, flood_stop) = (bus.local_addr(), stop.clone());
    let flood = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut tasks = Vec::new();
            let (n, source, how, breath) = flood;
            for i in 0..n {
                let task = flood_one(addr, source(i), how, breath, flood_stop.clone());
                tasks.push(tokio::spawn(task));
            }
            for task in tasks {
                let _ = task.await;
            }
        });
    });
    until(|| bus.stats().pending_evicted >= warm).await;
    // The broker restarts into the flood: its first attempt gets its session (a
    // second would come a backoff period, 1 s, later).
    broker.abort();
    until(|| bus.stats().sessions == 0).await;
    let mut config = broker_config(&bus, "broker-1", view.clone());
    config = config.reconnect_min(Duration::from_secs(1));
    config = config.reconnect_max(Duration::from_secs(2));
    let (restarted, took) = timed(async {
        let broker = Broker::spawn(config).unwrap();
        connected(&bus).await;
        broker
    })
    .await;
    let stats = bus.stats();
    stop.cancel();
    tokio::task::spawn_blocking(move || flood.join().unwrap())
        .await
        .unwrap();
    // Its first attempt got in (a second comes a backoff period later, and counts a
    // failure), before the bus's TLS handshake deadline would have ended it: on 2
    // loaded cores the flood's handshakes delay the broker's (past 2 s in a CI run),
    // they do not keep it out.
    assert_eq!(
        restarted.stats().session_failures,
        0,
        "took {took:?}: {stats:?}"
    );
    assert!(
        // EventBusConfig's default TLS handshake deadline: 3 s.
        took < Duration::from_secs(3) + support::DEADLINE_SLACK,
        "the broker took {took:?} to get its session back: {stats:?}"
    );
    assert!(stats.pending <= 64, "{stats:?}");
    assert!(stats.pending_evicted >= warm, "{stats:?}");
    assert_eq!(stats.connections_refused, 0, "{stats:?}");
    restarted.abort();
    bus.shutdown().await;
}

/// 1,100 idle connections from 138 loopback addresses (8 each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unauthenticated_connections_cannot_keep_a_broker_out() {
    let source =
        |i: usize| std::net::Ipv4Addr::new(127, 1, (i / 8 / 250) as u8, (i / 8 % 250) as u8 + 1);
    restart_into_a_flood(silent(source), 1000).await;
}

/// 128 connections that complete TLS and idle, each from a loopback address of its
/// own (one each, as the broker: no busiest source to evict first), each re-opened
/// 50 ms after the bus closes it, about one a millisecond (issue 49 M5's flood; see
/// `admission::past_tls_without_a_request_goes_first` for the order it relies on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_that_completes_tls_and_idles_cannot_keep_a_broker_out() {
    let source = |i: usize| std::net::Ipv4Addr::new(127, 2, 0, i as u8 + 1);
    let flood = (
        128,
        source as fn(usize) -> _,
        Flood::Tls,
        Duration::from_millis(50),
    );
    restart_into_a_flood(flood, 1000).await;
}

/// 1,100 idle connections from the broker's own address (a cluster's shared NAT
/// egress): its share of the pool no longer shuts the broker out (issue 49 M5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_the_broker_s_own_address_cannot_keep_it_out() {
    restart_into_a_flood(silent(|_| std::net::Ipv4Addr::LOCALHOST), 1000).await;
}

#[tokio::test]
async fn dns_lookups_and_opens_are_capped_per_broker() {
    use crate::common::HeldLookups;
    let limits = Limits::default().with_max_streams(4);
    let bus = bus_configured(
        "127.0.0.1:0",
        crate::common::shared_clients(),
        EventBusConfig::default().limits(limits),
    )
    .await;
    let view = Arc::new(MemoryDiscovery::new());
    let (_publisher, endpoint, _reg) = publisher(&view, 1).await;
    // A resolver that never answers, two lookups at most: the third waits for a slot
    // (counted) and all run into the 200 ms DNS deadline.
    let lookups = HeldLookups::default();
    let mut config = broker_config(&bus, "broker-1", view.clone() as Arc<dyn Discovery>)
        .resolver(Arc::new(lookups.clone()));
    config = config.max_dns_lookups(2);
    config = config.deadlines(Deadlines::default().dns(Duration::from_millis(200)));
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    let opens = (0..3).map(|_| bus.open_stream("prod", 1, &endpoint));
    for r in within(futures_util::future::join_all(opens)).await {
        assert!(
            matches!(r, Err(TunnelError::Refused(RefuseCode::DnsTimeout))),
            "{r:?}"
        );
    }
    let stats = broker.stats();
    assert_eq!(stats.dns_saturated, 1, "{stats:?}");
    assert_eq!((lookups.asked(), lookups.peak()), (2, 2));
    // Past their streams' deadlines the two lookups still hold their slots (a system
    // lookup cannot be cancelled): a fourth open waits too, and asks for none.
    let r = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::DnsTimeout))),
        "{r:?}"
    );
    assert_eq!(broker.stats().dns_saturated, 2);
    assert_eq!((lookups.asked(), lookups.peak()), (2, 2));
    broker.abort();
    until(|| bus.stats().sessions == 0).await;

    // One open a second after a burst of the session's limit (4).
    let mut config = broker_config(&bus, "broker-2", view.clone() as Arc<dyn Discovery>);
    config = config.opens_per_second(1);
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    for _ in 0..4 {
        let stream = within(bus.open_stream("prod", 1, &endpoint)).await;
        assert!(stream.is_ok(), "{stream:?}");
    }
    let r = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::RateLimited))),
        "{r:?}"
    );
    assert_eq!(broker.stats().refused["rate_limited"], 1);
    broker.abort();
    bus.shutdown().await;
}

#[tokio::test]
async fn one_credential_holds_a_few_connections_not_every_slot() {
    // A shared token may claim any client id: five brokers with it, four get in.
    let bus = bus().await;
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let mut brokers = Vec::new();
    for i in 0..4 {
        brokers.push(Broker::spawn(broker_config(&bus, &format!("b{i}"), view.clone())).unwrap());
        until(|| bus.stats().sessions == i + 1).await;
    }
    let fifth = Broker::spawn(broker_config(&bus, "b4", view.clone())).unwrap();
    until(|| bus.stats().connections_refused >= 1).await;
    until(|| fifth.stats().session_failures >= 1).await;
    assert_eq!(bus.stats().sessions, 4);
    // One leaves: its slot is the credential's again.
    brokers.pop().unwrap().abort();
    until(|| bus.stats().sessions == 4 && bus.brokers_for("prod").contains(&"b4".to_owned())).await;
    fifth.abort();
    for b in brokers {
        b.abort();
    }
    bus.shutdown().await;
}

/// One router, each namespace the way its grant says: "staging" (granted to no
/// broker) dialled directly, "prod" through its broker; with `tunnel_direct_fallback`
/// a granted namespace no broker covers is dialled directly, without it it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_tunnels_granted_namespaces_and_dials_the_rest() {
    use eventplane::discovery::Query;
    use eventplane::publish::EventPublisher;
    use eventplane::subscriber::DynamicSubscriber;

    let bus = bus_configured("127.0.0.1:0", two_brokers(), EventBusConfig::default()).await;
    let view = Arc::new(MemoryDiscovery::new());
    let publisher = |namespace: &'static str| {
        let view = view.clone();
        async move {
            EventPublisher::builder(view, namespace, "worker", "kv")
                .build()
                .await
                .unwrap()
        }
    };
    let router = |namespace: &str, fallback: bool| {
        DynamicSubscriber::builder(view.clone(), Query::new(namespace))
            .topic("kv")
            .tunnel(bus.clone())
            .tunnel_direct_fallback(fallback)
            // Retries while no broker covers "prod" stay short.
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(250))
            .spawn()
            .unwrap()
    };
    // `router` receives what `p` publishes once `p` has its `subscribers`.
    async fn reaches(p: &EventPublisher, subscribers: usize, router: &mut DynamicSubscriber) {
        p.wait_for_subscribers_within(subscribers, support::DEADLINE)
            .await
            .unwrap();
        p.publish(&b"hello"[..]);
        let got = within(router.recv()).await.unwrap();
        assert_eq!(got.source.id.publisher_id(), p.publisher_id());
    }

    // No broker yet: a granted namespace waits, unless the fallback is on.
    let early = publisher("prod").await;
    let mut waiting = router("prod", false);
    let mut fallback = router("prod", true);
    reaches(&early, 1, &mut fallback).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), waiting.recv())
            .await
            .is_err(),
        "a granted namespace waits for a broker"
    );
    assert_eq!(
        early.stats().subscribed,
        1,
        "only the fallback router reached it"
    );
    assert_eq!(bus.stats().streams_opened, 0);

    let broker = Broker::spawn(as_broker(&bus, "broker-a", TOKEN_A, view.clone())).unwrap();
    connected(&bus).await;
    // The waiting router reaches it now, through the broker.
    until(|| early.stats().subscribed == 2).await;
    assert_eq!(bus.stats().streams_opened, 1);
    // Staging, granted to no broker, is dialled directly by a router with the bus.
    let staged = publisher("staging").await;
    let mut staging = router("staging", false);
    reaches(&staged, 1, &mut staging).await;
    assert_eq!(bus.stats().streams_opened, 1, "staging was not tunnelled");
    assert_eq!(broker.stats().streams_opened, 1);
    // A new prod publisher goes through the broker even with the fallback on.
    let late = publisher("prod").await;
    // (Both prod routers follow it.)
    reaches(&late, 2, &mut fallback).await;
    until(|| broker.stats().streams_opened == 3 && bus.stats().streams_opened == 3).await;
    drop(waiting);
    broker.abort();
    bus.shutdown().await;
}
