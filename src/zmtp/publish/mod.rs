//! `PubSocket`: fan-out to many subscribers, each with its own bounded queue. This
//! file holds the public API and its stats; `fanout` the synchronous core (the peer
//! table, the prefix index, the queues); `task` the per-subscriber connection tasks.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::Duration;

use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::endpoint;
use super::{Config, Error, Message};
use crate::net::RateLimitedWarn;

/// A ZMQ PUB: accepts any number of subscribers and fans each message out to those
/// whose subscriptions match its first frame.
///
/// [`send`](Self::send) never blocks and never fails because a subscriber is slow:
/// the message is encoded once, into a 64 KiB chunk shared by every subscriber it is
/// queued for (a message over 8 KiB gets an allocation of its own). A subscriber's
/// queue holds runs of messages lying back to back in a chunk: queueing one more
/// message for it usually moves the end of its last run. Each subscriber's queue
/// holds at most `send_queue_messages` messages and `send_queue_bytes` bytes; past
/// that the message is dropped *for that subscriber only* and counted in
/// [`stats`](Self::stats) and [`subscriber_stats`](Self::subscriber_stats). One task
/// per subscriber hands whole runs to the kernel, up to 64 runs (about 64 KiB) in one
/// vectored write straight from the shared chunks (no copy per subscriber; runs under
/// 512 B, and every run on streams without vectored writes, are copied into its
/// write buffer).
///
/// Subscriptions arrive as ZMTP 3.1 commands or ZMTP 3.0 messages, from any peer.
/// Matching costs one hash look-up per distinct subscription length, however many
/// subscribers there are.
///
/// # What a subscriber can make it hold
/// - Everything pending toward one subscriber counts as one figure against
///   `send_queue_bytes` (default 16 MiB): its queued messages, charged for the chunks
///   they keep alive (a queue holding one message of a chunk pays for the whole
///   chunk, once however many it holds), what its writer was handed and has not
///   written yet (charged the same way), and control replies. At most one PONG is
///   ever pending: a PING that arrives before the last answer was written replaces
///   it. Below a `send_queue_bytes` of 1 MiB every message gets an allocation of its
///   own, charged its length.
/// - While 64 KiB or more wait to be written to a subscriber, its connection is not
///   read; if it reads nothing for `write_stall_timeout` (default 30 s) it is closed
///   and counted in [`PubStats::stalled`].
/// - What a subscriber sends is capped at its subscription limit: a frame larger than
///   `max_subscription_size + 1` closes the connection at its header, before READY
///   only commands are accepted, and subscription prefixes are copied out of the read
///   buffer.
/// - At most `max_connections` (default 1024) connections at once, handshaking ones
///   included; more are closed on accept and counted in [`PubStats::refused`].
///
/// Dropping the socket stops accepting and closes every connection (queued messages
/// are discarded) as soon as its tasks observe the cancellation, so the port may stay
/// bound for a moment; [`close`](Self::close) first waits up to a linger period for the
/// queues to drain, then waits until the listener and every connection are gone.
///
/// ```no_run
/// use eventplane::zmtp::{Config, Message, PubSocket};
/// # async fn run() -> Result<(), eventplane::zmtp::Error> {
/// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
/// println!("bound at {}", publisher.local_endpoint().unwrap_or("?"));
/// publisher.wait_for_subscribers(1).await;
/// let report = publisher.send(Message::from_parts(["kv-events", "hello"]));
/// assert_eq!(report.dropped, 0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PubSocket {
    shared: Arc<Shared>,
    local_addr: Option<SocketAddr>,
    local_endpoint: Option<String>,
    /// Stops everything: the acceptor and every connection.
    cancel: CancellationToken,
    /// Stops only the acceptor (a child of `cancel`).
    stop_accepting: CancellationToken,
    tracker: TaskTracker,
}

