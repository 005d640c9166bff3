//! `SubSocket`: one subscriber connection over any byte stream.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::endpoint;
use super::io::Conn;
use super::retain::Retention;
use super::{Config, Error, Event, Message, PeerInfo, SessionStats, SocketType, TimeoutKind};

/// [`SubSocket::recv_many`] returns once its batch holds this many bytes, however
/// many messages `max` allows: a batch of large messages is not charged anywhere
/// until the caller stores it, so it must stay small.
pub(crate) const RECV_MANY_BYTES: usize = 1 << 20;

/// A ZMQ SUB connected to one publisher.
///
/// Works over TCP ([`connect`](Self::connect)) or any `AsyncRead + AsyncWrite` stream
/// ([`handshake`](Self::handshake)): a tunnel, a TLS stream, an in-memory duplex.
/// There is no automatic reconnect: when a call fails the socket is dead, and the
/// owner (for example `DynamicSubscriber`) decides whether to dial again.
///
/// # Memory
/// Frames are handed out as zero-copy slices of the socket's read buffer, so a
/// message kept alive keeps its read buffer alive (a 64 KiB chunk, or for a frame
/// larger than a chunk an allocation of about the frame's size). The socket counts
/// the read buffers that messages still reference after it moved on
/// ([`SubBuffers::retained`]); above [`Config::max_retained_bytes`] (default 8 MiB)
/// it copies every frame of up to `read_chunk` bytes into an allocation of its own
/// size instead, until enough of the old messages are gone. A consumer that keeps up
/// never pays for a copy; one that hoards messages holds at most their size plus
/// `max_retained_bytes` plus the current read buffer.
///
/// A read buffer starts at 1 KiB and doubles with every read that fills it, up to
/// `read_chunk`. Sockets that share one account (a `DynamicSubscriber`'s connections)
/// also count their current read buffers together, and each gives its buffer back
/// (keeping only an unfinished frame's bytes) whenever its peer has nothing more to
/// read, starting over at 1 KiB: thousands of mostly idle connections cost what the
/// few being read at once hold. A socket of its own gives its buffer back after every
/// receive while its read buffers add up to more than `max_retained_bytes`.
///
/// Output toward the publisher (subscriptions, PONGs) is bounded the same way as a
/// publisher's: at most one unsent PONG, reading pauses while a full write batch is
/// stuck, and a publisher that reads nothing for `write_stall_timeout` is dropped.
///
/// # Cancel safety
/// [`recv`](Self::recv) and [`recv_many`](Self::recv_many) are cancel-safe: all state
/// lives in the socket, so dropping the future (e.g. in `select!`) loses no message.
/// [`subscribe`](Self::subscribe) is cancel-safe too: the subscription is recorded
/// before any I/O and is sent by the next call that writes.
///
/// Over TCP:
/// ```no_run
/// use eventplane::zmtp::{Config, SubSocket};
/// # async fn run() -> Result<(), eventplane::zmtp::Error> {
/// let mut sub = SubSocket::connect("tcp://127.0.0.1:5555", Config::default()).await?;
/// sub.subscribe("kv-events").await?;
/// loop {
///     let msg = sub.recv().await?;
///     println!("{} frames", msg.len());
/// }
/// # }
/// ```
///
/// Over any stream, here an in-memory pipe to a [`PubSocket`](super::PubSocket):
/// ```
/// use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::zmtp::Error> {
/// let publisher = PubSocket::new(Config::default());
/// let (a, b) = tokio::io::duplex(64 << 10);
/// publisher.accept_stream(a, "in-memory");
/// let mut sub = SubSocket::handshake(b, Config::default()).await?;
/// sub.subscribe("kv").await?;
/// publisher.wait_for_subscribers(1).await;
/// publisher.send(Message::from_parts(["kv-events", "hello"]));
/// let msg = sub.recv().await?;
/// assert_eq!(msg.get(1).unwrap(), b"hello");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SubSocket<S = TcpStream> {
    conn: Conn<S>,
    retention: Arc<Retention>,
    pending_error: Option<Error>,
    /// Give the read buffer back whenever the peer has nothing more to read (a
    /// connection among thousands sharing one account, most of them idle).
    release_when_idle: bool,
}

