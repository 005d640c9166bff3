//! One check per rule of the watch contract, and the register / list / TTL checks.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::harness::{
    converge, endpoint, eventually, id, initial_sync, list, namespace, next_event, register,
    synced_mirror, unregister, watch,
};
use super::mirror::{Mirror, view_as};
use super::{CheckResult, Settings, fail};
use crate::discovery::{
    ChannelId, Discovery, DiscoveryEvent, DiscoveryStream, Instance, Query, WorkerIdentity,
};

/// Rule 2: one `Added` per matching instance, then exactly one `Resync` with them.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_initial_sync, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_initial_sync(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_initial_sync(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "initial_sync";
    let ns = namespace(C);
    let mut guards = Vec::new();
    for n in 0..3 {
        guards.push(register(C, d, id(&ns, "comp", "t", n), n).await?);
    }
    guards.push(register(C, d, id(&ns, "comp2", "t", 9), 9).await?);
    let other = namespace(C);
    guards.push(register(C, d, id(&other, "comp", "t", 1), 1).await?);
    let q = Query::new(&ns).component("comp");
    let mut s = watch(C, d, q, CancellationToken::new()).await?;
    let (added, snapshot) = initial_sync(C, &mut s, settings).await?;
    // Listed before the watch began: exact incarnations only where the backend has
    // them.
    let inc = |i: &Instance| {
        if settings.exact_incarnations {
            i.incarnation
        } else {
            0
        }
    };
    let expected: BTreeSet<(ChannelId, u64)> = guards
        .iter()
        .take(3)
        .map(|g| (g.instance().id.clone(), inc(g.instance())))
        .collect();
    let got_added: BTreeSet<(ChannelId, u64)> =
        added.iter().map(|i| (i.id.clone(), inc(i))).collect();
    let got_snapshot: BTreeSet<(ChannelId, u64)> =
        snapshot.iter().map(|i| (i.id.clone(), inc(i))).collect();
    if added.len() != 3 || got_added != expected {
        return Err(fail(
            C,
            format!("expected 3 Added for the matching instances, got {added:?}"),
        ));
    }
    if got_snapshot != expected {
        return Err(fail(
            C,
            format!("Resync {snapshot:?} is not the matching set"),
        ));
    }
    if let Ok(Some(ev)) = tokio::time::timeout(settings.quiet, s.next()).await {
        return Err(fail(
            C,
            format!("spurious event after the initial sync: {ev:?}"),
        ));
    }
    Ok(())
}

/// Rule 2: an empty match still ends its initial sync with `Resync([])`.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_empty_initial_resync, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_empty_initial_resync(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_empty_initial_resync(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "empty_initial_resync";
    let ns = namespace(C);
    let mut s = watch(C, d, Query::new(ns), CancellationToken::new()).await?;
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Resync(all) if all.is_empty() => Ok(()),
        other => Err(fail(C, format!("expected Resync([]), got {other:?}"))),
    }
}

