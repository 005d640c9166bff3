//! The event bus's server side (DESIGN §7.3): accepting broker connections (TLS,
//! HTTP/2, the credential), running each broker's session, and attaching its data
//! streams.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::tunnel::bus::admission::Pending;
use crate::tunnel::bus::auth::{BusClients, Identity};
use crate::tunnel::bus::sources::SourceTable;
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::{BODY_CHANNEL, ChannelBody, TUNNEL_WRITE_CHUNKS, TunnelStream, next_chunk};
use crate::tunnel::protocol::announce::Role;
use crate::tunnel::{
    ControlDecoder, DenyCode, EventBusConfig, RefuseCode, RouterSession, SessionEnd, SessionEvent,
    SubscribeError, rendezvous_owner,
};

pub(crate) use crate::tunnel::bus::state::{
    Command, Counters, Detached, Entry, OpenStream, Waiter,
};

pub(crate) struct Inner {
    pub(crate) clients: BusClients,
    pub(crate) config: EventBusConfig,
    /// Connections that have not authenticated yet.
    pub(crate) pending: Mutex<Pending<CancellationToken>>,
    /// One permit per authenticated connection.
    pub(crate) authenticated: Arc<tokio::sync::Semaphore>,
    /// Authenticated connections held per credential.
    pub(crate) per_identity: Mutex<HashMap<Identity, usize>>,
    /// Refusals and evictions warn once a minute per kind.
    pub(crate) warn: crate::net::RateLimitedWarn,
    pub(crate) sessions: Mutex<HashMap<String, Entry>>,
    pub(crate) waiting: Mutex<HashMap<u64, Waiter>>,
    pub(crate) open: Mutex<HashMap<u64, OpenStream>>,
    pub(crate) next_session: AtomicU64,
    pub(crate) next_conn: AtomicU64,
    pub(crate) counters: Counters,
    /// Which source session serves which announced publisher.
    pub(crate) sources: SourceTable<mpsc::Sender<Command>>,
    pub(crate) cancel: CancellationToken,
    pub(crate) tracker: TaskTracker,
}

impl Inner {
    /// Broker `joined` was welcomed: ends the open streams of other brokers whose
    /// publisher it now owns by rendezvous hashing, so their subscribers reconnect
    /// through it. Only its share moves.
    pub(crate) fn move_share_to(&self, joined: &str) {
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
                        .filter(|(_, e)| e.serves(ns))
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
            if stream.movable
                && stream.client_id != joined
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

    /// Ends the data stream `stream_id` if it is open (the broker refused or closed it
    /// after it attached).
    pub(crate) fn end_stream(&self, stream_id: u64) {
        if let Some(open) = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream_id)
        {
            open.stop.cancel();
        }
    }

    /// A warning of kind `key`, at most once a minute (with the count suppressed).
    pub(crate) fn warn(&self, key: &str, message: std::fmt::Arguments<'_>) {
        if let Some(suppressed) = self.warn.check(key, Instant::now()) {
            tracing::warn!(suppressed, "{message}");
        }
    }

    pub(crate) fn fail(&self, stream_id: u64, error: TunnelError) {
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

/// One broker connection: it carries one session at a time, and closes when that
/// session ends, or when it does not authenticate within
/// [`EventBusConfig::auth_timeout`] or have a session welcomed within
/// [`EventBusConfig::session_start_timeout`].
pub(crate) struct Conn {
    pub(crate) id: u64,
    /// The credential it authenticated with, and its authenticated slot.
    pub(crate) auth: Mutex<Option<AuthSlot>>,
    /// It authenticated.
    pub(crate) authenticated: AtomicBool,
    /// A session runs on it.
    pub(crate) busy: AtomicBool,
    /// A session on it was welcomed.
    pub(crate) welcomed: AtomicBool,
    /// Requests it made before it authenticated.
    pub(crate) unauthenticated_requests: AtomicU64,
    /// Cancelled to close the connection.
    pub(crate) close: CancellationToken,
}

/// An authenticated connection's slot: one of `max_connections`, and one of its
/// credential's `max_connections_per_client`; both given back when it closes.
pub(crate) struct AuthSlot {
    identity: Identity,
    inner: std::sync::Weak<Inner>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for AuthSlot {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            let mut held = inner.per_identity.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = held.get_mut(&self.identity) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    held.remove(&self.identity);
                }
            }
        }
    }
}

