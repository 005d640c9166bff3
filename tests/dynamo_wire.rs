//! Dynamo's wire through real sockets: hostile Dynamo frames reach a
//! `DynamicSubscriber` with `Layout::Dynamo` over TCP; each is skipped and counted under
//! its reason, and the connection goes on serving the good messages around them.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventplane::discovery::{MemoryDiscovery, Query, StaticDiscovery};
use eventplane::publish::EventPublisher;
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::wire::{Dialect, MalformedStats};
use eventplane::zmtp::{Config, Message, PubSocket};
use support::within;

fn good(seq: u64, payload: &'static [u8]) -> Message {
    Dialect::Dynamo.encode(
        &Bytes::from_static(b"kv-events"),
        42,
        seq,
        Bytes::from_static(payload),
    )
}

/// `good(seq)` with frame `i` replaced.
fn with_frame(seq: u64, i: usize, frame: Vec<u8>) -> Message {
    let mut parts = good(seq, b"x").into_parts().collect::<Vec<_>>();
    parts[i] = Bytes::from(frame);
    Message::from_parts(parts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_dynamo_frames_are_counted_by_reason_and_the_stream_goes_on() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let discovery = StaticDiscovery::from_endpoints(
        "ns",
        "worker",
        "kv-events",
        [publisher.local_endpoint().unwrap()],
    )
    .unwrap();
    let mut sub = DynamicSubscriber::builder(Arc::new(discovery), Query::new("ns"))
        .topic("kv-events")
        .layout(Layout::Dynamo)
        .spawn()
        .unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    // Warm up: until one good message is through, nothing else is sent.
    let mut seq = 1;
    loop {
        publisher.send(good(seq, b"warm"));
        seq += 1;
        if let Ok(d) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            assert_eq!(d.unwrap().payload().as_deref(), Some(&b"warm"[..]));
            break;
        }
    }
    let before = sub.handle().stats().total;
    let mut frame = good(seq, b"x").get(3).unwrap().to_vec();
    let mut longer = frame.clone();
    longer.push(0);
    frame[0] = 2;
    let hostile = [
        with_frame(seq, 3, frame),                            // header: version 2
        with_frame(seq, 3, vec![1, 0]),                       // header: short
        with_frame(seq, 3, longer),                           // length
        with_frame(seq, 3, vec![1, 0, 0, 0, 1, 0xc1]),        // envelope
        with_frame(seq, 2, (seq + 1).to_be_bytes().to_vec()), // identity: sequence
        with_frame(seq, 1, 43u64.to_be_bytes().to_vec()),     // identity: publisher
        with_frame(seq, 2, vec![0; 7]),                       // frames: 7-byte sequence
        Message::from_parts([&b"kv-events"[..], &[0; 8][..], &[0; 8][..]]), // frames: three
    ];
    for m in hostile {
        publisher.send(m);
    }
    // The subscription is for "kv-events" exactly: a longer topic reaches us and is
    // filtered by the exact-topic check.
    let mut parts = good(seq, b"x").into_parts().collect::<Vec<_>>();
    parts[0] = Bytes::from_static(b"kv-events-2");
    publisher.send(Message::from_parts(parts));
    publisher.send(good(seq, b"after"));
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(d.payload().as_deref(), Some(&b"after"[..]));
    assert_eq!(d.sequence, Some(seq));
    let after = sub.handle().stats().total;
    let mut want = before.malformed;
    want.add(&malformed(2, 2, 1, 1, 2));
    assert_eq!(after.malformed, want);
    assert_eq!(after.dropped_malformed - before.dropped_malformed, 8);
    assert_eq!(
        after.dropped_filtered_topic - before.dropped_filtered_topic,
        1
    );
    assert_eq!(
        after.reconnects, 0,
        "a malformed message must not cost the connection"
    );
}

fn malformed(
    frames: u64,
    header: u64,
    length: u64,
    envelope: u64,
    identity: u64,
) -> MalformedStats {
    let mut m = MalformedStats::default();
    let count = |n: u64, e: eventplane::wire::WireError, m: &mut MalformedStats| {
        for _ in 0..n {
            m.count(&e);
        }
    };
    use eventplane::wire::WireError as E;
    count(frames, E::Frames(0), &mut m);
    count(header, E::Header { version: None }, &mut m);
    count(
        length,
        E::Length {
            declared: 0,
            actual: 0,
        },
        &mut m,
    );
    count(envelope, E::Envelope(""), &mut m);
    count(identity, E::Identity(""), &mut m);
    m
}

/// Our publisher and subscriber on Dynamo's wire through MemoryDiscovery: sequences from
/// 0, consecutive, no gaps, payloads intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_publisher_and_dynamic_subscriber_speak_dynamo() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
        .topic("kv-events")
        .layout(Layout::Dynamo)
        .spawn()
        .unwrap();
    let publisher = EventPublisher::builder(discovery, "ns", "worker", "kv-events")
        .dialect(Dialect::Dynamo)
        .build()
        .await
        .unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    for i in 0..100u32 {
        publisher.publish(i.to_be_bytes().to_vec());
    }
    for i in 0..100u32 {
        let d = within(sub.recv()).await.unwrap();
        assert_eq!(d.sequence, Some(u64::from(i)));
        assert_eq!(d.payload().as_deref(), Some(&i.to_be_bytes()[..]));
        assert_eq!(d.source.id.publisher_id(), publisher.publisher_id());
    }
    // An empty payload is a payload, not a missing one.
    publisher.publish(Vec::new());
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(d.payload().as_deref(), Some(&b""[..]));
    let stats = sub.handle().stats().total;
    assert_eq!(
        (stats.gaps, stats.sequence_resets, stats.dropped()),
        (0, 0, 0),
        "{stats:?}"
    );
}
