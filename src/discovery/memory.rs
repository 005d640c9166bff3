//! `MemoryDiscovery`: the embedded, in-process backend.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backlog::{WatchBacklog, WatchCounters, WatchStream};
use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStats,
    DiscoveryStream, Instance, Query, Registration, RegistrationHandle, StaleFilter, Transport,
    WorkerIdentity,
};
use crate::config::{self, ConfigError};

/// The embedded discovery backend: one registry shared by every clone.
///
/// - `list` costs O(matches): instances are indexed by namespace, component and topic.
/// - Each watcher has its own bounded backlog (`watch_buffer`, default 1024 events);
///   a watcher that falls behind is never disconnected and never slows the others: its
///   backlog collapses into one `Resync`.
/// - A registration's lease is renewed for as long as its guard lives. Dropping the
///   guard removes it at once; [`Registration::detach`] stops the renewal and the
///   registration expires after `ttl` (default 10 s), as a crashed process's would.
///   Expiry runs on a tokio task spawned the first time something is detached.
///
/// ```
/// use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = MemoryDiscovery::new();
/// let shared = discovery.clone(); // same registry
/// let id = ChannelId::new("prod", "worker", "kv-events", 1)?;
/// let _guard = discovery.register(id.clone(), Transport::zmq("tcp://127.0.0.1:5555")).await?;
/// assert_eq!(shared.list(Query::new("prod").component("worker")).await?.len(), 1);
/// assert!(shared.get(&id).is_some());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryDiscovery {
    registry: Arc<Registry>,
}

/// Builds a [`MemoryDiscovery`].
///
/// ```
/// use std::time::Duration;
/// use eventplane::discovery::MemoryDiscovery;
/// let discovery = MemoryDiscovery::builder().ttl(Duration::from_secs(3)).watch_buffer(256).build()?;
/// # let _ = discovery;
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct MemoryDiscoveryBuilder {
    ttl: Duration,
    watch_buffer: usize,
}

impl MemoryDiscoveryBuilder {
    /// How long a detached registration survives. Default 10 s; must not be zero.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Events buffered per watcher before its backlog collapses into a `Resync`.
    /// Default 1024; must not be zero. Costs up to this many events per slow
    /// watcher.
    pub fn watch_buffer(mut self, events: usize) -> Self {
        self.watch_buffer = events;
        self
    }

    /// The backend, or the [`ConfigError`] naming a zero setting.
    ///
    /// ```
    /// use std::time::Duration;
    /// use eventplane::ConfigError;
    /// use eventplane::discovery::MemoryDiscovery;
    /// let err = MemoryDiscovery::builder().ttl(Duration::ZERO).build().unwrap_err();
    /// assert_eq!(err, ConfigError::Zero { field: "ttl" });
    /// ```
    pub fn build(self) -> Result<MemoryDiscovery, ConfigError> {
        config::nonzero_duration("ttl", self.ttl)?;
        config::nonzero("watch_buffer", self.watch_buffer)?;
        Ok(self.build_checked())
    }

    fn build_checked(self) -> MemoryDiscovery {
        MemoryDiscovery {
            registry: Arc::new(Registry {
                state: RwLock::new(State::default()),
                ttl: self.ttl,
                watch_buffer: self.watch_buffer,
                counters: Arc::default(),
            }),
        }
    }
}

#[derive(Debug)]
struct Registry {
    /// Reads (`list`, `get`, snapshots) share; changes and their fan-out are
    /// exclusive.
    state: RwLock<State>,
    ttl: Duration,
    watch_buffer: usize,
    /// Every watcher's backlog counts here.
    counters: Arc<WatchCounters>,
}

#[derive(Debug)]
struct Entry {
    instance: Instance,
    /// `None` while the guard lives (the lease is being renewed).
    expires_at: Option<Instant>,
}

type Publishers = HashMap<u64, Entry>;
type Topics = HashMap<String, Publishers>;
type Components = HashMap<String, Topics>;

#[derive(Debug, Default)]
struct State {
    index: HashMap<String, Components>,
    registrations: usize,
    next_incarnation: u64,
    watchers: HashMap<u64, Watcher>,
    next_watcher: u64,
    /// Detached registrations by deadline: `(deadline, incarnation) → id`.
    expiries: BTreeMap<(Instant, u64), ChannelId>,
    sweeper: bool,
    stats: DiscoveryStats,
}

#[derive(Debug)]
struct Watcher {
    query: Query,
    backlog: WatchBacklog,
}

