//! The dynamic subscriber: discovery-driven fan-in with bounded, fair, counted loss.
//!
//! [`DynamicSubscriber`] watches a [`Discovery`] query, keeps one connection per
//! matching publisher, and merges their messages into one stream of [`Delivery`]s.
//!
//! # The lossy contract
//! - **Never backpressure the publisher.** Each connection keeps reading its socket
//!   whatever the consumer does (TCP backpressure would push loss into the publisher's
//!   high-water mark, where it is silent). When the consumer is slow, messages are
//!   dropped *here* and counted.
//! - **Bounded memory.** Each publisher has its own lane of at most `lane_capacity`
//!   messages (default 4096) and `lane_bytes` (4 MiB), each message charged its bytes
//!   plus its bookkeeping (about 170 bytes); all lanes together hold at most
//!   `max_buffered_bytes` (64 MiB). Messages are zero-copy slices of their
//!   connection's read buffer while the read buffers they keep alive total at most
//!   the ZMTP config's `max_retained_bytes` (8 MiB, shared by all connections,
//!   [`SubscriberStats::retained_bytes`]); beyond, small frames are copied into
//!   allocations of their own size. A connection gives its read buffer back whenever
//!   its publisher has nothing more to read, so idle publishers hold none (about
//!   5 KiB each in all, `tests/fanin_idle.rs`). So the process holds about
//!   `max_buffered_bytes` + twice `max_retained_bytes` (plus a frame being assembled
//!   per connection) for messages, however slow the consumer and whatever the
//!   publishers send. At most `max_publishers` (4096) publishers are followed,
//!   `max_concurrent_dials` (256) of them dialled at once. The
//!   [guide](crate::guide#bounds) sets every one of these bounds in one example.
//! - **Fair.** The consumer takes from ready lanes round-robin, and the global budget
//!   never refuses a lane that holds less than its share — it evicts from the largest
//!   lane instead — so a flooding publisher cannot starve a quiet one.
//! - **Counted.** Every drop is counted per publisher and by reason in
//!   [`SubscriberStats`]: lane full, budget, wrong topic, malformed; sequence gaps too.
//! - `DropNewest` (default) or `DropOldest` (freshest data wins); order within a
//!   publisher is preserved.
//!
//! # Connections and discovery
//! When a publisher leaves discovery, its connection drains: it keeps reading until
//! the publisher closes it or 500 ms pass, so messages already sent are delivered.
//!
//! A new id is dialled (resolve → [`AddrFilter`] check on every
//! resolved address → TCP connect → handshake → subscribe) in its own task; failures
//! reconnect with jittered backoff (100 ms → 5 s, never below 100 ms, reset after 30 s healthy) until
//! the publisher leaves discovery. A re-registration on the same endpoint keeps the
//! connection; a new endpoint replaces it; a `Removed` counts only if its incarnation
//! is at least the tracked one; a `Resync` reconciles. A failed watch is re-opened with
//! backoff while existing connections keep serving.
//!
//! # Shutdown
//! Dropping the subscriber or cancelling its token stops every task and closes every
//! socket; [`SubscriberHandle::shutdown`] waits for them.
//!
//! # A router, start to finish
//! Follow every KV-event publisher and keep the library's router index from what
//! they send: [`recv_item`](DynamicSubscriber::recv_item) hands out deliveries and
//! notices in one ordered stream, and [`kv::router::IndexFeed`](crate::kv::router::IndexFeed) applies
//! them — events under their publisher's worker identity, a publisher's blocks
//! dropped when its event ids skip (events lost on the way, as Dynamo's router does)
//! or when it departs ([`Notice::Departed`] comes after its last delivery). Then ask
//! which worker holds the longest prefix of a request (the [guide](crate::guide) has
//! the rest).
//!
//! ```
//! use std::sync::Arc;
//! use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
//! use eventplane::kv::{KvEvent, KvEventData, router::{local_block_hashes, IndexFeed}};
//! use eventplane::kv::{RouterEvent, StorageTier, StoredBlock, BlockHash, WorkerId};
//! use eventplane::publish::EventPublisher;
//! use eventplane::subscriber::DynamicSubscriber;
//! use eventplane::wire::Dialect;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new()); // or EtcdDiscovery
//! let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("prod"))
//!     .topic("kv-events") // the default layout is what EventPublisher sends
//!     .notices(1024)
//!     .spawn()?;
//! let prompt = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4); // a request's blocks
//! # let worker = EventPublisher::builder(discovery, "prod", "worker", "kv-events").worker(7, 0).build().await?;
//! # worker.wait_for_subscribers(1).await;
//! # let block = StoredBlock { block_hash: BlockHash(42), tokens_hash: prompt[0] };
//! # let data = KvEventData::Stored { parent_hash: None, blocks: vec![block] };
//! # let event = KvEvent { id: 1, dp_rank: 0, data };
//! # worker.publish(Dialect::EventPlane.encode_router_events(&[RouterEvent { worker_id: WorkerId(7), tier: StorageTier::Device, event }])?);
//! let mut feed = IndexFeed::default();
//! while let Some(item) = router.recv_item().await {
//!     feed.item(Dialect::EventPlane, &item)?; // or count the error and go on
//!     let scores = feed.index().find_matches(&prompt);
//!     if let Some(best) = scores.best() {
//!         println!("worker {:?} holds {} of the prompt's blocks", best.worker_id, best.blocks);
//! #       break;
//!     }
//! }
//! # Ok(()) }
//! ```

