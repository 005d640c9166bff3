//! A router's end of Dynamo's KV queries: asks a worker's endpoint, and takes the
//! answer on a connection the worker opens back to it (the thin I/O around the frame
//! and body codecs).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::frame::{FrameError, TwoPart, decode_two_part, encode_request, encode_two_part};
use super::query::{AnswerBody, CallHome, Codec, Control, KvAnswer, KvQuery, QueryError};
use crate::hash::FastMap;
use crate::kv::WorkerId;

/// Where a Dynamo worker serves KV queries (from its `recovery_target`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueryTarget {
    /// `HOST:PORT` to connect to.
    pub address: String,
    /// The request path (`{instance:x}/{namespace}/{component}/{endpoint}`).
    pub path: String,
    /// The worker's codec.
    pub codec: Codec,
    /// The worker asked about (`worker_id` of the query).
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: u32,
}

impl QueryTarget {
    /// From a `recovery_target`'s `transport.tcp` (`HOST:PORT/path`) and its codec,
    /// for the worker's rank `dp_rank`.
    pub fn from_tcp(
        tcp: &str,
        codec: Codec,
        worker_id: impl Into<WorkerId>,
        dp_rank: u32,
    ) -> Option<QueryTarget> {
        let (address, path) = tcp.split_once('/')?;
        if address.is_empty() || path.is_empty() {
            return None;
        }
        Some(QueryTarget {
            address: address.to_owned(),
            path: path.to_owned(),
            codec,
            worker_id: worker_id.into(),
            dp_rank,
        })
    }

    /// From its spelling in [`Instance::recovery`](crate::discovery::Instance::recovery):
    /// `dynamo+CODEC://HOST:PORT/PATH?worker_id=W&dp_rank=R` (CODEC `msgpack` or
    /// `json`). `None` for anything else.
    ///
    /// ```
    /// use eventplane::kv::dynamo_recovery::{Codec, QueryTarget};
    /// let t = QueryTarget::parse("dynamo+json://10.0.0.7:4100/1f/ns/c/e?worker_id=7&dp_rank=1").unwrap();
    /// assert_eq!((t.address.as_str(), t.path.as_str(), t.codec), ("10.0.0.7:4100", "1f/ns/c/e", Codec::Json));
    /// assert_eq!((t.worker_id.0, t.dp_rank), (7, 1));
    /// assert!(QueryTarget::parse("tcp://10.0.0.7:4100").is_none());
    /// ```
    pub fn parse(recovery: &str) -> Option<QueryTarget> {
        let (codec, rest) = [
            ("dynamo+msgpack://", Codec::Msgpack),
            ("dynamo+json://", Codec::Json),
        ]
        .into_iter()
        .find_map(|(scheme, codec)| recovery.strip_prefix(scheme).map(|r| (codec, r)))?;
        let (tcp, query) = rest.split_once('?')?;
        let (mut worker_id, mut dp_rank): (Option<u64>, Option<u32>) = (None, None);
        for pair in query.split('&') {
            match pair.split_once('=')? {
                ("worker_id", v) => worker_id = v.parse().ok(),
                ("dp_rank", v) => dp_rank = v.parse().ok(),
                _ => {}
            }
        }
        QueryTarget::from_tcp(tcp, codec, worker_id?, dp_rank?)
    }
}

