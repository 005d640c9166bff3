//! The `kv_router` example as a user runs it (its exit codes, its output and stats),
//! fed by `kv_relay` processes over real sockets, in both wires. The etcd paths are in
//! `tests/dynamo_etcd/suite.rs`.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use eventplane::wire::Dialect;
use std::process::Stdio;
use std::time::Duration;

use eventplane::kv::{
    RouterEvent,
    engine::{EngineEvent, encode_engine_batch},
};
use serde_json::Value;
use support::{Engine, WARM_RANK, example, within};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

async fn run(args: &[&str]) -> std::process::Output {
    within(Command::new(example("kv-router")).args(args).output())
        .await
        .unwrap()
}

fn last_json(stderr: &[u8]) -> Value {
    let text = String::from_utf8_lossy(stderr);
    serde_json::from_str(text.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("no stats line ({e}): {text}"))
}

#[tokio::test]
async fn bad_arguments_exit_2() {
    for args in [
        // No source.
        &["--namespace", "ns", "--topic", "t"][..],
        // --dynamo needs --etcd.
        &[
            "--static",
            "tcp://127.0.0.1:1",
            "--dynamo",
            "--namespace",
            "ns",
            "--topic",
            "t",
        ],
        // --wire is for static publishers; --dynamo already says the wire.
        &[
            "--etcd",
            "http://127.0.0.1:1",
            "--dynamo",
            "--wire",
            "dynamo",
            "--namespace",
            "ns",
            "--topic",
            "t",
        ],
        &[
            "--static",
            "tcp://127.0.0.1:1",
            "--wire",
            "zmq",
            "--namespace",
            "ns",
            "--topic",
            "t",
        ],
        // --endpoint is Dynamo's.
        &[
            "--static",
            "tcp://127.0.0.1:1",
            "--endpoint",
            "e",
            "--namespace",
            "ns",
            "--topic",
            "t",
        ],
        // An etcd endpoint the backend refuses is an argument, not an outage.
        &["--etcd", " ", "--namespace", "ns", "--topic", "t"],
    ] {
        let out = run(args).await;
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test]
async fn unreachable_discovery_exits_3_and_silence_exits_1() {
    let (_held, port) = support::refusing_port();
    let etcd = format!("http://127.0.0.1:{port}");
    let out = run(&[
        "--etcd",
        &etcd,
        "--dynamo",
        "--namespace",
        "ns",
        "--topic",
        "t",
    ])
    .await;
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach discovery"));

    // The worker side too: kv_relay cannot register.
    let out = within(
        Command::new(example("kv-relay"))
            .args([
                "--connect",
                "tcp://127.0.0.1:1",
                "--topic",
                "kv",
                "--block-size",
                "4",
            ])
            .args([
                "--worker-id",
                "1",
                "--bind",
                "tcp://127.0.0.1:0",
                "--wire",
                "dynamo",
            ])
            .args(["--etcd", &etcd, "--namespace", "ns", "--component", "c"])
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach discovery"));

    // --count 0: nothing to wait for.
    let publisher = format!("tcp://127.0.0.1:{port}");
    let out = run(&[
        "--static",
        &publisher,
        "--namespace",
        "ns",
        "--topic",
        "t",
        "--count",
        "0",
    ])
    .await;
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(last_json(&out.stderr)["router_events"], 0);

    // kv_relay: a Dynamo endpoint without Dynamo's wire, a zero block size.
    for extra in [
        &["--endpoint", "e"][..],
        &["--wire", "dynamo", "--block-size", "0"],
    ] {
        let out = within(
            Command::new(example("kv-relay"))
                .args([
                    "--connect",
                    "tcp://127.0.0.1:1",
                    "--topic",
                    "kv",
                    "--block-size",
                    "4",
                ])
                .args(["--worker-id", "1", "--bind", "tcp://127.0.0.1:0"])
                .args(["--etcd", &etcd, "--namespace", "ns", "--component", "c"])
                .args(extra)
                .output(),
        )
        .await
        .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // A static publisher that never answers: the run times out (exit 1) and still
    // reports its stats.
    let out = run(&[
        "--static",
        &publisher,
        "--namespace",
        "ns",
        "--topic",
        "t",
        "--timeout-ms",
        "300",
    ])
    .await;
    assert_eq!(out.status.code(), Some(1));
    let stats = last_json(&out.stderr);
    assert_eq!(stats["router_events"], 0);
    assert!(
        stats["subscriber"]["total"]["connect_failures"]
            .as_u64()
            .unwrap()
            > 0,
        "{stats}"
    );
}

/// A relay process on `wire`, its engine and its endpoint.
async fn relay(wire: &str) -> (Engine, Child, String) {
    let engine = Engine::bind("kv").await;
    let (child, endpoint) = support::spawn_example(
        "kv-relay",
        &[
            "--connect",
            &engine.endpoint(),
            "--topic",
            "kv",
            "--block-size",
            "4",
            "--worker-id",
            "11",
            "--bind",
            "tcp://127.0.0.1:0",
            "--wire",
            wire,
        ],
        true,
    )
    .await;
    within(engine.socket.wait_for_subscribers(1)).await;
    (engine, child, endpoint.unwrap())
}

/// `kv_relay --wire W` → `kv_router --static EP --wire W`, for both wires: the router
/// prints exactly the router events the sans-IO pipeline makes of the fixtures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_reads_kv_relay_in_both_wires() {
    let expected = support::expected_router_events(&support::kv_fixture_files(), 11, 4);
    for wire in ["eventplane", "dynamo"] {
        let (mut engine, relay, endpoint) = relay(wire).await;
        let mut router = Command::new(example("kv-router"))
            .args([
                "--static",
                &endpoint,
                "--wire",
                wire,
                "--namespace",
                "ns",
                "--topic",
                "kv-events",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(router.stdout.take().unwrap()).lines();
        engine
            .warm_up(async |wait| {
                tokio::time::timeout(wait, lines.next_line())
                    .await
                    .ok()
                    .map(|l| l.unwrap().unwrap())
            })
            .await;
        for f in support::kv_fixture_files() {
            engine.send(std::fs::read(f).unwrap());
        }
        let mut got = Vec::new();
        while got.len() < expected.len() {
            let line = within(lines.next_line())
                .await
                .unwrap()
                .expect("router exited");
            let ev: RouterEvent = serde_json::from_str(&line).unwrap();
            if ev.event.dp_rank != WARM_RANK {
                got.push(ev);
            }
        }
        let first = got[0].event.id;
        for (g, e) in got.iter_mut().zip(&expected) {
            g.event.id = g.event.id - first + 1;
            assert_eq!(g, e, "{wire}");
        }
        let stats = support::terminate_for_stats(router).await;
        assert_eq!(stats["wire"], wire);
        assert_eq!(
            stats["subscriber"]["total"]["dropped_malformed"], 0,
            "{stats}"
        );
        assert_eq!(stats["decode_errors"]["payload"], 0, "{stats}");
        let relay_stats = support::terminate_for_stats(relay).await;
        assert_eq!(relay_stats["wire"], wire);
    }
}

/// A router told the wrong wire does not guess: our layout reads a Dynamo publisher's
/// frames, but their payload is an envelope, not router events — each is counted as a
/// payload decode error, none is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_wire_is_counted_not_guessed() {
    let (mut engine, relay, endpoint) = relay("dynamo").await;
    let mut router = Command::new(example("kv-router"))
        .args(["--static", &endpoint, "--wire", "eventplane"])
        .args(["--namespace", "ns", "--topic", "kv-events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(router.stderr.take().unwrap()).lines();
    // Keep sending until the router has connected and counted one (it says so once).
    let clear = encode_engine_batch(0.0, WARM_RANK, 4, &[EngineEvent::Cleared]).unwrap();
    tokio::time::timeout(support::DEADLINE, async {
        loop {
            engine.send(clear.clone());
            tokio::select! {
                line = stderr.next_line() => {
                    let line = line.unwrap().expect("the router exited");
                    if line.contains("undecodable payload") {
                        return;
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await
    .expect("no undecodable payload reported within the deadline");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &router.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut last = String::new();
    while let Some(line) = within(stderr.next_line()).await.unwrap() {
        last = line;
    }
    let out = within(router.wait_with_output()).await.unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stdout.is_empty());
    let stats = last_json(last.as_bytes());
    assert!(
        stats["decode_errors"]["payload"].as_u64().unwrap() > 0,
        "{stats}"
    );
    assert_eq!(stats["router_events"], 0);
    support::terminate_for_stats(relay).await;
}

/// A router-event payload: worker 7, rank 0, event `id` storing `hashes`.
fn stored(id: u64, hashes: &[u64]) -> Vec<u8> {
    use eventplane::kv::{
        BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash, WorkerId,
    };
    let blocks = hashes
        .iter()
        .map(|&h| StoredBlock {
            block_hash: BlockHash(h),
            tokens_hash: TokensHash(h),
        })
        .collect();
    let data = KvEventData::Stored {
        parent_hash: None,
        blocks,
    };
    Dialect::EventPlane
        .encode_router_events(&[RouterEvent {
            worker_id: WorkerId(7),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: 0,
                data,
            },
        }])
        .unwrap()
}

/// A publisher of our wire bound at `endpoint`, registered nowhere. Rebinding the
/// endpoint of a publisher just shut down may briefly find it in use (its listener
/// is closed by its task): retried for up to a few seconds.
async fn static_publisher(endpoint: &str) -> eventplane::publish::EventPublisher {
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match eventplane::publish::EventPublisher::bind_unregistered(
            endpoint,
            "kv-events",
            eventplane::zmtp::Config::default(),
        )
        .await
        {
            Ok(p) => return p,
            Err(e)
                if tokio::time::Instant::now() < until
                    && format!("{e:?}").contains("AddrInUse") =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot bind {endpoint}: {e:?}"),
        }
    }
}

/// `kv_router --static ENDPOINT --dump-index` on topic `kv-events`.
fn router_of(endpoint: &str) -> support::Watched {
    support::Watched::spawn(
        "kv-router",
        &[
            "--static",
            endpoint,
            "--namespace",
            "ns",
            "--topic",
            "kv-events",
            "--dump-index",
        ],
    )
}

/// Event ids are dense per publisher: an event whose id skips (events lost between the
/// worker's processor and the router) makes `kv_router` forget that publisher's
/// blocks before applying it, as Dynamo's router does: no ghost survives the loss.
#[tokio::test]
async fn an_event_id_gap_forgets_the_publishers_blocks_first() {
    let publisher = static_publisher("tcp://127.0.0.1:0").await;
    let mut router = router_of(publisher.local_endpoint().unwrap());
    within(publisher.wait_for_subscribers(1)).await;
    // Ids 1, 2, then 4: event 3 never came (the message sequence has no gap: the
    // loss was before the publisher, where only the ids show it).
    for (id, hashes) in [(1, &[1, 2][..]), (2, &[3]), (4, &[5])] {
        publisher.publish(stored(id, hashes));
        router.line().await;
    }
    let said = router.stderr_until("lost events").await;
    assert!(said.contains("(id 4 after 2): forgot 3 blocks"), "{said}");
    let stats = router.terminate().await;
    assert_eq!(stats["lost_views"], 1, "{stats}");
    assert_eq!(stats["subscriber"]["total"]["gaps"], 0, "{stats}");
    assert_eq!(
        stats["index"],
        serde_json::json!([{"worker_id": 7, "dp_rank": 0, "tier": "device", "block_hashes": [5]}]),
        "{stats}"
    );
}

/// A publisher that reconnects (here: restarted behind the same static endpoint) may
/// have sent while disconnected, a clear perhaps: `kv_router` forgets what it held of
/// it at the reconnection, not at its next event, which may be minutes away.
#[tokio::test]
async fn a_reconnection_forgets_the_publishers_blocks_at_once() {
    // Restarted on the same endpoint below.
    let first = static_publisher(&support::restartable_endpoint()).await;
    let endpoint = first.local_endpoint().unwrap().to_owned();
    let mut router = router_of(&endpoint);
    within(first.wait_for_subscribers(1)).await;
    first.publish(stored(1, &[1]));
    router.line().await;
    first.shutdown().await;
    // Back on the same endpoint, silent.
    let second = static_publisher(&endpoint).await;
    within(second.wait_for_subscribers(1)).await;
    let said = router.stderr_until("reconnected").await;
    assert!(said.contains("forgot 1 blocks"), "{said}");
    let stats = router.terminate().await;
    assert_eq!(stats["index"], serde_json::json!([]), "{stats}");
    assert_eq!(stats["lost_views"], 1, "{stats}");
}

/// The index is bounded per publisher (`--max-index-blocks`): stored blocks past the
/// cap are not indexed and are counted; a removal makes room again.
#[tokio::test]
async fn the_index_holds_at_most_its_cap_of_blocks_per_publisher() {
    use eventplane::kv::{BlockHash, KvEvent, KvEventData, StorageTier, WorkerId};
    let publisher = static_publisher("tcp://127.0.0.1:0").await;
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let mut router = support::Watched::spawn(
        "kv-router",
        &[
            "--static",
            &endpoint,
            "--namespace",
            "ns",
            "--topic",
            "kv-events",
            "--max-index-blocks",
            "3",
            "--dump-index",
        ],
    );
    within(publisher.wait_for_subscribers(1)).await;
    publisher.publish(stored(1, &[1, 2]));
    router.line().await;
    // Two more: one fits, one does not; a block already held costs nothing.
    publisher.publish(stored(2, &[2, 3, 4]));
    router.line().await;
    let removed = Dialect::EventPlane
        .encode_router_events(&[RouterEvent {
            worker_id: WorkerId(7),
            tier: StorageTier::Device,
            event: KvEvent {
                id: 3,
                dp_rank: 0,
                data: KvEventData::Removed {
                    block_hashes: vec![BlockHash(1)],
                },
            },
        }])
        .unwrap();
    publisher.publish(removed);
    router.line().await;
    publisher.publish(stored(4, &[5]));
    router.line().await;
    let stats = router.terminate().await;
    assert_eq!(stats["index_blocks"], 3, "{stats}");
    assert_eq!(stats["index_refused"], 1, "{stats}");
    assert_eq!(
        stats["index"],
        serde_json::json!([{"worker_id": 7, "dp_rank": 0, "tier": "device", "block_hashes": [2, 3, 5]}]),
        "{stats}"
    );
}

/// `kv-relay --admin-listen`: `/readyz` is 503 until the engine is connected, 200
/// while it is, 503 again once it is gone; `/metrics` counts what the relay decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_relay_is_ready_while_its_engine_is_connected() {
    use support::admin::{admin_address, get, metric, until};
    // An endpoint nothing listens on yet, that an engine binds later.
    let engine_ep = support::restartable_endpoint();
    let mut relay = Command::new(example("kv-relay"))
        .args([
            "--connect",
            &engine_ep,
            "--topic",
            "kv",
            "--block-size",
            "4",
        ])
        .args(["--worker-id", "11", "--bind", "tcp://127.0.0.1:0"])
        .args(["--admin-listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(relay.stderr.take().unwrap()).lines();
    let admin = admin_address(&mut lines).await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let (status, reason) = get(&admin, "/readyz").await;
    assert_eq!(
        (status, reason.as_str()),
        (503, "not ready: no connection to the engine\n")
    );
    assert_eq!(get(&admin, "/livez").await.0, 200);
    let mut engine = Engine::bind_at(&engine_ep, "kv").await;
    until(&admin, "/readyz", |status, _| status == 200).await;
    within(engine.socket.wait_for_subscribers(1)).await;
    engine.send(encode_engine_batch(0.0, 0, 4, &[EngineEvent::Cleared]).unwrap());
    until(&admin, "/metrics", |_, text| {
        metric(text, "eventplane_kv_decoder_batches_total") == Some(1.0)
            && metric(text, "eventplane_kv_listener_connected") == Some(1.0)
    })
    .await;
    drop(engine);
    until(&admin, "/readyz", |status, _| status == 503).await;
}

/// One HTTP/1.1 request to `addr` (a fresh connection); the status and body.
async fn http(addr: &str, request: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = within(tokio::net::TcpStream::connect(addr)).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    within(stream.read_to_end(&mut answer)).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

/// `kv-router --static ENDPOINTS… --serve 127.0.0.1:0` (plus `extra`), and the
/// address its scoring service listens on.
async fn scoring_router(endpoints: &[&str], extra: &[&str]) -> (support::Watched, String) {
    let mut args = vec!["--static"];
    args.extend_from_slice(endpoints);
    args.extend_from_slice(&["--namespace", "ns", "--topic", "kv-events"]);
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--serve", "127.0.0.1:0"]);
    let mut router = support::Watched::spawn("kv-router", &args);
    let said = router.stderr_until("scores on http://").await;
    let addr = said
        .split("http://")
        .nth(1)
        .and_then(|s| s.split('/').next())
        .unwrap()
        .to_owned();
    (router, addr)
}

fn post_scores(body: &str) -> Vec<u8> {
    format!(
        "POST /v1/scores HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// engine → `kv-relay` → `kv-router --serve`: `/v1/scores` names the worker holding
/// a request's prefix and how many of its blocks, from tokens or from local hashes;
/// bad requests get a 4xx and the router goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scoring_service_scores_a_request_through_the_processes() {
    use eventplane::kv::router::local_block_hashes;
    let (mut engine, relay, endpoint) = relay("eventplane").await;
    let (mut router, addr) = scoring_router(&[&endpoint], &[]).await;
    engine
        .warm_up(async |wait| tokio::time::timeout(wait, router.line()).await.ok())
        .await;
    // The engine stores a 3-block prompt (block size 4), on rank 0.
    let stored = EngineEvent::Stored {
        block_hashes: vec![101, 102, 103],
        parent_block_hash: None,
        token_ids: (0..12).collect(),
        medium: None,
    };
    engine.send(encode_engine_batch(0.0, 0, 4, &[stored]).unwrap());
    while !router.line().await.contains("\"stored\"") {}

    // A request sharing those 3 blocks, and one more.
    let (status, body) = http(
        &addr,
        &post_scores(r#"{"tokens": [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15], "block_size": 4}"#),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let scores: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        scores,
        serde_json::json!({"scores": [{"worker_id": 11, "dp_rank": 0, "blocks": 3}]})
    );
    // The same by local hashes: the first two blocks.
    let tokens: Vec<u32> = (0..8).collect();
    let hashes: Vec<u64> = local_block_hashes(&tokens, 4).iter().map(|h| h.0).collect();
    let (status, body) = http(
        &addr,
        &post_scores(&serde_json::json!({"local_hashes": hashes}).to_string()),
    )
    .await;
    assert_eq!(
        (status, body.trim()),
        (
            200,
            r#"{"scores":[{"blocks":2,"dp_rank":0,"worker_id":11}]}"#
        )
    );
    // Another prompt: nobody holds it.
    let (status, body) = http(
        &addr,
        &post_scores(r#"{"tokens": [9,9,9,9], "block_size": 4}"#),
    )
    .await;
    assert_eq!((status, body.trim()), (200, r#"{"scores":[]}"#));

    // Bad requests: malformed, both kinds at once, a zero block size, an oversized
    // body (refused on its Content-Length), another path, another method.
    let oversized = b"POST /v1/scores HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\nConnection: close\r\n\r\n{";
    for (request, want) in [
        (post_scores("{not json"), 400),
        (
            post_scores(r#"{"local_hashes": [1], "tokens": [1], "block_size": 1}"#),
            400,
        ),
        (post_scores(r#"{"tokens": [1], "block_size": 0}"#), 400),
        (post_scores(r#"{"local_hashes": [-1]}"#), 400),
        (oversized.to_vec(), 413),
        (
            b"POST /v2/x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                .to_vec(),
            404,
        ),
        (
            b"GET /v1/scores HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            405,
        ),
    ] {
        let (status, body) = http(&addr, &request).await;
        assert_eq!(
            status,
            want,
            "{}: {body}",
            String::from_utf8_lossy(&request)
        );
        assert!(body.contains("\"error\""), "{body}");
    }
    // Clients that send their headers and then stall hold a connection each, not
    // the scorer: a request behind them is answered at once, not after their body
    // timeout (10 s).
    let mut stalled = Vec::new();
    for _ in 0..12 {
        use tokio::io::AsyncWriteExt;
        let mut s = within(tokio::net::TcpStream::connect(&addr)).await.unwrap();
        s.write_all(b"POST /v1/scores HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{")
            .await
            .unwrap();
        stalled.push(s);
    }
    // Let the router take them in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let (status, _) = http(
        &addr,
        &post_scores(r#"{"tokens": [0,1,2,3], "block_size": 4}"#),
    )
    .await;
    assert_eq!(status, 200);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
    // Their bodies end ({}: neither kind of request), each refused.
    for mut s in stalled {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"}").await.unwrap();
        let mut answer = Vec::new();
        within(s.read_to_end(&mut answer)).await.unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 400"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }

    let stats = router.terminate().await;
    assert_eq!(stats["serve"]["scored"], 4, "{stats}");
    assert_eq!(stats["serve"]["refused"], 7 + 12, "{stats}");
    assert_eq!(stats["index_stats"]["blocks"], 3, "{stats}");
    support::terminate_for_stats(relay).await;
}

/// One message of router events.
fn message(events: &[RouterEvent]) -> Vec<u8> {
    Dialect::EventPlane.encode_router_events(events).unwrap()
}

fn router_event(worker: u64, rank: u32, id: u64, data: eventplane::kv::KvEventData) -> RouterEvent {
    use eventplane::kv::{KvEvent, StorageTier, WorkerId};
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: rank,
            data,
        },
    }
}

/// What hostile publishers send a real `kv-router --serve` costs what each event's
/// own size says: floods of empty stores and of removes of unknown hashes create
/// nothing, a storm of `cleared` events does not stall a concurrent `/v1/scores`,
/// and the process's peak memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_events_cost_their_own_size_in_a_real_router() {
    use eventplane::kv::{BlockHash, KvEventData, StoredBlock, TokensHash};
    let honest = static_publisher("tcp://127.0.0.1:0").await;
    let hostile = static_publisher("tcp://127.0.0.1:0").await;
    let (router, addr) = scoring_router(
        &[
            honest.local_endpoint().unwrap(),
            hostile.local_endpoint().unwrap(),
        ],
        &["--format", "quiet"],
    )
    .await;
    within(honest.wait_for_subscribers(1)).await;
    within(hostile.wait_for_subscribers(1)).await;
    let pid = router.child.id().unwrap();
    let baseline = support::reset_peak_rss(pid);

    // The honest worker 7 holds a chain of 1,000 blocks.
    let chain: Vec<StoredBlock> = (0..1000)
        .map(|i| StoredBlock {
            block_hash: BlockHash(1_000_000 + i),
            tokens_hash: TokensHash(5_000 + i),
        })
        .collect();
    honest.publish(message(&[router_event(
        7,
        0,
        1,
        KvEventData::Stored {
            parent_hash: None,
            blocks: chain,
        },
    )]));
    let query = post_scores(
        &serde_json::json!({"local_hashes": (5_000..6_000).collect::<Vec<u64>>()}).to_string(),
    );
    within(async {
        loop {
            let (status, body) = http(&addr, &query).await;
            assert_eq!(status, 200, "{body}");
            if body.contains("\"blocks\":1000") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // The hostile publisher: empty stores for 20,000 workers, removes of 1,000,000
    // hashes nobody holds, then 200,000 `cleared` events, all in ~1 MiB messages;
    // the scores are asked for all along.
    let mut id = 0;
    let mut next = || {
        id += 1;
        id
    };
    let mut messages = Vec::new();
    for chunk in (10..20_010u64).collect::<Vec<_>>().chunks(5_000) {
        let events: Vec<RouterEvent> = chunk
            .iter()
            .map(|&w| {
                router_event(
                    w,
                    0,
                    next(),
                    KvEventData::Stored {
                        parent_hash: None,
                        blocks: vec![],
                    },
                )
            })
            .collect();
        messages.push(message(&events));
    }
    for i in 0..10u64 {
        let hashes = (0..100_000).map(|h| BlockHash(i << 32 | h)).collect();
        messages.push(message(&[router_event(
            8,
            0,
            next(),
            KvEventData::Removed {
                block_hashes: hashes,
            },
        )]));
    }
    for _ in 0..8 {
        let events: Vec<RouterEvent> = (0..25_000)
            .map(|r| router_event(8, r % 4, next(), KvEventData::Cleared))
            .collect();
        messages.push(message(&events));
    }
    let total_events = id;
    let asking = tokio::spawn({
        let (addr, query) = (addr.clone(), query.clone());
        async move {
            let mut worst = Duration::ZERO;
            let started = std::time::Instant::now();
            while started.elapsed() < Duration::from_secs(3) {
                let ((status, body), took) = support::timed(http(&addr, &query)).await;
                assert_eq!(status, 200);
                assert!(body.contains("\"blocks\":1000"), "{body}");
                worst = worst.max(took);
            }
            worst
        }
    });
    for m in messages {
        hostile.publish(m);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let worst = asking.await.unwrap();
    // Not a speed check: a router that held its index for the storm's length would
    // answer nothing for seconds.
    println!("worst /v1/scores while the storm ran: {worst:?}");
    assert!(worst < Duration::from_secs(2), "a query waited {worst:?}");

    let peak = support::proc_status_bytes(pid, "VmHWM").saturating_sub(baseline);
    let stats = router.terminate().await;
    println!(
        "peak RSS growth {} KiB over {total_events} hostile events",
        peak >> 10
    );
    let index = &stats["index_stats"];
    // Only the honest chain is held: the hostile events created no rank, no node.
    assert_eq!(
        (
            index["blocks"].as_u64(),
            index["ranks"].as_u64(),
            index["nodes"].as_u64()
        ),
        (Some(1000), Some(1), Some(1000)),
        "{stats}"
    );
    // They reached the index (lanes may drop some of them under load, counted).
    assert!(stats["router_events"].as_u64().unwrap() > 1000, "{stats}");
    // Bounded by the subscriber's buffers (64 MiB) and the index, not by what was sent.
    assert!(peak < 128 << 20, "peak RSS grew {} MiB", peak >> 20);
}