mod config;
mod item;
mod link;
mod notice;
mod shared;
mod stats;
mod worker;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use crate::wire::Layout;
pub use item::Item;
pub use notice::Notice;
pub use shared::Delivery;
pub use stats::{PublisherStats, SubscriberStats};

use crate::ConfigError;
use crate::discovery::{ChannelId, Discovery, Query};
use crate::lossy::{DropPolicy, Merge};
use crate::net::{AddrFilter, RateLimitedWarn};
use crate::zmtp;
use crate::zmtp::retain::Retention;
use config::Config;
use shared::{Retired, Shared};

/// Builds a [`DynamicSubscriber`]; every setter names its default.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::lossy::DropPolicy;
/// use eventplane::net::AddrFilter;
/// use eventplane::subscriber::{DynamicSubscriber, Layout};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::ConfigError> {
/// let sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("prod").component("worker"))
///     .topic("kv-events")
///     .layout(Layout::TopicSeq)
///     .lane_capacity(1024)
///     .max_buffered_bytes(16 << 20)
///     .drop_policy(DropPolicy::DropOldest)
///     .addr_filter(AddrFilter::strict())
///     .reconnect_backoff(Duration::from_millis(50), Duration::from_secs(2))
///     .spawn()?;
/// sub.handle().shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct DynamicSubscriberBuilder {
    config: Config,
}