/// Serves subscribers of a [`PubSocket`] over connected streams (from
/// [`PubSocket::acceptor`]); cheap to clone.
#[derive(Debug, Clone)]
pub struct StreamAcceptor {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl StreamAcceptor {
    /// Whether its socket closed (it accepts nothing more).
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Serves one subscriber over `stream`, exactly as
    /// [`PubSocket::accept_stream`] does (the same send queue bounds, drop counters
    /// and `max_connections`); `false` when refused.
    pub fn accept_stream<S>(&self, stream: S, label: impl Into<String>) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if self.cancel.is_cancelled() {
            return false;
        }
        spawn_peer(
            &self.tracker,
            self.shared.clone(),
            self.cancel.clone(),
            stream,
            label.into(),
        )
    }
}

mod fanout;
mod stats;
mod task;

pub use stats::{PeerStats, PubStats, SendReport};

use fanout::{Inner, Shared};
use task::{accept_loop, spawn_peer};

impl PubSocket {
    /// A publisher with no listener: feed it connections with
    /// [`accept_stream`](Self::accept_stream). Must be called within a tokio runtime
    /// when streams are added.
    pub fn new(config: Config) -> PubSocket {
        let (subscribed, _) = watch::channel(0);
        let cancel = CancellationToken::new();
        PubSocket {
            shared: Arc::new(Shared {
                config,
                inner: Mutex::new(Inner::default()),
                subscribed,
                drained: Notify::new(),
                warn: RateLimitedWarn::default(),
            }),
            local_addr: None,
            local_endpoint: None,
            stop_accepting: cancel.child_token(),
            cancel,
            tracker: TaskTracker::new(),
        }
    }

    /// Binds `tcp://host:port` and accepts subscribers in a background task. Port 0
    /// lets the OS pick a free port atomically; read it from
    /// [`local_endpoint`](Self::local_endpoint).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, PubSocket};
    /// // Port 0: the OS picks a free port, no probe-then-bind race.
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// assert_ne!(publisher.local_addr().map(|a| a.port()), Some(0));
    /// # Ok(()) }
    /// ```
    pub async fn bind(endpoint: &str, config: Config) -> Result<PubSocket, Error> {
        let addrs = endpoint::resolve(endpoint, config.connect_timeout).await?;
        let listener = TcpListener::bind(&addrs[..]).await?;
        let mut socket = PubSocket::new(config);
        let local = listener.local_addr()?;
        socket.local_addr = Some(local);
        socket.local_endpoint = Some(endpoint::format_tcp(local));
        socket.tracker.spawn(accept_loop(
            listener,
            socket.shared.clone(),
            socket.cancel.clone(),
            socket.stop_accepting.clone(),
            socket.tracker.clone(),
        ));
        tracing::debug!(endpoint = %endpoint::format_tcp(local), "zmtp pub bound");
        Ok(socket)
    }

    /// The bound address as `tcp://ip:port`, if bound.
    pub fn local_endpoint(&self) -> Option<&str> {
        self.local_endpoint.as_deref()
    }

