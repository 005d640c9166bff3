//! The thin I/O layer under the sessions: HTTP/2 bodies fed from bounded channels,
//! a byte stream over a data stream's two bodies, TLS configuration, and the bearer
//! credential.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use hyper::body::Incoming;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::{CancellationToken, PollSender, WaitForCancellationFutureOwned};

use crate::tunnel::RelayBudget;
use crate::tunnel::error::TunnelError;

/// Chunks a body channel holds at most (its bytes are bounded by the relay budget or
/// by the writer's own pacing).
pub(crate) const BODY_CHANNEL: usize = 64;

/// Chunks (each at most 64 KiB) a [`TunnelStream`] queues toward the publisher before
/// its writes wait: 256 KiB per stream here, plus the chunk hyper holds while it waits
/// for the broker's 64 KiB stream window.
pub(crate) const TUNNEL_WRITE_CHUNKS: usize = 4;

/// An HTTP/2 body whose chunks come from a bounded channel; it ends when every sender
/// is gone, and fails (resetting the stream) on an `Err` item.
pub(crate) struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, io::Error>>,
    /// Ends the body with an error (resetting the stream) when cancelled.
    ended: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
}

impl ChannelBody {
    pub(crate) fn new(rx: mpsc::Receiver<Result<Bytes, io::Error>>) -> ChannelBody {
        ChannelBody { rx, ended: None }
    }

    /// Resets the stream when `ended` is cancelled: as a data stream's response body,
    /// that ends both directions (the request body the router reads fails too).
    pub(crate) fn until(mut self, ended: CancellationToken) -> ChannelBody {
        self.ended = Some(Box::pin(ended.cancelled_owned()));
        self
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(ended) = self.ended.as_mut() {
            if ended.as_mut().poll(cx).is_ready() {
                self.ended = None;
                self.rx.close();
                return Poll::Ready(Some(Err(session_ended())));
            }
        }
        match ready!(self.rx.poll_recv(cx)) {
            Some(Ok(chunk)) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            None => Poll::Ready(None),
        }
    }
}

/// A relayed stream's chunks toward the router, between the relay and hyper. The
/// relay can fail it, which drops what it holds at once (hyper may not poll the body
/// again for as long as the router reads nothing): what the budget stops charging is
/// freed, not left queued.
#[derive(Debug, Default)]
struct Queue {
    chunks: std::collections::VecDeque<Bytes>,
    failed: Option<io::Error>,
    /// The relay let go: the body ends once the chunks are taken.
    done: bool,
    /// Hyper let go of the body (the stream ended).
    gone: bool,
    waker: Option<std::task::Waker>,
}

/// The relay's end of a [`Queue`] (its drop ends the body).
#[derive(Debug)]
pub(crate) struct RelayQueue(Arc<Mutex<Queue>>);

impl RelayQueue {
    fn with<R>(&self, f: impl FnOnce(&mut Queue) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Queues `chunk` (charged by the caller); `false` once hyper let go.
    pub(crate) fn push(&self, chunk: Bytes) -> bool {
        self.with(|q| {
            if q.gone || q.failed.is_some() {
                return false;
            }
            q.chunks.push_back(chunk);
            if let Some(w) = q.waker.take() {
                w.wake();
            }
            true
        })
    }

    /// Fails the body with `error` (hyper resets the stream) and drops every chunk
    /// still queued.
    pub(crate) fn fail(&self, error: io::Error) {
        let dropped = self.with(|q| {
            q.failed = Some(error);
            if let Some(w) = q.waker.take() {
                w.wake();
            }
            std::mem::take(&mut q.chunks)
        });
        drop(dropped);
    }

    /// Whether hyper let go of the body (the router ended the stream).
    pub(crate) fn is_closed(&self) -> bool {
        self.with(|q| q.gone)
    }
}

impl Drop for RelayQueue {
    fn drop(&mut self) {
        self.with(|q| {
            q.done = true;
            if let Some(w) = q.waker.take() {
                w.wake();
            }
        });
    }
}

/// Hyper's end of a [`Queue`]: the data stream's request body. It gives each chunk's
/// budget back as hyper takes it, and closes the stream's budget when dropped.
pub(crate) struct QueueBody {
    queue: Arc<Mutex<Queue>>,
    budget: Arc<Mutex<RelayBudget>>,
    stream: u64,
    /// Told when hyper first asks for data: the HTTP/2 stream is open and may send.
    started: Option<oneshot::Sender<()>>,
}

/// A relayed stream's queue: the relay's end, and the body hyper sends (charged
/// against `budget` as `stream`; `started` told when hyper first polls it: for a
/// request, hyper has handed the stream to h2 — h2 holds a request back while the
/// peer's concurrency limit is reached, though a burst in one poll may get past that
/// check; the broker's own slot permits bound the rest).
pub(crate) fn relay_queue(
    budget: Arc<Mutex<RelayBudget>>,
    stream: u64,
    started: oneshot::Sender<()>,
) -> (RelayQueue, QueueBody) {
    let queue = Arc::new(Mutex::new(Queue::default()));
    (
        RelayQueue(queue.clone()),
        QueueBody {
            queue,
            budget,
            stream,
            started: Some(started),
        },
    )
}

impl Body for QueueBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(started) = self.started.take() {
            let _ = started.send(());
        }
        let next = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(e) = q.failed.take() {
                q.done = true;
                Some(Err(e))
            } else if let Some(chunk) = q.chunks.pop_front() {
                Some(Ok(chunk))
            } else if q.done {
                return Poll::Ready(None);
            } else {
                q.waker = Some(cx.waker().clone());
                None
            }
        };
        match next {
            Some(Ok(chunk)) => {
                self.budget
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .release(self.stream, chunk.len());
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            None => Poll::Pending,
        }
    }
}

