//! [`EventPublisher`]: a `PubSocket` registered in discovery, sending
//! `[topic, publisher_id u64be, sequence u64be, payload]` (what a
//! `DynamicSubscriber`'s default layout reads, so every gap is counted) or Dynamo's
//! frames ([`Dialect`]).
//!
//! The socket binds an OS-assigned port on `127.0.0.1` unless told otherwise
//! ([`bind`](EventPublisherBuilder::bind), [`bind_host`](EventPublisherBuilder::bind_host)
//! with [`advertise_host`](EventPublisherBuilder::advertise_host) to serve other
//! machines); the registration lives as long as the publisher and is removed by
//! [`shutdown`](EventPublisher::shutdown) after queued messages drained. Publishing
//! never waits: each subscriber has a bounded send queue, and what does not fit is
//! dropped and counted ([`PubStats`]). PUB/SUB keeps nothing for late joiners, so wait
//! for the subscribers you expect, with a deadline.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use eventplane::discovery::{MemoryDiscovery, Query};
//! use eventplane::publish::{EventPublisher, PublishError};
//! use eventplane::subscriber::DynamicSubscriber;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let discovery = Arc::new(MemoryDiscovery::new());
//! let publisher = EventPublisher::builder(discovery.clone(), "prod", "worker", "kv-events")
//!     .worker(7, 0) // optional: the worker identity routers see in discovery
//!     .build()
//!     .await?;
//! // Nobody subscribed yet: waiting is bounded, and the error says what to check.
//! let err = publisher.wait_for_subscribers_within(1, Duration::from_millis(50)).await.unwrap_err();
//! assert!(matches!(err, PublishError::NoSubscribers { subscribed: 0, .. }));
//!
//! let mut router = DynamicSubscriber::builder(discovery, Query::new("prod")).topic("kv-events").spawn()?;
//! publisher.wait_for_subscribers_within(1, Duration::from_secs(10)).await?;
//! let report = publisher.publish(&b"router events"[..]);
//! assert_eq!(report.dropped, 0);
//! let delivery = router.recv().await.ok_or("router stopped")?;
//! assert_eq!((delivery.sequence, delivery.payload().as_deref()), (Some(0), Some(&b"router events"[..])));
//! publisher.shutdown().await; // drain, unregister, close
//! # Ok(()) }
//! ```

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::discovery::{
    ChannelId, Discovery, DiscoveryError, DpRank, Instance, MAX_PUBLISHER_ID, Registration,
    Transport, WorkerId, WorkerIdentity,
};
use crate::net::random_u64;
use crate::wire::Dialect;
use crate::zmtp::{self, PubSocket, PubStats, SendReport};

/// Errors of [`EventPublisher`].
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::publish::{EventPublisher, PublishError};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let err = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "ns", "c", "t")
///     .bind_host("0.0.0.0") // fine to bind…
///     .build()              // …but 0.0.0.0 cannot be advertised
///     .await
///     .unwrap_err();
/// assert!(matches!(err, PublishError::AdvertiseHost { .. }));
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// Binding the socket failed.
    #[error("cannot bind the publisher socket")]
    Bind(#[source] zmtp::Error),
    /// Registering in discovery failed.
    #[error("cannot register the publisher in discovery")]
    Register(#[source] DiscoveryError),
    /// The advertised host cannot be dialled by others (e.g. `0.0.0.0`).
    #[error("advertise host {host:?} is not routable: {reason}")]
    AdvertiseHost {
        /// The host.
        host: String,
        /// Why.
        reason: &'static str,
    },
    /// Fewer subscribers than awaited arrived in time
    /// ([`EventPublisher::wait_for_subscribers_within`]): a subscriber that uses
    /// another topic, namespace or component, or that cannot reach the advertised
    /// endpoint, never arrives.
    #[error(
        "{subscribed} of {wanted} subscribers after {waited:?}: check that subscribers \
         follow this namespace, component and topic and can reach {endpoint}"
    )]
    NoSubscribers {
        /// Subscribers awaited.
        wanted: usize,
        /// Subscribers there when the time ran out.
        subscribed: usize,
        /// How long it waited.
        waited: Duration,
        /// The endpoint subscribers dial.
        endpoint: String,
    },
}

