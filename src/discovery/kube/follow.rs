//! The Kubernetes watch: one task per backend (its *hub*) that lists every followed
//! namespace's resources and readiness, watches each list from its resourceVersion
//! (bookmarks on), keeps the join, and feeds a bounded backlog per
//! [`Discovery::watch`](crate::discovery::Discovery) (each with its query): a watch
//! started while the hub runs joins it, so `k` watches (a broker covering `k` Dynamo
//! namespaces) cost one read and one set of Kubernetes watches, not `k`. The hub ends
//! once its last watch is dropped.
//!
//! A watch the server ends (its `timeoutSeconds`) or that fails is opened again from
//! the last version seen; one silent for longer than the timeout plus a slack (the
//! timeout itself, at most [`STALL_SLACK`]) is taken as stalled and opened again. A version the server no
//! longer has (410 Gone, as an answer or as an `ERROR` event) means changes may have
//! been missed: everything is read afresh and the consumer gets one `Resync`.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, WatchEvent, WatchParams};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use super::capped;
use super::config::{KubeMode, Limits};
use super::error::{failed, is_gone, retry_after, timed_out};
use super::join::{Change, Join, Ns};
use super::narrow;
use super::resource::DISCOVERY_LABEL;
use super::shared::{Kind, Object, Shared};
use crate::discovery::backlog::{Backlog, Ended, WatchStream};
use crate::discovery::{DiscoveryError, DiscoveryEvent, DiscoveryStream, Query};
use crate::net::random_unit;

/// The most a silent watch is given past its `timeoutSeconds` before it is taken as
/// stalled (less for timeouts under it: the timeout itself).
pub(crate) const STALL_SLACK: Duration = Duration::from_secs(10);

/// What a watch yields, whatever the kind it reads.
enum Update {
    Changed(Object),
    Deleted(Object),
    /// A bookmark's version.
    Bookmark(String),
    /// The server's `ERROR` event (410 when the version is gone).
    Error(u16, String),
    /// An event that did not parse.
    Undecodable(String),
}

type Events = Pin<Box<dyn Stream<Item = Result<Update, kube::Error>> + Send>>;
type OpenFuture = crate::BoxFuture<'static, Result<Events, kube::Error>>;

/// One open watch of one (namespace, kind).
struct Slot {
    ns: Ns,
    kind: Kind,
    version: String,
    events: Option<Events>,
    /// When the watch is taken as stalled unless it shows life.
    stall_at: Instant,
    /// When it was opened.
    opened: Instant,
}

/// A watch the server ends sooner than this after opening it is opened again after
/// the backoff.
const EARLY_END: Duration = Duration::from_secs(1);

/// Starts a watch: joins the backend's running hub (its backlog starts from the hub's
/// view), or reads everything, opens every watch and starts a hub, returning once they
/// are open (no change can fall between the read and the watch: each starts from its
/// list's version). Cancelled first, it returns a stream that has ended.
pub(crate) async fn start(
    shared: Arc<Shared>,
    hub: &Hub,
    query: Query,
    cancel: CancellationToken,
) -> Result<DiscoveryStream, DiscoveryError> {
    let watch_cancel = cancel.child_token();
    let stream = |backlog| {
        DiscoveryStream::with_cancellation(
            WatchStream::following(backlog, watch_cancel.clone().drop_guard()),
            cancel.clone(),
        )
    };
    if let Some(tx) = hub.sender() {
        let (reply, answer) = oneshot::channel();
        let joining = Subscribe {
            query: query.clone(),
            cancel: watch_cancel.clone(),
            reply,
        };
        // A hub ending meanwhile drops the request: then start one.
        if tx.send(joining).await.is_ok()
            && let Ok(backlog) = answer.await
        {
            return Ok(stream(backlog));
        }
    }
    let established = tokio::select! {
        biased;
        () = cancel.cancelled() => {
            return Ok(DiscoveryStream::with_cancellation(Ended, cancel.clone()));
        }
        r = establish(&shared) => r?,
    };
    let (mut join, slots) = established;
    join.reread = false;
    let backlog = Backlog::start(
        shared.config.watch_buffer,
        Arc::clone(&shared.counters.watch),
        Shared::matching(&join, &query),
    );
    let (tx, joins) = mpsc::channel(16);
    hub.set(tx);
    let span = tracing::debug_span!("kube_watch", namespaces = ?shared.namespaces);
    let relist_backoff = shared.backoff();
    tokio::spawn(
        Follower {
            shared,
            subscribers: vec![Subscriber {
                query,
                backlog: Arc::clone(&backlog),
                cancel: watch_cancel.clone(),
            }],
            joins,
            cancel: CancellationToken::new(),
            relist_backoff,
            join,
            slots,
            relisted_at: None,
        }
        .run()
        .instrument(span),
    );
    Ok(stream(backlog))
}

