//! A worker's Dynamo KV query endpoint: serves Dynamo 1.6.1's router from the
//! worker's recovery log over the TCP request plane (the thin I/O around
//! [`decode_request`](super::decode_request) and [`answer`](super::answer)).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::frame::{ACK, RequestLimits, decode_request, encode_two_part, two_part_of};
use super::query::{AnswerBody, CallHome, Codec, Control, KvAnswer, KvQuery};
use crate::counter;
use crate::kv::pipeline::SharedWorkerLog;
use crate::net::AddrFilter;

/// Settings of a [`DynamoQueryServer`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DynamoQueryConfig {
    pub(crate) limits: RequestLimits,
    pub(crate) max_connections: usize,
    pub(crate) max_answers: usize,
    pub(crate) max_answer_events: usize,
    pub(crate) max_queued_answers: usize,
    pub(crate) call_home_timeout: Duration,
    pub(crate) idle_timeout: Duration,
    pub(crate) filter: AddrFilter,
}

/// Settings: each setter documents its default.
impl DynamoQueryConfig {
    /// Bounds of a request frame, checked as its lengths arrive. Default
    /// [`RequestLimits::default`]: a 1 KiB path, 8 KiB of headers, a 64 KiB payload.
    #[must_use]
    pub fn limits(mut self, limits: RequestLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Connections served at once. Default 16 (more are closed at once, counted); 0 is
    /// taken as 1.
    #[must_use]
    pub fn max_connections(mut self, max_connections: usize) -> Self {
        self.max_connections = max_connections;
        self
    }

    /// Answers being sent at once. Default 2 (a dump is the worker's whole cache;
    /// further requests wait for a turn, within `call_home_timeout`); 0 is taken as 1.
    #[must_use]
    pub fn max_answers(mut self, max_answers: usize) -> Self {
        self.max_answers = max_answers;
        self
    }

    /// Events in one `Events` answer. Default 4,096 (past them the answer stops, and
    /// Dynamo's router asks again from there; a large answer would be one large
    /// message).
    #[must_use]
    pub fn max_answer_events(mut self, max_answer_events: usize) -> Self {
        self.max_answer_events = max_answer_events;
        self
    }

    /// Answers sent or waiting for their turn, across connections. Default 64 (a query
    /// past them is not acknowledged, its connection closed and counted in `busy`;
    /// Dynamo's router retries it); 0 is taken as 1.
    #[must_use]
    pub fn max_queued_answers(mut self, max_queued_answers: usize) -> Self {
        self.max_queued_answers = max_queued_answers;
        self
    }

    /// Deadline of dialling the router back and sending the answer. Default 10 s.
    #[must_use]
    pub fn call_home_timeout(mut self, call_home_timeout: Duration) -> Self {
        self.call_home_timeout = call_home_timeout;
        self
    }

    /// A request must arrive whole within this, and its acknowledgement be written,
    /// or the connection is closed. Default 30 s.
    #[must_use]
    pub fn idle_timeout(mut self, idle_timeout: Duration) -> Self {
        self.idle_timeout = idle_timeout;
        self
    }

    /// Addresses an answer may be sent to, besides being the address that asked
    /// (Dynamo's router must advertise the address it connects from): by default
    /// the subscriber's ([`AddrFilter::default`]).
    #[must_use]
    pub fn filter(mut self, filter: AddrFilter) -> Self {
        self.filter = filter;
        self
    }
}

impl Default for DynamoQueryConfig {
    fn default() -> Self {
        DynamoQueryConfig {
            limits: RequestLimits::default(),
            max_connections: 16,
            max_answers: 2,
            max_answer_events: 4096,
            max_queued_answers: 64,
            call_home_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            filter: AddrFilter::default(),
        }
    }
}

/// Counters of a [`DynamoQueryServer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct DynamoQueryStats {
    /// Request connections accepted.
    pub connections: u64,
    /// ... closed at once: too many open.
    pub refused_connections: u64,
    /// Queries answered with events.
    pub events: u64,
    /// ... with a dump.
    pub dumps: u64,
    /// ... `TooNew` or `InvalidRange`.
    pub out_of_range: u64,
    /// Requests that were not a KV query (the connection closed).
    pub malformed: u64,
    /// Queries not answered (their connection closed): the address to send the
    /// answer to was not the one that asked, or the filter refused it.
    pub refused_call_homes: u64,
    /// Answers whose sending failed or timed out.
    pub failed_call_homes: u64,
    /// Queries not answered: `max_queued_answers` were already waiting.
    pub busy: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    refused_connections: AtomicU64,
    events: AtomicU64,
    dumps: AtomicU64,
    out_of_range: AtomicU64,
    malformed: AtomicU64,
    refused_call_homes: AtomicU64,
    failed_call_homes: AtomicU64,
    busy: AtomicU64,
}

