//! What a `PubSocket` reports: per send, per socket and per subscriber.

use crate::zmtp::SessionStats;

/// What one [`PubSocket::send`](super::PubSocket::send) did.
///
/// ```
/// use eventplane::zmtp::{Config, Message, PubSocket};
/// let publisher = PubSocket::new(Config::default());
/// // Nobody subscribed: nothing queued, nothing dropped.
/// let report = publisher.send(Message::from_parts(["topic", "payload"]));
/// assert_eq!((report.queued, report.dropped), (0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendReport {
    /// Subscribers the message was queued for.
    pub queued: usize,
    /// Matching subscribers whose queue was full: the message was dropped for them.
    pub dropped: usize,
}

/// Totals of a [`PubSocket`](super::PubSocket).
///
/// ```
/// use eventplane::zmtp::{Config, Message, PubSocket};
/// let publisher = PubSocket::new(Config::default());
/// publisher.send(Message::from_parts(["t"]));
/// let stats = publisher.stats();
/// assert_eq!((stats.messages, stats.queued, stats.dropped), (1, 0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PubStats {
    /// Connections whose handshake completed and that are still open.
    pub connections: usize,
    /// Of those, connections holding at least one subscription.
    pub subscribed: usize,
    /// Calls to `send`.
    pub messages: u64,
    /// Messages queued to subscribers (one per matching subscriber).
    pub queued: u64,
    /// Messages dropped because a subscriber's queue was full.
    pub dropped: u64,
    /// Connections accepted in total.
    pub accepted: u64,
    /// Connections that ended with an error (protocol, timeout, I/O).
    pub failed: u64,
    /// Of those, connections closed because the subscriber read nothing for
    /// `write_stall_timeout` while output waited for it.
    pub stalled: u64,
    /// Connections closed on accept because `max_connections` were open.
    pub refused: u64,
    /// The sum of every subscriber's [`PeerStats::pending_bytes`]: an upper bound of
    /// what is pending toward all of them (a chunk of encoded messages shared by
    /// several subscribers counts once for each, although it is held once).
    pub pending_bytes: usize,
}

/// One subscriber of a [`PubSocket`](super::PubSocket), from [`PubSocket::subscriber_stats`](super::PubSocket::subscriber_stats).
///
/// ```
/// use eventplane::zmtp::{Config, PubSocket};
/// let publisher = PubSocket::new(Config::default());
/// for s in publisher.subscriber_stats() {
///     println!("{}: {} queued, {} dropped", s.peer, s.queue_len, s.dropped);
/// }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PeerStats {
    /// The peer's address, or a label for non-TCP streams.
    pub peer: String,
    /// Distinct prefixes subscribed.
    pub subscriptions: usize,
    /// Messages waiting in its queue.
    pub queue_len: usize,
    /// Bytes its queue keeps alive: messages with an allocation of their own at their
    /// size, small messages as the whole 64 KiB chunks they were encoded into (once
    /// per chunk), and the queue's slots.
    pub queue_bytes: usize,
    /// Everything pending toward it, the figure bounded by `send_queue_bytes`:
    /// `queue_bytes` plus its unwritten output (charged for the chunks it keeps alive,
    /// like the queue) and unsent control replies.
    pub pending_bytes: usize,
    /// Messages handed to its writer.
    pub written: u64,
    /// Messages dropped because its queue was full.
    pub dropped: u64,
    /// The connection's protocol counters (PINGs and PONGs each way, subscriptions
    /// ignored, …), as of its writer's last turn.
    pub session: SessionStats,
}