/// Reads everything and opens a watch per (namespace, kind) from its list's version.
async fn establish(shared: &Shared) -> Result<(Join, Vec<Slot>), DiscoveryError> {
    let (join, versions) = shared.read_all().await?;
    let mut slots = Vec::with_capacity(versions.len());
    for (ns, kind, version) in versions {
        let events = open(shared, ns, kind, &version).await?;
        slots.push(Slot {
            ns,
            kind,
            version,
            events: Some(events),
            stall_at: stall_deadline(shared),
            opened: Instant::now(),
        });
    }
    Ok((join, slots))
}

fn stall_deadline(shared: &Shared) -> Instant {
    let timeout = shared.config.watch_timeout;
    Instant::now() + timeout + timeout.min(STALL_SLACK)
}

/// Opens one watch from `version`, within the open deadline.
async fn open(
    shared: &Shared,
    ns: Ns,
    kind: Kind,
    version: &str,
) -> Result<Events, DiscoveryError> {
    let namespace = shared.namespace(ns).to_owned();
    let secs = u32::try_from(shared.config.watch_timeout.as_secs()).unwrap_or(u32::MAX);
    let mut params = WatchParams::default().timeout(secs);
    if kind == Kind::Readiness {
        params = params.labels(DISCOVERY_LABEL);
    }
    let after = shared.config.watch_open_timeout;
    let opened = match (kind, shared.mode) {
        (Kind::Resources, _) => Box::pin(resource_events(
            shared.client.clone(),
            shared.resources(ns).resource_url().to_owned(),
            params,
            version.to_owned(),
            shared.config.limits,
        )) as OpenFuture,
        (Kind::Readiness, KubeMode::Pod) => {
            let api: Api<EndpointSlice> = Api::namespaced(shared.client.clone(), &namespace);
            Box::pin(events(
                shared.client.clone(),
                api.resource_url().to_owned(),
                params,
                version.to_owned(),
                |o| Object::Slice(Box::new(o)),
            ))
        }
        (Kind::Readiness, _) => {
            let api: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
            Box::pin(events(
                shared.client.clone(),
                api.resource_url().to_owned(),
                params,
                version.to_owned(),
                |o| Object::Pod(Box::new(o)),
            ))
        }
    };
    match tokio::time::timeout(after, opened).await {
        Ok(Ok(events)) => Ok(events),
        Ok(Err(e)) => Err(failed("watch", &namespace, e)),
        Err(_) => Err(timed_out("watch", &namespace, after)),
    }
}

/// Opens a typed watch and maps its events to [`Update`]s (each line read with its
/// bound, [`capped::watch_lines`]).
async fn events<K>(
    client: kube::Client,
    url: String,
    params: WatchParams,
    version: String,
    wrap: fn(K) -> Object,
) -> Result<Events, kube::Error>
where
    K: DeserializeOwned + Send + 'static,
{
    let lines = capped::watch_lines(&client, &url, &params, &version).await?;
    Ok(lines
        .map(move |line| {
            let text = match line? {
                capped::Line::Text(text) => text,
                capped::Line::TooLong(reason) => return Ok(Update::Undecodable(reason)),
            };
            Ok(match serde_json::from_slice::<WatchEvent<K>>(&text) {
                Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => Update::Changed(wrap(o)),
                Ok(WatchEvent::Deleted(o)) => Update::Deleted(wrap(o)),
                Ok(WatchEvent::Bookmark(b)) => Update::Bookmark(b.metadata.resource_version),
                Ok(WatchEvent::Error(e)) => Update::Error(e.code, e.message),
                Err(e) => Update::Undecodable(e.to_string()),
            })
        })
        .boxed())
}

/// Opens a watch of resources, read narrowly ([`narrow`]): each event a line of at
/// most [`narrow::MAX_WATCH_LINE_BYTES`], its object read on its own. An object that does not
/// read is a malformed resource (withdrawn, counted), not a failed watch.
async fn resource_events(
    client: kube::Client,
    url: String,
    params: WatchParams,
    version: String,
    limits: Limits,
) -> Result<Events, kube::Error> {
    let lines = capped::watch_lines(&client, &url, &params, &version).await?;
    Ok(lines
        .map(move |line| {
            Ok(match line? {
                capped::Line::Text(text) => resource_update(&text, &limits),
                capped::Line::TooLong(reason) => Update::Undecodable(reason),
            })
        })
        .boxed())
}