impl DynamicSubscriberBuilder {
    /// Subscribe to this topic: frame 0 must equal it exactly (prefix collisions are
    /// dropped and counted), and only publishers whose discovery record carries this
    /// topic are followed. Others matching the query are not dialled (none of their
    /// messages could match); they are counted in
    /// [`SubscriberStats::other_topic_publishers`] with a rate-limited warning, so a
    /// typo shows. Default: everything, every publisher of the query.
    pub fn topic(mut self, topic: impl Into<Bytes>) -> Self {
        self.config.topic = Some(topic.into());
        self
    }
    /// Dialect layout. Default [`Layout::TopicPublisherSeq`], what
    /// [`EventPublisher`](crate::publish::EventPublisher) sends, so its sequence gaps
    /// are counted without configuring anything (the `watch` example's default too).
    /// Engines (`[topic, seq, payload]`) need [`Layout::TopicSeq`]; any other framing
    /// [`Layout::Raw`], or every message is counted as malformed.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.config.layout = layout;
        self
    }
    /// Messages per publisher lane. Default 4096.
    pub fn lane_capacity(mut self, messages: usize) -> Self {
        self.config.merge = self.config.merge.lane_capacity(messages);
        self
    }
    /// Bytes per publisher lane (each message charged its bytes plus about 170 bytes of
    /// bookkeeping, see [`lossy::ITEM_OVERHEAD`](crate::lossy::ITEM_OVERHEAD)). Default
    /// 4 MiB.
    pub fn lane_bytes(mut self, bytes: usize) -> Self {
        self.config.merge = self.config.merge.lane_bytes(bytes);
        self
    }
    /// Bytes across all lanes. Default 64 MiB.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.config.merge = self.config.merge.max_buffered_bytes(bytes);
        self
    }
    /// What to drop when full. Default [`DropPolicy::DropNewest`].
    pub fn drop_policy(mut self, policy: DropPolicy) -> Self {
        self.config.merge = self.config.merge.policy(policy);
        self
    }
    /// ZMTP bounds and timeouts for every connection. Default `zmtp::Config::default()`.
    pub fn zmtp_config(mut self, config: zmtp::Config) -> Self {
        self.config.zmtp = config;
        self
    }
    /// Which resolved addresses may be dialled. Default [`AddrFilter::default`]
    /// (loopback allowed, other special ranges refused).
    pub fn addr_filter(mut self, filter: AddrFilter) -> Self {
        self.config.addr_filter = filter;
        self
    }
    /// Reconnect backoff bounds: each wait is at least `min`, jittered up to a ceiling
    /// that doubles to `max` ([`Backoff`](crate::net::Backoff)). Default 100 ms → 5 s.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.reconnect_min = min;
        self.config.reconnect_max = max;
        self
    }
    /// Re-watch backoff bounds after a discovery watch fails. Default 250 ms → 5 s.
    pub fn rewatch_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.rewatch_min = min;
        self.config.rewatch_max = max;
        self
    }
    /// Messages read from a socket per batch. Default 256.
    pub fn recv_batch(mut self, messages: usize) -> Self {
        self.config.recv_batch = messages;
        self
    }
    /// Most publishers followed at once. Default 4096. Publishers discovered beyond
    /// it are not dialled and counted in [`SubscriberStats::refused_publishers`]; the
    /// next discovery resync picks them up when room has been made.
    pub fn max_publishers(mut self, publishers: usize) -> Self {
        self.config.max_publishers = publishers;
        self
    }
    /// Publishers dialled at once (resolution, connect and handshake). Default 256.
    /// Thousands of publishers discovered together, or all of them reconnecting
    /// after a network cut, are dialled this many at a time: no burst of thousands of
    /// connects and handshakes at once against the network or the publishers' hosts.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::ConfigError> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::subscriber::DynamicSubscriber;
    /// let sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns"))
    ///     .max_publishers(16_384)
    ///     .max_concurrent_dials(512)
    ///     .spawn()?;
    /// # drop(sub);
    /// # Ok(()) }
    /// ```
    pub fn max_concurrent_dials(mut self, dials: usize) -> Self {
        self.config.max_concurrent_dials = dials;
        self
    }
    /// Keep up to `capacity` lifecycle [`Notice`]s (connected, gap, reset, departed)
    /// for [`DynamicSubscriber::take_notices`]; a full queue drops the newest and
    /// counts it in [`SubscriberStats::notices_dropped`]. Default 0: none are kept.
    pub fn notices(mut self, capacity: usize) -> Self {
        self.config.notices = capacity;
        self
    }
    /// Whether this subscriber relies on the publishers' worker identities (a KV
    /// router indexing by worker). When `true`, a publisher whose discovery record
    /// carries none is still followed, but warned about (rate-limited, once a minute
    /// per publisher) so a worker that forgot
    /// [`EventPublisherBuilder::worker`](crate::publish::EventPublisherBuilder::worker)
    /// shows on the router side. Either way, such publishers are counted in
    /// [`SubscriberStats::unidentified_publishers`]. Default `false`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::DynamicSubscriber;
    /// let discovery = Arc::new(MemoryDiscovery::new());
    /// let router = DynamicSubscriber::builder(discovery.clone(), Query::new("prod"))
    ///     .topic("kv-events")
    ///     .expect_worker_identity(true)
    ///     .spawn()?;
    /// // A worker without `.worker(id, dp_rank)`: followed, warned about, counted.
    /// let publisher = EventPublisher::builder(discovery, "prod", "w", "kv-events").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// assert_eq!(router.stats().unidentified_publishers, 1);
    /// # Ok(()) }
    /// ```
    pub fn expect_worker_identity(mut self, expect: bool) -> Self {
        self.config.expect_worker_identity = expect;
        self
    }
    /// Reach the publishers of every namespace `bus` grants to a broker credential
    /// ([`EventBus::grants`](crate::tunnel::EventBus::grants)) through a broker
    /// covering it (the one rendezvous hashing picks per publisher), and the others
    /// directly. While no broker covers a granted namespace its publishers wait (their
    /// reconnects back off) unless [`tunnel_direct_fallback`](Self::tunnel_direct_fallback)
    /// is on. A broker lost or draining ends its streams; each reconnects through the
    /// next owner. The connection is otherwise the same: ZMTP, bounds and stats are
    /// unchanged.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::subscriber::DynamicSubscriber;
    /// use eventplane::tunnel::{BusClients, EventBus, EventBusConfig, Secret, server_tls};
    /// let clients = BusClients::shared(&Secret::from_file("bus.token")?, vec!["prod".into()])?;
    /// let bus = EventBus::bind("0.0.0.0:8443", server_tls("bus.pem", "bus.key")?, clients, EventBusConfig::default()).await?;
    /// let router = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("prod"))
    ///     .topic("kv-events")
    ///     .tunnel(bus)
    ///     .spawn()?;
    /// # drop(router); Ok(()) }
    /// ```
    #[cfg(feature = "tunnel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tunnel")))]
    pub fn tunnel(mut self, bus: crate::tunnel::EventBus) -> Self {
        self.config.bus = Some(bus);
        self
    }
    /// Dial the publishers of a granted namespace directly while no broker covers it
    /// (welcomed and not draining; a broker that is full still covers it) (default off: a granted namespace is reached only through brokers, since it is
    /// granted because the router cannot, or must not, reach it directly). A
    /// connection made directly stays direct until it ends.
    #[cfg(feature = "tunnel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tunnel")))]
    pub fn tunnel_direct_fallback(mut self, on: bool) -> Self {
        self.config.tunnel_direct_fallback = on;
        self
    }
    /// Stop when `token` is cancelled (the subscriber uses a child of it). Default: a
    /// token of its own.
    pub fn cancellation(mut self, token: &CancellationToken) -> Self {
        self.config.cancel = token.child_token();
        self
    }

    /// The first refused setting, if any, named as its setter;
    /// [`spawn`](Self::spawn) calls it first. Starts nothing and needs no runtime.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::subscriber::DynamicSubscriber;
    /// let builder = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns"))
    ///     .reconnect_backoff(Duration::from_secs(5), Duration::from_secs(1));
    /// assert_eq!(builder.validate().unwrap_err().field(), "reconnect_backoff");
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.config.validate()?;
        self.config.merge.check::<Delivery>()
    }

    /// Checks the configuration, then starts the watch loop on the current tokio
    /// runtime. A zero bound, a zero minimum backoff or a maximum below its minimum is
    /// refused with a [`ConfigError`] naming the setter.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use eventplane::ConfigError;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::subscriber::DynamicSubscriber;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let err = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns"))
    ///     .lane_capacity(0)
    ///     .spawn()
    ///     .unwrap_err();
    /// assert_eq!(err, ConfigError::Zero { field: "lane_capacity" });
    /// # }
    /// ```
    pub fn spawn(self) -> Result<DynamicSubscriber, ConfigError> {
        self.config.validate()?;
        let config = Arc::new(self.config);
        let merge = Arc::new(Merge::new(config.merge)?);
        let shared = Arc::new(Shared {
            publishers: Mutex::new(HashMap::new()),
            retired: Mutex::new(Retired::default()),
            retention: Arc::new(Retention::new(config.zmtp.max_retained_bytes())),
            refused_publishers: AtomicU64::new(0),
            other_topic_publishers: std::sync::atomic::AtomicUsize::new(0),
            rewatches: AtomicU64::new(0),
            synced: std::sync::atomic::AtomicBool::new(false),
            tracker: TaskTracker::new(),
            warn: RateLimitedWarn::default(),
            notices: notice::Notices::new(config.notices),
            departed_sequences: Mutex::new(shared::DepartedSequences::new(config.max_publishers)),
            sequence_handover: tokio::sync::Notify::new(),
            dials: tokio::sync::Semaphore::new(
                config
                    .max_concurrent_dials
                    .min(tokio::sync::Semaphore::MAX_PERMITS),
            ),
        });
        shared.tracker.spawn(worker::watch_loop(
            shared.clone(),
            config.clone(),
            merge.clone(),
        ));
        let handle = SubscriberHandle {
            shared: shared.clone(),
            merge: merge.clone(),
            cancel: config.cancel.clone(),
        };
        Ok(DynamicSubscriber {
            handle,
            merge,
            scratch: Vec::new(),
            items: std::collections::VecDeque::new(),
            recv_batch: config.recv_batch,
        })
    }
}

