//! A conformance suite for [`Discovery`] backends: one async check per rule of the
//! watch contract (see the [module docs](super)) plus register / list / unregister /
//! re-register / TTL behaviour.
//!
//! Every check takes a fresh backend, uses its own namespace, and returns a
//! [`ConformanceFailure`] instead of panicking, so a test can also prove that a broken
//! backend *fails* a check. [`run_all`] runs them all.
//!
//! ```
//! use std::sync::Arc;
//! use eventplane::discovery::{Discovery, MemoryDiscovery};
//! use eventplane::discovery::conformance::{self, Settings};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let failures = conformance::run_all(
//!     || async { Arc::new(MemoryDiscovery::new()) as Arc<dyn Discovery> },
//!     &Settings::default(),
//! )
//! .await;
//! assert!(failures.is_empty(), "{failures:?}");
//! # }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{
    ChannelId, Discovery, DiscoveryEvent, DiscoveryStream, Instance, Query, Registration, Transport,
};

/// Knobs for the suite.
///
/// ```
/// use std::time::Duration;
/// use eventplane::discovery::conformance::Settings;
/// // For a backend whose leases last 3 s and whose watch buffer is 256 events.
/// let settings = Settings::default().with_ttl(Duration::from_secs(3)).with_overflow_churn(1000);
/// assert_eq!(settings.ttl, Some(Duration::from_secs(3)));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// Registrations to churn (register + unregister) while a watcher does not poll;
    /// should exceed the backend's per-watcher buffer. Default 3000.
    pub overflow_churn: usize,
    /// The backend's lease TTL, to check that a detached registration expires; `None`
    /// skips the check. Default `None`.
    pub ttl: Option<Duration>,
    /// How long any one expected event or state may take. Default 10 s.
    pub deadline: Duration,
    /// How long to watch for spurious events after the initial sync. Default 200 ms.
    pub quiet: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            overflow_churn: 3000,
            ttl: None,
            deadline: Duration::from_secs(10),
            quiet: Duration::from_millis(200),
        }
    }
}

impl Settings {
    /// With the TTL check enabled for a backend whose lease TTL is `ttl`.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// With a different bound on how long an expected event may take.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// With a different churn count for the overflow check.
    pub fn with_overflow_churn(mut self, churn: usize) -> Self {
        self.overflow_churn = churn;
        self
    }
}

/// A violated rule.
///
/// ```
/// use eventplane::discovery::conformance::ConformanceFailure;
/// let failure = ConformanceFailure { check: "initial_sync", reason: "no Resync".into() };
/// assert_eq!(failure.to_string(), "initial_sync: no Resync");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConformanceFailure {
    /// The check's name.
    pub check: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl fmt::Display for ConformanceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.check, self.reason)
    }
}

impl std::error::Error for ConformanceFailure {}

type CheckResult = Result<(), ConformanceFailure>;

fn fail(check: &'static str, reason: impl Into<String>) -> ConformanceFailure {
    ConformanceFailure {
        check,
        reason: reason.into(),
    }
}

/// Runs every check, each against a fresh backend from `factory`; returns the
/// failures (empty when the backend conforms).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery};
/// use eventplane::discovery::conformance::{run_all, Settings};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let failures = run_all(
///     || async { Arc::new(MemoryDiscovery::new()) as Arc<dyn Discovery> },
///     &Settings::default(),
/// )
/// .await;
/// assert!(failures.is_empty(), "{failures:?}");
/// # }
/// ```
pub async fn run_all<F, Fut>(factory: F, settings: &Settings) -> Vec<ConformanceFailure>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Discovery>>,
{
    let mut failures = Vec::new();
    macro_rules! run {
        ($check:ident) => {
            if let Err(f) = $check(&*factory().await, settings).await {
                failures.push(f);
            }
        };
    }
    run!(check_initial_sync);
    run!(check_empty_initial_resync);
    run!(check_no_gap_between_snapshot_and_watch);
    run!(check_incremental_changes);
    run!(check_overflow_collapses_into_resync);
    run!(check_stale_removal_suppressed);
    run!(check_cancel_and_drop_release_watch);
    run!(check_register_list_unregister);
    run!(check_reregister_incarnations);
    run!(check_exact_query_matching);
    if settings.ttl.is_some() {
        run!(check_ttl_expiry);
    }
    failures
}

static NAMESPACE_SEQ: AtomicU64 = AtomicU64::new(0);

