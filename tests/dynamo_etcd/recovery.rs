//! Dynamo 1.6.1's worker recovery, both ways, against the real thing:
//!
//! - Dynamo's own KV router follows `kv-relay --wire dynamo --recovery-bind` (in front
//!   of vLLM 0.34.0's own publisher) and repairs from it: a dump when it first sees the
//!   relay, holding what was stored before it started, and the lost events after a gap,
//!   keeping what it held: it ends as a second Dynamo router that lost nothing (one
//!   without the relay's `recovery_target` resets the worker there, and the oldest
//!   blocks vanish from its index).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::collections::HashSet;

use super::live::{Py, json_line};
use crate::support::engine_peer::EnginePeer;
use crate::support::etcd::EtcdServer;
use crate::support::{DEADLINE, Watched};

/// The relay's worker id (`EnginePeer::relay`).
const WORKER: u64 = 1;

/// `kv-relay --wire dynamo` in front of `engine`, registered in etcd under
/// `ns/kvworker` with a Dynamo KV query endpoint in `codec`, queueing `queue` messages
/// per router; returns it and the endpoint it registered.
async fn spawn_relay(
    engine: &EnginePeer,
    etcd: &str,
    ns: &str,
    codec: &str,
    queue: &str,
) -> (Watched, String) {
    let (mut relay, _) = engine
        .relay(&[
            "--wire",
            "dynamo",
            "--publisher-queue",
            queue,
            "--recovery-bind",
            "tcp://127.0.0.1:0",
            "--recovery-codec",
            codec,
            // The whole burst below: a gap within it is repaired with its events.
            "--recovery-events",
            "200000",
            "--recovery-event-blocks",
            "2000000",
            "--etcd",
            etcd,
            "--namespace",
            ns,
            "--component",
            "kvworker",
        ])
        .await;
    let line = relay.line().await;
    let endpoint = line.strip_prefix("recovery ").unwrap().to_owned();
    (relay, endpoint)
}

/// Dynamo's router on `ns/kvworker`, admitting the relay's worker.
async fn dynamos_router(etcd: &str, ns: &str) -> Py {
    let worker = WORKER.to_string();
    Py::spawn_with(
        "dynamo_router.py",
        &[
            "--etcd",
            etcd,
            "--namespace",
            ns,
            "--component",
            "kvworker",
            "--block-size",
            crate::support::engine_peer::BLOCK_SIZE,
            "--admit",
            &worker,
            "--no-index",
        ],
        // Dynamo warns for every store under a parent this engine evicted.
        &[("DYN_LOG", "error")],
    )
    .await
}

/// The block hashes Dynamo's router holds for the relay's worker.
async fn indexed(router: &mut Py) -> HashSet<u64> {
    router.send("dump").await;
    let state = json_line(&router.until(|l| json_line(l)["kind"] == "state").await);
    state["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["worker_id"] == WORKER)
        .map(|b| b["block_hash"].as_u64().unwrap())
        .collect()
}

/// Waits until Dynamo's router holds exactly `truth` for the worker.
async fn until_indexed(router: &mut Py, truth: &HashSet<u64>, what: &str) {
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        let held = indexed(router).await;
        if held == *truth {
            return;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "{what}: Dynamo's router holds {} blocks, {} of the engine's missing, {} extra",
            held.len(),
            truth.difference(&held).count(),
            held.difference(truth).count()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Waits until `router` and `reference` hold the same blocks for the worker, twice
/// in a row 200 ms apart; those blocks.
async fn until_same(router: &mut Py, reference: &mut Py) -> HashSet<u64> {
    let until = tokio::time::Instant::now() + DEADLINE;
    let mut last = None;
    loop {
        let (held, expected) = (indexed(router).await, indexed(reference).await);
        if held == expected && last.as_ref() == Some(&held) {
            return held;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the repaired router holds {} blocks, {} of the reference's missing, {} extra",
            held.len(),
            expected.difference(&held).count(),
            held.difference(&expected).count()
        );
        last = (held == expected).then_some(held);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

fn signal(pid: u32, sig: &str) {
    let sent = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
    assert!(sent.unwrap().success());
}

/// Dynamo's router, started after the engine stored blocks, gets them from the
/// relay's dump. Stopped while the engine publishes more than the relay's queue
/// holds, it asks for the events it lost and ends holding what a Dynamo router that
/// lost nothing holds (following a second relay of the same engine with a queue the
/// burst fits in), the oldest (pinned) blocks included: repaired, not reset. (Dynamo's
/// tree does not equal the engine's blocks under this engine's evictions, which
/// remove parents before their children, so the reference is Dynamo's own.)
async fn dynamos_router_repairs_from_kv_relay(codec: &str) {
    let etcd = EtcdServer::start().await;
    let (ns, ns_ref) = (format!("dynrec-{codec}"), format!("dynrec-{codec}-ref"));
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    // A short queue toward a router that stops reading: it drops soon.
    let (relay, endpoint) = spawn_relay(&engine, &etcd.url(), &ns, codec, "64").await;
    let (reference_relay, _) = spawn_relay(&engine, &etcd.url(), &ns_ref, codec, "100000").await;
    assert!(
        endpoint.starts_with(&format!("dynamo+{codec}://127.0.0.1:")),
        "{endpoint}"
    );
    // Stored before Dynamo's routers start: only a dump can tell them.
    engine.burst(20).await;
    let before = engine.truth().await;
    let mut router = dynamos_router(&etcd.url(), &ns).await;
    let mut reference = dynamos_router(&etcd.url(), &ns_ref).await;
    until_indexed(&mut router, &before, "the dump at first sight").await;
    until_indexed(&mut reference, &before, "the reference's dump").await;

    // A gap: the router stops reading while the relay's queue toward it overflows.
    signal(router.pid(), "-STOP");
    engine.burst(2500).await;
    signal(router.pid(), "-CONT");
    engine.burst(5).await;
    let truth = engine.truth().await;
    let pinned: HashSet<u64> = before.intersection(&truth).copied().collect();
    assert!(
        !pinned.is_empty(),
        "no block from before the gap is left: the test cannot tell a repair from a reset"
    );
    let held = until_same(&mut router, &mut reference).await;
    assert!(
        pinned.is_subset(&held),
        "blocks stored before the gap are gone: {} of {}",
        pinned.difference(&held).count(),
        pinned.len()
    );

    let stats = relay.terminate().await;
    assert!(
        stats["publisher"]["dropped"].as_u64().unwrap() > 0,
        "nothing was lost on the way: the test proves nothing ({stats})"
    );
    let served = &stats["recovery"]["server"];
    assert_eq!(served["dumps"], 1, "{stats}");
    assert!(served["events"].as_u64().unwrap() >= 1, "{stats}");
    assert_eq!(served["malformed"], 0, "{stats}");
    assert_eq!(served["refused_call_homes"], 0, "{stats}");
    let reference_stats = reference_relay.terminate().await;
    assert_eq!(
        reference_stats["publisher"]["dropped"], 0,
        "{reference_stats}"
    );
    assert_eq!(
        reference_stats["recovery"]["server"]["events"], 0,
        "{reference_stats}"
    );
    router.finish().await;
    reference.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_repairs_from_kv_relay_in_msgpack() {
    dynamos_router_repairs_from_kv_relay("msgpack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_repairs_from_kv_relay_in_json() {
    dynamos_router_repairs_from_kv_relay("json").await;
}
