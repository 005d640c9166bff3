//! `event_broker` as a process (feature `tunnel`): its configuration is checked
//! before anything connects, it relays through a real TLS bus, its `[timeouts]` and
//! `[backoff]` keys set the deadlines it keeps (asserted in time), SIGTERM drains it
//! for `drain_deadline_ms`, and its memory stays within a stream's budget when the
//! router reads nothing. Also `kv_router --bus-listen`, the bus as a process.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use eventplane::wire::Dialect;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventplane::tunnel::{EventBus, EventBusConfig, Limits, Secret, server_tls};
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};

use std::process::Stdio;

use crate::support::{example, within};
use tokio::process::Command;

pub(crate) const TOKEN: &str = "event-broker-test-token";

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tunnel")
        .join(name)
}

/// A fresh directory with the token file and `broker.toml` holding `body`.
/// This file's token, shared, granted "prod".
pub(crate) fn clients() -> eventplane::tunnel::BusClients {
    eventplane::tunnel::BusClients::shared(&Secret::new(TOKEN).unwrap(), vec!["prod".to_owned()])
        .unwrap()
}

pub(crate) fn config(name: &str, body: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("eventplane-broker-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), format!("{TOKEN}\n")).unwrap();
    let path = dir.join("broker.toml");
    std::fs::write(&path, body).unwrap();
    path
}

pub(crate) fn body(bus_url: &str, token_dir: &Path, endpoints: &[&str], extra: &str) -> String {
    let endpoints: Vec<String> = endpoints.iter().map(|e| format!("{e:?}")).collect();
    // The publishers are on loopback, which a broker refuses unless it is listed.
    let cidrs = if extra.contains("allowed_cidrs") {
        ""
    } else {
        "allowed_cidrs = [\"127.0.0.0/8\"]\n"
    };
    format!(
        "bus_url = {bus_url:?}\nclient_id = \"broker-a\"\nca_file = {ca:?}\n\
         token_file = {token:?}\ndrain_deadline_ms = 300\n{cidrs}{extra}\n\
         [discovery]\nnamespaces = [\"prod\"]\nstatic_endpoints = [{}]\n",
        endpoints.join(", "),
        ca = fixture("ca.pem"),
        token = token_dir.join("token"),
    )
}

pub(crate) async fn run(config: &Path, extra: &[&str]) -> std::process::Output {
    within(
        Command::new(example("event-broker"))
            .arg("--config")
            .arg(config)
            .args(extra)
            .output(),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn configurations_are_checked_and_refused_by_name() {
    let dir = config("check", "").parent().unwrap().to_owned();
    let good = config(
        "check",
        &body("https://localhost:1", &dir, &["tcp://127.0.0.1:5"], ""),
    );
    let out = run(&good, &["--check-config"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("configuration ok"));
    // Every tuning knob, set.
    let tuned = config(
        "check",
        &body(
            "https://localhost:1",
            &dir,
            &["tcp://127.0.0.1:5"],
            "max_stream_buffer_bytes = 65536\nmax_session_buffer_bytes = 8388608\n\
             [timeouts]\ndns_ms = 1000\nconnect_ms = 2000\nconnect_attempt_ms = 500\n\
             stream_slot_ms = 1000\nresponse_ms = 2000\nbus_connect_ms = 3000\n\
             [backoff]\nmin_ms = 100\nmax_ms = 5000",
        ),
    );
    let out = run(&tuned, &["--check-config"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let cases = [
        (
            body("http://localhost:1", &dir, &["tcp://127.0.0.1:5"], ""),
            "is not https://",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "colour = \"blue\"",
            ),
            "unknown field",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "allowed_cidrs = [\"10.0.0.0/40\"]",
            ),
            "allowed_cidrs",
        ),
        (
            body("https://localhost:1", &dir, &[], ""),
            "exactly one of etcd, static_endpoints and kubernetes",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "max_stream_buffer_bytes = 1024",
            ),
            "max_stream_buffer_bytes",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "[timeouts]\ndns_ms = 0",
            ),
            "deadlines.dns",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "[backoff]\nmin_ms = 5000\nmax_ms = 10",
            ),
            "reconnect",
        ),
        (
            body(
                "https://localhost:1",
                &dir,
                &["tcp://127.0.0.1:5"],
                "[timeouts]\ndns_seconds = 5",
            ),
            "unknown field",
        ),
    ];
    for (text, says) in cases {
        let path = config("check", &text);
        let out = run(&path, &["--check-config"]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{says}: {stderr}");
        assert!(stderr.contains(says), "{says}: {stderr}");
        // The credential never shows.
        assert!(!stderr.contains(TOKEN), "{stderr}");
    } // The shipped broker.token's placeholder is no credential.
    let held = config("placeholder", "").parent().unwrap().to_owned();
    let path = config(
        "placeholder",
        &body("https://localhost:1", &held, &["tcp://127.0.0.1:5"], ""),
    );
    std::fs::write(held.join("token"), "replace-with-the-routers-token\n").unwrap();
    let out = run(&path, &["--check-config"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("placeholder"), "{stderr}");
    // A systemd credential (the Debian unit's LoadCredential=): read from
    // ${CREDENTIALS_DIRECTORY}, refused by name where that is not set.
    let credentials = config("credentials", "").parent().unwrap().to_owned();
    let path = config(
        "credentials",
        &body(
            "https://localhost:1",
            Path::new("${CREDENTIALS_DIRECTORY}"),
            &["tcp://127.0.0.1:5"],
            "",
        ),
    );
    let check = |dir: Option<&Path>| {
        let mut command = Command::new(example("event-broker"));
        command.arg("--config").arg(&path).arg("--check-config");
        match dir {
            Some(dir) => command.env("CREDENTIALS_DIRECTORY", dir),
            None => command.env_remove("CREDENTIALS_DIRECTORY"),
        };
        async move { within(command.output()).await.unwrap() }
    };
    let out = check(None).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("CREDENTIALS_DIRECTORY"), "{stderr}");
    let out = check(Some(&credentials)).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// A TLS bus, one publisher, and `event_broker` running with a config for them
/// (`drain_deadline_ms` as given) and joined to the bus.
async fn running(
    name: &str,
    drain_ms: u64,
) -> (EventBus, Arc<PubSocket>, String, tokio::process::Child) {
    running_with(name, drain_ms, Limits::default()).await
}

async fn running_with(
    name: &str,
    drain_ms: u64,
    limits: Limits,
) -> (EventBus, Arc<PubSocket>, String, tokio::process::Child) {
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    let bus = EventBus::bind(
        "127.0.0.1:0",
        tls,
        clients(),
        EventBusConfig::default().limits(limits),
    )
    .await
    .unwrap();
    let publisher = Arc::new(
        PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap(),
    );
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let dir = config(name, "").parent().unwrap().to_owned();
    let text = body(
        &format!("https://localhost:{}", bus.local_addr().port()),
        &dir,
        &[&endpoint],
        "",
    )
    .replace(
        "drain_deadline_ms = 300",
        &format!("drain_deadline_ms = {drain_ms}"),
    );
    let path = config(name, &text);
    let broker = Command::new(example("event-broker"))
        .arg("--config")
        .arg(&path)
        .env(
            crate::support::FIXED_MMAP_THRESHOLD.0,
            crate::support::FIXED_MMAP_THRESHOLD.1,
        )
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    within(async {
        while bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    (bus, publisher, endpoint, broker)
}

#[tokio::test]
async fn it_relays_through_the_bus_and_drains_on_sigterm() {
    let (bus, publisher, endpoint, broker) = running("relay", 300).await;
    let _sub = subscribed(&bus, &publisher, &endpoint).await;

    // SIGTERM: `draining` (the bus stops offering it), the open stream gets its
    // 300 ms, then stats and exit 0.
    let pid = broker.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = within(broker.wait_with_output()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("bus session welcomed"), "{stderr}");
    assert!(stderr.contains("draining before exit"), "{stderr}");
    assert!(!stderr.contains(TOKEN), "{stderr}");
    let stats = stats_json(&out.stderr);
    assert_eq!(stats["streams_opened"], 1, "{stats}");
    assert!(stats["bytes_up"].as_u64().unwrap() > 0, "{stats}");
    bus.shutdown().await;
}

/// A `SubSocket` through the broker to `publisher`, subscribed to "t" and checked
/// with one message.
async fn subscribed(
    bus: &EventBus,
    publisher: &PubSocket,
    endpoint: &str,
) -> SubSocket<eventplane::tunnel::TunnelStream> {
    let stream = within(bus.open_stream("prod", 0, endpoint)).await.unwrap();
    let mut sub = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let message = Message::from_parts([Bytes::from_static(b"t"), Bytes::from_static(b"x")]);
    publisher.send(message.clone());
    assert_eq!(within(sub.recv()).await.unwrap(), message);
    sub
}

fn signal(child: &tokio::process::Child, signal: &str) {
    let pid = child.id().unwrap().to_string();
    let status = std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal}");
}

#[tokio::test]
async fn a_frozen_broker_is_ended_for_silence_and_its_streams_with_it() {
    let limits =
        Limits::default().with_heartbeat(Duration::from_millis(200), Duration::from_millis(1000));
    let (bus, publisher, endpoint, broker) = running_with("frozen", 300, limits).await;
    let mut sub = subscribed(&bus, &publisher, &endpoint).await;

    // The broker process freezes with its connection open: the bus hears no
    // heartbeat, ends the session after its idle timeout, and the stream through
    // it ends too (nothing on the broker's side could end it now).
    let idle = Duration::from_millis(1000);
    let frozen = std::time::Instant::now();
    signal(&broker, "-STOP");
    within(async { while sub.recv().await.is_ok() {} }).await;
    // The bus last heard the broker at most one heartbeat (200 ms) before the freeze.
    let ended = frozen.elapsed();
    assert!(
        ended >= idle - Duration::from_millis(200) - idle / 10
            && ended <= idle + crate::support::DEADLINE_SLACK,
        "the bus's idle timeout (1 s, heartbeats every 200 ms) fired after {ended:?}"
    );
    assert_eq!(bus.stats().sessions, 0);
    assert!(bus.brokers_for("prod").is_empty());

    // Thawed, it finds its session gone and comes back.
    signal(&broker, "-CONT");
    within(async {
        while bus.stats().sessions_started < 2 || bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    signal(&broker, "-TERM");
    let out = within(broker.wait_with_output()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("bus session ended"), "{stderr}");
    bus.shutdown().await;
}

#[tokio::test]
async fn a_second_signal_stops_it_at_once() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    // A long drain: only the second signal can end it soon.
    let (bus, _publisher, endpoint, mut broker) = running("twice", 600_000).await;
    let _stream = within(bus.open_stream("prod", 0, &endpoint)).await.unwrap();
    let pid = broker.id().unwrap().to_string();
    let term = || {
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
    };
    assert!(term().success());
    let mut lines = BufReader::new(broker.stderr.take().unwrap()).lines();
    within(async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("draining before exit") {
                return;
            }
        }
        panic!("no draining line");
    })
    .await;
    assert!(term().success());
    let status = within(broker.wait()).await.unwrap();
    assert_eq!(status.code(), Some(1));
    bus.shutdown().await;
}

#[tokio::test]
async fn kv_router_runs_an_event_bus_that_carries_events_through_a_broker() {
    use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Transport};
    use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId};
    use tokio::io::{AsyncBufReadExt, BufReader};
    let dir = config("router", "").parent().unwrap().to_owned();
    let publisher = eventplane::publish::EventPublisher::unregistered("kv")
        .bind("tcp://127.0.0.1:0")
        .build()
        .await
        .unwrap();
    let port = publisher
        .local_endpoint()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    // A name only the broker resolves ("inside the cluster"): the router cannot dial
    // it directly, so what it indexes came through the broker.
    let inside = format!("tcp://publisher.inside.invalid:{port}");
    let follow = ["--static", &inside, "--namespace", "prod", "--topic", "kv"];
    let mut router = router_with_bus(&dir)
        .args(follow)
        .args(["--count", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(router.stderr.take().unwrap()).lines();
    let addr = bus_address(&mut lines).await;
    let bus_port = addr.rsplit(':').next().unwrap();
    // A broker joins with the router's token and the test CA; its view advertises the
    // publisher, its resolver knows the name.
    let view = Arc::new(MemoryDiscovery::new());
    let _reg = view
        .register(
            ChannelId::new("prod", "worker", "kv", 1).unwrap(),
            Transport::zmq(inside.clone()),
        )
        .await
        .unwrap();
    let local: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let broker = eventplane::tunnel::Broker::spawn(
        eventplane::tunnel::BrokerConfig::new(
            format!("https://localhost:{bus_port}"),
            "broker-a",
            vec!["prod".to_owned()],
            Secret::new(TOKEN).unwrap(),
            eventplane::tunnel::client_tls(fixture("ca.pem")).unwrap(),
            view.clone() as Arc<dyn Discovery>,
        )
        .addr_filter(crate::common::loopback())
        .resolver(Arc::new(crate::common::FixedResolver(vec![local]))),
    )
    .unwrap();
    publisher
        .wait_for_subscribers_within(1, crate::support::DEADLINE)
        .await
        .unwrap();
    for (id, worker) in [(1, 7), (2, 8)] {
        let event = RouterEvent {
            worker_id: WorkerId(worker),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: 0,
                data: KvEventData::Cleared,
            },
        };
        publisher.publish(Dialect::EventPlane.encode_router_events(&[event]).unwrap());
    }
    // --count 2: it prints both and exits 0.
    let mut stdout = String::new();
    tokio::io::AsyncReadExt::read_to_string(router.stdout.as_mut().unwrap(), &mut stdout)
        .await
        .unwrap();
    let status = within(router.wait()).await.unwrap();
    let printed: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(status.code(), Some(0), "{stdout}");
    let workers: Vec<_> = printed.iter().map(|e| e["worker_id"].clone()).collect();
    assert_eq!(workers, [7, 8], "{stdout}");
    let stats = broker.stats();
    assert_eq!(stats.streams_opened, 1, "{stats:?}");
    assert!(stats.bytes_up > 0, "{stats:?}");
    assert_eq!(publisher.stats().accepted, 1, "only the broker connected");
    broker.abort();

    // A key that is not there: refused as an argument (2), naming the bus.
    // `kv_router` with a bus on `listen` whose key is `key`: its output.
    let with_bus = async |listen: &str, key: PathBuf| {
        within(
            Command::new(example("kv-router"))
                .args(["--allow-cidr", "127.0.0.0/8"])
                .args(follow)
                .args(["--bus-listen", listen])
                .arg("--bus-key")
                .arg(key)
                .arg("--bus-cert")
                .arg(fixture("bus.pem"))
                .arg("--bus-token-file")
                .arg(dir.join("token"))
                .output(),
        )
        .await
        .unwrap()
    };
    let out = with_bus("127.0.0.1:0", PathBuf::from("/nonexistent.key")).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("event bus"), "{stderr}");

    // A bus port already taken: exit 3, naming --bus-listen and the cause, not
    // discovery (which was reached).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let out = with_bus(&taken_addr, fixture("bus.key")).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on --bus-listen {taken_addr}"))
            && stderr.contains("in use")
            && !stderr.contains("discovery"),
        "{stderr}"
    );
    drop(taken);
}