/// Why a query got no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoQueryError {
    /// The worker could not be reached, or a connection failed.
    #[error("connection failed")]
    Io(#[from] std::io::Error),
    /// No complete answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A frame past its bound.
    #[error("frame refused")]
    Frame(#[from] FrameError),
    /// Not what Dynamo sends.
    #[error("malformed answer")]
    Malformed(#[from] QueryError),
    /// The worker's stream said it failed.
    #[error("the worker answered an error: {0}")]
    Refused(String),
    /// Too many queries waiting for their answers.
    #[error("too many queries waiting")]
    Busy,
}

/// Bounds of a [`CallHome`] listener's streams.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CallHomeConfig {
    pub(crate) max_pending: usize,
    pub(crate) max_header: usize,
    pub(crate) max_body: usize,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_handshakes: usize,
    pub(crate) filter: crate::net::AddrFilter,
}

/// Settings: each setter documents its default.
impl CallHomeConfig {
    /// Queries awaiting their answer at once. Default 16 (as many as a
    /// [`RecoveryDriver`](crate::kv::router::RecoveryDriver) runs; each answer is held to
    /// `max_body`); 0 is taken as 1.
    #[must_use]
    pub fn max_pending(mut self, max_pending: usize) -> Self {
        self.max_pending = max_pending;
        self
    }

    /// Largest header of an answer's stream. Default 64 KiB.
    #[must_use]
    pub fn max_header(mut self, max_header: usize) -> Self {
        self.max_header = max_header;
        self
    }

    /// Largest body (an answer; a dump is the worker's whole cache). Default 256 MiB.
    #[must_use]
    pub fn max_body(mut self, max_body: usize) -> Self {
        self.max_body = max_body;
        self
    }

    /// How long a connection may take to say which answer it carries. Default 5 s.
    #[must_use]
    pub fn handshake_timeout(mut self, handshake_timeout: Duration) -> Self {
        self.handshake_timeout = handshake_timeout;
        self
    }

    /// Connections that have not yet said which answer they carry, at once. Default
    /// 64 (more are closed at once); 0 is taken as 1.
    #[must_use]
    pub fn max_handshakes(mut self, max_handshakes: usize) -> Self {
        self.max_handshakes = max_handshakes;
        self
    }

    /// Addresses a query may be sent to: by default the subscriber's own
    /// ([`AddrFilter::default`](crate::net::AddrFilter::default): what discovery
    /// names is dialled, so metadata and link-local addresses are refused).
    #[must_use]
    pub fn filter(mut self, filter: crate::net::AddrFilter) -> Self {
        self.filter = filter;
        self
    }
}

impl Default for CallHomeConfig {
    fn default() -> Self {
        CallHomeConfig {
            max_pending: 16,
            max_header: 64 << 10,
            max_body: 256 << 20,
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 64,
            filter: crate::net::AddrFilter::default(),
        }
    }
}

/// A stream that said which answer it carries, and what was read past that.
type Arrived = (TcpStream, BytesMut);

/// A query waiting for its answer: the worker's address once dialled (only it may
/// call home with the answer), and where the answer's stream goes.
#[derive(Debug)]
struct Waiting {
    /// The query went out: its answer may come.
    sent: bool,
    tx: oneshot::Sender<Arrived>,
}

type Pending = Arc<Mutex<FastMap<String, Waiting>>>;

/// Whether a query has been sent and waits for its answer.
fn awaited(pending: &Pending) -> bool {
    pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .any(|w| w.sent)
}

/// The listener workers dial back with their answers, and the queries made through
/// it. While no query waits, every connection is closed at once; otherwise a
/// connection must name, within the handshake timeout, the subject of a query that
/// was sent (128 random bits, told only to the worker asked), or it is closed: nothing
/// is accepted that was not asked for. The subject, not the address, says whose
/// answer it is: a worker may call home from another of its addresses than the one it
/// was reached at (a multi-homed host, a gateway between networks).
#[derive(Debug)]
pub struct CallHomeListener {
    port: u16,
    pending: Pending,
    /// One per query from its start to its answer's end (`max_pending`).
    slots: Arc<tokio::sync::Semaphore>,
    config: CallHomeConfig,
    cancel: CancellationToken,
}

impl Drop for CallHomeListener {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl CallHomeListener {
    /// Listens on `addr` (port 0 for any).
    pub async fn bind(
        addr: SocketAddr,
        config: CallHomeConfig,
    ) -> std::io::Result<CallHomeListener> {
        let listener = TcpListener::bind(addr).await?;
        let port = listener.local_addr()?.port();
        let pending: Pending = Arc::default();
        let cancel = CancellationToken::new();
        let (p, c) = (pending.clone(), cancel.clone());
        let handshakes = Arc::new(tokio::sync::Semaphore::new(config.max_handshakes.max(1)));
        let (max_header, wait) = (config.max_header, config.handshake_timeout);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = c.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                // Only a worker a query is waiting on may call home, and only so many
                // at once may take their time to say which answer they carry.
                if !awaited(&p) {
                    continue;
                }
                let Ok(turn) = handshakes.clone().try_acquire_owned() else {
                    continue;
                };
                let p = p.clone();
                tokio::spawn(async move {
                    let _turn = turn;
                    let said = tokio::time::timeout(wait, hello(stream, max_header));
                    if let Ok(Ok((subject, arrived))) = said.await {
                        let mut pending = p.lock().unwrap_or_else(|e| e.into_inner());
                        let ours = pending.get(&subject).is_some_and(|w| w.sent);
                        if let Some(w) = ours.then(|| pending.remove(&subject)).flatten() {
                            let _ = w.tx.send(arrived);
                        }
                    }
                });
            }
        });
        Ok(CallHomeListener {
            port,
            pending,
            slots: Arc::new(tokio::sync::Semaphore::new(config.max_pending.max(1))),
            config,
            cancel,
        })
    }

    /// The largest answer body accepted.
    pub(crate) fn max_body(&self) -> usize {
        self.config.max_body
    }

    /// The port workers dial back (on the address they were reached from).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Asks `target` `query` and waits for its answer, all within `timeout`.
    pub async fn query(
        &self,
        target: &QueryTarget,
        query: &KvQuery,
        timeout: Duration,
    ) -> Result<KvAnswer, DynamoQueryError> {
        self.query_through(target, query, timeout, Some(&self.config.filter))
            .await
    }

    /// As [`query`](Self::query), dialling through `filter` instead of the
    /// listener's (`None`: any address).
    pub async fn query_through(
        &self,
        target: &QueryTarget,
        query: &KvQuery,
        timeout: Duration,
        filter: Option<&crate::net::AddrFilter>,
    ) -> Result<KvAnswer, DynamoQueryError> {
        // Held until the answer is read (the bound on answers in memory).
        let Ok(_slot) = self.slots.try_acquire() else {
            return Err(DynamoQueryError::Busy);
        };
        let subject = format!(
            "{:032x}",
            u128::from(crate::net::random_u64()) << 64 | u128::from(crate::net::random_u64())
        );
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(subject.clone(), Waiting { sent: false, tx });
        let mut stage = "connecting";
        let asked = tokio::time::timeout(
            timeout,
            self.ask(target, query, &subject, rx, filter, &mut stage),
        )
        .await;
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&subject);
        asked.map_err(|_| {
            tracing::debug!(worker = %target.address, stage, ?timeout, "Dynamo recovery query timed out");
            DynamoQueryError::Timeout(timeout)
        })?
    }

    async fn ask(
        &self,
        target: &QueryTarget,
        query: &KvQuery,
        subject: &str,
        rx: oneshot::Receiver<Arrived>,
        filter: Option<&crate::net::AddrFilter>,
        stage: &mut &'static str,
    ) -> Result<KvAnswer, DynamoQueryError> {
        let endpoint = format!("tcp://{}", target.address);
        let zmtp = crate::zmtp::Config::default();
        let mut stream = match filter {
            Some(filter) => crate::zmtp::dial_filtered(&endpoint, &zmtp, filter)
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?,
            None => TcpStream::connect(&target.address).await?,
        };
        let _ = stream.set_nodelay(true);
        if let Some(w) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(subject)
        {
            w.sent = true;
        }
        // The worker dials back the address it reached us from.
        let local = stream.local_addr()?;
        let home = CallHome::new(SocketAddr::new(local.ip(), self.port), subject);
        let control = Control::kv_query(subject, target.codec, &home);
        let body = query.encode(target.codec)?;
        let headers = serde_json::json!({
            "request-id": subject,
            "x-endpoint-path": target.path,
        })
        .to_string();
        let payload = encode_two_part(&control.encode(), &body);
        *stage = "sending the query";
        stream
            .write_all(&encode_request(&target.path, headers.as_bytes(), &payload)?)
            .await?;
        let mut ack = [0u8; 4];
        *stage = "waiting for the acknowledgement";
        stream.read_exact(&mut ack).await?;
        if ack != super::frame::ACK {
            return Err(DynamoQueryError::Refused(
                "the request was not acknowledged".into(),
            ));
        }
        *stage = "waiting for the worker to call home";
        let (answers, buf) = rx
            .await
            .map_err(|_| DynamoQueryError::Refused("the answer's stream never came".into()))?;
        *stage = "reading the answer";
        read_answer(answers, buf, &self.config, target.codec).await
    }
}

