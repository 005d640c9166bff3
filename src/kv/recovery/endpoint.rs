//! The recovery endpoint: a worker serves its [`WorkerLog`] over ZMTP, a router asks.
//!
//! A DEALER (the router) sends one request per message; a ROUTER connection (the
//! worker) answers on the same connection:
//!
//! | request | answer |
//! |---|---|
//! | `["", "since", id u64be]` | `["", "events", payload]`… then `["", "end", current_id u64be, 1]`, or `["", "too_old", oldest u64be]` |
//! | `["", "dump"]` | `["", "blocks", packed]`… then `["", "end", current_id u64be, complete 0/1]` |
//!
//! `payload` is a msgpack list of router events, as the worker publishes them (at most
//! 128 events and 8,192 blocks a message); `packed` is the same events packed as
//! fixed-width integers (16 bytes a stored block; see `blocks.rs`), at most 8,192 blocks
//! a message. A client takes either in any answer. Anything else is answered
//! `["", "error", reason]` and the connection closed.

use crate::wire::Dialect;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::blocks;
use super::{Dump, SharedWorkerLog, Since};
use crate::counter;
use crate::kv::{RouterEvent, pipeline::split_messages};
use crate::zmtp::{self, DealerSocket, Message};

/// Connections a recovery endpoint serves at once by default: 16 (more are closed at
/// once and counted).
pub(crate) const DEFAULT_RECOVERY_CONNECTIONS: usize = 16;

/// Dumps built at once by default: 2. Requests that find the log where the last dump
/// left it share that dump instead of building another.
pub(crate) const DEFAULT_CONCURRENT_DUMPS: usize = 2;

/// How long a recovery connection may stay silent before it is closed: 30 s.
pub(crate) const RECOVERY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest request a recovery endpoint reads: 64 bytes (a request is at most 3 short
/// frames; anything larger fails the connection before it is assembled).
const MAX_REQUEST: usize = 64;

/// Messages of router events in one answer.
const EVENTS_PER_MESSAGE: usize = 128;
const BLOCKS_PER_MESSAGE: usize = 8192;

/// What a router asks a worker for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecoveryRequest {
    /// The events after this id.
    Since(u64),
    /// Every block the worker holds.
    Dump,
}

/// What a worker answered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recovered {
    /// The events after the asked id, and the id they lead up to.
    Events {
        /// The events, in order.
        events: Vec<RouterEvent>,
        /// The worker's newest event id.
        current_id: u64,
    },
    /// The worker no longer keeps the events after the asked id: ask for a dump.
    TooOld {
        /// The oldest id it keeps.
        oldest: u64,
    },
    /// A dump.
    Dump(Dump),
}

/// Why a recovery request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// The endpoint could not be reached, or its connection failed.
    #[error("recovery connection failed")]
    Connection(#[from] zmtp::Error),
    /// No complete answer within the timeout.
    #[error("no complete recovery answer within {0:?}")]
    Timeout(Duration),
    /// The answer was larger than the client accepts.
    #[error("recovery answer larger than {0} bytes")]
    TooLarge(usize),
    /// The answer carried more blocks than the client accepts.
    #[error("recovery answer with more than {0} blocks")]
    TooManyBlocks(usize),
    /// The answer was not a recovery answer.
    #[error("malformed recovery answer: {0}")]
    Malformed(&'static str),
    /// The worker refused the request.
    #[error("the worker refused the request: {0}")]
    Refused(String),
    /// Not asked: the [`RecoveryDriver`](crate::kv::router::RecoveryDriver) had too many
    /// recoveries queued.
    #[error("not asked: too many recoveries queued")]
    Busy,
}

impl RecoveryError {
    /// Whether asking again later may succeed: the worker was not reached, not in
    /// time, or not asked at all. An answer that was too large, malformed or refused
    /// would be the same again.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            RecoveryError::Connection(_) | RecoveryError::Timeout(_) | RecoveryError::Busy
        )
    }
}

