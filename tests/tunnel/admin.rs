//! The services' admin endpoints through the built binaries (`--admin-listen`, the
//! broker's `admin_listen`): `/readyz` follows what each process waits for, `/metrics`
//! says what its stats say while traffic flows, and a flood of connections to the
//! admin port costs the process no memory beyond its connection cap.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use eventplane::wire::Dialect;
use std::process::Stdio;
use std::time::Duration;

use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, WorkerId};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

use crate::event_broker::{body, bus_address, config, router_with_bus};
use crate::support::admin::{admin_address, get, metric, until};
use crate::support::{example, proc_status_bytes, reset_peak_rss, within};

/// A broker whose Kubernetes discovery cannot give its first view yet answers 503 on
/// `/readyz`; once the view is complete and the bus welcomed it, 200; once the bus is
/// gone, 503 again. With events
/// flowing publisher → broker → `kv-router`, the broker's `/metrics` and the router's
/// say what their stats say: the bytes the broker relayed up are the bytes the
/// router's bus read, and the router's subscriber received every message.
#[tokio::test]
async fn readiness_follows_the_view_and_the_metrics_follow_the_traffic() {
    let api = crate::kube_api::KubeApi::start().await;
    let publisher = eventplane::publish::EventPublisher::unregistered("kv")
        .bind("tcp://127.0.0.1:0")
        .build()
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    crate::kube_broker::put_worker(&api, &endpoint, "kv");
    let dir = config("admin", "").parent().unwrap().to_owned();

    // The router: its bus, its subscriber following the publisher (through a broker:
    // "prod" is the broker credential's namespace), its admin endpoint.
    let mut router = router_with_bus(&dir)
        .args([
            "--static",
            &endpoint,
            "--namespace",
            "prod",
            "--topic",
            "kv",
        ])
        .args(["--format", "quiet", "--admin-listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut router_lines = BufReader::new(router.stderr.take().unwrap()).lines();
    let bus = bus_address(&mut router_lines).await;
    let router_admin = admin_address(&mut router_lines).await;
    let bus_port = bus.rsplit(':').next().unwrap();

    // The broker, its discovery held: the API server answers nothing yet.
    api.hold(true);
    let text = body(
        &format!("https://localhost:{bus_port}"),
        &dir,
        &["tcp://127.0.0.1:1"],
        "admin_listen = \"127.0.0.1:0\"",
    )
    .replace(
        "static_endpoints = [\"tcp://127.0.0.1:1\"]",
        "kubernetes = { namespaces = [\"dyn\"] }",
    );
    let path = config("admin", &text);
    let kubeconfig = api.kubeconfig(&dir, "dyn");
    let mut broker = Command::new(example("event-broker"))
        .arg("--config")
        .arg(&path)
        .env("KUBECONFIG", &kubeconfig)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut broker_lines = BufReader::new(broker.stderr.take().unwrap()).lines();
    let broker_admin = admin_address(&mut broker_lines).await;
    // Keep reading its log, so that it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = broker_lines.next_line().await {} });
    // (It reads discovery once before it starts its broker: held, that read waits.)
    let held = (
        503,
        "not ready: starting: discovery not reached yet\n".to_owned(),
    );
    assert_eq!(get(&broker_admin, "/readyz").await, held);
    // Held for a while: still not ready, still alive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(get(&broker_admin, "/readyz").await, held);
    assert_eq!(get(&broker_admin, "/livez").await, (200, "ok\n".to_owned()));
    api.hold(false);
    until(&broker_admin, "/readyz", |status, _| status == 200).await;

    // Traffic: events through the broker to the router.
    within(publisher.wait_for_subscribers(1)).await;
    const EVENTS: u64 = 200;
    for id in 1..=EVENTS {
        let event = RouterEvent {
            worker_id: WorkerId(7),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: 0,
                data: KvEventData::Cleared,
            },
        };
        publisher.publish(Dialect::EventPlane.encode_router_events(&[event]).unwrap());
    }
    // The router's metrics: every message received and delivered, bytes through the
    // tunnel; the broker's: the same bytes relayed up, one stream open.
    let received = "eventplane_subscriber_received_total";
    // (Both waited for: a sample may fall between a message's read and its delivery.)
    let delivered = "eventplane_subscriber_delivered_total";
    until(&router_admin, "/metrics", |_, text| {
        metric(text, received) == Some(EVENTS as f64)
            && metric(text, delivered) == Some(EVENTS as f64)
    })
    .await;
    // The bus's counters are sampled on a tick of their own (not the subscriber's):
    // the bytes the router's bus read, once they stopped growing, are the bytes the
    // broker relayed up.
    let (read, routed, relayed) = within(async {
        loop {
            let (_, routed) = get(&router_admin, "/metrics").await;
            let (_, relayed) = get(&broker_admin, "/metrics").await;
            let read = metric(&routed, "eventplane_bus_read_bytes_total").unwrap_or(0.0);
            let up = metric(&relayed, "eventplane_broker_up_bytes_total");
            if read > 0.0 && up == Some(read) {
                return (read, routed, relayed);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(read > 0.0);
    assert_eq!(
        metric(&relayed, "eventplane_broker_streams_open"),
        Some(1.0)
    );
    assert_eq!(metric(&relayed, "eventplane_broker_connected"), Some(1.0));
    assert!(relayed.contains("# HELP eventplane_broker_up_bytes_total"));
    assert_eq!(
        metric(&routed, "eventplane_subscriber_discovery_synced"),
        Some(1.0)
    );
    // No publisher's id, endpoint or namespace in any series.
    for text in [&routed, &relayed] {
        assert!(
            !text.contains("127.0.0.1") && !text.contains("prod") && !text.contains("\"42\""),
            "{text}"
        );
    }

    // What the router's stats say at exit is what its metrics said.
    let kill = |pid: u32| {
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap()
    };
    assert!(kill(router.id().unwrap()).success());
    let last = within(async {
        let mut last = String::new();
        while let Some(line) = router_lines.next_line().await.unwrap() {
            last = line;
        }
        last
    })
    .await;
    let stats: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(stats["subscriber"]["total"]["received"], EVENTS);
    assert_eq!(stats["bus"]["bytes_in"].as_f64(), Some(read));
    assert_eq!(within(router.wait()).await.unwrap().code(), Some(0));
    // Its view complete but the bus gone: not ready, and why.
    until(&broker_admin, "/readyz", |status, reason| {
        status == 503 && reason == "not ready: no session with the bus\n"
    })
    .await;
    assert!(kill(broker.id().unwrap()).success());
    within(broker.wait()).await.unwrap();
}

/// Thousands of connections to `kv-router`'s admin port, half sending half a request
/// head and waiting, half asking for `/metrics` 100 at a time: at most 8 are served at
/// once (a silent one makes room for a newcomer; one that finds all 8 answering is
/// closed), so the process's peak RSS grows by less than its slack, and a probe made
/// while the silent connections are open is answered.
#[tokio::test]
async fn a_flood_on_the_admin_port_costs_no_memory() {
    // A publisher that never answers: the router has nothing else to do.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", closed.local_addr().unwrap());
    let mut router = Command::new(example("kv-router"))
        .args(["--static", &endpoint, "--namespace", "ns", "--topic", "kv"])
        .args(["--format", "quiet", "--admin-listen", "127.0.0.1:0"])
        .env(
            crate::support::FIXED_MMAP_THRESHOLD.0,
            crate::support::FIXED_MMAP_THRESHOLD.1,
        )
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(router.stderr.take().unwrap()).lines();
    let admin = admin_address(&mut lines).await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    until(&admin, "/readyz", |status, _| status == 200).await;
    let pid = router.id().unwrap();
    // Warm: the first scrapes allocate what every later one reuses.
    for _ in 0..20 {
        assert_eq!(get(&admin, "/metrics").await.0, 200);
    }
    let before = reset_peak_rss(pid);
    let mut unanswered = 0u64;
    for _ in 0..20 {
        // 100 connections hold half a head each; 100 more ask for /metrics.
        let mut held = Vec::new();
        for _ in 0..100 {
            if let Ok(mut s) = tokio::net::TcpStream::connect(&admin).await {
                let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX-Pad: ").await;
                held.push(s);
            }
        }
        let asks = (0..100).map(|_| {
            let admin = admin.clone();
            tokio::spawn(async move {
                let Ok(mut s) = tokio::net::TcpStream::connect(&admin).await else {
                    return false;
                };
                let _ = s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await;
                let mut out = Vec::new();
                let _ = s.read_to_end(&mut out).await;
                out.is_empty()
            })
        });
        for ask in asks.collect::<Vec<_>>() {
            unanswered += u64::from(ask.await.unwrap());
        }
        // A probe, with the silent connections still open: it gets its answer.
        assert_eq!(get(&admin, "/readyz").await.0, 200, "a probe was kept out");
        drop(held);
    }
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    // Sampled every second: polled until the evictions show.
    let evicted = "eventplane_admin_evicted_connections_total";
    let text = until(&admin, "/metrics", |_, text| {
        metric(text, evicted).unwrap_or(0.0) > 0.0
    })
    .await;
    let evicted = metric(&text, evicted).unwrap_or(0.0);
    println!(
        "figure: kv-router admin port, 4,000 connections (2,000 holding half a head): \
         peak RSS +{} KiB, {unanswered} of 2,000 scrapes unanswered, {evicted} silent \
         connections closed to make room",
        grown / 1024
    );
    assert!(evicted > 0.0, "the connection cap was never reached");
    assert!(
        grown < crate::support::RSS_SLACK,
        "the admin flood grew kv-router by {grown} B"
    );
    // Still serving.
    until(&admin, "/livez", |status, _| status == 200).await;
}