/// The merged stream of every matching publisher's messages. See the
/// [module docs](self) for the lossy contract.
///
/// ```no_run
/// use std::sync::Arc;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::subscriber::{DynamicSubscriber, Layout};
/// # async fn run(discovery: MemoryDiscovery) -> Result<(), eventplane::ConfigError> {
/// let mut subscriber = DynamicSubscriber::builder(Arc::new(discovery), Query::new("prod"))
///     .topic("kv-events")
///     .layout(Layout::TopicPublisherSeq)
///     .spawn()?;
/// while let Some(delivery) = subscriber.recv().await {
///     println!("{} #{:?}", delivery.source.id, delivery.sequence);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DynamicSubscriber {
    handle: SubscriberHandle,
    merge: Arc<Merge<Delivery>>,
    /// Holds the one delivery `recv` takes (kept to reuse its allocation).
    scratch: Vec<Delivery>,
    /// What [`recv_item`](Self::recv_item) took and has yet to hand out: one batch
    /// of deliveries (at most `recv_batch`) and the notices queued after it (at most
    /// the notice queue's capacity).
    items: std::collections::VecDeque<Item>,
    recv_batch: usize,
}

/// A cloneable handle: stats and shutdown from anywhere.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::subscriber::DynamicSubscriber;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::ConfigError> {
/// let sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns")).spawn()?;
/// let handle = sub.handle(); // Clone + Send: stats and shutdown from any task
/// assert_eq!(handle.stats().total.received, 0);
/// handle.shutdown().await; // stops every connection task and waits for them
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SubscriberHandle {
    shared: Arc<Shared>,
    merge: Arc<Merge<Delivery>>,
    cancel: CancellationToken,
}