/// One watch line of resources as an [`Update`].
fn resource_update(line: &[u8], limits: &Limits) -> Update {
    let line = match std::str::from_utf8(line) {
        Ok(l) => l,
        Err(e) => return Update::Undecodable(e.to_string()),
    };
    let event: narrow::Line<'_> = match serde_json::from_str(line) {
        Ok(e) => e,
        Err(e) => return Update::Undecodable(e.to_string()),
    };
    let object = event.object.get();
    let read = || {
        let r = narrow::resource(object, limits);
        // Without its name or version, what changed is unknown: read everything.
        match (&r.name, &r.version) {
            (Some(_), Some(_)) => Ok(Object::Resource(Box::new(r))),
            _ => Err(Update::Undecodable(
                "an object without a name or version".to_owned(),
            )),
        }
    };
    match event.kind.as_str() {
        "ADDED" | "MODIFIED" => read().map_or_else(|u| u, Update::Changed),
        "DELETED" => read().map_or_else(|u| u, Update::Deleted),
        "BOOKMARK" => match narrow::version_of(object) {
            Some(v) => Update::Bookmark(v),
            None => Update::Undecodable("a bookmark without a version".to_owned()),
        },
        "ERROR" => match serde_json::from_str::<narrow::Status>(object) {
            Ok(status) => Update::Error(status.code, status.message),
            Err(e) => Update::Undecodable(e.to_string()),
        },
        other => Update::Undecodable(format!(
            "an event of type {:?}",
            other.chars().take(32).collect::<String>()
        )),
    }
}

/// Watches that lived at least this long after a full read let the next one start at
/// once (sooner: after the growing backoff).
const RELIST_SETTLED: Duration = Duration::from_secs(1);

/// How often the hub looks for watches that were dropped.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// Where a backend's running hub takes new watches (none running: `None`, or a
/// sender whose hub has ended).
#[derive(Default)]
pub(crate) struct Hub(std::sync::Mutex<Option<mpsc::Sender<Subscribe>>>);

impl Hub {
    fn sender(&self) -> Option<mpsc::Sender<Subscribe>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(|tx| !tx.is_closed())
    }

    fn set(&self, tx: mpsc::Sender<Subscribe>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    }
}

/// A watch joining the hub: its backlog comes back, or nothing when the hub ended.
pub(crate) struct Subscribe {
    query: Query,
    cancel: CancellationToken,
    reply: oneshot::Sender<Arc<Backlog>>,
}

/// One watch the hub feeds.
struct Subscriber {
    query: Query,
    backlog: Arc<Backlog>,
    /// Cancelled when the watch is dropped or cancelled.
    cancel: CancellationToken,
}

/// The task following a backend's watches.
struct Follower {
    shared: Arc<Shared>,
    subscribers: Vec<Subscriber>,
    joins: mpsc::Receiver<Subscribe>,
    /// Ends waits (backoffs, reads) once no watch is left.
    cancel: CancellationToken,
    join: Join,
    slots: Vec<Slot>,
    /// When the latest full read completed (none yet: `None`).
    relisted_at: Option<Instant>,
    /// Between full reads that follow each other too closely.
    relist_backoff: crate::net::Backoff,
}

/// What to do after an event.
enum Next {
    Continue,
    /// Open this slot's watch again from its version.
    Reopen(usize, String),
    /// Read everything afresh and resync.
    Relist(String),
}

