//! `EtcdDiscovery`: the distributed backend (feature `etcd`).

mod config;
mod record;
mod watch;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp,
};
use tokio::sync::{Notify, watch as state_watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

pub use config::DEFAULT_PREFIX;
use config::EtcdConfig;
use record::{Keys, RecordError, encode_value, prefix_end};

use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryStats, DiscoveryStream, Instance,
    Query, Registration, RegistrationHandle, Transport,
};
use crate::net::{Backoff, RateLimitedWarn, random_unit};

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
///   [`DiscoveryStats::malformed`] and logged (rate-limited), never fatal.
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

#[derive(Debug)]
struct Session {
    lease: i64,
    regs: HashMap<ChannelId, LocalReg>,
}

#[derive(Debug, Clone)]
struct LocalReg {
    serial: u64,
    key: String,
    value: String,
    /// The key's current `mod_revision` (changes when the key is put again).
    revision: i64,
}

/// Work handed to the session task by code that cannot wait for etcd: guard drops,
/// detaches, and futures dropped (or failed) part-way through a request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PendingKind {
    /// A dropped guard, or an `unregister` dropped before it took the registration out
    /// of the table: unregister it.
    Release,
    /// Move the registration to its own lease.
    Detach,
    /// An `unregister` dropped (or failed) after it took the registration out of the
    /// table: delete `key` if it still holds that incarnation (`mod_revision`).
    Delete { key: String, revision: i64 },
    /// A `register` dropped (or failed) while its put under `lease` was in flight, so
    /// etcd may or may not have applied it: take back what it may have left (see
    /// [`Shared::clean_abandoned`]). `rechecked` once that was looked at twice.
    Abandoned {
        key: String,
        lease: i64,
        rechecked: bool,
    },
}

#[derive(Debug)]
struct PendingOp {
    id: ChannelId,
    /// The registration's serial (for `Abandoned`, the serial the register took).
    serial: u64,
    kind: PendingKind,
}

/// Hands its op to the session task if dropped before [`disarm`](Self::disarm): how a
/// request whose future may be dropped part-way (or that failed without telling
/// whether etcd applied it) is finished in the background. Dropping only signals: it
/// never blocks or spawns.
#[must_use = "dropping the guard signals its clean-up at once"]
struct SignalOnDrop {
    shared: Arc<Shared>,
    op: Option<PendingOp>,
}

impl SignalOnDrop {
    fn arm(shared: &Arc<Shared>, op: PendingOp) -> SignalOnDrop {
        SignalOnDrop {
            shared: Arc::clone(shared),
            op: Some(op),
        }
    }

    /// The request completed: nothing is left to do.
    fn disarm(mut self) {
        self.op = None;
    }
}

impl Drop for SignalOnDrop {
    fn drop(&mut self) {
        if let Some(op) = self.op.take() {
            self.shared.signal(op);
        }
    }
}

impl fmt::Debug for SignalOnDrop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SignalOnDrop")
            .field("op", &self.op)
            .finish_non_exhaustive()
    }
}

