//! The worker we ship and the routers we teach, as a user runs them: a real ZMQ engine
//! (`examples/engine.py`, libzmq through pyzmq) → `kv_relay --etcd` → the guide's
//! router (`guide_router`, compiled from the guide's own text) and `kv_router`, over a
//! real etcd. Every delivery names its worker, and loss before the worker (a dropped
//! engine batch, an engine crash and restart) leaves no ghost in either router. The
//! same story on Dynamo's wire, against Dynamo 1.6.1's own router, is in
//! `tests/dynamo_etcd/live.rs`. Needs `--features etcd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

#[cfg(feature = "etcd")]
mod support;

#[cfg(feature = "etcd")]
mod with_etcd {

    use eventplane::wire::Dialect;
    use serde_json::{Value, json};
    use tokio::process::Child;

    use crate::support::etcd::EtcdServer;
    use crate::support::{EnginePy, Watched, restartable_endpoint, spawn_kv_relay, within};

    /// The blocks a router event line stores (empty for anything else).
    fn stored(line: &str) -> Vec<u64> {
        let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
        v["event"]["data"]["stored"]["blocks"]
            .as_array()
            .map(|b| b.iter().filter_map(|b| b["block_hash"].as_u64()).collect())
            .unwrap_or_default()
    }

    /// Worker 7's `kv_relay` (our wire) registered in etcd under `prod/worker`, in
    /// front of `engine`; returns it once it has subscribed to the engine (engine.py
    /// takes commands only then).
    async fn relay(url: &str, engine: &EnginePy) -> Child {
        let ep = &engine.endpoint;
        spawn_kv_relay(ep, "kv-events", 7, "eventplane", url, "prod", "worker")
            .await
            .0
    }

    /// The guide's router and `kv_router` follow `kv_relay` through etcd: the record
    /// carries the worker, every delivery is identified, and after a dropped batch, an
    /// engine crash and a new engine on the same endpoint both indexes hold exactly what
    /// the new engine stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_guides_router_and_kv_router_follow_kv_relay_through_an_engine_restart() {
        let server = EtcdServer::start().await;
        let url = server.url();
        // Restarted on the same endpoint below.
        let mut engine = EnginePy::spawn(&restartable_endpoint(), &[]).await;
        let port = engine.port();
        let relay = relay(&url, &engine).await;

        // The record is our public contract, with the worker in it.
        let listed = server.etcdctl(&["get", "--prefix", "/eventplane/v1/channels/prod/"]);
        let record: Value = listed
            .lines()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no record: {listed}"));
        assert_eq!(
            record["worker"],
            json!({"worker_id": 7, "dp_rank": 0}),
            "{record}"
        );

        let mut guide = Watched::spawn(
            "guide_router",
            &["--etcd", &url, "--namespace", "prod", "--until-block", "20"],
        );
        let mut router = Watched::spawn(
            "kv-router",
            &[
                "--allow-cidr",
                "127.0.0.0/8",
                "--etcd",
                &url,
                "--namespace",
                "prod",
                "--topic",
                "kv-events",
                "--dump-index",
            ],
        );
        guide.stderr_until("connected (1 connections)").await;
        // Until kv_router's subscription is through too: a marker block, re-sent.
        loop {
            engine.send("root 900").await;
            let got = tokio::time::timeout(std::time::Duration::from_millis(200), router.line());
            if got.await.is_ok_and(|l| stored(&l) == [900]) {
                break;
            }
        }

        // Engine A: a chain, a removal, a batch its PUB dropped, a new chain.
        for command in ["root 1 2", "store 3", "remove 3", "skip", "root 4"] {
            engine.send(command).await;
        }
        // Through to the router before the crash (a killed engine takes what it had
        // not written yet with it).
        let mut seen = Vec::new();
        let mut until = async |block: u64, seen: &mut Vec<String>| loop {
            let line = router.line().await;
            let blocks = stored(&line);
            seen.push(line);
            if blocks == [block] {
                break;
            }
        };
        until(4, &mut seen).await;
        // It crashes; engine B starts on the same endpoint, numbering from 0.
        engine.kill().await;
        let mut engine = EnginePy::spawn(&format!("tcp://127.0.0.1:{port}"), &[]).await;
        for command in ["root 10 11", "store 12", "remove 12", "root 20"] {
            engine.send(command).await;
        }
        // What engine B holds, and nothing else.
        let holds = json!([10, 11, 20]);
        until(20, &mut seen).await;
        let stats = router.terminate().await;
        assert_eq!(
            stats["index"],
            json!([{"worker_id": 7, "dp_rank": 0, "tier": "device", "block_hashes": holds}]),
            "{stats}"
        );
        assert_eq!(stats["unidentified_deliveries"], 0, "{stats}");
        let cleared = seen.iter().filter(|l| l.contains("\"cleared\"")).count();
        assert_eq!(
            cleared, 2,
            "one clear for the dropped batch, one for the crash: {seen:#?}"
        );
        assert_eq!(stats["subscriber"]["total"]["gaps"], 0, "{stats}");

