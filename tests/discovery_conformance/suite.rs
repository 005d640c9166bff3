//! The conformance suite passes for `MemoryDiscovery` and is strong enough to fail
//! backends that break the contract: five deliberately broken toy backends each
//! fail the check for the rule they break.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use eventplane::discovery::conformance::{self, ConformanceFailure, Settings};
use eventplane::discovery::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStream,
    FaultDiscovery, Instance, MemoryDiscovery, Query, Registration, Transport, WorkerIdentity,
};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

/// Generous bound on what a toy waits for, so a bug fails the test instead of hanging
/// it. Not a timing assertion.
const DEADLINE: Duration = Duration::from_secs(30);

fn memory() -> Arc<dyn Discovery> {
    Arc::new(
        MemoryDiscovery::builder()
            .ttl(Duration::from_secs(10))
            .build()
            .unwrap(),
    )
}

#[tokio::test(start_paused = true)]
async fn memory_discovery_conforms() {
    let settings = Settings::default().with_ttl(Duration::from_secs(10));
    let failures = conformance::run_all(|| async { memory() }, &settings).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test]
async fn memory_discovery_conforms_in_real_time() {
    let failures = conformance::run_all(|| async { memory() }, &Settings::default()).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

#[tokio::test(start_paused = true)]
async fn fault_wrapper_without_faults_conforms() {
    let failures = conformance::run_all(
        || async { Arc::new(FaultDiscovery::new(memory()).0) as Arc<dyn Discovery> },
        &Settings::default(),
    )
    .await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Delegates to a `MemoryDiscovery`; `watch` is overridden per toy.
#[derive(Debug)]
struct Toy {
    inner: MemoryDiscovery,
    kind: Broken,
}

#[derive(Debug, Clone, Copy)]
enum Broken {
    /// Never emits a `Resync`: consumers cannot tell "empty" from "not synced yet".
    NoResync,
    /// Lists, then subscribes a moment later: changes in between are lost.
    GapBetweenListAndWatch,
    /// Delivers the removal of the old incarnation after a re-registration.
    StaleRemoval,
    /// Ends the stream when its buffer overflows instead of resyncing.
    DisconnectOnOverflow,
    /// Stores registrations without the worker identity they were given.
    ForgetsWorker,
}

impl Discovery for Toy {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        // The fifth toy keeps the endpoint and forgets whose worker it is.
        let worker = if matches!(self.kind, Broken::ForgetsWorker) {
            None
        } else {
            worker
        };
        self.inner.register_with(id, transport, worker)
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        self.inner.list(query)
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        Box::pin(async move {
            match self.kind {
                Broken::NoResync => {
                    let s = self.inner.watch(query, cancel).await?;
                    Ok(DiscoveryStream::new(s.filter(|ev| {
                        std::future::ready(!matches!(ev, Ok(DiscoveryEvent::Resync(_))))
                    })))
                }
                Broken::GapBetweenListAndWatch => {
                    let snapshot = self.inner.list(query.clone()).await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    // The check of this rule registers an instance a millisecond while
                    // the watch is set up: make sure one lands in the gap, however late
                    // its registrations run on a loaded machine (the other checks
                    // register nothing meanwhile: they get the plain 20 ms).
                    if query
                        .namespace_filter()
                        .starts_with("conformance-no_gap_between_snapshot_and_watch-")
                    {
                        let deadline = tokio::time::Instant::now() + DEADLINE;
                        loop {
                            let now = self.inner.list(query.clone()).await?;
                            if now.iter().any(|i| !snapshot.contains(i)) {
                                break;
                            }
                            assert!(
                                tokio::time::Instant::now() < deadline,
                                "no registration in the list-to-watch gap in {DEADLINE:?} \
                                 ({} listed, as in the snapshot)",
                                now.len()
                            );
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    let live = self.inner.watch(query, cancel).await?;
                    let mut initial: Vec<Result<DiscoveryEvent, DiscoveryError>> = snapshot
                        .iter()
                        .cloned()
                        .map(|i| Ok(DiscoveryEvent::Added(i)))
                        .collect();
                    initial.push(Ok(DiscoveryEvent::Resync(snapshot)));
                    // Skip the live watch's own initial sync.
                    let mut synced = false;
                    let live = live.filter(move |ev| {
                        let pass = synced;
                        if matches!(ev, Ok(DiscoveryEvent::Resync(_))) {
                            synced = true;
                        }
                        std::future::ready(pass)
                    });
                    Ok(DiscoveryStream::new(
                        futures_util::stream::iter(initial).chain(live),
                    ))
                }
                Broken::StaleRemoval => {
                    let s = self.inner.watch(query, cancel).await?;
                    let mut seen: HashMap<ChannelId, u64> = HashMap::new();
                    Ok(DiscoveryStream::new(s.flat_map(move |ev| {
                        let mut out = vec![];
                        let stale = match &ev {
                            Ok(DiscoveryEvent::Added(i)) => seen
                                .insert(i.id.clone(), i.incarnation)
                                .map(|old| (i.id.clone(), old)),
                            _ => None,
                        };
                        out.push(ev);
                        if let Some((id, incarnation)) = stale {
                            out.push(Ok(DiscoveryEvent::Removed { id, incarnation }));
                        }
                        futures_util::stream::iter(out)
                    })))
                }
                Broken::DisconnectOnOverflow => {
                    let s = self.inner.watch(query, cancel).await?;
                    let mut resyncs = 0;
                    Ok(DiscoveryStream::new(s.take_while(move |ev| {
                        if matches!(ev, Ok(DiscoveryEvent::Resync(_))) {
                            resyncs += 1;
                        }
                        std::future::ready(resyncs <= 1)
                    })))
                }
                Broken::ForgetsWorker => self.inner.watch(query, cancel).await,
            }
        })
    }
}

fn toy(kind: Broken) -> Arc<dyn Discovery> {
    let buffer = match kind {
        Broken::DisconnectOnOverflow => 64,
        _ => 1024,
    };
    Arc::new(Toy {
        inner: MemoryDiscovery::builder()
            .watch_buffer(buffer)
            .build()
            .unwrap(),
        kind,
    })
}

async fn failures_of(kind: Broken) -> Vec<ConformanceFailure> {
    // A broken backend makes checks wait for events that never come: keep that short.
    let settings = Settings::default().with_deadline(Duration::from_secs(2));
    conformance::run_all(|| async move { toy(kind) }, &settings).await
}

fn failed_checks(failures: &[ConformanceFailure]) -> Vec<&'static str> {
    failures.iter().map(|f| f.check).collect()
}

#[tokio::test]
async fn suite_catches_missing_resync() {
    let failures = failures_of(Broken::NoResync).await;
    let checks = failed_checks(&failures);
    assert!(checks.contains(&"initial_sync"), "{failures:#?}");
    assert!(checks.contains(&"empty_initial_resync"), "{failures:#?}");
}

#[tokio::test]
async fn suite_catches_gap_between_list_and_watch() {
    let failures = failures_of(Broken::GapBetweenListAndWatch).await;
    assert!(
        failed_checks(&failures).contains(&"no_gap_between_snapshot_and_watch"),
        "{failures:#?}"
    );
}

#[tokio::test]
async fn suite_catches_stale_removal() {
    let failures = failures_of(Broken::StaleRemoval).await;
    assert_eq!(
        failed_checks(&failures),
        vec!["stale_removal_suppressed"],
        "{failures:#?}"
    );
}

#[tokio::test]
async fn suite_catches_disconnect_on_overflow() {
    let failures = failures_of(Broken::DisconnectOnOverflow).await;
    assert!(
        failed_checks(&failures).contains(&"overflow_collapses_into_resync"),
        "{failures:#?}"
    );
}

#[tokio::test]
async fn suite_catches_a_forgotten_worker_identity() {
    let failures = failures_of(Broken::ForgetsWorker).await;
    assert_eq!(
        failed_checks(&failures),
        vec!["worker_identity"],
        "{failures:#?}"
    );
}

#[tokio::test]
async fn fault_injection() {
    let (discovery, faults) = FaultDiscovery::new(memory());
    let id = ChannelId::new("ns", "c", "t", 1).unwrap();
    let _g = discovery
        .register(id.clone(), Transport::zmq("tcp://127.0.0.1:1"))
        .await
        .unwrap();

    // A backend-side Resync with the current set.
    let mut w = discovery
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    assert!(matches!(w.next().await, Some(Ok(DiscoveryEvent::Added(_)))));
    assert!(matches!(
        w.next().await,
        Some(Ok(DiscoveryEvent::Resync(_)))
    ));
    assert_eq!(faults.open_watches(), 1);
    faults.inject_resync();
    match w.next().await {
        Some(Ok(DiscoveryEvent::Resync(all))) => assert_eq!(all.len(), 1),
        other => panic!("{other:?}"),
    }

    // Ending watches.
    faults.end_watches();
    assert!(w.next().await.is_none());
    drop(w);
    assert_eq!(faults.open_watches(), 0);

    // Failing watch calls, then a working one.
    faults.fail_next_watch_calls(2);
    for _ in 0..2 {
        let err = discovery
            .watch(Query::new("ns"), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(err.is_transient());
    }
    let mut w = discovery
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    assert!(w.next().await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn fault_delay_holds_events() {
    let (discovery, faults) = FaultDiscovery::new(memory());
    let mut w = discovery
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    assert!(w.next().await.unwrap().is_ok());
    faults.delay_events(Some(Duration::from_secs(5)));
    let start = tokio::time::Instant::now();
    let _g = discovery
        .register(
            ChannelId::new("ns", "c", "t", 1).unwrap(),
            Transport::zmq("tcp://127.0.0.1:1"),
        )
        .await
        .unwrap();
    assert!(matches!(w.next().await, Some(Ok(DiscoveryEvent::Added(_)))));
    assert_eq!(start.elapsed(), Duration::from_secs(5));
}
