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
use crate::support::admin::until_metric;
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
    // Settled once most of the newest blocks are in (they wait behind the repair).
    // Dynamo 1.6.1's router, flooded on a loaded machine, now and then stops taking
    // this worker's events for good after its repairs (no further query, no error):
    // then the check below runs on what it holds after the deadline, which the
    // repair's queries (counted below) came before.
    let until = tokio::time::Instant::now() + DEADLINE;
    let held = loop {
        let held = indexed(&mut router).await;
        if newest.intersection(&held).count() * 2 > newest.len()
            || tokio::time::Instant::now() >= until
        {
            break held;
        }
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
    // (An answer Dynamo's router stopped waiting for, under load, is counted in
    // `failed_call_homes` and asked again: not a refusal.)
    for refused in ["malformed", "refused_call_homes", "busy"] {
        assert_eq!(served[refused], 0, "{refused}: {stats}");
    }
    router.finish().await;
}

/// In both codecs, one after the other (each floods a Dynamo router: two at once on
/// two cores starve each other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_repairs_from_kv_relay_in_both_codecs() {
    dynamos_router_repairs_from_kv_relay("msgpack").await;
    dynamos_router_repairs_from_kv_relay("json").await;
}

/// A real Dynamo 1.6.1 worker with its local indexer, playing the engine on stdin
/// (worker 77, block size 4), registered under `ns/kvworker`; it advertises its
/// request plane on loopback (where `kv-router` reaches it and is dialled back).
async fn dynamo_worker(etcd: &str, ns: &str) -> Py {
    Py::spawn_with(
        "dynamo_worker.py",
        &[
            "--etcd",
            etcd,
            "--namespace",
            ns,
            "--component",
            "kvworker",
            "--local-indexer",
        ],
        &[("DYN_TCP_RPC_HOST", "127.0.0.1")],
    )
    .await
}

/// An engine batch storing `hashes` as one chain under `parent` (block size 4).
fn store(hashes: &[u64], parent: Option<u64>) -> String {
    let tokens: Vec<u64> = hashes.iter().flat_map(|h| [*h; 4]).collect();
    serde_json::json!([["BlockStored", hashes, parent, tokens, 4, null, "GPU", null]]).to_string()
}

/// `kv-router --dynamo` on `ns/kvworker` with its admin endpoint and its final index
/// in the stats line; the child, its stderr lines and the admin address.
async fn our_router(
    etcd: &str,
    ns: &str,
) -> (
    tokio::process::Child,
    tokio::sync::mpsc::Receiver<String>,
    String,
) {
    let (router, _out, mut err) = super::suite::spawn_kv_router(
        &[
            "--etcd",
            etcd,
            "--dynamo",
            "--namespace",
            ns,
            "--format",
            "quiet",
            "--dump-index",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let addr = loop {
        let line = crate::support::within(err.recv())
            .await
            .expect("kv-router exited");
        if let Some(at) = line.split("admin endpoint on http://").nth(1) {
            break at.trim_end_matches('/').to_owned();
        }
    };
    (router, err, addr)
}

/// The blocks a `kv-router --dump-index` stats line holds for `worker`.
fn our_index(stats: &serde_json::Value, worker: u64) -> HashSet<u64> {
    stats["index"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["worker_id"] == worker)
        .flat_map(|e| e["block_hashes"].as_array().unwrap().iter())
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// `kv-router --dynamo`, started after a real Dynamo worker with its local indexer
/// stored blocks, asks the worker over Dynamo's request plane (the `recovery_target`
/// of its `event_sources` record) and holds them: the dump at first sight, then the
/// live events after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_rebuilds_a_real_dynamo_worker_from_its_local_indexer() {
    let etcd = EtcdServer::start().await;
    let ns = "dynrec-ours";
    let mut worker = dynamo_worker(&etcd.url(), ns).await;
    // Stored before the router starts: only the worker's dump can tell it.
    worker.send(&store(&[101, 102, 103], None)).await;
    worker.send(&store(&[104], Some(103))).await;
    worker.send(&store(&[201], None)).await;
    worker.until(|l| l.contains("\"batch\": 2")).await;
    // The worker's local indexer applies its own events asynchronously.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let (router, err, addr) = our_router(&etcd.url(), ns).await;
    until_metric(&addr, "eventplane_kv_index_repairs_total", 1.0).await;
    // Live after the dump.
    worker.send(&store(&[301], None)).await;
    worker.until(|l| l.contains("\"batch\": 3")).await;
    until_metric(&addr, "eventplane_kv_index_blocks", 6.0).await;
    let stats = super::suite::terminate_reading(router, err).await;
    assert_eq!(
        our_index(&stats, 77),
        HashSet::from([101, 102, 103, 104, 201, 301]),
        "{stats}"
    );
    assert_eq!(stats["wipes"]["recovery_failed"], 0, "{}", stats["wipes"]);
    worker.finish().await;
}

/// `kv-router --dynamo` repairs over Dynamo's request plane from `kv-relay --wire
/// dynamo --recovery-bind` (both ends speaking what the tests above check against
/// the real Dynamo): rebuilt from the relay's dump when it first sees it, then,
/// stopped while the engine publishes more than the relay's queue holds, repaired
/// with the events it lost, never wiping the worker, and equal to the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_repairs_a_gap_over_dynamos_request_plane() {
    use crate::support::admin;
    let etcd = EtcdServer::start().await;
    let ns = "dynrec-gap";
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let (relay, _) = spawn_relay(&engine, &etcd.url(), ns, "msgpack", "64").await;
    engine.burst(20).await;
    let (router, err, addr) = our_router(&etcd.url(), ns).await;
    until_metric(&addr, "eventplane_kv_index_repairs_total", 1.0).await;

    signal(router.id().unwrap(), "-STOP");
    engine.burst(2500).await;
    signal(router.id().unwrap(), "-CONT");
    engine.burst(5).await;
    let truth = engine.truth().await;
    crate::support::within(async {
        loop {
            let (_, body) = admin::get(&addr, "/metrics").await;
            let at = |m: &str| admin::metric(&body, m).unwrap_or(-1.0);
            let settled = at("eventplane_kv_index_held_events") == 0.0
                && at("eventplane_kv_index_recovering_publishers") == 0.0;
            if settled && at("eventplane_kv_index_blocks") == truth.len() as f64 {
                return;
            }
            if at("eventplane_kv_index_wipes_total") > 0.0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
    let stats = super::suite::terminate_reading(router, err).await;
    for cause in ["id_gap", "reconnect", "recovery_failed", "held_overflow"] {
        assert_eq!(stats["wipes"][cause], 0, "{cause}: {}", stats["wipes"]);
    }
    assert_eq!(our_index(&stats, WORKER), truth);
    let relay_stats = relay.terminate().await;
    assert!(
        relay_stats["publisher"]["dropped"].as_u64().unwrap() > 0,
        "nothing was lost on the way: the test proves nothing ({relay_stats})"
    );
    let served = &relay_stats["recovery"]["server"];
    assert!(served["events"].as_u64().unwrap() >= 1, "{relay_stats}");
}