/// Memory a [`SubSocket`] holds for its connection, from [`SubSocket::buffers`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::zmtp::Error> {
/// use eventplane::zmtp::{Config, PubSocket, SubSocket};
/// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
/// let sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
/// let buffers = sub.buffers();
/// assert!(buffers.read_buffer <= Config::default().read_chunk());
/// assert_eq!((buffers.retained, buffers.copied_messages), (0, 0));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SubBuffers {
    /// Size of the current read buffer's allocation.
    pub read_buffer: usize,
    /// Earlier read buffers that messages handed out still keep alive (shared by
    /// every connection of a `DynamicSubscriber`).
    pub retained: usize,
    /// Bytes waiting to be written to the publisher.
    pub pending_output: usize,
    /// Messages copied out of the read buffer because `retained` exceeded
    /// [`Config::max_retained_bytes`].
    pub copied_messages: u64,
}

impl SubSocket<TcpStream> {
    /// Connects to `tcp://host:port` (within `connect_timeout`, trying each resolved
    /// address) and performs the handshake (within `handshake_timeout`).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let endpoint = publisher.local_endpoint().unwrap_or_default();
    /// let sub = SubSocket::connect(endpoint, Config::default()).await?; // greeting + READY done
    /// assert!(sub.peer().is_some());
    /// # Ok(()) }
    /// ```
    pub async fn connect(endpoint: &str, config: Config) -> Result<Self, Error> {
        let stream = connect_tcp(endpoint, &config).await?;
        Self::handshake(stream, config).await
    }

    /// [`connect`](Self::connect), dialling only the resolved addresses `filter`
    /// accepts: the check sits between resolving and connecting, so a name that
    /// resolves somewhere it must not (DNS rebinding to a metadata address, say) is
    /// never dialled. [`Error::Refused`] when it refuses them all.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use eventplane::net::AddrFilter;
    /// use eventplane::zmtp::{Config, Error, SubSocket};
    /// let strict = AddrFilter::strict(); // refuses loopback too
    /// let err = SubSocket::connect_filtered("tcp://127.0.0.1:5555", Config::default(), &strict)
    ///     .await
    ///     .unwrap_err();
    /// assert!(matches!(err, Error::Refused { .. }));
    /// # }
    /// ```
    pub async fn connect_filtered(
        endpoint: &str,
        config: Config,
        filter: &crate::net::AddrFilter,
    ) -> Result<Self, Error> {
        let stream = dial_filtered(endpoint, &config, filter).await?;
        let retention = Arc::new(Retention::new(config.max_retained_bytes));
        Self::handshake_with(stream, config, retention, false).await
    }
}

/// Resolves `endpoint`, refuses it when the filter allows none of its addresses, and
/// dials the allowed ones (a connection before any handshake).
pub(crate) async fn dial_filtered(
    endpoint: &str,
    config: &Config,
    filter: &crate::net::AddrFilter,
) -> Result<TcpStream, Error> {
    {
        let addrs = endpoint::resolve(endpoint, config.connect_timeout).await?;
        let allowed: Vec<std::net::SocketAddr> = addrs
            .iter()
            .copied()
            .filter(|a| filter.check_socket(*a).is_ok())
            .collect();
        if allowed.is_empty() {
            let addr = addrs
                .first()
                .copied()
                .ok_or_else(|| Error::from(std::io::Error::from(std::io::ErrorKind::NotFound)))?;
            return Err(Error::Refused { addr });
        }
        dial(&allowed, config).await
    }
}

/// Dials `endpoint` with the configured connect timeout and sets `TCP_NODELAY`.
pub(crate) async fn connect_tcp(endpoint: &str, config: &Config) -> Result<TcpStream, Error> {
    let addrs = endpoint::resolve(endpoint, config.connect_timeout).await?;
    dial(&addrs, config).await
}