/// Why an etcd request failed (boxed into [`DiscoveryError::Unavailable`]).
#[derive(Debug, thiserror::Error)]
enum EtcdRequestError {
    #[error("etcd {op} failed (endpoints {endpoints})")]
    Failed {
        op: &'static str,
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd {op} timed out after {after:?} (endpoints {endpoints})")]
    TimedOut {
        op: &'static str,
        endpoints: String,
        after: Duration,
    },
    #[error("etcd {op} answered without a response header")]
    NoHeader { op: &'static str },
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

    /// Counts and logs (rate-limited) a skipped record.
    pub(crate) fn skipped(&self, key: &[u8], err: &RecordError) {
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

    fn signal(&self, op: PendingOp) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(op);
        self.wake.notify_one();
    }

    /// Puts `value` at `key` under `lease`; returns the new `mod_revision`.
    async fn put(&self, key: &str, value: &str, lease: i64) -> Result<i64, DiscoveryError> {
        let mut kv = self.client.kv_client();
        let response = self
            .request(
                "put",
                kv.put(key, value, Some(PutOptions::new().with_lease(lease))),
            )
            .await?;
        response
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "put" }))
    }

    async fn grant(&self) -> Result<i64, DiscoveryError> {
        let mut lease = self.client.lease_client();
        let response = self
            .request("lease grant", lease.grant(self.config.ttl_secs(), None))
            .await?;
        Ok(response.id())
    }

    /// Puts a new registration and records it. Cancel-safe: dropped while its put is in
    /// flight (or when the put fails without saying whether etcd applied it), it leaves
    /// an `Abandoned` clean-up to the session task; the registration enters the table
    /// only once the put landed, and the caller turns the result into its guard without
    /// another await.
    async fn register(
        self: &Arc<Self>,
        id: ChannelId,
        transport: Transport,
    ) -> Result<(Instance, u64), DiscoveryError> {
        let key = self.keys.key(&id);
        let value = encode_value(&id, &transport);
        let mut session = self.session.lock().await;
        if self.shutdown.is_cancelled() {
            // `close` revoked the lease while this waited: do not grant a new one.
            return Err(DiscoveryError::Closed);
        }
        // Taken under the lock, serials order the puts of one id as etcd applies them
        // (which `clean_abandoned` relies on).
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let (revision, cleanup) = match self.put_new(&id, serial, &key, &value, session.lease).await
        {
            Ok(done) => done,
            Err(e) if is_lease_not_found(&e) => {
                // The lease is gone: re-grant now (putting every registration again),
                // then retry once under the new lease.
                self.regrant(&mut session).await?;
                self.put_new(&id, serial, &key, &value, session.lease)
                    .await?
            }
            Err(e) => return Err(e),
        };
        session.regs.insert(
            id.clone(),
            LocalReg {
                serial,
                key,
                value,
                revision,
            },
        );
        // In the table: from here on the guard the caller builds owns the key.
        cleanup.disarm();
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        let incarnation = u64::try_from(revision).unwrap_or_default();
        debug!(%id, incarnation, "registered in etcd");
        Ok((Instance::new(id, transport, incarnation), serial))
    }

    /// Puts a new registration's key under `lease`. Until the caller disarms the
    /// returned guard (once the registration is in the table), dropping this future or
    /// the guard signals an `Abandoned` clean-up. A refusal that proves nothing was
    /// applied (lease not found, denied, invalid) disarms it.
    async fn put_new(
        self: &Arc<Self>,
        id: &ChannelId,
        serial: u64,
        key: &str,
        value: &str,
        lease: i64,
    ) -> Result<(i64, SignalOnDrop), DiscoveryError> {
        let cleanup = SignalOnDrop::arm(
            self,
            PendingOp {
                id: id.clone(),
                serial,
                kind: PendingKind::Abandoned {
                    key: key.to_owned(),
                    lease,
                    rechecked: false,
                },
            },
        );
        match self.put(key, value, lease).await {
            Ok(revision) => Ok((revision, cleanup)),
            Err(e) if is_lease_not_found(&e) || !e.is_transient() => {
                cleanup.disarm();
                Err(e)
            }
            // A timeout or a lost connection: etcd may have applied the put.
            Err(e) => Err(e),
        }
    }

    /// Removes a registration and deletes its key. Cancel-safe: the registration
    /// leaves the table (so a lease re-grant no longer puts it back) before the delete
    /// is sent; dropped after that, or failing transiently, this leaves the delete to
    /// the session task.
    async fn unregister(
        self: &Arc<Self>,
        id: &ChannelId,
        serial: u64,
    ) -> Result<(), DiscoveryError> {
        let mut session = self.session.lock().await;
        if session.regs.get(id).is_none_or(|r| r.serial != serial) {
            // Replaced by a newer registration of the same id: nothing to remove.
            return Ok(());
        }
        let Some(reg) = session.regs.remove(id) else {
            return Ok(());
        };
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        let cleanup = SignalOnDrop::arm(
            self,
            PendingOp {
                id: id.clone(),
                serial,
                kind: PendingKind::Delete {
                    key: reg.key.clone(),
                    revision: reg.revision,
                },
            },
        );
        match self.delete_incarnation(&reg.key, reg.revision).await {
            Ok(()) => cleanup.disarm(),
            Err(e) if !e.is_transient() => {
                // Retrying cannot help; the key expires with the lease once this
                // backend is closed or dropped.
                cleanup.disarm();
                return Err(e);
            }
            Err(e) => return Err(e),
        }
        drop(session);
        debug!(%id, "unregistered from etcd");
        Ok(())
    }

    /// Deletes `key` if it still holds the incarnation `revision`: another process, or
    /// a later registration, may have replaced it.
    async fn delete_incarnation(&self, key: &str, revision: i64) -> Result<(), DiscoveryError> {
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::delete(key, None)]);
        let mut kv = self.client.kv_client();
        self.request("delete", kv.txn(txn)).await?;
        Ok(())
    }

    /// Takes back what an abandoned `register` of `id` (serial `serial`, put under
    /// `lease`) may have left. `Ok(true)` when it found no trace of the put, which may
    /// also mean that etcd has not applied it yet: worth a second look later.
    ///
    /// - A later registration of the id is in the table: the key is its. Nothing to do.
    /// - An earlier one is: the abandoned put may have overwritten its value. If the
    ///   key is on our lease but no longer at that registration's revision, its value
    ///   is put back (and its revision recorded), so its guard controls the key again.
    ///   After a re-grant, the re-grant already put it back.
    /// - None is: the key is deleted if it is on `lease` (so never another process's
    ///   key, nor a detached one).
    async fn clean_abandoned(
        &self,
        id: &ChannelId,
        serial: u64,
        key: &str,
        lease: i64,
    ) -> Result<bool, DiscoveryError> {
        let mut session = self.session.lock().await;
        let current_lease = session.lease;
        let mut kv = self.client.kv_client();
        match session.regs.get_mut(id) {
            Some(reg) if reg.serial >= serial => Ok(false),
            // Our lease was lost since (with every key on it): nothing can land there.
            Some(_) if lease != current_lease => Ok(false),
            Some(reg) => {
                let txn = Txn::new()
                    .when([
                        Compare::lease(key, CompareOp::Equal, lease),
                        Compare::mod_revision(key, CompareOp::NotEqual, reg.revision),
                    ])
                    .and_then([TxnOp::put(
                        key,
                        reg.value.clone(),
                        Some(PutOptions::new().with_lease(lease)),
                    )]);
                let response = self.request("restore", kv.txn(txn)).await?;
                if !response.succeeded() {
                    return Ok(true);
                }
                reg.revision = response
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| unavailable(EtcdRequestError::NoHeader { op: "restore" }))?;
                debug!(%id, revision = reg.revision, "an abandoned re-registration was taken back");
                Ok(false)
            }
            None => {
                let txn = Txn::new()
                    .when([Compare::lease(key, CompareOp::Equal, lease)])
                    .and_then([TxnOp::delete(key, None)]);
                let response = self.request("delete", kv.txn(txn)).await?;
                if response.succeeded() {
                    debug!(%id, "the key of an abandoned registration was deleted");
                }
                Ok(!response.succeeded())
            }
        }
    }

    /// Moves a registration to its own lease that is never renewed.
    async fn detach(&self, id: &ChannelId, serial: u64) -> Result<(), DiscoveryError> {
        let mut session = self.session.lock().await;
        let Some(reg) = session.regs.get(id).filter(|r| r.serial == serial).cloned() else {
            return Ok(());
        };
        let orphan = self.grant().await?;
        let txn = Txn::new()
            .when([Compare::mod_revision(
                reg.key.clone(),
                CompareOp::Equal,
                reg.revision,
            )])
            .and_then([TxnOp::put(
                reg.key.clone(),
                reg.value.clone(),
                Some(PutOptions::new().with_lease(orphan)),
            )]);
        let mut kv = self.client.kv_client();
        self.request("detach", kv.txn(txn)).await?;
        session.regs.remove(id);
        self.counters
            .registrations
            .store(session.regs.len(), Ordering::Relaxed);
        debug!(%id, lease = orphan, "detached: expires with its own lease");
        Ok(())
    }

    /// Grants a new lease and puts every live registration under it.
    async fn regrant(&self, session: &mut Session) -> Result<(), DiscoveryError> {
        self.counters.lease_losses.fetch_add(1, Ordering::Relaxed);
        let lease = self.grant().await?;
        for (id, reg) in session.regs.iter_mut() {
            reg.revision = self.put(&reg.key, &reg.value, lease).await?;
            debug!(%id, revision = reg.revision, "registration put again under the new lease");
        }
        session.lease = lease;
        self.lease_id.store(lease, Ordering::Relaxed);
        warn!(
            lease,
            registrations = session.regs.len(),
            "etcd lease was lost: granted a new one and put every registration again"
        );
        Ok(())
    }

    /// Carries out work signalled by guard drops, detaches and dropped futures. Work
    /// that failed transiently is kept for the next round; work that cannot succeed
    /// (refused credentials or permissions) is given up with a warning.
    async fn process_pending(self: &Arc<Self>) -> Result<(), DiscoveryError> {
        let ops = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let mut ops = ops.into_iter();
        let mut later = Vec::new();
        let mut outcome = Ok(());
        while let Some(op) = ops.next() {
            let result = match &op.kind {
                PendingKind::Release => self.unregister(&op.id, op.serial).await,
                PendingKind::Detach => self.detach(&op.id, op.serial).await,
                PendingKind::Delete { key, revision } => {
                    self.delete_incarnation(key, *revision).await
                }
                PendingKind::Abandoned {
                    key,
                    lease,
                    rechecked,
                } => match self.clean_abandoned(&op.id, op.serial, key, *lease).await {
                    // Nothing found: unless already looked at twice, look again next
                    // round, in case etcd applies the dropped put only now.
                    Ok(true) if !rechecked => {
                        later.push(PendingOp {
                            id: op.id.clone(),
                            serial: op.serial,
                            kind: PendingKind::Abandoned {
                                key: key.clone(),
                                lease: *lease,
                                rechecked: true,
                            },
                        });
                        Ok(())
                    }
                    other => other.map(|_| ()),
                },
            };
            match result {
                Ok(()) => {}
                Err(e) if !e.is_transient() => {
                    if let Some(suppressed) =
                        self.warn.check("pending-denied", std::time::Instant::now())
                    {
                        warn!(error = %e, id = %op.id, suppressed, "giving up deferred etcd work");
                    }
                }
                Err(e) => {
                    later.push(op);
                    later.extend(ops);
                    outcome = Err(e);
                    break;
                }
            }
        }
        if !later.is_empty() {
            // Not signalled: kept for the next round (the next keep-alive, or wake-up).
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(later);
        }
        outcome
    }
}