impl DynamicSubscriber {
    /// A builder for the publishers matching `query` in `discovery`.
    pub fn builder(discovery: Arc<dyn Discovery>, query: Query) -> DynamicSubscriberBuilder {
        DynamicSubscriberBuilder {
            config: Config::new(discovery, query),
        }
    }

    /// A handle for stats and shutdown.
    pub fn handle(&self) -> SubscriberHandle {
        self.handle.clone()
    }

    /// Counters, per publisher and total.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::{DynamicSubscriber, Layout};
    /// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
    ///     .topic("t").layout(Layout::TopicPublisherSeq).spawn()?;
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.publish("x");
    /// sub.recv().await.ok_or("stopped")?;
    /// let stats = sub.stats();
    /// assert_eq!((stats.total.delivered, stats.total.dropped(), stats.publishers.len()), (1, 0, 1));
    /// # Ok(()) }
    /// ```
    pub fn stats(&self) -> SubscriberStats {
        self.handle.stats()
    }

    /// Moves the lifecycle [`Notice`]s queued so far into `out` without waiting;
    /// returns how many (always 0 unless [`notices`](DynamicSubscriberBuilder::notices)
    /// was set). Call it after handling each batch: a [`Notice::Departed`] comes only
    /// once every message of that publisher was taken from its lane, so handling the
    /// batch first never re-creates state for a publisher that already departed.
    pub fn take_notices(&self, out: &mut Vec<Notice>) -> usize {
        self.handle.shared.notices.take(out)
    }

    /// The next delivery; `None` once the subscriber was shut down and drained.
    /// Cancel-safe.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::{DynamicSubscriber, Layout};
    /// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
    ///     .topic("t").layout(Layout::TopicPublisherSeq).spawn()?;
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.publish("one");
    /// let delivery = sub.recv().await.ok_or("stopped")?; // cancel-safe
    /// assert_eq!(delivery.sequence, Some(0));
    /// # Ok(()) }
    /// ```
    pub async fn recv(&mut self) -> Option<Delivery> {
        std::future::poll_fn(|cx| self.poll_next_delivery(cx)).await
    }

    /// Waits for at least one delivery, then appends up to `max` (taken round-robin
    /// across publishers) to `out`. Returns 0 once shut down and drained. Cancel-safe.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::{DynamicSubscriber, Layout};
    /// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
    ///     .topic("t").layout(Layout::TopicPublisherSeq).spawn()?;
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// for _ in 0..10 { publisher.publish("x"); }
    /// let mut batch = Vec::new();
    /// while batch.len() < 10 {
    ///     sub.recv_many(&mut batch, 256).await; // fair across publishers, cancel-safe
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn recv_many(&mut self, out: &mut Vec<Delivery>, max: usize) -> usize {
        let max = max.max(1);
        std::future::poll_fn(|cx| self.merge.poll_recv_many(cx, out, max)).await
    }