/// Tries each address in turn within the connect timeout; sets `TCP_NODELAY`.
pub(crate) async fn dial(
    addrs: &[std::net::SocketAddr],
    config: &Config,
) -> Result<TcpStream, Error> {
    let dial = async {
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect(*addr).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()))
    };
    let stream = tokio::time::timeout(config.connect_timeout, dial)
        .await
        .map_err(|_| Error::Timeout(TimeoutKind::Connect))?
        .inspect_err(|e| tracing::debug!(?addrs, error = %e, "tcp connect failed"))?;
    stream.set_nodelay(true)?;
    tracing::debug!(peer = ?stream.peer_addr().ok(), "tcp connected; zmtp handshake next");
    Ok(stream)
}

impl<S> SubSocket<S>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Performs the ZMTP handshake as a SUB over `stream`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
    /// // Any byte stream: here an in-memory pipe, in production a tunnel or TLS stream.
    /// let (near, far) = tokio::io::duplex(64 << 10);
    /// let publisher = PubSocket::new(Config::default());
    /// publisher.accept_stream(far, "in-memory");
    /// let mut sub = SubSocket::handshake(near, Config::default()).await?;
    /// sub.subscribe("t").await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.send(Message::from_parts(["t", "hello"]));
    /// assert_eq!(sub.recv().await?.get(1), Some(&b"hello"[..]));
    /// # Ok(()) }
    /// ```
    pub async fn handshake(stream: S, config: Config) -> Result<Self, Error> {
        let retention = Arc::new(Retention::new(config.max_retained_bytes));
        Self::handshake_with(stream, config, retention, false).await
    }

    /// [`handshake`](Self::handshake), counting retained read buffers in an account
    /// shared with other sockets (a `DynamicSubscriber`'s connections share one). Such
    /// a socket gives its read buffer back whenever its peer has nothing more to read:
    /// of thousands of connections, only the few being read at once hold one.
    pub(crate) async fn handshake_sharing(
        stream: S,
        config: Config,
        retention: Arc<Retention>,
    ) -> Result<Self, Error> {
        Self::handshake_with(stream, config, retention, true).await
    }

    async fn handshake_with(
        stream: S,
        config: Config,
        retention: Arc<Retention>,
        release_when_idle: bool,
    ) -> Result<Self, Error> {
        Self::handshake_as(
            SocketType::Sub,
            stream,
            config,
            retention,
            release_when_idle,
        )
        .await
    }

    /// The handshake as `socket_type`: a [`DealerSocket`](super::DealerSocket) is this
    /// receive loop (unfiltered) with a way to send.
    pub(crate) async fn handshake_as(
        socket_type: SocketType,
        stream: S,
        config: Config,
        retention: Arc<Retention>,
        release_when_idle: bool,
    ) -> Result<Self, Error> {
        let mut conn = Conn::new(stream, socket_type, &config, Some(retention.clone()));
        poll_fn(|cx| conn.poll_handshake(cx)).await?;
        tracing::debug!(peer = ?conn.session.peer(), ?socket_type, "zmtp handshake complete");
        Ok(SubSocket {
            conn,
            retention,
            pending_error: None,
            release_when_idle,
        })
    }

    /// What the publisher told us in its greeting and READY.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.conn.session.peer()
    }

    /// Counters of this connection.
    pub fn stats(&self) -> SessionStats {
        self.conn.session.stats()
    }

    /// The memory this connection holds (see [Memory](Self#memory)).
    pub fn buffers(&self) -> SubBuffers {
        self.retention.prune();
        SubBuffers {
            read_buffer: self.conn.read_buffer_allocation(),
            retained: self.retention.retained(),
            pending_output: self.conn.pending_output(),
            copied_messages: self.retention.copied(),
        }
    }

    /// Subscribes to messages whose first frame starts with `prefix` (`""` for all).
    /// Subscriptions are reference-counted; only the first of a prefix goes on the
    /// wire.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("kv").await?; // prefix match: "kv" and "kv-events", not "k"
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.send(Message::from_parts(["other", "x"]));
    /// publisher.send(Message::from_parts(["kv-events", "y"]));
    /// assert_eq!(sub.recv().await?.get(0).unwrap(), b"kv-events");
    /// # Ok(()) }
    /// ```
    pub async fn subscribe(&mut self, prefix: impl Into<Bytes>) -> Result<(), Error> {
        self.conn.session.subscribe(prefix.into());
        self.flush().await
    }

    /// Drops one reference to `prefix`; the last one cancels it at the publisher.
    /// Messages already in flight are still filtered out locally.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("a").await?;
    /// sub.subscribe("a").await?; // counted twice…
    /// sub.unsubscribe("a").await?; // …so still subscribed once
    /// # Ok(()) }
    /// ```
    pub async fn unsubscribe(&mut self, prefix: impl AsRef<[u8]>) -> Result<(), Error> {
        self.conn.session.unsubscribe(prefix.as_ref());
        self.flush().await
    }

    async fn flush(&mut self) -> Result<(), Error> {
        poll_fn(|cx| self.conn.poll_write_out(cx)).await
    }

    /// Queues `msg` for the peer and writes it out (a DEALER's request). A socket that
    /// already failed returns its error.
    pub(crate) async fn send_message(&mut self, msg: &Message) -> Result<(), Error> {
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        if !self.conn.session.send_message(msg) {
            return Err(Error::SocketClosed);
        }
        self.flush().await
    }

    /// Receives the next message that matches a subscription.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use std::time::Duration;
    /// use eventplane::zmtp::{Config, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("").await?;
    /// // Cancel-safe: a timeout (or a `select!` branch losing) loses no message.
    /// assert!(tokio::time::timeout(Duration::from_millis(10), sub.recv()).await.is_err());
    /// # Ok(()) }
    /// ```
    pub async fn recv(&mut self) -> Result<Message, Error> {
        poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Waits for at least one message, then appends every message already received
    /// (up to `max`, and until the batch holds 1 MiB) to `out` without
    /// further waiting. Returns how many were added.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("").await?;
    /// publisher.wait_for_subscribers(1).await;
    /// for i in 0..3u8 { publisher.send(Message::from_parts([vec![i]])); }
    /// let mut batch = Vec::new();
    /// while batch.len() < 3 {
    ///     sub.recv_many(&mut batch, 64).await?; // at least one, at most 64 per call
    /// }
    /// assert_eq!(batch.len(), 3);
    /// # Ok(()) }
    /// ```
    pub async fn recv_many(&mut self, out: &mut Vec<Message>, max: usize) -> Result<usize, Error> {
        poll_fn(|cx| self.poll_recv_many(cx, out, max)).await
    }

    /// Waits for at least one message, then hands every message already received (up
    /// to `max`, and until they hold 1 MiB) to `f`, in order, without
    /// further waiting. Returns how many it handed over.
    ///
    /// The batch form for a consumer that files each message somewhere of its own (a
    /// queue, a parser, a lane of a `DynamicSubscriber`): nothing is collected in
    /// between. Cancel-safe like [`recv_many`](Self::recv_many): a message is either
    /// handed to `f` or still in the socket.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("").await?;
    /// publisher.wait_for_subscribers(1).await;
    /// for i in 1..=3u8 { publisher.send(Message::from_parts([vec![i]])); }
    /// let (mut seen, mut sum) = (0, 0u32);
    /// while seen < 3 {
    ///     seen += sub.recv_with(64, |m| sum += m.get(0).map_or(0, |f| u32::from(f[0]))).await?;
    /// }
    /// assert_eq!(sum, 6);
    /// # Ok(()) }
    /// ```
    pub async fn recv_with<F: FnMut(Message)>(
        &mut self,
        max: usize,
        mut f: F,
    ) -> Result<usize, Error> {
        poll_fn(|cx| self.poll_recv_with(cx, max, &mut f)).await
    }

    /// Poll form of [`recv_with`](Self::recv_with).
    pub fn poll_recv_with<F: FnMut(Message)>(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        f: &mut F,
    ) -> Poll<Result<usize, Error>> {
        let max = max.max(1);
        let mut got = 0;
        let mut bytes = 0;
        self.poll_inner(cx, &mut |m| {
            bytes += m.byte_len();
            f(m);
            got += 1;
            got < max && bytes < RECV_MANY_BYTES
        })
        .map(|r| r.map(|_| got))
    }

    /// Poll form of [`recv`](Self::recv).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message, Error>> {
        let mut one = None;
        self.poll_inner(cx, &mut |m| {
            one = Some(m);
            false
        })
        .map(|r| r.and_then(|_| one.ok_or(Error::SocketClosed)))
    }

    /// Poll form of [`recv_many`](Self::recv_many).
    pub fn poll_recv_many(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut Vec<Message>,
        max: usize,
    ) -> Poll<Result<usize, Error>> {
        self.poll_recv_with(cx, max, &mut |m| out.push(m))
    }

    /// Decodes messages into `sink` until it returns `false` or input runs dry after
    /// at least one message. Errors seen after a message was delivered are kept for the
    /// next call, so no delivered message is lost to a later failure. Between calls,
    /// a socket whose account holds too many read buffers gives its own back.
    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
        sink: &mut dyn FnMut(Message) -> bool,
    ) -> Poll<Result<(), Error>> {
        let result = self.poll_pass(cx, sink);
        if (self.release_when_idle && result.is_pending()) || self.retention.reads_over_limit() {
            self.conn.release_read_buffer();
        }
        result
    }

    fn poll_pass(
        &mut self,
        cx: &mut Context<'_>,
        sink: &mut dyn FnMut(Message) -> bool,
    ) -> Poll<Result<(), Error>> {
        let mut delivered = false;
        if self.pending_error.is_some() {
            // The connection already failed: hand out what was received before the
            // failure, then the error.
            loop {
                match self.conn.session.poll_event() {
                    Ok(Some(Event::Message(m))) => {
                        delivered = true;
                        if !sink(m) {
                            return Poll::Ready(Ok(()));
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            return match self.pending_error.take() {
                Some(e) if !delivered => Poll::Ready(Err(e)),
                Some(e) => {
                    self.pending_error = Some(e);
                    Poll::Ready(Ok(()))
                }
                None => Poll::Ready(Err(Error::SocketClosed)),
            };
        }
        let read_chunk = self.conn.read_chunk();
        let result = loop {
            if let Err(e) = self.conn.poll_timers(cx) {
                break Err(e);
            }
            let copy = self.retention.over_limit();
            let retention = &self.retention;
            let drained = self.conn.session.poll_messages(|mut m| {
                delivered = true;
                if copy && m.compact(read_chunk) {
                    retention.note_copied();
                }
                sink(m)
            });
            let more = match drained {
                Ok(more) => more,
                Err(e) => return self.finish(delivered, Err(e)),
            };
            if let Poll::Ready(Err(e)) = self.conn.poll_flush(cx) {
                break Err(e);
            }
            if !more {
                break Ok(());
            }
            if !self.conn.may_read() {
                // A full write batch waits for the publisher to read; the flush above
                // registered for write readiness (and the stall timer is armed).
                if delivered {
                    break Ok(());
                }
                return Poll::Pending;
            }
            match self.conn.poll_read(cx) {
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => break Err(e),
                Poll::Pending if delivered => break Ok(()),
                Poll::Pending => return Poll::Pending,
            }
        };
        self.finish(delivered, result)
    }

    fn finish(&mut self, delivered: bool, result: Result<(), Error>) -> Poll<Result<(), Error>> {
        match result {
            Err(e) if delivered => {
                self.pending_error = Some(e);
                Poll::Ready(Ok(()))
            }
            other => Poll::Ready(other),
        }
    }

    #[cfg(test)]
    pub(crate) fn input_capacity(&self) -> usize {
        self.conn.read_buffer_allocation()
    }

    /// The underlying stream (for example to read its peer address).
    pub fn get_ref(&self) -> &S {
        &self.conn.stream
    }
}
