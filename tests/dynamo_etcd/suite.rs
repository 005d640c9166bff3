//! Dynamo's discovery records on a real etcd, and the processes end to end.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use crate::support;

use std::time::Duration;

use eventplane::discovery::conformance::Mirror;
use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream, DynamoRecords,
    EtcdDiscovery, Query, Transport,
};
use eventplane::kv::engine::{EngineEvent, encode_engine_batch};
use serde_json::Value;
use support::etcd::EtcdServer;
use support::{WARM_RANK, within};
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(3);
/// The identity of the captured Dynamo worker.
const CAPTURED_ID: u64 = 3_390_985_166_245_404;

fn capture() -> Value {
    support::dynamo_capture()
}

async fn connect(url: &str, records: DynamoRecords) -> EtcdDiscovery {
    EtcdDiscovery::builder([url])
        .lease_ttl(TTL)
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .dialect(eventplane::wire::Dialect::Dynamo)
        .records(records)
        .connect()
        .await
        .unwrap()
}

fn worker() -> DynamoRecords {
    DynamoRecords::new().endpoint("generate").worker(77, 0)
}

async fn next(s: &mut DiscoveryStream) -> DiscoveryEvent {
    within(s.next())
        .await
        .expect("stream ended")
        .expect("stream failed")
}

async fn synced(s: &mut DiscoveryStream) -> Mirror {
    let mut m = Mirror::default();
    until(s, &mut m, |m| m.resyncs() == 1).await;
    m
}

async fn until(s: &mut DiscoveryStream, mirror: &mut Mirror, done: impl Fn(&Mirror) -> bool) {
    while !done(mirror) {
        let ev = next(s).await;
        mirror.apply(&ev);
    }
}

