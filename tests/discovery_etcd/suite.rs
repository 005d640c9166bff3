//! `EtcdDiscovery` against a real etcd started by the harness: the conformance suite,
//! the public record format, hostile records, and faults (etcd killed and restarted, a
//! partition, a revoked lease, compaction, two processes).
//!
//! No test sleeps a fixed time to wait for etcd: each waits for the condition.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use eventplane::discovery::conformance::{self, Mirror, Settings};
use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream, EtcdDiscovery,
    EtcdState, Instance, Query, Transport,
};
use support::etcd::{EtcdServer, Proxy};
use support::{DEADLINE, within};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(3);

async fn connect(url: &str) -> EtcdDiscovery {
    EtcdDiscovery::builder([url])
        .lease_ttl(TTL)
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .connect()
        .await
        .unwrap()
}

fn id(ns: &str, n: u64) -> ChannelId {
    ChannelId::new(ns, "worker", "kv-events", n).unwrap()
}

fn endpoint(n: u64) -> Transport {
    Transport::zmq(format!("tcp://127.0.0.1:{}", 20_000 + n))
}

async fn next(s: &mut DiscoveryStream) -> DiscoveryEvent {
    within(s.next())
        .await
        .expect("stream ended")
        .expect("stream failed")
}

/// Applies events until `done` holds for the mirror.
async fn until(s: &mut DiscoveryStream, mirror: &mut Mirror, done: impl Fn(&Mirror) -> bool) {
    while !done(mirror) {
        let ev = next(s).await;
        mirror.apply(&ev);
    }
}

async fn synced(s: &mut DiscoveryStream) -> Mirror {
    let mut m = Mirror::default();
    until(s, &mut m, |m| m.resyncs() == 1).await;
    m
}