        let line = guide.line().await;
        let status = within(guide.child.wait()).await.unwrap();
        assert_eq!(status.code(), Some(0), "{line}");
        let report: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            report["workers"],
            json!([{"worker_id": 7, "dp_rank": 0, "blocks": holds}]),
            "{report}"
        );
        assert!(report["deliveries"].as_u64().unwrap() >= 10, "{report}");
        assert_eq!(
            (
                &report["unidentified"],
                &report["undecodable"],
                &report["lost"]
            ),
            (&json!(0), &json!(0), &json!(0)),
            "{report}"
        );

        let relay_stats = crate::support::terminate_for_stats(relay).await;
        assert_eq!(relay_stats["listener"]["stale_clears"], 2, "{relay_stats}");
        assert_eq!(relay_stats["listener"]["seq_gaps"], 1, "{relay_stats}");
        assert_eq!(relay_stats["publisher"]["dropped"], 0, "{relay_stats}");
        engine.kill().await;
    }

    /// A worker registered by hand (another language, following the record contract)
    /// without `worker`: the router follows it, and says so on its own side — the
    /// subscriber's warning names the publisher, the stats count its deliveries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publisher_without_a_worker_identity_is_reported_by_the_router() {
        use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId};
        let server = EtcdServer::start().await;
        let url = server.url();
        let publisher = eventplane::publish::EventPublisher::bind_unregistered(
            "tcp://127.0.0.1:0",
            "kv-events",
            eventplane::zmtp::Config::default(),
        )
        .await
        .unwrap();
        let record = json!({
            "id": {"namespace": "prod", "component": "py", "topic": "kv-events",
                   "publisher_id": publisher.publisher_id()},
            "transport": {"kind": "zmq", "endpoint": publisher.local_endpoint().unwrap()},
        });
        let key = format!(
            "/eventplane/v1/channels/prod/py/kv-events/{:x}",
            publisher.publisher_id()
        );
        server.etcdctl(&["put", &key, &record.to_string()]);
        let mut router = Watched::spawn(
            "kv-router",
            &[
                "--allow-cidr",
                "127.0.0.0/8",
                "--etcd",
                &url,
                "--namespace",
                "prod",
                "--topic",
                "kv-events",
                "--count",
                "1",
            ],
        );
        within(publisher.wait_for_subscribers(1)).await;
        let event = KvEvent {
            id: 1,
            dp_rank: 0,
            data: KvEventData::Cleared,
        };
        publisher.publish(
            Dialect::EventPlane
                .encode_router_events(&[RouterEvent {
                    worker_id: WorkerId(9),
                    tier: StorageTier::Device,
                    event,
                }])
                .unwrap(),
        );
        let warning = router.stderr_until("registered no worker identity").await;
        assert!(warning.contains("prod/py/kv-events"), "{warning}");
        router.line().await;
        let (status, stats) = router.exit_stats().await;
        assert_eq!(status.code(), Some(0));
        assert_eq!(stats["unidentified_deliveries"], 1, "{stats}");
        assert_eq!(stats["subscriber"]["unidentified_publishers"], 1, "{stats}");
    }

    /// A record naming a loopback address (a tenant's, or a mistake): `kv-router`
    /// never dials it (refused, counted in `refused_by_filter`) unless `--allow-cidr`
    /// reopens loopback, and then it does (it used to dial whatever a record named,
    /// its own loopback included: a port scanner of its host).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kv_router_dials_no_loopback_a_record_names_unless_allowed() {
        let server = EtcdServer::start().await;
        let url = server.url();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let record = json!({
            "id": {"namespace": "prod", "component": "py", "topic": "kv-events",
                   "publisher_id": 0x77},
            "transport": {"kind": "zmq",
                          "endpoint": format!("tcp://{}", listener.local_addr().unwrap())},
        });
        server.etcdctl(&[
            "put",
            "/eventplane/v1/channels/prod/py/kv-events/77",
            &record.to_string(),
        ]);
        let follow = [
            "--etcd",
            &url,
            "--namespace",
            "prod",
            "--topic",
            "kv-events",
        ];
        let router = Watched::spawn("kv-router", &[&follow[..], &["--format", "quiet"]].concat());
        let dialled = tokio::time::timeout(std::time::Duration::from_secs(3), listener.accept());
        assert!(
            dialled.await.is_err(),
            "kv-router dialled a loopback address a record named"
        );
        let stats = router.terminate().await;
        assert!(
            stats["subscriber"]["total"]["refused_by_filter"]
                .as_u64()
                .unwrap()
                >= 1,
            "{stats}"
        );
        let allowed = [
            &follow[..],
            &["--format", "quiet", "--allow-cidr", "127.0.0.0/8"],
        ]
        .concat();
        let router = Watched::spawn("kv-router", &allowed);
        within(listener.accept()).await.unwrap();
        drop(router);
    }
}

#[cfg(not(feature = "etcd"))]
#[test]
#[ignore = "needs `--features etcd`: run `cargo test --all-features`"]
fn skipped_without_feature_etcd() {}