/// Builds an [`EventPublisher`].
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use eventplane::discovery::MemoryDiscovery;
/// use eventplane::publish::EventPublisher;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::publish::PublishError> {
/// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "prod", "worker", "kv-events")
///     .bind_host("127.0.0.1")      // use 0.0.0.0 with advertise_host("10.0.0.5") to serve a network
///     .linger(Duration::from_millis(200))
///     .build()
///     .await?;
/// assert!(publisher.instance().unwrap().transport.endpoint().starts_with("tcp://127.0.0.1:"));
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use]
pub struct EventPublisherBuilder {
    discovery: Option<Arc<dyn Discovery>>,
    namespace: String,
    component: String,
    topic: String,
    bind_host: String,
    bind: Option<String>,
    advertise_host: Option<String>,
    zmtp: zmtp::Config,
    linger: Duration,
    dialect: Dialect,
    worker: Option<WorkerIdentity>,
    recovery: Option<String>,
    publisher_id: Option<u64>,
}

impl EventPublisherBuilder {
    /// Interface to bind. Default `127.0.0.1`; use `0.0.0.0` with an explicit
    /// [`advertise_host`](Self::advertise_host) to serve other machines.
    pub fn bind_host(mut self, host: impl Into<String>) -> Self {
        self.bind_host = host.into();
        self
    }
    /// Binds exactly `endpoint` (`tcp://host:port`; port 0 lets the OS pick) instead of
    /// `tcp://{bind_host}:0`. Default: none.
    pub fn bind(mut self, endpoint: impl Into<String>) -> Self {
        self.bind = Some(endpoint.into());
        self
    }
    /// What the publisher writes: [`Dialect::EventPlane`] (default) or [`Dialect::Dynamo`]
    /// (Dynamo's framed envelope). Which records discovery writes
    /// is the discovery backend's choice (see `EtcdDiscoveryBuilder::dialect`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::wire::Dialect;
    /// let publisher = EventPublisher::unregistered("kv-events").dialect(Dialect::Dynamo).build().await?;
    /// assert_eq!((publisher.dialect(), publisher.next_sequence()), (Dialect::Dynamo, 0));
    /// # Ok(()) }
    /// ```
    pub fn dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }
    /// Host others dial. Default: the bind host (which must then be routable).
    pub fn advertise_host(mut self, host: impl Into<String>) -> Self {
        self.advertise_host = Some(host.into());
        self
    }
    /// ZMTP config of the socket (queue bounds per subscriber). Default
    /// `zmtp::Config::default()`.
    pub fn zmtp_config(mut self, config: zmtp::Config) -> Self {
        self.zmtp = config;
        self
    }
    /// How long [`EventPublisher::shutdown`] lets queues drain. Default 1 s.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// The worker this publisher speaks for, registered with it (see
    /// [`Discovery::register_with`]): every subscriber's [`Instance`] of this publisher
    /// (a delivery's `source`, a `Connected` notice) carries it. Default: none. An
    /// [`unregistered`](EventPublisher::unregistered) publisher refuses it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::{MemoryDiscovery, WorkerIdentity};
    /// use eventplane::publish::EventPublisher;
    /// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "prod", "worker", "kv-events")
    ///     .worker(7, 0)
    ///     .build()
    ///     .await?;
    /// assert_eq!(publisher.instance().unwrap().worker, Some(WorkerIdentity::new(7, 0)));
    /// # Ok(()) }
    /// ```
    pub fn worker(mut self, worker_id: impl Into<WorkerId>, dp_rank: DpRank) -> Self {
        self.worker = Some(WorkerIdentity::new(worker_id, dp_rank));
        self
    }

    /// The endpoint where this worker serves its recovery log (a
    /// [`kv::pipeline::RecoveryServer`](crate::kv::pipeline::RecoveryServer)'s), registered with the
    /// publisher ([`Instance::recovery`](crate::discovery::Instance::recovery)) in
    /// backends whose records carry it ([`Discovery::register_instance`]). Default: none.
    /// In Dynamo's records, `dynamo+msgpack://HOST:PORT` (or `dynamo+json://`) names a
    /// [`DynamoQueryServer`](crate::kv::dynamo_recovery::DynamoQueryServer) instead,
    /// written as the `recovery_target` Dynamo's router asks (features `etcd`/`kube`).
    pub fn recovery(mut self, endpoint: impl Into<String>) -> Self {
        self.recovery = Some(endpoint.into());
        self
    }

    /// With publisher id `id` (at most [`MAX_PUBLISHER_ID`]; default: random). A
    /// process restarted with the same id is, to a subscriber that saw the earlier
    /// one, the same publisher restarting its sequence: a reset it counts.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use eventplane::publish::EventPublisher;
    /// let publisher = EventPublisher::unregistered("kv-events").publisher_id(42).build().await?;
    /// assert_eq!(publisher.publisher_id(), 42);
    /// # Ok(()) }
    /// ```
    pub fn publisher_id(mut self, id: u64) -> Self {
        self.publisher_id = Some(id & MAX_PUBLISHER_ID);
        self
    }

    /// Binds (by default on an OS-assigned port), picks a random publisher id and,
    /// unless built by [`EventPublisher::unregistered`], registers in discovery.
    pub async fn build(self) -> Result<EventPublisher, PublishError> {
        let advertise = self
            .advertise_host
            .clone()
            .unwrap_or_else(|| self.bind_host.clone());
        let bind = self
            .bind
            .clone()
            .unwrap_or_else(|| format!("tcp://{}:0", bracket(&self.bind_host)));
        if self.discovery.is_some() && (self.bind.is_none() || self.advertise_host.is_some()) {
            check_advertise_host(&advertise)?;
        }
        if self.discovery.is_none() && self.worker.is_some() {
            return Err(PublishError::Register(DiscoveryError::InvalidConfig(
                crate::ConfigError::Inconsistent {
                    field: "worker",
                    reason: "needs a registered publisher: an unregistered one has no record to carry it",
                },
            )));
        }
        let socket = PubSocket::bind(&bind, self.zmtp)
            .await
            .map_err(PublishError::Bind)?;
        let publisher_id = self
            .publisher_id
            .unwrap_or_else(|| random_u64() & MAX_PUBLISHER_ID);
        let registration = match self.discovery {
            None => None,
            Some(discovery) => {
                let endpoint = match (&self.bind, &self.advertise_host) {
                    // Bound at an explicit endpoint: advertise what was bound, checked.
                    (Some(_), None) => {
                        let bound = socket.local_endpoint().unwrap_or_default().to_owned();
                        let host = bound
                            .strip_prefix("tcp://")
                            .and_then(|r| r.rsplit_once(':'))
                            .map(|(h, _)| h.to_owned())
                            .unwrap_or_default();
                        check_advertise_host(&host)?;
                        bound
                    }
                    _ => {
                        let port = socket.local_addr().map(|a| a.port()).unwrap_or_default();
                        format!("tcp://{}:{port}", bracket(&advertise))
                    }
                };
                let id = ChannelId::new(
                    self.namespace,
                    self.component,
                    self.topic.clone(),
                    publisher_id,
                )
                .map_err(PublishError::Register)?;
                let mut instance = Instance::new(id, Transport::zmq(endpoint.clone()), 0);
                instance.worker = self.worker;
                instance.recovery = self.recovery;
                let registration = discovery
                    .register_instance(instance)
                    .await
                    .map_err(PublishError::Register)?;
                tracing::debug!(%endpoint, publisher_id, dialect = %self.dialect, "event publisher registered");
                Some(registration)
            }
        };
        Ok(EventPublisher {
            socket,
            registration,
            topic: Bytes::from(self.topic),
            id: publisher_id,
            id_frame: Bytes::copy_from_slice(&publisher_id.to_be_bytes()),
            sequence: AtomicU64::new(0),
            linger: self.linger,
            dialect: self.dialect,
        })
    }
}

fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

fn check_advertise_host(host: &str) -> Result<(), PublishError> {
    let bad = |reason| PublishError::AdvertiseHost {
        host: host.to_owned(),
        reason,
    };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.is_empty() || bare == "*" {
        return Err(bad("empty or wildcard"));
    }
    if let Ok(ip) = bare.parse::<IpAddr>() {
        if ip.is_unspecified() {
            return Err(bad(
                "unspecified address: bind to it, but advertise a real one",
            ));
        }
        if ip.is_multicast() {
            return Err(bad("multicast address"));
        }
    }
    Ok(())
}

/// Publishes events on the event plane: binds a [`PubSocket`] on an OS-assigned
/// port, registers `tcp://{advertise_host}:{port}` in discovery under a random
/// publisher id (≤ 2^53 − 1), and sends `[topic, publisher_id u64be, sequence u64be,
/// payload]` with the sequence counting from 0 (or, with [`Dialect::Dynamo`], Dynamo's
/// frames, also counting from 0). Sending never blocks; slow subscribers
/// lose messages, counted in [`stats`](Self::stats) (and visible to them as sequence
/// gaps). [`shutdown`](Self::shutdown) unregisters and lingers; dropping it
/// unregisters (best effort) and closes the socket.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
/// use eventplane::publish::EventPublisher;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let discovery = Arc::new(MemoryDiscovery::new());
/// let publisher = EventPublisher::builder(discovery.clone(), "prod", "worker", "kv-events")
///     .build()
///     .await?;
/// assert_eq!(discovery.list(Query::new("prod")).await?.len(), 1);
/// publisher.publish("payload");
/// publisher.shutdown().await;
/// assert!(discovery.list(Query::new("prod")).await?.is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventPublisher {
    socket: PubSocket,
    registration: Option<Registration>,
    topic: Bytes,
    id: u64,
    /// `id` as sent: 8 bytes big-endian, made once.
    id_frame: Bytes,
    sequence: AtomicU64,
    linger: Duration,
    dialect: Dialect,
}