/// The connection presented `identity`: the first time, it leaves the
/// unauthenticated pool for an authenticated slot, within the credential's share
/// (`false` when it was evicted meanwhile, or no slot is free: the connection
/// closes); after that, every request must present the same credential.
pub(crate) fn authenticate(inner: &Arc<Inner>, conn: &Conn, identity: Identity) -> bool {
    let mut auth = conn.auth.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(held) = auth.as_ref() {
        return held.identity == identity;
    }
    // Evicted between its request and now: it is closing.
    if !inner
        .pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(conn.id)
    {
        conn.close.cancel();
        return false;
    }
    let refuse = |why: std::fmt::Arguments<'_>| {
        inner
            .counters
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        inner.warn("connections_refused", why);
        conn.close.cancel();
        false
    };
    {
        let mut held = inner.per_identity.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(identity).or_default();
        if *n >= inner.config.max_connections_per_client {
            return refuse(format_args!(
                "event bus: a credential holds its {} authenticated connections: refusing another",
                inner.config.max_connections_per_client
            ));
        }
        *n += 1;
    }
    // From here the slot's drop gives the credential's count back.
    let slot = |permit| AuthSlot {
        identity,
        inner: Arc::downgrade(inner),
        _permit: permit,
    };
    let Ok(permit) = inner.authenticated.clone().try_acquire_owned() else {
        let mut held = inner.per_identity.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&identity) {
            *n = n.saturating_sub(1);
        }
        drop(held);
        return refuse(format_args!(
            "event bus: {} authenticated connections held: refusing another",
            inner.config.max_connections
        ));
    };
    *auth = Some(slot(permit));
    conn.authenticated.store(true, Ordering::Relaxed);
    true
}

/// Requests a connection may make before one of them authenticated it (a broker
/// makes one: its session); one more is answered 429, its credential unread, and the
/// connection closes. HTTP/2 lets a client open up to `max_streams` + 1 streams at
/// once: without this, each could carry a guess.
pub(crate) const MAX_REQUESTS_BEFORE_AUTH: u64 = 2;

/// How long a connection that has not authenticated stays open after its first
/// refused credential: time for the 401 to leave.
const CLOSE_AFTER_REFUSAL: std::time::Duration = std::time::Duration::from_millis(100);

fn empty(status: StatusCode) -> Response<ChannelBody> {
    let (_, rx) = mpsc::channel(1);
    let mut response = Response::new(ChannelBody::new(rx));
    *response.status_mut() = status;
    response
}

/// Closes `conn` once the answer now written had time to leave.
fn close_soon(conn: &Conn) {
    let close = conn.close.clone();
    tokio::spawn(async move {
        tokio::time::sleep(CLOSE_AFTER_REFUSAL).await;
        close.cancel();
    });
}