/// Counters of a [`RecoveryServer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RecoveryServerStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections closed at once because 16 were open.
    pub refused_connections: u64,
    /// "since" requests answered with events.
    pub since_requests: u64,
    /// "since" requests answered `too_old`.
    pub too_old: u64,
    /// Dump requests answered.
    pub dump_requests: u64,
    /// Dumps built (the others shared one already built at the same id).
    pub dumps_built: u64,
    /// Requests that were not a recovery request (answered `error`, closed).
    pub malformed_requests: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    refused: AtomicU64,
    since: AtomicU64,
    too_old: AtomicU64,
    dumps: AtomicU64,
    built: AtomicU64,
    malformed: AtomicU64,
}

/// An encoded dump, shared by the requests that find the log at its id.
type Encoded = Arc<(u64, bool, Vec<Bytes>)>;

#[derive(Debug)]
struct Shared {
    log: SharedWorkerLog,
    counters: Counters,
    connections: Arc<Semaphore>,
    dumps: Semaphore,
    /// The last dump built, with the log's (last id, id breaks) it was built at: a
    /// log whose ids restarted (another process) is at a new key even at the same id.
    last_dump: Mutex<Option<((u64, u64), Encoded)>>,
    config: zmtp::Config,
}

/// A worker's recovery endpoint: serves its [`SharedWorkerLog`] to routers.
///
/// A router connects a DEALER and sends one request per message; each connection is
/// answered on its own:
///
/// | request | answer |
/// |---|---|
/// | `["", "since", id u64be]` | `["", "events", payload]`… then `["", "end", current_id u64be, 1]`, or `["", "too_old", oldest u64be]` |
/// | `["", "dump"]` | `["", "blocks", packed]`… then `["", "end", current_id u64be, complete 0/1]` |
///
/// `payload` is a msgpack list of router events as the worker publishes them (at most
/// 128 events and 8,192 blocks a message); `packed` carries a dump's events as
/// little-endian integers, 16 bytes a stored block (a payload starts with the events'
/// `worker_id u64, id u64`; then records of `tag u8` (0 stored from the root, 1 stored
/// under a `parent u64` that follows the record's header, 2 removed, 3 cleared),
/// `tier u8` (device 0, host_pinned 1, disk 2, external 3), `dp_rank u32`, `count u32`,
/// then `count` × (`block_hash u64, tokens_hash u64`), or `count` × `block_hash u64` for
/// a removal), at most 8,192 blocks a message. Anything else is answered `["", "error",
/// reason]` and the connection closed; a request frame over 64 bytes fails the
/// connection as it arrives. At most 16 connections,
/// 2 dumps built at once (requests that find the log
/// unchanged share the last one), a connection silent for 30 s
/// closed.
///
/// ```
/// use eventplane::kv::{pipeline::{RecoveryServer, SharedWorkerLog, WorkerLogConfig}, router::{RecoveryRequest, Recovered}};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let log = SharedWorkerLog::new(WorkerLogConfig::default());
/// let server = RecoveryServer::bind("tcp://127.0.0.1:0", log.clone()).await?;
/// let answer = eventplane::kv::router::recover(server.local_endpoint(), RecoveryRequest::Dump, Default::default()).await?;
/// assert!(matches!(answer, Recovered::Dump(d) if d.events.is_empty()));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct RecoveryServer {
    shared: Arc<Shared>,
    endpoint: String,
    cancel: CancellationToken,
}

