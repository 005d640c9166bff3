//! `EtcdDiscovery`: the distributed backend (feature `etcd`).

mod backend;
mod builder;
mod config;
mod error;
mod lease;
mod record;
mod registry;
mod shared;
mod table;
mod watch;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tokio::sync::{Notify, watch as state_watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info};

pub use builder::EtcdDiscoveryBuilder;
use config::EtcdConfig;
use error::{EtcdRequestError, failed, unavailable};
use lease::Maintainer;
use record::{Keys, prefix_end};
pub use shared::EtcdState;
pub(crate) use shared::{Counters, Shared};
use table::Session;

use super::DiscoveryError;
use crate::net::RateLimitedWarn;

/// The distributed discovery backend, on etcd v3 (feature `etcd`).
///
/// - Keys `{prefix}/v1/channels/{ns}/{component}/{topic}/{publisher_id:x}` (prefix
///   default `/eventplane`; each segment percent-encoded as in
///   [`ChannelId::to_path`](crate::discovery::ChannelId::to_path)), each value a JSON
///   record, at most 64 KiB:
///
///   ```text
///   {"id": {"namespace": "prod", "component": "worker", "topic": "kv-events",
///           "publisher_id": 42},
///    "transport": {"kind": "zmq", "endpoint": "tcp://10.0.0.5:41234"},
///    "worker": {"worker_id": 7, "dp_rank": 0},
///    "recovery": "tcp://10.0.0.5:41235"}
///   ```
///
///   `recovery` (optional) is where the worker serves its recovery log
///   ([`kv::pipeline::RecoveryServer`](crate::kv::pipeline::RecoveryServer)); a value that is not
///   `tcp://host:port` is ignored (with a warning), the record kept.
///
///   `publisher_id` is an integer ≤ 2^53 − 1 and the key's last segment is it in
///   lower-case hex; `worker` (optional) is the worker the publisher speaks for,
///   `worker_id` a `u64` (keep it ≤ 2^53 − 1 where registrars parse JSON numbers as
///   doubles) and `dp_rank` a `u32`: subscribers see it as
///   [`Instance::worker`](crate::discovery::Instance::worker), a KV router's way to
///   know whose events these are before decoding them (write it; a record without it
///   is followed, but its deliveries carry no worker). This is a public contract:
///   processes in any language may register this way. Unknown fields are ignored; a
///   malformed record (a missing or mistyped field, an id that disagrees with its key,
///   a transport kind other than `zmq`, an empty endpoint, a `worker` out of range)
///   is skipped, counted in
///   [`DiscoveryStats::malformed`](crate::discovery::DiscoveryStats::malformed) and logged (rate-limited), never fatal. With
///   [`Dialect::Dynamo`](EtcdDiscoveryBuilder::dialect) it reads and writes
///   Dynamo's records instead.
/// - One lease per `EtcdDiscovery` (TTL default 10 s, renewed every TTL/3) carries every
///   registration. If etcd reports the lease lost (expired during an outage, or revoked),
///   a new one is granted and every live registration is put again
///   ([`DiscoveryStats::lease_losses`](crate::discovery::DiscoveryStats::lease_losses)). [`state`](Self::state) tells whether the
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
/// - [`Registration::detach`](crate::discovery::Registration::detach) moves the key to its own lease that is never renewed, so
///   it expires after the TTL exactly as if this process had died.
///
/// Dropping a [`Registration`](crate::discovery::Registration) deletes its key in the background; the session (lease
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

/// Keeps the session alive; the last one dropped stops it.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
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
        let keys = Keys::new(&config.prefix, config.dialect, config.records.as_ref());
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
            Err(e) => {
                debug!(error = %crate::net::ErrorChain(&e), "could not revoke the etcd lease; it will expire")
            }
        }
        session.regs.clear();
        shared.counters.registrations.store(0, Ordering::Relaxed);
    }
}
