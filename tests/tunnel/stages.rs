//! Every per-stage deadline of a broker, over real TLS + HTTP/2 and real sockets
//! (DESIGN §7.2): DNS, the connection (across resolved addresses, each attempt
//! capped), the data stream's slot, the router's response head; the idle timeout both
//! ways; and the discovery view the broker dials from.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::{
    FixedResolver, Mark, NeverResolves, Script, ScriptedBus, TOKEN, broker_config, bus, bus_with,
    connected, fixture, publisher, unaccepting_listener, until,
};
use crate::support::{assert_fired_at, refusing_port, timed, within};
use eventplane::discovery::{
    ChannelId, Discovery, FaultDiscovery, MemoryDiscovery, Registration, Transport,
};
use eventplane::tunnel::protocol::SessionEvent;
use eventplane::tunnel::{
    Broker, BrokerConfig, Deadlines, EventBusConfig, Limits, RefuseCode, Secret, TunnelError,
    client_tls,
};

fn refused(result: Result<eventplane::tunnel::TunnelStream, TunnelError>) -> RefuseCode {
    match result {
        Err(TunnelError::Refused(code)) => code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn advertise(view: &MemoryDiscovery, n: u64, endpoint: &str) -> Registration {
    view.register(
        ChannelId::new("prod", "worker", "kv", n).unwrap(),
        Transport::zmq(endpoint),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_resolver_that_never_answers_is_dns_timeout() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let _reg = advertise(&view, 1, "tcp://slow-dns.test:5557").await;
    let mut config =
        broker_config(&bus, "broker-1", view.clone()).resolver(Arc::new(NeverResolves));
    // Well under the 5 s default: a broker that ignored it would answer late.
    let dns = Duration::from_millis(300);
    config = config.deadlines(Deadlines::default().dns(dns));
    let broker = Broker::spawn(config).unwrap();
    connected(&bus).await;
    let (r, elapsed) = timed(bus.open_stream("prod", 1, "tcp://slow-dns.test:5557")).await;
    assert_eq!(refused(r), RefuseCode::DnsTimeout);
    assert_fired_at("deadlines.dns", elapsed, dns);
    assert_eq!(broker.stats().refused.get("dns_timeout"), Some(&1));
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn a_listener_that_never_accepts_is_connect_timeout_and_other_addresses_are_tried() {
    let bus = bus().await;
    let view = Arc::new(MemoryDiscovery::new());
    let (_listener, _filler, hanging) = unaccepting_listener();
    let (_held, closed) = refusing_port();
    let target = "tcp://publisher.test:5557";
    let _reg = advertise(&view, 1, target).await;
    let at = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));

    // A broker whose resolver answers `ports`, with these connect deadlines.
    let resolving = |ports: Vec<u16>, attempt_ms: u64, total_ms: u64| {
        let config = broker_config(&bus, "broker-1", view.clone())
            .resolver(Arc::new(FixedResolver(ports.into_iter().map(at).collect())))
            .deadlines(
                Deadlines::default()
                    .connect_attempt(Duration::from_millis(attempt_ms))
                    .connect(Duration::from_millis(total_ms)),
            );
        Broker::spawn(config).unwrap()
    };

    // Only a listener that never accepts: the attempt runs out, the stage refuses.
    let broker = resolving(vec![closed, hanging], 300, 5_000);
    connected(&bus).await;
    let (r, elapsed) = timed(bus.open_stream("prod", 1, target)).await;
    assert_eq!(refused(r), RefuseCode::ConnectTimeout);
    assert_fired_at(
        "deadlines.connect_attempt",
        elapsed,
        Duration::from_millis(300),
    );
    assert_eq!(broker.stats().refused.get("connect_timeout"), Some(&1));
    broker.shutdown().await;
    until(|| bus.stats().sessions == 0).await;

    // The total deadline holds even when each attempt's cap is longer.
    let broker = resolving(vec![hanging, hanging], 20_000, 300);
    connected(&bus).await;
    let (r, elapsed) = timed(bus.open_stream("prod", 1, target)).await;
    assert_eq!(refused(r), RefuseCode::ConnectTimeout);
    assert_fired_at("deadlines.connect", elapsed, Duration::from_millis(300));
    broker.shutdown().await;
    until(|| bus.stats().sessions == 0).await;

    // A refused and a hanging address before a live one: the broker gets there.
    let (publisher, _endpoint, _reg2) = publisher(&view, 2).await;
    let live = publisher.local_addr().unwrap().port();
    let broker = resolving(vec![closed, hanging, live], 300, 10_000);
    connected(&bus).await;
    let (stream, elapsed) = timed(bus.open_stream("prod", 1, target)).await;
    assert!(stream.is_ok(), "{stream:?}");
    // It gave the hanging address its whole attempt, no more.
    assert_fired_at(
        "deadlines.connect_attempt, then the next address",
        elapsed,
        Duration::from_millis(300),
    );
    until(|| broker.stats().streams_opened == 1).await;
    drop(stream);
    broker.shutdown().await;
    bus.shutdown().await;
}

/// A broker toward a scripted bus, with `target` advertised.
async fn broker_toward(
    script: Script,
    limits: Limits,
    tweak: impl FnOnce(BrokerConfig) -> BrokerConfig,
) -> (ScriptedBus, Broker, (tokio::net::TcpListener, Registration)) {
    let target_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = format!("tcp://{}", target_listener.local_addr().unwrap());
    let view = Arc::new(MemoryDiscovery::new());
    let registration = advertise(&view, 1, &target).await;
    let bus = ScriptedBus::start(script, limits, &target).await;
    let config = BrokerConfig::new(
        bus.url.clone(),
        "broker-1",
        vec!["prod".to_owned()],
        Secret::new(TOKEN).unwrap(),
        client_tls(fixture("ca.pem")).unwrap(),
        view,
    )
    .addr_filter(crate::common::loopback());
    let config = tweak(config);
    (
        bus,
        Broker::spawn(config).unwrap(),
        (target_listener, registration),
    )
}

/// A broker toward a bus scripted as `script` is refused with `code` for stream 1,
/// `deadline` after the subscribe, counted, and opens nothing.
async fn refused_by_script(
    script: Script,
    code: RefuseCode,
    deadline: Duration,
    tweak: impl FnOnce(BrokerConfig) -> BrokerConfig,
) {
    let (mut bus, broker, _target) = broker_toward(script, Limits::default(), tweak).await;
    let event = within(bus.events.recv()).await.unwrap();
    let elapsed = bus.marks.first(Mark::Subscribed).elapsed();
    assert_eq!(event, SessionEvent::Refused { stream_id: 1, code });
    assert_fired_at(code.as_str(), elapsed, deadline);
    assert_eq!(broker.stats().refused.get(code.as_str()), Some(&1));
    assert_eq!(broker.stats().streams_opened, 0);
    broker.shutdown().await;
}

#[tokio::test]
async fn a_data_stream_without_a_slot_is_stream_slot_timeout() {
    let slot = Duration::from_millis(300);
    refused_by_script(
        Script::NoStreamSlot,
        RefuseCode::StreamSlotTimeout,
        slot,
        |c| c.deadlines(Deadlines::default().stream_slot(slot)),
    )
    .await;
}

#[tokio::test]
async fn a_router_that_never_answers_the_head_is_response_timeout() {
    let response = Duration::from_millis(300);
    refused_by_script(
        Script::HoldResponseHead,
        RefuseCode::ResponseTimeout,
        response,
        |c| c.deadlines(Deadlines::default().response(response)),
    )
    .await;
}

#[tokio::test]
async fn a_broker_leaves_a_silent_bus_after_the_idle_timeout_and_reconnects() {
    let idle = Duration::from_millis(400);
    let limits = Limits::default().with_heartbeat(Duration::from_millis(100), idle);
    let (bus, broker, _target) = broker_toward(Script::FallSilent, limits, |c| {
        c.reconnect_min(Duration::from_millis(20))
            .reconnect_max(Duration::from_millis(100))
    })
    .await;
    // The scripted bus never closes a session: a second one means the broker ended the
    // first itself, for silence: the idle timeout after the welcome (the last frame it
    // heard), then at most 100 ms of backoff.
    until(|| bus.sessions.load(Ordering::Relaxed) >= 2).await;
    until(|| broker.stats().connected).await;
    let (welcomed, again) = (
        bus.marks.first(Mark::Welcomed),
        bus.marks.all(Mark::Session)[1],
    );
    assert_fired_at("the broker's idle timeout", again - welcomed, idle);
    until(|| broker.stats().sessions >= 2).await;
    broker.shutdown().await;
}

#[tokio::test]
async fn a_broker_dials_only_once_its_initial_list_is_complete_and_keeps_its_snapshot() {
    let bus = bus().await;
    let memory = Arc::new(MemoryDiscovery::new());
    let (discovery, faults) = FaultDiscovery::new(memory.clone());
    let (_publisher, endpoint, _reg) = publisher(&memory, 1).await;
    // The first watches fail: the view retries, and the bus hears nothing meanwhile.
    faults.fail_next_watch_calls(2);
    let broker = Broker::spawn(broker_config(&bus, "broker-1", Arc::new(discovery))).unwrap();
    let mut waited = 0;
    within(async {
        while !broker.stats().discovery_ready {
            assert_eq!(bus.stats().sessions_started, 0, "dialled before the list");
            waited += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        waited > 0,
        "the view was ready before its watches could succeed"
    );
    connected(&bus).await;
    assert_eq!(broker.stats().advertised_endpoints, 1);
    assert!(within(bus.open_stream("prod", 1, &endpoint)).await.is_ok());

    // Discovery goes away: the last snapshot still answers.
    faults.fail_next_watch_calls(1_000);
    faults.fail_watches("etcd is down");
    let (_late, late_endpoint, _late_reg) = publisher(&memory, 2).await;
    assert!(within(bus.open_stream("prod", 1, &endpoint)).await.is_ok());
    // Not yet seen: a registration made while the watch is down.
    let r = within(bus.open_stream("prod", 2, &late_endpoint)).await;
    assert_eq!(refused(r), RefuseCode::TargetNotAdvertised);
    // Back: the next complete list replaces the snapshot.
    faults.fail_next_watch_calls(0);
    until(|| broker.stats().advertised_endpoints == 2).await;
    assert!(
        within(bus.open_stream("prod", 2, &late_endpoint))
            .await
            .is_ok()
    );

    // An unregistered publisher is no longer dialled.
    drop(_reg);
    until(|| broker.stats().advertised_endpoints == 1).await;
    let r = within(bus.open_stream("prod", 1, &endpoint)).await;
    assert_eq!(refused(r), RefuseCode::TargetNotAdvertised);
    broker.shutdown().await;
    bus.shutdown().await;
}

/// Reads `stream` until it ends (EOF or an error), within the support deadline.
async fn read_to_end(stream: &mut (impl tokio::io::AsyncRead + Unpin)) {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    within(async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
}

/// Whether `stream` is still open after `wait` of reading (what arrives, such as the
/// bus's HTTP/2 settings, is read and dropped; nothing ends it).
async fn still_open(stream: &mut (impl tokio::io::AsyncRead + Unpin), wait: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let ended = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(wait, ended).await.is_err()
}

#[tokio::test]
async fn a_connection_that_never_starts_a_session_is_closed_at_its_deadline() {
    let start = Duration::from_millis(600);
    let mut config = EventBusConfig::default();
    config = config.session_start_timeout(start);
    let bus = bus_with(config).await;
    // TLS completes, then nothing: the bus hangs up after session_start_timeout
    // instead of holding one of its connection slots forever. The clock starts before
    // the handshake (the bus's starts at its end): the lower bound holds by
    // construction, the handshake's time counts against the slack.
    let since_tls = std::time::Instant::now();
    let mut tls = tls_to(&bus).await;
    assert!(
        still_open(&mut tls, start / 2).await,
        "closed before its deadline"
    );
    read_to_end(&mut tls).await;
    assert_fired_at("session_start_timeout", since_tls.elapsed(), start);
    assert_eq!(bus.stats().sessions_started, 0);

    // A broker whose session is welcomed in time keeps its connection past it.
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view)).unwrap();
    connected(&bus).await;
    tokio::time::sleep(start * 2).await;
    assert_eq!(bus.brokers_for("prod"), ["broker-1"]);
    assert_eq!(
        (bus.stats().sessions_started, broker.stats().sessions),
        (1, 1)
    );
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn a_connection_that_never_completes_tls_is_closed_at_its_deadline() {
    let handshake = Duration::from_millis(600);
    let mut config = EventBusConfig::default();
    config = config.tls_handshake_timeout(handshake);
    let bus = bus_with(config).await;
    // TCP, then not one byte of TLS (the clock starts before the connect).
    let since = std::time::Instant::now();
    let mut tcp = tokio::net::TcpStream::connect(bus.local_addr())
        .await
        .unwrap();
    assert!(
        still_open(&mut tcp, handshake / 2).await,
        "closed before its deadline"
    );
    read_to_end(&mut tcp).await;
    assert_fired_at("tls_handshake_timeout", since.elapsed(), handshake);
    // A broker's handshake within it is not cut, nor its connection after it.
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view)).unwrap();
    connected(&bus).await;
    tokio::time::sleep(handshake * 2).await;
    assert_eq!(
        (bus.stats().sessions_started, broker.stats().sessions),
        (1, 1)
    );
    assert!(broker.stats().connected);
    broker.shutdown().await;
    bus.shutdown().await;
}

#[tokio::test]
async fn a_connection_carries_one_session_at_a_time() {
    let bus = bus().await;
    let (mut sender, conn) = h2_to(&bus).await;
    tokio::spawn(conn);
    let post = || session_request(&bus, TOKEN);
    let first = within(sender.send_request(post())).await.unwrap();
    assert_eq!(first.status(), 200);
    // A second session on the same connection is refused: a broker reconnects on a
    // new connection, so one credential holder cannot stack sessions on one.
    let second = within(sender.send_request(post())).await.unwrap();
    assert_eq!(second.status(), 409);
    drop(first);
    bus.shutdown().await;
}

/// A wrong credential costs its connection: the first guess gets its 401, and the
/// connection is closed then (it used to carry a thousand streams of guesses).
#[tokio::test]
async fn a_wrong_credential_closes_its_connection() {
    let bus = bus().await;
    let (mut sender, conn) = h2_to(&bus).await;
    let ended = tokio::spawn(conn);
    let guess = |token: &str| session_request(&bus, token);
    let first = within(sender.send_request(guess("guess-0"))).await.unwrap();
    assert_eq!(first.status(), 401);
    // Closed by the bus 100 ms after its answer (well before the 3 s a connection
    // has to authenticate): the connection ends, and no second guess is answered.
    let refused = std::time::Instant::now();
    within(ended).await.unwrap().ok();
    assert!(
        refused.elapsed() < Duration::from_millis(1500),
        "closed {:?} after the 401",
        refused.elapsed()
    );
    assert!(within(sender.send_request(guess("guess-1"))).await.is_err());
    assert_eq!(bus.stats().unauthorized, 1);
    bus.shutdown().await;
}

/// Requests sent at once on a connection that has not authenticated: two have their
/// credential read, the rest are answered 429 unread and the connection closes (an
/// HTTP/2 connection may open 1,025 streams at once, each a guess).
#[tokio::test]
async fn a_connection_has_two_requests_before_it_authenticates() {
    let bus = bus().await;
    let (sender, conn) = h2_to(&bus).await;
    tokio::spawn(conn);
    let guesses = (0..10).map(|i| {
        let mut sender = sender.clone();
        let guess = session_request(&bus, &format!("guess-{i}-0123456789abcdef"));
        async move {
            sender
                .send_request(guess)
                .await
                .map(|r| r.status().as_u16())
        }
    });
    let answers = within(futures_util::future::join_all(guesses)).await;
    let read = answers.iter().filter(|a| matches!(a, Ok(401))).count();
    assert!(read <= 2, "{answers:?}");
    assert!(
        answers.iter().all(|a| matches!(a, Ok(401 | 429) | Err(_))),
        "{answers:?}"
    );
    assert!(answers.iter().any(|a| matches!(a, Ok(429))), "{answers:?}");
    bus.shutdown().await;
}

/// An HTTP/2 connection to `bus`: its sender, and the connection to drive.
async fn h2_to(
    bus: &eventplane::tunnel::EventBus,
) -> (
    hyper::client::conn::http2::SendRequest<crate::common::EmptyBody>,
    hyper::client::conn::http2::Connection<
        hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
        crate::common::EmptyBody,
        hyper_util::rt::TokioExecutor,
    >,
) {
    let tls = tls_to(bus).await;
    hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap()
}

/// A session request to `bus` with `token`.
fn session_request(
    bus: &eventplane::tunnel::EventBus,
    token: &str,
) -> hyper::Request<crate::common::EmptyBody> {
    hyper::Request::post(format!(
        "https://localhost:{}/bus/v1/session",
        bus.local_addr().port()
    ))
    .header("authorization", format!("Bearer {token}"))
    .body(crate::common::EmptyBody)
    .unwrap()
}

/// A TLS connection to `bus` (ALPN h2) that has said nothing yet.
async fn tls_to(
    bus: &eventplane::tunnel::EventBus,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(bus.local_addr())
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(client_tls(fixture("ca.pem")).unwrap())
        .connect(name, tcp)
        .await
        .unwrap()
}

#[tokio::test]
async fn unauthenticated_connections_get_a_pool_of_their_own() {
    let mut config = EventBusConfig::default();
    config = config.max_connections(2);
    config = config.max_pending_per_source(2);
    let bus = bus_with(config).await;
    // Two connections from one address that say nothing hold its share of the
    // pending pool...
    let mut first = tls_to(&bus).await;
    let _second = tls_to(&bus).await;
    // ...so a third from it takes the place of the one longest without progress,
    // closed at once, and counted.
    let _third = tokio::net::TcpStream::connect(bus.local_addr())
        .await
        .unwrap();
    let (_, elapsed) = timed(read_to_end(&mut first)).await;
    assert!(elapsed < Duration::from_secs(1), "closed after {elapsed:?}");
    until(|| bus.stats().pending_evicted == 1).await;
    assert_eq!(bus.stats().pending, 2);
    // They never take an authenticated slot: a broker gets in while they are held.
    let view: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let broker = Broker::spawn(broker_config(&bus, "broker-1", view)).unwrap();
    connected(&bus).await;
    broker.shutdown().await;
    bus.shutdown().await;
}