fn unavailable(e: EtcdRequestError) -> DiscoveryError {
    DiscoveryError::Unavailable(Box::new(e))
}

/// Wraps a failed request: refused credentials or permissions are
/// [`DiscoveryError::Denied`] (retrying will not help), bad arguments
/// [`DiscoveryError::InvalidConfig`], everything else
/// [`DiscoveryError::Unavailable`].
fn failed(op: &'static str, endpoints: String, source: etcd_client::Error) -> DiscoveryError {
    use etcd_client::Error as E;
    match &source {
        E::InvalidArgs(_) | E::InvalidUri(_) | E::EndpointError(_) => {
            DiscoveryError::InvalidConfig {
                reason: format!("etcd {op} (endpoints {endpoints}): {source}"),
            }
        }
        E::GRpcStatus(status) if is_denial(status.message()) => {
            DiscoveryError::Denied(Box::new(EtcdRequestError::Failed {
                op,
                endpoints,
                source,
            }))
        }
        _ => unavailable(EtcdRequestError::Failed {
            op,
            endpoints,
            source,
        }),
    }
}

/// etcd's messages for authentication and authorization failures.
fn is_denial(message: &str) -> bool {
    [
        "authentication failed",
        "permission denied",
        "user name is empty",
        "invalid auth token",
        "user name not found",
    ]
    .iter()
    .any(|m| message.contains(m))
}