impl Registry {
    fn lock(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn get(&self, id: &ChannelId) -> Option<&Entry> {
        self.index
            .get(id.namespace())?
            .get(id.component())?
            .get(id.topic())?
            .get(&id.publisher_id())
    }

    fn get_mut(&mut self, id: &ChannelId) -> Option<&mut Entry> {
        self.index
            .get_mut(id.namespace())?
            .get_mut(id.component())?
            .get_mut(id.topic())?
            .get_mut(&id.publisher_id())
    }

    fn list(&self, query: &Query) -> Vec<Instance> {
        let mut out = Vec::new();
        let Some(components) = self.index.get(query.namespace_filter()) else {
            return out;
        };
        let mut visit_topics = |topics: &Topics| match query.topic_filter() {
            Some(t) => {
                if let Some(p) = topics.get(t) {
                    out.extend(p.values().map(|e| e.instance.clone()));
                }
            }
            None => {
                for p in topics.values() {
                    out.extend(p.values().map(|e| e.instance.clone()));
                }
            }
        };
        match query.component_filter() {
            Some(c) => {
                if let Some(topics) = components.get(c) {
                    visit_topics(topics);
                }
            }
            None => components.values().for_each(visit_topics),
        }
        out
    }

    fn insert(&mut self, instance: Instance) {
        let id = &instance.id;
        let previous = self
            .index
            .entry(id.namespace().to_owned())
            .or_default()
            .entry(id.component().to_owned())
            .or_default()
            .entry(id.topic().to_owned())
            .or_default()
            .insert(
                id.publisher_id(),
                Entry {
                    instance: instance.clone(),
                    expires_at: None,
                },
            );
        if previous.is_none() {
            self.registrations += 1;
        }
        self.notify(&instance.id.clone(), DiscoveryEvent::Added(instance));
    }

    /// Removes `id` if its current incarnation is `incarnation`.
    fn remove(&mut self, id: &ChannelId, incarnation: u64) -> bool {
        if self
            .get(id)
            .is_none_or(|e| e.instance.incarnation != incarnation)
        {
            return false;
        }
        let Some(components) = self.index.get_mut(id.namespace()) else {
            return false;
        };
        let Some(topics) = components.get_mut(id.component()) else {
            return false;
        };
        let Some(publishers) = topics.get_mut(id.topic()) else {
            return false;
        };
        publishers.remove(&id.publisher_id());
        if publishers.is_empty() {
            topics.remove(id.topic());
            if topics.is_empty() {
                components.remove(id.component());
                if components.is_empty() {
                    self.index.remove(id.namespace());
                }
            }
        }
        self.registrations -= 1;
        self.notify(
            id,
            DiscoveryEvent::Removed {
                id: id.clone(),
                incarnation,
            },
        );
        true
    }

    fn notify(&mut self, id: &ChannelId, event: DiscoveryEvent) {
        for watcher in self.watchers.values() {
            if watcher.query.matches(id) {
                watcher.backlog.push(event.clone());
            }
        }
    }

    fn expire_due(&mut self, now: Instant) {
        while let Some(entry) = self.expiries.first_entry() {
            let (deadline, incarnation) = *entry.key();
            if deadline > now {
                break;
            }
            let id = entry.remove();
            let still_detached = self
                .get(&id)
                .is_some_and(|e| e.instance.incarnation == incarnation && e.expires_at.is_some());
            if still_detached && self.remove(&id, incarnation) {
                self.stats.expired += 1;
                tracing::debug!(%id, "registration expired");
            }
        }
    }
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        MemoryDiscovery::builder().build_checked()
    }
}

impl MemoryDiscovery {
    /// A backend with the default TTL (10 s) and watch buffer (1024 events).
    pub fn new() -> MemoryDiscovery {
        MemoryDiscovery::default()
    }

    /// Configures a backend.
    pub fn builder() -> MemoryDiscoveryBuilder {
        MemoryDiscoveryBuilder {
            ttl: Duration::from_secs(10),
            watch_buffer: 1024,
        }
    }

    /// The current registration of `id`: O(1).
    pub fn get(&self, id: &ChannelId) -> Option<Instance> {
        self.registry.read().get(id).map(|e| e.instance.clone())
    }

