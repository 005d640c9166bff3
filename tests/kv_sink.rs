//! The event-plane sink: message splitting, named-field msgpack, and a router that
//! decodes exactly what the worker published — over real TCP.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use eventplane::wire::Dialect;
use std::sync::Arc;

use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId,
    pipeline::{EventPlaneSink, Processor, ProcessorConfig, split_messages},
};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{DynamicSubscriber, Layout};
use support::cases::cases;
use support::within;

fn router_event(id: u64, blocks: usize) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(5),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 1,
            data: KvEventData::Removed {
                block_hashes: (0..blocks as u64).map(BlockHash).collect(),
            },
        },
    }
}

#[test]
fn splitting_respects_both_limits_and_keeps_everything() {
    cases(256, |rng| {
        let sizes = rng.vec(0..600, |r| r.range(0..400));
        let events: Vec<RouterEvent> = sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| router_event(i as u64, b))
            .collect();
        let messages: Vec<&[RouterEvent]> = split_messages(&events, 128, 8192).collect();
        let mut joined = Vec::new();
        for m in &messages {
            assert!(!m.is_empty() && m.len() <= 128);
            let blocks: usize = m.iter().map(|e| e.event.data.block_count()).sum();
            assert!(blocks <= 8192 || m.len() == 1);
            joined.extend_from_slice(m);
        }
        assert_eq!(joined, events);
    });
}

#[test]
fn a_single_event_over_the_block_limit_travels_alone() {
    let events = vec![
        router_event(1, 10),
        router_event(2, 9000),
        router_event(3, 10),
    ];
    let sizes: Vec<usize> = split_messages(&events, 128, 8192).map(<[_]>::len).collect();
    assert_eq!(sizes, vec![1, 1, 1]);
}

#[test]
fn payload_uses_named_fields_and_round_trips() {
    let events = vec![
        router_event(1, 3),
        RouterEvent {
            worker_id: WorkerId(u64::MAX),
            tier: StorageTier::HostPinned,
            event: KvEvent {
                id: 2,
                dp_rank: 0,
                data: KvEventData::Stored {
                    parent_hash: Some(BlockHash(u64::MAX)),
                    blocks: vec![StoredBlock {
                        block_hash: BlockHash(7),
                        tokens_hash: TokensHash(8),
                    }],
                },
            },
        },
    ];
    let bytes = Dialect::EventPlane.encode_router_events(&events).unwrap();
    for name in [
        "worker_id",
        "tier",
        "dp_rank",
        "block_hashes",
        "parent_hash",
        "tokens_hash",
    ] {
        assert!(
            bytes.windows(name.len()).any(|w| w == name.as_bytes()),
            "{name}"
        );
    }
    assert_eq!(
        Dialect::EventPlane.decode_router_events(&bytes).unwrap(),
        events
    );
}

#[test]
fn hostile_payloads_are_errors() {
    for bad in [
        &b""[..],
        b"\xc1",
        b"\xdd\xff\xff\xff\xff",
        b"\x91\xde\xff\xff",
        b"\x91\x83\xa9worker_id\x01",
    ] {
        assert!(
            Dialect::EventPlane.decode_router_events(bad).is_err(),
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn worker_to_router_over_the_event_plane() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let publisher = Arc::new(
        EventPublisher::builder(discovery.clone(), "ns", "worker", "kv-events")
            .build()
            .await
            .unwrap(),
    );
    let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
        .topic("kv-events")
        .layout(Layout::TopicPublisherSeq)
        .spawn()
        .unwrap();
    within(publisher.wait_for_subscribers(1)).await;

    let sink = Arc::new(EventPlaneSink::new(publisher.clone()));
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let processor = Processor::new(ProcessorConfig::default(), rx, sink.clone()).unwrap();
    let at = Placement {
        worker_id: WorkerId(5),
        dp_rank: 0,
        tier: StorageTier::Device,
    };
    // 300 events in one list, none mergeable (alternating kinds): 3 messages.
    let list: Vec<PlacementEvent> = (0..300u64)
        .map(|i| PlacementEvent {
            placement: at,
            event: KvEvent {
                id: i,
                dp_rank: 0,
                data: if i % 2 == 0 {
                    KvEventData::Stored {
                        parent_hash: None,
                        blocks: vec![StoredBlock {
                            block_hash: BlockHash(i),
                            tokens_hash: TokensHash(i),
                        }],
                    }
                } else {
                    KvEventData::Removed {
                        block_hashes: vec![BlockHash(i - 1)],
                    }
                },
            },
        })
        .collect();
    tx.send(list).await.unwrap();
    drop(tx);
    let stats = processor.run().await;
    assert_eq!(stats.output_events, 300);
    assert_eq!(sink.messages(), 3);

    let mut received = Vec::new();
    while received.len() < 300 {
        let d = within(router.recv()).await.unwrap();
        received.extend(
            Dialect::EventPlane
                .decode_router_events(d.message.get(3).unwrap())
                .unwrap(),
        );
    }
    let ids: Vec<u64> = received.iter().map(|e| e.event.id).collect();
    assert_eq!(ids, (1..=300).collect::<Vec<_>>());
    assert_eq!(router.stats().total.gaps, 0);
}
