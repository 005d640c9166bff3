//! EngineListener end to end: a real libzmq publisher (pyzmq + msgpack fixtures)
//! → EngineListener → Processor → a collecting sink. The router events must equal
//! what the sans-IO decoder and pipeline make of the same bytes.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::sync::Arc;

use eventplane::kv::{EngineListener, EngineListenerConfig, Processor, ProcessorConfig, WorkerId};
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

    let sink = Arc::new(CollectSink::default());
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let listener = EngineListener::new(
        EngineListenerConfig::new(
            format!("tcp://127.0.0.1:{port}"),
            "kv-events",
            WorkerId(3),
            4,
        ),
        tx,
    )
    .unwrap();
    let stats = listener.handle();
    let cancel = CancellationToken::new();
    let listening = tokio::spawn(listener.cancellation(&cancel).run());
    let processing = tokio::spawn(
        Processor::new(ProcessorConfig::default(), rx, sink.clone())
            .unwrap()
            .run(),
    );
    assert_eq!(engine.line().await, "done");

    // What the same bytes must become.
    let expected = support::expected_router_events(&files, 3, 4);
    within(async {
        while sink.0.lock().unwrap().len() < expected.len() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    cancel.cancel();
    let listener_stats = listening.await.unwrap();
    processing.await.unwrap();
    assert_eq!(*sink.0.lock().unwrap(), expected);
    assert_eq!(
        (listener_stats.seq_gaps, listener_stats.seq_gap_batches),
        (1, 3)
    );
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
    use eventplane::kv::{EngineEvent, encode_engine_batch};
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
