//! The router's event bus (DESIGN §7.3): a TLS + HTTP/2 server that authenticates
//! brokers, runs their sessions ([`RouterSession`](super::RouterSession)), and opens publisher connections
//! through them ([`EventBus::open_stream`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::error::TunnelError;
use super::io::{Secret, TunnelStream};
use super::serve::{Command, Counters, Inner, Waiter, accept_loop};
use super::{DrainReason, PENDING_SUBSCRIBE_TIMEOUT, RefuseCode, rendezvous_ranked};

/// Brokers `open_stream` tries for one publisher: its rendezvous owner, then once the
/// runner-up when the owner cannot reach it.
pub const OPEN_ATTEMPTS: usize = 2;

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
    /// Subscribes the owner could not serve that were tried through the runner-up.
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
}

/// The router's event bus: brokers dial in, the router opens publisher connections
/// through them. It runs until [`shutdown`](Self::shutdown), or until its last handle
/// (clones included) is dropped.
///
/// A connection carries one broker session and closes with it. It must complete TLS
/// within [`EventBusConfig::tls_handshake_timeout`](super::EventBusConfig) and have
/// its session welcomed within its `session_start_timeout` (10 s each by default), or
/// it is closed: connections that never authenticate cannot hold the
/// `max_connections` slots for long. A broker that joins takes over its rendezvous
/// share of the open streams once its session held for `join_hold_down`.
///
/// ```no_run
/// # async fn run() -> Result<(), eventplane::tunnel::TunnelError> {
/// use eventplane::tunnel::{EventBus, EventBusConfig, Secret, server_tls};
/// let tls = server_tls("bus.pem", "bus.key")?;
/// let bus = EventBus::bind("0.0.0.0:8443", tls, Secret::from_file("bus.token")?, EventBusConfig::default()).await?;
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
    /// that present `token`, offering them `config.limits` and holding their
    /// connections to `config`'s cap and deadlines (refused by
    /// [`EventBusConfig::validate`](super::EventBusConfig::validate) before binding).
    pub async fn bind(
        addr: &str,
        tls: Arc<rustls::ServerConfig>,
        token: Secret,
        config: super::EventBusConfig,
    ) -> Result<EventBus, TunnelError> {
        config.validate()?;
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            token,
            config,
            sessions: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            open: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            next_conn: AtomicU64::new(1),
            counters: Counters::default(),
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
        BusStats {
            sessions: self
                .inner
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            sessions_started: l(&c.sessions_started),
            superseded: l(&c.superseded),
            unauthorized: l(&c.unauthorized),
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

    /// The client ids of the welcomed brokers covering `namespace` and taking streams.
    pub fn brokers_for(&self, namespace: &str) -> Vec<String> {
        let sessions = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut ids: Vec<String> = sessions
            .iter()
            .filter(|(_, e)| e.serves(namespace))
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Opens a connection to the publisher `publisher_id` at `target` (`tcp://host:port`)
    /// through the broker that owns it among those covering `namespace` (rendezvous
    /// hashing), and returns the byte stream once the broker connected and its data
    /// stream arrived. When the owner refuses for a reason of its own (the target is
    /// not in its view, its filter, DNS or network failed it, it is draining or full,
    /// its session ended), the runner-up is tried once ([`OPEN_ATTEMPTS`]); the last
    /// error is returned.
    pub async fn open_stream(
        &self,
        namespace: &str,
        publisher_id: u64,
        target: &str,
    ) -> Result<TunnelStream, TunnelError> {
        let candidates: Vec<(u64, mpsc::Sender<Command>)> = {
            let sessions = self
                .inner
                .sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let live = sessions.iter().filter(|(_, e)| e.serves(namespace));
            rendezvous_ranked(live.map(|(id, _)| id.as_str()), publisher_id)
                .into_iter()
                .take(OPEN_ATTEMPTS)
                .filter_map(|id| sessions.get(id))
                .map(|e| (e.session_id, e.commands.clone()))
                .collect()
        };
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
                .open_via(session_id, commands, namespace, publisher_id, target)
                .await
            {
                Ok(stream) => return Ok(stream),
                Err(e) if another_broker_may(&e) && i + 1 < tries => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// One subscribe through the session `session_id`.
    async fn open_via(
        &self,
        session_id: u64,
        commands: mpsc::Sender<Command>,
        namespace: &str,
        publisher_id: u64,
        target: &str,
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
                    reply,
                },
            );
            id
        };
        // Cancelled or not, the waiter goes when this call does.
        let _forget = Forget { inner, stream_id };
        let subscribe = Command::Subscribe {
            stream_id,
            target: target.to_owned(),
        };
        // Never waits on a session that stopped taking commands.
        if commands.try_send(subscribe).is_err() {
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