pub(crate) async fn route(
    inner: Arc<Inner>,
    conn: Arc<Conn>,
    req: Request<Incoming>,
) -> Response<ChannelBody> {
    if req.method() != hyper::Method::POST {
        return empty(StatusCode::METHOD_NOT_ALLOWED);
    }
    if !conn.authenticated.load(Ordering::Relaxed)
        && conn
            .unauthenticated_requests
            .fetch_add(1, Ordering::Relaxed)
            >= MAX_REQUESTS_BEFORE_AUTH
    {
        inner.counters.unauthorized.fetch_add(1, Ordering::Relaxed);
        close_soon(&conn);
        return empty(StatusCode::TOO_MANY_REQUESTS);
    }
    let auth = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let Some(identity) = inner.clients.authenticate(auth) else {
        inner.counters.unauthorized.fetch_add(1, Ordering::Relaxed);
        inner.warn(
            "unauthorized",
            format_args!("event bus: a request with a missing or unknown credential refused"),
        );
        // A guess costs its connection: one that has not authenticated is closed
        // once this answer is on its way (never one guess after another on it).
        if !conn.authenticated.load(Ordering::Relaxed) {
            close_soon(&conn);
        }
        return empty(StatusCode::UNAUTHORIZED);
    };
    if !authenticate(&inner, &conn, identity) {
        return if conn.close.is_cancelled() {
            empty(StatusCode::SERVICE_UNAVAILABLE)
        } else {
            // Another credential than the connection's first.
            inner.counters.unauthorized.fetch_add(1, Ordering::Relaxed);
            empty(StatusCode::UNAUTHORIZED)
        };
    }
    let path = req.uri().path().to_owned();
    if path == "/bus/v1/session" {
        if conn.busy.swap(true, Ordering::Relaxed) {
            // One session per connection: a broker reconnects on a new one.
            return empty(StatusCode::CONFLICT);
        }
        return start_session(inner, conn, identity, req);
    }
    if let Some(id) = path.strip_prefix("/bus/v1/streams/") {
        return match id.parse::<u64>() {
            Ok(id) => data_stream(inner, conn.id, identity, id, req).await,
            Err(_) => empty(StatusCode::NOT_FOUND),
        };
    }
    empty(StatusCode::NOT_FOUND)
}

fn start_session(
    inner: Arc<Inner>,
    conn: Arc<Conn>,
    identity: Identity,
    req: Request<Incoming>,
) -> Response<ChannelBody> {
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
        conn,
        identity,
        req.into_body(),
        out_tx,
        cmd_tx,
        cmd_rx,
    ));
    Response::new(ChannelBody::new(out_rx))
}