fn is_lease_not_found(e: &DiscoveryError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        // etcd answers "etcdserver: requested lease not found" to a put and the
        // client reports "lease not found" on the keep-alive stream.
        if err.to_string().contains("lease not found") {
            return true;
        }
        source = err.source();
    }
    false
}

/// What one keep-alive round found.
enum KeepAlive {
    Alive,
    Lost,
}

/// The session task: lease keep-alive and re-grant, plus signalled work.
struct Maintainer {
    shared: Arc<Shared>,
    keeper: Option<(LeaseKeeper, LeaseKeepAliveStream, i64)>,
}

impl Maintainer {
    async fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let mut backoff = shared.backoff();
        let mut next = tokio::time::Instant::now() + shared.config.keepalive_every();
        loop {
            tokio::select! {
                biased;
                () = shared.shutdown.cancelled() => break,
                () = shared.wake.notified() => {
                    if let Err(e) = shared.process_pending().await {
                        debug!(error = %e, "deferred etcd work failed; retrying with the keep-alive");
                    }
                }
                () = tokio::time::sleep_until(next) => {
                    let outcome = match self.keep_alive().await {
                        Err(e) if is_lease_not_found(&e) => Ok(KeepAlive::Lost),
                        other => other,
                    };
                    let healthy = match outcome {
                        Ok(KeepAlive::Alive) => true,
                        Ok(KeepAlive::Lost) => {
                            self.keeper = None;
                            let mut session = shared.session.lock().await;
                            match shared.regrant(&mut session).await {
                                Ok(()) => true,
                                Err(e) => {
                                    warn!(error = %e, "could not re-grant the etcd lease");
                                    false
                                }
                            }
                        }
                        Err(e) => {
                            self.keeper = None;
                            if let Some(suppressed) =
                                shared.warn.check("keepalive", std::time::Instant::now())
                            {
                                warn!(error = %e, suppressed, "etcd keep-alive failed; reconnecting");
                            }
                            false
                        }
                    };
                    if healthy {
                        if shared.state.borrow().eq(&EtcdState::Reconnecting) {
                            info!("etcd session live again");
                        }
                        shared.set_state(EtcdState::Live);
                        backoff.reset();
                        if let Err(e) = shared.process_pending().await {
                            debug!(error = %e, "deferred etcd work failed");
                        }
                        next = tokio::time::Instant::now() + shared.config.keepalive_every();
                    } else {
                        shared.set_state(EtcdState::Reconnecting);
                        let delay = backoff
                            .next_delay(random_unit())
                            .max(shared.config.backoff_min)
                            .min(shared.config.keepalive_every());
                        next = tokio::time::Instant::now() + delay;
                    }
                }
            }
        }
        // Best effort: carry out drops that raced the shutdown, then give the lease
        // back if nothing is left on it (after `close` it is already revoked).
        let _ = shared.process_pending().await;
        let session = shared.session.lock().await;
        if session.regs.is_empty() && !shared.closed.load(Ordering::Relaxed) {
            let mut lease = shared.client.lease_client();
            let _ = shared
                .request("lease revoke", lease.revoke(session.lease))
                .await;
        }
    }

    async fn keep_alive(&mut self) -> Result<KeepAlive, DiscoveryError> {
        let shared = Arc::clone(&self.shared);
        let lease = shared.lease_id.load(Ordering::Relaxed);
        if self.keeper.as_ref().is_none_or(|k| k.2 != lease) {
            let mut client = shared.client.lease_client();
            let (keeper, stream) = shared
                .request("lease keep-alive", client.keep_alive(lease))
                .await?;
            self.keeper = Some((keeper, stream, lease));
        }
        let Some((keeper, stream, _)) = self.keeper.as_mut() else {
            return Ok(KeepAlive::Lost);
        };
        shared
            .request("lease keep-alive", keeper.keep_alive())
            .await?;
        match shared.request("lease keep-alive", stream.message()).await? {
            Some(response) if response.ttl() > 0 => Ok(KeepAlive::Alive),
            Some(_) => Ok(KeepAlive::Lost),
            None => Err(DiscoveryError::WatchEnded {
                reason: "etcd closed the keep-alive stream".to_owned(),
            }),
        }
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
        let keys = Keys::new(&config.prefix);
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
