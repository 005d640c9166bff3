//! Dynamo's discovery records on a real etcd, and the processes end to end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use eventplane::discovery::conformance::{self, Mirror, Settings};
use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream, DynamoRecords,
    EtcdDiscovery, Query, RecordFormat, Transport,
};
use serde_json::Value;
use support::etcd::EtcdServer;
use support::within;
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(3);
/// The identity of the captured Dynamo worker.
const CAPTURED_ID: u64 = 3_390_985_166_245_404;

fn capture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/dynamo-1.6.1-capture.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

async fn connect(url: &str, records: DynamoRecords) -> EtcdDiscovery {
    EtcdDiscovery::builder([url])
        .lease_ttl(TTL)
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .record_format(RecordFormat::Dynamo(records))
        .connect()
        .await
        .unwrap()
}

fn worker() -> DynamoRecords {
    DynamoRecords::new().endpoint("generate").worker(77, 0)
}

async fn next(s: &mut DiscoveryStream) -> DiscoveryEvent {
    within(s.next())
        .await
        .expect("stream ended")
        .expect("stream failed")
}

async fn synced(s: &mut DiscoveryStream) -> Mirror {
    let mut m = Mirror::default();
    until(s, &mut m, |m| m.resyncs() == 1).await;
    m
}

async fn until(s: &mut DiscoveryStream, mirror: &mut Mirror, done: impl Fn(&Mirror) -> bool) {
    while !done(mirror) {
        let ev = next(s).await;
        mirror.apply(&ev);
    }
}

