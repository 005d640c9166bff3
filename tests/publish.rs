//! EventPublisher: OS-assigned port, advertise-host validation, random id within
//! 2^53−1, `[topic, publisher_id, sequence, payload]` from sequence 0, registration and
//! unregistration.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::sync::Arc;

use eventplane::discovery::{Discovery, MAX_PUBLISHER_ID, MemoryDiscovery, Query};
use eventplane::publish::{EventPublisher, PublishError};
use eventplane::zmtp::{Config, SubSocket};
use support::within;

#[tokio::test]
async fn publishes_the_documented_layout_from_sequence_zero() {
    let d = Arc::new(MemoryDiscovery::new());
    let publisher = EventPublisher::builder(d.clone(), "ns", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    let instance = publisher.instance().unwrap().clone();
    assert!(instance.id.publisher_id() <= MAX_PUBLISHER_ID);
    let endpoint = instance.transport.endpoint().to_owned();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    assert!(!endpoint.ends_with(":0"));
    assert_eq!(
        d.list(Query::new("ns")).await.unwrap(),
        vec![instance.clone()]
    );

    let mut sub = within(SubSocket::connect(&endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("kv-events").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    for i in 0..3u8 {
        assert_eq!(publisher.publish(vec![i]).queued, 1);
    }
    for seq in 0..3u64 {
        let m = within(sub.recv()).await.unwrap();
        let parts: Vec<&[u8]> = m.parts().collect();
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0], b"kv-events");
        assert_eq!(parts[1], &instance.id.publisher_id().to_be_bytes());
        assert_eq!(parts[2], &seq.to_be_bytes());
        assert_eq!(parts[3], &[seq as u8]);
    }
    assert_eq!(publisher.next_sequence(), 3);
    assert_eq!(publisher.stats().dropped, 0);
    publisher.shutdown().await;
    assert!(d.list(Query::new("ns")).await.unwrap().is_empty());
}

#[tokio::test]
async fn unspecified_advertise_hosts_are_rejected() {
    let d: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    for host in ["0.0.0.0", "::", "[::]", "*", ""] {
        let err = EventPublisher::builder(d.clone(), "ns", "c", "t")
            .bind_host("0.0.0.0")
            .advertise_host(host)
            .build()
            .await
            .unwrap_err();
        assert!(
            matches!(err, PublishError::AdvertiseHost { .. }),
            "{host}: {err:?}"
        );
    }
    // Binding every interface is fine with a real advertised host.
    let p = EventPublisher::builder(d.clone(), "ns", "c", "t")
        .bind_host("0.0.0.0")
        .advertise_host("127.0.0.1")
        .build()
        .await
        .unwrap();
    assert!(
        p.instance()
            .unwrap()
            .transport
            .endpoint()
            .starts_with("tcp://127.0.0.1:")
    );
    // Nothing was registered for the rejected ones.
    assert_eq!(d.list(Query::new("ns")).await.unwrap().len(), 1);
}

#[tokio::test]
async fn ids_are_random_and_dropping_unregisters() {
    let d = Arc::new(MemoryDiscovery::new());
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let p = EventPublisher::builder(d.clone(), "ns", "c", "t")
            .build()
            .await
            .unwrap();
        let id = p.instance().unwrap().id.publisher_id();
        assert!(id <= MAX_PUBLISHER_ID);
        ids.insert(id);
        drop(p);
    }
    assert_eq!(ids.len(), 20);
    assert!(d.list(Query::new("ns")).await.unwrap().is_empty());
}

#[tokio::test]
async fn waiting_for_subscribers_is_bounded_when_asked() {
    use std::time::Duration;
    let d = Arc::new(MemoryDiscovery::new());
    let publisher = EventPublisher::builder(d.clone(), "ns", "worker", "kv_events")
        .build()
        .await
        .unwrap();
    let endpoint = publisher
        .instance()
        .unwrap()
        .transport
        .endpoint()
        .to_owned();
    // Nobody follows `kv_events` yet: an error naming the endpoint, not a hang.
    let err = publisher
        .wait_for_subscribers_within(1, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            PublishError::NoSubscribers {
                wanted: 1,
                subscribed: 0,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(&endpoint), "{err}");
    // A subscriber arrives: the same call returns at once.
    let mut sub = SubSocket::connect(&endpoint, Config::default())
        .await
        .unwrap();
    sub.subscribe("kv_events").await.unwrap();
    within(publisher.wait_for_subscribers_within(1, Duration::from_secs(10)))
        .await
        .unwrap();
}
