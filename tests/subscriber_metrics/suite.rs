//! The `metrics` feature: the subscriber's counters arrive in an installed recorder.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use eventplane::zmtp::{Config, Message, PubSocket};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Records every counter and gauge by name and sorted labels.
#[derive(Default, Clone)]
struct Capture {
    values: Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>,
}

impl Capture {
    fn handle(&self, key: &Key) -> Arc<AtomicU64> {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        self.values.lock().unwrap().entry(name).or_default().clone()
    }

    fn counter(&self, prefix: &str) -> u64 {
        self.values
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.load(Ordering::Relaxed))
            .sum()
    }
}

impl Recorder for Capture {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.handle(key))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test]
async fn counters_reach_the_metrics_facade() {
    let capture = Capture::default();
    metrics::set_global_recorder(capture.clone()).unwrap();
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let p = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let id = ChannelId::new("ns", "worker", "kv", 42).unwrap();
    let _g = d
        .register(id, Transport::zmq(p.local_endpoint().unwrap()))
        .await
        .unwrap();
    let mut sub = DynamicSubscriber::builder(d, Query::new("ns"))
        .topic("kv")
        .layout(Layout::TopicSeq)
        .spawn()
        .unwrap();
    support::within(p.wait_for_subscribers(1)).await;
    for seq in 0u64..10 {
        p.send(Message::from_parts([
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from_static(b"payload"),
        ]));
    }
    p.send(Message::from_parts(["kv-other", "x", "y"]));
    for _ in 0..10 {
        support::within(sub.recv()).await.unwrap();
    }
    let handle = sub.handle();
    let stop = eventplane::CancellationToken::new();
    let exporter = eventplane::metrics::Exporter::new().source(move || handle.stats());
    tokio::spawn(exporter.run(Duration::from_millis(20), stop.clone()));
    let _stop = stop.drop_guard();
    // No publisher's id, namespace or topic in any label: one series per metric (and
    // per drop reason).
    let delivered = "eventplane_subscriber_delivered_total{}";
    support::within(async {
        while capture.counter(delivered) != 10
            || capture.counter("eventplane_subscriber_dropped_total{reason=filtered_topic}") != 1
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(capture.counter("eventplane_subscriber_received_total"), 11);
    assert_eq!(capture.counter("eventplane_subscriber_gaps_total"), 0);
    assert_eq!(
        capture.counter("eventplane_subscriber_publishers{}"),
        1f64.to_bits()
    );
    let labelled: Vec<String> = capture
        .values
        .lock()
        .unwrap()
        .keys()
        .filter(|k| !k.ends_with("{}"))
        .cloned()
        .collect();
    assert!(
        labelled
            .iter()
            .all(|k| k.contains("{reason=") && !k.contains(',')),
        "{labelled:?}"
    );
}
