//! Routers that heal: `kv-router` repairs what it lost of a worker from the worker's
//! recovery log (`kv-relay --recovery-bind`, registered in a real etcd) instead of
//! wiping it, in front of vLLM 0.34.0's own publisher (`tests/support/engine_peer.rs`):
//! directly, through an `event-broker` (the router outside the cluster), and from a
//! relay that dials out to the router's bus (a source).
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use std::collections::HashSet;

use serde_json::Value;
use support::Watched;
use support::admin::{self, until_metric};
use support::engine_peer::EnginePeer;
use support::etcd::EtcdServer;

/// `kv-relay` in front of `engine`, registered in etcd under `ns/kvworker` with its
/// recovery endpoint, repairing from the engine's replay buffer too.
async fn relay(engine: &EnginePeer, etcd: &str, ns: &str) -> Watched {
    relay_with(engine, &["--etcd", etcd, "--namespace", ns]).await
}

/// `kv-relay` in front of `engine` with its recovery endpoint, made known by `known`
/// (a discovery backend and namespace, or a bus) under component `kvworker`.
async fn relay_with(engine: &EnginePeer, known: &[&str]) -> Watched {
    let mut args = vec![
        // A short queue toward a router that stops reading: it drops soon.
        "--publisher-queue",
        "64",
        "--recovery-bind",
        "tcp://127.0.0.1:0",
        "--component",
        "kvworker",
    ];
    args.extend(known);
    let (mut relay, _) = engine.relay(&args).await;
    // Its recovery endpoint.
    relay.line().await;
    relay
}

/// Sends `sig` to `process`.
fn signal(process: &Watched, sig: &str) {
    let pid = process.child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args([sig, &pid])
        .status();
    assert!(sent.unwrap().success());
}

/// `kv-router` following `ns/kvworker` in etcd, with its admin endpoint; returns it
/// and that endpoint's address.
async fn router(etcd: &str, ns: &str) -> (Watched, String) {
    let (router, addr, _) = router_with(&["--etcd", etcd, "--namespace", ns], None).await;
    (router, addr)
}

