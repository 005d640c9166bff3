//! Against the real thing: NVIDIA Dynamo 1.6.1 (PyPI `ai-dynamo-runtime==1.6.1`) run
//! by `tests/dynamo_live/*.py` in a virtualenv that `.ci/run` creates
//! (`target/dynamo-venv`; `EVENTPLANE_DYNAMO_PYTHON` points elsewhere).
//!
//! - A Dynamo worker is followed by `kv_router --dynamo` through etcd: the router prints
//!   exactly the router events Dynamo publishes for the capture's engine batches.
//! - Side by side: Dynamo's own KV router indexes `kv_relay --wire dynamo` exactly as it
//!   indexes a Dynamo worker fed the same engine batches, state by state.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use crate::support;

use std::path::PathBuf;
use std::process::Stdio;

use serde_json::{Value, json};
use support::etcd::EtcdServer;
use support::{DEADLINE, dynamo_python, within};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// A Dynamo process from `tests/dynamo_live/`, driven by stdin/stdout lines.
pub(crate) struct Py {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Py {
    pub(crate) async fn spawn(script: &str, args: &[&str]) -> Py {
        Py::spawn_with(script, args, &[]).await
    }

    pub(crate) async fn spawn_with(script: &str, args: &[&str], env: &[(&str, &str)]) -> Py {
        let mut child = Command::new(dynamo_python())
            .arg(
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/dynamo_live")
                    .join(script),
            )
            .args(args)
            .env("DYN_LOG", "warn")
            // The caller's first (e.g. DYN_LOG=error for a router that would log a
            // warning per event, faster than the script's log pump drains them).
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // EVENTPLANE_DYNAMO_STDERR=1 shows Dynamo's logs (debugging a test).
            .stderr(match std::env::var_os("EVENTPLANE_DYNAMO_STDERR") {
                Some(_) => Stdio::inherit(),
                None => Stdio::null(),
            })
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut py = Py {
            child,
            stdin,
            lines,
        };
        py.until(|l| l == "ready").await;
        py
    }

    pub(crate) async fn line(&mut self) -> String {
        within(self.lines.next_line())
            .await
            .unwrap()
            .expect("the Dynamo process exited")
    }

    /// Reads lines until one satisfies `pred`; returns it.
    pub(crate) async fn until(&mut self, pred: impl Fn(&str) -> bool) -> String {
        loop {
            let line = self.line().await;
            if pred(&line) {
                return line;
            }
        }
    }

