//! Repair from the engines' replay buffers, against the engines' own publishers: the
//! unmodified `ZmqEventPublisher` of vLLM 0.25.1 (replies `[seq, payload]`), vLLM
//! 0.34.0 and SGLang 0.5.23 (replies `[topic, seq, payload]`), each with its replay
//! ROUTER and a high-water mark of 1, run by `tests/support/engine_replay_peer.py`.
//! `tools/engine_sources.py` fetches the modules (.ci/run does) into target/engines.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use eventplane::wire::Dialect;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventplane::kv::{
    KvEventData, PlacementEvent, WorkerId,
    engine::{EngineListener, EngineListenerConfig},
    router::{Recovered, RecoveryClientConfig, RecoveryRequest, recover},
};
use eventplane::zmtp::{Config, SubSocket};
use support::engine_peer::{EnginePeer, TOPIC};
use support::{Watched, within};

/// What a router holds of the worker, and the clears it was sent.
#[derive(Default)]
struct View {
    blocks: HashSet<u64>,
    clears: u64,
}

impl View {
    fn apply(&mut self, data: &KvEventData) {
        match data {
            KvEventData::Stored { blocks, .. } => {
                self.blocks.extend(blocks.iter().map(|b| b.block_hash.0));
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    self.blocks.remove(&h.0);
                }
            }
            KvEventData::Cleared => {
                self.blocks.clear();
                self.clears += 1;
            }
            _ => {}
        }
    }
}

