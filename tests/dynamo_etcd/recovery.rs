//! Dynamo 1.6.1's worker recovery, both ways, against the real thing:
//!
//! - Dynamo's own KV router follows `kv-relay --wire dynamo --recovery-bind` (in front
//!   of vLLM 0.34.0's own publisher) and repairs from it: a dump when it first sees the
//!   relay, holding what was stored before it started, and the lost events after a gap,
//!   keeping what it held: it ends with exactly the engine's blocks (one without the
//!   relay's `recovery_target` resets the worker there, and the oldest blocks vanish
//!   from its index).
//! - `kv-router --dynamo` follows a real Dynamo worker with its local indexer, through
//!   a hop that loses exactly what a test says: rebuilt from its dump at first sight,
//!   repaired with `Events` after a small loss and with a `TreeDump` after one larger
//!   than the worker's ring; a worker that hangs mid-query is wiped at the router's
//!   deadline, counted, and rebuilt once it answers again.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use eventplane::wire::Dialect;
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
/// per router, with its admin endpoint; returns it, the endpoint it registered and its
/// admin address.
async fn spawn_relay(
    engine: &EnginePeer,
    etcd: &str,
    ns: &str,
    codec: &str,
    queue: &str,
) -> (Watched, String, String) {
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
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .await;
    let line = relay.line().await;
    let endpoint = line.strip_prefix("recovery ").unwrap().to_owned();
    let admin = relay.stderr_until("admin endpoint on http://").await;
    let admin = admin
        .rsplit("http://")
        .next()
        .unwrap()
        .trim_end_matches('/');
    (relay, endpoint, admin.to_owned())
}