/// Rule 1: changes made while `watch` is being established are never lost.
///
/// Registrations run before, during and after the `watch` call; the consumer drains
/// events as they come (so no buffer overflows and no `Resync` can paper over a gap),
/// and must end up with exactly the listed set.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_no_gap_between_snapshot_and_watch, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_no_gap_between_snapshot_and_watch(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_no_gap_between_snapshot_and_watch(
    d: &dyn Discovery,
    settings: &Settings,
) -> CheckResult {
    const C: &str = "no_gap_between_snapshot_and_watch";
    let ns = namespace(C);
    let q = Query::new(&ns);
    let mut guards = Vec::new();
    let mut s: Option<DiscoveryStream> = None;
    let mut mirror = Mirror::default();
    let mut watch_fut = Some(d.watch(q.clone(), CancellationToken::new()));
    // Register one instance per millisecond while the watch is being set up, so that
    // registrations straddle its establishment.
    for n in 0..200u64 {
        guards.push(register(C, d, id(&ns, "c", "t", n), n).await?);
        if n == 5 {
            let Some(fut) = watch_fut.take() else { break };
            let both = async {
                let mut more = Vec::new();
                let mut fut = fut;
                let mut k = 1000u64;
                loop {
                    tokio::select! {
                        r = &mut fut => return (r, more),
                        () = tokio::time::sleep(Duration::from_millis(1)) => {
                            if let Ok(g) = d.register(id(&ns, "c", "t", k), endpoint(k)).await {
                                more.push(g);
                            }
                            k += 1;
                        }
                    }
                }
            };
            let (r, more) = both.await;
            guards.extend(more);
            s = Some(r.map_err(|e| fail(C, format!("watch failed: {e}")))?);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if let Some(s) = s.as_mut() {
            // Drain without waiting: `timeout` polls the stream once before its
            // zero deadline counts.
            while let Ok(Some(ev)) = tokio::time::timeout(Duration::ZERO, s.next()).await {
                let ev = ev.map_err(|e| fail(C, format!("the stream failed: {e}")))?;
                mirror.apply(&ev);
            }
        }
    }
    let Some(mut s) = s else {
        return Err(fail(C, "watch never started"));
    };
    converge(C, d, &q, &mut s, &mut mirror, settings).await
}

/// Rule 3: `Added` on register, `Removed` with the incarnation on unregister and on
/// guard drop.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_incremental_changes, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_incremental_changes(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_incremental_changes(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "incremental_changes";
    let ns = namespace(C);
    let mut s = watch(C, d, Query::new(&ns), CancellationToken::new()).await?;
    initial_sync(C, &mut s, settings).await?;
    let a = register(C, d, id(&ns, "c", "t", 1), 1).await?;
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Added(i) if i == *a.instance() => {}
        other => return Err(fail(C, format!("expected Added(a), got {other:?}"))),
    }
    let b = register(C, d, id(&ns, "c", "t", 2), 2).await?;
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Added(i) if i == *b.instance() => {}
        other => return Err(fail(C, format!("expected Added(b), got {other:?}"))),
    }
    let (a_id, a_inc) = (a.instance().id.clone(), a.instance().incarnation);
    unregister(C, a).await?;
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Removed { id, incarnation } if id == a_id && incarnation == a_inc => {}
        other => return Err(fail(C, format!("expected Removed(a), got {other:?}"))),
    }
    let (b_id, b_inc) = (b.instance().id.clone(), b.instance().incarnation);
    drop(b);
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Removed { id, incarnation } if id == b_id && incarnation == b_inc => {}
        other => {
            return Err(fail(
                C,
                format!("expected Removed(b) after its guard dropped, got {other:?}"),
            ));
        }
    }
    Ok(())
}

/// Rule 4: a watcher that stops polling while many changes happen is not disconnected
/// and, when it polls again, converges on the true set.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_overflow_collapses_into_resync, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_overflow_collapses_into_resync(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_overflow_collapses_into_resync(
    d: &dyn Discovery,
    settings: &Settings,
) -> CheckResult {
    const C: &str = "overflow_collapses_into_resync";
    let ns = namespace(C);
    let q = Query::new(&ns);
    let mut s = watch(C, d, q.clone(), CancellationToken::new()).await?;
    let mut mirror = synced_mirror(C, &mut s, settings).await?;
    let mut keep = Vec::new();
    for n in 0..settings.overflow_churn as u64 {
        let g = register(C, d, id(&ns, "c", "t", n), n).await?;
        if n % 100 == 0 {
            keep.push(g);
        } else {
            unregister(C, g).await?;
        }
    }
    converge(C, d, &q, &mut s, &mut mirror, settings).await?;
    if mirror.state().len() != keep.len() {
        return Err(fail(
            C,
            format!(
                "converged on {} instances, {} are live",
                mirror.state().len(),
                keep.len()
            ),
        ));
    }
    Ok(())
}

/// Rule 5: a late removal of an old incarnation never removes its replacement.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_stale_removal_suppressed, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_stale_removal_suppressed(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_stale_removal_suppressed(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "stale_removal_suppressed";
    let ns = namespace(C);
    let q = Query::new(&ns);
    let a_id = id(&ns, "c", "t", 1);
    let first = register(C, d, a_id.clone(), 1).await?;
    let mut s = watch(C, d, q.clone(), CancellationToken::new()).await?;
    let mut mirror = synced_mirror(C, &mut s, settings).await?;
    let second = register(C, d, a_id.clone(), 2).await?;
    if second.instance().incarnation <= first.instance().incarnation {
        return Err(fail(C, "re-registration did not get a newer incarnation"));
    }
    // The old guard goes away after its replacement registered.
    drop(first);
    let marker = register(C, d, id(&ns, "c", "marker", 9), 9).await?;
    let deadline = tokio::time::Instant::now() + settings.deadline;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let ev = next_event(C, &mut s, left).await?;
        if let DiscoveryEvent::Removed { id, incarnation } = &ev {
            if *id == a_id && *incarnation < second.instance().incarnation {
                return Err(fail(
                    C,
                    format!("delivered a stale Removed (incarnation {incarnation})"),
                ));
            }
        }
        mirror.apply(&ev);
        if mirror.state().contains_key(&marker.instance().id) {
            break;
        }
    }
    let expected = (
        second.instance().transport.endpoint().to_owned(),
        second.instance().incarnation,
    );
    if mirror.state().get(&a_id) != Some(&expected) {
        return Err(fail(C, "the consumer lost the replacement registration"));
    }
    let listed = list(C, d, q).await?;
    if view_as(settings, &listed).get(&a_id)
        != view_as(settings, std::slice::from_ref(second.instance())).get(&a_id)
    {
        return Err(fail(C, "the old guard's drop removed the replacement"));
    }
    Ok(())
}

