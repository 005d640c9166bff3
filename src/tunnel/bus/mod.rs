//! The router's event bus (DESIGN §7.3): a TLS + HTTP/2 server that authenticates
//! brokers, runs their sessions ([`RouterSession`](crate::tunnel::RouterSession)), and opens publisher connections
//! through them ([`EventBus::open_stream`]).

pub(crate) mod accept;
pub(crate) mod admission;
pub(crate) mod auth;
pub(crate) mod serve;
pub(crate) mod sources;
pub(crate) mod state;

pub use auth::{BusClients, TokenDigest};
pub use sources::AnnouncedView;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::discovery::ChannelId;
use crate::tunnel::bus::accept::accept_loop;
use crate::tunnel::bus::admission::Pending;
use crate::tunnel::bus::serve::{Command, Counters, Inner, Waiter};
use crate::tunnel::bus::sources::{SourceLimits, SourceTable};
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::TunnelStream;
use crate::tunnel::protocol::announce::Target;
use crate::tunnel::{DrainReason, PENDING_SUBSCRIBE_TIMEOUT, RefuseCode, rendezvous_ranked};
use crate::wire::Dialect;

/// Brokers `open_stream` asks for one publisher: its rendezvous owner, then once the
/// runner-up when the owner cannot reach it (a full owner is skipped without asking,
/// and counted as a fallback too).
pub(crate) const OPEN_ATTEMPTS: usize = 2;

/// How long an open waits for room in a session's command queue.
const COMMAND_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether a refusal is about the broker that gave it (its view, its network, its
/// load, its session), so another broker may succeed.
fn another_broker_may(error: &TunnelError) -> bool {
    match error {
        TunnelError::Refused(code) => !matches!(
            code,
            RefuseCode::BadTarget | RefuseCode::DuplicateStream | RefuseCode::UnknownStream
        ),
        TunnelError::Session(_) | TunnelError::Timeout(_) => true,
        _ => false,
    }
}

/// Counters of an [`EventBus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct BusStats {
    /// Broker sessions welcomed now.
    pub sessions: usize,
    /// Sessions started since the bus started.
    pub sessions_started: u64,
    /// Sessions ended because a newer one of the same client id arrived.
    pub superseded: u64,
    /// Requests refused for a wrong or missing credential.
    pub unauthorized: u64,
    /// Hellos denied, by code (`DenyCode`): a client id or a namespace the
    /// credential does not grant (an impostor, or a misconfigured broker).
    pub denied: HashMap<String, u64>,
    /// Unauthenticated connections closed to make room in their full pool, or in
    /// their source's full share of it.
    pub pending_evicted: u64,
    /// Connections closed for not completing TLS, or not authenticating, in time.
    pub pending_timeouts: u64,
    /// Connections held unauthenticated now.
    pub pending: usize,
    /// Authenticated connections refused: `max_connections` were held, or the
    /// credential held its `max_connections_per_client`.
    pub connections_refused: u64,
    /// Opens refused before reaching any broker: the target is empty, over 1 KiB or
    /// not `tcp://host:port`.
    pub bad_targets: u64,
    /// Streams opened through a broker.
    pub streams_opened: u64,
    /// Streams refused, closed before opening, or expired.
    pub streams_failed: u64,
    /// Data streams refused with `unknown_stream`.
    pub unknown_streams: u64,
    /// Streams ended because a joining broker became their publisher's owner (their
    /// subscribers reconnect through it).
    pub streams_moved: u64,
    /// Data streams open now.
    pub streams_open: usize,
    /// Subscribes the owner could not serve (it refused for a reason of its own, or
    /// it was full) that were tried through the runner-up.
    pub fallbacks: u64,
    /// Subscribes waiting for their broker's answer now.
    pub streams_pending: usize,
    /// Subscribes brokers refused, by code (`RefuseCode`).
    pub refused: HashMap<String, u64>,
    /// Streams brokers closed, by code (`CloseCode`).
    pub closed: HashMap<String, u64>,
    /// Bytes the router read from publishers through the tunnel.
    pub bytes_in: u64,
    /// Bytes the router wrote to publishers through the tunnel.
    pub bytes_out: u64,
    /// Source sessions welcomed now (DESIGN §7.4; also counted in `sessions`).
    pub source_sessions: usize,
    /// Publishers sources announce now.
    pub announced_sources: usize,
    /// Announced publishers ignored, by reason: `held_by_another_source` (another
    /// client's session announces the channel), `superseded_session` (a newer session
    /// of the same client does), `bus_full` (`max_announced_sources` held).
    pub announce_refused: HashMap<String, u64>,
}