fn namespace(check: &str) -> String {
    format!(
        "conformance-{check}-{}-{}",
        std::process::id(),
        NAMESPACE_SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

fn id(ns: &str, component: &str, topic: &str, publisher: u64) -> ChannelId {
    ChannelId::new(ns, component, topic, publisher).unwrap_or_else(|_| {
        // Only reachable with a malformed namespace, which `namespace` never makes.
        unreachable_id()
    })
}

#[allow(clippy::expect_used)]
fn unreachable_id() -> ChannelId {
    ChannelId::new("x", "x", "x", 0).expect("valid")
}

fn endpoint(n: u64) -> Transport {
    Transport::zmq(format!("tcp://127.0.0.1:{}", 10_000 + n % 50_000))
}

async fn register(
    check: &'static str,
    d: &dyn Discovery,
    id: ChannelId,
    n: u64,
) -> Result<Registration, ConformanceFailure> {
    d.register(id, endpoint(n))
        .await
        .map_err(|e| fail(check, format!("register failed: {e}")))
}

async fn list(
    check: &'static str,
    d: &dyn Discovery,
    q: Query,
) -> Result<Vec<Instance>, ConformanceFailure> {
    d.list(q)
        .await
        .map_err(|e| fail(check, format!("list failed: {e}")))
}

async fn watch(
    check: &'static str,
    d: &dyn Discovery,
    q: Query,
    cancel: CancellationToken,
) -> Result<DiscoveryStream, ConformanceFailure> {
    d.watch(q, cancel)
        .await
        .map_err(|e| fail(check, format!("watch failed: {e}")))
}

async fn next_event(
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

/// A consumer's view of a watch — what a correct consumer believes after each event:
/// id → (endpoint, incarnation). For tests of backends and of consumers.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, Transport};
/// use eventplane::discovery::conformance::Mirror;
/// let id = ChannelId::new("ns", "c", "t", 7)?;
/// let mut mirror = Mirror::default();
/// mirror.apply(&DiscoveryEvent::Resync(vec![]));
/// mirror.apply(&DiscoveryEvent::Added(Instance::new(id.clone(), Transport::zmq("tcp://h:1"), 3)));
/// assert_eq!(mirror.publisher_ids(), vec![7]);
/// assert_eq!(mirror.state()[&id], ("tcp://h:1".to_owned(), 3));
/// mirror.apply(&DiscoveryEvent::Removed { id, incarnation: 3 });
/// assert!(mirror.state().is_empty());
/// assert_eq!(mirror.resyncs(), 1);
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Default, Clone)]
pub struct Mirror {
    state: BTreeMap<ChannelId, (String, u64)>,
    resyncs: usize,
}

impl Mirror {
    /// What the consumer believes now: id → (endpoint, incarnation).
    pub fn state(&self) -> &BTreeMap<ChannelId, (String, u64)> {
        &self.state
    }

    /// `Resync`s applied so far (the initial sync's included).
    pub fn resyncs(&self) -> usize {
        self.resyncs
    }

    /// The publisher ids believed live, in id order.
    pub fn publisher_ids(&self) -> Vec<u64> {
        self.state.keys().map(ChannelId::publisher_id).collect()
    }

    /// Applies one event, as a consumer must.
    pub fn apply(&mut self, ev: &DiscoveryEvent) {
        match ev {
            DiscoveryEvent::Added(i) => {
                self.state.insert(
                    i.id.clone(),
                    (i.transport.endpoint().to_owned(), i.incarnation),
                );
            }
            DiscoveryEvent::Removed { id, .. } => {
                self.state.remove(id);
            }
            DiscoveryEvent::Resync(all) => {
                self.resyncs += 1;
                self.state = view(all);
            }
        }
    }
}

fn view(instances: &[Instance]) -> BTreeMap<ChannelId, (String, u64)> {
    instances
        .iter()
        .map(|i| {
            (
                i.id.clone(),
                (i.transport.endpoint().to_owned(), i.incarnation),
            )
        })
        .collect()
}

/// Consumes events until the mirror equals the backend's `list`.
async fn converge(
    check: &'static str,
    d: &dyn Discovery,
    q: &Query,
    s: &mut DiscoveryStream,
    mirror: &mut Mirror,
    settings: &Settings,
) -> CheckResult {
    let target = view(&list(check, d, q.clone()).await?);
    let deadline = tokio::time::Instant::now() + settings.deadline;
    while mirror.state != target {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let ev = next_event(check, s, left).await.map_err(|f| {
            fail(
                check,
                format!(
                    "{} (consumer sees {} instances, backend lists {})",
                    f.reason,
                    mirror.state.len(),
                    target.len()
                ),
            )
        })?;
        mirror.apply(&ev);
    }
    Ok(())
}

/// Polls `condition` until it holds, failing with `what` after the deadline.
async fn eventually<F, Fut>(
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

async fn unregister(check: &'static str, registration: Registration) -> CheckResult {
    registration
        .unregister()
        .await
        .map_err(|e| fail(check, format!("unregister failed: {e}")))
}

/// Reads the initial sync into a fresh consumer view.
async fn synced_mirror(
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
async fn initial_sync(
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
    let expected: BTreeSet<(ChannelId, u64)> = guards
        .iter()
        .take(3)
        .map(|g| (g.instance().id.clone(), g.instance().incarnation))
        .collect();
    let got_added: BTreeSet<(ChannelId, u64)> = added
        .iter()
        .map(|i| (i.id.clone(), i.incarnation))
        .collect();
    let got_snapshot: BTreeSet<(ChannelId, u64)> = snapshot
        .iter()
        .map(|i| (i.id.clone(), i.incarnation))
        .collect();
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
    if mirror.state.len() != keep.len() {
        return Err(fail(
            C,
            format!(
                "converged on {} instances, {} are live",
                mirror.state.len(),
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
        if mirror.state.contains_key(&marker.instance().id) {
            break;
        }
    }
    let expected = (
        second.instance().transport.endpoint().to_owned(),
        second.instance().incarnation,
    );
    if mirror.state.get(&a_id) != Some(&expected) {
        return Err(fail(C, "the consumer lost the replacement registration"));
    }
    let listed = list(C, d, q).await?;
    if !listed.iter().any(|i| i == second.instance()) {
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
    let listed = view(&list(C, d, q.clone()).await?);
    if listed != view(&[a.instance().clone(), b.instance().clone()]) {
        return Err(fail(C, format!("list returned {listed:?}")));
    }
    unregister(C, a).await?;
    let listed = list(C, d, q.clone()).await?;
    if listed != vec![b.instance().clone()] {
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
/// let discovery = MemoryDiscovery::builder().ttl(ttl).build();
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
