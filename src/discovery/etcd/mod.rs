//! `EtcdDiscovery`: the distributed backend (feature `etcd`).

mod config;
mod dynamo;
mod error;
mod lease;
mod record;
mod registry;
mod watch;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tokio::sync::{Notify, watch as state_watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

pub use config::DEFAULT_PREFIX;
use config::EtcdConfig;
pub use dynamo::DynamoRecords;
use error::{EtcdRequestError, failed, unavailable};
use lease::Maintainer;
pub use record::RecordFormat;
use record::{Keys, RecordError, prefix_end};
use registry::{PendingKind, PendingOp, Session, SignalOnDrop};

use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance,
    Query, Registration, RegistrationHandle, Transport,
};
use crate::net::{Backoff, RateLimitedWarn};

/// Whether an [`EtcdDiscovery`]'s session with etcd is healthy.
///
/// ```
/// use eventplane::discovery::EtcdState;
/// assert_ne!(EtcdState::Live, EtcdState::Reconnecting);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EtcdState {
    /// The lease was renewed within the last keep-alive period: registrations are up.
    Live,
    /// The last keep-alive failed; the backend is retrying with backoff. Registrations
    /// survive while etcd keeps the lease (its TTL); if it was lost, they are put again
    /// under a new lease on reconnect.
    Reconnecting,
}

/// The distributed discovery backend, on etcd v3 (feature `etcd`).
///
/// - Keys `{prefix}/v1/channels/{ns}/{component}/{topic}/{publisher_id:x}` (prefix
///   default [`DEFAULT_PREFIX`]), each value a JSON record
///   `{"id":{"namespace","component","topic","publisher_id"},"transport":{"kind":"zmq","endpoint"}}`.
///   This is a public contract: processes in any language may register this way.
///   Unknown fields are ignored; a malformed record is skipped, counted in
///   [`DiscoveryStats::malformed`] and logged (rate-limited), never fatal. With
///   [`RecordFormat::Dynamo`](EtcdDiscoveryBuilder::record_format) it reads and writes
///   Dynamo's records instead.
/// - One lease per `EtcdDiscovery` (TTL default 10 s, renewed every TTL/3) carries every
///   registration. If etcd reports the lease lost (expired during an outage, or revoked),
///   a new one is granted and every live registration is put again
///   ([`DiscoveryStats::lease_losses`]). [`state`](Self::state) tells whether the
///   session is [`Live`](EtcdState::Live).
/// - The incarnation of an instance is its key's `mod_revision`.
/// - `watch` reads the matching keys at one revision R (in pages), then watches from
///   R + 1 with previous values, and returns once etcd acknowledged the watch: no change
///   can fall between. On any stream error or compaction the watch reconnects with
///   jittered backoff (250 ms → 5 s), reads afresh and emits a `Resync`. Each watch has
///   its own bounded backlog (`watch_buffer`, default 1024) that collapses into a
///   `Resync` when the consumer falls behind.
/// - A re-put that leaves a record's value unchanged (a detach, or a foreign writer
///   refreshing its key) is not a change and is not reported.
/// - [`Registration::detach`] moves the key to its own lease that is never renewed, so
///   it expires after the TTL exactly as if this process had died.
///
/// Dropping a [`Registration`] deletes its key in the background; the session (lease
/// keep-alive) lives while any clone of the `EtcdDiscovery` or any registration guard
/// does. Dropping a `register` or `unregister` future part-way is safe: a put that
/// etcd may have applied is taken back in the background (unless a later registration
/// of the id owns the key; an earlier one gets its value back), an unregister once
/// started is finished in the background, and a lease re-grant puts back only the
/// registrations whose guards are held. A watch cancelled (or dropped) while it
/// reconnects stops at once. [`close`](Self::close) revokes the lease, deleting every
/// registration made through it at once.
///
/// ```no_run
/// use eventplane::discovery::{ChannelId, Discovery, EtcdDiscovery, Query, Transport};
/// # #[tokio::main]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = EtcdDiscovery::connect(["http://127.0.0.1:2379"]).await?;
/// let id = ChannelId::new("prod", "worker", "kv-events", 7)?;
/// let registration = discovery.register(id, Transport::zmq("tcp://10.0.0.5:41234")).await?;
/// let listed = discovery.list(Query::new("prod").component("worker")).await?;
/// assert!(listed.contains(registration.instance()));
/// registration.unregister().await?;
/// discovery.close().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdDiscovery {
    handle: Arc<Handle>,
}

impl fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.handle.shared.config.endpoints)
            .field("prefix", &self.handle.shared.config.prefix)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