/// Waits until the view holds exactly what the engine holds.
async fn converged(view: &Mutex<View>, engine: &mut EnginePeer, what: &str) {
    let truth = engine.truth().await;
    let reached = tokio::time::timeout(support::DEADLINE, async {
        loop {
            if view.lock().unwrap().blocks == truth {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let held = view.lock().unwrap().blocks.len();
    assert!(
        reached.is_ok(),
        "{what}: the router holds {held} blocks, the engine {} ({} missing)",
        truth.len(),
        truth.difference(&view.lock().unwrap().blocks).count()
    );
}

/// A router's subscription to a relay: every router event applied to a view.
fn route(relay_endpoint: String) -> Arc<Mutex<View>> {
    let view = Arc::new(Mutex::new(View::default()));
    let shared = view.clone();
    tokio::spawn(async move {
        let mut sub = SubSocket::connect(&relay_endpoint, Config::default())
            .await
            .unwrap();
        sub.subscribe("").await.unwrap();
        while let Ok(msg) = sub.recv().await {
            let payload = msg.get(msg.len() - 1).unwrap();
            for ev in Dialect::EventPlane.decode_router_events(payload).unwrap() {
                shared.lock().unwrap().apply(&ev.event.data);
            }
        }
    });
    view
}

/// `kv-relay --engine-replay` in front of the engine and a router subscribed to it,
/// from an engine that reset its cache once the router was in place.
async fn relay_in_front(engine: &mut EnginePeer) -> (Watched, Arc<Mutex<View>>) {
    relay_with(engine, &[]).await
}

async fn relay_with(engine: &mut EnginePeer, extra: &[&str]) -> (Watched, Arc<Mutex<View>>) {
    let (relay, endpoint) = engine.relay(extra).await;
    let view = route(endpoint);
    // The router is subscribed once its first event arrives: publish until one does,
    // then start from an engine that reset its cache (what the relay published before
    // the router subscribed never reached it).
    within(async {
        while view.lock().unwrap().blocks.is_empty() {
            engine.burst(1).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    engine.peer.send_line("clear").await;
    engine.peer.line().await;
    within(async {
        while view.lock().unwrap().clears == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    view.lock().unwrap().clears = 0;
    (relay, view)
}

/// Stops (SIGSTOP) or resumes (SIGCONT) a process.
fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().unwrap().to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// The relay is stopped (SIGSTOP) while the engine publishes more than any socket
/// buffer holds, so the engine's PUB drops batches; then the engine restarts.
async fn relay_repairs_by_replay(module: &str, flavor: &str) {
    let mut engine = EnginePeer::start(module, flavor).await;
    let (relay, view) = relay_in_front(&mut engine).await;
    engine.burst(20).await;
    converged(&view, &mut engine, "live").await;

    signal(&relay.child, "-STOP");
    engine.burst(3000).await;
    signal(&relay.child, "-CONT");
    engine.burst(5).await;
    converged(&view, &mut engine, "after the engine's PUB dropped batches").await;
    assert_eq!(view.lock().unwrap().clears, 0, "repaired without a clear");

    engine.restart().await;
    engine.burst(10).await;
    converged(&view, &mut engine, "after the engine restarted").await;
    assert!(
        view.lock().unwrap().clears >= 1,
        "the old engine's blocks cleared"
    );

    let stats = relay.terminate().await;
    let listener = &stats["listener"];
    assert!(
        listener["seq_gaps"].as_u64().unwrap() >= 1,
        "no loss happened: {listener}"
    );
    let replay = &listener["replay"];
    assert!(replay["repairs"].as_u64().unwrap() >= 2, "{replay}");
    assert!(
        replay["replayed_batches"].as_u64().unwrap() >= 1000,
        "{replay}"
    );
    assert!(
        replay["fallbacks"]["restart"].as_u64().unwrap() >= 1,
        "{replay}"
    );
    for cause in ["unreachable", "timeout", "too_new", "no_progress"] {
        assert_eq!(replay["fallbacks"][cause], 0, "{cause}: {replay}");
    }
}

/// A relay that comes back (here: resumed) to a new engine that already published past
/// the relay's last batch tells it from the old one by that batch's content, not its
/// number: it clears and replays the new engine from 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_engine_past_the_relays_last_batch_is_told_by_the_batchs_content() {
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let (relay, view) = relay_in_front(&mut engine).await;
    engine.burst(10).await;
    converged(&view, &mut engine, "live").await;
    signal(&relay.child, "-STOP");
    engine.restart().await;
    engine.burst(60).await;
    signal(&relay.child, "-CONT");
    converged(&view, &mut engine, "after the engine restarted").await;
    let stats = relay.terminate().await;
    let replay = &stats["listener"]["replay"];
    assert_eq!(replay["fallbacks"]["restart"], 1, "{replay}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_25_publisher_drops_and_the_relay_repairs_by_replay() {
    relay_repairs_by_replay("vllm-0.25.1", "vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_0_34_publisher_drops_and_the_relay_repairs_by_replay() {
    relay_repairs_by_replay("vllm-0.34.0", "vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_publisher_drops_and_the_relay_repairs_by_replay() {
    relay_repairs_by_replay("sglang-0.5.23", "sglang").await;
}

/// A listener started (or restarted) next to an engine that already published
/// rebuilds what the engine holds from its buffer, instead of starting cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_started_late_rebuilds_the_engines_blocks_from_its_buffer() {
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    engine.burst(200).await;
    let view = Arc::new(Mutex::new(View::default()));
    let mut runs = Vec::new();
    for _ in 0..2 {
        // Twice: the second listener is a relay restarted after more was published.
        engine.burst(30).await;
        *view.lock().unwrap() = View::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<PlacementEvent>>(64);
        let config = EngineListenerConfig::new(&engine.publish, TOPIC, WorkerId(1), 16)
            .engine_replay(&engine.replay);
        let listener = EngineListener::new(config, tx).unwrap();
        let handle = listener.handle();
        let task = tokio::spawn(listener.run());
        let shared = view.clone();
        let applier = tokio::spawn(async move {
            while let Some(events) = rx.recv().await {
                for ev in events {
                    shared.lock().unwrap().apply(&ev.event.data);
                }
            }
        });
        converged(&view, &mut engine, "from the buffer").await;
        handle.cancel();
        let stats = within(task).await.unwrap();
        within(applier).await.unwrap();
        runs.push(stats);
    }
    for stats in runs {
        assert_eq!(stats.stale_clears, 0);
        assert_eq!(stats.replay.fallbacks.total(), 0, "{:?}", stats.replay);
        assert!(stats.replay.replayed_batches >= 230, "{:?}", stats.replay);
    }
}

/// A router that starts late rebuilds the worker from the relay's dump (what the
/// engine holds, through the relay), and one that missed events gets them from the
/// relay's ring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_router_rebuilds_the_worker_from_the_relays_dump_and_ring() {
    let mut engine = EnginePeer::start("vllm-0.34.0", "vllm").await;
    let (mut relay, view) =
        relay_with(&mut engine, &["--recovery-bind", "tcp://127.0.0.1:0"]).await;
    let recovery = relay.line().await;
    let recovery = recovery.strip_prefix("recovery ").unwrap().to_owned();
    engine.burst(40).await;
    converged(&view, &mut engine, "live").await;
    let Recovered::Dump(dump) = recover(
        &recovery,
        RecoveryRequest::Dump,
        RecoveryClientConfig::default(),
    )
    .await
    .unwrap() else {
        panic!("a dump")
    };
    assert!(dump.complete);
    let mut rebuilt = View::default();
    for ev in &dump.events {
        rebuilt.apply(&ev.event.data);
    }
    assert_eq!(
        rebuilt.blocks,
        engine.truth().await,
        "the dump is what the engine holds"
    );
    // The last ten events, as a router that missed them asks.
    let since = dump.current_id - 10;
    let Recovered::Events { events, current_id } = recover(
        &recovery,
        RecoveryRequest::Since(since),
        RecoveryClientConfig::default(),
    )
    .await
    .unwrap() else {
        panic!("kept")
    };
    assert_eq!(current_id, dump.current_id);
    let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
    assert_eq!(ids, (since + 1..=current_id).collect::<Vec<_>>());
    let stats = relay.terminate().await;
    assert_eq!(stats["recovery"]["server"]["dump_requests"], 1, "{stats}");
}