impl Drop for RecoveryServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl RecoveryServer {
    /// Binds `endpoint` (`tcp://host:port`, port 0 for any) and serves `log` until
    /// dropped.
    pub async fn bind(endpoint: &str, log: SharedWorkerLog) -> Result<RecoveryServer, zmtp::Error> {
        let (host, port) = zmtp::parse_tcp(endpoint)?;
        let listener = TcpListener::bind((host.as_str(), port)).await?;
        let local = listener.local_addr()?;
        let server = RecoveryServer {
            shared: Arc::new(Shared {
                log,
                counters: Counters::default(),
                connections: Arc::new(Semaphore::new(DEFAULT_RECOVERY_CONNECTIONS)),
                dumps: Semaphore::new(DEFAULT_CONCURRENT_DUMPS),
                last_dump: Mutex::new(None),
                config: zmtp::Config::builder()
                    .max_frame_size(MAX_REQUEST)
                    .max_message_size(MAX_REQUEST)
                    .build()
                    .unwrap_or_default(),
            }),
            endpoint: format!("tcp://{local}"),
            cancel: CancellationToken::new(),
        };
        let shared = server.shared.clone();
        let cancel = server.cancel.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = cancel.cancelled() => return,
                    a = listener.accept() => a,
                };
                match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let _ = serve(shared.clone(), stream, cancel.clone());
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "recovery endpoint accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        tracing::debug!(endpoint = %server.endpoint, "recovery endpoint bound");
        Ok(server)
    }

    /// The bound endpoint, `tcp://ip:port`.
    pub fn local_endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Serves one router over an already connected stream (a tunnel stream); `false`
    /// when refused (the server stopped, or holds 16).
    pub fn serve_stream<S>(&self, stream: S) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        serve(self.shared.clone(), stream, self.cancel.clone())
    }

    /// A cloneable handle serving streams as [`serve_stream`](Self::serve_stream)
    /// does, for a tunnel source that answers routers through its bus session
    /// ([`Source::announce_with_recovery`](crate::tunnel::Source::announce_with_recovery),
    /// feature `tunnel`). It stops serving when the server is dropped.
    pub fn acceptor(&self) -> RecoveryAcceptor {
        RecoveryAcceptor {
            shared: self.shared.clone(),
            cancel: self.cancel.clone(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> RecoveryServerStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RecoveryServerStats {
            connections: l(&c.connections),
            refused_connections: l(&c.refused),
            since_requests: l(&c.since),
            too_old: l(&c.too_old),
            dump_requests: l(&c.dumps),
            dumps_built: l(&c.built),
            malformed_requests: l(&c.malformed),
        }
    }
}

/// Serves a [`RecoveryServer`]'s log over streams handed to it (from
/// [`RecoveryServer::acceptor`]): the same bounds and counters as the server's own
/// connections.
#[derive(Debug, Clone)]
pub struct RecoveryAcceptor {
    shared: Arc<Shared>,
    cancel: CancellationToken,
}

impl RecoveryAcceptor {
    /// Serves one router over `stream`; `false` when refused (the server was dropped,
    /// or holds 16).
    pub fn accept_stream<S>(&self, stream: S) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        serve(self.shared.clone(), stream, self.cancel.clone())
    }

    /// Whether its server was dropped (it accepts nothing more).
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Whether it would serve one more connection now (fewer than
    /// [`DEFAULT_RECOVERY_CONNECTIONS`] are open): a tunnel source asks before it opens
    /// a stream it would have to close at once.
    #[cfg_attr(not(feature = "tunnel"), allow(dead_code))]
    pub(crate) fn has_room(&self) -> bool {
        self.shared.connections.available_permits() > 0
    }
}

#[cfg(feature = "tunnel")]
impl crate::tunnel::RecoveryStreams for RecoveryAcceptor {
    fn accept(&self, stream: crate::tunnel::TunnelStream) -> bool {
        self.accept_stream(stream)
    }

    fn is_closed(&self) -> bool {
        RecoveryAcceptor::is_closed(self)
    }

    fn has_room(&self) -> bool {
        RecoveryAcceptor::has_room(self)
    }
}

/// Serves one connection; `false` when refused.
fn serve<S>(shared: Arc<Shared>, stream: S, cancel: CancellationToken) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if cancel.is_cancelled() {
        return false;
    }
    let Ok(permit) = shared.connections.clone().try_acquire_owned() else {
        counter::add(&shared.counters.refused, 1);
        return false;
    };
    counter::add(&shared.counters.connections, 1);
    tokio::spawn(async move {
        let _permit = permit;
        let conn = async {
            let mut socket = DealerSocket::accept_as_router(stream, shared.config.clone()).await?;
            loop {
                let request = match tokio::time::timeout(RECOVERY_IDLE_TIMEOUT, socket.recv()).await
                {
                    Ok(r) => r?,
                    Err(_) => return Ok(()),
                };
                if !answer(&shared, &mut socket, &request).await? {
                    return Ok(());
                }
            }
        };
        tokio::select! {
            () = cancel.cancelled() => {}
            r = conn => {
                if let Err(e) = r {
                    let e: zmtp::Error = e;
                    tracing::debug!(error = %crate::net::ErrorChain(&e), "recovery connection ended");
                }
            }
        }
    });
    true
}