/// Builds an [`EtcdDiscovery`]. Every setter documents its default.
///
/// ```no_run
/// use std::time::Duration;
/// use eventplane::discovery::EtcdDiscovery;
/// # #[tokio::main]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let discovery = EtcdDiscovery::builder(["http://10.0.0.2:2379", "http://10.0.0.3:2379"])
///     .prefix("/prod-eventplane")
///     .lease_ttl(Duration::from_secs(15))
///     .connect()
///     .await?;
/// # let _ = discovery;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct EtcdDiscoveryBuilder {
    config: EtcdConfig,
}

impl EtcdDiscoveryBuilder {
    /// Key prefix; keys live under `{prefix}/v1/channels/`. Default
    /// [`DEFAULT_PREFIX`] (`/eventplane`). Must start with `/` and not end with one.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.prefix = prefix.into();
        self
    }

    /// Which records to read and write: ours ([`RecordFormat::EventPlane`], the
    /// default) or Dynamo's ([`RecordFormat::Dynamo`]: `v1/event_channels/…` with
    /// `v1/event_sources/…` beside each registration, both under the lease), to
    /// follow Dynamo workers or to be followed by a Dynamo router.
    ///
    /// ```no_run
    /// use eventplane::discovery::{DynamoRecords, EtcdDiscovery, RecordFormat};
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// // A worker: its registrations are what a Dynamo 1.6 worker would write.
    /// let discovery = EtcdDiscovery::builder(["http://127.0.0.1:2379"])
    ///     .record_format(RecordFormat::Dynamo(DynamoRecords::new().endpoint("generate").worker(77, 0)))
    ///     .connect()
    ///     .await?;
    /// # let _ = discovery;
    /// # Ok(()) }
    /// ```
    pub fn record_format(mut self, format: RecordFormat) -> Self {
        self.config.format = format;
        self
    }

    /// Lease TTL: how long registrations outlive this process (or an outage). Default
    /// 10 s, renewed every TTL/3; 2 s ..= 1 h, whole seconds.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.config.lease_ttl = ttl;
        self
    }

    /// How long `connect` waits for etcd to answer its readiness check. Default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// Deadline of each request to etcd (a `register`, one page of a `list`, a watch's
    /// creation). Default 5 s.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.config.request_timeout = timeout;
        self
    }

    /// Events buffered per watch before its backlog collapses into a `Resync`. Default
    /// 1024 (about 200 bytes each, plus the instances a `Resync` carries).
    pub fn watch_buffer(mut self, events: usize) -> Self {
        self.config.watch_buffer = events;
        self
    }

    /// Keys read per page by `list` and a watch's (re)sync. Default 1000; a page too
    /// large for the client's 4 MiB message limit is retried smaller.
    pub fn page_size(mut self, keys: usize) -> Self {
        self.config.page_size = keys;
        self
    }

    /// Records larger than this are skipped as malformed. Default 64 KiB.
    pub fn max_value_bytes(mut self, bytes: usize) -> Self {
        self.config.max_value_bytes = bytes;
        self
    }

    /// Authenticates as `user` (etcd with auth enabled); the token is refreshed when it
    /// expires. Default: no authentication. (Plain `http://` endpoints: run etcd on a
    /// trusted network or behind a TLS tunnel.)
    pub fn credentials(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.config.credentials = Some((user.into(), config::Password(password.into())));
        self
    }

    /// Reconnect backoff of watches and the keep-alive (full jitter). Default
    /// 250 ms → 5 s.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.backoff_min = min;
        self.config.backoff_max = max;
        self
    }

    /// Validates the settings, checks that etcd answers (a status request, since the
    /// client itself connects lazily) and that our keys may be read (a one-key read
    /// under the prefix), grants the lease and starts its keep-alive.
    ///
    /// # Errors
    /// [`DiscoveryError::InvalidConfig`] for bad settings,
    /// [`DiscoveryError::Denied`] when etcd refuses the credentials (or, without
    /// credentials, requires them), [`DiscoveryError::Unavailable`] when etcd does
    /// not answer in time.
    pub async fn connect(self) -> Result<EtcdDiscovery, DiscoveryError> {
        EtcdDiscovery::start(self.config).await
    }
}

/// Keeps the session alive; the last one dropped stops it.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