#[allow(clippy::too_many_arguments)]
async fn run_session(
    inner: Arc<Inner>,
    session_id: u64,
    conn: Arc<Conn>,
    identity: Identity,
    mut body: Incoming,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
    commands: mpsc::Sender<Command>,
    mut cmd_rx: mpsc::Receiver<Command>,
) {
    let mut session = RouterSession::new(session_id, inner.config.limits, Instant::now())
        .with_grant(inner.clients.grant(identity));
    let detached = Arc::new(Detached::default());
    let room = Arc::new(AtomicBool::new(true));
    let mut decoder = ControlDecoder::default();
    // However the session ends, its data streams and its connection end with it.
    let ended = CancellationToken::new();
    let _end_streams = ended.clone().drop_guard();
    let _close_conn = conn.close.clone().drop_guard();
    let conn_id = conn.id;
    // A joining broker takes its share of open streams once it held on for a while.
    let mut take_share_at: Option<tokio::time::Instant> = None;
    let available = Arc::new(AtomicBool::new(false));
    let mut checking = false;
    let mut client: Option<String> = None;
    let mut body_open = true;
    loop {
        // Frames go out only as the broker reads them: a broker that stops reading
        // fills the session's bounded outbox, which ends the session.
        match out.try_reserve() {
            Ok(permit) if session.has_transmit() => {
                permit.send(Ok(crate::tunnel::protocol::frame::encode_frames(|| {
                    session.poll_transmit()
                })))
            }
            Err(mpsc::error::TrySendError::Closed(())) => session.close(),
            _ => {}
        }
        while let Some(event) = session.poll_event() {
            match event {
                SessionEvent::Welcomed {
                    client_id,
                    namespaces,
                    role,
                    ..
                } => {
                    let entry = Entry {
                        session_id,
                        role,
                        identity,
                        conn_id,
                        namespaces: namespaces.clone(),
                        commands: commands.clone(),
                        available: available.clone(),
                        room: room.clone(),
                        detached: detached.clone(),
                        ended: ended.clone(),
                    };
                    let old = {
                        let mut sessions = inner.sessions.lock().unwrap_or_else(|p| p.into_inner());
                        match sessions.get(&client_id) {
                            // Only the credential a client id runs under may supersede it.
                            Some(held) if held.identity != identity => Err(()),
                            _ => Ok(sessions.insert(client_id.clone(), entry)),
                        }
                    };
                    let Ok(old) = old else {
                        inner
                            .counters
                            .denied
                            .add(DenyCode::ClientIdNotGranted.as_str());
                        inner.warn(
                            "denied",
                            format_args!("event bus: a session claimed a client id another credential holds: closed"),
                        );
                        session.close();
                        continue;
                    };
                    // `event-broker --check-bus`'s session proves the credential and
                    // leaves: it carries no streams.
                    checking = client_id.ends_with(".check");
                    tracing::info!(%client_id, session_id, ?namespaces, %role, "session welcomed");
                    if let Some(old) = old {
                        inner.counters.superseded.fetch_add(1, Ordering::Relaxed);
                        // Its announcements go now, not when it has read its close:
                        // this session's own take their place.
                        inner.sources.session_ended(old.session_id);
                        tracing::info!(%client_id, "a newer session supersedes the broker's previous one");
                        let _ = old.commands.try_send(Command::Close);
                    }
                    conn.welcomed.store(true, Ordering::Relaxed);
                    if role == Role::Broker {
                        take_share_at =
                            Some(tokio::time::Instant::now() + inner.config.join_hold_down);
                    }
                    client = Some(client_id);
                }
                SessionEvent::Opened(_) => {}
                SessionEvent::Announced(sources) => {
                    if let Some(client_id) = &client {
                        tracing::debug!(%client_id, announced = sources.len(), "a source announced publishers");
                        let refused = inner
                            .sources
                            .announce(session_id, client_id, &commands, sources)
                            .await;
                        for code in crate::tunnel::AnnounceRefusal::ALL {
                            let these: Vec<_> = refused
                                .iter()
                                .filter(|(c, _)| c == code)
                                .map(|(_, s)| s.clone())
                                .collect();
                            if !these.is_empty() {
                                session.refuse_announced(*code, these);
                            }
                        }
                    }
                }
                SessionEvent::Withdrawn(ids) => inner.sources.withdraw(session_id, &ids),
                SessionEvent::Refused { stream_id, code } => {
                    inner.counters.refused.add(code.as_str());
                    inner.fail(stream_id, TunnelError::Refused(code));
                    inner.end_stream(stream_id);
                }
                SessionEvent::Closed { stream_id, code } => {
                    inner.counters.closed.add(code.as_str());
                    inner.fail(stream_id, TunnelError::Closed(code));
                    inner.end_stream(stream_id);
                }
                SessionEvent::Expired(stream_id) => {
                    inner.fail(stream_id, TunnelError::Timeout("subscribe"));
                }
                SessionEvent::BrokerDraining => {
                    tracing::info!(client_id = ?client, "broker draining");
                }
                SessionEvent::Ended(end) => {
                    if let SessionEnd::Denied(code) = &end {
                        inner.counters.denied.add(code.as_str());
                        inner.warn(
                            "denied",
                            format_args!("event bus: a broker's hello claimed what its credential does not grant ({code}): denied"),
                        );
                        // The `denied` frame says why; the broker ends its side on
                        // reading it (or within a second, the connection closes).
                        if session.has_transmit() {
                            let _ =
                                out.try_send(Ok(crate::tunnel::protocol::frame::encode_frames(
                                    || session.poll_transmit(),
                                )));
                        }
                        drop(out);
                        let _ = tokio::time::timeout(Duration::from_secs(1), async {
                            while let Some(Ok(_)) = next_chunk(&mut body).await {}
                        })
                        .await;
                    } else {
                        tracing::info!(client_id = ?client, session_id, reason = %end, "broker session ended");
                    }
                    finish(&inner, session_id, client.as_deref(), &end);
                    return;
                }
            }
        }
        available.store(session.is_available() && !checking, Ordering::Relaxed);
        room.store(session.has_room(), Ordering::Relaxed);
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
                    if let Err(e) = session.subscribe_to(stream_id, target, Instant::now()) {
                        // Full or draining: another broker may take it.
                        let error = match e {
                            SubscribeError::Draining => TunnelError::Refused(RefuseCode::Draining),
                            SubscribeError::TooManyStreams => TunnelError::Refused(RefuseCode::TooManyStreams),
                            SubscribeError::BadTarget => TunnelError::Refused(RefuseCode::BadTarget),
                            SubscribeError::DuplicateStream => TunnelError::Refused(RefuseCode::DuplicateStream),
                            SubscribeError::UnsupportedTarget => TunnelError::Refused(RefuseCode::UnsupportedTarget),
                            SubscribeError::NotAnnounced => TunnelError::Refused(RefuseCode::TargetNotAnnounced),
                            _ => TunnelError::Session(SessionEnd::Closed),
                        };
                        inner.fail(stream_id, error);
                    }
                }
                Some(Command::Drain { deadline, reason }) => session.drain(deadline, reason),
                Some(Command::Attach { stream_id, reply }) => {
                    let _ = reply.send(session.accept_data_stream(stream_id).is_ok());
                }
                Some(Command::Close) | None => session.close(),
            },
            permit = out.reserve(), if session.has_transmit() => match permit {
                Ok(permit) => permit.send(Ok(crate::tunnel::protocol::frame::encode_frames(|| session.poll_transmit()))),
                Err(_) => session.close(),
            },
            () = detached.notify.notified() => {
                for stream_id in detached.take() {
                    session.data_stream_ended(stream_id);
                }
            }
            () = crate::time::sleep_until_opt(deadline) => session.handle_timeout(Instant::now()),
            () = crate::time::sleep_until_opt(take_share_at) => {
                take_share_at = None;
                if let (Some(client), true) = (&client, session.is_available()) {
                    inner.move_share_to(client);
                }
            }
            () = inner.cancel.cancelled() => session.close(),
        }
    }
}

