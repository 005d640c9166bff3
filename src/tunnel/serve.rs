//! The event bus's server side (DESIGN §7.3): accepting broker connections (TLS,
//! HTTP/2, the credential), running each broker's session, and attaching its data
//! streams.

use std::collections::HashMap;
use std::convert::Infallible;
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

use super::codes::CodeCounts;
use super::error::TunnelError;
use super::io::{
    BODY_CHANNEL, ChannelBody, Secret, StreamBytes, TUNNEL_WRITE_CHUNKS, TunnelStream, next_chunk,
};
use super::{
    ControlDecoder, DrainReason, EventBusConfig, RouterEvent, RouterSession, SessionEnd,
    rendezvous_owner,
};

/// Commands a session task takes from the rest of the bus.
pub(super) enum Command {
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

pub(super) struct Entry {
    pub(super) session_id: u64,
    /// The HTTP/2 connection the session runs on: its data streams must come on it.
    pub(super) conn_id: u64,
    pub(super) namespaces: Vec<String>,
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) available: Arc<AtomicBool>,
    /// Cancelled when the session ends: its data streams end with it.
    pub(super) ended: CancellationToken,
}

impl Entry {
    /// Whether this session takes new streams for `namespace` (welcomed, covering it,
    /// not draining).
    pub(super) fn serves(&self, namespace: &str) -> bool {
        self.available.load(Ordering::Relaxed) && self.namespaces.iter().any(|n| n == namespace)
    }
}

pub(super) struct Waiter {
    pub(super) session_id: u64,
    pub(super) namespace: String,
    pub(super) publisher_id: u64,
    pub(super) reply: oneshot::Sender<Result<TunnelStream, TunnelError>>,
}

/// An open data stream, for moving it when its publisher's owner changes.
pub(super) struct OpenStream {
    pub(super) namespace: String,
    pub(super) publisher_id: u64,
    pub(super) client_id: String,
    /// Ends the stream (both bodies) when cancelled.
    pub(super) stop: CancellationToken,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) sessions_started: AtomicU64,
    pub(super) superseded: AtomicU64,
    pub(super) unauthorized: AtomicU64,
    pub(super) streams_opened: AtomicU64,
    pub(super) streams_failed: AtomicU64,
    pub(super) unknown_streams: AtomicU64,
    pub(super) streams_moved: AtomicU64,
    pub(super) fallbacks: AtomicU64,
    pub(super) refused: CodeCounts,
    pub(super) closed: CodeCounts,
    pub(super) bytes: Arc<StreamBytes>,
}

pub(super) struct Inner {
    pub(super) token: Secret,
    pub(super) config: EventBusConfig,
    pub(super) sessions: Mutex<HashMap<String, Entry>>,
    pub(super) waiting: Mutex<HashMap<u64, Waiter>>,
    pub(super) open: Mutex<HashMap<u64, OpenStream>>,
    pub(super) next_session: AtomicU64,
    pub(super) next_conn: AtomicU64,
    pub(super) counters: Counters,
    pub(super) cancel: CancellationToken,
    pub(super) tracker: TaskTracker,
}

impl Inner {
    /// Broker `joined` was welcomed: ends the open streams of other brokers whose
    /// publisher it now owns by rendezvous hashing, so their subscribers reconnect
    /// through it. Only its share moves.
    pub(super) fn move_share_to(&self, joined: &str) {
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

    /// Ends the data stream `stream_id` if it is open (the broker refused or closed it
    /// after it attached).
    pub(super) fn end_stream(&self, stream_id: u64) {
        if let Some(open) = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream_id)
        {
            open.stop.cancel();
        }
    }