/// Reads the first message of a connection a worker opened: which answer it carries.
async fn hello(
    mut stream: TcpStream,
    max_header: usize,
) -> Result<(String, Arrived), DynamoQueryError> {
    let mut buf = BytesMut::with_capacity(1024);
    let first = next_message(&mut stream, &mut buf, max_header, 0).await?;
    let hello: serde_json::Value =
        serde_json::from_slice(&first.header).map_err(|e| QueryError::Undecodable {
            what: "answer stream header",
            detail: e.to_string(),
        })?;
    let subject = hello
        .get("subject")
        .and_then(serde_json::Value::as_str)
        .ok_or(DynamoQueryError::Refused("no subject".into()))?
        .to_owned();
    Ok((subject, (stream, buf)))
}

async fn next_message(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    max_header: usize,
    max_body: usize,
) -> Result<TwoPart, DynamoQueryError> {
    loop {
        if let Some(m) = decode_two_part(buf, max_header, max_body)? {
            return Ok(m);
        }
        if stream.read_buf(buf).await? == 0 {
            return Err(DynamoQueryError::Io(
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
    }
}

/// Reads an answer's stream after its hello: the prologue (`{"error": null}`), the
/// answer's body, the final body.
async fn read_answer(
    mut stream: TcpStream,
    mut buf: BytesMut,
    config: &CallHomeConfig,
    codec: Codec,
) -> Result<KvAnswer, DynamoQueryError> {
    let prologue = next_message(&mut stream, &mut buf, config.max_header, 0).await?;
    let prologue: serde_json::Value =
        serde_json::from_slice(&prologue.header).map_err(|e| QueryError::Undecodable {
            what: "answer prologue",
            detail: e.to_string(),
        })?;
    if let Some(error) = prologue.get("error").filter(|e| !e.is_null()) {
        return Err(DynamoQueryError::Refused(
            error.to_string().chars().take(256).collect(),
        ));
    }
    let mut answer = None;
    loop {
        let m = next_message(&mut stream, &mut buf, config.max_header, config.max_body).await?;
        if m.body.is_empty() {
            // A header alone: the sentinel, or something this version does not know.
            break;
        }
        match AnswerBody::decode(&m.body, codec)? {
            AnswerBody::Answer(a) if answer.is_none() => answer = Some(a),
            AnswerBody::Answer(_) => {
                return Err(DynamoQueryError::Refused("more than one answer".into()));
            }
            AnswerBody::Final => break,
        }
    }
    answer.ok_or(DynamoQueryError::Refused("a stream with no answer".into()))
}
