//! Every configuration is refused the same way: one `ConfigError` naming the setter,
//! returned by the step that consumes the configuration. Nothing is clamped.

#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use eventplane::ConfigError;
use eventplane::discovery::{MemoryDiscovery, Query};
use eventplane::kv::{
    RouterEvent, WorkerId,
    engine::{EngineDecoder, EngineListener, EngineListenerConfig},
    pipeline::{
        Coalescer, DedupFilter, DedupMode, EventSink, Pipeline, Processor, ProcessorConfig,
        SinkError,
    },
};
use eventplane::lossy::{ITEM_OVERHEAD, Merge, MergeConfig};
use eventplane::net::Backoff;
use eventplane::subscriber::{DynamicSubscriber, DynamicSubscriberBuilder};
use eventplane::zmtp;

struct Nowhere;

impl EventSink for Nowhere {
    fn publish<'a>(
        &'a self,
        _: &'a [RouterEvent],
    ) -> eventplane::BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}

fn field<T: std::fmt::Debug>(r: Result<T, ConfigError>) -> &'static str {
    r.unwrap_err().field()
}

#[test]
fn zmtp_and_lossy_name_the_field() {
    assert_eq!(
        field(zmtp::Config::builder().max_message_parts(0).build()),
        "max_message_parts"
    );
    assert_eq!(
        field(zmtp::Config::builder().max_frame_size(32 << 20).build()),
        "max_frame_size"
    );
    for (name, config) in [
        ("lane_capacity", MergeConfig::default().lane_capacity(0)),
        ("lane_bytes", MergeConfig::default().lane_bytes(0)),
        (
            "max_buffered_bytes",
            MergeConfig::default().max_buffered_bytes(0),
        ),
    ] {
        assert_eq!(field(Merge::<u8>::new(config)), name);
    }
    // A byte bound that cannot hold one item's bookkeeping would drop everything.
    assert_eq!(
        field(Merge::<u8>::new(
            MergeConfig::default().lane_bytes(ITEM_OVERHEAD)
        )),
        "lane_bytes"
    );
    assert!(Merge::<u8>::new(MergeConfig::default().lane_bytes(ITEM_OVERHEAD + 1)).is_ok());
    assert!(Merge::<u8>::new(MergeConfig::default().lane_capacity(1)).is_ok());
    let ms = Duration::from_millis;
    assert_eq!(field(Backoff::new(ms(0), ms(1))), "backoff");
    assert_eq!(field(Backoff::new(ms(2), ms(1))), "backoff");
    assert_eq!(
        field(Backoff::new(ms(1), ms(2)).unwrap().with_multiplier(0.5)),
        "multiplier"
    );
    // Heartbeat TTLs are deciseconds on the wire: below one, the peer would see none.
    let hb = || zmtp::Config::builder().heartbeat_interval(Some(Duration::from_secs(1)));
    assert_eq!(
        field(hb().heartbeat_ttl(Some(ms(50))).build()),
        "heartbeat_ttl"
    );
    assert_eq!(
        field(
            zmtp::Config::builder()
                .heartbeat_timeout(Some(Duration::from_secs(1)))
                .build()
        ),
        "heartbeat_timeout"
    );
}

#[test]
fn memory_discovery_names_the_field() {
    assert_eq!(
        field(MemoryDiscovery::builder().ttl(Duration::ZERO).build()),
        "ttl"
    );
    assert_eq!(
        field(MemoryDiscovery::builder().watch_buffer(0).build()),
        "watch_buffer"
    );
    assert!(MemoryDiscovery::builder().watch_buffer(1).build().is_ok());
}

#[tokio::test]
async fn the_subscriber_refuses_before_it_starts() {
    let builder = || DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns"));
    let ms = Duration::from_millis;
    let cases: Vec<(&str, DynamicSubscriberBuilder)> = vec![
        ("lane_capacity", builder().lane_capacity(0)),
        ("lane_bytes", builder().lane_bytes(0)),
        ("max_buffered_bytes", builder().max_buffered_bytes(0)),
        ("recv_batch", builder().recv_batch(0)),
        ("max_publishers", builder().max_publishers(0)),
        ("max_concurrent_dials", builder().max_concurrent_dials(0)),
        (
            "reconnect_backoff",
            builder().reconnect_backoff(ms(0), ms(10)),
        ),
        (
            "reconnect_backoff",
            builder().reconnect_backoff(ms(20), ms(10)),
        ),
        ("rewatch_backoff", builder().rewatch_backoff(ms(20), ms(10))),
    ];
    for (name, b) in cases {
        assert_eq!(b.validate().unwrap_err().field(), name);
        assert_eq!(field(b.spawn()), name);
    }
    let sub = builder().recv_batch(1).max_publishers(1).spawn().unwrap();
    sub.handle().shutdown().await;
}

#[test]
fn the_kv_pipeline_names_the_field() {
    assert_eq!(field(Coalescer::new(0)), "max_batch_blocks");
    assert_eq!(
        field(Pipeline::new(0, DedupMode::RefCounted)),
        "max_batch_blocks"
    );
    assert_eq!(
        field(DedupFilter::new(DedupMode::RefCounted).with_limits(0, 1)),
        "max_hashes"
    );
    assert_eq!(
        field(DedupFilter::new(DedupMode::RefCounted).with_limits(1, 0)),
        "max_ranks"
    );
    assert_eq!(field(EngineDecoder::new(WorkerId(1), 0)), "block_size");
    assert_eq!(
        field(
            EngineDecoder::new(WorkerId(1), 4)
                .unwrap()
                .with_limits(0, 1)
        ),
        "max_elements"
    );

    let processor = |config: ProcessorConfig| {
        let (_tx, rx) = tokio::sync::mpsc::channel(1);
        Processor::new(config, rx, Arc::new(Nowhere)).map(drop)
    };
    let base = ProcessorConfig::default;
    for (name, config) in [
        ("max_batch_blocks", base().max_batch_blocks(0)),
        ("dedup_limits", base().dedup_limits(0, 64)),
        ("batch_timeout", base().batch_timeout(Some(Duration::ZERO))),
        (
            "batch_timeout",
            base().batch_timeout(Some(Duration::from_secs(16))),
        ),
        ("publish_timeout", base().publish_timeout(Duration::ZERO)),
    ] {
        assert_eq!(config.validate().unwrap_err().field(), name);
        assert_eq!(field(processor(config)), name);
    }
    assert!(processor(base().batch_timeout(Some(Duration::from_secs(15)))).is_ok());

    let listener = |config: EngineListenerConfig| {
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        EngineListener::new(config, tx).map(drop)
    };
    let config =
        |block_size| EngineListenerConfig::new("tcp://127.0.0.1:1", "kv", WorkerId(1), block_size);
    let ms = Duration::from_millis;
    for (name, c) in [
        ("block_size", config(0)),
        (
            "endpoint",
            EngineListenerConfig::new("127.0.0.1:5557", "kv", WorkerId(1), 4),
        ),
        ("batch_limits", config(4).batch_limits(0, 1)),
        (
            "reconnect_backoff",
            config(4).reconnect_backoff(ms(0), ms(1)),
        ),
        (
            "reconnect_backoff",
            config(4).reconnect_backoff(ms(2), ms(1)),
        ),
    ] {
        assert_eq!(c.validate().unwrap_err().field(), name);
        assert_eq!(field(listener(c)), name);
    }
    assert!(listener(config(4)).is_ok());
}
