//! The router's event bus (DESIGN §7.3): a TLS + HTTP/2 server that authenticates
//! brokers, runs their sessions ([`RouterSession`]), and opens publisher connections
//! through them ([`EventBus::open_stream`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::error::TunnelError;
use super::io::{BODY_CHANNEL, ChannelBody, Secret, TunnelStream, next_chunk};
use super::{
    ControlDecoder, DrainReason, Limits, PENDING_SUBSCRIBE_TIMEOUT, RouterEvent, RouterSession,
    SessionEnd, rendezvous_owner,
};

/// Connections the bus holds at once (brokers need one each).
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a connection may take to complete its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may take, after TLS, to start a session with the right
/// credential.
pub const SESSION_START_TIMEOUT: Duration = Duration::from_secs(10);

/// Commands a session task takes from the rest of the bus.
enum Command {
    Subscribe {
        stream_id: u64,
        target: String,
    },
    Unsubscribe(u64),
    Drain {
        deadline: Duration,
        reason: DrainReason,
    },
    Attach {
        stream_id: u64,
        reply: oneshot::Sender<bool>,
    },
    Close,
}

struct Entry {
    session_id: u64,
    /// The HTTP/2 connection the session runs on: its data streams must come on it.
    conn_id: u64,
    namespaces: Vec<String>,
    commands: mpsc::Sender<Command>,
    available: Arc<AtomicBool>,
    /// Cancelled when the session ends: its data streams end with it.
    ended: CancellationToken,
}

struct Waiter {
    session_id: u64,
    namespace: String,
    publisher_id: u64,
    reply: oneshot::Sender<Result<TunnelStream, TunnelError>>,
}

/// An open data stream, for moving it when its publisher's owner changes.
struct OpenStream {
    namespace: String,
    publisher_id: u64,
    client_id: String,
    /// Ends the stream (both bodies) when cancelled.
    stop: CancellationToken,
}

#[derive(Default)]
struct Counters {
    sessions_started: AtomicU64,
    superseded: AtomicU64,
    unauthorized: AtomicU64,
    streams_opened: AtomicU64,
    streams_failed: AtomicU64,
    unknown_streams: AtomicU64,
    streams_moved: AtomicU64,
}

struct Inner {
    token: Secret,
    limits: Limits,
    sessions: Mutex<HashMap<String, Entry>>,
    waiting: Mutex<HashMap<u64, Waiter>>,
    open: Mutex<HashMap<u64, OpenStream>>,
    next_session: AtomicU64,
    next_conn: AtomicU64,
    counters: Counters,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Inner {
    /// Broker `joined` was welcomed: ends the open streams of other brokers whose
    /// publisher it now owns by rendezvous hashing, so their subscribers reconnect
    /// through it. Only its share moves.
    fn move_share_to(&self, joined: &str) {
        let live: HashMap<String, Vec<String>> = {
            let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            let Some(entry) = sessions.get(joined) else {
                return;
            };
            entry
                .namespaces
                .iter()
                .map(|ns| {
                    let ids = sessions
                        .iter()
                        .filter(|(id, e)| {
                            (id.as_str() == joined || e.available.load(Ordering::Relaxed))
                                && e.namespaces.contains(ns)
                        })
                        .map(|(id, _)| id.clone())
                        .collect();
                    (ns.clone(), ids)
                })
                .collect()
        };
        let mut moved = 0u64;
        for stream in self.open.lock().unwrap_or_else(|p| p.into_inner()).values() {
            let Some(ids) = live.get(&stream.namespace) else {
                continue;
            };
            if stream.client_id != joined
                && rendezvous_owner(ids.iter().map(String::as_str), stream.publisher_id)
                    == Some(joined)
            {
                stream.stop.cancel();
                moved += 1;
            }
        }
        if moved > 0 {
            self.counters
                .streams_moved
                .fetch_add(moved, Ordering::Relaxed);
            tracing::info!(client_id = %joined, moved, "a broker joined: its share of the streams moves to it");
        }
    }

    fn fail(&self, stream_id: u64, error: TunnelError) {
        let waiter = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&stream_id);
        if let Some(w) = waiter {
            self.counters.streams_failed.fetch_add(1, Ordering::Relaxed);
            let _ = w.reply.send(Err(error));
        }
    }
}

/// Counters of an [`EventBus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
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
}