/// Rule 6: cancelling ends the stream; cancelling or dropping frees the watch.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_cancel_and_drop_release_watch, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_cancel_and_drop_release_watch(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_cancel_and_drop_release_watch(
    d: &dyn Discovery,
    settings: &Settings,
) -> CheckResult {
    const C: &str = "cancel_and_drop_release_watch";
    let ns = namespace(C);
    let base = d.stats().watchers;
    let cancel = CancellationToken::new();
    let mut s = watch(C, d, Query::new(&ns), cancel.clone()).await?;
    initial_sync(C, &mut s, settings).await?;
    let reports = d.stats().watchers > base;
    cancel.cancel();
    match tokio::time::timeout(settings.deadline, s.next()).await {
        Ok(None) => {}
        Ok(Some(ev)) => return Err(fail(C, format!("event after cancel: {ev:?}"))),
        Err(_) => return Err(fail(C, "the stream did not end after cancel")),
    }
    let s2 = watch(C, d, Query::new(&ns), CancellationToken::new()).await?;
    drop(s2);
    drop(s);
    if reports {
        eventually(
            C,
            settings,
            "dropped or cancelled watches were not released",
            || async { Ok(d.stats().watchers <= base) },
        )
        .await?;
    }
    Ok(())
}

/// Register, list (with incarnations and endpoints), unregister, and drop.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_register_list_unregister, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_register_list_unregister(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_register_list_unregister(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "register_list_unregister";
    let ns = namespace(C);
    let q = Query::new(&ns);
    let a = register(C, d, id(&ns, "c", "t", 1), 1).await?;
    let b = register(C, d, id(&ns, "c", "t", 2), 2).await?;
    let listed = view_as(settings, &list(C, d, q.clone()).await?);
    if listed != view_as(settings, &[a.instance().clone(), b.instance().clone()]) {
        return Err(fail(C, format!("list returned {listed:?}")));
    }
    unregister(C, a).await?;
    let listed = list(C, d, q.clone()).await?;
    if view_as(settings, &listed) != view_as(settings, std::slice::from_ref(b.instance())) {
        return Err(fail(
            C,
            format!("after unregister, list returned {listed:?}"),
        ));
    }
    drop(b);
    eventually(
        C,
        settings,
        "a dropped guard's registration was never removed",
        || async { Ok(list(C, d, q.clone()).await?.is_empty()) },
    )
    .await
}

/// A registration's worker identity reaches every reader: the returned instance, `list`
/// and a watch's `Added` all carry it; a registration without one carries none.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_worker_identity, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_worker_identity(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_worker_identity(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "worker_identity";
    let ns = namespace(C);
    let worker = WorkerIdentity::new(0x1_0000_0001, 3);
    let mut s = watch(C, d, Query::new(&ns), CancellationToken::new()).await?;
    initial_sync(C, &mut s, settings).await?;
    let a = d
        .register_with(id(&ns, "c", "t", 1), endpoint(1), Some(worker))
        .await
        .map_err(|e| fail(C, format!("register_with failed: {e}")))?;
    if a.instance().worker != Some(worker) {
        return Err(fail(C, format!("registered as {:?}", a.instance())));
    }
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Added(i) if i.worker == Some(worker) && i == *a.instance() => {}
        other => {
            return Err(fail(
                C,
                format!("expected Added with {worker}, got {other:?}"),
            ));
        }
    }
    let b = register(C, d, id(&ns, "c", "t", 2), 2).await?;
    let listed = list(C, d, Query::new(&ns)).await?;
    let workers: Vec<Option<WorkerIdentity>> = listed.iter().map(|i| i.worker).collect();
    let expected = if listed.first().map(|i| &i.id) == Some(&a.instance().id) {
        vec![Some(worker), None]
    } else {
        vec![None, Some(worker)]
    };
    if workers != expected {
        return Err(fail(C, format!("list returned {listed:?}")));
    }
    unregister(C, a).await?;
    unregister(C, b).await
}