/// Answers one request; `false` when the connection must close.
async fn answer<S>(
    shared: &Shared,
    socket: &mut DealerSocket<S>,
    request: &Message,
) -> Result<bool, zmtp::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let c = &shared.counters;
    let kind = (request.len(), request.get(0), request.get(1));
    match kind {
        (3, Some(b""), Some(b"since")) => {
            let Some(after) = request.get(2).and_then(|f| <[u8; 8]>::try_from(f).ok()) else {
                return refuse(c, socket, "since needs a u64 id").await;
            };
            let (since, current) = shared
                .log
                .with(|log| (log.since(u64::from_be_bytes(after)), log.stats().last_id));
            match since {
                Since::Events(events) => {
                    counter::add(&c.since, 1);
                    for m in encode(&events) {
                        socket
                            .send(&Message::from_parts([
                                Bytes::new(),
                                Bytes::from_static(b"events"),
                                m,
                            ]))
                            .await?;
                    }
                    socket.send(&end(current, true)).await?;
                }
                Since::TooOld { oldest } => {
                    counter::add(&c.too_old, 1);
                    let reply = Message::from_parts([
                        Bytes::new(),
                        Bytes::from_static(b"too_old"),
                        Bytes::copy_from_slice(&oldest.to_be_bytes()),
                    ]);
                    socket.send(&reply).await?;
                }
            }
            Ok(true)
        }
        (2, Some(b""), Some(b"dump")) => {
            counter::add(&c.dumps, 1);
            let dump = dump(shared).await;
            for m in &dump.2 {
                socket
                    .send(&Message::from_parts([
                        Bytes::new(),
                        Bytes::from_static(b"blocks"),
                        m.clone(),
                    ]))
                    .await?;
            }
            socket.send(&end(dump.0, dump.1)).await?;
            Ok(true)
        }
        _ => refuse(c, socket, "not a recovery request").await,
    }
}

async fn refuse<S>(
    c: &Counters,
    socket: &mut DealerSocket<S>,
    reason: &'static str,
) -> Result<bool, zmtp::Error>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    counter::add(&c.malformed, 1);
    let reply = Message::from_parts([
        Bytes::new(),
        Bytes::from_static(b"error"),
        Bytes::from_static(reason.as_bytes()),
    ]);
    socket.send(&reply).await?;
    Ok(false)
}

fn end(current: u64, complete: bool) -> Message {
    Message::from_parts([
        Bytes::new(),
        Bytes::from_static(b"end"),
        Bytes::copy_from_slice(&current.to_be_bytes()),
        Bytes::from(vec![u8::from(complete)]),
    ])
}

fn encode(events: &[RouterEvent]) -> Vec<Bytes> {
    split_messages(events, EVENTS_PER_MESSAGE, BLOCKS_PER_MESSAGE)
        .filter_map(|m| {
            Dialect::EventPlane
                .encode_router_events(m)
                .ok()
                .map(Bytes::from)
        })
        .collect()
}