/// The router's event bus: brokers dial in, the router opens publisher connections
/// through them. It runs until [`shutdown`](Self::shutdown), or until its last handle
/// (clones included) is dropped.
///
/// A connection must complete TLS within 10 s and start an authenticated session
/// within [`SESSION_START_TIMEOUT`] of that, or it is closed: connections that never
/// authenticate cannot hold the [`MAX_CONNECTIONS`] slots.
///
/// ```no_run
/// # async fn run() -> Result<(), eventplane::tunnel::TunnelError> {
/// use eventplane::tunnel::{EventBus, Limits, Secret, server_tls};
/// let tls = server_tls("bus.pem", "bus.key")?;
/// let bus = EventBus::bind("0.0.0.0:8443", tls, Secret::from_file("bus.token")?, Limits::default()).await?;
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
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

impl EventBus {
    /// Listens on `addr` (`host:port`; port 0 for any) with `tls`, accepting brokers
    /// that present `token`, and offering them `limits`.
    pub async fn bind(
        addr: &str,
        tls: Arc<rustls::ServerConfig>,
        token: Secret,
        limits: Limits,
    ) -> Result<EventBus, TunnelError> {
        let listener = TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            token,
            limits,
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
            .filter(|(_, e)| {
                e.available.load(Ordering::Relaxed) && e.namespaces.iter().any(|n| n == namespace)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Opens a connection to the publisher `publisher_id` at `target` (`tcp://host:port`)
    /// through the broker that owns it among those covering `namespace` (rendezvous
    /// hashing), and returns the byte stream once the broker connected and its data
    /// stream arrived.
    pub async fn open_stream(
        &self,
        namespace: &str,
        publisher_id: u64,
        target: &str,
    ) -> Result<TunnelStream, TunnelError> {
        let inner = &self.inner;
        let (session_id, commands) = {
            let sessions = inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
            let live = sessions.iter().filter(|(_, e)| {
                e.available.load(Ordering::Relaxed) && e.namespaces.iter().any(|n| n == namespace)
            });
            let owner = rendezvous_owner(live.map(|(id, _)| id.as_str()), publisher_id)
                .ok_or_else(|| TunnelError::NoBroker(namespace.to_owned()))?;
            let entry = sessions
                .get(owner)
                .ok_or_else(|| TunnelError::NoBroker(namespace.to_owned()))?;
            (entry.session_id, entry.commands.clone())
        };
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

async fn accept_loop(
    inner: Arc<Inner>,
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            () = inner.cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((tcp, _peer)) = accepted else {
            // Out of descriptors, most likely: pause instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // A bounded number of connections, authenticated or not.
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::debug!("event bus connection limit reached: refusing a connection");
            continue;
        };
        let (inner2, acceptor) = (inner.clone(), acceptor.clone());
        inner.tracker.spawn(async move {
            let _permit = permit;
            let tls = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake with a broker failed");
                    return;
                }
                Err(_) => return,
            };
            let conn_id = inner2.next_conn.fetch_add(1, Ordering::Relaxed);
            let service_inner = inner2.clone();
            let authenticated = Arc::new(AtomicBool::new(false));
            let session_started = authenticated.clone();
            let service = hyper::service::service_fn(move |req| {
                let inner = service_inner.clone();
                let session_started = session_started.clone();
                async move {
                    Ok::<_, Infallible>(route(inner, conn_id, &session_started, req).await)
                }
            });
            let unauthenticated = async {
                tokio::time::sleep(SESSION_START_TIMEOUT).await;
                if authenticated.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            // Every stream the welcome allows, plus the session's own.
            // Windows: one stalled stream holds at most 256 KiB of the connection's
            // 16 MiB, so it cannot stall the session or the other streams.
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(inner2.limits.max_streams.saturating_add(1))
                .initial_stream_window_size(256 << 10)
                .initial_connection_window_size(16 << 20)
                .serve_connection(TokioIo::new(tls), service);
            tokio::select! {
                () = inner2.cancel.cancelled() => {}
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "broker connection ended");
                },
                () = unauthenticated => {
                    tracing::debug!("a connection started no authenticated session in time: closed");
                }
            }
        });
    }
}

fn empty(status: StatusCode) -> Response<ChannelBody> {
    let (_, rx) = mpsc::channel(1);
    let mut response = Response::new(ChannelBody::new(rx));
    *response.status_mut() = status;
    response
}

async fn route(
    inner: Arc<Inner>,
    conn_id: u64,
    session_started: &AtomicBool,
    req: Request<Incoming>,
) -> Response<ChannelBody> {
    if req.method() != hyper::Method::POST {
        return empty(StatusCode::METHOD_NOT_ALLOWED);
    }
    let auth = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if !inner.token.matches_header(auth) {
        inner.counters.unauthorized.fetch_add(1, Ordering::Relaxed);
        return empty(StatusCode::UNAUTHORIZED);
    }
    let path = req.uri().path().to_owned();
    if path == "/bus/v1/session" {
        session_started.store(true, Ordering::Relaxed);
        return start_session(inner, conn_id, req);
    }
    if let Some(id) = path.strip_prefix("/bus/v1/streams/") {
        return match id.parse::<u64>() {
            Ok(id) => data_stream(inner, conn_id, id, req).await,
            Err(_) => empty(StatusCode::NOT_FOUND),
        };
    }
    empty(StatusCode::NOT_FOUND)
}

fn start_session(inner: Arc<Inner>, conn_id: u64, req: Request<Incoming>) -> Response<ChannelBody> {
    let session_id = inner.next_session.fetch_add(1, Ordering::Relaxed);
    inner
        .counters
        .sessions_started
        .fetch_add(1, Ordering::Relaxed);
    let (out_tx, out_rx) = mpsc::channel(BODY_CHANNEL);
    let (cmd_tx, cmd_rx) = mpsc::channel(256);
    let tracker = inner.tracker.clone();
    tracker.spawn(run_session(
        inner,
        session_id,
        conn_id,
        req.into_body(),
        out_tx,
        cmd_tx,
        cmd_rx,
    ));
    Response::new(ChannelBody::new(out_rx))
}

async fn run_session(
    inner: Arc<Inner>,
    session_id: u64,
    conn_id: u64,
    mut body: Incoming,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
    commands: mpsc::Sender<Command>,
    mut cmd_rx: mpsc::Receiver<Command>,
) {
    let mut session = RouterSession::new(session_id, inner.limits, std::time::Instant::now());
    let mut decoder = ControlDecoder::default();
    // However the session ends, its data streams end with it.
    let ended = CancellationToken::new();
    let _end_streams = ended.clone().drop_guard();
    let available = Arc::new(AtomicBool::new(false));
    let mut client: Option<String> = None;
    let mut body_open = true;
    loop {
        // Frames go out only as the broker reads them: a broker that stops reading
        // fills the session's bounded outbox, which ends the session.
        match out.try_reserve() {
            Ok(permit) if session.has_transmit() => {
                permit.send(Ok(super::frame::encode_frames(|| session.poll_transmit())))
            }
            Err(mpsc::error::TrySendError::Closed(())) => session.close(),
            _ => {}
        }
        while let Some(event) = session.poll_event() {
            match event {
                RouterEvent::Welcomed {
                    client_id,
                    namespaces,
                    ..
                } => {
                    tracing::info!(%client_id, session_id, ?namespaces, "broker session welcomed");
                    let entry = Entry {
                        session_id,
                        conn_id,
                        namespaces,
                        commands: commands.clone(),
                        available: available.clone(),
                        ended: ended.clone(),
                    };
                    let old = inner
                        .sessions
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(client_id.clone(), entry);
                    if let Some(old) = old {
                        inner.counters.superseded.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%client_id, "a newer session supersedes the broker's previous one");
                        let _ = old.commands.try_send(Command::Close);
                    }
                    inner.move_share_to(&client_id);
                    client = Some(client_id);
                }
                RouterEvent::Opened(_) => {}
                RouterEvent::Refused { stream_id, code } => {
                    inner.fail(stream_id, TunnelError::Refused(code));
                }
                RouterEvent::Closed { stream_id, code } => {
                    inner.fail(stream_id, TunnelError::Closed(code));
                }
                RouterEvent::Expired(stream_id) => {
                    inner.fail(stream_id, TunnelError::Timeout("subscribe"));
                }
                RouterEvent::BrokerDraining => {
                    tracing::info!(client_id = ?client, "broker draining");
                }
                RouterEvent::Ended(end) => {
                    tracing::info!(client_id = ?client, session_id, reason = %end, "broker session ended");
                    finish(&inner, session_id, client.as_deref(), &end);
                    return;
                }
            }
        }
        available.store(session.is_available(), Ordering::Relaxed);
        let deadline = session.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            chunk = next_chunk(&mut body), if body_open => match chunk {
                Some(Ok(bytes)) => {
                    let now = std::time::Instant::now();
                    let mut input = &bytes[..];
                    loop {
                        match decoder.decode(&mut input) {
                            Ok(Some(frame)) => session.handle(frame, now),
                            Ok(None) => break,
                            Err(e) => {
                                tracing::warn!(error = %e, "undecodable control frame from a broker");
                                session.abort(SessionEnd::Protocol("undecodable control frame"));
                                break;
                            }
                        }
                    }
                }
                _ => {
                    body_open = false;
                    session.close();
                }
            },
            command = cmd_rx.recv() => match command {
                Some(Command::Subscribe { stream_id, target }) => {
                    if let Err(e) = session.subscribe(stream_id, target, std::time::Instant::now()) {
                        inner.fail(stream_id, TunnelError::Config { field: "subscribe", reason: e.to_string() });
                    }
                }
                Some(Command::Drain { deadline, reason }) => session.drain(deadline, reason),
                Some(Command::Unsubscribe(stream_id)) => session.unsubscribe(stream_id),
                Some(Command::Attach { stream_id, reply }) => {
                    let _ = reply.send(session.accept_data_stream(stream_id).is_ok());
                }
                Some(Command::Close) | None => session.close(),
            },
            permit = out.reserve(), if session.has_transmit() => match permit {
                Ok(permit) => permit.send(Ok(super::frame::encode_frames(|| session.poll_transmit()))),
                Err(_) => session.close(),
            },
            () = crate::time::sleep_until_opt(deadline) => session.handle_timeout(std::time::Instant::now()),
            () = inner.cancel.cancelled() => session.close(),
        }
    }
}