impl EventPublisher {
    /// A builder for `namespace/component/topic`.
    pub fn builder(
        discovery: Arc<dyn Discovery>,
        namespace: impl Into<String>,
        component: impl Into<String>,
        topic: impl Into<String>,
    ) -> EventPublisherBuilder {
        EventPublisherBuilder {
            discovery: Some(discovery),
            namespace: namespace.into(),
            component: component.into(),
            ..EventPublisher::unregistered(topic)
        }
    }

    /// A builder for a publisher of `topic` registered nowhere, for deployments whose
    /// subscribers are configured statically (`StaticDiscovery`, or a script).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use eventplane::publish::EventPublisher;
    /// let publisher = EventPublisher::unregistered("kv-events").bind("tcp://127.0.0.1:0").build().await?;
    /// assert!(publisher.instance().is_none());
    /// # Ok(()) }
    /// ```
    pub fn unregistered(topic: impl Into<String>) -> EventPublisherBuilder {
        EventPublisherBuilder {
            discovery: None,
            namespace: String::new(),
            component: String::new(),
            topic: topic.into(),
            bind_host: "127.0.0.1".into(),
            bind: None,
            advertise_host: None,
            zmtp: zmtp::Config::default(),
            linger: Duration::from_secs(1),
            dialect: Dialect::EventPlane,
            worker: None,
            recovery: None,
            publisher_id: None,
        }
    }

    /// A publisher bound at exactly `endpoint` (`tcp://host:port`; port 0 lets the OS
    /// pick) and registered nowhere, for deployments whose subscribers are configured
    /// statically (`StaticDiscovery`, or a script). The publisher id is random
    /// (≤ 2^53 − 1) and the wire format is the same as a registered publisher's.
    ///
    /// ```
    /// use eventplane::publish::EventPublisher;
    /// use eventplane::zmtp::Config;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// let publisher =
    ///     EventPublisher::bind_unregistered("tcp://127.0.0.1:0", "kv-events", Config::default())
    ///         .await?;
    /// assert!(publisher.instance().is_none());
    /// assert!(publisher.local_endpoint().unwrap().starts_with("tcp://127.0.0.1:"));
    /// publisher.shutdown().await;
    /// # Ok(()) }
    /// ```
    pub async fn bind_unregistered(
        endpoint: &str,
        topic: impl Into<String>,
        zmtp: zmtp::Config,
    ) -> Result<EventPublisher, PublishError> {
        EventPublisher::unregistered(topic)
            .bind(endpoint)
            .zmtp_config(zmtp)
            .build()
            .await
    }

    /// A handle that serves more subscribers over connected streams (a tunnel
    /// source's data streams, DESIGN §7.4), with this publisher's bounds and counters.
    pub fn acceptor(&self) -> zmtp::StreamAcceptor {
        self.socket.acceptor()
    }