/// `kv-router` following `follow` (component `kvworker`), with its admin endpoint,
/// and an event bus when given its credentials (`--bus-token-file` or
/// `--bus-clients`, and the file); returns it, the admin address, and the bus's port.
async fn router_with(
    follow: &[&str],
    bus: Option<(&str, &str)>,
) -> (Watched, String, Option<String>) {
    let mut args = follow.to_vec();
    let (cert, key) = (fixture("bus.pem"), fixture("bus.key"));
    if let Some((flag, file)) = bus {
        args.extend(["--bus-listen", "127.0.0.1:0", "--bus-cert", &cert]);
        args.extend(["--bus-key", &key, flag, file]);
    }
    args.extend([
        "--allow-cidr",
        "127.0.0.0/8",
        "--component",
        "kvworker",
        "--topic",
        "kv-events",
        "--format",
        "quiet",
        "--dump-index",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let mut router = Watched::spawn("kv-router", &args);
    let bus = match bus {
        Some(_) => {
            let line = router.stderr_until("event bus listening on ").await;
            Some(line.rsplit(':').next().unwrap().trim().to_owned())
        }
        None => None,
    };
    let line = router.stderr_until("admin endpoint on http://").await;
    let addr = line
        .split("http://")
        .nth(1)
        .unwrap()
        .trim_end_matches('/')
        .to_owned();
    (router, addr, bus)
}

/// Asserts the router's index (its stats line) holds exactly `truth` for worker 1.
#[track_caller]
fn assert_index(stats: &Value, truth: &HashSet<u64>) {
    let held = indexed(stats);
    assert!(
        held == *truth,
        "the router holds {} blocks, the engine {}: {} missing, {} extra; repairs {}, index {}",
        held.len(),
        truth.len(),
        truth.difference(&held).count(),
        held.difference(truth).count(),
        stats["repairs"],
        stats["index_stats"]
    );
}

/// The blocks the router's index holds for worker 1 (from `--dump-index`).
fn indexed(stats: &Value) -> HashSet<u64> {
    stats["index"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["worker_id"] == 1)
        .flat_map(|e| e["block_hashes"].as_array().unwrap().iter())
        .map(|h| h.as_u64().unwrap())
        .collect()
}

fn assert_no_wipes(stats: &Value) {
    for cause in ["id_gap", "reconnect", "recovery_failed", "held_overflow"] {
        assert_eq!(stats["wipes"][cause], 0, "{cause}: {}", stats["wipes"]);
    }
}

/// A router started after the engine published rebuilds the worker from its dump,
/// and equals the engine without another event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_late_rebuilds_every_worker_from_its_dump() {
    let etcd = EtcdServer::start().await;
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let relay = relay(&engine, &etcd.url(), "late").await;
    engine.burst(60).await;
    let truth = engine.truth().await;
    // The relay has it all (its own engine replay makes sure) before the router starts.
    let (router, addr) = router(&etcd.url(), "late").await;
    // Ready only once its first recoveries are done: the worker's dump applied.
    admin::until(&addr, "/readyz", |status, _| status == 200).await;
    let (_, metrics) = admin::get(&addr, "/metrics").await;
    assert_eq!(
        admin::metric(&metrics, "eventplane_kv_index_blocks"),
        Some(truth.len() as f64),
        "ready before the dump was applied"
    );
    // Nothing was published since: the dump alone is the engine's blocks.
    let stats = router.terminate().await;
    assert_index(&stats, &truth);
    assert!(
        stats["repairs"]["dump"].as_u64().unwrap() >= 1,
        "{}",
        stats["repairs"]
    );
    assert_no_wipes(&stats);
    relay.terminate().await;
}

/// Stops `router` while the engine publishes more than a relay's queue holds, resumes
/// it, publishes a little more; the engine's blocks.
async fn fall_behind(router: &Watched, engine: &mut EnginePeer) -> HashSet<u64> {
    signal(router, "-STOP");
    engine.burst(2500).await;
    signal(router, "-CONT");
    engine.burst(5).await;
    // Bursts settle at the engine's 4,000 blocks, so that count says nothing of what
    // the router applied; 3,993 it holds only once this last batch is applied (a
    // batch stores before it removes: a router on its way holds at least 4,000).
    engine.remove_newest(7).await;
    let truth = engine.truth().await;
    assert_eq!(truth.len(), 3993);
    truth
}

/// Waits until the router at `addr` has caught up after a loss: nothing held or
/// recovering, and either the engine's block count with at least two repairs, or a
/// wipe (which the caller's assertions then name).
async fn caught_up(addr: &str, truth: &HashSet<u64>) {
    // A debug router working through thousands of batches beside the rest of the
    // suite on 2 cores took over `DEADLINE` (30 s) once: a wait, not a bound.
    let started = std::time::Instant::now();
    let waited = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        loop {
            let (_, body) = admin::get(addr, "/metrics").await;
            let held = admin::metric(&body, "eventplane_kv_index_held_events").unwrap_or(1.0);
            let recovering =
                admin::metric(&body, "eventplane_kv_index_recovering_publishers").unwrap_or(1.0);
            let repairs = admin::metric(&body, "eventplane_kv_index_repairs_total").unwrap_or(0.0);
            let lost = admin::metric(&body, "eventplane_kv_index_wipes_total").unwrap_or(0.0);
            let blocks = admin::metric(&body, "eventplane_kv_index_blocks").unwrap_or(0.0);
            let caught_up = blocks == truth.len() as f64;
            if held == 0.0 && recovering == 0.0 && ((repairs >= 2.0 && caught_up) || lost > 0.0) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the router did not catch up within 120 s");
    eprintln!("caught up in {:?}", started.elapsed());
}

/// A router that falls behind (stopped while the worker publishes more than the
/// relay's queue holds) loses events on the way: it repairs them from the relay's
/// log instead of wiping the worker, and equals the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_lost_events_repairs_them_from_the_workers_log() {
    let etcd = EtcdServer::start().await;
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let relay = relay(&engine, &etcd.url(), "gap").await;
    let (router, addr) = router(&etcd.url(), "gap").await;
    // Rebuilt (an empty dump) once the relay is followed.
    until_metric(&addr, "eventplane_kv_index_repairs_total", 1.0).await;
    engine.burst(20).await;
    let truth = fall_behind(&router, &mut engine).await;
    caught_up(&addr, &truth).await;
    let stats = router.terminate().await;
    let dropped = stats["subscriber"]["total"]["dropped"].clone();
    let relay_stats = relay.terminate().await;
    let publisher_dropped = relay_stats["publisher"]["dropped"].as_u64().unwrap_or(0);
    assert!(
        publisher_dropped > 0 || dropped != 0,
        "no event was lost on the way: the test proves nothing ({relay_stats})"
    );
    assert_index(&stats, &truth);
    assert_no_wipes(&stats);
}

/// `/readyz` stays 503 while a worker's first recovery is outstanding (its endpoint
/// accepts and never answers, so the request times out after the client's 5 s), then
/// the worker is wiped for it and the router is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_is_not_ready_until_its_first_recoveries_are_done() {
    use eventplane::zmtp::{Config, PubSocket};
    let etcd = EtcdServer::start().await;
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_at = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let record = format!(
        r#"{{"id":{{"namespace":"slow","component":"kvworker","topic":"kv-events","publisher_id":7}},"transport":{{"kind":"zmq","endpoint":"{}"}},"worker":{{"worker_id":7,"dp_rank":0}},"recovery":"tcp://{silent_at}"}}"#,
        publisher.local_endpoint().unwrap()
    );
    etcd.etcdctl(&[
        "put",
        "/eventplane/v1/channels/slow/kvworker/kv-events/7",
        &record,
    ]);
    let (router, addr) = router(&etcd.url(), "slow").await;
    let started = std::time::Instant::now();
    admin::until(&addr, "/readyz", |status, _| status == 200).await;
    let waited = started.elapsed();
    // The request's 5 s timeout (not the first second's tick), within the 10 s bound.
    assert!(
        waited >= std::time::Duration::from_secs(4) && waited <= std::time::Duration::from_secs(11),
        "ready after {waited:?}"
    );
    let stats = router.terminate().await;
    assert_eq!(stats["wipes"]["recovery_failed"], 1, "{}", stats["wipes"]);
}

