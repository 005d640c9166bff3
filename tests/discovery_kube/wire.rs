//! `KubeDiscovery` against the API test server's TLS and authentication (test audit
//! H5), its paged lists' snapshots, its faults between pages and its throttling
//! (M8, section 3), and an EndpointSlice whose `ready` is null (L2: not ready, as
//! for Dynamo's router).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::{Duration, Instant};

use eventplane::discovery::{
    Discovery, DiscoveryError, DiscoveryEvent, DynamoRecords, KubeDiscovery, Query,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::ListParams;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::kube_api::{KubeApi, TOKEN, fixture};
use crate::suite::{
    NS, added_until_resync, builder, channel, next, populate, reader, resource, synced, worker_in,
};
use crate::support::{DEADLINE_SLACK, within};

/// Every message of `e` and of its sources, one a line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut lines = Vec::new();
    let mut source = Some(e);
    while let Some(err) = source {
        lines.push(err.to_string());
        source = err.source();
    }
    lines.join("\n")
}

/// Waits until the server holds a watch for every collection the reader listed: a
/// watch whose request comes after `drop_watches` is not dropped (the list returns,
/// and the reader is synced, before its watches reach the server).
async fn watches_open(api: &KubeApi) {
    within(async {
        loop {
            let log = api.log();
            let paths = |watch: bool| -> std::collections::BTreeSet<String> {
                log.iter()
                    .filter(|l| l.method == "GET" && l.query.contains_key("watch") == watch)
                    .map(|l| l.path.clone())
                    .collect()
            };
            let listed = paths(false);
            if !listed.is_empty() && listed.is_subset(&paths(true)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Its handler takes the drop generation just after it logs the request.
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A reader of every Dynamo endpoint in `NS` (backoff 10 to 200 ms), synced on "dyn".
async fn dynamo_reader(api: &KubeApi) -> (KubeDiscovery, eventplane::discovery::DiscoveryStream) {
    let d = builder(api)
        .records(DynamoRecords::new())
        .connect()
        .await
        .unwrap();
    let s = synced(&d, Query::new("dyn")).await;
    (d, s)
}

/// A reader of namespace `NS` whose client is configured with `ca` and `token`.
async fn reader_with(api: &KubeApi, ca: Option<&str>, token: Option<&str>) -> KubeDiscovery {
    let ca = ca.map(fixture);
    let config = api.config_with(ca.as_deref(), token);
    KubeDiscovery::builder()
        .client(kube::Client::try_from(config).unwrap())
        .namespaces([NS])
        .connect()
        .await
        .unwrap()
}

/// The test server speaks HTTPS with a bearer token, and what it gives out carries
/// both: its kubeconfig names `https://127.0.0.1:PORT` with the test CA as
/// `certificate-authority-data` and the token; every request of a reader made from
/// it was authorized.
#[tokio::test]
async fn the_server_is_https_with_a_token_and_its_kubeconfig_carries_both() {
    let api = KubeApi::start().await;
    assert!(api.url().starts_with("https://127.0.0.1:"), "{}", api.url());
    let dir = std::env::temp_dir().join(format!("eventplane-kube-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(api.kubeconfig(&dir, NS)).unwrap();
    assert!(text.contains(&format!("server: {}", api.url())), "{text}");
    assert!(text.contains("certificate-authority-data: "), "{text}");
    assert!(text.contains(&format!("token: {TOKEN}")), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
    worker_in(&api, "dyn", 1);
    let d = reader(&api).await;
    assert_eq!(d.list(Query::new("dyn")).await.unwrap().len(), 1);
    let log = api.log();
    assert!(!log.is_empty());
    assert!(
        log.iter().all(|l| l.authorized && l.fault.is_none()),
        "{log:#?}"
    );
}

/// A client with the wrong token, or none, is answered 401 (a `Status`, reason
/// `Unauthorized`) and gets `DiscoveryError::Denied` from `list` and `watch`: typed,
/// not transient, no panic, not an empty view.
#[tokio::test]
async fn a_wrong_or_missing_token_is_denied_with_a_typed_error() {
    let api = KubeApi::start().await;
    worker_in(&api, "dyn", 1);
    for token in [Some("not-the-token-0123456789abcdef"), None] {
        let d = reader_with(&api, Some("ca.pem"), token).await;
        match within(d.list(Query::new("dyn"))).await {
            Err(e @ DiscoveryError::Denied(_)) => assert!(!e.is_transient(), "{e:?}"),
            other => panic!("token {token:?}: expected Denied, got {other:?}"),
        }
        match within(d.watch(Query::new("dyn"), CancellationToken::new())).await {
            Err(DiscoveryError::Denied(_)) => {}
            Err(e) => panic!("token {token:?}: expected Denied, got {e:?}"),
            Ok(_) => panic!("token {token:?}: a watch opened without the token"),
        }
    }
    let log = api.log();
    assert!(!log.is_empty());
    assert!(
        log.iter().all(|l| !l.authorized && l.fault == Some(401)),
        "{log:#?}"
    );
    // The right token reads it.
    let d = reader_with(&api, Some("ca.pem"), Some(TOKEN)).await;
    assert_eq!(d.list(Query::new("dyn")).await.unwrap().len(), 1);
}

/// A client that trusts another CA refuses the server: `Unavailable` naming the
/// certificate, the TLS handshake failed on the server, and no request reached it.
/// Without any CA data kube-rs trusts the system's roots, which do not hold the test
/// CA either (or there are none, and the client is refused before it connects).
#[tokio::test]
async fn a_client_without_the_ca_refuses_the_server() {
    let api = KubeApi::start().await;
    worker_in(&api, "dyn", 1);
    let d = reader_with(&api, Some("other-ca.pem"), Some(TOKEN)).await;
    let e = within(d.list(Query::new("dyn")))
        .await
        .expect_err("listed from a server whose certificate it does not trust");
    assert!(matches!(e, DiscoveryError::Unavailable(_)), "{e:?}");
    let text = chain(&e);
    assert!(
        text.to_lowercase().contains("certificate") || text.contains("UnknownIssuer"),
        "{text}"
    );
    within(async {
        while api.tls_refused() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    match kube::Client::try_from(api.config_with(None, Some(TOKEN))) {
        Err(e) => eprintln!("no system roots: the client is refused before connecting: {e}"),
        Ok(client) => {
            let d = KubeDiscovery::builder()
                .client(client)
                .namespaces([NS])
                .connect()
                .await
                .unwrap();
            let listed = within(d.list(Query::new("dyn"))).await;
            assert!(
                matches!(listed, Err(DiscoveryError::Unavailable(_))),
                "{listed:?}"
            );
        }
    }
    assert!(api.log().is_empty(), "{:#?}", api.log());
}

/// Later pages of a list come from the snapshot of its first page (a real API server
/// serves a paged list at one resourceVersion): a slice written after the first page
/// is not in them, a slice deleted after it still is; a new list sees both changes.
#[tokio::test]
async fn later_pages_of_a_list_come_from_its_first_pages_snapshot() {
    let api = KubeApi::start().await;
    for name in ["a", "c", "e"] {
        api.ready_slice(NS, name, &[]);
    }
    let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(api.client(), NS);
    let names = |list: &kube::api::ObjectList<EndpointSlice>| -> Vec<String> {
        list.items
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect()
    };
    let first = slices.list(&ListParams::default().limit(1)).await.unwrap();
    assert_eq!(names(&first), ["a"]);
    api.ready_slice(NS, "b", &[]);
    api.delete("endpointslices", NS, "e");
    let token = first.metadata.continue_.clone().unwrap();
    let rest = slices
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(names(&rest), ["c", "e"]);
    assert_eq!(
        rest.metadata.resource_version,
        first.metadata.resource_version
    );
    assert!(rest.metadata.continue_.as_deref().unwrap_or("").is_empty());
    let fresh = slices.list(&ListParams::default()).await.unwrap();
    assert_eq!(names(&fresh), ["a", "b", "c"]);
}

/// Lists of `/dynamoworkermetadatas` that were first pages (no continue token).
fn resource_reads(api: &KubeApi) -> usize {
    api.log()
        .iter()
        .filter(|l| {
            l.path.ends_with("/dynamoworkermetadatas")
                && !l.query.contains_key("watch")
                && !l.query.contains_key("continue")
        })
        .count()
}

/// History compacted between two pages of the first read (its continue token
/// answered 410): the read starts again, whole, and the watch gets exactly one
/// `Resync` of every resource; `reconnects` stays 0 (no watch was lost). The same for
/// `list`.
#[tokio::test]
async fn compaction_between_pages_reads_again_with_one_resync_and_no_reconnect() {
    let api = KubeApi::start().await;
    populate(&api, 100);
    let d = builder(&api)
        .records(DynamoRecords::new())
        .page_size(32)
        .connect()
        .await
        .unwrap();
    // The readiness list is one page; the first page of resources is the next, and
    // the continue token after it is gone.
    api.compact_after_pages(1);
    let mut s = d
        .watch(Query::new("dyn"), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(added_until_resync(&mut s, 100).await, 100);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), s.next())
            .await
            .is_err(),
        "more than one Resync"
    );
    assert_eq!(d.stats().reconnects, 0, "{:?}", d.stats());
    // The fault fired: the resources were read from their first page twice.
    assert_eq!(resource_reads(&api), 2);
    api.compact_after_pages(1);
    assert_eq!(d.list(Query::new("dyn")).await.unwrap().len(), 100);
    assert_eq!(resource_reads(&api), 4);
    assert_eq!(d.stats().reconnects, 0);
}

/// Watches opened again while the server throttles (429 with `Retry-After: 1`, twice)
/// wait the second it asks each time (their own backoff is 10 to 200 ms), then follow
/// on: a worker written meanwhile is seen, and nothing was read afresh.
#[tokio::test]
async fn throttled_watches_wait_the_retry_after_and_recover() {
    let api = KubeApi::start().await;
    let (d, mut s) = dynamo_reader(&api).await;
    watches_open(&api).await;
    let before = api.log().len();
    api.throttle(2, Duration::from_secs(1));
    api.drop_watches();
    let started = Instant::now();
    // Both refused, then both open again (a watch request answered after them).
    let log = within(async {
        loop {
            let log = api.log()[before..].to_vec();
            let last_429 = log.iter().rposition(|l| l.fault == Some(429));
            let reopened = last_429.map_or(0, |i| {
                log[i + 1..]
                    .iter()
                    .filter(|l| l.fault.is_none() && l.query.contains_key("watch"))
                    .count()
            });
            if log.iter().filter(|l| l.fault == Some(429)).count() == 2 && reopened >= 2 {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // Each refused request's next attempt (the same collection's) waited the second.
    for (i, refused) in log.iter().enumerate().filter(|(_, l)| l.fault == Some(429)) {
        let retry = log[i + 1..]
            .iter()
            .find(|l| l.path == refused.path)
            .expect("no request after a 429");
        let waited = retry.at.saturating_duration_since(refused.at);
        assert!(
            waited >= Duration::from_millis(900)
                && waited <= Duration::from_secs(1) + DEADLINE_SLACK,
            "the request after a 429 with Retry-After: 1 came {waited:?} later"
        );
    }
    // And it follows on: a worker written now is seen.
    worker_in(&api, "dyn", 1);
    loop {
        if let DiscoveryEvent::Added(i) = next(&mut s).await {
            assert_eq!(i.id.publisher_id(), 1);
            break;
        }
    }
    // Both watches opened again: two answered, after the two refused.
    assert!(
        log.iter().filter(|l| l.fault.is_none()).count() >= 2,
        "{log:#?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(1800));
    assert_eq!(d.stats().reconnects, 0, "{:?}", d.stats());
}

/// 504s (a lagging replica) while the watches are opened again and everything is
/// read afresh after a compaction: retried, and the watch ends in one `Resync` with
/// the worker (`reconnects` 1).
#[tokio::test]
async fn gateway_timeouts_during_a_read_afresh_are_retried() {
    let api = KubeApi::start().await;
    let (d, mut s) = dynamo_reader(&api).await;
    worker_in(&api, "dyn", 1);
    assert!(matches!(next(&mut s).await, DiscoveryEvent::Added(_)));
    // A write neither watch reads, then the compaction: both watches' versions are
    // older than it (the readiness watch's certainly), so one of them is gone.
    watches_open(&api).await;
    api.ready_slice("elsewhere", "bump", &[]);
    api.compact();
    api.gateway_timeouts(3, None);
    api.drop_watches();
    match next(&mut s).await {
        DiscoveryEvent::Resync(all) => assert_eq!(all.len(), 1, "{all:?}"),
        other => panic!("expected a Resync, got {other:?}"),
    }
    assert_eq!(d.stats().reconnects, 1, "{:?}", d.stats());
    let timeouts = api.log().iter().filter(|l| l.fault == Some(504)).count();
    assert_eq!(timeouts, 3);
}

/// An endpoint whose `conditions.ready` is null is not ready, as for Dynamo 1.6.1's
/// router (the API would read it as ready; the view follows Dynamo's), and turns
/// ready when it says true.
#[tokio::test]
async fn an_endpoint_whose_ready_is_null_is_not_ready_as_for_dynamo() {
    let api = KubeApi::start().await;
    let (k, v) = channel("dyn", 1, "tcp://10.0.0.1:1");
    api.put(
        "dynamoworkermetadatas",
        NS,
        resource("w-null", "u-null", json!({"event_channels": {(k): v}})),
    );
    let slice = |ready: serde_json::Value| {
        json!({"metadata": {"name": "s-null",
                 "labels": {"nvidia.com/dynamo-discovery-enabled": "true"}},
               "addressType": "IPv4",
               "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": ready},
                   "targetRef": {"kind": "Pod", "name": "w-null", "uid": "u-null",
                                 "namespace": NS}}]})
    };
    api.put("endpointslices", NS, slice(serde_json::Value::Null));
    let d = reader(&api).await;
    assert!(d.list(Query::new("dyn")).await.unwrap().is_empty());
    api.put("endpointslices", NS, slice(json!(true)));
    let listed = d.list(Query::new("dyn")).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    api.put("endpointslices", NS, slice(json!(false)));
    assert!(d.list(Query::new("dyn")).await.unwrap().is_empty());
}

/// A list the server refuses with a `Retry-After` (429, API Priority and Fairness) is
/// asked again after it, by `list` itself; a refusal without one (a 504 alone) is the
/// caller's at once.
#[tokio::test]
async fn a_list_refused_with_a_retry_after_is_asked_again_after_it() {
    let api = KubeApi::start().await;
    worker_in(&api, "dyn", 1);
    let d = builder(&api)
        .records(DynamoRecords::new())
        .connect()
        .await
        .unwrap();
    let before = api.log().len();
    api.throttle(2, Duration::from_secs(1));
    let started = Instant::now();
    let found = within(d.list(Query::new("dyn"))).await.unwrap();
    let took = started.elapsed();
    assert_eq!(found.len(), 1, "{found:?}");
    let refused = api.log()[before..]
        .iter()
        .filter(|l| l.fault == Some(429))
        .count();
    assert_eq!(refused, 2);
    // Two refusals, a second each.
    assert!(
        took >= Duration::from_millis(1900) && took <= Duration::from_secs(2) + DEADLINE_SLACK,
        "two 429s with Retry-After: 1 took {took:?}"
    );
    api.gateway_timeouts(1, None);
    match within(d.list(Query::new("dyn"))).await {
        Err(e @ DiscoveryError::Unavailable(_)) => assert!(e.is_transient(), "{e:?}"),
        other => panic!("a 504 without Retry-After: expected Unavailable, got {other:?}"),
    }
}