/// `etcdctl get --prefix` as (key, value) pairs.
fn get_prefix(server: &EtcdServer, prefix: &str) -> Vec<(String, String)> {
    let out = server.etcdctl(&["get", "--prefix", prefix]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .map(|kv| {
            (
                kv[0].to_owned(),
                kv.get(1).copied().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// What we register is key- and JSON-equal to what the Dynamo 1.6.1 worker wrote for
/// the same identity, both records on our lease; unregistering deletes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_records_equal_the_captured_ones() {
    let capture = capture();
    let server = EtcdServer::start().await;
    let d = connect(&server.url(), worker()).await;
    let id = ChannelId::new("capns", "kvworker", "kv-events", CAPTURED_ID).unwrap();
    let endpoint = capture["endpoint"].as_str().unwrap();
    let g = d.register(id, Transport::zmq(endpoint)).await.unwrap();
    let ours: Vec<(String, String)> = [
        get_prefix(&server, "v1/event_channels/"),
        get_prefix(&server, "v1/event_sources/"),
    ]
    .concat();
    let theirs = capture["etcd"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len(), "{ours:?}");
    for ((key, value), captured) in ours.iter().zip(theirs) {
        assert_eq!(key, captured["key"].as_str().unwrap());
        let ours: Value = serde_json::from_str(value).unwrap();
        let theirs: Value = serde_json::from_str(captured["value"].as_str().unwrap()).unwrap();
        assert_eq!(ours, theirs, "{key}");
        // Byte-equal too: same field order, same number forms.
        assert_eq!(value, captured["value"].as_str().unwrap());
    }
    let ttl = server.etcdctl(&[
        "lease",
        "timetolive",
        &format!("{:x}", d.lease_id()),
        "--keys",
    ]);
    for (key, _) in &ours {
        assert!(ttl.contains(key.as_str()), "{key} not on our lease: {ttl}");
    }
    within(g.unregister()).await.unwrap();
    assert!(get_prefix(&server, "v1/").is_empty());
}

/// The captured records, written by "Dynamo" (etcdctl), are followed: a watch with no
/// endpoint sees the publisher at the captured endpoint. Records of other scopes or
/// transports are skipped and counted; another endpoint's records are not followed by
/// a watch narrowed to one endpoint, and not counted either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_records_are_followed_and_hostile_ones_counted() {
    let capture = capture();
    let server = EtcdServer::start().await;
    let router = connect(&server.url(), DynamoRecords::new()).await;
    let narrowed = connect(&server.url(), DynamoRecords::new().endpoint("generate")).await;
    let mut w = router
        .watch(
            Query::new("capns").component("kvworker").topic("kv-events"),
            CancellationToken::new(),
        )
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    for record in capture["etcd"].as_array().unwrap() {
        server.etcdctl(&[
            "put",
            record["key"].as_str().unwrap(),
            record["value"].as_str().unwrap(),
        ]);
    }
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![CAPTURED_ID]).await;
    let listed = router.list(Query::new("capns")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].transport.endpoint(),
        capture["endpoint"].as_str().unwrap()
    );
    assert_eq!(listed[0].id.component(), "kvworker");

    // Another endpoint of the same component: followed by the router (every endpoint),
    // not by the narrowed backend, which does not count it as malformed either.
    let other = capture["etcd"][0]["value"]
        .as_str()
        .unwrap()
        .replace("\"name\":\"generate\"", "\"name\":\"prefill\"")
        .replace(&CAPTURED_ID.to_string(), "5");
    server.etcdctl(&[
        "put",
        "v1/event_channels/namespace/capns/component/kvworker/endpoint/prefill/topic/kv-events/5",
        &other,
    ]);
    until(&mut w, &mut m, |m| {
        m.publisher_ids() == vec![5, CAPTURED_ID]
    })
    .await;
    let narrowed_ids: Vec<u64> = narrowed
        .list(Query::new("capns"))
        .await
        .unwrap()
        .iter()
        .map(|i| i.id.publisher_id())
        .collect();
    assert_eq!(narrowed_ids, vec![CAPTURED_ID]);
    assert_eq!(narrowed.stats().malformed, 0);

    // Hostile records: skipped and counted, the watch keeps serving.
    let before = router.stats().malformed;
    let key = |n: &str| {
        format!(
            "v1/event_channels/namespace/capns/component/kvworker/endpoint/generate/topic/kv-events/{n}"
        )
    };
    let channel = capture["etcd"][0]["value"].as_str().unwrap().to_owned();
    for (k, v) in [
        (key("6"), "not json".to_owned()),
        // The value names another instance than its key.
        (key("7"), channel.clone()),
        (
            key("8"),
            channel
                .replace(&CAPTURED_ID.to_string(), "8")
                .replace("\"Zmq\"", "\"Nats\""),
        ),
        (
            key("9"),
            channel
                .replace(&CAPTURED_ID.to_string(), "9")
                .replace(r#""kind":"endpoint""#, r#""kind":"namespace""#),
        ),
        (key("zz"), "{}".to_owned()),
    ] {
        server.etcdctl(&["put", &k, &v]);
    }
    // A later valid change still arrives: the captured worker stops.
    server.etcdctl(&["del", capture["etcd"][0]["key"].as_str().unwrap()]);
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![5]).await;
    assert_eq!(router.stats().malformed - before, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_without_a_worker_is_refused_clearly() {
    let server = EtcdServer::start().await;
    let router = connect(&server.url(), DynamoRecords::new().endpoint("generate")).await;
    let err = router
        .register(
            ChannelId::new("ns", "c", "t", 1).unwrap(),
            Transport::zmq("tcp://127.0.0.1:1"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DiscoveryError::InvalidConfig(_)), "{err:?}");
    assert!(
        err.to_string().contains("worker") || format!("{err:?}").contains("worker"),
        "{err:?}"
    );
}

/// A lease lost behind our back: both records come back under the new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lease_puts_both_records_back() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url(), worker()).await;
    let g = d
        .register(
            ChannelId::new("lease", "c", "kv-events", 1).unwrap(),
            Transport::zmq("tcp://127.0.0.1:1"),
        )
        .await
        .unwrap();
    let old = d.lease_id();
    server.etcdctl(&["lease", "revoke", &format!("{old:x}")]);
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        let lease = d.lease_id();
        let keys = get_prefix(&server, "v1/");
        if lease != old && keys.len() == 2 {
            let ttl = server.etcdctl(&["lease", "timetolive", &format!("{lease:x}"), "--keys"]);
            if keys.iter().all(|(k, _)| ttl.contains(k.as_str())) {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "records not back: {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    within(g.unregister()).await.unwrap();
    assert!(get_prefix(&server, "v1/").is_empty());
}

/// The engine batches of the capture's `engine_script`, as a vLLM ≤ 0.23 engine sends
/// them.
fn engine_batches(capture: &Value) -> Vec<Vec<u8>> {
    capture["engine_script"]
        .as_array()
        .unwrap()
        .iter()
        .map(|events| rmp_serde::to_vec(&serde_json::json!([1_700_000_000.5, events, 0])).unwrap())
        .collect()
}

/// The router events the capture lists, as `kv_router` prints them, without ids.
pub(crate) fn captured_router_events(capture: &Value) -> Vec<Value> {
    // From the capture's hand-written `decoded` section, not our decoder.
    support::dynamo_capture_events(capture)
        .into_iter()
        .map(|ev| {
            let mut v = serde_json::to_value(&ev).unwrap();
            v["event"]["id"] = Value::Null;
            v
        })
        .collect()
}

/// The whole path next to Dynamo, as processes: an engine → `kv_relay --wire dynamo`
/// registered in etcd with Dynamo's records → `kv_router --dynamo` following those
/// records. The router prints exactly the router events the captured Dynamo worker
/// published for the same engine batches (ids apart), and sees the worker stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_relay_dynamo_feeds_kv_router_dynamo_through_etcd() {
    let capture = capture();
    let server = EtcdServer::start().await;
    let url = server.url();
    let (mut engine, relay, relay_ep) = spawn_kv_relay_dynamo(&url, "e2e").await;

    // Dynamo's two records, under the relay's lease, naming worker 77 and its endpoint.
    let channels = get_prefix(&server, "v1/event_channels/");
    let sources = get_prefix(&server, "v1/event_sources/");
    assert_eq!(
        (channels.len(), sources.len()),
        (1, 1),
        "{channels:?} {sources:?}"
    );
    assert!(channels[0].0.starts_with(
        "v1/event_channels/namespace/e2e/component/kvworker/endpoint/generate/topic/kv-events/"
    ));
    let channel: Value = serde_json::from_str(&channels[0].1).unwrap();
    assert_eq!(
        channel["transport"]["config"]["endpoint"],
        relay_ep.as_str()
    );
    let source: Value = serde_json::from_str(&sources[0].1).unwrap();
    assert_eq!(
        source["metadata"]["worker"],
        serde_json::json!({"worker_id": 77, "dp_rank": 0})
    );

    let (router, mut out, mut err_rx) = spawn_kv_router_dynamo(&url, "e2e");

    // Until the router's subscription reaches the relay, warm-up clears; they come out
    // as router events we skip.
    let first = engine
        .warm_up(async |wait| {
            tokio::time::timeout(wait, out.next_line())
                .await
                .ok()
                .map(|l| l.unwrap().unwrap())
        })
        .await;
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["event"]["dp_rank"], WARM_RANK);
    for batch in engine_batches(&capture) {
        engine.send(batch);
    }
    let want = captured_router_events(&capture);
    let mut got = Vec::new();
    let mut ids = Vec::new();
    let mut warm_seen = 1u64;
    while got.len() < want.len() {
        let line = within(out.next_line())
            .await
            .unwrap()
            .expect("router exited");
        let mut v: Value = serde_json::from_str(&line).unwrap();
        if v["event"]["dp_rank"] == WARM_RANK {
            warm_seen += 1;
            continue;
        }
        ids.push(v["event"]["id"].as_u64().unwrap());
        v["event"]["id"] = Value::Null;
        got.push(v);
    }
    assert_eq!(got, want);
    // Dense ids, as Dynamo's are.
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");

    // The capture ends with a clear, which empties every tier of worker 77 (as in
    // Dynamo's router); one block stored after it is what the index holds.
    engine.send(
        encode_engine_batch(
            0.0,
            WARM_RANK,
            4,
            &[EngineEvent::Stored {
                block_hashes: vec![0x5dff],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                medium: None,
            }],
        )
        .unwrap(),
    );
    let line = within(out.next_line()).await.unwrap().unwrap();
    assert!(line.contains(&0x5dff.to_string()), "{line}");
    warm_seen += 1;

    // The worker stops: its records leave etcd and the router forgets its blocks.
    let relay_stats = support::terminate_for_stats(relay).await;
    assert_eq!(relay_stats["wire"], "dynamo");
    assert_eq!(relay_stats["publisher"]["dropped"], 0, "{relay_stats}");
    assert!(get_prefix(&server, "v1/").is_empty());
    loop {
        let line = within(err_rx.recv()).await.expect("router stderr closed");
        if line.contains("left: forgot") {
            assert!(line.contains("left: forgot 1 blocks"), "{line}");
            break;
        }
    }
    let stats = terminate_reading(router, err_rx).await;
    assert_eq!(stats["wire"], "dynamo");
    assert_eq!(stats["publishers"], 0);
    assert_eq!(stats["index_blocks"], 0);
    assert_eq!(
        stats["router_events"].as_u64().unwrap(),
        warm_seen + want.len() as u64
    );
    for reason in [
        "frames", "header", "length", "envelope", "identity", "payload",
    ] {
        assert_eq!(stats["decode_errors"][reason], 0, "{reason}: {stats}");
    }
}

/// SIGTERM, then the JSON stats on the last stderr line (read through `lines`).
pub(crate) async fn terminate_reading(
    mut child: tokio::process::Child,
    mut lines: tokio::sync::mpsc::Receiver<String>,
) -> Value {
    let pid = child.id().unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = within(child.wait()).await.unwrap();
    assert_eq!(status.code(), Some(0));
    let mut last = String::new();
    while let Some(line) = within(lines.recv()).await {
        last = line;
    }
    serde_json::from_str(&last).unwrap_or_else(|e| panic!("no stats line ({e}): {last}"))
}

/// `kv_router --etcd URL --dynamo --namespace NS --component kvworker --topic
/// kv-events`: the child, its stdout lines, and its stderr lines forwarded to a channel
/// (read by `terminate_reading`).
pub(crate) fn spawn_kv_router_dynamo(
    url: &str,
    namespace: &str,
) -> (
    tokio::process::Child,
    tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    tokio::sync::mpsc::Receiver<String>,
) {
    spawn_kv_router(&["--etcd", url, "--dynamo", "--namespace", namespace], &[])
}

/// `kv_router` with `args` (and `--component kvworker --topic kv-events`) and `env`;
/// its stdout lines, and its stderr lines through a channel.
pub(crate) fn spawn_kv_router(
    args: &[&str],
    env: &[(&str, &str)],
) -> (
    tokio::process::Child,
    tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    tokio::sync::mpsc::Receiver<String>,
) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut router = tokio::process::Command::new(support::example("kv-router"))
        // The test's publishers and workers are on loopback.
        .args(["--allow-cidr", "127.0.0.0/8"])
        .args(args)
        .args(["--component", "kvworker", "--topic", "kv-events"])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = BufReader::new(router.stdout.take().unwrap()).lines();
    let (err_tx, err_rx) = tokio::sync::mpsc::channel::<String>(64);
    let mut err_lines = BufReader::new(router.stderr.take().unwrap()).lines();
    // EVENTPLANE_TEST_ECHO_STDERR=1 echoes its stderr (debugging a test).
    let echo = std::env::var_os("EVENTPLANE_TEST_ECHO_STDERR").is_some();
    tokio::spawn(async move {
        while let Ok(Some(line)) = err_lines.next_line().await {
            if echo {
                eprintln!("[kv-router] {line}");
            }
            if err_tx.send(line).await.is_err() {
                break;
            }
        }
    });
    (router, out, err_rx)
}

/// A test engine and `kv_relay --wire dynamo` (worker 77, block size 4) relaying it,
/// registered in etcd under `namespace/kvworker`, subscribed to the engine; returns
/// the engine, the relay and the endpoint it publishes on.
pub(crate) async fn spawn_kv_relay_dynamo(
    url: &str,
    namespace: &str,
) -> (support::Engine, tokio::process::Child, String) {
    let engine = support::Engine::bind("kv").await;
    let engine_ep = engine.endpoint();
    let (relay, relay_ep) =
        support::spawn_kv_relay(&engine_ep, "kv", 77, "dynamo", url, namespace, "kvworker").await;
    within(engine.socket.wait_for_subscribers(1)).await;
    (engine, relay, relay_ep)
}