async fn wait_for<F: Fn() -> bool>(what: &str, condition: F) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `condition` holds, failing if that takes longer than `bound`: a timing
/// assertion, unlike [`wait_for`].
async fn within_bound<F: Fn() -> bool>(what: &str, bound: Duration, condition: F) {
    let started = tokio::time::Instant::now();
    while !condition() {
        assert!(started.elapsed() < bound, "not within {bound:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The key of `id(ns, n)` (the public layout).
fn key_of(ns: &str, n: u64) -> String {
    format!("/eventplane/v1/channels/{ns}/worker/kv-events/{n:x}")
}

/// The keys under namespace `ns`, each with the lease it is attached to.
async fn keys_in(raw: &mut etcd_client::Client, ns: &str) -> BTreeMap<String, i64> {
    let response = raw
        .get(
            format!("/eventplane/v1/channels/{ns}/"),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    response
        .kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_owned(), kv.lease()))
        .collect()
}

/// Waits until the keys under `ns` are exactly `want`, each on `d`'s current lease.
async fn until_keys(
    raw: &mut etcd_client::Client,
    d: &EtcdDiscovery,
    ns: &str,
    want: &BTreeSet<String>,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let lease = d.lease_id();
        let found = keys_in(raw, ns).await;
        if found.keys().eq(want.iter()) && found.values().all(|l| *l == lease) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "keys under {ns}: {found:?} (our lease {lease}), want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `fut` for a while, then drops it unless it finished (`Some(output)`). Step 0
/// polls it once; odd steps give it `step` × 40 µs; other even steps poll it `step` + 1
/// times, letting the runtime run in between. Growing steps drop it at every point:
/// before its request, while etcd applies it, after.
async fn cut_short<F: Future>(fut: F, step: u64) -> Option<F::Output> {
    if step % 2 == 1 {
        return tokio::time::timeout(Duration::from_micros(40 * step), fut)
            .await
            .ok();
    }
    let mut fut = std::pin::pin!(fut);
    for _ in 0..=step {
        let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        if let Poll::Ready(output) = polled {
            return Some(output);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// The conformance suite, in both record formats: ours and Dynamo's (which a worker
/// registers with an endpoint and a worker id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conforms_on_real_etcd() {
    use eventplane::discovery::DynamoRecords;
    use eventplane::wire::Dialect;
    let server = EtcdServer::start().await;
    let url = server.url();
    let settings = Settings::default()
        .with_ttl(TTL)
        .with_overflow_churn(1500)
        .with_deadline(Duration::from_secs(20));
    for (dialect, records) in [
        (Dialect::EventPlane, None),
        (
            Dialect::Dynamo,
            Some(DynamoRecords::new().endpoint("generate").worker(77, 0)),
        ),
    ] {
        let failures = conformance::run_all(
            || {
                let (url, records) = (url.clone(), records.clone());
                async move {
                    // Small pages: every snapshot in the suite is read in several.
                    let mut builder = EtcdDiscovery::builder([url])
                        .lease_ttl(TTL)
                        .watch_buffer(256)
                        .page_size(4)
                        .dialect(dialect);
                    if let Some(records) = records {
                        builder = builder.records(records);
                    }
                    Arc::new(builder.connect().await.unwrap()) as Arc<dyn Discovery>
                }
            },
            &match dialect {
                // Dynamo keeps the worker in `event_sources`, which the reader does not join.
                Dialect::Dynamo => settings.clone().without_worker_identity(),
                _ => settings.clone(),
            },
        )
        .await;
        assert!(failures.is_empty(), "{dialect}: {failures:#?}");
    }
}

#[tokio::test]
async fn connect_fails_clearly_when_etcd_is_unreachable() {
    // A port nothing listens on.
    let (_held, port) = support::refusing_port();
    let url = format!("http://127.0.0.1:{port}");
    let err = EtcdDiscovery::builder([&url])
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, DiscoveryError::Unavailable(_)), "{err:?}");
    assert!(err.is_transient());
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("status") && chain.contains(&url), "{chain}");

    for (field, bad) in [
        ("endpoints", EtcdDiscovery::builder(Vec::<String>::new())),
        ("prefix", EtcdDiscovery::builder([&url]).prefix("no-slash")),
        (
            "lease_ttl",
            EtcdDiscovery::builder([&url]).lease_ttl(Duration::from_millis(500)),
        ),
        (
            "watch_buffer",
            EtcdDiscovery::builder([&url]).watch_buffer(0),
        ),
    ] {
        let err = bad.connect().await.unwrap_err();
        assert!(
            matches!(&err, DiscoveryError::InvalidConfig(e) if e.field() == field),
            "{field}: {err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_follow_the_public_format_and_foreign_writers_are_read() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let g = d
        .register(id("fmt", 0x2a), Transport::zmq("tcp://10.0.0.5:41234"))
        .await
        .unwrap();
    let out = server.etcdctl(&["get", "--prefix", "/eventplane/v1/channels/fmt/"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/eventplane/v1/channels/fmt/worker/kv-events/2a");
    let value: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(
        value,
        serde_json::json!({
            "id": {"namespace": "fmt", "component": "worker", "topic": "kv-events", "publisher_id": 42},
            "transport": {"kind": "zmq", "endpoint": "tcp://10.0.0.5:41234"}
        })
    );
    let lease = format!("{:x}", d.lease_id());
    let ttl = server.etcdctl(&["lease", "timetolive", &lease, "--keys"]);
    assert!(
        ttl.contains("/eventplane/v1/channels/fmt/worker/kv-events/2a"),
        "{ttl}"
    );

    // Another writer (any language) registers by putting the same JSON, with extra
    // fields; hostile and malformed records are skipped and counted.
    let mut w = d
        .watch(Query::new("fmt"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    assert_eq!(m.publisher_ids(), vec![42]);
    server.etcdctl(&[
        "put",
        "/eventplane/v1/channels/fmt/worker/kv-events/7",
        r#"{"id":{"namespace":"fmt","component":"worker","topic":"kv-events","publisher_id":7,"zone":"b"},"transport":{"kind":"zmq","endpoint":"tcp://10.0.0.6:1"},"version":3}"#,
    ]);
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![7, 42]).await;
    let before = d.stats().malformed;
    for (key, value) in [
        ("/eventplane/v1/channels/fmt/worker/kv-events/8", "not json"),
        (
            "/eventplane/v1/channels/fmt/worker/kv-events/9",
            r#"{"id":{"namespace":"fmt","component":"worker","topic":"kv-events","publisher_id":10},"transport":{"kind":"zmq","endpoint":"x"}}"#,
        ),
        ("/eventplane/v1/channels/fmt/worker/kv-events/zz", "{}"),
        (
            "/eventplane/v1/channels/fmt/worker/kv-events/b",
            r#"{"id":{"namespace":"fmt","component":"worker","topic":"kv-events","publisher_id":11},"transport":{"kind":"carrier-pigeon","endpoint":"x"}}"#,
        ),
        // A valid record turned garbage: the publisher it named is gone.
        ("/eventplane/v1/channels/fmt/worker/kv-events/7", "[[[[["),
    ] {
        server.etcdctl(&["put", key, value]);
    }
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![42]).await;
    // The watch keeps serving: a later valid change still arrives.
    drop(g);
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
    assert_eq!(d.stats().malformed - before, 5);
    // list skips (and counts) the same records.
    assert!(d.list(Query::new("fmt")).await.unwrap().is_empty());
    assert_eq!(d.stats().malformed - before, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_etcd_restart_and_resyncs_what_changed_while_down() {
    let mut server = EtcdServer::start().await;
    let proxy = Proxy::start(server.addr()).await;
    let writer = connect(&server.url()).await;
    let watcher = connect(&proxy.url()).await;
    let a = writer.register(id("rs", 1), endpoint(1)).await.unwrap();
    let _b = writer.register(id("rs", 2), endpoint(2)).await.unwrap();
    let mut w = watcher
        .watch(Query::new("rs"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    assert_eq!(m.publisher_ids(), vec![1, 2]);

    // The watcher is cut off, etcd crashes and comes back; while the watcher is still
    // away, one registration is deleted and another added.
    proxy.cut().await;
    server.stop();
    server.restart().await;
    within(a.unregister()).await.unwrap();
    let _c = within(writer.register(id("rs", 3), endpoint(3)))
        .await
        .unwrap();
    proxy.restore();

    let resyncs = m.resyncs();
    until(&mut w, &mut m, |m| m.resyncs() > resyncs).await;
    assert_eq!(
        m.publisher_ids(),
        vec![2, 3],
        "the Resync reflects the deletion"
    );
    assert!(watcher.stats().reconnects >= 1);
    let listed: Vec<u64> = writer
        .list(Query::new("rs"))
        .await
        .unwrap()
        .iter()
        .map(|i| i.id.publisher_id())
        .collect();
    assert_eq!(listed.len(), 2);
    // Both sessions are live again.
    wait_for("writer live", || writer.state() == EtcdState::Live).await;
    wait_for("watcher live", || watcher.state() == EtcdState::Live).await;

    // And incremental events flow after the resync.
    drop(_b);
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![3]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_after_etcd_restart_without_a_partition() {
    let mut server = EtcdServer::start().await;
    let writer = connect(&server.url()).await;
    let watcher = connect(&server.url()).await;
    let a = writer.register(id("kill", 1), endpoint(1)).await.unwrap();
    let mut w = watcher
        .watch(Query::new("kill"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    server.stop();
    server.restart().await;
    // The watcher comes back by itself with a Resync; changes after it arrive.
    until(&mut w, &mut m, |m| m.resyncs() == 2).await;
    assert_eq!(m.publisher_ids(), vec![1]);
    within(a.unregister()).await.unwrap();
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lease_comes_back_by_itself() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let observer = connect(&server.url()).await;
    let g = d.register(id("lease", 1), endpoint(1)).await.unwrap();
    let first = g.instance().incarnation;
    let mut w = observer
        .watch(Query::new("lease"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    let old_lease = d.lease_id();

    // Revoked behind our back (an operator, or etcd expiring it during a long stall).
    server.etcdctl(&["lease", "revoke", &format!("{old_lease:x}")]);
    let removal = next(&mut w).await;
    assert!(
        matches!(&removal, DiscoveryEvent::Removed { id: gone, .. } if gone.publisher_id() == 1),
        "expected the revocation's Removed, got {removal:?}"
    );
    m.apply(&removal);
    // The keep-alive notices, grants a new lease and puts the registration again.
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![1]).await;
    let (_, incarnation) = m.state().values().next().unwrap().clone();
    assert!(incarnation > first);
    // The re-grant finishes its bookkeeping right after its last put.
    wait_for("new lease recorded", || d.lease_id() != old_lease).await;
    assert_eq!(d.stats().lease_losses, 1);
    wait_for("live", || d.state() == EtcdState::Live).await;

    // The guard still controls the re-put registration.
    within(g.unregister()).await.unwrap();
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
    assert!(d.list(Query::new("lease")).await.unwrap().is_empty());
}

/// Cut off from etcd for longer than the TTL, a publisher's lease expires (watchers
/// see it go); the session reports `Reconnecting`, and once etcd is reachable again it
/// grants a new lease and puts the registration back by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_longer_than_the_ttl_loses_the_lease_and_recovers() {
    let server = EtcdServer::start().await;
    let proxy = Proxy::start(server.addr()).await;
    let publisher = connect(&proxy.url()).await;
    let observer = connect(&server.url()).await;
    let mut states = publisher.state_changes();
    let _g = publisher
        .register(id("part", 1), endpoint(1))
        .await
        .unwrap();
    let mut w = observer
        .watch(Query::new("part"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    assert_eq!(m.publisher_ids(), vec![1]);

    proxy.cut().await;
    // etcd expires the lease after the TTL: the observer sees the registration go.
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
    within(states.wait_for(|s| *s == EtcdState::Reconnecting))
        .await
        .unwrap();

    proxy.restore();
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![1]).await;
    within(states.wait_for(|s| *s == EtcdState::Live))
        .await
        .unwrap();
    assert_eq!(publisher.stats().lease_losses, 1);
    assert_eq!(publisher.stats().registrations, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_reconnecting_past_a_compaction_resyncs() {
    let server = EtcdServer::start().await;
    let proxy = Proxy::start(server.addr()).await;
    let writer = connect(&server.url()).await;
    let watcher = connect(&proxy.url()).await;
    let a = writer.register(id("cmp", 1), endpoint(1)).await.unwrap();
    let mut w = watcher
        .watch(Query::new("cmp"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    let seen = server.revision();

    proxy.cut().await;
    within(a.unregister()).await.unwrap();
    let mut keep = Vec::new();
    for n in 10..20 {
        let g = within(writer.register(id("cmp", n), endpoint(n)))
            .await
            .unwrap();
        if n % 2 == 0 {
            keep.push(g);
        }
    }
    let now = server.revision();
    assert!(now > seen + 10);
    // Compact everything the watcher could resume from.
    server.etcdctl(&["compact", &now.to_string()]);
    proxy.restore();

    let resyncs = m.resyncs();
    until(&mut w, &mut m, |m| m.resyncs() > resyncs).await;
    assert_eq!(m.publisher_ids(), vec![10, 12, 14, 16, 18]);
    drop(keep);
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_revokes_every_registration_and_detach_expires() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let observer = connect(&server.url()).await;
    let _a = d.register(id("close", 1), endpoint(1)).await.unwrap();
    let b = d.register(id("close", 2), endpoint(2)).await.unwrap();
    let mut w = observer
        .watch(Query::new("close"), CancellationToken::new())
        .await
        .unwrap();
    let mut m = synced(&mut w).await;
    assert_eq!(d.stats().registrations, 2);
    // A detached registration is not revoked with the lease: it expires on its own.
    b.detach();
    wait_for("detach carried out", || d.stats().registrations == 1).await;
    d.close().await;
    until(&mut w, &mut m, |m| m.publisher_ids() == vec![2]).await;
    until(&mut w, &mut m, |m| m.state().is_empty()).await;
    assert!(matches!(
        d.register(id("close", 3), endpoint(3)).await,
        Err(DiscoveryError::Closed)
    ));
}

/// Records too large for one read (5 × 1 MiB against the client's 4 MiB message
/// limit) neither break `list` nor a watch's sync: the page shrinks, the records are
/// skipped as oversized, the good ones are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_records_do_not_break_reads() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let _good = d.register(id("big", 1), endpoint(1)).await.unwrap();
    let mut raw = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let huge = "x".repeat(1 << 20);
    for n in 2..7u64 {
        raw.put(
            format!("/eventplane/v1/channels/big/worker/kv-events/{n:x}"),
            format!(
                r#"{{"id":{{"namespace":"big","component":"worker","topic":"kv-events","publisher_id":{n}}},"transport":{{"kind":"zmq","endpoint":"{huge}"}}}}"#
            ),
            None,
        )
        .await
        .unwrap();
    }
    let listed = d.list(Query::new("big")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(d.stats().malformed, 5);
    let mut w = d
        .watch(Query::new("big"), CancellationToken::new())
        .await
        .unwrap();
    let m = synced(&mut w).await;
    assert_eq!(m.publisher_ids(), vec![1]);
}

/// Dropping every handle deletes the registrations and gives the lease back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_last_handle_releases_everything() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let lease = format!("{:x}", d.lease_id());
    let g = d.register(id("drop", 1), endpoint(1)).await.unwrap();
    assert!(server.etcdctl(&["lease", "list"]).contains(&lease));
    drop(d); // the guard keeps the session alive
    assert!(server.etcdctl(&["lease", "list"]).contains(&lease));
    drop(g);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while server.etcdctl(&["lease", "list"]).contains(&lease)
        || !server
            .etcdctl(&["get", "--prefix", "/eventplane/v1/channels/drop/"])
            .trim()
            .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease never released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The whole fan-in over etcd: an `EventPublisher` registered through one backend, a
/// `DynamicSubscriber` watching through another; a second publisher joins, the first
/// leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_subscriber_follows_publishers_through_etcd() {
    use eventplane::publish::EventPublisher;
    use eventplane::subscriber::{DynamicSubscriber, Layout};

    let server = EtcdServer::start().await;
    let workers: Arc<dyn Discovery> = Arc::new(connect(&server.url()).await);
    let router: Arc<dyn Discovery> = Arc::new(connect(&server.url()).await);
    let mut sub = DynamicSubscriber::builder(router, Query::new("e2e").component("worker"))
        .topic("kv-events")
        .layout(Layout::TopicPublisherSeq)
        .spawn()
        .unwrap();
    let first = EventPublisher::builder(workers.clone(), "e2e", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    let first_id = first.instance().unwrap().id.publisher_id();
    within(first.wait_for_subscribers(1)).await;
    first.publish(&b"one"[..]);
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(d.source.id.publisher_id(), first_id);
    assert_eq!(d.sequence, Some(0));

    let second = EventPublisher::builder(workers.clone(), "e2e", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    let second_id = second.instance().unwrap().id.publisher_id();
    within(second.wait_for_subscribers(1)).await;
    second.publish(&b"two"[..]);
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(d.source.id.publisher_id(), second_id);

    within(first.shutdown()).await;
    wait_for("first publisher dropped", || {
        sub.handle().stats().publishers.len() == 1
    })
    .await;
    second.publish(&b"three"[..]);
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(
        (d.source.id.publisher_id(), d.sequence),
        (second_id, Some(1))
    );
    let stats = sub.handle().stats();
    assert_eq!(stats.total.dropped(), 0, "{stats:?}");
}

/// A record planted in etcd that points at the cloud metadata address is never dialled:
/// the subscriber refuses it by address and counts it; real publishers are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_metadata_endpoint_is_refused_and_counted() {
    use eventplane::publish::EventPublisher;
    use eventplane::subscriber::{DynamicSubscriber, Layout};

    let server = EtcdServer::start().await;
    server.etcdctl(&[
        "put",
        "/eventplane/v1/channels/ssrf/worker/kv-events/666",
        r#"{"id":{"namespace":"ssrf","component":"worker","topic":"kv-events","publisher_id":1638},"transport":{"kind":"zmq","endpoint":"tcp://169.254.169.254:80"}}"#,
    ]);
    let discovery: Arc<dyn Discovery> = Arc::new(connect(&server.url()).await);
    let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ssrf"))
        .topic("kv-events")
        .layout(Layout::TopicPublisherSeq)
        .spawn()
        .unwrap();
    let real = EventPublisher::builder(discovery, "ssrf", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    within(real.wait_for_subscribers(1)).await;
    real.publish(&b"ok"[..]);
    let d = within(sub.recv()).await.unwrap();
    assert_eq!(d.source.id.publisher_id(), real.publisher_id());
    let handle = sub.handle();
    wait_for("the planted record refused", || {
        handle.stats().total.refused_by_filter >= 1
    })
    .await;
    let stats = handle.stats();
    assert_eq!(stats.total.connect_failures, 0, "{stats:?}");
}

/// etcd with authentication enabled: the right credentials work end to end; wrong
/// ones, or none, fail with `Denied` (not retryable), never with a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_on_an_etcd_with_auth_enabled() {
    let server = EtcdServer::start().await;
    server.etcdctl(&["user", "add", "root:rootpw"]);
    server.etcdctl(&["auth", "enable"]);

    let d = EtcdDiscovery::builder([server.url()])
        .credentials("root", "rootpw")
        .lease_ttl(TTL)
        .connect()
        .await
        .unwrap();
    let g = d.register(id("auth", 1), endpoint(1)).await.unwrap();
    let mut w = d
        .watch(Query::new("auth"), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(synced(&mut w).await.publisher_ids(), vec![1]);
    g.unregister().await.unwrap();
    assert!(format!("{d:?}").contains("endpoints") && !format!("{d:?}").contains("rootpw"));

    let wrong = EtcdDiscovery::builder([server.url()])
        .credentials("root", "nope")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(wrong, DiscoveryError::Denied(_)), "{wrong:?}");
    assert!(!wrong.is_transient());
    let anonymous = EtcdDiscovery::connect([server.url()]).await.unwrap_err();
    assert!(
        matches!(anonymous, DiscoveryError::Denied(_)),
        "{anonymous:?}"
    );
}

/// A `register` future dropped at any point (before its put, while etcd applies it,
/// right after) leaves no key on our lease, and a lease re-grant puts none back; the
/// registrations that completed keep their keys and guards. A re-registration of a
/// live id dropped part-way leaves the key to the live registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_register_future_dropped_part_way_leaves_no_key_behind() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let mut raw = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();

    let mut kept = Vec::new();
    let mut dropped = 0;
    for n in 0..160 {
        match cut_short(d.register(id("cxl", n), endpoint(n)), n).await {
            Some(registration) => kept.push(registration.unwrap()),
            None => dropped += 1,
        }
    }
    assert!(
        dropped > 0,
        "every register finished before it could be dropped"
    );
    let want: BTreeSet<String> = kept
        .iter()
        .map(|r| key_of("cxl", r.instance().id.publisher_id()))
        .collect();
    until_keys(&mut raw, &d, "cxl", &want).await;
    assert_eq!(d.stats().registrations, kept.len());

    // The lease is lost: the re-grant puts back what is held, and nothing else.
    let old_lease = d.lease_id();
    server.etcdctl(&["lease", "revoke", &format!("{old_lease:x}")]);
    wait_for("new lease", || d.lease_id() != old_lease).await;
    until_keys(&mut raw, &d, "cxl", &want).await;
    for registration in kept {
        within(registration.unregister()).await.unwrap();
    }
    until_keys(&mut raw, &d, "cxl", &BTreeSet::new()).await;
    assert_eq!(d.stats().registrations, 0);

    // Re-registering a live id, dropped part-way: whichever registration completed
    // last owns the key, with its endpoint, and its guard still removes it.
    let mut live = d.register(id("recxl", 1), endpoint(0)).await.unwrap();
    let mut abandoned = 0;
    for n in 1..120 {
        match cut_short(d.register(id("recxl", 1), endpoint(n)), n).await {
            // Replaces the registration; the earlier guard no longer owns the key.
            Some(replacement) => live = replacement.unwrap(),
            None => abandoned += 1,
        }
    }
    assert!(
        abandoned > 0,
        "every re-register finished before it could be dropped"
    );
    let expected = live.instance().transport.clone();
    until_keys(&mut raw, &d, "recxl", &BTreeSet::from([key_of("recxl", 1)])).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let listed = d.list(Query::new("recxl")).await.unwrap();
        if matches!(listed.as_slice(), [only] if only.transport == expected) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "listed {listed:?}, want {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    within(live.unregister()).await.unwrap();
    until_keys(&mut raw, &d, "recxl", &BTreeSet::new()).await;
    assert_eq!(d.stats().registrations, 0);
}

/// An `unregister` future dropped at any point, then the lease lost: the re-grant
/// puts back only the registration still held, never one whose unregister was
/// dropped, and every dropped unregister still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregister_future_dropped_part_way_is_not_undone_by_a_lease_regrant() {
    let server = EtcdServer::start().await;
    let d = connect(&server.url()).await;
    let mut raw = etcd_client::Client::connect([server.url()], None)
        .await
        .unwrap();
    let held = d.register(id("unr", 1000), endpoint(1000)).await.unwrap();
    let mut registrations = Vec::new();
    for n in 0..120 {
        registrations.push(within(d.register(id("unr", n), endpoint(n))).await.unwrap());
    }
    let mut dropped = 0;
    for (n, registration) in (0..).zip(registrations) {
        match cut_short(registration.unregister(), n).await {
            Some(result) => result.unwrap(),
            None => dropped += 1,
        }
    }
    assert!(
        dropped > 0,
        "every unregister finished before it could be dropped"
    );

    // Lost right away, likely before the session task finished the dropped ones.
    let old_lease = d.lease_id();
    server.etcdctl(&["lease", "revoke", &format!("{old_lease:x}")]);
    wait_for("new lease", || d.lease_id() != old_lease).await;
    wait_for("live", || d.state() == EtcdState::Live).await;
    until_keys(&mut raw, &d, "unr", &BTreeSet::from([key_of("unr", 1000)])).await;
    wait_for("one registration left", || d.stats().registrations == 1).await;
    assert_eq!(d.stats().lease_losses, 1);

    within(held.unregister()).await.unwrap();
    until_keys(&mut raw, &d, "unr", &BTreeSet::new()).await;
    assert_eq!(d.stats().registrations, 0);
}

/// A watch cancelled, or dropped, while it re-establishes against an etcd that does
/// not answer (or is gone) stops at once, not after its request timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_cancelled_while_it_reconnects_stops_promptly() {
    let mut server = EtcdServer::start().await;
    let proxy = Proxy::start(server.addr()).await;
    // Long request timeouts: a watch that looked at its token only between attempts
    // would take that long to stop.
    let slow = |url: String| async move {
        EtcdDiscovery::builder([url])
            .lease_ttl(TTL)
            .request_timeout(Duration::from_secs(25))
            .backoff(Duration::from_millis(10), Duration::from_millis(50))
            .connect()
            .await
            .unwrap()
    };
    let hung = slow(proxy.url()).await; // etcd stops answering it
    let down = slow(server.url()).await; // etcd is gone
    let hung_cancel = CancellationToken::new();
    let mut hung_cancelled = hung
        .watch(Query::new("wc"), hung_cancel.clone())
        .await
        .unwrap();
    let mut hung_dropped = hung
        .watch(Query::new("wc"), CancellationToken::new())
        .await
        .unwrap();
    let down_cancel = CancellationToken::new();
    let mut down_cancelled = down
        .watch(Query::new("wc"), down_cancel.clone())
        .await
        .unwrap();
    for w in [&mut hung_cancelled, &mut hung_dropped, &mut down_cancelled] {
        synced(w).await;
    }
    assert_eq!((hung.stats().watchers, down.stats().watchers), (2, 1));

    proxy.blackhole().await;
    server.stop();
    // The watches' streams fail and they re-establish: through the proxy, the read
    // hangs on a connection nobody answers.
    wait_for("a request hangs in the black hole", || proxy.held() >= 1).await;
    // Not a wait for etcd: lets every watch get well into its re-establish. The
    // assertions below hold whatever step each watch is at.
    tokio::time::sleep(Duration::from_millis(300)).await;

    hung_cancel.cancel();
    down_cancel.cancel();
    drop(hung_dropped);
    assert!(within(hung_cancelled.next()).await.is_none());
    assert!(within(down_cancelled.next()).await.is_none());
    within_bound("the watch tasks stopped", Duration::from_secs(3), || {
        hung.stats().watchers == 0 && down.stats().watchers == 0
    })
    .await;
}

/// Env var naming what a child process does (see `child_process`).
const CHILD_ENV: &str = "EVENTPLANE_ETCD_CHILD";

/// Two separate OS processes (this test binary, re-run) each register and watch for
/// the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_watch_each_other() {
    let server = EtcdServer::start().await;
    let exe = std::env::current_exe().unwrap();
    let spawn = |me: u64, peer: u64| {
        tokio::process::Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "suite::child_process",
                "--nocapture",
            ])
            .env(CHILD_ENV, format!("{} {me} {peer}", server.url()))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let mut a = spawn(1, 2);
    let mut b = spawn(2, 1);
    let mut a_out = BufReader::new(a.stdout.take().unwrap()).lines();
    let mut b_out = BufReader::new(b.stdout.take().unwrap()).lines();
    async fn expect(
        lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
        want: &str,
    ) {
        loop {
            let line = within(lines.next_line())
                .await
                .unwrap()
                .expect("child exited");
            if line == want {
                return;
            }
        }
    }
    expect(&mut a_out, "CHILD saw 2").await;
    expect(&mut b_out, "CHILD saw 1").await;
    // A leaves (unregistering); B sees it go.
    a.stdin.take().unwrap().write_all(b"exit\n").await.unwrap();
    assert!(within(a.wait()).await.unwrap().success());
    expect(&mut b_out, "CHILD gone 1").await;
    b.stdin.take().unwrap().write_all(b"exit\n").await.unwrap();
    assert!(within(b.wait()).await.unwrap().success());
    assert!(
        server
            .etcdctl(&["get", "--prefix", "/eventplane/v1/channels/procs/"])
            .trim()
            .is_empty()
    );
}

/// Run only as a child of `two_processes_watch_each_other`.
#[tokio::test]
#[ignore = "run as a child process by two_processes_watch_each_other"]
async fn child_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.split(' ');
    let url = parts.next().unwrap().to_owned();
    let me: u64 = parts.next().unwrap().parse().unwrap();
    let peer: u64 = parts.next().unwrap().parse().unwrap();
    let d = connect(&url).await;
    let g = d
        .register(
            ChannelId::new("procs", "worker", "kv-events", me).unwrap(),
            endpoint(me),
        )
        .await
        .unwrap();
    let mut w = d
        .watch(Query::new("procs"), CancellationToken::new())
        .await
        .unwrap();
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut known: Vec<Instance> = Vec::new();
    let mut announced = false;
    loop {
        tokio::select! {
            line = stdin.next_line() => {
                if matches!(line, Ok(Some(ref l)) if l == "exit") || matches!(line, Ok(None) | Err(_)) {
                    break;
                }
            }
            ev = w.next() => {
                let ev = ev.unwrap().unwrap();
                match ev {
                    DiscoveryEvent::Added(i) => known.push(i),
                    DiscoveryEvent::Removed { id, .. } => {
                        known.retain(|i| i.id != id);
                        if id.publisher_id() == peer {
                            println!("CHILD gone {peer}");
                        }
                    }
                    DiscoveryEvent::Resync(all) => known = all,
                    _ => {}
                }
                if !announced && known.iter().any(|i| i.id.publisher_id() == peer) {
                    announced = true;
                    println!("CHILD saw {peer}");
                }
            }
        }
    }
    g.unregister().await.unwrap();
}
