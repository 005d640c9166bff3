//! Errors of the ZMTP layer.

use std::fmt;
use std::io;

/// Everything that can end a ZMTP connection.
///
/// Use [`Error::is_protocol`], [`Error::is_timeout`] and [`Error::is_io`] to decide
/// whether to reconnect (I/O, timeouts) or to report a misbehaving peer (protocol).
///
/// ```
/// use eventplane::zmtp::{Error, ProtocolError};
/// let err = Error::from(ProtocolError::BadSignature);
/// assert!(err.is_protocol());
/// assert_eq!(err.to_string(), "protocol error: bad greeting signature");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The transport failed (connect, read or write).
    #[error("I/O error")]
    Io(#[source] io::Error),
    /// The peer broke the ZMTP protocol or one of the configured bounds.
    #[error("protocol error: {0}")]
    Protocol(ProtocolError),
    /// A deadline passed: connect, handshake or heartbeat.
    #[error("{0} timed out")]
    Timeout(TimeoutKind),
    /// The peer sent an `ERROR` command; its reason is kept (lossily decoded as UTF-8).
    #[error("peer sent ERROR: {reason}")]
    PeerError {
        /// The reason the peer gave.
        reason: String,
    },
    /// The peer closed the connection cleanly.
    #[error("connection closed by peer")]
    Closed,
    /// The socket was closed on this side, or failed earlier and stays failed.
    #[error("socket is closed")]
    SocketClosed,
    /// Every address the endpoint resolved to was refused by the caller's address
    /// filter ([`SubSocket::connect_filtered`](super::SubSocket::connect_filtered)):
    /// nothing was dialled.
    #[error("{addr} refused by the address filter; not dialled")]
    Refused {
        /// The first address refused.
        addr: std::net::SocketAddr,
    },
    /// The endpoint could not be parsed or resolved.
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl Error {
    /// `true` when the peer violated the protocol or a configured bound.
    pub fn is_protocol(&self) -> bool {
        matches!(self, Error::Protocol(_) | Error::PeerError { .. })
    }

    /// `true` for connect, handshake and heartbeat timeouts.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout(_))
    }

    /// `true` for transport failures and a peer closing the connection: worth a
    /// reconnect with backoff.
    pub fn is_io(&self) -> bool {
        matches!(self, Error::Io(_) | Error::Closed)
    }

    /// The protocol violation, if this is one.
    pub fn protocol(&self) -> Option<&ProtocolError> {
        match self {
            Error::Protocol(p) => Some(p),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<ProtocolError> for Error {
    fn from(e: ProtocolError) -> Self {
        Error::Protocol(e)
    }
}

/// Which deadline passed.
///
/// ```
/// use eventplane::zmtp::{Error, TimeoutKind};
/// let err = Error::Timeout(TimeoutKind::Handshake);
/// assert!(err.is_timeout());
/// assert_eq!(err.to_string(), "handshake timed out");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimeoutKind {
    /// TCP connect (`Config::connect_timeout`).
    Connect,
    /// Greeting + READY (`Config::handshake_timeout`).
    Handshake,
    /// No bytes from the peer within the heartbeat timeout or the peer's TTL.
    Heartbeat,
    /// Name resolution of the endpoint's host (within `Config::connect_timeout`).
    Resolve,
    /// The peer read nothing we wrote for `Config::write_stall_timeout` while output
    /// was waiting for it.
    WriteStall,
}

impl fmt::Display for TimeoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimeoutKind::Connect => "connect",
            TimeoutKind::Handshake => "handshake",
            TimeoutKind::Heartbeat => "heartbeat",
            TimeoutKind::Resolve => "name resolution",
            TimeoutKind::WriteStall => "write (peer not reading)",
        })
    }
}