/// The dump at the log's current id: shared when one was built there, else built
/// (at most [`DEFAULT_CONCURRENT_DUMPS`] at once).
async fn dump(shared: &Shared) -> Encoded {
    let at = {
        let s = shared.log.stats();
        (s.last_id, s.id_breaks)
    };
    let cached = |shared: &Shared| {
        shared
            .last_dump
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|(key, _)| *key == at)
            .map(|(_, d)| d.clone())
    };
    if let Some(d) = cached(shared) {
        return d;
    }
    let _permit = shared.dumps.acquire().await;
    // Another request may have built it while this one waited.
    if let Some(d) = cached(shared) {
        return d;
    }
    // Copied under the log's lock with the key it is at; sorted and packed after.
    let (snapshot, at) = shared.log.with(|log| {
        let s = log.stats();
        (log.snapshot(), (s.last_id, s.id_breaks))
    });
    let dump = snapshot.into_dump();
    counter::add(&shared.counters.built, 1);
    let messages = blocks::encode(&dump.events, BLOCKS_PER_MESSAGE);
    let encoded: Encoded = Arc::new((dump.current_id, dump.complete, messages));
    *shared.last_dump.lock().unwrap_or_else(|p| p.into_inner()) = Some((at, encoded.clone()));
    encoded
}

/// Settings of [`recover`]: private fields, consuming setters that state their
/// defaults.
///
/// ```
/// use std::time::Duration;
/// use eventplane::kv::router::RecoveryClientConfig;
/// let config = RecoveryClientConfig::default()
///     .timeout(Duration::from_secs(2))
///     .max_bytes(64 << 20);
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RecoveryClientConfig {
    pub(crate) timeout: Duration,
    pub(crate) max_bytes: usize,
    pub(crate) zmtp: zmtp::Config,
    pub(crate) filter: Option<crate::net::AddrFilter>,
    pub(crate) max_blocks: usize,
}

/// Settings: each setter documents its default.
impl RecoveryClientConfig {
    /// Deadline of the whole request, connection included. Default 5 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The most answer bytes accepted, on the wire and again decoded (each event costs
    /// its in-memory size, so an answer of many empty events is held to it too).
    /// Default 256 MiB. A [`RecoveryDriver`](crate::kv::router::RecoveryDriver) holds
    /// at most 16 answers at once.
    #[must_use]
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The connection's bounds. Default `zmtp::Config::default()` (frames up to 8 MiB,
    /// messages up to 16 MiB).
    #[must_use]
    pub fn zmtp(mut self, zmtp: zmtp::Config) -> Self {
        self.zmtp = zmtp;
        self
    }

    /// Addresses the client may dial: by default the subscriber's own
    /// ([`AddrFilter::default`](crate::net::AddrFilter::default): what discovery names
    /// is dialled, so metadata and link-local addresses are refused); `None` dials
    /// anything.
    #[must_use]
    pub fn filter(mut self, filter: Option<crate::net::AddrFilter>) -> Self {
        self.filter = filter;
        self
    }

    /// The most blocks an answer may carry, decoded (a hash of 0 costs one byte on the
    /// wire, 8 in memory). Default 2^22.
    #[must_use]
    pub fn max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks;
        self
    }
}

impl Default for RecoveryClientConfig {
    fn default() -> Self {
        RecoveryClientConfig {
            timeout: Duration::from_secs(5),
            max_bytes: 256 << 20,
            zmtp: zmtp::Config::default(),
            filter: Some(crate::net::AddrFilter::default()),
            max_blocks: crate::kv::DEFAULT_MAX_LOG_BLOCKS,
        }
    }
}

/// Asks the worker at `endpoint` for `request`, on a connection of its own.
pub async fn recover(
    endpoint: &str,
    request: RecoveryRequest,
    config: RecoveryClientConfig,
) -> Result<Recovered, RecoveryError> {
    let timeout = config.timeout;
    tokio::time::timeout(timeout, async {
        let socket = match &config.filter {
            Some(filter) => {
                DealerSocket::connect_filtered(endpoint, config.zmtp.clone(), filter).await?
            }
            None => DealerSocket::connect(endpoint, config.zmtp.clone()).await?,
        };
        recover_over(socket, request, config.max_bytes, config.max_blocks).await
    })
    .await
    .map_err(|_| RecoveryError::Timeout(timeout))?
}

