//! Discovery: who publishes what, where.
//!
//! A [`Discovery`] backend registers publishers ([`Instance`]s, each a [`ChannelId`]
//! plus a [`Transport`]) and lets consumers list and watch them. Backends:
//! [`MemoryDiscovery`] (embedded, the default), [`StaticDiscovery`] (a fixed set) and
//! `EtcdDiscovery` (feature `etcd`, the distributed backend).
//!
//! # The watch contract
//! Every backend's [`Discovery::watch`] stream obeys these rules (checked by
//! `discovery::conformance`, feature `test-support`):
//! 1. The watch is established before `watch` returns: no change can fall between.
//! 2. It starts with one [`DiscoveryEvent::Added`] per matching instance, then exactly
//!    one [`DiscoveryEvent::Resync`] with the snapshot — empty if nothing matches —
//!    which means "initial sync complete".
//! 3. Then incremental `Added` / `Removed`.
//! 4. Whenever the backend may have missed changes (a reconnect, a compaction, or a
//!    watcher whose bounded buffer overflowed), it emits `Resync(full current set)`;
//!    consumers replace their state. An overflowing watcher is never disconnected and
//!    never grows without bound: its backlog collapses into one `Resync` (the initial
//!    sync's too: a watcher that never read it reads that `Resync` first).
//! 5. A `Removed` whose incarnation is older than the registration of that id the
//!    watcher last saw is never delivered (a late removal must not kill its
//!    replacement).
//! 6. The stream ends only when cancelled or dropped; dropping it frees the backend's
//!    resources for that watch promptly.
//!
//! A backend of your own gets rules 2, 4 and 5 from [`WatchBacklog`], the one bounded
//! backlog the memory, etcd and Kubernetes backends use.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

mod backend;
mod backlog;
#[cfg(feature = "test-support")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-support")))]
pub mod conformance;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "test-support")]
mod fault;
#[cfg(feature = "kube")]
mod kube;
mod memory;
mod merged;
mod model;
#[cfg(any(feature = "etcd", feature = "kube"))]
mod records;
mod rewatch;
mod static_;
mod watch;

pub use backend::{Backend, Connected};
pub use backlog::{WatchBacklog, WatchCounters, WatchStream};
pub use error::DiscoveryError;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use etcd::{EtcdDiscovery, EtcdDiscoveryBuilder, EtcdState};
#[cfg(feature = "test-support")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-support")))]
pub use fault::{FaultControl, FaultDiscovery};
#[cfg(feature = "kube")]
#[cfg_attr(docsrs, doc(cfg(feature = "kube")))]
pub use kube::{KubeDiscovery, KubeDiscoveryBuilder, KubeMode, PodIdentity, kube_instance_id};
pub use memory::{MemoryDiscovery, MemoryDiscoveryBuilder};
pub use merged::Merged;
#[cfg(feature = "tunnel")]
pub(crate) use model::ANNOUNCED_SCHEME;
pub use model::{
    ChannelId, DiscoveryEvent, DpRank, Instance, MAX_PUBLISHER_ID, Query, Transport, WorkerId,
    WorkerIdentity,
};
#[cfg(any(feature = "etcd", feature = "kube"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "etcd", feature = "kube"))))]
pub use records::DynamoRecords;
pub(crate) use rewatch::{Rewatch, Rewatched};
pub use static_::StaticDiscovery;
pub use watch::StaleFilter;

/// The boxed future of the [`Discovery`] trait's methods (also at the crate root).
pub use crate::BoxFuture;

/// A discovery backend. Dyn-compatible: use it as `Arc<dyn Discovery>`.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{ChannelId, Discovery, DiscoveryEvent, MemoryDiscovery, Query, Transport};
/// use tokio_util::sync::CancellationToken;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
/// let mut watch = discovery.watch(Query::new("prod"), CancellationToken::new()).await?;
/// assert_eq!(watch.next().await.transpose()?, Some(DiscoveryEvent::Resync(vec![])));
///
/// let id = ChannelId::new("prod", "worker", "kv-events", 7)?;
/// let registration = discovery.register(id, Transport::zmq("tcp://127.0.0.1:5555")).await?;
/// assert!(matches!(watch.next().await.transpose()?, Some(DiscoveryEvent::Added(_))));
/// registration.unregister().await?;
/// assert!(matches!(watch.next().await.transpose()?, Some(DiscoveryEvent::Removed { .. })));
/// # Ok(()) }
/// ```
pub trait Discovery: Send + Sync + fmt::Debug {
    /// Registers `transport` under `id`. The returned guard keeps the registration
    /// alive (renewing its lease where the backend has one); dropping it signals the
    /// backend to remove it, [`Registration::unregister`] removes it and waits.
    /// Registering an id again replaces the earlier registration with a new
    /// incarnation. The same as [`register_with`](Self::register_with) without a
    /// worker identity.
    fn register(
        &self,
        id: ChannelId,
        transport: Transport,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        self.register_with(id, transport, None)
    }