/// Incarnations strictly increase across re-registrations; a re-registration with a
/// new endpoint replaces the old one.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_reregister_incarnations, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_reregister_incarnations(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_reregister_incarnations(d: &dyn Discovery, _settings: &Settings) -> CheckResult {
    const C: &str = "reregister_incarnations";
    let ns = namespace(C);
    let a_id = id(&ns, "c", "t", 1);
    let first = register(C, d, a_id.clone(), 1).await?;
    let inc1 = first.instance().incarnation;
    unregister(C, first).await?;
    let second = register(C, d, a_id.clone(), 2).await?;
    let third = register(C, d, a_id.clone(), 3).await?;
    let (inc2, inc3) = (second.instance().incarnation, third.instance().incarnation);
    if !(inc1 < inc2 && inc2 < inc3) {
        return Err(fail(
            C,
            format!("incarnations {inc1}, {inc2}, {inc3} do not increase"),
        ));
    }
    let listed = list(C, d, Query::new(&ns)).await?;
    if listed != vec![third.instance().clone()] {
        return Err(fail(
            C,
            format!("expected only the latest registration, got {listed:?}"),
        ));
    }
    Ok(())
}

/// Queries match each given field exactly: no prefix accidents.
///
/// ```
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_exact_query_matching, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// check_exact_query_matching(&MemoryDiscovery::new(), &Settings::default()).await?;
/// # Ok(()) }
/// ```
pub async fn check_exact_query_matching(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "exact_query_matching";
    let ns = namespace(C);
    let ns2 = format!("{ns}2");
    let _g = [
        register(C, d, id(&ns, "comp", "t", 1), 1).await?,
        register(C, d, id(&ns, "comp2", "t", 2), 2).await?,
        register(C, d, id(&ns, "comp", "t2", 3), 3).await?,
        register(C, d, id(&ns2, "comp", "t", 4), 4).await?,
    ];
    let ids =
        |v: Vec<Instance>| -> BTreeSet<u64> { v.iter().map(|i| i.id.publisher_id()).collect() };
    let cases = [
        (Query::new(&ns).component("comp"), vec![1, 3]),
        (Query::new(&ns).topic("t"), vec![1, 2]),
        (Query::new(&ns).component("comp").topic("t"), vec![1]),
        (Query::new(&ns), vec![1, 2, 3]),
        (Query::new(&ns).component("com"), vec![]),
    ];
    for (q, want) in cases {
        let got = ids(list(C, d, q.clone()).await?);
        if got != want.into_iter().collect::<BTreeSet<u64>>() {
            return Err(fail(C, format!("{q:?} listed {got:?}")));
        }
    }
    let prefix = ns.get(..ns.len() - 1).unwrap_or("conformance");
    let mut s = watch(C, d, Query::new(prefix), CancellationToken::new()).await?;
    match next_event(C, &mut s, settings.deadline).await? {
        DiscoveryEvent::Resync(all) if all.is_empty() => Ok(()),
        other => Err(fail(C, format!("a namespace prefix matched: {other:?}"))),
    }
}

/// A detached registration survives until its TTL, then expires with a `Removed`.
///
/// ```
/// use std::time::Duration;
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::discovery::conformance::{check_ttl_expiry, Settings};
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), eventplane::discovery::conformance::ConformanceFailure> {
/// let ttl = Duration::from_secs(10);
/// let discovery = MemoryDiscovery::builder().ttl(ttl).build().expect("ttl is not zero");
/// check_ttl_expiry(&discovery, &Settings::default().with_ttl(ttl)).await?;
/// # Ok(()) }
/// ```
pub async fn check_ttl_expiry(d: &dyn Discovery, settings: &Settings) -> CheckResult {
    const C: &str = "ttl_expiry";
    let Some(ttl) = settings.ttl else {
        return Ok(());
    };
    let ns = namespace(C);
    let q = Query::new(&ns);
    let live = register(C, d, id(&ns, "c", "t", 1), 1).await?;
    let gone = register(C, d, id(&ns, "c", "t", 2), 2).await?;
    let gone_id = gone.instance().id.clone();
    let mut s = watch(C, d, q.clone(), CancellationToken::new()).await?;
    initial_sync(C, &mut s, settings).await?;
    gone.detach();
    tokio::time::sleep(ttl / 2).await;
    if list(C, d, q.clone()).await?.len() != 2 {
        return Err(fail(C, "a detached registration vanished before its TTL"));
    }
    match next_event(C, &mut s, ttl + settings.deadline).await? {
        DiscoveryEvent::Removed { id, .. } if id == gone_id => {}
        other => {
            return Err(fail(
                C,
                format!("expected the expiry's Removed, got {other:?}"),
            ));
        }
    }
    // Three TTLs later the live one is still there: its lease is being renewed.
    tokio::time::sleep(ttl * 3).await;
    let listed = list(C, d, q).await?;
    if listed != vec![live.instance().clone()] {
        return Err(fail(C, format!("after expiry, list returned {listed:?}")));
    }
    Ok(())
}