/// What a broker sends the bus: the session's control frames, or a relayed stream.
pub(crate) enum BrokerBody {
    Control(ChannelBody),
    Relay(QueueBody),
}

impl Body for BrokerBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            BrokerBody::Control(b) => Pin::new(b).poll_frame(cx),
            BrokerBody::Relay(b) => Pin::new(b).poll_frame(cx),
        }
    }
}

impl Drop for QueueBody {
    fn drop(&mut self) {
        let dropped = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.gone = true;
            std::mem::take(&mut q.chunks)
        };
        drop(dropped);
        self.budget
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .close(self.stream);
    }
}

/// The error a data stream ends with when its session ended.
fn session_ended() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the broker session ended")
}

/// The next data chunk of an incoming body (trailers skipped); `None` at its end.
pub(crate) async fn next_chunk(body: &mut Incoming) -> Option<Result<Bytes, hyper::Error>> {
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await?;
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    return Some(Ok(data));
                }
            }
            Err(e) => return Some(Err(e)),
        }
    }
}

/// Bytes through the tunnel streams of one bus.
#[derive(Debug, Default)]
pub(crate) struct StreamBytes {
    pub(crate) read: AtomicU64,
    pub(crate) written: AtomicU64,
}

/// A publisher connection through the tunnel, as the router sees it: bytes from the
/// publisher arrive in the data stream's request body, bytes to it go out in its
/// response body. A `SubSocket` runs ZMTP over it exactly as over TCP.
pub struct TunnelStream {
    incoming: Incoming,
    pending: Bytes,
    outgoing: PollSender<Result<Bytes, io::Error>>,
    bytes: Arc<StreamBytes>,
    /// Tells the session the router let go (it unsubscribes: the broker closes the
    /// publisher connection silently).
    on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

impl std::fmt::Debug for TunnelStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelStream")
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl TunnelStream {
    pub(crate) fn new(
        incoming: Incoming,
        outgoing: mpsc::Sender<Result<Bytes, io::Error>>,
        bytes: Arc<StreamBytes>,
        on_drop: Box<dyn FnOnce() + Send + Sync>,
    ) -> TunnelStream {
        TunnelStream {
            incoming,
            pending: Bytes::new(),
            outgoing: PollSender::new(outgoing),
            bytes,
            on_drop: Some(on_drop),
        }
    }
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            match ready!(Pin::new(&mut self.incoming).poll_frame(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.bytes
                            .read
                            .fetch_add(data.len() as u64, Ordering::Relaxed);
                        self.pending = data;
                    }
                }
            }
        }
        let n = self.pending.len().min(buf.remaining());
        buf.put_slice(self.pending.get(..n).unwrap_or_default());
        self.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if ready!(self.outgoing.poll_reserve(cx)).is_err() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(64 << 10);
        let chunk = Bytes::copy_from_slice(buf.get(..n).unwrap_or_default());
        match self.outgoing.send_item(Ok(chunk)) {
            Ok(()) => {
                self.bytes.written.fetch_add(n as u64, Ordering::Relaxed);
                Poll::Ready(Ok(n))
            }
            Err(_) => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.outgoing.close();
        Poll::Ready(Ok(()))
    }
}

/// Shortest token [`Secret::new`] takes, in bytes: a bus keeps unsalted digests and
/// answers guesses, so a token must not be guessable (use 32 random bytes or more).
pub(crate) const MIN_TOKEN_LEN: usize = 16;