struct Shared {
    log: SharedWorkerLog,
    config: DynamoQueryConfig,
    counters: Counters,
    connections: Arc<Semaphore>,
    answers: Arc<Semaphore>,
    queued: Arc<Semaphore>,
}

/// Serves Dynamo's KV queries from a worker's [`SharedWorkerLog`] until dropped.
#[derive(Debug)]
pub struct DynamoQueryServer {
    local: SocketAddr,
    shared: Arc<Shared>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Drop for DynamoQueryServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl DynamoQueryServer {
    /// Binds `endpoint` (`tcp://host:port`, port 0 for any) and serves `log`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::kv::dynamo_recovery::{DynamoQueryConfig, DynamoQueryServer};
    /// use eventplane::kv::{pipeline::{SharedWorkerLog, WorkerLogConfig}};
    /// let log = SharedWorkerLog::new(WorkerLogConfig::default());
    /// let server =
    ///     DynamoQueryServer::bind("tcp://127.0.0.1:0", log, DynamoQueryConfig::default()).await?;
    /// assert_ne!(server.local_addr().port(), 0);
    /// # Ok(()) }
    /// ```
    pub async fn bind(
        endpoint: &str,
        log: SharedWorkerLog,
        config: DynamoQueryConfig,
    ) -> Result<DynamoQueryServer, crate::zmtp::Error> {
        let (host, port) = crate::zmtp::parse_tcp(endpoint)?;
        let listener = TcpListener::bind((host.as_str(), port)).await?;
        let local = listener.local_addr()?;
        let shared = Arc::new(Shared {
            log,
            connections: Arc::new(Semaphore::new(config.max_connections.max(1))),
            answers: Arc::new(Semaphore::new(config.max_answers.max(1))),
            queued: Arc::new(Semaphore::new(config.max_queued_answers.max(1))),
            config,
            counters: Counters::default(),
        });
        let cancel = CancellationToken::new();
        let (s, c) = (shared.clone(), cancel.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = c.cancelled() => return,
                    a = listener.accept() => a,
                };
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::debug!(error = %e, "Dynamo query endpoint accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = s.connections.clone().try_acquire_owned() else {
                    counter::add(&s.counters.refused_connections, 1);
                    continue;
                };
                counter::add(&s.counters.connections, 1);
                let (s, c) = (s.clone(), c.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    tokio::select! {
                        () = c.cancelled() => {}
                        () = serve(&s, stream, peer, &c) => {}
                    }
                });
            }
        });
        Ok(DynamoQueryServer {
            local,
            shared,
            cancel,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Counters.
    pub fn stats(&self) -> DynamoQueryStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DynamoQueryStats {
            connections: l(&c.connections),
            refused_connections: l(&c.refused_connections),
            events: l(&c.events),
            dumps: l(&c.dumps),
            out_of_range: l(&c.out_of_range),
            malformed: l(&c.malformed),
            refused_call_homes: l(&c.refused_call_homes),
            failed_call_homes: l(&c.failed_call_homes),
            busy: l(&c.busy),
        }
    }
}