    /// The bound socket address, if bound.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local_addr
    }

    /// Serves one subscriber over an already connected stream (a tunnel, a TLS
    /// stream, an in-memory duplex). `label` names it in stats and logs. Returns
    /// `false`, dropping the stream and counting it in [`PubStats::refused`], when
    /// `max_connections` are already open.
    pub fn accept_stream<S>(&self, stream: S, label: impl Into<String>) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        spawn_peer(
            &self.tracker,
            self.shared.clone(),
            self.cancel.clone(),
            stream,
            label.into(),
        )
    }

    /// A handle that serves subscribers over connected streams, as
    /// [`accept_stream`](Self::accept_stream) does, from wherever they arrive (a
    /// tunnel source's data streams); it holds the socket's state, not the socket:
    /// once the socket closed, what it accepts ends at once.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use eventplane::zmtp::{Config, PubSocket};
    /// let publisher = PubSocket::new(Config::default());
    /// let acceptor = publisher.acceptor();
    /// let (ours, _theirs) = tokio::io::duplex(4096);
    /// assert!(acceptor.accept_stream(ours, "in-memory subscriber"));
    /// # }
    /// ```
    pub fn acceptor(&self) -> StreamAcceptor {
        StreamAcceptor {
            shared: self.shared.clone(),
            cancel: self.cancel.clone(),
            tracker: self.tracker.clone(),
        }
    }

    /// Queues `msg` for every subscriber whose subscription matches its first frame.
    /// Never blocks; a full queue drops the message for that subscriber and counts it.
    ///
    /// ```
    /// use eventplane::zmtp::{Config, Message, PubSocket};
    /// let publisher = PubSocket::new(Config::default());
    /// // No subscriber matches: nothing queued, nothing dropped, never blocks.
    /// let report = publisher.send(Message::from_parts(["kv-events", "payload"]));
    /// assert_eq!((report.queued, report.dropped), (0, 0));
    /// ```
    pub fn send(&self, msg: Message) -> SendReport {
        let mut wake: SmallVec<[Waker; 8]> = SmallVec::new();
        let report = self
            .shared
            .lock()
            .fan_out(&self.shared.config, &msg, &mut wake);
        for w in wake {
            w.wake();
        }
        report
    }

    /// Totals.
    pub fn stats(&self) -> PubStats {
        let inner = self.shared.lock();
        let mut stats = inner.stats;
        stats.pending_bytes = inner
            .peers
            .iter()
            .map(|(_, p)| p.queue.held() + p.in_flight)
            .sum();
        stats
    }

    /// Per-subscriber counters, for connections whose handshake completed.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use eventplane::zmtp::{Config, PubSocket, SubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// let mut sub = SubSocket::connect(publisher.local_endpoint().unwrap_or_default(), Config::default()).await?;
    /// sub.subscribe("t").await?;
    /// publisher.wait_for_subscribers(1).await;
    /// let peers = publisher.subscriber_stats();
    /// assert_eq!((peers.len(), peers[0].subscriptions, peers[0].dropped), (1, 1, 0));
    /// # Ok(()) }
    /// ```
    pub fn subscriber_stats(&self) -> Vec<PeerStats> {
        let inner = self.shared.lock();
        inner
            .peers
            .iter()
            .map(|(_, p)| p)
            .filter(|p| p.ready)
            .map(|p| PeerStats {
                peer: p.label.clone(),
                subscriptions: p.prefixes.len(),
                queue_len: p.queue.len(),
                queue_bytes: p.queue.held(),
                pending_bytes: p.queue.held() + p.in_flight,
                written: p.written,
                dropped: p.dropped,
                session: p.session,
            })
            .collect()
    }

    /// Waits until at least `count` connections hold a subscription.
    pub async fn wait_for_subscribers(&self, count: usize) {
        let mut rx = self.shared.subscribed.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we wait.
        let _ = rx.wait_for(|n| *n >= count).await;
    }

    /// Waits until every queue is written out, or `timeout` passes. Returns `true`
    /// when everything was written.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::zmtp::Error> {
    /// use std::time::Duration;
    /// use eventplane::zmtp::{Config, Message, PubSocket};
    /// let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default()).await?;
    /// publisher.send(Message::from_parts(["t"]));
    /// assert!(publisher.flush(Duration::from_secs(1)).await); // every queue written out
    /// publisher.close(Duration::from_millis(100)).await;
    /// # Ok(()) }
    /// ```
    pub async fn flush(&self, timeout: Duration) -> bool {
        let now = tokio::time::Instant::now();
        // A timeout too large to add (Duration::MAX) waits a century instead.
        let deadline = now
            .checked_add(timeout)
            .unwrap_or(now + Duration::from_secs(100 * 365 * 86_400));
        loop {
            let notified = self.shared.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shared.lock().peers.iter().all(|(_, p)| p.idle()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Stops accepting, lets queued messages drain for up to `linger`, then closes
    /// every connection and waits for their tasks to end.
    pub async fn close(self, linger: Duration) {
        self.stop_accepting.cancel();
        self.flush(linger).await;
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for PubSocket {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