    fn poll_next_delivery(&mut self, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        // One at a time: a message taken from its lane counts as delivered, and a
        // departed publisher's `Departed` is told once its lane is empty — so nothing
        // of it may wait here, unseen by the consumer, when that is told.
        let n = std::task::ready!(self.merge.poll_recv_many(cx, &mut self.scratch, 1));
        if n == 0 {
            return Poll::Ready(None);
        }
        Poll::Ready(self.scratch.pop())
    }
}

impl Stream for DynamicSubscriber {
    type Item = Delivery;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Delivery>> {
        self.poll_next_delivery(cx)
    }
}

impl Drop for DynamicSubscriber {
    fn drop(&mut self) {
        self.handle.cancel.cancel();
    }
}

impl SubscriberHandle {
    /// Whether the initial discovery sync completed ([`SubscriberStats::synced`]),
    /// without the rest of a snapshot: one atomic load, for a readiness probe.
    pub fn synced(&self) -> bool {
        self.shared.synced.load(Ordering::Relaxed)
    }

    /// Completes once a [`Notice`] is queued (at once if one is), so that a router
    /// hears of a departure or a gap while no message arrives: wait on it beside
    /// [`DynamicSubscriber::recv_many`] in a `select!` (a handle, so that the
    /// subscriber itself stays free for `recv_many`). Never completes with notices off.
    /// Cancel-safe.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::subscriber::{DynamicSubscriber, Notice};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("ns")).topic("t").notices(64).spawn()?;
    /// let lifecycle = router.handle();
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.shutdown().await; // leaves without sending anything
    /// let (mut batch, mut notices) = (Vec::new(), Vec::new());
    /// 'run: loop {
    ///     tokio::select! {
    ///         n = router.recv_many(&mut batch, 256) => if n == 0 { break }, // shut down
    ///         () = lifecycle.notice_ready() => {}
    ///     }
    ///     // ... handle `batch` first, then the notices:
    ///     router.take_notices(&mut notices);
    ///     for notice in notices.drain(..) {
    ///         if let Notice::Departed(id) = notice {
    ///             println!("{id} left: forget what it sent");
    ///             break 'run;
    ///         }
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn notice_ready(&self) {
        self.shared.notices.ready().await;
    }

    /// Counters, per publisher and total (departed publishers included in the total).
    pub fn stats(&self) -> SubscriberStats {
        let mut retired = self.shared.lock_retired();
        self.shared.settle_locked(&mut retired);
        let mut total = retired.sum();
        let mut unidentified_publishers = 0;
        let mut publishers: Vec<(ChannelId, PublisherStats)> = self
            .shared
            .lock()
            .iter()
            .map(|(id, cell)| {
                let instance = cell.instance.lock().unwrap_or_else(|p| p.into_inner());
                unidentified_publishers += usize::from(instance.worker.is_none());
                (id.clone(), cell.snapshot())
            })
            .collect();
        drop(retired);
        publishers.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, s) in &publishers {
            total.add(s);
        }
        self.shared.retention.prune();
        SubscriberStats {
            total,
            publishers,
            buffered_bytes: self.merge.buffered_bytes(),
            retained_bytes: self.shared.retention.retained(),
            copied_messages: self.shared.retention.copied(),
            read_buffer_bytes: self.shared.retention.current(),
            refused_publishers: self.shared.refused_publishers.load(Ordering::Relaxed),
            other_topic_publishers: self.shared.other_topic_publishers.load(Ordering::Relaxed),
            unidentified_publishers,
            notices_dropped: self.shared.notices.dropped(),
            rewatches: self.shared.rewatches.load(Ordering::Relaxed),
            synced: self.shared.synced.load(Ordering::Relaxed),
        }
    }

    /// Signals every task to stop (non-blocking).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::ConfigError> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{MemoryDiscovery, Query};
    /// use eventplane::subscriber::DynamicSubscriber;
    /// let mut sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns")).spawn()?;
    /// sub.handle().cancel();
    /// assert!(sub.recv().await.is_none()); // the stream ends
    /// # Ok(()) }
    /// ```
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Stops every task, closes every socket, and waits for them.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_delivery_costs_about_170_bytes_of_bookkeeping() {
        let slot = std::mem::size_of::<(super::Delivery, usize)>() + 32;
        assert!((150..=200).contains(&slot), "{slot}");
    }
}