/// A violation of ZMTP 3.x (RFC 23 / RFC 37) or of a configured bound.
///
/// Every variant closes the connection; none of them is raised after allocating what the
/// peer claimed.
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::ProtocolError;
/// use eventplane::zmtp::codec::{FrameDecoder, FrameLimits};
///
/// let limits = FrameLimits { max_frame_size: 1 << 20, max_message_size: 1 << 21,
///     max_message_parts: 64, max_command_size: 1 << 16, strict: false };
/// // A 9-byte header claiming 2^36 bytes.
/// let mut forged = BytesMut::from(&[0x02, 0, 0, 0, 0x10, 0, 0, 0, 0][..]);
/// let err = FrameDecoder::new(limits).decode(&mut forged).unwrap_err();
/// assert!(matches!(err, ProtocolError::FrameTooLarge { size, .. } if size == 1 << 36));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// Greeting byte 0 was not `0xFF` or byte 9 lacked bit 0 (RFC 23 §2.3).
    #[error("bad greeting signature")]
    BadSignature,
    /// The peer speaks a ZMTP major version below 3.
    #[error("unsupported ZMTP version {major}.{minor}")]
    UnsupportedVersion {
        /// Peer's major version.
        major: u8,
        /// Peer's minor version.
        minor: u8,
    },
    /// The peer asked for a security mechanism other than `NULL`.
    #[error("unsupported security mechanism {mechanism:?}")]
    UnsupportedMechanism {
        /// The mechanism name, NUL padding removed.
        mechanism: String,
    },
    /// A frame header declared more than `max_frame_size` bytes.
    #[error("frame of {size} bytes exceeds the limit of {max}")]
    FrameTooLarge {
        /// Size the peer declared.
        size: u64,
        /// The configured limit.
        max: usize,
    },
    /// The parts of one message would exceed `max_message_size` bytes.
    #[error("message of at least {size} bytes exceeds the limit of {max}")]
    MessageTooLarge {
        /// Bytes declared so far.
        size: u64,
        /// The configured limit.
        max: usize,
    },
    /// A message has more than `max_message_parts` frames.
    #[error("message has more than {max} parts")]
    TooManyParts {
        /// The configured limit.
        max: usize,
    },
    /// A command frame exceeded its limit (READY metadata during the handshake).
    #[error("command of {size} bytes exceeds the limit of {max}")]
    CommandTooLarge {
        /// Size the peer declared.
        size: u64,
        /// The limit.
        max: usize,
    },
    /// A READY carried more than
    /// [`MAX_METADATA_PROPERTIES`](crate::zmtp::codec::MAX_METADATA_PROPERTIES)
    /// properties.
    #[error("READY has more than {max} properties")]
    TooManyProperties {
        /// The limit.
        max: usize,
    },
    /// A command frame had the MORE flag set (commands are single frames; a command
    /// *between* the frames of a message is accepted, as libzmq sends its heartbeats).
    #[error("command frame with the MORE flag")]
    CommandWithMore,
    /// A reserved flag bit was set and `strict` mode is on.
    #[error("reserved frame flag bits {flags:#04x} set")]
    ReservedFlags {
        /// The flags byte.
        flags: u8,
    },
    /// A command's body could not be parsed.
    #[error("malformed {command} command")]
    MalformedCommand {
        /// The command name.
        command: &'static str,
    },
    /// A message frame or unexpected command arrived before the handshake completed.
    #[error("unexpected {what} during the handshake")]
    UnexpectedDuringHandshake {
        /// What arrived.
        what: String,
    },
    /// A second READY arrived after the handshake.
    #[error("duplicate READY")]
    DuplicateReady,
    /// The peer's `Socket-Type` cannot talk to ours.
    #[error("peer socket type {peer:?} is incompatible with {ours}")]
    IncompatibleSocketType {
        /// The peer's declared type.
        peer: String,
        /// Our type.
        ours: &'static str,
    },
    /// A subscription exceeded `max_subscription_size` or the peer exceeded
    /// `max_subscriptions`.
    #[error("subscription limit exceeded: {what}")]
    SubscriptionLimit {
        /// Which limit.
        what: &'static str,
    },
}