/// A session ended: forget it (unless a newer one took its client id) and fail the
/// streams still waiting on it.
fn finish(inner: &Inner, session_id: u64, client: Option<&str>, end: &SessionEnd) {
    // Its announced publishers depart with it.
    inner.sources.session_ended(session_id);
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
    identity: Identity,
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
            .iter()
            // Only on the connection of the session that asked for it, with its
            // credential.
            .find(|(_, e)| {
                e.session_id == session_id && e.conn_id == conn_id && e.identity == identity
            })
            .map(|(id, e)| {
                (
                    id.clone(),
                    e.commands.clone(),
                    e.ended.clone(),
                    e.detached.clone(),
                )
            })
    };
    let Some((client_id, commands, ended, detached)) = found else {
        return unknown(&inner);
    };
    let (reply, attached) = oneshot::channel();
    // Behind a burst of subscribes in the session's queue, within 5 s in all.
    let attach = async {
        commands
            .send(Command::Attach { stream_id, reply })
            .await
            .is_ok()
            && attached.await == Ok(true)
    };
    if tokio::time::timeout(Duration::from_secs(5), attach).await != Ok(true) {
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
    let (tx, rx) = mpsc::channel(TUNNEL_WRITE_CHUNKS);
    // Ends with its session, or alone when it moves to another broker.
    let stop = ended.child_token();
    inner.open.lock().unwrap_or_else(|p| p.into_inner()).insert(
        stream_id,
        OpenStream {
            namespace: waiter.namespace.clone(),
            publisher_id: waiter.publisher_id,
            client_id,
            movable: waiter.movable,
            stop: stop.clone(),
        },
    );
    let registry = Arc::downgrade(&inner);
    let stream = TunnelStream::new(
        req.into_body(),
        tx,
        inner.counters.bytes.clone(),
        Box::new(move || {
            detached.push(stream_id);
            if let Some(inner) = registry.upgrade() {
                inner
                    .open
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&stream_id);
            }
        }),
    );
    inner
        .counters
        .streams_opened
        .fetch_add(1, Ordering::Relaxed);
    let _ = waiter.reply.send(Ok(stream));
    Response::new(ChannelBody::new(rx).until(stop))
}