impl Follower {
    async fn run(mut self) {
        let mut turn = 0usize;
        loop {
            let stall_at = self.slots.iter().map(|s| s.stall_at).min();
            let n = self.slots.len();
            turn = turn.wrapping_add(1);
            let slots = &mut self.slots;
            let next = poll_fn(|cx| {
                for i in 0..n {
                    let idx = (turn + i) % n;
                    let Some(slot) = slots.get_mut(idx) else {
                        continue;
                    };
                    let Some(events) = slot.events.as_mut() else {
                        continue;
                    };
                    if let Poll::Ready(item) = events.as_mut().poll_next(cx) {
                        return Poll::Ready((idx, item));
                    }
                }
                Poll::Pending
            });
            let next = tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                Some(joining) = self.joins.recv() => {
                    self.subscribe(joining);
                    Next::Continue
                }
                () = tokio::time::sleep(PRUNE_EVERY) => {
                    if !self.prune() {
                        break;
                    }
                    Next::Continue
                }
                (idx, item) = next => self.on_event(idx, item),
                () = sleep_until(stall_at) => {
                    let now = Instant::now();
                    match self.slots.iter().position(|s| s.stall_at <= now) {
                        Some(idx) => Next::Reopen(idx, "silent past its timeout".to_owned()),
                        None => Next::Continue,
                    }
                }
            };
            let ok = match next {
                Next::Continue => true,
                Next::Reopen(idx, why) => self.reopen(idx, &why).await,
                Next::Relist(why) => self.relist(&why).await,
            };
            if !ok || !self.prune() {
                break;
            }
        }
        // Requests that come now find the channel closed and start a hub of their own.
        self.joins.close();
        for s in self.subscribers.drain(..) {
            s.backlog.finish();
        }
    }

    /// A watch joins: its backlog starts from the current view.
    fn subscribe(&mut self, joining: Subscribe) {
        let backlog = Backlog::start(
            self.shared.config.watch_buffer,
            Arc::clone(&self.shared.counters.watch),
            Shared::matching(&self.join, &joining.query),
        );
        if joining.reply.send(Arc::clone(&backlog)).is_err() {
            backlog.finish();
            return;
        }
        self.subscribers.push(Subscriber {
            query: joining.query,
            backlog,
            cancel: joining.cancel,
        });
    }

    /// Whether every watch is gone (a read retried with backoff stops then).
    fn abandoned(&self) -> bool {
        self.subscribers.iter().all(|s| s.cancel.is_cancelled())
    }

    /// Lets go of the watches that were dropped or cancelled; `false` once none is
    /// left (the hub ends, and waits in progress with it).
    fn prune(&mut self) -> bool {
        self.subscribers.retain(|s| {
            let gone = s.cancel.is_cancelled();
            if gone {
                s.backlog.finish();
            }
            !gone
        });
        if self.subscribers.is_empty() {
            self.cancel.cancel();
            return false;
        }
        true
    }

    fn on_event(&mut self, idx: usize, item: Option<Result<Update, kube::Error>>) -> Next {
        let Some(slot) = self.slots.get_mut(idx) else {
            return Next::Continue;
        };
        slot.stall_at = stall_deadline(&self.shared);
        let (ns, kind) = (slot.ns, slot.kind);
        let update = match item {
            // Ended at once (a proxy that closes watches): open it again after the
            // backoff, not in a tight loop.
            None if slot.opened.elapsed() < EARLY_END => {
                return Next::Reopen(idx, "ended early".to_owned());
            }
            None => return Next::Reopen(idx, "ended by the server".to_owned()),
            Some(Err(e)) => return Next::Reopen(idx, format!("failed: {e}")),
            Some(Ok(u)) => u,
        };
        let changes = match update {
            Update::Changed(object) | Update::Deleted(object) if object.version().is_none() => {
                drop(object);
                self.shared
                    .skipped(1, "an object without a resourceVersion");
                return Next::Continue;
            }
            Update::Changed(object) => {
                slot.version = object.version().unwrap_or_default().to_owned();
                self.shared.apply(&mut self.join, ns, &object, false)
            }
            Update::Deleted(object) => {
                slot.version = object.version().unwrap_or_default().to_owned();
                self.shared.apply(&mut self.join, ns, &object, true)
            }
            Update::Bookmark(version) => {
                // Only a version the server could resume from (an empty one would
                // make the next reopen a fresh watch, missing what changed between).
                if version.parse::<u64>().is_ok_and(|v| v > 0) {
                    slot.version = version;
                }
                return Next::Continue;
            }
            Update::Error(410, message) => {
                return Next::Relist(format!("version gone (410): {message}"));
            }
            Update::Error(code, message) => {
                return Next::Reopen(idx, format!("error event {code}: {message}"));
            }
            Update::Undecodable(e) => {
                // A change we cannot read may be a deletion: read everything afresh.
                self.shared
                    .skipped(1, &format!("an undecodable {kind:?} event: {e}"));
                return Next::Relist("an undecodable event".to_owned());
            }
        };
        self.push(changes);
        if std::mem::take(&mut self.join.reread) {
            // A resource refused or evicted for room, its pod now ready: read it again
            // (the read makes its room, evicting resources that are not joined).
            return Next::Relist("a resource refused for room became ready".to_owned());
        }
        Next::Continue
    }

    /// Applies the join's changes to each watcher's view (those its query matches)
    /// and queues them.
    fn push(&self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        for subscriber in &self.subscribers {
            let mut st = subscriber.backlog.lock();
            let mut pushed = false;
            for change in &changes {
                let event = match change {
                    Change::Up(instance) if subscriber.query.matches(&instance.id) => {
                        st.current.insert(instance.id.clone(), instance.clone());
                        DiscoveryEvent::Added(instance.clone())
                    }
                    Change::Up(_) => continue,
                    Change::Down(id, incarnation) => match st.current.remove(id) {
                        Some(old) => DiscoveryEvent::Removed {
                            id: id.clone(),
                            incarnation: (*incarnation).max(old.incarnation),
                        },
                        None => continue,
                    },
                };
                pushed = true;
                subscriber.backlog.push(&mut st, event);
            }
            Backlog::wake(st, pushed);
        }
    }

    /// Opens slot `idx`'s watch again from its version, with backoff; a version gone
    /// turns into a relist. `false` when cancelled first.
    async fn reopen(&mut self, idx: usize, why: &str) -> bool {
        let Some(slot) = self.slots.get_mut(idx) else {
            return true;
        };
        slot.events = None;
        let (ns, kind, version) = (slot.ns, slot.kind, slot.version.clone());
        debug!(
            namespace = self.shared.namespace(ns),
            ?kind,
            why,
            "kubernetes watch ended; opening it again"
        );
        let mut backoff = self.shared.backoff();
        let mut first = why == "ended by the server";
        // What the server asked to wait after the last failure (`Retry-After`).
        let mut asked = None;
        loop {
            if self.abandoned() {
                return false;
            }
            let opened = open(&self.shared, ns, kind, &version);
            let waited = attempt(&self.cancel, &mut backoff, &mut first, asked.take(), opened);
            let Some(opened) = waited.await else {
                return false;
            };
            match opened {
                Ok(events) => {
                    if let Some(slot) = self.slots.get_mut(idx) {
                        slot.events = Some(events);
                        slot.stall_at = stall_deadline(&self.shared);
                        slot.opened = Instant::now();
                    }
                    return true;
                }
                Err(e) if is_gone(&e) => return self.relist("version gone (410)").await,
                Err(e) => {
                    asked = retry_after(&e);
                    self.warn_reconnect(&e);
                }
            }
        }
    }

    /// Reads everything afresh, opens every watch again and queues one `Resync`.
    /// `false` when cancelled first.
    async fn relist(&mut self, why: &str) -> bool {
        debug!(why, "kubernetes watch must read afresh");
        self.slots.clear();
        // Read afresh at once, unless the watches of the previous read lived less
        // than `RELIST_SETTLED`: then after the backoff, which goes on growing (a
        // server that answers every watch with 410 is not read back to back).
        let mut first = self
            .relisted_at
            .is_none_or(|at| at.elapsed() >= RELIST_SETTLED);
        if first {
            self.relist_backoff = self.shared.backoff();
        }
        let mut asked = None;
        loop {
            if self.abandoned() {
                return false;
            }
            let established = establish(&self.shared);
            let Some(established) = attempt(
                &self.cancel,
                &mut self.relist_backoff,
                &mut first,
                asked.take(),
                established,
            )
            .await
            else {
                return false;
            };
            match established {
                Ok((mut join, slots)) => {
                    self.relisted_at = Some(Instant::now());
                    join.reread = false;
                    self.join = join;
                    self.slots = slots;
                    self.shared
                        .counters
                        .reconnects
                        .fetch_add(1, Ordering::Relaxed);
                    for s in &self.subscribers {
                        s.backlog.resync(Shared::matching(&self.join, &s.query));
                    }
                    return true;
                }
                Err(e) => {
                    asked = retry_after(&e);
                    self.warn_reconnect(&e);
                }
            }
        }
    }

    fn warn_reconnect(&self, e: &DiscoveryError) {
        if let Some(suppressed) = self
            .shared
            .warn
            .check("watch-reconnect", std::time::Instant::now())
        {
            warn!(error = %crate::net::ErrorChain(e), suppressed, "kubernetes watch lost; retrying");
        }
    }
}

/// Waits out the backoff (unless `first`), at least what the server `asked` for (its
/// `Retry-After`), then runs `attempt`; `None` when cancelled first.
async fn attempt<T>(
    cancel: &CancellationToken,
    backoff: &mut crate::net::Backoff,
    first: &mut bool,
    asked: Option<Duration>,
    attempt: impl Future<Output = T>,
) -> Option<T> {
    if !std::mem::take(first) || asked.is_some() {
        let delay = backoff
            .next_delay(random_unit())
            .max(asked.unwrap_or_default());
        tokio::select! {
            biased;
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(delay) => {}
        }
    }
    tokio::select! {
        biased;
        () = cancel.cancelled() => None,
        r = attempt => Some(r),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
