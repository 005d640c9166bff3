//! What every check uses: fresh namespaces and ids, deadlines, convergence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::mirror::{Mirror, normalized, view_as};
use super::{CheckResult, ConformanceFailure, Settings, fail};
use crate::discovery::{
    ChannelId, Discovery, DiscoveryEvent, DiscoveryStream, Instance, Query, Registration, Transport,
};

pub(super) static NAMESPACE_SEQ: AtomicU64 = AtomicU64::new(0);

pub(super) fn namespace(check: &str) -> String {
    format!(
        "conformance-{check}-{}-{}",
        std::process::id(),
        NAMESPACE_SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

pub(super) fn id(ns: &str, component: &str, topic: &str, publisher: u64) -> ChannelId {
    ChannelId::new(ns, component, topic, publisher).unwrap_or_else(|_| {
        // Only reachable with a malformed namespace, which `namespace` never makes.
        unreachable_id()
    })
}

#[allow(clippy::expect_used)]
pub(super) fn unreachable_id() -> ChannelId {
    ChannelId::new("x", "x", "x", 0).expect("valid")
}

pub(super) fn endpoint(n: u64) -> Transport {
    Transport::zmq(format!("tcp://127.0.0.1:{}", 10_000 + n % 50_000))
}

pub(super) async fn register(
    check: &'static str,
    d: &dyn Discovery,
    id: ChannelId,
    n: u64,
) -> Result<Registration, ConformanceFailure> {
    d.register(id, endpoint(n))
        .await
        .map_err(|e| fail(check, format!("register failed: {e}")))
}

pub(super) async fn list(
    check: &'static str,
    d: &dyn Discovery,
    q: Query,
) -> Result<Vec<Instance>, ConformanceFailure> {
    d.list(q)
        .await
        .map_err(|e| fail(check, format!("list failed: {e}")))
}

pub(super) async fn watch(
    check: &'static str,
    d: &dyn Discovery,
    q: Query,
    cancel: CancellationToken,
) -> Result<DiscoveryStream, ConformanceFailure> {
    d.watch(q, cancel)
        .await
        .map_err(|e| fail(check, format!("watch failed: {e}")))
}

pub(super) async fn next_event(
    check: &'static str,
    s: &mut DiscoveryStream,
    deadline: Duration,
) -> Result<DiscoveryEvent, ConformanceFailure> {
    match tokio::time::timeout(deadline, s.next()).await {
        Err(_) => Err(fail(check, "no event within the deadline")),
        Ok(None) => Err(fail(check, "the stream ended")),
        Ok(Some(Err(e))) => Err(fail(check, format!("the stream failed: {e}"))),
        Ok(Some(Ok(ev))) => Ok(ev),
    }
}

/// Consumes events until the mirror equals the backend's `list`.
pub(super) async fn converge(
    check: &'static str,
    d: &dyn Discovery,
    q: &Query,
    s: &mut DiscoveryStream,
    mirror: &mut Mirror,
    settings: &Settings,
) -> CheckResult {
    let target = view_as(settings, &list(check, d, q.clone()).await?);
    let deadline = tokio::time::Instant::now() + settings.deadline;
    while normalized(settings, mirror.state().clone()) != target {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let ev = next_event(check, s, left).await.map_err(|f| {
            fail(
                check,
                format!(
                    "{} (consumer sees {} instances, backend lists {})",
                    f.reason,
                    mirror.state().len(),
                    target.len()
                ),
            )
        })?;
        mirror.apply(&ev);
    }
    Ok(())
}

/// Polls `condition` until it holds, failing with `what` after the deadline.
pub(super) async fn eventually<F, Fut>(
    check: &'static str,
    settings: &Settings,
    what: &str,
    mut condition: F,
) -> CheckResult
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, ConformanceFailure>>,
{
    let deadline = tokio::time::Instant::now() + settings.deadline;
    while !condition().await? {
        if tokio::time::Instant::now() >= deadline {
            return Err(fail(check, what));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

pub(super) async fn unregister(check: &'static str, registration: Registration) -> CheckResult {
    registration
        .unregister()
        .await
        .map_err(|e| fail(check, format!("unregister failed: {e}")))
}

/// Reads the initial sync into a fresh consumer view.
pub(super) async fn synced_mirror(
    check: &'static str,
    s: &mut DiscoveryStream,
    settings: &Settings,
) -> Result<Mirror, ConformanceFailure> {
    let mut mirror = Mirror::default();
    let (added, snapshot) = initial_sync(check, s, settings).await?;
    for i in added {
        mirror.apply(&DiscoveryEvent::Added(i));
    }
    mirror.apply(&DiscoveryEvent::Resync(snapshot));
    Ok(mirror)
}

/// Reads the initial sync: `Added`s up to and including the first `Resync`.
pub(super) async fn initial_sync(
    check: &'static str,
    s: &mut DiscoveryStream,
    settings: &Settings,
) -> Result<(Vec<Instance>, Vec<Instance>), ConformanceFailure> {
    let mut added = Vec::new();
    loop {
        match next_event(check, s, settings.deadline).await? {
            DiscoveryEvent::Added(i) => added.push(i),
            DiscoveryEvent::Resync(all) => return Ok((added, all)),
            other => {
                return Err(fail(check, format!("{other:?} during the initial sync")));
            }
        }
    }
}
