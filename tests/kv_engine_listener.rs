//! EngineListener end to end: a real libzmq publisher (pyzmq + msgpack fixtures)
//! → EngineListener → Processor → a collecting sink. The router events must equal
//! what the sans-IO decoder and pipeline make of the same bytes.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::sync::Arc;

use eventplane::kv::{
    WorkerId,
    engine::{EngineListener, EngineListenerConfig},
    pipeline::{Processor, ProcessorConfig},
};
use support::{CollectSink, PyPeer, within};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn libzmq_engine_to_router_events() {
    let files = support::kv_fixture_files();
    // Batch seqs 0, 1, 5: the last jump counts one gap of 3 missing batches.
    let mut engine = PyPeer::spawn(&[
        "kvpub",
        "--topics",
        "kv-events",
        "--files",
        &files.join(","),
        "--seqs",
        "0,1,5",
    ]);
    let port = engine
        .line()
        .await
        .strip_prefix("port ")
        .unwrap()
        .to_owned();

    let relaying = Relaying::start(EngineListenerConfig::new(
        format!("tcp://127.0.0.1:{port}"),
        "kv-events",
        WorkerId(3),
        4,
    ));
    assert_eq!(engine.line().await, "done");

    // What the same bytes must become.
    let expected = support::expected_router_events(&files, 3, 4);
    let got = relaying.events(expected.len()).await;
    let stats = relaying.handle.clone();
    let (listener_stats, _) = relaying.stop().await;
    assert_eq!(got, expected);
    assert_eq!(
        (listener_stats.seq_gaps, listener_stats.seq_gap_batches),
        (1, 3)
    );
    // Each fixture batch ends with its rank's AllBlocksCleared: the gap found nothing
    // forwarded since a clear, so it needed none of its own.
    assert_eq!(listener_stats.stale_clears, 0);
    assert_eq!(listener_stats.decoder.batches, 3);
    assert_eq!(listener_stats.decoder.failed_events, 2);
    assert_eq!(stats.stats().malformed_messages, 0);
    engine.send_line("exit").await;
    assert!(engine.wait().await.success());
}