    /// The endpoint the socket is bound to (with the OS-assigned port).
    pub fn local_endpoint(&self) -> Option<&str> {
        self.socket.local_endpoint()
    }

    /// The publisher id sent in every message's second frame.
    pub fn publisher_id(&self) -> u64 {
        self.id
    }

    /// Sends one payload with the next sequence number. Never blocks.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::MemoryDiscovery;
    /// use eventplane::publish::EventPublisher;
    /// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "ns", "c", "t").build().await?;
    /// assert_eq!(publisher.next_sequence(), 0);
    /// let report = publisher.publish(&b"payload"[..]); // [t, publisher_id, 0, payload]
    /// assert_eq!(report.dropped, 0);
    /// assert_eq!(publisher.next_sequence(), 1);
    /// # Ok(()) }
    /// ```
    pub fn publish(&self, payload: impl Into<Bytes>) -> SendReport {
        let seq = self.sequence.fetch_add(1, Ordering::Relaxed);
        self.socket.send(self.dialect.encode_with_id(
            &self.topic,
            self.id,
            &self.id_frame,
            seq,
            payload.into(),
        ))
    }

    /// What this publisher writes.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The registered instance (id, endpoint, incarnation).
    pub fn instance(&self) -> Option<&Instance> {
        self.registration.as_ref().map(Registration::instance)
    }

    /// The next sequence number to be sent.
    pub fn next_sequence(&self) -> u64 {
        self.sequence.load(Ordering::Relaxed)
    }

    /// Socket counters (messages, queued, dropped, subscribers).
    pub fn stats(&self) -> PubStats {
        self.socket.stats()
    }

    /// Waits until `count` subscribers have subscribed, however long that takes; see
    /// [`wait_for_subscribers_within`](Self::wait_for_subscribers_within) for a bound.
    pub async fn wait_for_subscribers(&self, count: usize) {
        self.socket.wait_for_subscribers(count).await;
    }

    /// [`wait_for_subscribers`](Self::wait_for_subscribers) for at most `timeout`;
    /// [`PublishError::NoSubscribers`] says how many came when it runs out.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use eventplane::discovery::MemoryDiscovery;
    /// use eventplane::publish::{EventPublisher, PublishError};
    /// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "ns", "c", "t").build().await?;
    /// // Nobody follows this topic: an error after 20 ms instead of a hang.
    /// let err = publisher.wait_for_subscribers_within(1, Duration::from_millis(20)).await.unwrap_err();
    /// assert!(matches!(err, PublishError::NoSubscribers { wanted: 1, subscribed: 0, .. }));
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_subscribers_within(
        &self,
        count: usize,
        timeout: Duration,
    ) -> Result<(), PublishError> {
        match tokio::time::timeout(timeout, self.socket.wait_for_subscribers(count)).await {
            Ok(()) => Ok(()),
            Err(_) => Err(PublishError::NoSubscribers {
                wanted: count,
                subscribed: self.socket.stats().subscribed,
                waited: timeout,
                endpoint: match self.instance() {
                    Some(instance) => instance.transport.endpoint().to_owned(),
                    None => self.socket.local_endpoint().unwrap_or_default().to_owned(),
                },
            }),
        }
    }

    /// Lets queued messages drain (up to the linger period), unregisters, and closes
    /// the socket. Draining first means subscribers have the last messages before
    /// discovery tells them this publisher is gone.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::publish::PublishError> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::MemoryDiscovery;
    /// use eventplane::publish::EventPublisher;
    /// let publisher = EventPublisher::builder(Arc::new(MemoryDiscovery::new()), "ns", "c", "t").build().await?;
    /// let discovery_sees = publisher.instance().cloned();
    /// assert!(discovery_sees.is_some());
    /// publisher.shutdown().await; // drain (up to the linger), unregister, close
    /// # Ok(()) }
    /// ```
    pub async fn shutdown(self) {
        let EventPublisher {
            socket,
            registration,
            linger,
            ..
        } = self;
        socket.flush(linger).await;
        if let Some(r) = registration {
            if let Err(e) = r.unregister().await {
                tracing::warn!(error = %crate::net::ErrorChain(&e), "unregister failed; the lease will expire");
            }
        }
        socket.close(Duration::ZERO).await;
    }
}