/// A worker whose first recovery fails (its endpoint accepts and never answers, so
/// the request times out and the worker is wiped) is rebuilt from its dump once the
/// endpoint answers: the blocks it stored before the router listened are back, with
/// no other loss.
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_wiped_by_a_failed_recovery_is_rebuilt_once_it_answers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use eventplane::discovery::{Discovery, EtcdDiscovery};
    use eventplane::kv::pipeline::{
        EventPlaneSink, EventSink, LocalIndex, RecoveryServer, SharedWorkerLog, WorkerLogConfig,
    };
    use eventplane::publish::EventPublisher;

    let etcd = EtcdServer::start().await;
    let log = SharedWorkerLog::new(WorkerLogConfig::default());
    let server = RecoveryServer::bind("tcp://127.0.0.1:0", log.clone())
        .await
        .unwrap();
    // The endpoint routers are told of: silent (connections held, nothing answered)
    // until `answering`, then a pipe to the log's server.
    let answering = Arc::new(AtomicBool::new(false));
    let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front_at = format!("tcp://{}", front.local_addr().unwrap());
    let behind = server
        .local_endpoint()
        .trim_start_matches("tcp://")
        .to_owned();
    let open = answering.clone();
    tokio::spawn(async move {
        let mut silent = Vec::new();
        while let Ok((mut stream, _)) = front.accept().await {
            if !open.load(Ordering::SeqCst) {
                silent.push(stream);
                continue;
            }
            let behind = behind.clone();
            tokio::spawn(async move {
                if let Ok(mut b) = tokio::net::TcpStream::connect(&behind).await {
                    let _ = tokio::io::copy_bidirectional(&mut stream, &mut b).await;
                }
            });
        }
    });
    let discovery: Arc<dyn Discovery> =
        Arc::new(EtcdDiscovery::connect([etcd.url()]).await.unwrap());
    let publisher = EventPublisher::builder(discovery, "rebuild", "kvworker", "kv-events")
        .worker(1, 0)
        .recovery(&front_at)
        .build()
        .await
        .unwrap();
    let sink = EventPlaneSink::new(Arc::new(publisher));
    let mut keeper = log.clone();
    // Event `id` stores block 100 + id from the root; kept, then published.
    let mut publish = move |id: u64| {
        let ev = support::stored_at_root(1, id, 100 + id);
        keeper.apply(&ev).unwrap();
        ev
    };
    // Stored before any router listens: only a dump can tell of these.
    for id in 1..=5 {
        let ev = publish(id);
        sink.publish(&[ev]).await.unwrap();
    }
    let (router, addr) = router(&etcd.url(), "rebuild").await;
    let failed = "eventplane_kv_index_wipes_total{reason=\"recovery_failed\"}";
    until_metric(&addr, failed, 1.0).await;
    answering.store(true, Ordering::SeqCst);
    // Live while the rebuild waits its back-off: applied as it comes.
    let ev = publish(6);
    sink.publish(&[ev]).await.unwrap();
    let rebuilt = "eventplane_kv_index_repairs_total{kind=\"rebuild\"}";
    until_metric(&addr, rebuilt, 1.0).await;
    let ev = publish(7);
    sink.publish(&[ev]).await.unwrap();
    until_metric(&addr, "eventplane_kv_index_blocks", 7.0).await;
    let stats = router.terminate().await;
    let truth: HashSet<u64> = (101..=107).collect();
    assert_index(&stats, &truth);
    assert_eq!(stats["wipes"]["recovery_failed"], 1, "{}", stats["wipes"]);
    assert_eq!(stats["wipes"]["id_gap"], 0, "{}", stats["wipes"]);
    assert_eq!(stats["repairs"]["rebuilding"], 0, "{}", stats["repairs"]);
}