/// `etcdctl get --prefix` as (key, value) pairs.
fn get_prefix(server: &EtcdServer, prefix: &str) -> Vec<(String, String)> {
    let out = server.etcdctl(&["get", "--prefix", prefix]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .map(|kv| {
            (
                kv[0].to_owned(),
                kv.get(1).copied().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_records_conform_on_real_etcd() {
    let server = EtcdServer::start().await;
    let url = server.url();
    let settings = Settings::default()
        .with_ttl(TTL)
        .with_overflow_churn(1500)
        .with_deadline(Duration::from_secs(20));
    let failures = conformance::run_all(
        || {
            let url = url.clone();
            async move {
                Arc::new(
                    EtcdDiscovery::builder([url])
                        .lease_ttl(TTL)
                        .watch_buffer(256)
                        .page_size(4)
                        .record_format(RecordFormat::Dynamo(worker()))
                        .connect()
                        .await
                        .unwrap(),
                ) as Arc<dyn Discovery>
            }
        },
        &settings,
    )
    .await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// What we register is key- and JSON-equal to what the Dynamo 1.6.1 worker wrote for
/// the same identity, both records on our lease; unregistering deletes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_records_equal_the_captured_ones() {
    let capture = capture();
    let server = EtcdServer::start().await;
    let d = connect(&server.url(), worker()).await;
    let id = ChannelId::new("capns", "kvworker", "kv-events", CAPTURED_ID).unwrap();
    let endpoint = capture["endpoint"].as_str().unwrap();
    let g = d.register(id, Transport::zmq(endpoint)).await.unwrap();
    let ours: Vec<(String, String)> = [
        get_prefix(&server, "v1/event_channels/"),
        get_prefix(&server, "v1/event_sources/"),
    ]
    .concat();
    let theirs = capture["etcd"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len(), "{ours:?}");
    for ((key, value), captured) in ours.iter().zip(theirs) {
        assert_eq!(key, captured["key"].as_str().unwrap());
        let ours: Value = serde_json::from_str(value).unwrap();
        let theirs: Value = serde_json::from_str(captured["value"].as_str().unwrap()).unwrap();
        assert_eq!(ours, theirs, "{key}");
        // Byte-equal too: same field order, same number forms.
        assert_eq!(value, captured["value"].as_str().unwrap());
    }
    let ttl = server.etcdctl(&[
        "lease",
        "timetolive",
        &format!("{:x}", d.lease_id()),
        "--keys",
    ]);
    for (key, _) in &ours {
        assert!(ttl.contains(key.as_str()), "{key} not on our lease: {ttl}");
    }
    within(g.unregister()).await.unwrap();
    assert!(get_prefix(&server, "v1/").is_empty());
}

/// The captured records, written by "Dynamo" (etcdctl), are followed: a watch with no
/// endpoint sees the publisher at the captured endpoint. Records of other scopes or
/// transports are skipped and counted; another endpoint's records are not followed by
/// a watch narrowed to one endpoint, and not counted either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_records_are_followed_and_hostile_ones_counted() {
    let capture = capture();
    let server = EtcdServer::start().await;
    let router = connect(&server.url(), DynamoRecords::new()).await;
    let narrowed = connect(&server.url(), DynamoRecords::new().endpoint("generate")).await;
    let mut w = router
        .watch(
            Query::new("capns").component("kvworker").topic("kv-events"),
            CancellationToken::new(),
        )
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    for record in capture["etcd"].as_array().unwrap() {
        server.etcdctl(&[
            "put",
            record["key"].as_str().unwrap(),
            record["value"].as_str().unwrap(),
        ]);
    }
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![CAPTURED_ID]).await;
    let listed = router.list(Query::new("capns")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].transport.endpoint(),
        capture["endpoint"].as_str().unwrap()
    );
    assert_eq!(listed[0].id.component(), "kvworker");

    // Another endpoint of the same component: followed by the router (every endpoint),
    // not by the narrowed backend, which does not count it as malformed either.
    let other = capture["etcd"][0]["value"]
        .as_str()
        .unwrap()
        .replace("\"name\":\"generate\"", "\"name\":\"prefill\"")
        .replace(&CAPTURED_ID.to_string(), "5");
    server.etcdctl(&[
        "put",
        "v1/event_channels/namespace/capns/component/kvworker/endpoint/prefill/topic/kv-events/5",
        &other,
    ]);
    until(&mut w, &mut m, |m| {
        m.publisher_ids() == vec![5, CAPTURED_ID]
    })
    .await;
    let narrowed_ids: Vec<u64> = narrowed
        .list(Query::new("capns"))
        .await
        .unwrap()
        .iter()
        .map(|i| i.id.publisher_id())
        .collect();
    assert_eq!(narrowed_ids, vec![CAPTURED_ID]);
    assert_eq!(narrowed.stats().malformed, 0);

    // Hostile records: skipped and counted, the watch keeps serving.
    let before = router.stats().malformed;
    let key = |n: &str| {
        format!(
            "v1/event_channels/namespace/capns/component/kvworker/endpoint/generate/topic/kv-events/{n}"
        )
    };
    let channel = capture["etcd"][0]["value"].as_str().unwrap().to_owned();
    for (k, v) in [
        (key("6"), "not json".to_owned()),
        // The value names another instance than its key.
        (key("7"), channel.clone()),
        (
            key("8"),
            channel
                .replace(&CAPTURED_ID.to_string(), "8")
                .replace("\"Zmq\"", "\"Nats\""),
        ),
        (
            key("9"),
            channel
                .replace(&CAPTURED_ID.to_string(), "9")
                .replace(r#""kind":"endpoint""#, r#""kind":"namespace""#),
        ),
        (key("zz"), "{}".to_owned()),
    ] {
        server.etcdctl(&["put", &k, &v]);
    }
    // A later valid change still arrives: the captured worker stops.
    server.etcdctl(&["del", capture["etcd"][0]["key"].as_str().unwrap()]);
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![5]).await;
    assert_eq!(router.stats().malformed - before, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_without_a_worker_is_refused_clearly() {
    let server = EtcdServer::start().await;
    let router = connect(&server.url(), DynamoRecords::new().endpoint("generate")).await;
    let err = router
        .register(
            ChannelId::new("ns", "c", "t", 1).unwrap(),
            Transport::zmq("tcp://127.0.0.1:1"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, DiscoveryError::InvalidConfig { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("worker") || format!("{err:?}").contains("worker"),
        "{err:?}"
    );
}

/// A lease lost behind our back: both records come back under the new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lease_puts_both_records_back() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url(), worker()).await;
    let g = d
        .register(
            ChannelId::new("lease", "c", "kv-events", 1).unwrap(),
            Transport::zmq("tcp://127.0.0.1:1"),
        )
        .await
        .unwrap();
    let old = d.lease_id();
    server.etcdctl(&["lease", "revoke", &format!("{old:x}")]);
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        let lease = d.lease_id();
        let keys = get_prefix(&server, "v1/");
        if lease != old && keys.len() == 2 {
            let ttl = server.etcdctl(&["lease", "timetolive", &format!("{lease:x}"), "--keys"]);
            if keys.iter().all(|(k, _)| ttl.contains(k.as_str())) {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "records not back: {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    within(g.unregister()).await.unwrap();
    assert!(get_prefix(&server, "v1/").is_empty());
}