/// Serves one request connection: frames in, an acknowledgement each, answers sent
/// on connections of their own.
async fn serve(
    shared: &Arc<Shared>,
    mut stream: TcpStream,
    peer: SocketAddr,
    cancel: &CancellationToken,
) {
    let limits = shared.config.limits;
    let idle = shared.config.idle_timeout;
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        // A whole request within the idle timeout (not a byte per timeout).
        let read = tokio::time::timeout(idle, async {
            loop {
                match decode_request(&mut buf, limits) {
                    Ok(Some(frame)) => return Some(frame),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "Dynamo query refused");
                        counter::add(&shared.counters.malformed, 1);
                        return None;
                    }
                }
                match stream.read_buf(&mut buf).await {
                    Ok(n) if n > 0 => {}
                    _ => return None,
                }
            }
        });
        let Ok(Some(frame)) = read.await else {
            return;
        };
        let Some((query, codec, home)) = parse(&frame.payload, limits) else {
            counter::add(&shared.counters.malformed, 1);
            return;
        };
        // The answer goes back only to the address that asked, through the filter.
        // A query that cannot be answered is not acknowledged: the connection closes,
        // which Dynamo's router counts as a failure and retries.
        let to =
            home.address.parse::<SocketAddr>().ok().filter(|a| {
                same_address(peer, *a) && shared.config.filter.check_socket(*a).is_ok()
            });
        let Some(to) = to else {
            tracing::debug!(%peer, address = %home.address.chars().take(64).collect::<String>(),
                "Dynamo query's answer address refused: not the asking address");
            counter::add(&shared.counters.refused_call_homes, 1);
            return;
        };
        let Ok(queued) = shared.queued.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "Dynamo query refused: too many answers waiting");
            counter::add(&shared.counters.busy, 1);
            return;
        };
        match tokio::time::timeout(idle, stream.write_all(&ACK)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        let shared = shared.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let _queued = queued;
            let deadline = shared.config.call_home_timeout;
            let sent = tokio::time::timeout(deadline, async {
                let _turn = shared.answers.acquire().await;
                let most = shared.config.max_answer_events;
                let answer = shared.log.with(|log| super::answer(log, &query, most));
                tracing::debug!(start = ?query.start_event_id, end = ?query.end_event_id,
                    answer = answer.summary(), "Dynamo KV query answered");
                let c = &shared.counters;
                match &answer {
                    KvAnswer::Events { .. } => counter::add(&c.events, 1),
                    KvAnswer::TreeDump { .. } => counter::add(&c.dumps, 1),
                    _ => counter::add(&c.out_of_range, 1),
                }
                call_home(to, &home.subject, codec, answer).await
            });
            let sent = tokio::select! {
                () = cancel.cancelled() => return,
                r = sent => r,
            };
            if !matches!(sent, Ok(Ok(()))) {
                tracing::debug!(%to, outcome = ?sent, "Dynamo query's answer not delivered");
                counter::add(&shared.counters.failed_call_homes, 1);
            }
        });
    }
}

/// Whether `to` is the address that connected from `peer` (IPv4-mapped IPv6 taken as
/// IPv4). Dynamo's router names the address it advertises
/// (`DYN_TCP_RESPONSE_STREAM_HOST`),
/// which must be the one it reaches this worker from.
fn same_address(peer: SocketAddr, to: SocketAddr) -> bool {
    to.ip().to_canonical() == peer.ip().to_canonical()
}

/// A request's query, its codec and where its answer goes.
fn parse(payload: &bytes::Bytes, limits: RequestLimits) -> Option<(KvQuery, Codec, CallHome)> {
    let message = two_part_of(payload, limits.headers, limits.payload)?;
    let control = Control::decode(&message.header).ok()?;
    let query = KvQuery::decode(&message.body, control.payload_codec).ok()?;
    let home = control.call_home().ok()?;
    Some((query, control.payload_codec, home))
}

/// Dials the router back and sends `answer` as Dynamo's response stream.
async fn call_home(
    to: SocketAddr,
    subject: &str,
    codec: Codec,
    answer: KvAnswer,
) -> std::io::Result<()> {
    let body = AnswerBody::Answer(answer)
        .encode(codec)
        .map_err(std::io::Error::other)?;
    let last = AnswerBody::Final
        .encode(codec)
        .map_err(std::io::Error::other)?;
    let hello = serde_json::json!({"subject": subject, "stream_type": "response"}).to_string();
    let mut stream = TcpStream::connect(to).await?;
    let _ = stream.set_nodelay(true);
    for (header, body) in [
        (hello.as_bytes(), &[][..]),
        (&b"{\"error\":null}"[..], &[][..]),
        (&[][..], &body[..]),
        (&[][..], &last[..]),
        (&b"\"sentinel\""[..], &[][..]),
    ] {
        stream.write_all(&encode_two_part(header, body)).await?;
    }
    stream.shutdown().await
}