/// The tunnel's test certificates and keys (`tests/fixtures/tunnel`).
fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/tunnel/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[cfg(feature = "tunnel")]
/// A fresh directory `name` holding `files`.
fn secrets(name: &str, files: &[(&str, String)]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("eventplane-heal-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (file, body) in files {
        std::fs::write(dir.join(file), body).unwrap();
    }
    dir
}

#[cfg(feature = "tunnel")]
/// A router that first sees the worker late, then stopped while the worker publishes
/// past the relay's queue: it rebuilds the worker from its dump and repairs the loss
/// from its log, and equals the engine with no wipe; its stats.
async fn rebuilt_then_repaired(
    engine: &mut EnginePeer,
    router: Watched,
    addr: &str,
) -> serde_json::Value {
    // The first repair is the worker's dump (readiness cannot wait for it here: the
    // router cannot know of a publisher before the broker or the source is up).
    until_metric(addr, "eventplane_kv_index_repairs_total", 1.0).await;
    // What the relay had not yet logged when it dumped arrives live.
    let first = engine.truth().await;
    until_metric(addr, "eventplane_kv_index_blocks", first.len() as f64).await;
    let truth = fall_behind(&router, engine).await;
    caught_up(addr, &truth).await;
    let stats = router.terminate().await;
    assert_index(&stats, &truth);
    assert_no_wipes(&stats);
    // The first sight's dump, and at least one repair of a loss (events since it, or
    // a dump when the worker's last 1,024 events no longer reach back): no repair
    // without a loss.
    let repairs = &stats["repairs"];
    assert!(
        repairs["dump"].as_u64().unwrap() + repairs["since"].as_u64().unwrap() >= 2,
        "no loss was repaired: {repairs}"
    );
    stats
}

