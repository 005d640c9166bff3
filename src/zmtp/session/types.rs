//! What a session tells its owner: the socket types, the peer's identity, the events
//! and the counters.

use bytes::Bytes;

use crate::zmtp::Message;
use crate::zmtp::codec::Metadata;

/// Our side of the connection.
///
/// ```
/// use eventplane::zmtp::SocketType;
/// assert_eq!(SocketType::Sub.as_str(), "SUB");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SocketType {
    /// A publisher: accepts subscriptions, sends messages.
    Pub,
    /// A subscriber: sends subscriptions, receives messages.
    Sub,
    /// A dealer: sends and receives whole messages, unfiltered (the client side of a
    /// request to a ROUTER, such as an engine's replay endpoint).
    Dealer,
    /// One connection of a ROUTER: receives whole messages, unfiltered, and answers on
    /// the same connection (the server side of a DEALER's requests; identities are not
    /// needed when each connection is served on its own).
    Router,
}

impl SocketType {
    /// The wire spelling sent in READY's `Socket-Type`.
    pub fn as_str(&self) -> &'static str {
        match self {
            SocketType::Pub => "PUB",
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
        }
    }

    pub(super) fn accepts_peer(&self, peer: &[u8]) -> bool {
        let ok: &[&[u8]] = match self {
            SocketType::Pub => &[b"SUB", b"XSUB"],
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER", b"DEALER", b"REP"],
            SocketType::Router => &[b"DEALER", b"REQ", b"ROUTER"],
        };
        ok.iter().any(|t| t.eq_ignore_ascii_case(peer))
    }
}

/// What the peer told us during the handshake; see [`Session`](super::Session) for how to obtain one.
///
/// ```
/// use eventplane::zmtp::{PeerInfo, codec::Metadata};
/// let mut metadata = Metadata::new();
/// metadata.push("Socket-Type", "PUB");
/// let peer = PeerInfo { major: 3, minor: 0, metadata };
/// assert!(!peer.speaks_3_1()); // zeromq-rs: subscriptions go as messages, no PINGs
/// assert_eq!(peer.socket_type(), Some(&b"PUB"[..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// ZMTP major version.
    pub major: u8,
    /// ZMTP minor version: 0 (3.0, e.g. zeromq-rs) or 1 (3.1, libzmq ≥ 4.3).
    pub minor: u8,
    /// The peer's READY metadata.
    pub metadata: Metadata,
}

impl PeerInfo {
    /// The peer's `Socket-Type`, if it sent one.
    pub fn socket_type(&self) -> Option<&[u8]> {
        self.metadata.get("Socket-Type").map(|v| &v[..])
    }

    /// `true` for ZMTP ≥ 3.1 peers: they get SUBSCRIBE/CANCEL commands and PINGs.
    pub fn speaks_3_1(&self) -> bool {
        self.major > 3 || self.minor >= 1
    }
}

/// Something the application must act on, from [`Session::poll_event`](super::Session::poll_event) (see the
/// example there).
///
/// ```
/// use std::time::Instant;
/// use eventplane::zmtp::{Config, Event, Message, Pair, Side};
/// let mut pair = Pair::new(&Config::default(), &Config::default(), Instant::now());
/// pair.sub.subscribe(b"kv".as_slice().into());
/// pair.drive()?;
/// assert!(pair.take_events(Side::Pub).iter().any(|e| matches!(e, Event::Subscribe(_))));
/// pair.publ.send_message(&Message::from_parts(["kv", "x"]));
/// pair.drive()?;
/// let seen = pair.take_events(Side::Sub);
/// assert!(matches!(seen.first(), Some(Event::Ready(_))));
/// assert!(seen.iter().any(|e| matches!(e, Event::Message(m) if m.len() == 2)));
/// # Ok::<(), eventplane::zmtp::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The handshake completed.
    Ready(PeerInfo),
    /// A message that passed the local subscription filter (SUB role), or any message
    /// (DEALER role).
    Message(Message),
    /// The peer's first subscription to this prefix (PUB role; repeats are counted, not
    /// reported).
    Subscribe(Bytes),
    /// The peer's last subscription to this prefix went away (PUB role).
    Cancel(Bytes),
}

/// Counters of one session.
///
/// ```
/// use std::time::Instant;
/// use eventplane::zmtp::{Config, Session, SocketType};
/// let session = Session::new(SocketType::Sub, &Config::default(), Instant::now());
/// assert_eq!(session.stats().messages, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SessionStats {
    /// Messages delivered through [`Event::Message`].
    pub messages: u64,
    /// Bytes of those messages (frame bodies).
    pub bytes: u64,
    /// Messages dropped by the local subscription filter.
    pub filtered: u64,
    /// Unknown commands ignored after the handshake.
    pub unknown_commands: u64,
    /// Messages a publisher ignored (not a subscription).
    pub ignored_messages: u64,
    /// PINGs received (each answered).
    pub pings_received: u64,
    /// PINGs sent.
    pub pings_sent: u64,
    /// PONGs queued in answer to PINGs (a PING that arrives while the previous answer
    /// still waits to be written replaces it: at most one PONG is ever pending).
    pub pongs_sent: u64,
    /// PINGs whose answer replaced a PONG that was still pending (the peer pinged
    /// faster than it read).
    pub pongs_coalesced: u64,
    /// PONGs received.
    pub pongs_received: u64,
    /// Commands that arrived between the frames of a multipart message (libzmq's
    /// heartbeat does this).
    pub commands_between_frames: u64,
}