/// While `stopped` does not read: publishes `n` batches, waits until the relay (its
/// admin endpoint `relay_admin`) has taken all `sent` batches so far, and publishes
/// more until its publisher has dropped some (the buffers between the relay and a
/// stopped reader vary with the machine's load); returns the batches sent in all.
async fn overflow(engine: &mut EnginePeer, relay_admin: &str, mut sent: u64, n: u32) -> u64 {
    use crate::support::admin;
    engine.burst(n).await;
    sent += u64::from(n);
    for _ in 0..8 {
        // Every batch taken (or, should the relay have lost some from the engine,
        // nothing more taken for a second).
        let (mut last, mut still) = (-1.0, 0);
        let dropped = crate::support::within(async {
            loop {
                let (_, body) = admin::get(relay_admin, "/metrics").await;
                let taken = admin::metric(&body, "eventplane_kv_processor_input_lists_total")
                    .unwrap_or(0.0);
                still = if taken == last { still + 1 } else { 0 };
                last = taken;
                if taken >= sent as f64 || still >= 20 {
                    return admin::metric(&body, "eventplane_pub_dropped_total").unwrap_or(0.0);
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
        .await;
        if dropped > 0.0 {
            return sent;
        }
        engine.burst(500).await;
        sent += 500;
    }
    sent
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
    let (relay, endpoint, relay_admin) = spawn_relay(&engine, &etcd.url(), &ns, codec, "64").await;
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
    overflow(&mut engine, &relay_admin, 20, 2500).await;
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
    extra: &[&str],
) -> (
    tokio::process::Child,
    tokio::sync::mpsc::Receiver<String>,
    String,
) {
    let mut args = vec![
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
    ];
    args.extend(extra);
    let (router, _out, mut err) = super::suite::spawn_kv_router(&args, &[]);
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

    let (router, err, addr) = our_router(&etcd.url(), ns, &[]).await;
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
    let (relay, _, relay_admin) = spawn_relay(&engine, &etcd.url(), ns, "msgpack", "64").await;
    engine.burst(20).await;
    let (router, err, addr) = our_router(&etcd.url(), ns, &[]).await;
    until_metric(&addr, "eventplane_kv_index_repairs_total", 1.0).await;

    signal(router.id().unwrap(), "-STOP");
    let sent = overflow(&mut engine, &relay_admin, 20, 2500).await;
    signal(router.id().unwrap(), "-CONT");
    engine.burst(5).await;
    let truth = engine.truth().await;
    // Settled on what was sent, not on the count of blocks (the engine holds as many
    // before its last batches as after them): the relay has taken every engine batch,
    // the router has read every message the relay queued for it, twice in a row.
    let batches = (sent + 5) as f64;
    let mut last = None;
    crate::support::within(async {
        loop {
            let (_, relayed) = admin::get(&relay_admin, "/metrics").await;
            let (_, body) = admin::get(&addr, "/metrics").await;
            let at = |m: &str| admin::metric(&body, m).unwrap_or(-1.0);
            let taken = admin::metric(&relayed, "eventplane_kv_processor_input_lists_total");
            let queued = admin::metric(&relayed, "eventplane_pub_queued_total");
            let read = at("eventplane_subscriber_received_total");
            let settled = at("eventplane_kv_index_held_events") == 0.0
                && at("eventplane_kv_index_recovering_publishers") == 0.0
                && taken.is_some_and(|t| t >= batches)
                && queued == Some(read);
            if settled
                && last == Some(read)
                && at("eventplane_kv_index_blocks") == truth.len() as f64
            {
                return;
            }
            last = settled.then_some(read);
            if at("eventplane_kv_index_wipes_total") > 0.0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    let stats = super::suite::terminate_reading(router, err).await;
    for cause in ["id_gap", "reconnect", "recovery_failed", "held_overflow"] {
        assert_eq!(stats["wipes"][cause], 0, "{cause}: {}", stats["wipes"]);
    }
    let ours = our_index(&stats, WORKER);
    assert!(
        ours == truth,
        "{} of the engine's blocks missing, {} extra; repairs {}, index_stats {}",
        truth.difference(&ours).count(),
        ours.difference(&truth).count(),
        stats["repairs"],
        stats["index_stats"]
    );
    // What the relay served, on its /metrics as in its stats.
    let (_, metrics) = admin::get(&relay_admin, "/metrics").await;
    let answered = |kind: &str| {
        let name = format!("eventplane_kv_recovery_answers_total{{kind=\"{kind}\"}}");
        admin::metric(&metrics, &name).unwrap_or(0.0)
    };
    // (`out_of_range` too: the router's follow-ups past the newest event, `TooNew`.)
    assert_eq!(answered("dump"), 1.0, "{metrics}");
    assert!(answered("events") >= 1.0, "{metrics}");
    let relay_stats = relay.terminate().await;
    assert!(
        relay_stats["publisher"]["dropped"].as_u64().unwrap() > 0,
        "nothing was lost on the way: the test proves nothing ({relay_stats})"
    );
    let served = &relay_stats["recovery"]["server"];
    assert!(served["events"].as_u64().unwrap() >= 1, "{relay_stats}");
}

/// A lossy hop on a Dynamo worker's event plane: a SUB on the worker's PUB and a PUB
/// of its own that forwards every message unchanged, except those it is told to lose
/// (whole messages, counted in the router events they carry) or hold. The worker's
/// `event_channels` record is rewritten to name it (same lease), so a router started
/// after that reads the worker through it: a loss exactly where a test wants one.
struct LossyHop {
    publisher: std::sync::Arc<eventplane::zmtp::PubSocket>,
    state: std::sync::Arc<std::sync::Mutex<HopState>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct HopState {
    /// Lose messages while this many events are still to be lost.
    lose: u64,
    /// Events lost so far.
    lost: u64,
    /// Events forwarded so far.
    forwarded: u64,
    /// Holding: messages kept back (`release`).
    hold: bool,
    held: Vec<eventplane::zmtp::Message>,
}

/// The router events a Dynamo event-plane message carries (its last part's envelope;
/// 0 for a message that carries none).
fn events_in(message: &eventplane::zmtp::Message) -> u64 {
    message
        .get(message.len().saturating_sub(1))
        .and_then(|frame| eventplane::wire::parse_dynamo_frame(frame).ok())
        .filter(|envelope| envelope.topic == "kv-events")
        .and_then(|envelope| Dialect::Dynamo.decode_router_events(envelope.payload).ok())
        .map_or(0, |events| events.len() as u64)
}

impl LossyHop {
    /// Puts a hop in front of the only worker registered under `ns`.
    async fn insert(etcd: &EtcdServer, ns: &str) -> LossyHop {
        use eventplane::zmtp::{Config, PubSocket, SubSocket};
        let prefix = format!("v1/event_channels/namespace/{ns}/");
        let listed = etcd.etcdctl(&["get", "--prefix", &prefix]);
        let [key, value] = listed.lines().collect::<Vec<_>>()[..] else {
            panic!("not one event channel under {prefix}: {listed}");
        };
        let (key, value) = (key.to_owned(), value.to_owned());
        let json = etcd.etcdctl(&["get", &key, "-w", "json"]);
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        let lease = json["kvs"][0]["lease"].as_i64().unwrap();
        let mut record: serde_json::Value = serde_json::from_str(&value).unwrap();
        let worker = record["transport"]["config"]["endpoint"]
            .as_str()
            .unwrap()
            .to_owned();

        let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        let endpoint = publisher.local_endpoint().unwrap().to_owned();
        let publisher = std::sync::Arc::new(publisher);
        let mut sub = SubSocket::connect(&worker, Config::default())
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        let state = std::sync::Arc::new(std::sync::Mutex::new(HopState::default()));
        let (shared, forward) = (state.clone(), publisher.clone());
        let task = tokio::spawn(async move {
            while let Ok(message) = sub.recv().await {
                let events = events_in(&message);
                let mut s = shared.lock().unwrap();
                if s.lose > 0 {
                    s.lose = s.lose.saturating_sub(events);
                    s.lost += events;
                } else if s.hold {
                    s.held.push(message);
                } else {
                    s.forwarded += events;
                    forward.send(message);
                }
            }
        });

        record["transport"]["config"]["endpoint"] = endpoint.into();
        etcd.etcdctl(&[
            "put",
            &format!("--lease={lease:x}"),
            &key,
            &record.to_string(),
        ]);
        LossyHop {
            publisher,
            state,
            task,
        }
    }

    /// Loses the next messages, until `events` events are lost.
    fn lose(&self, events: u64) {
        self.state.lock().unwrap().lose = events;
    }

    /// Events forwarded so far.
    fn forwarded(&self) -> u64 {
        self.state.lock().unwrap().forwarded
    }

    /// Events lost so far.
    fn lost(&self) -> u64 {
        self.state.lock().unwrap().lost
    }

    fn hold(&self) {
        self.state.lock().unwrap().hold = true;
    }

    /// Messages held back so far.
    fn held(&self) -> usize {
        self.state.lock().unwrap().held.len()
    }

    /// Stops holding: loses the first held message, forwards the rest.
    fn release_losing_first(&self) {
        let mut s = self.state.lock().unwrap();
        s.hold = false;
        let mut held = std::mem::take(&mut s.held).into_iter();
        if let Some(first) = held.next() {
            s.lost += events_in(&first);
        }
        for message in held {
            s.forwarded += events_in(&message);
            self.publisher.send(message);
        }
    }
}

impl Drop for LossyHop {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until the router at `addr` has settled (nothing held, nobody recovering)
/// with `blocks` blocks, or wiped someone (the caller's assertions then say what);
/// with `None`, only until it settled.
async fn until_settled(addr: &str, blocks: Option<usize>) {
    use crate::support::admin;
    crate::support::within(async {
        loop {
            let (_, body) = admin::get(addr, "/metrics").await;
            let at = |m: &str| admin::metric(&body, m).unwrap_or(-1.0);
            let settled = at("eventplane_kv_index_held_events") == 0.0
                && at("eventplane_kv_index_recovering_publishers") == 0.0;
            let Some(blocks) = blocks else {
                if settled {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            if settled && at("eventplane_kv_index_blocks") == blocks as f64 {
                return;
            }
            if at("eventplane_kv_index_wipes_total") > 0.0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// Waits until `f` of the hop stops changing (500 ms), then returns it.
async fn until_still(f: impl Fn() -> u64) -> u64 {
    crate::support::within(async {
        let mut last = f();
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            let now = f();
            if now == last {
                return now;
            }
            last = now;
        }
    })
    .await
}

/// The engine the tests below play through `dynamo_worker.py`'s stdin: batches of
/// whole chains (no parent), and what it holds.
#[derive(Default)]
struct Engine {
    next: u64,
    held: HashSet<u64>,
    batches: u64,
}

impl Engine {
    /// Publishes `n` batches of `chains` chains of 2 blocks each through `worker`;
    /// returns once the worker has handed the last to its relay.
    async fn publish(&mut self, worker: &mut Py, n: usize, chains: usize) {
        for _ in 0..n {
            let events: Vec<serde_json::Value> = (0..chains)
                .map(|_| {
                    let hashes = [1_000_000 + self.next, 1_000_001 + self.next];
                    self.next += 2;
                    self.held.extend(hashes);
                    let tokens: Vec<u64> = hashes.iter().flat_map(|h| [*h; 4]).collect();
                    serde_json::json!(["BlockStored", hashes, null, tokens, 4, null, "GPU", null])
                })
                .collect();
            worker
                .send(&serde_json::Value::from(events).to_string())
                .await;
            self.batches += 1;
        }
        let last = format!("\"batch\": {}", self.batches - 1);
        worker.until(|l| l.contains(&last)).await;
    }
}

/// A real Dynamo worker (77, local indexer on) under `ns/kvworker`, behind a lossy
/// hop, that stored 3 batches before `kv-router --dynamo` (with `extra` arguments)
/// started, rebuilt it from its dump and settled.
struct RealWorker {
    _etcd: EtcdServer,
    worker: Py,
    hop: LossyHop,
    engine: Engine,
    router: tokio::process::Child,
    err: tokio::sync::mpsc::Receiver<String>,
    addr: String,
}

impl RealWorker {
    async fn followed(ns: &str, extra: &[&str]) -> RealWorker {
        let etcd = EtcdServer::start().await;
        let mut worker = dynamo_worker(&etcd.url(), ns).await;
        let hop = LossyHop::insert(&etcd, ns).await;
        let mut engine = Engine::default();
        engine.publish(&mut worker, 3, 4).await;
        // Relayed (and so in the worker's local indexer, fed as it publishes).
        until_still(|| hop.forwarded()).await;
        let (router, err, addr) = our_router(&etcd.url(), ns, extra).await;
        until_metric(
            &addr,
            "eventplane_kv_index_repairs_total{kind=\"dump\"}",
            1.0,
        )
        .await;
        until_settled(&addr, Some(engine.held.len())).await;
        RealWorker {
            _etcd: etcd,
            worker,
            hop,
            engine,
            router,
            err,
            addr,
        }
    }
}

/// `kv-router --dynamo` follows a real Dynamo 1.6.1 worker (its local indexer on)
/// through a hop that loses what the test says, and repairs each loss over Dynamo's
/// request plane: a few events lost (within the worker's ring of 1,024) come back as
/// `Events`; more than its ring holds come back as a `TreeDump`; either way nothing is
/// wiped and the index equals the engine's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_repairs_a_real_dynamo_workers_gaps() {
    let RealWorker {
        _etcd,
        mut worker,
        hop,
        mut engine,
        router,
        err,
        addr,
    } = RealWorker::followed("dynrec-realgap", &[]).await;

    // One batch lost: asked from the event after the last one seen, in the ring.
    hop.lose(1);
    engine.publish(&mut worker, 3, 4).await;
    until_metric(
        &addr,
        "eventplane_kv_index_repairs_total{kind=\"since\"}",
        1.0,
    )
    .await;
    until_settled(&addr, Some(engine.held.len())).await;
    assert!(hop.lost() >= 1);

    // More than the worker's ring: it answers the same question with its tree.
    hop.lose(1100);
    engine.publish(&mut worker, 60, 20).await;
    until_metric(
        &addr,
        "eventplane_kv_index_repairs_total{kind=\"dump\"}",
        2.0,
    )
    .await;
    until_settled(&addr, Some(engine.held.len())).await;
    let lost = hop.lost();
    assert!(lost > 1100, "the hop lost only {lost} events");

    let stats = super::suite::terminate_reading(router, err).await;
    for cause in ["id_gap", "reconnect", "recovery_failed", "held_overflow"] {
        assert_eq!(stats["wipes"][cause], 0, "{cause}: {}", stats["wipes"]);
    }
    assert_eq!(stats["repairs"]["since"], 1, "{}", stats["repairs"]);
    assert_eq!(our_index(&stats, 77), engine.held);
    eprintln!(
        "lost {lost} events, forwarded {} ({})",
        hop.forwarded(),
        stats["repairs"]
    );
    drop(hop);
    worker.finish().await;
}

/// A real Dynamo worker that hangs mid-query (stopped after publishing, so its
/// request plane accepts the router's connection and never answers) is wiped once the
/// router's recovery deadline passes, counted (`recovery_failed`), and the events held
/// meanwhile are applied: only the blocks after the loss are left. Once the worker
/// answers again, the router rebuilds it from its dump and equals the engine. (Dynamo
/// 1.6.1's router retries such a worker for about 25 s, holding its events, then
/// applies them over what it had.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_wipes_a_real_dynamo_worker_that_hangs_mid_query_then_rebuilds_it() {
    use crate::support::admin;
    let deadline_ms = 1000;
    let deadline = deadline_ms.to_string();
    let RealWorker {
        _etcd,
        mut worker,
        hop,
        mut engine,
        router,
        err,
        addr,
    } = RealWorker::followed("dynrec-hang", &["--recovery-timeout-ms", &deadline]).await;

    hop.hold();
    engine.publish(&mut worker, 2, 4).await;
    let held = until_still(|| hop.held() as u64).await;
    assert!(held >= 2, "the worker relayed {held} messages");
    signal(worker.pid(), "-STOP");
    let before = hop.forwarded();
    let released = tokio::time::Instant::now();
    hop.release_losing_first();
    let after_loss = 2 * (hop.forwarded() - before); // a chain of 2 blocks an event
    until_metric(
        &addr,
        "eventplane_kv_index_wipes_total{reason=\"recovery_failed\"}",
        1.0,
    )
    .await;
    let waited = released.elapsed();
    // The deadline fired, and not long after it (slack for a loaded machine).
    assert!(
        waited >= std::time::Duration::from_millis(deadline_ms)
            && waited < std::time::Duration::from_millis(deadline_ms * 8),
        "wiped {waited:?} after the loss (deadline {deadline_ms} ms)"
    );
    // Still stopped: its rebuild cannot have happened; what the router holds is what
    // came after the loss.
    until_settled(&addr, None).await;
    let (_, body) = admin::get(&addr, "/metrics").await;
    assert_eq!(
        admin::metric(&body, "eventplane_kv_index_blocks"),
        Some(after_loss as f64)
    );
    signal(worker.pid(), "-CONT");
    until_metric(
        &addr,
        "eventplane_kv_index_repairs_total{kind=\"rebuild\"}",
        1.0,
    )
    .await;
    until_settled(&addr, Some(engine.held.len())).await;

    let stats = super::suite::terminate_reading(router, err).await;
    assert_eq!(stats["wipes"]["recovery_failed"], 1, "{}", stats["wipes"]);
    for cause in ["id_gap", "reconnect", "held_overflow"] {
        assert_eq!(stats["wipes"][cause], 0, "{cause}: {}", stats["wipes"]);
    }
    assert_eq!(our_index(&stats, 77), engine.held);
    drop(hop);
    worker.finish().await;
}
