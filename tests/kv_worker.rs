//! `kv::pipeline::Worker`: the worker side wired in one builder — an engine's PUB over real TCP,
//! through listener and processor, out on a registered publisher to a router; its
//! shutdown publishes what was queued and unregisters; its token stops it.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use eventplane::wire::Dialect;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventplane::discovery::{Discovery, MemoryDiscovery, Query, WorkerIdentity};
use eventplane::kv::{
    KvEventData, WorkerId,
    engine::{EngineEvent, EngineListenerConfig, encode_engine_batch},
    pipeline::{ProcessorConfig, Worker},
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::DynamicSubscriber;
use eventplane::zmtp::{Config, Message, PubSocket};
use eventplane::{CancellationToken, ConfigError};
use support::{CollectSink, DEADLINE, within};

const BLOCK: u32 = 4;

/// An engine's PUB, as vLLM binds it: `[topic, seq u64be, msgpack batch]`.
async fn engine() -> (PubSocket, String) {
    let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = engine.local_endpoint().unwrap().to_owned();
    (engine, endpoint)
}

/// Batch `seq` stores one block of its own.
fn send_batch(engine: &PubSocket, seq: u64) {
    let event = EngineEvent::Stored {
        block_hashes: vec![1000 + seq],
        parent_block_hash: None,
        token_ids: vec![seq as u32; BLOCK as usize],
        medium: None,
    };
    let payload = encode_engine_batch(0.0, 0, BLOCK, &[event]).unwrap();
    engine.send(Message::from_parts([
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ]));
}

#[tokio::test]
async fn a_worker_relays_an_engine_to_a_router_and_unregisters_on_shutdown() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
        .topic("kv-events")
        .spawn()
        .unwrap();
    let (engine, endpoint) = engine().await;
    let publisher = EventPublisher::builder(discovery.clone(), "ns", "worker-9", "kv-events")
        .worker(9, 0)
        .build()
        .await
        .unwrap();
    let worker = Worker::builder(
        EngineListenerConfig::new(&endpoint, "kv", WorkerId(9), BLOCK as usize),
        publisher,
    )
    .processor(ProcessorConfig::default().batch_timeout(None))
    .spawn()
    .unwrap();
    let published_by = worker.publisher().unwrap().instance().unwrap().id.clone();
    worker
        .publisher()
        .unwrap()
        .wait_for_subscribers_within(1, DEADLINE)
        .await
        .unwrap();
    within(engine.wait_for_subscribers(1)).await;

    for seq in 0..50 {
        send_batch(&engine, seq);
    }
    let mut stored = Vec::new();
    within(async {
        while stored.len() < 50 {
            let delivery = router.recv().await.unwrap();
            assert_eq!(delivery.source.id, published_by);
            // The worker is known from discovery, before the payload is decoded.
            assert_eq!(delivery.source.worker, Some(WorkerIdentity::new(9, 0)));
            for ev in Dialect::EventPlane
                .decode_router_events(&delivery.payload().unwrap())
                .unwrap()
            {
                assert_eq!(ev.worker_id, WorkerId(9));
                let KvEventData::Stored { blocks, .. } = ev.event.data else {
                    panic!("only stores were sent: {ev:?}");
                };
                stored.push((ev.event.id, blocks[0].block_hash.0));
            }
        }
    })
    .await;
    // Dense ids from 1, and the engine's hashes, in order.
    let expected: Vec<(u64, u64)> = (0..50).map(|s| (s + 1, 1000 + s)).collect();
    assert_eq!(stored, expected);

    let stats = worker.shutdown().await;
    assert_eq!(stats.listener.seq_gaps, 0);
    assert_eq!(stats.listener.decoder.batches, 50);
    assert_eq!(
        (stats.processor.input_events, stats.processor.output_events),
        (50, 50)
    );
    let publisher = stats.publisher.unwrap();
    assert_eq!(publisher.messages, stats.published_messages);
    assert!(stats.published_messages >= 1);
    // Shutdown unregistered the publisher.
    let left = discovery.list(Query::new("ns")).await.unwrap();
    assert!(left.is_empty(), "still registered: {left:?}");
}

#[tokio::test]
async fn the_callers_token_stops_a_worker_after_what_it_took_is_published() {
    let (engine, endpoint) = engine().await;
    let sink = Arc::new(CollectSink::default());
    let stop = CancellationToken::new();
    let worker = Worker::with_sink(
        EngineListenerConfig::new(&endpoint, "kv", WorkerId(2), BLOCK as usize),
        sink.clone(),
    )
    // Batches wait for the 10 s timer: only the stop can flush them in time.
    .processor(ProcessorConfig::default().batch_timeout(Some(Duration::from_secs(10))))
    .queue_capacity(4)
    .cancellation(&stop)
    .spawn()
    .unwrap();
    within(engine.wait_for_subscribers(1)).await;
    for seq in 0..20 {
        send_batch(&engine, seq);
    }
    within(async {
        while worker.stats().processor.input_events < 20 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(!worker.is_finished());

    stop.cancel();
    within(async {
        while !worker.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // Everything the processor held went out on the way down (coalesced stores).
    let blocks: usize = sink
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.event.data.block_count())
        .sum();
    assert_eq!(blocks, 20);
    let stats = worker.shutdown().await;
    assert_eq!(stats.published_messages, 0, "a sink of our own");
    assert_eq!(stats.publisher, None);
    assert_eq!(stats.processor.input_events, 20);
}

#[tokio::test]
async fn refused_settings_are_named_before_anything_starts() {
    let sink = Arc::new(CollectSink::default());
    let engine = EngineListenerConfig::new("tcp://127.0.0.1:1", "kv", WorkerId(1), 16);
    let err = Worker::with_sink(engine.clone(), sink.clone())
        .queue_capacity(0)
        .spawn()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::Zero {
            field: "queue_capacity"
        }
    );
    let err = Worker::with_sink(engine, sink)
        .processor(ProcessorConfig::default().batch_timeout(Some(Duration::from_secs(60))))
        .validate()
        .unwrap_err();
    assert_eq!(err.field(), "batch_timeout");
    let err = Worker::with_sink(
        EngineListenerConfig::new("tcp://127.0.0.1:1", "kv", WorkerId(1), 0),
        Arc::new(CollectSink::default()),
    )
    .spawn()
    .unwrap_err();
    assert_eq!(err.field(), "block_size");
}

#[tokio::test]
async fn a_publisher_registered_for_another_worker_is_refused() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let publisher = EventPublisher::builder(discovery.clone(), "ns", "w", "kv-events")
        .worker(1, 0)
        .build()
        .await
        .unwrap();
    // The engine's events would be stamped worker 2 while discovery says worker 1.
    let err = Worker::builder(
        EngineListenerConfig::new("tcp://127.0.0.1:1", "kv", WorkerId(2), 16),
        publisher,
    )
    .spawn()
    .unwrap_err();
    assert_eq!(err.field(), "worker_id");
}