    /// As [`until`](Self::until), giving up (`None`) after `wait`.
    pub(crate) async fn until_within(
        &mut self,
        wait: std::time::Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Option<String> {
        tokio::time::timeout(wait, self.until(pred)).await.ok()
    }

    pub(crate) async fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    /// Closes stdin (the scripts' clean stop) and waits for exit 0.
    pub(crate) async fn finish(mut self) {
        drop(self.stdin.take());
        let status = within(self.child.wait()).await.unwrap();
        assert!(status.success(), "{status}");
    }
}

pub(crate) fn json_line(line: &str) -> Value {
    serde_json::from_str(line).unwrap_or(Value::Null)
}

/// The capture's engine batches, as JSON lines for `dynamo_worker.py`.
fn script(capture: &Value) -> Vec<Value> {
    capture["engine_script"].as_array().unwrap().clone()
}

/// An engine batch storing one block `hash` (no parent) on the host tier: a marker
/// whose arrival in an index says that everything sent before it was applied.
fn sentinel(hash: u64) -> Value {
    json!([[
        "BlockStored",
        [hash],
        null,
        [hash, hash, hash, hash],
        4,
        null,
        "CPU",
        null
    ]])
}

/// A Dynamo 1.6.1 worker publishes the capture's batches; `kv_router --dynamo`,
/// following it through etcd, prints exactly the router events the capture lists (ids
/// counted by the worker, consecutive) and sees the worker stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_follows_a_real_dynamo_worker() {
    let capture = support::dynamo_capture();
    let server = EtcdServer::start().await;
    let url = server.url();
    let worker = Py::spawn(
        "dynamo_worker.py",
        &[
            "--etcd",
            &url,
            "--namespace",
            "live1",
            "--component",
            "kvworker",
        ],
    )
    .await;
    let (router, out, err_rx) = super::suite::spawn_kv_router_dynamo(&url, "live1");
    router_prints_the_capture(&capture, worker, router, out, err_rx).await;
}

/// The same through Kubernetes discovery: a Dynamo 1.6.1 worker with
/// `DYN_DISCOVERY_BACKEND=kubernetes` writes its `DynamoWorkerMetadata` resource into
/// the API test server (its pod made ready in an EndpointSlice); `kv_router --kube
/// --dynamo` follows it there and prints exactly the capture's router events.
#[cfg(feature = "kube")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_follows_a_real_dynamo_worker_on_kubernetes() {
    let capture = support::dynamo_capture();
    let api = crate::kube_api::KubeApi::start().await;
    let dir = std::env::temp_dir().join(format!("eventplane-kube-live-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir, "livek");
    let kubeconfig = kubeconfig.to_str().unwrap();
    api.ready_slice("livek", "worker-slice", &[("worker-0", "uid-live-0", true)]);
    let env = [
        ("KUBECONFIG", kubeconfig),
        ("POD_NAME", "worker-0"),
        ("POD_UID", "uid-live-0"),
        ("POD_NAMESPACE", "livek"),
        ("DYN_TCP_RPC_HOST", "127.0.0.1"),
        ("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1"),
        ("DYN_SYSTEM_HOST", "127.0.0.1"),
        ("DYN_SYSTEM_PORT", "-1"),
        ("OTEL_EXPORT_ENABLED", "false"),
    ];
    let worker = Py::spawn_with(
        "dynamo_worker.py",
        &[
            "--discovery",
            "kubernetes",
            "--namespace",
            "live1k",
            "--component",
            "kvworker",
        ],
        &env,
    )
    .await;
    // What Dynamo wrote: its resource, owned by its pod, with the KV publisher's
    // channel and source.
    let cr = within(async {
        loop {
            match api.get("dynamoworkermetadatas", "livek", "worker-0") {
                Some(cr)
                    if !cr["spec"]["data"]["event_sources"]
                        .as_object()
                        .is_none_or(|m| m.is_empty()) =>
                {
                    return cr;
                }
                _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    assert_eq!(cr["metadata"]["ownerReferences"][0]["uid"], "uid-live-0");
    assert_eq!(api.field_managers("livek", "worker-0")[0], "dynamo-worker");
    let (router, out, err_rx) = spawn_kv_router_kube(kubeconfig, "livek", "live1k");
    router_prints_the_capture(&capture, worker, router, out, err_rx).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kv_router --kube --dynamo` on the API server of `kubeconfig`.
#[cfg(feature = "kube")]
fn spawn_kv_router_kube(
    kubeconfig: &str,
    kube_namespace: &str,
    namespace: &str,
) -> (
    Child,
    Lines<BufReader<ChildStdout>>,
    tokio::sync::mpsc::Receiver<String>,
) {
    super::suite::spawn_kv_router(
        &[
            "--kube",
            "--kube-namespace",
            kube_namespace,
            "--dynamo",
            "--namespace",
            namespace,
        ],
        &[("KUBECONFIG", kubeconfig)],
    )
}

/// Drives `worker` through the capture's batches and checks that the router prints
/// exactly the capture's router events, then sees the worker leave.
async fn router_prints_the_capture(
    capture: &Value,
    mut worker: Py,
    router: Child,
    mut out: Lines<BufReader<ChildStdout>>,
    mut err_rx: tokio::sync::mpsc::Receiver<String>,
) {
    // Until the router's subscription reaches the worker's PUB: clears, which come out
    // as router events; the script's first event is a store.
    let warm_until = tokio::time::Instant::now() + DEADLINE;
    loop {
        assert!(
            tokio::time::Instant::now() < warm_until,
            "nothing reached kv_router"
        );
        worker.send(r#"[["AllBlocksCleared"]]"#).await;
        let got =
            tokio::time::timeout(std::time::Duration::from_millis(200), out.next_line()).await;
        if let Ok(line) = got {
            assert_eq!(
                json_line(&line.unwrap().unwrap())["event"]["data"],
                "cleared"
            );
            break;
        }
    }
    for batch in script(capture) {
        worker.send(&batch.to_string()).await;
    }
    let want = super::suite::captured_router_events(capture);
    let mut got = Vec::new();
    let mut ids = Vec::new();
    while got.len() < want.len() {
        let line = within(out.next_line())
            .await
            .unwrap()
            .expect("kv_router exited");
        let mut v = json_line(&line);
        if got.is_empty() && v["event"]["data"] == "cleared" {
            continue; // a warm-up clear still in flight
        }
        ids.push(v["event"]["id"].as_u64().unwrap());
        v["event"]["id"] = Value::Null;
        got.push(v);
    }
    assert_eq!(got, want);
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");

    // The script ends with a clear, which empties every tier of the worker (as in
    // Dynamo's router); one block stored after it is what the index holds.
    // On the device tier: the router's index scores that one.
    let mut last = sentinel(0x5dff);
    last[0][6] = json!("GPU");
    worker.send(&last.to_string()).await;
    let line = within(out.next_line()).await.unwrap().unwrap();
    assert_eq!(
        json_line(&line)["event"]["data"]["stored"]["blocks"][0]["block_hash"],
        0x5dff
    );

    // The worker stops cleanly: its records leave etcd, the router forgets its blocks.
    worker.finish().await;
    loop {
        let line = within(err_rx.recv())
            .await
            .expect("kv_router stderr closed");
        if line.contains("left: forgot") {
            assert!(line.contains("left: forgot 1 blocks"), "{line}");
            break;
        }
    }
    let stats = super::suite::terminate_reading(router, err_rx).await;
    assert_eq!(
        (stats["publishers"].as_u64(), stats["index_blocks"].as_u64()),
        (Some(0), Some(0)),
        "{stats}"
    );
    for reason in [
        "frames", "header", "length", "envelope", "identity", "payload",
    ] {
        assert_eq!(stats["decode_errors"][reason], 0, "{reason}: {stats}");
    }
    assert_eq!(stats["subscriber"]["total"]["gaps"], 0, "{stats}");
}

/// Whether `line` is an index change that adds block `hash`.
fn adds(line: &str, hash: u64) -> bool {
    let v = json_line(line);
    v["kind"] == "index"
        && v["added"]
            .as_array()
            .is_some_and(|a| a.iter().any(|b| b["block_hash"] == hash))
}

/// Sends a sentinel until Dynamo's router has indexed one (so it is subscribed), then
/// feeds the capture's batches, each followed by a sentinel, to a worker through
/// `send`, and returns the state the router reports once each sentinel is indexed.
async fn states_seen_by_dynamos_router(
    router: &mut Py,
    mut send: impl AsyncFnMut(Value),
    capture: &Value,
) -> Vec<Value> {
    const WARM: u64 = 0x5dff;
    let until = tokio::time::Instant::now() + DEADLINE;
    loop {
        assert!(
            tokio::time::Instant::now() < until,
            "Dynamo's router indexed nothing"
        );
        send(sentinel(WARM)).await;
        let wait = std::time::Duration::from_millis(300);
        if router.until_within(wait, |l| adds(l, WARM)).await.is_some() {
            break;
        }
    }
    let mut states = Vec::new();
    for (i, batch) in script(capture).into_iter().enumerate() {
        let marker = 0x5e00 + i as u64;
        send(batch).await;
        send(sentinel(marker)).await;
        router.until(|l| adds(l, marker)).await;
        router.send("dump").await;
        let state = json_line(&router.until(|l| json_line(l)["kind"] == "state").await);
        let mut blocks = state["blocks"].as_array().unwrap().clone();
        blocks.sort_by_key(|b| b.to_string());
        states.push(json!({"blocks": blocks, "counts": state["counts"]}));
    }
    states
}

/// The block hashes of a state, sentinels aside.
/// An engine batch of `events` as vLLM sends it: msgpack `[ts, events, dp_rank 0]`.
fn vllm_batch(events: Value) -> Vec<u8> {
    rmp_serde::to_vec(&json!([1_700_000_000.5, events, 0])).unwrap()
}

/// The capture's story in a router's states, batch by batch: 101, 102 stored; 103 and
/// the host-pinned 201 added; 103 removed; the 2^64 - 5 block added; and the clear
/// empties every tier of the worker.
fn assert_capture_story(states: &[Value]) {
    let story: Vec<Vec<u64>> = states.iter().map(held).collect();
    let big = 18_446_744_073_709_551_611;
    assert_eq!(
        story,
        vec![
            vec![101, 102],
            vec![101, 102, 103, 201],
            vec![101, 102, 201],
            vec![101, 102, 201, big],
            vec![],
        ]
    );
}

fn held(state: &Value) -> Vec<u64> {
    let mut h: Vec<u64> = state["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["block_hash"].as_u64().unwrap())
        .filter(|h| !(0x5dff..0x5e10).contains(h))
        .collect();
    h.sort_unstable();
    h
}

/// Side by side: Dynamo's own KV router follows a Dynamo worker, then `kv_relay --wire
/// dynamo`, each fed the capture's engine batches (and a sentinel after each). The
/// router's index must be the same after every batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_indexes_kv_relay_as_it_indexes_a_dynamo_worker() {
    let capture = support::dynamo_capture();
    let server = EtcdServer::start().await;
    let url = server.url();
    let args = |ns: &'static str| {
        vec![
            "--etcd".to_owned(),
            url.clone(),
            "--namespace".to_owned(),
            ns.to_owned(),
            "--component".to_owned(),
            "kvworker".to_owned(),
        ]
    };

    // Reference: Dynamo's worker.
    let a = args("live2a");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let mut router = Py::spawn("dynamo_router.py", &a).await;
    let mut worker = Py::spawn("dynamo_worker.py", &a).await;
    let reference = states_seen_by_dynamos_router(
        &mut router,
        async |batch: Value| worker.send(&batch.to_string()).await,
        &capture,
    )
    .await;
    worker.finish().await;
    router.finish().await;

    // Ours: kv_relay --wire dynamo, registered in the same etcd under another namespace.
    let (mut engine, relay, _) = super::suite::spawn_kv_relay_dynamo(&url, "live2b").await;
    let b = args("live2b");
    let b: Vec<&str> = b.iter().map(String::as_str).collect();
    let mut router = Py::spawn("dynamo_router.py", &b).await;
    let ours = states_seen_by_dynamos_router(
        &mut router,
        async |batch: Value| engine.send(vllm_batch(batch)),
        &capture,
    )
    .await;
    assert_eq!(ours, reference);

    // What the reference shows is the capture's story, batch by batch: 101, 102 stored;
    // 103 and the host-pinned 201 added; 103 removed; the 2^64 - 5 block added; and
    // Dynamo's router takes the clear to empty every tier of the worker (only the last
    // sentinel is left).
    assert_capture_story(&reference);
    assert_eq!(
        reference.last().unwrap()["blocks"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let relay_stats = support::terminate_for_stats(relay).await;
    assert_eq!(relay_stats["publisher"]["dropped"], 0, "{relay_stats}");
    router.finish().await;
}

/// The blocks a `kv_router` event line stores (empty for anything else).
fn stored_by(line: &str) -> Vec<u64> {
    json_line(line)["event"]["data"]["stored"]["blocks"]
        .as_array()
        .map(|b| b.iter().filter_map(|b| b["block_hash"].as_u64()).collect())
        .unwrap_or_default()
}

/// What `kv_router` event lines leave in an index: stored adds, removed removes,
/// cleared empties (one worker and rank here).
fn replay(lines: &[String]) -> Vec<u64> {
    let mut held = std::collections::BTreeSet::new();
    for line in lines {
        let v = json_line(line);
        let data = &v["event"]["data"];
        if data == "cleared" {
            held.clear();
        }
        held.extend(stored_by(line));
        for h in data["removed"]["block_hashes"]
            .as_array()
            .into_iter()
            .flatten()
        {
            held.remove(&h.as_u64().unwrap());
        }
    }
    held.into_iter().collect()
}

/// Loss before the worker, on Dynamo's wire: a real engine (`examples/engine.py`)
/// drops a batch, crashes and restarts behind `kv_relay --wire dynamo`. Dynamo 1.6.1's
/// own router and `kv_router --dynamo` follow the relay through etcd; after the gap and
/// after the restart both indexes are the same, and hold exactly what the live engine
/// stored (the relay's clears empty the worker in Dynamo's router too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_engine_restart_dynamos_router_and_kv_router_hold_what_the_new_engine_stored() {
    use support::EnginePy;
    let server = EtcdServer::start().await;
    let url = server.url();
    // Restarted on the same endpoint below.
    let mut engine = EnginePy::spawn(&support::restartable_endpoint(), &[]).await;
    let port = engine.port();
    let (relay, _) = support::spawn_kv_relay(
        &engine.endpoint,
        "kv-events",
        77,
        "dynamo",
        &url,
        "live3",
        "kvworker",
    )
    .await;
    let mut dynamo = Py::spawn(
        "dynamo_router.py",
        &[
            "--etcd",
            &url,
            "--namespace",
            "live3",
            "--component",
            "kvworker",
        ],
    )
    .await;
    let (router, mut out, err_rx) = super::suite::spawn_kv_router_dynamo(&url, "live3");
    let kv_router_add = std::time::Duration::from_millis(300);
    let mut ours = Vec::new();

    // Until both routers are subscribed: a marker block, re-sent.
    let (mut dynamo_has, mut kv_router_has) = (false, false);
    let until = tokio::time::Instant::now() + DEADLINE;
    while !(dynamo_has && kv_router_has) {
        assert!(
            tokio::time::Instant::now() < until,
            "the routers saw nothing"
        );
        engine.send("root 900").await;
        if !dynamo_has {
            dynamo_has = dynamo
                .until_within(kv_router_add, |l| adds(l, 900))
                .await
                .is_some();
        }
        while let Ok(Ok(Some(line))) = tokio::time::timeout(kv_router_add, out.next_line()).await {
            kv_router_has |= stored_by(&line) == [900];
            ours.push(line);
        }
    }

    // Both indexes once `marker` is in both.
    async fn states(
        dynamo: &mut Py,
        out: &mut Lines<BufReader<ChildStdout>>,
        ours: &mut Vec<String>,
        marker: u64,
    ) -> (Vec<u64>, Vec<u64>) {
        dynamo.until(|l| adds(l, marker)).await;
        dynamo.send("dump").await;
        let state = json_line(&dynamo.until(|l| json_line(l)["kind"] == "state").await);
        let mut theirs: Vec<u64> = state["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["worker_id"] == 77 && b["dp_rank"] == 0)
            .map(|b| b["block_hash"].as_u64().unwrap())
            .collect();
        theirs.sort_unstable();
        while !ours.last().is_some_and(|l| stored_by(l).contains(&marker)) {
            let line = within(out.next_line())
                .await
                .unwrap()
                .expect("kv_router exited");
            ours.push(line);
        }
        (theirs, replay(ours))
    }

    // Engine A: a chain, a removal, a batch its PUB dropped, then a new chain.
    for command in ["root 1 2", "store 3", "remove 3", "skip", "root 4"] {
        engine.send(command).await;
    }
    let (theirs, mine) = states(&mut dynamo, &mut out, &mut ours, 4).await;
    assert_eq!((theirs.as_slice(), mine.as_slice()), (&[4][..], &[4][..]));

    // It crashes; engine B on the same endpoint numbers from 0.
    engine.kill().await;
    let mut engine = EnginePy::spawn(&format!("tcp://127.0.0.1:{port}"), &[]).await;
    for command in ["root 10 11", "store 12", "remove 12", "root 20"] {
        engine.send(command).await;
    }
    let (theirs, mine) = states(&mut dynamo, &mut out, &mut ours, 20).await;
    assert_eq!(theirs, [10, 11, 20], "Dynamo's router");
    assert_eq!(mine, [10, 11, 20], "kv_router's events");

    let stats = super::suite::terminate_reading(router, err_rx).await;
    assert_eq!(stats["index_blocks"], 3, "{stats}");
    let relay_stats = support::terminate_for_stats(relay).await;
    assert_eq!(relay_stats["listener"]["stale_clears"], 2, "{relay_stats}");
    dynamo.finish().await;
    engine.kill().await;
}

/// Dynamo 1.6.1's own KV router in kube mode follows `kv_relay --wire dynamo --kube`
/// through the API test server and indexes its events as it indexes a Dynamo worker's:
/// batch by batch, the capture's story (the same story the etcd test above checks
/// against a real Dynamo worker). Dynamo's router indexes only workers that serve the
/// endpoint with a model card, so the test adds a stand-in resource `admit-0` with an
/// endpoint and a card for the worker id Dynamo gives that resource
/// (`kube_instance_id`), and the relay publishes as that worker.
#[cfg(feature = "kube")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamos_router_in_kube_mode_indexes_kv_relay_kube() {
    let capture = support::dynamo_capture();
    let api = crate::kube_api::KubeApi::start().await;
    let dir = std::env::temp_dir().join(format!("eventplane-kube-live2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir, "livek2");
    let kubeconfig = kubeconfig.to_str().unwrap().to_owned();
    let (ns, comp, ep) = ("live2k", "kvworker", "generate");
    let worker = eventplane::discovery::kube_instance_id("admit-0");
    let key = format!("{ns}/{comp}/{ep}/{worker:x}");
    let instance = json!({"type": "Endpoint", "component": comp, "endpoint": ep, "namespace": ns,
        "instance_id": worker, "transport": {"tcp": format!("127.0.0.1:9/{worker:x}/{ns}/{comp}/{ep}")},
        "device_type": "cuda", "request_plane_codec": "msgpack"});
    let card = json!({"type": "Model", "namespace": ns, "component": comp, "endpoint": ep,
        "instance_id": worker,
        "card_json": {"display_name": "eventplane-probe", "slug": "eventplane-probe",
            "model_info": null, "tokenizer": null, "context_length": 0,
            "kv_cache_block_size": 4, "migration_limit": 0, "model_type": "Chat",
            "model_input": "Tokens", "worker_type": "aggregated", "needs": [],
            "runtime_config": {"data_parallel_start_rank": 0, "data_parallel_size": 1,
                "enable_local_indexer": false, "enable_eagle": false},
            "media_decoder": null, "media_fetcher": null}});
    api.put(
        "dynamoworkermetadatas",
        "livek2",
        json!({"metadata": {"name": "admit-0", "ownerReferences": [{"apiVersion": "v1",
                "kind": "Pod", "name": "admit-0", "uid": "u-admit", "controller": true,
                "blockOwnerDeletion": false}]},
               "spec": {"data": {"endpoints": {(key.clone()): instance},
                   "model_cards": {(key): card}, "event_channels": {}, "event_sources": {}}}}),
    );
    api.ready_slice(
        "livek2",
        "pods",
        &[("admit-0", "u-admit", true), ("relay-0", "u-relay", true)],
    );

    // kv_relay as pod relay-0, registering through its resource.
    let mut engine = support::Engine::bind("kv").await;
    let worker_arg = worker.to_string();
    let mut relay = Command::new(support::example("kv-relay"))
        .args([
            "--connect",
            &engine.endpoint(),
            "--topic",
            "kv",
            "--block-size",
            "4",
        ])
        .args([
            "--worker-id",
            &worker_arg,
            "--bind",
            "tcp://127.0.0.1:0",
            "--wire",
            "dynamo",
        ])
        .args(["--kube", "--namespace", ns, "--component", comp])
        // Its recovery endpoint rides in its EventSource record, which Dynamo's
        // router reads beside it.
        .args(["--recovery-bind", "tcp://127.0.0.1:0"])
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", "relay-0")
        .env("POD_UID", "u-relay")
        .env("POD_NAMESPACE", "livek2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut relay_out = BufReader::new(relay.stdout.take().unwrap()).lines();
    let bound = within(relay_out.next_line()).await.unwrap().unwrap();
    assert!(bound.starts_with("tcp://127.0.0.1:"), "{bound}");
    let recovery = within(relay_out.next_line()).await.unwrap().unwrap();
    let written = api
        .get("dynamoworkermetadatas", "livek2", "relay-0")
        .unwrap();
    let sources = written["spec"]["data"]["event_sources"]
        .as_object()
        .unwrap();
    assert_eq!(sources.len(), 1, "{written}");
    // On Dynamo's wire, the relay serves Dynamo's KV queries: its `recovery_target`.
    let target = &sources.values().next().unwrap()["metadata"]["recovery_target"];
    let address = recovery.trim_start_matches("recovery dynamo+msgpack://");
    assert!(
        target["transport"]["tcp"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{address}/")),
        "{written}"
    );
    assert_eq!(target["request_plane_codec"], "msgpack", "{written}");

    let mut router = Py::spawn_with(
        "dynamo_router.py",
        &[
            "--discovery",
            "kubernetes",
            "--admit",
            "none",
            "--namespace",
            ns,
            "--component",
            comp,
        ],
        &[
            ("KUBECONFIG", kubeconfig.as_str()),
            ("POD_NAME", "router-0"),
            ("POD_UID", "u-router"),
            ("POD_NAMESPACE", "livek2"),
            ("DYN_TCP_RPC_HOST", "127.0.0.1"),
            // The relay answers its recovery queries only on the address they came
            // from: loopback.
            ("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1"),
            ("DYN_SYSTEM_HOST", "127.0.0.1"),
            ("DYN_SYSTEM_PORT", "-1"),
        ],
    )
    .await;
    let states = states_seen_by_dynamos_router(
        &mut router,
        async |batch: Value| engine.send(vllm_batch(batch)),
        &capture,
    )
    .await;
    assert_capture_story(&states);
    // Every block is the relay's worker's.
    for state in &states {
        for b in state["blocks"].as_array().unwrap() {
            assert_eq!(b["worker_id"], worker, "{b}");
        }
    }
    router.finish().await;
    let stats = support::terminate_for_stats(relay).await;
    assert_eq!(stats["publisher"]["dropped"], 0, "{stats}");
    // On SIGTERM the relay withdrew its records and applied its resource with every
    // map empty (a map emptied by an apply is stored as `null`, as a real API server
    // does; then applied empty again).
    let emptied = api
        .get("dynamoworkermetadatas", "livek2", "relay-0")
        .unwrap();
    for map in [
        "endpoints",
        "model_cards",
        "event_channels",
        "event_sources",
    ] {
        let m = &emptied["spec"]["data"][map];
        assert!(
            m.is_null() || m.as_object().is_some_and(|m| m.is_empty()),
            "{emptied}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