    pub(super) fn fail(&self, stream_id: u64, error: TunnelError) {
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
/// session ends or when none is welcomed within
/// [`EventBusConfig::session_start_timeout`].
struct Conn {
    id: u64,
    /// A session runs on it.
    busy: AtomicBool,
    /// A session on it was welcomed.
    welcomed: AtomicBool,
    /// Cancelled to close the connection.
    close: CancellationToken,
}

pub(super) async fn accept_loop(
    inner: Arc<Inner>,
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    let connections = Arc::new(tokio::sync::Semaphore::new(inner.config.max_connections));
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
            let tls = match tokio::time::timeout(
                inner2.config.tls_handshake_timeout,
                acceptor.accept(tcp),
            )
            .await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake with a broker failed");
                    return;
                }
                Err(_) => return,
            };
            let state = Arc::new(Conn {
                id: inner2.next_conn.fetch_add(1, Ordering::Relaxed),
                busy: AtomicBool::new(false),
                welcomed: AtomicBool::new(false),
                close: CancellationToken::new(),
            });
            let (service_inner, service_state) = (inner2.clone(), state.clone());
            let service = hyper::service::service_fn(move |req| {
                let (inner, state) = (service_inner.clone(), service_state.clone());
                async move { Ok::<_, Infallible>(route(inner, state, req).await) }
            });
            let unwelcomed = async {
                tokio::time::sleep(inner2.config.session_start_timeout).await;
                if state.welcomed.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            // Every stream the welcome allows, plus the session's own.
            // Windows: one stalled stream holds at most 256 KiB of the connection's
            // 16 MiB, so it cannot stall the session or the other streams.
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(inner2.config.limits.max_streams.saturating_add(1))
                .initial_stream_window_size(256 << 10)
                .initial_connection_window_size(16 << 20)
                .serve_connection(TokioIo::new(tls), service);
            tokio::select! {
                () = inner2.cancel.cancelled() => {}
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "broker connection ended");
                },
                () = unwelcomed => {
                    tracing::debug!("a connection had no session welcomed in time: closed");
                }
                () = state.close.cancelled() => {}
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
    conn: Arc<Conn>,
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
        if conn.busy.swap(true, Ordering::Relaxed) {
            // One session per connection: a broker reconnects on a new one.
            return empty(StatusCode::CONFLICT);
        }
        return start_session(inner, conn, req);
    }
    if let Some(id) = path.strip_prefix("/bus/v1/streams/") {
        return match id.parse::<u64>() {
            Ok(id) => data_stream(inner, conn.id, id, req).await,
            Err(_) => empty(StatusCode::NOT_FOUND),
        };
    }
    empty(StatusCode::NOT_FOUND)
}

fn start_session(
    inner: Arc<Inner>,
    conn: Arc<Conn>,
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
    conn: Arc<Conn>,
    mut body: Incoming,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
    commands: mpsc::Sender<Command>,
    mut cmd_rx: mpsc::Receiver<Command>,
) {
    let mut session =
        RouterSession::new(session_id, inner.config.limits, std::time::Instant::now());
    let mut decoder = ControlDecoder::default();
    // However the session ends, its data streams and its connection end with it.
    let ended = CancellationToken::new();
    let _end_streams = ended.clone().drop_guard();
    let _close_conn = conn.close.clone().drop_guard();
    let conn_id = conn.id;
    // A joining broker takes its share of open streams once it held on for a while.
    let mut take_share_at: Option<tokio::time::Instant> = None;
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
                    conn.welcomed.store(true, Ordering::Relaxed);
                    take_share_at = Some(tokio::time::Instant::now() + inner.config.join_hold_down);
                    client = Some(client_id);
                }
                RouterEvent::Opened(_) => {}
                RouterEvent::Refused { stream_id, code } => {
                    inner.counters.refused.add(code.as_str());
                    inner.fail(stream_id, TunnelError::Refused(code));
                    inner.end_stream(stream_id);
                }
                RouterEvent::Closed { stream_id, code } => {
                    inner.counters.closed.add(code.as_str());
                    inner.fail(stream_id, TunnelError::Closed(code));
                    inner.end_stream(stream_id);
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
            .iter()
            // Only on the connection of the session that asked for it.
            .find(|(_, e)| e.session_id == session_id && e.conn_id == conn_id)
            .map(|(id, e)| (id.clone(), e.commands.clone(), e.ended.clone()))
    };
    let Some((client_id, commands, ended)) = found else {
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
    let (tx, rx) = mpsc::channel(TUNNEL_WRITE_CHUNKS);
    let detach = commands.clone();
    // Ends with its session, or alone when it moves to another broker.
    let stop = ended.child_token();
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
        inner.counters.bytes.clone(),
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
    );
    inner
        .counters
        .streams_opened
        .fetch_add(1, Ordering::Relaxed);
    let _ = waiter.reply.send(Ok(stream));
    Response::new(ChannelBody::new(rx).until(stop))
}