/// Cancelled while the processor's input is full, the listener discards the batch in
/// hand and counts its events; it never waits forever.
#[tokio::test]
async fn cancel_with_a_full_input_counts_what_it_discards() {
    use eventplane::kv::engine::{EngineEvent, encode_engine_batch};
    use eventplane::zmtp::{Config, Message, PubSocket};

    let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    // Capacity 1 and nobody reading: the second batch waits in the listener's hand.
    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    let listener = EngineListener::new(
        EngineListenerConfig::new(engine.local_endpoint().unwrap(), "kv", WorkerId(1), 2),
        tx,
    )
    .unwrap();
    let stats = listener.handle();
    let cancel = CancellationToken::new();
    let listening = tokio::spawn(listener.cancellation(&cancel).run());
    within(engine.wait_for_subscribers(1)).await;
    let batch = |n: usize| encode_engine_batch(0.0, 0, 2, &vec![EngineEvent::Cleared; n]).unwrap();
    for (seq, n) in [(0u64, 1), (1, 3)] {
        engine.send(Message::from_parts([
            b"kv".to_vec(),
            seq.to_be_bytes().to_vec(),
            batch(n),
        ]));
    }
    within(async {
        while stats.stats().decoder.batches < 2 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    cancel.cancel();
    let finished = within(listening).await.unwrap();
    assert_eq!(finished.discarded_events, 3);
    assert_eq!(finished.decoder.events, 4);
}

/// An `EngineListener` and a `Processor` into a collecting sink, both running.
struct Relaying {
    handle: eventplane::kv::engine::EngineListenerHandle,
    sink: Arc<CollectSink>,
    cancel: CancellationToken,
    listening: tokio::task::JoinHandle<eventplane::kv::engine::EngineListenerStats>,
    processing: tokio::task::JoinHandle<eventplane::kv::pipeline::ProcessorStats>,
}

impl Relaying {
    fn start(config: EngineListenerConfig) -> Relaying {
        let sink = Arc::new(CollectSink::default());
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let listener = EngineListener::new(config, tx).unwrap();
        let handle = listener.handle();
        let cancel = CancellationToken::new();
        let listening = tokio::spawn(listener.cancellation(&cancel).run());
        let processing = tokio::spawn(
            Processor::new(ProcessorConfig::default(), rx, sink.clone())
                .unwrap()
                .run(),
        );
        Relaying {
            handle,
            sink,
            cancel,
            listening,
            processing,
        }
    }

    /// The router events once there are at least `n`.
    async fn events(&self, n: usize) -> Vec<eventplane::kv::RouterEvent> {
        within(async {
            while self.sink.0.lock().unwrap().len() < n {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await;
        self.sink.0.lock().unwrap().clone()
    }

    /// Stops both; their final counters.
    async fn stop(
        self,
    ) -> (
        eventplane::kv::engine::EngineListenerStats,
        eventplane::kv::pipeline::ProcessorStats,
    ) {
        self.cancel.cancel();
        (
            self.listening.await.unwrap(),
            self.processing.await.unwrap(),
        )
    }
}

/// Loss before the worker reaches the routers: a skipped engine batch, the engine's
/// connection ending (a crash) and its restart each cost routers what they held of
/// it — a `Cleared` for the ranks forwarded since the last clear, ahead of what
/// follows — and never more than one clear per loss. Applied in order, the router
/// events hold exactly what the new engine stored.
#[tokio::test]
async fn a_lost_engine_view_becomes_a_cleared_ahead_of_what_follows() {
    use eventplane::kv::KvEventData;
    use std::time::Duration;
    use support::EnginePy;

    // Restarted on the same endpoint below.
    let mut engine = EnginePy::spawn(&support::restartable_endpoint(), &[]).await;
    let port = engine.port();
    let relaying = Relaying::start(
        EngineListenerConfig::new(&engine.endpoint, "kv-events", WorkerId(3), 4)
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100)),
    );
    let (handle, events) = (&relaying.handle, |n| relaying.events(n));
    let stored = |hashes: &[u64]| -> Vec<u64> { hashes.to_vec() };
    let kinds = |evs: &[eventplane::kv::RouterEvent]| -> Vec<(Option<Vec<u64>>, u32)> {
        evs.iter()
            .map(|e| match &e.event.data {
                KvEventData::Stored { blocks, .. } => (
                    Some(blocks.iter().map(|b| b.block_hash.0).collect()),
                    e.event.dp_rank,
                ),
                _ => (None, e.event.dp_rank),
            })
            .collect()
    };

    // A batch the engine's PUB dropped: a clear before the next batch.
    assert_eq!(engine.send("store 1 2").await, 0);
    assert_eq!(engine.send("skip").await, 1);
    assert_eq!(engine.send("store 3").await, 2);
    let got = events(3).await;
    assert!(matches!(got[1].event.data, KvEventData::Cleared), "{got:?}");
    assert_eq!(
        kinds(&got),
        [
            (Some(stored(&[1, 2])), 0),
            (None, 0),
            (Some(stored(&[3])), 0)
        ]
    );
    let s = handle.stats();
    assert_eq!((s.seq_gaps, s.seq_gap_batches, s.stale_clears), (1, 1, 1));
    assert!(s.connected, "a readiness probe sees the engine connection");

    // The engine crashes: the connection's end is a clear, at once (not when a new
    // engine speaks: it may take minutes to load a model).
    engine.kill().await;
    let got = events(4).await;
    assert_eq!(kinds(&got[3..]), [(None, 0)]);
    assert_eq!(handle.stats().stale_clears, 2);
    assert!(!handle.stats().connected);

    // A new engine on the same endpoint, numbering from 0: nothing was forwarded since
    // the last clear, so no second one; its blocks are all routers hold.
    let mut engine = EnginePy::spawn(&format!("tcp://127.0.0.1:{port}"), &[]).await;
    assert_eq!(engine.send("store 10 11").await, 0);
    let got = events(5).await;
    assert_eq!(kinds(&got[4..]), [(Some(stored(&[10, 11])), 0)]);
    let s = handle.stats();
    assert_eq!(
        (s.stale_clears, s.seq_resets, s.reconnects),
        (2, 1, 1),
        "{s:?}"
    );
    let mut held = std::collections::BTreeSet::new();
    for ev in &got {
        match &ev.event.data {
            KvEventData::Stored { blocks, .. } => {
                held.extend(blocks.iter().map(|b| b.block_hash.0))
            }
            KvEventData::Removed { block_hashes } => {
                block_hashes.iter().for_each(|h| {
                    held.remove(&h.0);
                });
            }
            _ => held.clear(),
        }
    }
    assert_eq!(held.into_iter().collect::<Vec<_>>(), [10, 11]);
    assert_eq!(
        relaying.sink.0.lock().unwrap().len(),
        5,
        "nothing else was sent"
    );

    // An event of a type we do not know is skipped, without a clear (a newer engine's
    // new kinds must not wipe routers); a removal that cannot be decoded is a loss.
    engine.send(r#"[["SomethingNew", 1]]"#).await;
    engine
        .send(r#"[["BlockRemoved", "not hashes", null], ["BlockStored", [30], null, [1, 2, 3, 4], 4, null, null, null]]"#)
        .await;
    let got = events(7).await;
    assert_eq!(
        kinds(&got[5..]),
        [(None, 0), (Some(stored(&[30])), 0)],
        "{got:?}"
    );
    let s = handle.stats();
    assert_eq!(
        (
            s.stale_clears,
            s.decoder.failed_events,
            s.decoder.failed_removals
        ),
        (3, 2, 1),
        "{s:?}"
    );

    let (_, processed) = relaying.stop().await;
    // Raw ids stayed consecutive around the clears the listener made.
    assert_eq!((processed.input_gaps, processed.input_events), (0, 7));
    engine.kill().await;
}

/// An engine that stops answering without closing its connection (a hung process, a
/// host gone without a FIN) is a lost connection once a heartbeat goes unanswered, so
/// routers get their clear then, not never. Set small here; the default is
/// `ENGINE_HEARTBEAT`.
#[tokio::test]
async fn a_hung_engine_is_a_lost_connection_after_its_heartbeat_timeout() {
    use eventplane::kv::KvEventData;
    use std::time::{Duration, Instant};
    use support::{DEADLINE_SLACK, EnginePy};

    let mut engine = EnginePy::spawn("tcp://127.0.0.1:0", &[]).await;
    let heartbeat = Duration::from_millis(300);
    let zmtp = eventplane::zmtp::Config::builder()
        .heartbeat_interval(Some(heartbeat))
        .build()
        .unwrap();
    let relaying = Relaying::start(
        EngineListenerConfig::new(&engine.endpoint, "kv-events", WorkerId(3), 4).zmtp_config(zmtp),
    );
    engine.send("root 1").await;
    let count = |n| relaying.events(n);
    count(1).await;
    // Idle but alive: pings are answered, nothing is cleared.
    tokio::time::sleep(heartbeat * 4).await;
    assert_eq!(relaying.handle.stats().stale_clears, 0);

    let hung = Instant::now();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &engine.pid().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let got = count(2).await;
    let after = hung.elapsed();
    assert!(
        matches!(got[1].event.data, KvEventData::Cleared),
        "a clear, once the ping went unanswered"
    );
    // A ping goes out within one interval and is given one timeout.
    assert!(
        after >= heartbeat.mul_f64(0.9) && after <= heartbeat * 2 + DEADLINE_SLACK,
        "cleared {after:?} after the engine hung; heartbeat {heartbeat:?}"
    );
    std::process::Command::new("kill")
        .args(["-CONT", &engine.pid().to_string()])
        .status()
        .unwrap();
    relaying.stop().await;
    engine.kill().await;
}