    /// Registers `transport` under `id`, as [`register`](Self::register) does, with
    /// the worker it publishes for: every [`Instance`] of this registration (listed or
    /// watched, on any machine) carries `worker`. A backend must store it or refuse the
    /// registration; it never drops it silently.
    ///
    /// ```
    /// use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport, WorkerIdentity};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// let discovery = MemoryDiscovery::new();
    /// let id = ChannelId::new("prod", "worker", "kv-events", 7)?;
    /// let _registered = discovery
    ///     .register_with(id, Transport::zmq("tcp://127.0.0.1:5555"), Some(WorkerIdentity::new(42, 0)))
    ///     .await?;
    /// let listed = discovery.list(Query::new("prod")).await?;
    /// assert_eq!(listed[0].worker, Some(WorkerIdentity::new(42, 0)));
    /// # Ok(()) }
    /// ```
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>>;

    /// Registers `instance` (its incarnation is the backend's to assign): its channel,
    /// transport, worker and recovery endpoint. Backends whose records cannot carry a
    /// recovery endpoint register without it; so does this default, which calls
    /// [`register_with`](Self::register_with). [`MemoryDiscovery`] keeps it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use eventplane::discovery::{ChannelId, Discovery, Instance, MemoryDiscovery, Query, Transport};
    /// let discovery = MemoryDiscovery::new();
    /// let id = ChannelId::new("prod", "worker", "kv-events", 7)?;
    /// let instance = Instance::new(id, Transport::zmq("tcp://127.0.0.1:5555"), 0)
    ///     .with_recovery("tcp://127.0.0.1:5556");
    /// let _registered = discovery.register_instance(instance).await?;
    /// let listed = discovery.list(Query::new("prod")).await?;
    /// assert_eq!(listed[0].recovery.as_deref(), Some("tcp://127.0.0.1:5556"));
    /// # Ok(()) }
    /// ```
    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        self.register_with(instance.id, instance.transport, instance.worker)
    }

    /// The instances matching `query` now.
    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>>;

    /// Watches the instances matching `query` under the contract of the module docs.
    /// Cancelling `cancel` ends the stream.
    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>>;

    /// Counters, for backends that keep them.
    fn stats(&self) -> DiscoveryStats {
        DiscoveryStats::default()
    }
}

/// Counters of a discovery backend.
///
/// ```
/// use eventplane::discovery::{Discovery, MemoryDiscovery};
/// assert_eq!(MemoryDiscovery::new().stats().watchers, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct DiscoveryStats {
    /// Live registrations.
    pub registrations: usize,
    /// Open watch streams.
    pub watchers: usize,
    /// Events waiting in watch backlogs now (each backlog is bounded).
    pub buffered_events: usize,
    /// Watch backlogs that overflowed and collapsed into a `Resync`.
    pub overflow_resyncs: u64,
    /// Registrations removed because their lease expired.
    pub expired: u64,
    /// Malformed records skipped (backends that read foreign data).
    pub malformed: u64,
    /// Times the backend's lease was found lost and its registrations were put again
    /// (backends with a remote store).
    pub lease_losses: u64,
    /// Watch streams to a remote store re-established after an error or compaction
    /// (each followed by a `Resync`).
    pub reconnects: u64,
}

/// What a backend does when a [`Registration`] is unregistered, dropped or detached.
/// Implemented by backends (including test doubles in other crates).
///
/// ```
/// use eventplane::discovery::{BoxFuture, ChannelId, DiscoveryError, Instance, Registration, RegistrationHandle, Transport};
///
/// /// A backend's guard that has nothing to clean up.
/// #[derive(Debug)]
/// struct Noop;
///
/// impl RegistrationHandle for Noop {
///     fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>> {
///         Box::pin(async { Ok(()) })
///     }
///     fn release(self: Box<Self>) {}
/// }
///
/// let id = ChannelId::new("ns", "c", "t", 1)?;
/// let registration = Registration::new(Instance::new(id, Transport::zmq("tcp://127.0.0.1:1"), 1), Box::new(Noop));
/// assert_eq!(registration.instance().incarnation, 1);
/// # Ok::<(), DiscoveryError>(())
/// ```
pub trait RegistrationHandle: Send + Sync + fmt::Debug {
    /// Removes the registration and waits until the backend confirms.
    fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>>;

