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

use std::process::Stdio;
use std::time::Duration;

use eventplane::kv::{EngineEvent, RouterEvent, encode_engine_batch};
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
    let out = tokio::spawn(async move {
        run(&[
            "--static",
            &endpoint,
            "--wire",
            "eventplane",
            "--namespace",
            "ns",
            "--topic",
            "kv-events",
            "--timeout-ms",
            "1500",
        ])
        .await
    });
    // Keep sending until the router has had time to connect and count some.
    let clear = encode_engine_batch(0.0, WARM_RANK, 4, &[EngineEvent::Cleared]).unwrap();
    while !out.is_finished() {
        engine.send(clear.clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = out.await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let stats = last_json(&out.stderr);
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
        encode_router_events,
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
    encode_router_events(&[RouterEvent {
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
    let removed = eventplane::kv::encode_router_events(&[RouterEvent {
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