/// A session ended: forget it (unless a newer one took its client id) and fail the
/// streams still waiting on it.
fn finish(inner: &Inner, session_id: u64, client: Option<&str>, end: &SessionEnd) {
    if let Some(client) = client {
        let mut sessions = inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if sessions
            .get(client)
            .is_some_and(|e| e.session_id == session_id)
        {
            sessions.remove(client);
        }
    }
    let orphans: Vec<u64> = inner
        .waiting
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(_, w)| w.session_id == session_id)
        .map(|(id, _)| *id)
        .collect();
    for id in orphans {
        inner.fail(id, TunnelError::Session(end.clone()));
    }
}

async fn data_stream(
    inner: Arc<Inner>,
    conn_id: u64,
    stream_id: u64,
    req: Request<Incoming>,
) -> Response<ChannelBody> {
    let unknown = |inner: &Inner| {
        inner
            .counters
            .unknown_streams
            .fetch_add(1, Ordering::Relaxed);
        empty(StatusCode::NOT_FOUND)
    };
    let session_id = {
        let waiting = inner.waiting.lock().unwrap_or_else(|p| p.into_inner());
        match waiting.get(&stream_id) {
            Some(w) => w.session_id,
            None => return unknown(&inner),
        }
    };
    let found = {
        let sessions = inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions
            .values()
            // Only on the connection of the session that asked for it.
            .find(|e| e.session_id == session_id && e.conn_id == conn_id)
            .map(|e| (e.commands.clone(), e.ended.clone()))
    };
    let Some((commands, ended)) = found else {
        return unknown(&inner);
    };
    let (reply, attached) = oneshot::channel();
    if commands
        .try_send(Command::Attach { stream_id, reply })
        .is_err()
        || tokio::time::timeout(Duration::from_secs(5), attached).await != Ok(Ok(true))
    {
        return unknown(&inner);
    }
    let waiter = inner
        .waiting
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&stream_id);
    let Some(waiter) = waiter else {
        return unknown(&inner);
    };
    let (tx, rx) = mpsc::channel(BODY_CHANNEL);
    let detach = commands.clone();
    // Ends with its session, or alone when it moves to another broker.
    let stop = ended.child_token();
    let client_id = {
        let sessions = inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions
            .iter()
            .find(|(_, e)| e.session_id == session_id)
            .map(|(id, _)| id.clone())
            .unwrap_or_default()
    };
    inner.open.lock().unwrap_or_else(|p| p.into_inner()).insert(
        stream_id,
        OpenStream {
            namespace: waiter.namespace.clone(),
            publisher_id: waiter.publisher_id,
            client_id,
            stop: stop.clone(),
        },
    );
    let registry = Arc::downgrade(&inner);
    let stream = TunnelStream::new(
        req.into_body(),
        tx,
        Box::new(move || {
            let _ = detach.try_send(Command::Unsubscribe(stream_id));
            if let Some(inner) = registry.upgrade() {
                inner
                    .open
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&stream_id);
            }
        }),
        stop.clone(),
    );
    inner
        .counters
        .streams_opened
        .fetch_add(1, Ordering::Relaxed);
    let _ = waiter.reply.send(Ok(stream));
    Response::new(ChannelBody::new(rx).until(stop))
}