pub(crate) struct Shared {
    client: Client,
    config: EtcdConfig,
    keys: Keys,
    /// Serializes everything that touches the lease or the registration table:
    /// registers, unregisters, lease re-grants.
    session: tokio::sync::Mutex<Session>,
    /// The current lease id (mirror of `session.lease`, readable without locking).
    lease_id: AtomicI64,
    /// Work signalled from synchronous code (guard drops, detaches).
    pending: Mutex<Vec<PendingOp>>,
    wake: Notify,
    state: state_watch::Sender<EtcdState>,
    shutdown: CancellationToken,
    /// `close` revoked the lease.
    closed: AtomicBool,
    next_serial: AtomicU64,
    pub(crate) counters: Counters,
    pub(crate) warn: RateLimitedWarn,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    registrations: AtomicUsize,
    pub(crate) watchers: AtomicUsize,
    pub(crate) buffered_events: AtomicUsize,
    pub(crate) overflow_resyncs: AtomicU64,
    pub(crate) malformed: AtomicU64,
    lease_losses: AtomicU64,
    pub(crate) reconnects: AtomicU64,
}

impl Shared {
    fn endpoints(&self) -> String {
        self.config.endpoints.join(",")
    }

    /// Runs one request with the request timeout, wrapping failures.
    pub(crate) async fn request<T, F>(&self, op: &'static str, fut: F) -> Result<T, DiscoveryError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.request_within(op, self.config.request_timeout, fut)
            .await
    }

    async fn request_within<T, F>(
        &self,
        op: &'static str,
        after: Duration,
        fut: F,
    ) -> Result<T, DiscoveryError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(after, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(failed(op, self.endpoints(), source)),
            Err(_) => Err(unavailable(EtcdRequestError::TimedOut {
                op,
                endpoints: self.endpoints(),
                after,
            })),
        }
    }

    pub(crate) fn keys(&self) -> &Keys {
        &self.keys
    }

    pub(crate) fn config_watch_buffer(&self) -> usize {
        self.config.watch_buffer
    }

    pub(crate) fn backoff(&self) -> Backoff {
        Backoff::new(self.config.backoff_min, self.config.backoff_max)
    }

    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// Counts and logs (rate-limited) a skipped record; a record of another Dynamo
    /// endpoint is not followed, not malformed.
    pub(crate) fn skipped(&self, key: &[u8], err: &RecordError) {
        if *err == RecordError::Unfollowed {
            return;
        }
        self.counters.malformed.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.warn.check("malformed", std::time::Instant::now()) {
            warn!(
                key = %String::from_utf8_lossy(key.get(..key.len().min(256)).unwrap_or_default()),
                error = %err,
                suppressed,
                "skipping a malformed discovery record"
            );
        }
    }

    /// Reads every key under `prefix` at one revision, page by page, keeping those
    /// `query` matches. Returns the revision and the instances.
    pub(crate) async fn snapshot(
        &self,
        prefix: &str,
        query: &Query,
    ) -> Result<(i64, Vec<Instance>), DiscoveryError> {
        let end = prefix_end(prefix.as_bytes());
        let mut restarts = 0;
        'restart: loop {
            let mut out = Vec::new();
            let mut revision = 0i64;
            let mut from = prefix.as_bytes().to_vec();
            let mut page = self.config.page_size;
            loop {
                let mut options = GetOptions::new()
                    .with_range(end.clone())
                    .with_limit(i64::try_from(page).unwrap_or(i64::MAX));
                if revision > 0 {
                    options = options.with_revision(revision);
                }
                let mut kv = self.client.kv_client();
                let response = match tokio::time::timeout(
                    self.config.request_timeout,
                    kv.get(from.clone(), Some(options)),
                )
                .await
                {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => {
                        let text = e.to_string();
                        if text.contains("message length too large") && page > 1 {
                            page = (page / 4).max(1);
                            debug!(page, "etcd page too large, retrying smaller");
                            continue;
                        }
                        if text.contains("compacted") && revision > 0 && restarts < 5 {
                            restarts += 1;
                            continue 'restart;
                        }
                        return Err(failed("range", self.endpoints(), e));
                    }
                    Err(_) => {
                        return Err(unavailable(EtcdRequestError::TimedOut {
                            op: "range",
                            endpoints: self.endpoints(),
                            after: self.config.request_timeout,
                        }));
                    }
                };
                if revision == 0 {
                    revision = response
                        .header()
                        .map(|h| h.revision())
                        .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "range" }))?;
                }
                let kvs = response.kvs();
                for kv in kvs {
                    match self.keys.parse(
                        kv.key(),
                        kv.value(),
                        kv.mod_revision(),
                        self.config.max_value_bytes,
                    ) {
                        Ok(instance) if query.matches(&instance.id) => out.push(instance),
                        Ok(_) => {}
                        Err(e) => self.skipped(kv.key(), &e),
                    }
                }
                match kvs.last() {
                    Some(last) if response.more() => {
                        from = last.key().to_vec();
                        from.push(0);
                    }
                    _ => return Ok((revision, out)),
                }
            }
        }
    }

    fn set_state(&self, state: EtcdState) {
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }
}