/// The router outside the cluster reaches the worker's recovery endpoint through the
/// `event-broker` that relays its publisher: the broker's view advertises it (from
/// the relay's etcd record), and every recovery is a stream through the broker.
#[cfg(feature = "tunnel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_heals_through_a_broker() {
    const TOKEN: &str = "heal-through-a-broker-token";
    let etcd = EtcdServer::start().await;
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let relay = relay(&engine, &etcd.url(), "prod").await;
    engine.burst(60).await;
    let dir = secrets("broker", &[("token", format!("{TOKEN}\n"))]);
    let token = dir.join("token").display().to_string();
    let (router, addr, port) = router_with(
        &["--etcd", &etcd.url(), "--namespace", "prod"],
        Some(("--bus-token-file", &token)),
    )
    .await;
    let config = format!(
        "bus_url = \"https://localhost:{port}\"\nclient_id = \"broker-a\"\nca_file = {ca:?}\n\
         token_file = {token:?}\nallowed_cidrs = [\"127.0.0.0/8\"]\n\
         [discovery]\nnamespaces = [\"prod\"]\netcd = [{etcd:?}]\n",
        port = port.unwrap(),
        ca = fixture("ca.pem"),
        etcd = etcd.url(),
    );
    std::fs::write(dir.join("broker.toml"), config).unwrap();
    let broker = Watched::spawn(
        "event-broker",
        &["--config", &dir.join("broker.toml").display().to_string()],
    );
    let stats = rebuilt_then_repaired(&mut engine, router, &addr).await;
    let broker = broker.terminate().await;
    let relay = relay.terminate().await;
    // Every recovery connection the relay served was a stream through the broker: the
    // broker's streams are the publisher's connections and those.
    let to_publisher = relay["publisher"]["accepted"].as_u64().unwrap();
    let to_recovery = relay["recovery"]["server"]["connections"].as_u64().unwrap();
    assert!(to_recovery >= 2, "{}", relay["recovery"]);
    assert_eq!(
        broker["streams_opened"].as_u64().unwrap(),
        to_publisher + to_recovery,
        "broker {broker}, relay {relay}, repairs {}",
        stats["repairs"]
    );
}

/// A relay that dials out to the router's bus (a source, no etcd) announces its
/// recovery log with its publisher; the router asks for it through the relay's own
/// session.
#[cfg(feature = "tunnel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_heals_through_a_relay_that_dials_out() {
    const TOKEN: &str = "heal-through-a-source-token-0123456";
    let digest =
        eventplane::tunnel::TokenDigest::of(&eventplane::tunnel::Secret::new(TOKEN).unwrap())
            .to_hex();
    let dir = secrets(
        "source",
        &[
            ("token", format!("{TOKEN}\n")),
            (
                "clients.toml",
                format!(
                    "[[source]]\nclient_id = \"gpu-box-1\"\ntoken_sha256 = \"{digest}\"\nnamespaces = [\"prod\"]\n"
                ),
            ),
        ],
    );
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let clients = dir.join("clients.toml").display().to_string();
    let (router, addr, port) =
        router_with(&["--namespace", "prod"], Some(("--bus-clients", &clients))).await;
    // The router is up first here (the relay dials it): held back while the engine
    // publishes, it has what came before from the relay's dump only.
    signal(&router, "-STOP");
    let bus_url = format!("https://localhost:{}", port.unwrap());
    let token = dir.join("token").display().to_string();
    let relay = relay_with(
        &engine,
        &[
            "--bus-url",
            &bus_url,
            "--bus-ca",
            &fixture("ca.pem"),
            "--bus-token-file",
            &token,
            "--client-id",
            "gpu-box-1",
            "--namespace",
            "prod",
        ],
    )
    .await;
    engine.burst(60).await;
    signal(&router, "-CONT");
    rebuilt_then_repaired(&mut engine, router, &addr).await;
    // Every recovery was a stream of the relay's session (an announced publisher's
    // log cannot be reached otherwise): its streams are the publisher's and those.
    let relay = relay.terminate().await;
    let to_recovery = relay["recovery"]["server"]["connections"].as_u64().unwrap();
    assert!(to_recovery >= 2, "{}", relay["recovery"]);
    assert_eq!(
        relay["source"]["streams_opened"].as_u64().unwrap(),
        relay["publisher"]["accepted"].as_u64().unwrap() + to_recovery,
        "{relay}"
    );
}