/// A bearer credential: never printed (its `Debug` is redacted, its header marked
/// sensitive). A bus keeps only its digest ([`TokenDigest`](crate::tunnel::TokenDigest)).
#[derive(Clone)]
pub struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A credential (surrounding whitespace, such as a file's final newline, removed).
    /// It travels in an HTTP header, so it must be printable ASCII without spaces (a
    /// byte-order mark or a non-ASCII character is refused here, not sent as a bare
    /// `Bearer`), and holds at least 16 bytes.
    ///
    /// ```
    /// use eventplane::tunnel::Secret;
    /// assert!(Secret::new("s3cret-token-0123456789\n").is_ok());
    /// assert!(Secret::new("\u{feff}s3cret-token-0123456789").is_err());
    /// assert!(Secret::new("two words and some more").is_err());
    /// assert!(Secret::new("").is_err());
    /// assert!(Secret::new("too-short-token").is_err()); // 15 bytes
    /// assert!(Secret::new("just-long-enough").is_ok()); // 16
    /// ```
    pub fn new(token: impl AsRef<str>) -> Result<Secret, TunnelError> {
        let token = token.as_ref().trim();
        let refuse = |reason: &str| {
            Err(TunnelError::Config {
                field: "token",
                reason: reason.into(),
            })
        };
        if token.is_empty() {
            return refuse("is empty");
        }
        if token.len() < MIN_TOKEN_LEN {
            return refuse(
                "is under 16 bytes: use a random token of 32 bytes or more \
                 (`openssl rand -hex 32`)",
            );
        }
        if token.len() > 4096 {
            return refuse("is over 4096 bytes");
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return refuse(
                "must be printable ASCII without spaces (a byte-order mark or a non-ASCII \
                 character cannot travel in an HTTP header)",
            );
        }
        Ok(Secret(token.into()))
    }

    /// The token itself (for digests; never logged).
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The credential in `path` (a file holding just the token).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Secret, TunnelError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| TunnelError::Config {
            field: "token_file",
            reason: format!("{}: {e}", path.display()),
        })?;
        Secret::new(text)
    }

    /// The `Authorization` header value, marked sensitive (never indexed by HPACK,
    /// redacted from its `Debug`).
    pub(crate) fn header_value(&self) -> hyper::header::HeaderValue {
        // `new` admits only visible ASCII, so this never falls back.
        let mut value = hyper::header::HeaderValue::from_str(&format!("Bearer {}", self.0))
            .unwrap_or_else(|_| hyper::header::HeaderValue::from_static("Bearer"));
        value.set_sensitive(true);
        value
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem_error(what: &'static str, path: &Path, e: impl std::fmt::Display) -> TunnelError {
    TunnelError::Config {
        field: what,
        reason: format!("{}: {e}", path.display()),
    }
}

/// Every certificate of a PEM file (read with rustls' own PEM reader).
fn read_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TunnelError> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(what, path, e))
}

/// The TLS configuration of an event bus: its certificate chain and private key, in
/// PEM files; HTTP/2 only.
pub fn server_tls(
    cert_pem: impl AsRef<Path>,
    key_pem: impl AsRef<Path>,
) -> Result<Arc<rustls::ServerConfig>, TunnelError> {
    let (cert_pem, key_pem) = (cert_pem.as_ref(), key_pem.as_ref());
    let certs = read_certs("cert", cert_pem)?;
    if certs.is_empty() {
        return Err(pem_error("cert", cert_pem, "no certificate in the file"));
    }
    let key = match PrivateKeyDer::from_pem_file(key_pem) {
        Ok(key) => key,
        Err(pem::Error::NoItemsFound) => {
            return Err(pem_error("key", key_pem, "no private key in the file"));
        }
        Err(e) => return Err(pem_error("key", key_pem, e)),
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TunnelError::Tls)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TunnelError::Tls)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The TLS configuration of a broker: the CA bundle (PEM) its bus certificate must
/// chain to; HTTP/2 only.
pub fn client_tls(ca_pem: impl AsRef<Path>) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
    let ca_pem = ca_pem.as_ref();
    let mut roots = rustls::RootCertStore::empty();
    let certs = read_certs("ca_file", ca_pem)?;
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| pem_error("ca_file", ca_pem, e))?;
    }
    if roots.is_empty() {
        return Err(pem_error(
            "ca_file",
            ca_pem,
            "no CA certificate in the file",
        ));
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TunnelError::Tls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod pem_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tunnel")
            .join(name)
    }

    #[test]
    fn pem_files_are_read_and_their_failures_named() {
        assert!(server_tls(fixture("bus.pem"), fixture("bus.key")).is_ok());
        assert!(client_tls(fixture("ca.pem")).is_ok());
        let dir = std::env::temp_dir().join(format!("eventplane-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "nothing here\n").unwrap();
        fn why<T>(r: Result<T, TunnelError>) -> String {
            r.err().map(|e| e.to_string()).unwrap_or_default()
        }
        assert!(why(server_tls(&empty, fixture("bus.key"))).contains("no certificate"));
        assert!(why(server_tls(fixture("bus.pem"), &empty)).contains("no private key"));
        assert!(why(client_tls(&empty)).contains("no CA certificate"));
        let missing = dir.join("missing.pem");
        assert!(why(client_tls(&missing)).contains("missing.pem"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