/// The last stderr line, parsed as the JSON stats object the examples print on exit.
fn stats_json(stderr: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(stderr);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: last stderr line {last:?}"))
}

/// `event_broker` with `config`, its stderr lines handed over as they come, each
/// with the instant it arrived (for deadline assertions on what it logs).
struct Logged {
    child: tokio::process::Child,
    lines: tokio::sync::mpsc::Receiver<(std::time::Instant, String)>,
    started: std::time::Instant,
}

impl Logged {
    fn spawn(config: &Path) -> Logged {
        Logged::spawn_with(Command::new(example("event-broker")), config)
    }

    fn spawn_with(mut command: Command, config: &Path) -> Logged {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let started = std::time::Instant::now();
        let mut child = command
            .arg("--config")
            .arg(config)
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        let (tx, lines) = tokio::sync::mpsc::channel(4096);
        tokio::spawn(async move {
            while let Ok(Some(line)) = stderr.next_line().await {
                if tx.send((std::time::Instant::now(), line)).await.is_err() {
                    return;
                }
            }
        });
        Logged {
            child,
            lines,
            started,
        }
    }

    /// When the next line containing `text` arrived.
    async fn next(&mut self, text: &str) -> std::time::Instant {
        within(async {
            loop {
                match self.lines.recv().await {
                    Some((at, line)) if line.contains(text) => return at,
                    Some(_) => {}
                    None => panic!("event_broker exited before logging {text:?}"),
                }
            }
        })
        .await
    }