impl EtcdDiscovery {
    /// Connects with default settings: see [`builder`](Self::builder).
    ///
    /// # Errors
    /// As [`EtcdDiscoveryBuilder::connect`].
    pub async fn connect<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<EtcdDiscovery, DiscoveryError> {
        EtcdDiscovery::builder(endpoints).connect().await
    }

    /// A builder for endpoints like `http://10.0.0.2:2379` (several for a cluster).
    pub fn builder<E: AsRef<str>>(endpoints: impl IntoIterator<Item = E>) -> EtcdDiscoveryBuilder {
        EtcdDiscoveryBuilder {
            config: EtcdConfig::new(
                endpoints
                    .into_iter()
                    .map(|e| e.as_ref().to_owned())
                    .collect(),
            ),
        }
    }

    async fn start(config: EtcdConfig) -> Result<EtcdDiscovery, DiscoveryError> {
        config.validate()?;
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        let options = match &config.credentials {
            Some((user, password)) => options
                .with_user(user.clone(), password.0.clone())
                .with_auto_token_refresh(true),
            None => options,
        };
        let endpoints = config.endpoints.join(",");
        // With credentials the client authenticates here (a real request); without, it
        // connects lazily and the status request below is the readiness check.
        let client = match tokio::time::timeout(
            config.connect_timeout,
            Client::connect(&config.endpoints, Some(options)),
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(failed("connect", endpoints, e)),
            Err(_) => {
                return Err(unavailable(EtcdRequestError::TimedOut {
                    op: "connect",
                    endpoints,
                    after: config.connect_timeout,
                }));
            }
        };
        let (state, _) = state_watch::channel(EtcdState::Live);
        let keys = Keys::new(&config.prefix, &config.format);
        let mut shared = Shared {
            client,
            keys,
            session: tokio::sync::Mutex::new(Session {
                lease: 0,
                regs: HashMap::new(),
            }),
            lease_id: AtomicI64::new(0),
            pending: Mutex::new(Vec::new()),
            wake: Notify::new(),
            state,
            shutdown: CancellationToken::new(),
            closed: AtomicBool::new(false),
            next_serial: AtomicU64::new(1),
            counters: Counters::default(),
            warn: RateLimitedWarn::default(),
            config,
        };
        // Readiness: the client connects lazily, so ask for the server's status.
        let mut maintenance = shared.client.maintenance_client();
        shared
            .request_within(
                "status",
                shared.config.connect_timeout,
                maintenance.status(),
            )
            .await?;
        // And that we may read our keys (with auth enabled, a missing permission shows
        // here as `Denied`, not at the first watch).
        let mut kv = shared.client.kv_client();
        let root = shared.keys.root().to_owned();
        shared
            .request_within(
                "range",
                shared.config.connect_timeout,
                kv.get(
                    root.clone(),
                    Some(
                        GetOptions::new()
                            .with_range(prefix_end(root.as_bytes()))
                            .with_keys_only()
                            .with_limit(1),
                    ),
                ),
            )
            .await?;
        let lease = shared.grant().await?;
        shared.session.get_mut().lease = lease;
        shared.lease_id.store(lease, Ordering::Relaxed);
        let shared = Arc::new(shared);
        let span = tracing::debug_span!("etcd_discovery", endpoints = %shared.endpoints(), lease);
        tokio::spawn(
            Maintainer {
                shared: Arc::clone(&shared),
                keeper: None,
            }
            .run()
            .instrument(span),
        );
        info!(endpoints = %shared.endpoints(), prefix = %shared.config.prefix, lease, "connected to etcd");
        Ok(EtcdDiscovery {
            handle: Arc::new(Handle { shared }),
        })
    }

    /// The session's health now.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// use eventplane::discovery::{EtcdDiscovery, EtcdState};
    /// let discovery = EtcdDiscovery::connect(["http://127.0.0.1:2379"]).await?;
    /// if discovery.state() == EtcdState::Reconnecting {
    ///     eprintln!("etcd unreachable; registrations live until lease {:x} expires", discovery.lease_id());
    /// }
    /// # Ok(()) }
    /// ```
    pub fn state(&self) -> EtcdState {
        *self.handle.shared.state.borrow()
    }