    fn register_now(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> Registration {
        self.register_full(id, transport, worker, None)
    }

    fn register_full(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
        recovery: Option<String>,
    ) -> Registration {
        let mut st = self.registry.lock();
        st.next_incarnation += 1;
        let mut instance = Instance::new(id.clone(), transport, st.next_incarnation);
        instance.worker = worker;
        instance.recovery = recovery;
        st.insert(instance.clone());
        drop(st);
        tracing::debug!(%id, incarnation = instance.incarnation, "registered");
        Registration::new(
            instance.clone(),
            Box::new(MemoryHandle {
                registry: Arc::downgrade(&self.registry),
                id,
                incarnation: instance.incarnation,
            }),
        )
    }

    fn watch_now(&self, query: Query, cancel: CancellationToken) -> DiscoveryStream {
        let mut st = self.registry.lock();
        let snapshot = st.list(&query);
        let (backlog, events) = WatchBacklog::start(
            self.registry.watch_buffer,
            self.registry.counters.clone(),
            snapshot,
        );
        let id = st.next_watcher;
        st.next_watcher += 1;
        st.watchers.insert(id, Watcher { query, backlog });
        drop(st);
        DiscoveryStream::with_cancellation(
            MemoryWatch {
                registry: self.registry.clone(),
                id,
                events,
                filter: StaleFilter::default(),
                done: false,
            },
            cancel,
        )
    }
}

impl Discovery for MemoryDiscovery {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        let registration = self.register_now(id, transport, worker);
        Box::pin(async move { Ok(registration) })
    }

    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        let (id, transport, worker, recovery) = instance.into_registered();
        let registration = self.register_full(id, transport, worker, recovery);
        Box::pin(async move { Ok(registration) })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        let out = self.registry.read().list(&query);
        Box::pin(async move { Ok(out) })
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        // Established here, before the future is even polled: no change can fall
        // between the snapshot and the subscription.
        let stream = self.watch_now(query, cancel);
        Box::pin(async move { Ok(stream) })
    }

    fn stats(&self) -> DiscoveryStats {
        let st = self.registry.read();
        let mut stats = DiscoveryStats {
            registrations: st.registrations,
            ..st.stats
        };
        self.registry.counters.fill(&mut stats);
        stats
    }
}

#[derive(Debug)]
struct MemoryHandle {
    registry: Weak<Registry>,
    id: ChannelId,
    incarnation: u64,
}

impl MemoryHandle {
    fn remove(&self) {
        if let Some(registry) = self.registry.upgrade() {
            if registry.lock().remove(&self.id, self.incarnation) {
                tracing::debug!(id = %self.id, "unregistered");
            }
        }
    }
}

impl RegistrationHandle for MemoryHandle {
    fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>> {
        self.remove();
        Box::pin(async { Ok(()) })
    }

    fn release(self: Box<Self>) {
        // A short critical section, no I/O: removal is immediate.
        self.remove();
    }

    fn detach(self: Box<Self>) {
        let Some(registry) = self.registry.upgrade() else {
            return;
        };
        let mut st = registry.lock();
        let deadline = Instant::now() + registry.ttl;
        let Some(entry) = st.get_mut(&self.id) else {
            return;
        };
        if entry.instance.incarnation != self.incarnation {
            return;
        }
        entry.expires_at = Some(deadline);
        st.expiries
            .insert((deadline, self.incarnation), self.id.clone());
        if !st.sweeper {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    st.sweeper = true;
                    rt.spawn(sweep(Arc::downgrade(&registry)));
                }
                Err(_) => tracing::warn!(
                    id = %self.id,
                    "detach outside a tokio runtime: the registration will expire at the next detach inside one"
                ),
            }
        }
    }
}

/// Expires detached registrations at their deadlines; exits when none are left or the
/// registry is gone.
async fn sweep(registry: Weak<Registry>) {
    loop {
        let next = {
            let Some(reg) = registry.upgrade() else {
                return;
            };
            let mut st = reg.lock();
            st.expire_due(Instant::now());
            match st.expiries.first_key_value() {
                Some(((deadline, _), _)) => *deadline,
                None => {
                    st.sweeper = false;
                    return;
                }
            }
        };
        tokio::time::sleep_until(next).await;
    }
}

struct MemoryWatch {
    registry: Arc<Registry>,
    id: u64,
    events: WatchStream,
    filter: StaleFilter,
    done: bool,
}

impl MemoryWatch {
    fn close(&mut self) {
        if !self.done {
            self.done = true;
            // Dropping the watcher's backlog stops counting it.
            let watcher = self.registry.lock().watchers.remove(&self.id);
            drop(watcher);
        }
    }
}

impl Stream for MemoryWatch {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            let event = std::task::ready!(Pin::new(&mut this.events).poll_next(cx));
            match event {
                Some(Ok(event)) if !this.filter.admit(&event) => continue,
                other => return Poll::Ready(other),
            }
        }
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        self.close();
    }
}