    /// How many lines containing `text` arrive within `window` from now.
    async fn count_for(&mut self, text: &str, window: Duration) -> usize {
        let until = tokio::time::Instant::now() + window;
        let mut n = 0;
        while let Ok(Some((_, line))) = tokio::time::timeout_at(until, self.lines.recv()).await {
            n += usize::from(line.contains(text));
        }
        n
    }
}

/// A config named `name` for a broker toward `bus_url`, advertising `endpoints`,
/// with `extra` TOML (top-level keys first, then tables).
fn config_for(name: &str, bus_url: &str, endpoints: &[&str], extra: &str) -> PathBuf {
    let dir = config(name, "").parent().unwrap().to_owned();
    config(name, &body(bus_url, &dir, endpoints, extra))
}

async fn joined(bus: &EventBus) {
    within(async {
        while bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

fn default_bus_url(bus: &EventBus) -> String {
    format!("https://localhost:{}", bus.local_addr().port())
}

async fn default_bus() -> EventBus {
    EventBus::bind(
        "127.0.0.1:0",
        server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap(),
        clients(),
        EventBusConfig::default(),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn its_connect_timeouts_are_the_deadlines_it_keeps() {
    use crate::common::unaccepting_listener;
    use crate::support::{assert_fired_at, timed};
    use eventplane::tunnel::{RefuseCode, TunnelError};
    let bus = default_bus().await;
    let (_listener, _filler, port) = unaccepting_listener();
    let hanging = format!("tcp://127.0.0.1:{port}");
    // Each well under its default (5 s a attempt, 10 s in all).
    for (name, timeouts, deadline) in [
        (
            "attempt",
            "[timeouts]\nconnect_attempt_ms = 400\nconnect_ms = 9000",
            "connect_attempt_ms",
        ),
        (
            "connect",
            "[timeouts]\nconnect_attempt_ms = 9000\nconnect_ms = 400",
            "connect_ms",
        ),
    ] {
        let path = config_for(name, &default_bus_url(&bus), &[&hanging], timeouts);
        let mut broker = Logged::spawn(&path);
        joined(&bus).await;
        let (r, elapsed) = timed(bus.open_stream("prod", 0, &hanging)).await;
        assert!(
            matches!(r, Err(TunnelError::Refused(RefuseCode::ConnectTimeout))),
            "{r:?}"
        );
        assert_fired_at(deadline, elapsed, Duration::from_millis(400));
        broker.child.kill().await.unwrap();
        within(async {
            while !bus.brokers_for("prod").is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }
    bus.shutdown().await;
}

#[tokio::test]
async fn its_stream_slot_and_response_timeouts_are_the_deadlines_it_keeps() {
    use crate::common::{Mark, Script, ScriptedBus};
    use crate::support::assert_fired_at;
    use eventplane::tunnel::RefuseCode;
    use eventplane::tunnel::protocol::SessionEvent;
    for (script, key, code) in [
        (
            Script::NoStreamSlot,
            "stream_slot_ms",
            RefuseCode::StreamSlotTimeout,
        ),
        (
            Script::HoldResponseHead,
            "response_ms",
            RefuseCode::ResponseTimeout,
        ),
    ] {
        let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", target.local_addr().unwrap());
        let mut bus = ScriptedBus::start(script, Limits::default(), &endpoint).await;
        let path = config_for(
            key,
            &bus.url,
            &[&endpoint],
            &format!("[timeouts]\n{key} = 400"),
        );
        let mut broker = Logged::spawn(&path);
        let event = within(bus.events.recv()).await.unwrap();
        let elapsed = bus.marks.first(Mark::Subscribed).elapsed();
        assert_eq!(event, SessionEvent::Refused { stream_id: 1, code });
        assert_fired_at(key, elapsed, Duration::from_millis(400));
        broker.child.kill().await.unwrap();
    }
}

#[tokio::test]
async fn its_bus_connect_timeout_and_backoff_are_the_ones_configured() {
    use crate::common::unaccepting_listener;
    use crate::support::{assert_fired_at, refusing_port};
    // A bus whose TCP connect hangs: each attempt ends at bus_connect_ms, the next
    // comes at most max_ms later.
    let (_listener, _filler, port) = unaccepting_listener();
    let path = config_for(
        "bus-connect",
        &format!("https://localhost:{port}"),
        &["tcp://127.0.0.1:5"],
        "[timeouts]\nbus_connect_ms = 400\n[backoff]\nmin_ms = 50\nmax_ms = 50",
    );
    let mut broker = Logged::spawn(&path);
    let first = broker.next("bus session failed").await;
    // From the spawn: start-up is within the slack.
    assert_fired_at(
        "bus_connect_ms",
        first - broker.started,
        Duration::from_millis(400),
    );
    let second = broker.next("bus session failed").await;
    assert_fired_at(
        "two bus_connect_ms and a backoff of at most 50 ms",
        second - broker.started,
        Duration::from_millis(800),
    );
    broker.child.kill().await.unwrap();

    // A bus that refuses at once: the [backoff] keys set how fast it retries. With
    // max_ms = 100 every wait is at most 100 ms; with the defaults (at least 1 s, the
    // window doubling to 60 s) a handful of failures in 2 s at most.
    let (_held, refusing) = refusing_port();
    let url = format!("https://localhost:{refusing}");
    let fast = config_for(
        "backoff-fast",
        &url,
        &["tcp://127.0.0.1:5"],
        "[backoff]\nmin_ms = 50\nmax_ms = 100",
    );
    let mut broker = Logged::spawn(&fast);
    // Retry n waits at most min(max_ms, min_ms × 2^(n+1)): here 100 ms every time,
    // plus a refused connect and a log line, late by at most DEADLINE_SLACK on a
    // loaded machine. Without the cap the window doubles from 100 ms to 205 s by the
    // 12th retry: 12 waits all within 1.1 s would be a draw of about 10^-10.
    let bound = Duration::from_millis(100) + crate::support::DEADLINE_SLACK;
    let mut at = vec![broker.next("bus session failed").await];
    for _ in 0..12 {
        let last = *at.last().unwrap();
        let until = tokio::time::Instant::from_std(last + bound);
        let next = tokio::time::timeout_at(until, broker.next("bus session failed")).await;
        let gaps: Vec<Duration> = at.windows(2).map(|p| p[1] - p[0]).collect();
        let Ok(next) = next else {
            panic!("no retry within {bound:?} with min_ms = 50, max_ms = 100 (before: {gaps:?})")
        };
        assert!(
            next - last <= bound,
            "a retry after {:?} with min_ms = 50, max_ms = 100 (before: {gaps:?})",
            next - last
        );
        at.push(next);
    }
    broker.child.kill().await.unwrap();
    // min_ms is a floor: no retry comes sooner (with jitter from zero, as before, one
    // in three would).
    let floored = config_for(
        "backoff-floor",
        &url,
        &["tcp://127.0.0.1:5"],
        "[backoff]\nmin_ms = 300\nmax_ms = 400",
    );
    let mut broker = Logged::spawn(&floored);
    let mut at = Vec::new();
    for _ in 0..6 {
        at.push(broker.next("bus session failed").await);
    }
    for pair in at.windows(2) {
        let waited = pair[1] - pair[0];
        assert!(
            waited >= Duration::from_millis(270),
            "a retry after {waited:?} with min_ms = 300 (all: {:?})",
            at.windows(2).map(|p| p[1] - p[0]).collect::<Vec<_>>()
        );
    }
    broker.child.kill().await.unwrap();
    let slow = config_for("backoff-default", &url, &["tcp://127.0.0.1:5"], "");
    let mut broker = Logged::spawn(&slow);
    broker.next("bus session failed").await;
    let failures = broker
        .count_for("bus session failed", Duration::from_secs(2))
        .await;
    assert!(
        failures <= 4,
        "{failures} more failures in 2 s after the first with the default backoff"
    );
    broker.child.kill().await.unwrap();
}

#[tokio::test]
async fn its_dns_timeout_is_the_deadline_it_keeps() {
    use crate::support::{assert_fired_at, timed};
    use eventplane::tunnel::{RefuseCode, TunnelError};
    // The system resolver, made to hang: the broker runs in a mount namespace of its
    // own whose /etc/resolv.conf names a loopback address where a UDP socket takes
    // every query and answers none (glibc would wait 5 s per try).
    let Some(dns) = silent_dns().await else {
        return;
    };
    let bus = default_bus().await;
    let target = "tcp://publisher.eventplane-test.invalid:5557";
    let path = config_for(
        "dns",
        &default_bus_url(&bus),
        &[target],
        "[timeouts]\ndns_ms = 400",
    );
    let resolv = path.with_file_name("resolv.conf");
    std::fs::write(
        &resolv,
        format!(
            "nameserver {}\noptions timeout:5 attempts:2\n",
            dns.local_addr().unwrap().ip()
        ),
    )
    .unwrap();
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c"]);
    command.arg(format!(
        "mount --bind {} /etc/resolv.conf && exec {} \"$@\"",
        resolv.display(),
        example("event-broker").display()
    ));
    command.arg("event-broker");
    let mut broker = Logged::spawn_with(command, &path);
    joined(&bus).await;
    let (r, elapsed) = timed(bus.open_stream("prod", 0, target)).await;
    assert!(
        matches!(r, Err(TunnelError::Refused(RefuseCode::DnsTimeout))),
        "{r:?}"
    );
    assert_fired_at("dns_ms", elapsed, Duration::from_millis(400));
    broker.child.kill().await.unwrap();
    bus.shutdown().await;
}

/// A UDP socket on port 53 of a loopback address that reads queries and never
/// answers, or `None` (said on stderr) where this test cannot run: not root, or no
/// `unshare` (CI runs as root).
async fn silent_dns() -> Option<std::sync::Arc<tokio::net::UdpSocket>> {
    let can_unshare = std::process::Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    let socket = tokio::net::UdpSocket::bind("127.0.0.77:53").await;
    match (can_unshare, socket) {
        (true, Ok(socket)) => {
            let socket = std::sync::Arc::new(socket);
            let reader = socket.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1500];
                while reader.recv(&mut buf).await.is_ok() {}
            });
            Some(socket)
        }
        (can, socket) => {
            assert!(
                std::env::var_os("EVENTPLANE_REQUIRE_ROOT_TESTS").is_none(),
                "EVENTPLANE_REQUIRE_ROOT_TESTS is set (.ci/run sets it): this test must run \
                 (unshare --mount: {can}, 127.0.0.77:53: {:?})",
                socket.as_ref().err()
            );
            eprintln!(
                "SKIPPED: a hanging resolver needs root (unshare --mount: {can}, \
                 127.0.0.77:53: {:?})",
                socket.err()
            );
            None
        }
    }
}

#[tokio::test]
async fn sigterm_lets_open_streams_run_for_the_drain_deadline_then_exits() {
    use crate::support::assert_fired_at;
    let drain = Duration::from_millis(1200);
    let (bus, publisher, endpoint, broker) =
        running("drain-deadline", drain.as_millis() as u64).await;
    let mut sub = subscribed(&bus, &publisher, &endpoint).await;
    let termed = std::time::Instant::now();
    signal(&broker, "-TERM");
    // Still flowing most of the way to the deadline...
    tokio::time::sleep(drain / 2).await;
    let message = Message::from_parts([Bytes::from_static(b"t"), Bytes::from_static(b"late")]);
    publisher.send(message.clone());
    assert_eq!(within(sub.recv()).await.unwrap(), message);
    // ...cut at it, and the process exits 0 right after.
    within(async { while sub.recv().await.is_ok() {} }).await;
    assert_fired_at("drain_deadline_ms", termed.elapsed(), drain);
    let out = within(broker.wait_with_output()).await.unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_fired_at("exit after the drain", termed.elapsed(), drain);
    bus.shutdown().await;
}

#[tokio::test]
async fn a_router_that_never_reads_costs_the_broker_process_one_stream_budget() {
    use crate::support::{proc_status_bytes, reset_peak_rss};
    use eventplane::tunnel::protocol::{CHUNK_OVERHEAD, MAX_STREAM_BUFFER_BYTES};
    let (bus, publisher, endpoint, broker) = running("overflow", 300).await;
    // Subscribed, one message read, then never read again.
    let _sub = subscribed(&bus, &publisher, &endpoint).await;
    let pid = broker.id().unwrap();
    let before = reset_peak_rss(pid);
    // 32 MiB toward it. The broker keeps reading the publisher; what the router's
    // windows (256 KiB) do not take queues in the broker until the stream's 1 MiB
    // budget is full, and the stream is reset.
    let big = Bytes::from(vec![7u8; 64 << 10]);
    for _ in 0..512 {
        publisher.send(Message::from_parts([Bytes::from_static(b"t"), big.clone()]));
        tokio::task::yield_now().await;
    }
    within(async {
        while bus.stats().closed.get("buffer_overflow") != Some(&1) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    // The stream's budget, one 16 KiB relay read past it, and the allocator's and
    // HTTP/2's working room (SLACK).
    const SLACK: u64 = 1 << 20;
    let bound = (MAX_STREAM_BUFFER_BYTES + (16 << 10) + CHUNK_OVERHEAD) as u64 + SLACK;
    eprintln!(
        "figure: event_broker relaying 32 MiB to a router that reads nothing: +{} KiB peak \
         RSS (bound {} KiB)",
        grown >> 10,
        bound >> 10
    );
    assert!(
        grown <= bound,
        "event_broker grew by {grown} B, bound {bound} B"
    );
    // And the measure saw the queue at all (a reading of nothing would pass the bound).
    assert!(
        grown >= MAX_STREAM_BUFFER_BYTES as u64 / 2,
        "event_broker grew by {grown} B only: the flood did not reach its budget"
    );
    assert_eq!(
        publisher.stats().dropped,
        0,
        "the publisher never had to drop"
    );
    bus.shutdown().await;
}

/// `--check-config` contacts nothing (a wrong token passes it); `--check-bus` opens one
/// session: 0 once welcomed, 3 with the reason for a wrong token or CA or a closed
/// port.
#[tokio::test]
async fn check_bus_tells_a_wrong_token_or_ca_from_a_good_one() {
    let bus = default_bus().await;
    let url = default_bus_url(&bus);
    let good = config_for("check-bus", &url, &["tcp://127.0.0.1:5"], "");
    // A broker runs with this configuration: the check must not supersede it.
    let mut running = Logged::spawn(&good);
    running.next("bus session welcomed").await;
    joined(&bus).await;
    let out = run(&good, &["--check-bus"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("bus ok"),
        "{out:?}"
    );
    assert_eq!(
        running
            .count_for("bus session ended", Duration::from_millis(500))
            .await,
        0,
        "the running broker lost its session to the check"
    );
    assert_eq!(bus.brokers_for("prod"), ["broker-a"]);
    running.child.kill().await.unwrap();

    // A token the bus does not know: --check-config cannot tell, --check-bus can.
    let wrong_token = config_for("check-bus-token", &url, &["tcp://127.0.0.1:5"], "");
    std::fs::write(
        wrong_token.parent().unwrap().join("token"),
        "not-the-token-0123456789\n",
    )
    .unwrap();
    let out = run(&wrong_token, &["--check-config"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = run(&wrong_token, &["--check-bus"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("bus check failed"), "{stderr}");
    assert!(stderr.contains("refused the credential"), "{stderr}");

    // A CA that did not sign the bus's certificate.
    let text = std::fs::read_to_string(&good)
        .unwrap()
        .replace("ca.pem", "other-ca.pem");
    let wrong_ca = config("check-bus-ca", &text);
    let out = run(&wrong_ca, &["--check-bus"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");

    // Nobody listening.
    let (_held, closed) = crate::support::refusing_port();
    let nowhere = config_for(
        "check-bus-closed",
        &format!("https://localhost:{closed}"),
        &["tcp://127.0.0.1:5"],
        "",
    );
    let out = run(&nowhere, &["--check-bus"]).await;
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    drop(bus);
}

#[tokio::test]
async fn kv_router_bus_clients_bind_each_broker_to_its_id_and_namespaces() {
    use eventplane::tunnel::TokenDigest;
    use tokio::io::{AsyncBufReadExt, BufReader};
    let dir = config("bus-clients", "").parent().unwrap().to_owned();
    let (token_a, token_b) = ("bus-clients-token-a", "bus-clients-token-b");
    let digest = |t: &str| TokenDigest::of(&Secret::new(t).unwrap()).to_hex();
    let clients = dir.join("clients.toml");
    std::fs::write(
        &clients,
        format!(
            "[[broker]]\nclient_id = \"broker-a\"\ntoken_sha256 = \"{}\"\nnamespaces = [\"prod\"]\n\n\
             [[broker]]\nclient_id = \"broker-b\"\ntoken_sha256 = \"{}\"\nnamespaces = [\"prod\"]\n",
            digest(token_a),
            digest(token_b)
        ),
    )
    .unwrap();
    let mut router = Command::new(example("kv-router"))
        .args([
            "--static",
            "tcp://127.0.0.1:5",
            "--namespace",
            "prod",
            "--topic",
            "kv",
        ])
        .args(["--format", "quiet", "--bus-listen", "127.0.0.1:0"])
        .arg("--bus-cert")
        .arg(fixture("bus.pem"))
        .arg("--bus-key")
        .arg(fixture("bus.key"))
        .arg("--bus-clients")
        .arg(&clients)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(router.stderr.take().unwrap()).lines();
    let addr = bus_address(&mut lines).await;
    let url = format!("https://localhost:{}", addr.rsplit(':').next().unwrap());
    // `name`'s broker configuration: client id `id`, token `token`, namespaces `ns`.
    let broker = |name: &str, id: &str, token: &str, ns: &str| {
        let path = config_for(name, &url, &["tcp://127.0.0.1:5"], "")
            .to_str()
            .unwrap()
            .to_owned();
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("client_id = \"broker-a\"", &format!("client_id = {id:?}"))
            .replace("namespaces = [\"prod\"]", &format!("namespaces = [{ns}]"));
        std::fs::write(&path, text).unwrap();
        std::fs::write(Path::new(&path).parent().unwrap().join("token"), token).unwrap();
        PathBuf::from(path)
    };
    // broker-a with its own token: welcomed. The digest the router holds is the one
    // the broker prints for it.
    let real = broker("clients-real", "broker-a", token_a, "\"prod\"");
    let out = run(&real, &["--print-token-sha256"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), digest(token_a));
    let out = run(&real, &["--check-bus"]).await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    // broker-b's token claiming broker-a: denied, by its code.
    let impostor = broker("clients-impostor", "broker-a", token_b, "\"prod\"");
    let out = run(&impostor, &["--check-bus"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("client_id_not_granted"), "{stderr}");
    assert!(!stderr.contains(token_b), "{stderr}");
    // broker-a claiming a namespace it is not granted: denied.
    let greedy = broker("clients-greedy", "broker-a", token_a, "\"prod\", \"dev\"");
    let out = run(&greedy, &["--check-bus"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("namespace_not_granted"), "{stderr}");
    // The router's stats line has a bus section that counted both.
    signal(&router, "-TERM");
    let mut last = String::new();
    within(async {
        while let Ok(Some(line)) = lines.next_line().await {
            last = line;
        }
    })
    .await;
    assert_eq!(within(router.wait()).await.unwrap().code(), Some(0));
    let stats: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(
        stats["bus"]["denied"]["client_id_not_granted"], 1,
        "{stats}"
    );
    assert_eq!(
        stats["bus"]["denied"]["namespace_not_granted"], 1,
        "{stats}"
    );
    assert_eq!(stats["bus"]["sessions_started"], 3, "{stats}");

    // A file with a bad digest: refused as an argument, naming the broker.
    std::fs::write(
        &clients,
        "[[broker]]\nclient_id = \"broker-a\"\ntoken_sha256 = \"abc\"\nnamespaces = [\"prod\"]\n",
    )
    .unwrap();
    let out = within(
        Command::new(example("kv-router"))
            .args([
                "--static",
                "tcp://127.0.0.1:5",
                "--namespace",
                "prod",
                "--topic",
                "kv",
            ])
            .args(["--bus-listen", "127.0.0.1:0"])
            .arg("--bus-cert")
            .arg(fixture("bus.pem"))
            .arg("--bus-key")
            .arg(fixture("bus.key"))
            .arg("--bus-clients")
            .arg(&clients)
            .output(),
    )
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("broker-a") && stderr.contains("token_sha256"),
        "{stderr}"
    );
}

/// `kv-router` with an event bus on a loopback port, this directory's token shared,
/// the test certificate: add what it follows.
pub(crate) fn router_with_bus(token_dir: &Path) -> Command {
    let mut router = Command::new(example("kv-router"));
    router
        .args(["--allow-cidr", "127.0.0.0/8"])
        .args(["--bus-listen", "127.0.0.1:0", "--bus-token-file"])
        .arg(token_dir.join("token"))
        .arg("--bus-cert")
        .arg(fixture("bus.pem"))
        .arg("--bus-key")
        .arg(fixture("bus.key"));
    router
}

/// The address `kv_router --bus-listen` says its bus listens on (its stderr).
pub(crate) async fn bus_address(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
) -> String {
    within(async {
        loop {
            let line = lines.next_line().await.unwrap().unwrap();
            if let Some(addr) = line.strip_prefix("event bus listening on ") {
                return addr.to_owned();
            }
        }
    })
    .await
}