    /// A receiver that sees every change of [`state`](Self::state).
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// use eventplane::discovery::{EtcdDiscovery, EtcdState};
    /// let discovery = EtcdDiscovery::connect(["http://127.0.0.1:2379"]).await?;
    /// let mut states = discovery.state_changes();
    /// tokio::spawn(async move {
    ///     while states.changed().await.is_ok() {
    ///         let state = *states.borrow();
    ///         eprintln!("etcd session: {state:?}");
    ///     }
    /// });
    /// # Ok(()) }
    /// ```
    pub fn state_changes(&self) -> state_watch::Receiver<EtcdState> {
        self.handle.shared.state.subscribe()
    }

    /// The id of the lease carrying this backend's registrations (for operators:
    /// `etcdctl lease timetolive --keys <id in hex>`).
    pub fn lease_id(&self) -> i64 {
        self.handle.shared.lease_id.load(Ordering::Relaxed)
    }

    /// Stops the keep-alive and revokes the lease: every registration made through
    /// this backend disappears at once (watchers see `Removed`). Registration guards
    /// still alive become inert. Best effort: if etcd is unreachable, the lease simply
    /// expires after its TTL.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
    /// use eventplane::discovery::{EtcdDiscovery, EtcdState};
    /// let discovery = EtcdDiscovery::connect(["http://127.0.0.1:2379"]).await?;
    /// // … serve …
    /// discovery.close().await; // revokes the lease: every registration goes at once
    /// # Ok(()) }
    /// ```
    pub async fn close(&self) {
        let shared = &self.handle.shared;
        shared.closed.store(true, Ordering::Relaxed);
        shared.shutdown.cancel();
        let mut session = shared.session.lock().await;
        let mut lease = shared.client.lease_client();
        match shared
            .request("lease revoke", lease.revoke(session.lease))
            .await
        {
            Ok(_) => debug!(lease = session.lease, "etcd lease revoked"),
            Err(e) => debug!(error = %e, "could not revoke the etcd lease; it will expire"),
        }
        session.regs.clear();
        shared.counters.registrations.store(0, Ordering::Relaxed);
    }
}

impl Discovery for EtcdDiscovery {
    fn register(
        &self,
        id: ChannelId,
        transport: Transport,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        Box::pin(async move {
            if self.handle.shared.shutdown.is_cancelled() {
                return Err(DiscoveryError::Closed);
            }
            let (instance, serial) = self.handle.shared.register(id, transport).await?;
            let guard = EtcdRegistration {
                handle: Arc::clone(&self.handle),
                id: instance.id.clone(),
                serial,
            };
            Ok(Registration::new(instance, Box::new(guard)))
        })
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move {
            let shared = &self.handle.shared;
            let prefix = shared.keys.query_prefix(&query);
            Ok(shared.snapshot(&prefix, &query).await?.1)
        })
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        Box::pin(watch::start(Arc::clone(&self.handle.shared), query, cancel))
    }

    fn stats(&self) -> DiscoveryStats {
        let c = &self.handle.shared.counters;
        DiscoveryStats {
            registrations: c.registrations.load(Ordering::Relaxed),
            watchers: c.watchers.load(Ordering::Relaxed),
            buffered_events: c.buffered_events.load(Ordering::Relaxed),
            overflow_resyncs: c.overflow_resyncs.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            lease_losses: c.lease_losses.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            ..DiscoveryStats::default()
        }
    }
}

/// The guard behind an etcd [`Registration`].
struct EtcdRegistration {
    handle: Arc<Handle>,
    id: ChannelId,
    serial: u64,
}

impl fmt::Debug for EtcdRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdRegistration")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RegistrationHandle for EtcdRegistration {
    fn unregister(self: Box<Self>) -> BoxFuture<'static, Result<(), DiscoveryError>> {
        // Dropped before it took the registration out of the table (even unpolled),
        // this future releases it as a dropped guard would. From there on
        // `Shared::unregister` sees the delete through, retrying a failure in the
        // background.
        let release = SignalOnDrop::arm(
            &self.handle.shared,
            PendingOp {
                id: self.id.clone(),
                serial: self.serial,
                kind: PendingKind::Release,
            },
        );
        Box::pin(async move {
            let result = self.handle.shared.unregister(&self.id, self.serial).await;
            release.disarm();
            result
        })
    }

    fn release(self: Box<Self>) {
        self.handle.shared.signal(PendingOp {
            id: self.id.clone(),
            serial: self.serial,
            kind: PendingKind::Release,
        });
    }

    fn detach(self: Box<Self>) {
        self.handle.shared.signal(PendingOp {
            id: self.id.clone(),
            serial: self.serial,
            kind: PendingKind::Detach,
        });
    }
}