    /// Called from `Drop`: must only signal the backend (never block, never spawn).
    fn release(self: Box<Self>);

    /// Stops maintaining the registration without removing it, as if the process had
    /// died: the backend expires it when its lease runs out. Defaults to
    /// [`release`](Self::release).
    fn detach(self: Box<Self>) {
        self.release();
    }
}

/// A live registration. Dropping it signals the backend to remove it (without
/// blocking or spawning); [`unregister`](Self::unregister) removes it and waits.
///
/// ```
/// use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = MemoryDiscovery::new();
/// let id = ChannelId::new("ns", "c", "t", 1)?;
/// let registration = discovery.register(id, Transport::zmq("tcp://127.0.0.1:1")).await?;
/// assert_eq!(registration.instance().incarnation, 1);
/// drop(registration);
/// assert!(discovery.list(Query::new("ns")).await?.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping a Registration unregisters it"]
pub struct Registration {
    instance: Instance,
    handle: Option<Box<dyn RegistrationHandle>>,
}

impl Registration {
    /// A guard for `instance` (for backend implementations).
    pub fn new(instance: Instance, handle: Box<dyn RegistrationHandle>) -> Registration {
        Registration {
            instance,
            handle: Some(handle),
        }
    }

    /// What was registered, with the incarnation the backend assigned.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// Removes the registration and waits for the backend to confirm.
    pub async fn unregister(mut self) -> Result<(), DiscoveryError> {
        match self.handle.take() {
            Some(h) => h.unregister().await,
            None => Ok(()),
        }
    }

    /// Stops maintaining the registration without removing it: the backend expires it
    /// after its lease TTL, exactly as if this process had crashed.
    pub fn detach(mut self) {
        if let Some(h) = self.handle.take() {
            h.detach();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.release();
        }
    }
}

type BoxStream = Pin<Box<dyn Stream<Item = Result<DiscoveryEvent, DiscoveryError>> + Send>>;

/// The stream of a [`Discovery::watch`]. An `Err` item ends the stream (watch again,
/// with backoff); `None` means it was cancelled.
///
/// ```
/// use eventplane::discovery::{Discovery, DiscoveryEvent, MemoryDiscovery, Query};
/// use tokio_util::sync::CancellationToken;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let cancel = CancellationToken::new();
/// let mut stream = MemoryDiscovery::new().watch(Query::new("ns"), cancel.clone()).await?;
/// assert_eq!(stream.next().await.transpose()?, Some(DiscoveryEvent::Resync(vec![])));
/// cancel.cancel();
/// assert!(stream.next().await.is_none());
/// # Ok(()) }
/// ```
pub struct DiscoveryStream {
    /// `None` once the stream ended: the backend's stream is dropped at once, freeing
    /// its resources.
    inner: Option<BoxStream>,
    cancelled: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
}

impl fmt::Debug for DiscoveryStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiscoveryStream")
            .field("ended", &self.inner.is_none())
            .finish_non_exhaustive()
    }
}

impl DiscoveryStream {
    /// Wraps a backend's stream.
    pub fn new<S>(stream: S) -> DiscoveryStream
    where
        S: Stream<Item = Result<DiscoveryEvent, DiscoveryError>> + Send + 'static,
    {
        DiscoveryStream {
            inner: Some(Box::pin(stream)),
            cancelled: None,
        }
    }

    /// Wraps a backend's stream and ends it as soon as `cancel` is cancelled, dropping
    /// the backend's stream (and so freeing its resources) right then. This is how
    /// backends honour the token [`Discovery::watch`] takes.
    pub fn with_cancellation<S>(stream: S, cancel: CancellationToken) -> DiscoveryStream
    where
        S: Stream<Item = Result<DiscoveryEvent, DiscoveryError>> + Send + 'static,
    {
        DiscoveryStream {
            inner: Some(Box::pin(stream)),
            cancelled: Some(Box::pin(cancel.cancelled_owned())),
        }
    }

    /// The next event (without needing `StreamExt`).
    pub async fn next(&mut self) -> Option<Result<DiscoveryEvent, DiscoveryError>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }
}

impl Stream for DiscoveryStream {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(cancelled) = this.cancelled.as_mut() {
            if cancelled.as_mut().poll(cx).is_ready() {
                this.cancelled = None;
                this.inner = None;
            }
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let item = std::task::ready!(inner.as_mut().poll_next(cx));
        if item.is_none() {
            this.inner = None;
            this.cancelled = None;
        }
        Poll::Ready(item)
    }
}
