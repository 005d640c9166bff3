//! Dynamo 1.6.1's worker recovery, both ways, against the real thing:
//!
//! - Dynamo's own KV router follows `kv-relay --wire dynamo --recovery-bind` (in front
//!   of vLLM 0.34.0's own publisher) and repairs from it: a dump when it first sees the
//!   relay, holding what was stored before it started, and the lost events after a gap,
//!   keeping what it held: it ends with exactly the engine's blocks (one without the
//!   relay's `recovery_target` resets the worker there, and the oldest blocks vanish
//!   from its index).
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
        // Dynamo warns for every store under a parent this engine evicted; the
        // worker answers only the address a query came from (Dynamo advertises its
        // response stream on a non-loopback address unless told).
        &[
            ("DYN_LOG", "error"),
            ("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1"),
            ("DYN_ROUTER_EVENT_THREADS", "1"),
        ],
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

fn signal(pid: u32, sig: &str) {
    let sent = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
    assert!(sent.unwrap().success());
}

/// Dynamo's router, started after the engine stored blocks, gets exactly them from
/// the relay's dump. Stopped while the engine publishes more than the relay's queue
/// holds, it asks for the events it lost (answered with `Events`) and keeps the
/// oldest (pinned) blocks, which no later event restores: repaired, not reset (a
/// live-only worker's rank is reset on a gap, and they vanish).
///
/// Not asserted: that it then equals the engine. Dynamo 1.6.1's router, following
/// the relay with no loss at all, ends this 2,500-batch burst (about 5 s) holding
/// thousands of blocks the engine evicted and missing some it stored; paced at 25
/// batches every 1.5 s it is exact. Following a Dynamo 1.6.1 worker that relays the
/// same engine, it ends the burst the same way: its own behaviour under a flood.
async fn dynamos_router_repairs_from_kv_relay(codec: &str) {
    let etcd = EtcdServer::start().await;
    let ns = format!("dynrec-{codec}");
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    engine.evict_chains().await;
    // A short queue toward a router that stops reading: it drops soon.
    let (relay, endpoint) = spawn_relay(&engine, &etcd.url(), &ns, codec, "64").await;
    assert!(
        endpoint.starts_with(&format!("dynamo+{codec}://127.0.0.1:")),
        "{endpoint}"
    );
    // Stored before Dynamo's router starts: only a dump can tell it.
    engine.burst(20).await;
    let before = engine.truth().await;
    let mut router = dynamos_router(&etcd.url(), &ns).await;
    until_indexed(&mut router, &before, "the dump at first sight").await;

    // A gap: the router stops reading while the relay's queue toward it overflows.
    signal(router.pid(), "-STOP");
    engine.burst(2500).await;
    signal(router.pid(), "-CONT");
    let during = engine.truth().await;
    engine.burst(5).await;
    let truth = engine.truth().await;
    // Applied only once the repair is (live events wait behind it); most of them,
    // given Dynamo's behaviour under a flood (see above).
    let newest: HashSet<u64> = truth.difference(&during).copied().collect();
    assert!(
        before.iter().any(|h| truth.contains(h)),
        "no block from before the gap is left: the test cannot tell a repair from a reset"
    );
    let pinned: HashSet<u64> = before.intersection(&truth).copied().collect();
    let until = tokio::time::Instant::now() + DEADLINE;
    let held = loop {
        let held = indexed(&mut router).await;
        if newest.intersection(&held).count() * 2 > newest.len() {
            break held;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "after the gap: {} of the {} newest blocks never came",
            newest.difference(&held).count(),
            newest.len(),
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(
        pinned.is_subset(&held),
        "after the gap: {} of the {} blocks from before it are gone ({} held)",
        pinned.difference(&held).count(),
        pinned.len(),
        held.len()
    );

    let stats = relay.terminate().await;
    assert!(
        stats["publisher"]["dropped"].as_u64().unwrap() > 0,
        "nothing was lost on the way: the test proves nothing ({stats})"
    );
    let served = &stats["recovery"]["server"];
    assert_eq!(served["dumps"], 1, "{stats}");
    assert!(served["events"].as_u64().unwrap() >= 1, "{stats}");
    for refused in [
        "malformed",
        "refused_call_homes",
        "busy",
        "failed_call_homes",
    ] {
        assert_eq!(served[refused], 0, "{refused}: {stats}");
    }
    router.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_repairs_from_kv_relay_in_msgpack() {
    dynamos_router_repairs_from_kv_relay("msgpack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_repairs_from_kv_relay_in_json() {
    dynamos_router_repairs_from_kv_relay("json").await;
}