/// The router's event bus: brokers dial in, the router opens publisher connections
/// through them. It runs until [`shutdown`](Self::shutdown), or until its last handle
/// (clones included) is dropped.
///
/// Brokers authenticate with the credentials in its [`BusClients`], each bound to what
/// it may claim (a client id, namespaces); only granted namespaces are tunnelled.
///
/// A connection carries one broker session and closes with it. Until it presents an
/// accepted credential it waits in a pool of its own
/// ([`EventBusConfig::max_pending_connections`](crate::tunnel::EventBusConfig), 64, at most 8
/// per IPv4 address or IPv6 /64; when full, among the least advanced — silent, then
/// speaking, then past TLS — the oldest of the busiest source is closed), and
/// must complete TLS and authenticate within 3 s each: connections that never
/// authenticate cannot take the `max_connections` slots of brokers. Its session must
/// be welcomed within `session_start_timeout` (10 s). A broker that joins takes over
/// its rendezvous share of the open streams once its session held for
/// `join_hold_down`.
///
/// ```no_run
/// # async fn run() -> Result<(), eventplane::tunnel::TunnelError> {
/// use eventplane::tunnel::{BusClients, EventBus, EventBusConfig, Secret, TokenDigest, server_tls};
/// let tls = server_tls("bus.pem", "bus.key")?;
/// let clients = BusClients::new()
///     .broker("broker-a", TokenDigest::from_hex(&std::fs::read_to_string("broker-a.sha256")?)?, vec!["prod".into()])?;
/// let bus = EventBus::bind("0.0.0.0:8443", tls, clients, EventBusConfig::default()).await?;
/// // A SubSocket runs ZMTP through a broker covering namespace "prod":
/// let stream = bus.open_stream("prod", 7, "tcp://10.1.2.3:5557").await?;
/// let sub = eventplane::zmtp::SubSocket::handshake(stream, Default::default()).await;
/// # drop(sub); Ok(()) }
/// ```
#[derive(Clone)]
pub struct EventBus {
    inner: Arc<Inner>,
    local_addr: SocketAddr,
    /// The last handle dropped without `shutdown` stops the bus.
    _alive: Arc<tokio_util::sync::DropGuard>,
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("local_addr", &self.local_addr)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl EventBus {
    /// Listens on `addr` (`host:port`; port 0 for any) with `tls`, accepting brokers
    /// that present a credential of `clients` (within its grant), offering them
    /// `config.limits` and holding their connections to `config`'s caps and
    /// deadlines (refused by
    /// [`EventBusConfig::validate`](crate::tunnel::EventBusConfig::validate) before binding).
    pub async fn bind(
        addr: &str,
        tls: Arc<rustls::ServerConfig>,
        clients: BusClients,
        config: crate::tunnel::EventBusConfig,
    ) -> Result<EventBus, TunnelError> {
        config.validate()?;
        if clients.is_empty() {
            return Err(TunnelError::Config {
                field: "clients",
                reason: "no credential: no broker could connect".into(),
            });
        }
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let source_credentials = clients.sources();
        let inner = Arc::new(Inner {
            clients,
            pending: Mutex::new(Pending::new(
                config.max_pending_connections,
                config.max_pending_per_source,
            )),
            authenticated: Arc::new(tokio::sync::Semaphore::new(config.max_connections)),
            per_identity: Mutex::new(HashMap::new()),
            warn: crate::net::RateLimitedWarn::default(),
            config,
            sessions: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            open: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            next_conn: AtomicU64::new(1),
            counters: Counters::default(),
            sources: SourceTable::new(SourceLimits {
                max: config.max_announced_sources,
                sources: source_credentials,
                hold: config.announced_channel_hold,
                watch_buffer: config.announced_watch_buffer,
            }),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
        });
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        inner
            .tracker
            .spawn(accept_loop(inner.clone(), listener, acceptor));
        Ok(EventBus {
            _alive: Arc::new(inner.cancel.clone().drop_guard()),
            inner,
            local_addr,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Counters.
    pub fn stats(&self) -> BusStats {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let source_sessions = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|e| e.role == crate::tunnel::Role::Source)
            .count();
        BusStats {
            sessions: self
                .inner
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            source_sessions,
            announced_sources: self.inner.sources.len(),
            announce_refused: self.inner.sources.refused.snapshot(),
            sessions_started: l(&c.sessions_started),
            superseded: l(&c.superseded),
            unauthorized: l(&c.unauthorized),
            denied: c.denied.snapshot(),
            pending_evicted: l(&c.pending_evicted),
            pending_timeouts: l(&c.pending_timeouts),
            pending: self
                .inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            connections_refused: l(&c.connections_refused),
            bad_targets: l(&c.bad_targets),
            streams_opened: l(&c.streams_opened),
            streams_failed: l(&c.streams_failed),
            unknown_streams: l(&c.unknown_streams),
            streams_moved: l(&c.streams_moved),
            fallbacks: l(&c.fallbacks),
            streams_pending: self
                .inner
                .waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            refused: c.refused.snapshot(),
            closed: c.closed.snapshot(),
            bytes_in: l(&c.bytes.read),
            bytes_out: l(&c.bytes.written),
            streams_open: self
                .inner
                .open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
        }
    }

    /// The client ids of the welcomed brokers covering `namespace` and taking streams
    /// (not draining, not full).
    pub fn brokers_for(&self, namespace: &str) -> Vec<String> {
        let sessions = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut ids: Vec<String> = sessions
            .iter()
            .filter(|(_, e)| e.serves(namespace) && e.has_room())
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Whether a welcomed broker covers `namespace` and is not draining (it may be
    /// full).
    pub(crate) fn covered(&self, namespace: &str) -> bool {
        let sessions = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        sessions.values().any(|e| e.serves(namespace))
    }

    /// Whether a credential grants `namespace`: its publishers are reached through
    /// brokers only (a router dials them directly only when told to while no broker
    /// is up); the publishers of other namespaces are dialled directly.
    pub fn grants(&self, namespace: &str) -> bool {
        self.inner.clients.grants(namespace)
    }

    /// Opens a connection to the publisher `publisher_id` at `target` (`tcp://host:port`)
    /// through the broker that owns it among those covering `namespace` (rendezvous
    /// hashing), and returns the byte stream once the broker connected and its data
    /// stream arrived. When the owner refuses for a reason of its own (the target is
    /// not in its view, its filter, DNS or network failed it, it is draining or full,
    /// its session ended), the runner-up is tried once (2 attempts in all); a full
    /// owner is passed over without asking. The last error is returned.
    ///
    /// A target that is empty, over 1 KiB or not `tcp://host:port` is refused here
    /// (`Refused(BadTarget)`, counted in `bad_targets`) and never sent: no broker
    /// could dial it.
    pub async fn open_stream(
        &self,
        namespace: &str,
        publisher_id: u64,
        target: &str,
    ) -> Result<TunnelStream, TunnelError> {
        self.open_stream_as(namespace, publisher_id, target, false)
            .await
    }

    /// [`open_stream`](Self::open_stream); a `recovery` stream is not moved when a
    /// broker joins.
    async fn open_stream_as(
        &self,
        namespace: &str,
        publisher_id: u64,
        target: &str,
        recovery: bool,
    ) -> Result<TunnelStream, TunnelError> {
        if !crate::tunnel::protocol::frame::is_valid_target(target) {
            self.inner
                .counters
                .bad_targets
                .fetch_add(1, Ordering::Relaxed);
            return Err(TunnelError::Refused(RefuseCode::BadTarget));
        }
        let (candidates, passed_over) = {
            let sessions = self
                .inner
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let live = sessions.iter().filter(|(_, e)| e.serves(namespace));
            let ranked = rendezvous_ranked(live.map(|(id, _)| id.as_str()), publisher_id);
            // Full sessions ahead of the first with room are passed over.
            let passed_over = ranked
                .iter()
                .take_while(|id| sessions.get(**id).is_some_and(|e| !e.has_room()))
                .count();
            let candidates: Vec<(u64, mpsc::Sender<Command>)> = ranked
                .into_iter()
                .filter_map(|id| sessions.get(id))
                .filter(|e| e.has_room())
                .take(OPEN_ATTEMPTS)
                .map(|e| (e.session_id, e.commands.clone()))
                .collect();
            (candidates, passed_over)
        };
        if passed_over > 0 {
            self.inner
                .counters
                .fallbacks
                .fetch_add(passed_over as u64, Ordering::Relaxed);
        }
        let mut last = TunnelError::NoBroker(namespace.to_owned());
        let tries = candidates.len();
        for (i, (session_id, commands)) in candidates.into_iter().enumerate() {
            if i > 0 {
                self.inner
                    .counters
                    .fallbacks
                    .fetch_add(1, Ordering::Relaxed);
            }
            match self
                .open_via(
                    session_id,
                    commands,
                    namespace,
                    publisher_id,
                    Target::Tcp(target.to_owned()),
                    recovery,
                )
                .await
            {
                Ok(stream) => return Ok(stream),
                Err(e) if another_broker_may(&e) && i + 1 < tries => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Opens a connection to publisher `id`, which a source announced (DESIGN
    /// §7.4), through that source's session; the source serves it from its own
    /// publisher socket, as one more subscriber. `Refused(TargetNotAnnounced)` (counted
    /// in `refused`) when no session announces it now.
    pub async fn open_announced(&self, id: &ChannelId) -> Result<TunnelStream, TunnelError> {
        let publisher_id = id.publisher_id();
        self.open_at_source(id, Target::Announced { publisher_id })
            .await
    }

    /// Opens a connection to the recovery log of publisher `id`, which a source
    /// announced with one ([`AnnouncedSource::recovery`](crate::tunnel::AnnouncedSource::recovery)),
    /// through that source's session: a [`kv::router::recover_over`](crate::kv::router::recover_over)
    /// runs over it. `Refused(TargetNotAnnounced)` when no session announces it now (or
    /// announced it without a recovery log).
    pub async fn open_recovery(&self, id: &ChannelId) -> Result<TunnelStream, TunnelError> {
        let publisher_id = id.publisher_id();
        self.open_at_source(id, Target::Recovery { publisher_id })
            .await
    }

    /// Opens `target` of publisher `id` through the session that announced it.
    async fn open_at_source(
        &self,
        id: &ChannelId,
        target: Target,
    ) -> Result<TunnelStream, TunnelError> {
        let recovery = matches!(target, Target::Recovery { .. });
        let Some(route) = self.inner.sources.route(id) else {
            self.inner
                .counters
                .refused
                .add(RefuseCode::TargetNotAnnounced.as_str());
            return Err(TunnelError::Refused(RefuseCode::TargetNotAnnounced));
        };
        self.open_via(
            route.session_id,
            route.commands,
            "",
            id.publisher_id(),
            target,
            recovery,
        )
        .await
    }

    /// How a router reaches `endpoint` of publisher `id` (its publisher socket, or
    /// with `recovery` its recovery log): through the session that announced it
    /// (`announced`), through a broker when a credential grants its namespace, or
    /// `None` to dial it directly (not granted; or, with `direct_fallback`, no broker
    /// up for it).
    pub(crate) async fn reach(
        &self,
        id: &ChannelId,
        endpoint: &str,
        announced: bool,
        recovery: bool,
        direct_fallback: bool,
    ) -> Option<Result<TunnelStream, TunnelError>> {
        if announced {
            return Some(if recovery {
                self.open_recovery(id).await
            } else {
                self.open_announced(id).await
            });
        }
        let namespace = id.namespace();
        if !self.grants(namespace) || (direct_fallback && !self.covered(namespace)) {
            return None;
        }
        Some(
            self.open_stream_as(namespace, id.publisher_id(), endpoint, recovery)
                .await,
        )
    }

    /// The publishers sources announce in `dialect`, as a read-only
    /// [`Discovery`](crate::discovery::Discovery) a `DynamicSubscriber` follows (with this bus as
    /// its `tunnel`, and `dialect`'s layout).
    ///
    /// ```no_run
    /// # async fn run(bus: eventplane::tunnel::EventBus) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::sync::Arc;
    /// use eventplane::discovery::Query;
    /// use eventplane::subscriber::DynamicSubscriber;
    /// use eventplane::wire::Dialect;
    /// let router = DynamicSubscriber::builder(Arc::new(bus.announced(Dialect::EventPlane)), Query::new("prod"))
    ///     .topic("kv-events")
    ///     .tunnel(bus.clone())
    ///     .spawn()?;
    /// # drop(router); Ok(()) }
    /// ```
    pub fn announced(&self, dialect: Dialect) -> AnnouncedView {
        self.inner.sources.view(dialect)
    }

    /// One subscribe through the session `session_id` (`recovery`: a stream to a
    /// recovery endpoint, never moved to another broker).
    async fn open_via(
        &self,
        session_id: u64,
        commands: mpsc::Sender<Command>,
        namespace: &str,
        publisher_id: u64,
        target: Target,
        recovery: bool,
    ) -> Result<TunnelStream, TunnelError> {
        let inner = &self.inner;
        let (reply, answer) = oneshot::channel();
        // Random ids: a broker cannot guess another's streams.
        let stream_id = {
            let mut waiting = inner.waiting.lock().unwrap_or_else(|p| p.into_inner());
            let mut id = crate::net::random_u64() >> 1;
            while id == 0 || waiting.contains_key(&id) {
                id = crate::net::random_u64() >> 1;
            }
            waiting.insert(
                id,
                Waiter {
                    session_id,
                    namespace: namespace.to_owned(),
                    publisher_id,
                    // A recovery stream is not moved: cut, its answer would be lost.
                    movable: !recovery,
                    reply,
                },
            );
            id
        };
        // Cancelled or not, the waiter goes when this call does.
        let _forget = Forget { inner, stream_id };
        let subscribe = Command::Subscribe { stream_id, target };
        // A burst of opens queues behind the session's command queue, but never waits
        // long on a session that stopped taking commands.
        if tokio::time::timeout(COMMAND_QUEUE_TIMEOUT, commands.send(subscribe))
            .await
            .map_or(true, |sent| sent.is_err())
        {
            inner.fail(
                stream_id,
                TunnelError::Timeout("the broker session's command queue"),
            );
        }
        // The session expires the subscribe itself after 30 s; this is a backstop.
        match tokio::time::timeout(PENDING_SUBSCRIBE_TIMEOUT + Duration::from_secs(5), answer).await
        {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(TunnelError::Shutdown),
            Err(_) => {
                inner.fail(stream_id, TunnelError::Timeout("subscribe"));
                Err(TunnelError::Timeout("subscribe"))
            }
        }
    }

    /// Asks broker `client_id` to drain: it takes no new streams, lets open ones run for
    /// `deadline`, then reconnects (after 250–500 ms for a rebalance, throttled). Returns
    /// `false` when no such broker is connected.
    pub fn drain_broker(&self, client_id: &str, deadline: Duration, reason: DrainReason) -> bool {
        let sessions = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        sessions.get(client_id).is_some_and(|e| {
            e.commands
                .try_send(Command::Drain { deadline, reason })
                .is_ok()
        })
    }

    /// Ends every session and stops listening.
    pub async fn shutdown(self) {
        self.inner.cancel.cancel();
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }
}

/// Removes a stream's waiter when `open_stream` returns or is cancelled.
struct Forget<'a> {
    inner: &'a Inner,
    stream_id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.inner
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.stream_id);
    }
}