/// [`recover`] over a DEALER already connected to the worker (a tunnel stream).
pub async fn recover_over<S>(
    mut socket: DealerSocket<S>,
    request: RecoveryRequest,
    max_bytes: usize,
    max_blocks: usize,
) -> Result<Recovered, RecoveryError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let ask = match request {
        RecoveryRequest::Since(id) => Message::from_parts([
            Bytes::new(),
            Bytes::from_static(b"since"),
            Bytes::copy_from_slice(&id.to_be_bytes()),
        ]),
        RecoveryRequest::Dump => Message::from_parts([Bytes::new(), Bytes::from_static(b"dump")]),
    };
    socket.send(&ask).await?;
    let mut events = Vec::new();
    let mut bytes = 0usize;
    let mut blocks = 0usize;
    let mut held = 0usize;
    loop {
        let msg = socket.recv().await?;
        bytes = bytes.saturating_add(msg.byte_len());
        if bytes > max_bytes {
            return Err(RecoveryError::TooLarge(max_bytes));
        }
        if msg.get(0) != Some(b"") {
            return Err(RecoveryError::Malformed("no empty delimiter"));
        }
        let u64_at = |i: usize| {
            msg.get(i)
                .and_then(|f| <[u8; 8]>::try_from(f).ok())
                .map(u64::from_be_bytes)
        };
        match (msg.get(1), msg.len()) {
            (Some(kind @ (b"events" | b"blocks")), 3) => {
                let payload = msg.get(2).unwrap_or_default();
                let before = events.len();
                if kind == b"events" {
                    let decoded = Dialect::EventPlane
                        .decode_router_events(payload)
                        .map_err(|_| RecoveryError::Malformed("undecodable events"))?;
                    events.extend(decoded);
                } else {
                    // Decoded in place, held to what is left of the bound as it goes:
                    // a record of an empty event is 10 bytes on the wire, several
                    // times that decoded.
                    let budget = max_bytes.saturating_sub(held);
                    blocks::decode(payload, &mut events, budget).map_err(|e| match e {
                        blocks::Undecodable::OverBudget => RecoveryError::TooLarge(max_bytes),
                        blocks::Undecodable::Malformed => {
                            RecoveryError::Malformed("undecodable blocks")
                        }
                    })?;
                }
                let added = events.get(before..).unwrap_or_default();
                let carried: usize = added.iter().map(|e| e.event.data.block_count()).sum();
                blocks = blocks.saturating_add(carried);
                if blocks > max_blocks {
                    return Err(RecoveryError::TooManyBlocks(max_blocks));
                }
                // What they cost decoded: events without blocks are small on the wire.
                held = held.saturating_add(blocks::decoded_size(added.len(), carried));
                if held > max_bytes {
                    return Err(RecoveryError::TooLarge(max_bytes));
                }
            }
            (Some(b"end"), 4) => {
                let current_id = u64_at(2).ok_or(RecoveryError::Malformed("end without an id"))?;
                let complete = msg.get(3) == Some(&[1u8][..]);
                return Ok(match request {
                    RecoveryRequest::Since(_) => Recovered::Events { events, current_id },
                    RecoveryRequest::Dump => Recovered::Dump(Dump {
                        events,
                        current_id,
                        complete,
                    }),
                });
            }
            (Some(b"too_old"), 3) => {
                let oldest = u64_at(2).ok_or(RecoveryError::Malformed("too_old without an id"))?;
                return Ok(Recovered::TooOld { oldest });
            }
            (Some(b"error"), 3) => {
                let reason = String::from_utf8_lossy(msg.get(2).unwrap_or_default());
                return Err(RecoveryError::Refused(reason.chars().take(256).collect()));
            }
            _ => return Err(RecoveryError::Malformed("unknown answer")),
        }
    }
}
