//! Control frames on a tunnel session (DESIGN §7.1): a 4-byte big-endian body length,
//! then one msgpack map whose `"type"` names the frame. Decoding is bounded: a declared
//! length over the limit is refused before its body is buffered, and the body is read
//! with the crate's bounded msgpack reader (no length the peer declares is reserved).

use std::time::Duration;

use crate::msgpack::{self, Value};
use crate::tunnel::protocol::announce::{
    AnnouncedSource, Role, Target, decode_sources, encode_sources,
};
pub use crate::tunnel::protocol::codes::{
    AnnounceRefusal, CloseCode, DenyCode, DrainReason, RefuseCode,
};
use crate::tunnel::protocol::fields::{Fields, Writer, name_of};
pub use crate::tunnel::protocol::fields::{FrameError, MAX_NAME_LEN};

/// The newest session protocol version this crate speaks. Version 2 adds the `source`
/// role, its `announce` / `withdraw` frames, and `announced` targets; a broker offers
/// both 1 and 2, a source only 2 (a version-1 router refuses its `hello`).
pub const PROTOCOL_VERSION: u32 = 2;

/// The oldest session protocol version this crate speaks.
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// Largest control-frame body accepted by default (64 KiB).
pub const MAX_CONTROL_FRAME: usize = 64 * 1024;

/// Most namespaces a broker may say it covers in its `hello`.
pub const MAX_NAMESPACES: usize = 256;

/// Most protocol versions a `hello` may offer.
pub const MAX_VERSIONS: usize = 16;

/// Most msgpack elements decoded from one frame (a full `hello` needs ~270).
const MAX_ELEMENTS: usize = 2048;

/// A control frame.
///
/// ```
/// use eventplane::tunnel::protocol::{Control, ControlDecoder, RefuseCode};
/// let frame = Control::StreamRefused { stream_id: 7, code: RefuseCode::AddressFiltered };
/// let mut wire = Vec::new();
/// frame.encode(&mut wire);
/// let mut decoder = ControlDecoder::default();
/// let mut input = &wire[..];
/// assert_eq!(decoder.decode(&mut input)?, Some(frame));
/// # Ok::<(), eventplane::tunnel::protocol::FrameError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Control {
    /// Broker → router, first on a session: who it is and what it covers.
    Hello(Hello),
    /// Router → broker, the answer to `hello`: the negotiated terms.
    Welcome(Welcome),
    /// Either way, every heartbeat interval: the session is alive.
    Heartbeat,
    /// Router → client: open `target` and relay it as data stream `stream_id` (a
    /// broker dials a `tcp://` target; a source serves an announced one).
    Subscribe {
        /// The router's id for the stream.
        stream_id: u64,
        /// What to open. A `tcp://` target the decoder cannot take (not a string,
        /// empty, over [`MAX_NAME_LEN`]) decodes as an empty one, so that the client
        /// refuses that one stream with `bad_target` instead of failing the session;
        /// a target kind it does not know is refused with `unsupported_target`.
        target: Target,
    },
    /// Source → router (version 2): more publishers it serves, at most
    /// 64 per frame. Announcing a publisher again
    /// with anything changed replaces it (a new incarnation); the same announcement
    /// again changes nothing.
    Announce {
        /// The publishers.
        sources: Vec<AnnouncedSource>,
    },
    /// Source → router (version 2): publishers it no longer serves (their streams
    /// close), at most 64 per frame.
    Withdraw {
        /// Their ids.
        publisher_ids: Vec<u64>,
    },
    /// Router → source (version 2): announced publishers the router did not take (at
    /// most 64 per frame); the source counts them
    /// and announces them again later. A source of an earlier version skips the frame.
    AnnounceRefused {
        /// Their ids.
        publisher_ids: Vec<u64>,
        /// Why.
        code: AnnounceRefusal,
    },
    /// Router → broker: close stream `stream_id` (silently: no `stream_closed`).
    Unsubscribe {
        /// The stream.
        stream_id: u64,
    },
    /// Router → broker: take no new streams, let open ones finish within `deadline`,
    /// then reconnect (after a rebalance delay, for `Rebalance`).
    Drain {
        /// How long open streams may still run.
        deadline: Duration,
        /// Why.
        reason: DrainReason,
    },
    /// Broker → router: the publisher connection is up; the data stream follows.
    StreamOpened {
        /// The stream.
        stream_id: u64,
    },
    /// Broker → router: the subscribe was refused; nothing was or stays open.
    StreamRefused {
        /// The stream.
        stream_id: u64,
        /// Why.
        code: RefuseCode,
    },
    /// Broker → router: an open stream ended on the broker's side.
    StreamClosed {
        /// The stream.
        stream_id: u64,
        /// Why.
        code: CloseCode,
    },
    /// Broker → router: the broker is shutting down; it takes no new streams.
    Draining,
    /// Router → client, instead of `welcome`: the hello claims what the client's
    /// credential does not grant; the session ends. Also during a source's session,
    /// when an `announce` goes beyond its grant or its `max_sources`.
    Denied {
        /// Why.
        code: DenyCode,
    },
    /// A frame type this version does not know (from a newer peer): skipped.
    Unknown,
}

/// A client's `hello`: a broker's, or a source's with the publishers it announces.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hello {
    /// The client's id; a new session with the same id supersedes the old one.
    pub client_id: String,
    /// A broker: the discovery namespaces it can reach publishers in. A source: the
    /// namespaces it announces in.
    pub namespaces: Vec<String>,
    /// Protocol versions it speaks.
    pub versions: Vec<u32>,
    /// Its role.
    pub role: Role,
    /// A source's first announcements (at most 64;
    /// more follow in `announce` frames). Always empty for a broker.
    pub sources: Vec<AnnouncedSource>,
}

impl Hello {
    /// A broker's `hello`, offering versions 1 and 2.
    pub fn new(client_id: impl Into<String>, namespaces: Vec<String>) -> Hello {
        Hello {
            client_id: client_id.into(),
            namespaces,
            versions: vec![MIN_PROTOCOL_VERSION, PROTOCOL_VERSION],
            role: Role::Broker,
            sources: Vec::new(),
        }
    }

    /// A source's `hello`, offering version 2, announcing `sources` (at most
    /// 64; announce the rest once welcomed).
    ///
    /// ```
    /// use eventplane::discovery::ChannelId;
    /// use eventplane::tunnel::protocol::{AnnouncedSource, Control, ControlDecoder, Hello, Role};
    /// use eventplane::wire::Dialect;
    /// let id = ChannelId::new("prod", "backend", "kv-events", 7)?;
    /// let hello = Hello::source("gpu-box-1", vec!["prod".into()], vec![AnnouncedSource::new(&id, Dialect::EventPlane)]);
    /// let mut wire = Vec::new();
    /// Control::Hello(hello.clone()).encode(&mut wire);
    /// let decoded = ControlDecoder::default().decode(&mut &wire[..])?;
    /// assert_eq!(decoded, Some(Control::Hello(hello)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn source(
        client_id: impl Into<String>,
        namespaces: Vec<String>,
        sources: Vec<AnnouncedSource>,
    ) -> Hello {
        Hello {
            client_id: client_id.into(),
            namespaces,
            versions: vec![PROTOCOL_VERSION],
            role: Role::Source,
            sources,
        }
    }
}

/// A router's `welcome`: the version both speak and the limits the broker must keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Welcome {
    /// The negotiated protocol version.
    pub version: u32,
    /// The router's id for this session (for logs and `supersede` bookkeeping).
    pub session_id: u64,
    /// The session's effective limits.
    pub limits: Limits,
}

impl Welcome {
    /// A `welcome` for `version` with `limits`.
    pub fn new(version: u32, session_id: u64, limits: Limits) -> Welcome {
        Welcome {
            version,
            session_id,
            limits,
        }
    }
}

/// The limits a router sets for a session (in its `welcome`).
///
/// ```
/// use std::time::Duration;
/// use eventplane::tunnel::protocol::Limits;
/// let limits = Limits::default();
/// assert_eq!(limits.max_stream_buffer_bytes, 1 << 20);
/// assert_eq!(limits.heartbeat_interval, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Most data streams open at once. Default 1024.
    pub max_streams: u32,
    /// Bytes a broker may queue toward the router per stream (each chunk charged its
    /// length + 64). Default and maximum 1 MiB; never below 16 KiB.
    pub max_stream_buffer_bytes: u32,
    /// How often each side sends `heartbeat`. Default 10 s.
    pub heartbeat_interval: Duration,
    /// A side silent this long ends the session. Default 30 s.
    pub idle_timeout: Duration,
    /// Most publishers one source session may announce at once (version 2; a source
    /// going past it is denied `too_many_sources`). Default 1024.
    pub max_sources: u32,
}

impl Limits {
    /// With at most `streams` data streams open at once.
    #[must_use]
    pub fn with_max_streams(mut self, streams: u32) -> Limits {
        self.max_streams = streams;
        self
    }

    /// With brokers queueing at most `bytes` per stream (clamped to 16 KiB ..= 1 MiB
    /// by the broker).
    #[must_use]
    pub fn with_stream_buffer(mut self, bytes: u32) -> Limits {
        self.max_stream_buffer_bytes = bytes;
        self
    }

    /// With at most `sources` publishers announced by one source session.
    #[must_use]
    pub fn with_max_sources(mut self, sources: u32) -> Limits {
        self.max_sources = sources;
        self
    }

    /// With heartbeats every `interval`, and sessions ended after `idle_timeout` of
    /// silence (a broker refuses a `welcome` whose timeout does not exceed the
    /// interval).
    #[must_use]
    pub fn with_heartbeat(mut self, interval: Duration, idle_timeout: Duration) -> Limits {
        self.heartbeat_interval = interval;
        self.idle_timeout = idle_timeout;
        self
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_streams: 1024,
            max_stream_buffer_bytes: 1 << 20,
            heartbeat_interval: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_sources: 1024,
        }
    }
}

impl Control {
    /// The frame's type on the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            Control::Hello(_) => "hello",
            Control::Welcome(_) => "welcome",
            Control::Heartbeat => "heartbeat",
            Control::Subscribe { .. } => "subscribe",
            Control::Announce { .. } => "announce",
            Control::Withdraw { .. } => "withdraw",
            Control::AnnounceRefused { .. } => "announce_refused",
            Control::Unsubscribe { .. } => "unsubscribe",
            Control::Drain { .. } => "drain",
            Control::StreamOpened { .. } => "stream_opened",
            Control::StreamRefused { .. } => "stream_refused",
            Control::StreamClosed { .. } => "stream_closed",
            Control::Draining => "draining",
            Control::Denied { .. } => "denied",
            Control::Unknown => "unknown",
        }
    }

    /// Appends the frame (length prefix and body) to `out`. `Unknown` encodes as a
    /// frame of type `"unknown"`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; 4]);
        let mut w = Writer(out);
        let kind = self.kind();
        match self {
            Control::Hello(h) => {
                let source = h.role == Role::Source;
                w.map(if source { 6 } else { 5 });
                w.entry_str("type", kind);
                w.entry_str("role", h.role.as_str());
                w.entry_str("client_id", &h.client_id);
                if source {
                    w.str("sources");
                    encode_sources(&mut w, &h.sources);
                }
                w.str("namespaces");
                w.array(h.namespaces.len());
                for ns in &h.namespaces {
                    w.str(ns);
                }
                w.str("versions");
                w.array(h.versions.len());
                for v in &h.versions {
                    w.uint(u64::from(*v));
                }
            }
            Control::Welcome(welcome) => {
                w.map(8);
                w.entry_str("type", kind);
                w.entry_uint("version", u64::from(welcome.version));
                w.entry_uint("max_sources", u64::from(welcome.limits.max_sources));
                w.entry_uint("session_id", welcome.session_id);
                let l = &welcome.limits;
                w.entry_uint("max_streams", u64::from(l.max_streams));
                w.entry_uint(
                    "max_stream_buffer_bytes",
                    u64::from(l.max_stream_buffer_bytes),
                );
                w.entry_uint("heartbeat_interval_ms", millis(l.heartbeat_interval));
                w.entry_uint("idle_timeout_ms", millis(l.idle_timeout));
            }
            Control::Heartbeat | Control::Draining | Control::Unknown => {
                w.map(1);
                w.entry_str("type", kind);
            }
            Control::Subscribe { stream_id, target } => {
                w.map(3);
                w.entry_str("type", kind);
                w.entry_uint("stream_id", *stream_id);
                w.str("target");
                target.encode(&mut w);
            }
            Control::Announce { sources } => {
                w.map(2);
                w.entry_str("type", kind);
                w.str("sources");
                encode_sources(&mut w, sources);
            }
            Control::Withdraw { publisher_ids } => {
                w.map(2);
                w.entry_str("type", kind);
                w.str("publisher_ids");
                w.array(publisher_ids.len());
                for id in publisher_ids {
                    w.uint(*id);
                }
            }
            Control::AnnounceRefused {
                publisher_ids,
                code,
            } => {
                w.map(3);
                w.entry_str("type", kind);
                w.entry_str("code", code.as_str());
                w.str("publisher_ids");
                w.array(publisher_ids.len());
                for id in publisher_ids {
                    w.uint(*id);
                }
            }
            Control::Unsubscribe { stream_id } | Control::StreamOpened { stream_id } => {
                w.map(2);
                w.entry_str("type", kind);
                w.entry_uint("stream_id", *stream_id);
            }
            Control::Drain { deadline, reason } => {
                w.map(3);
                w.entry_str("type", kind);
                w.entry_uint("deadline_ms", millis(*deadline));
                w.entry_str("reason", reason.as_str());
            }
            Control::StreamRefused { stream_id, code } => {
                w.map(3);
                w.entry_str("type", kind);
                w.entry_uint("stream_id", *stream_id);
                w.entry_str("code", code.as_str());
            }
            Control::StreamClosed { stream_id, code } => {
                w.map(3);
                w.entry_str("type", kind);
                w.entry_uint("stream_id", *stream_id);
                w.entry_str("code", code.as_str());
            }
            Control::Denied { code } => {
                w.map(2);
                w.entry_str("type", kind);
                w.entry_str("code", code.as_str());
            }
        }
        let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
        if let Some(prefix) = out.get_mut(start..start + 4) {
            prefix.copy_from_slice(&len.to_be_bytes());
        }
    }

    /// Decodes one frame body (without its length prefix).
    pub fn decode_body(body: &[u8]) -> Result<Control, FrameError> {
        let value = msgpack::parse(body, MAX_ELEMENTS).map_err(|e| {
            FrameError::NotMsgpack(match e {
                msgpack::MsgpackError::Truncated => "truncated",
                msgpack::MsgpackError::TooDeep => "nested too deep",
                msgpack::MsgpackError::Reserved => "reserved type byte",
                msgpack::MsgpackError::Trailing => "bytes after the value",
                msgpack::MsgpackError::TooManyElements => "too many elements",
            })
        })?;
        if !matches!(value, Value::Map(_)) {
            return Err(FrameError::NotMsgpack("not a map"));
        }
        let kind = value
            .get("type")
            .and_then(Value::as_str)
            .ok_or(FrameError::Field {
                frame: "?",
                field: "type",
            })?;
        let f = Fields { value: &value };
        Ok(match kind {
            "hello" => {
                const F: &str = "hello";
                let role = Role::parse(f.str(F, "role", 16)?).ok_or(FrameError::OutOfBounds {
                    frame: F,
                    field: "role",
                    reason: "is neither \"broker\" nor \"source\"",
                })?;
                let sources = match role {
                    Role::Source => decode_sources(&f, F)?,
                    Role::Broker => Vec::new(),
                };
                let client_id = f.name(F, "client_id")?;
                let namespaces = f.array(F, "namespaces", MAX_NAMESPACES)?;
                let namespaces = namespaces
                    .iter()
                    .map(|v| name_of(v, F, "namespaces"))
                    .collect::<Result<Vec<_>, _>>()?;
                let versions = f.uints(F, "versions", MAX_VERSIONS)?;
                if versions.is_empty() {
                    return Err(FrameError::OutOfBounds {
                        frame: F,
                        field: "versions",
                        reason: "is empty",
                    });
                }
                let versions = versions
                    .into_iter()
                    .map(|v| {
                        u32::try_from(v).map_err(|_| FrameError::OutOfBounds {
                            frame: F,
                            field: "versions",
                            reason: "exceeds 2^32 - 1",
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Control::Hello(Hello {
                    client_id,
                    namespaces,
                    versions,
                    role,
                    sources,
                })
            }
            "welcome" => {
                const F: &str = "welcome";
                let limits = Limits {
                    max_streams: f.u32(F, "max_streams")?,
                    max_stream_buffer_bytes: f.u32(F, "max_stream_buffer_bytes")?,
                    heartbeat_interval: Duration::from_millis(f.u64(F, "heartbeat_interval_ms")?),
                    idle_timeout: Duration::from_millis(f.u64(F, "idle_timeout_ms")?),
                    // Version 1 routers do not send it.
                    max_sources: match value.get("max_sources") {
                        Some(_) => f.u32(F, "max_sources")?,
                        None => Limits::default().max_sources,
                    },
                };
                Control::Welcome(Welcome {
                    version: f.u32(F, "version")?,
                    session_id: f.u64(F, "session_id")?,
                    limits,
                })
            }
            "heartbeat" => Control::Heartbeat,
            "draining" => Control::Draining,
            "subscribe" => Control::Subscribe {
                stream_id: f.u64("subscribe", "stream_id")?,
                // One unusable target fails its stream, not the session.
                target: Target::decode(value.get("target")),
            },
            "announce" => Control::Announce {
                sources: decode_sources(&f, "announce")?,
            },
            "withdraw" => Control::Withdraw {
                publisher_ids: f.uints("withdraw", "publisher_ids", crate::tunnel::MAX_ANNOUNCE)?,
            },
            "announce_refused" => Control::AnnounceRefused {
                publisher_ids: f.uints(
                    "announce_refused",
                    "publisher_ids",
                    crate::tunnel::MAX_ANNOUNCE,
                )?,
                code: AnnounceRefusal::parse(f.str("announce_refused", "code", 64)?),
            },
            "denied" => Control::Denied {
                code: DenyCode::parse(f.str("denied", "code", 64)?),
            },
            "unsubscribe" => Control::Unsubscribe {
                stream_id: f.u64("unsubscribe", "stream_id")?,
            },
            "stream_opened" => Control::StreamOpened {
                stream_id: f.u64("stream_opened", "stream_id")?,
            },
            "drain" => Control::Drain {
                deadline: Duration::from_millis(f.u64("drain", "deadline_ms")?),
                reason: DrainReason::parse(f.str("drain", "reason", 64)?),
            },
            "stream_refused" => Control::StreamRefused {
                stream_id: f.u64("stream_refused", "stream_id")?,
                code: RefuseCode::parse(f.str("stream_refused", "code", 64)?),
            },
            "stream_closed" => Control::StreamClosed {
                stream_id: f.u64("stream_closed", "stream_id")?,
                code: CloseCode::parse(f.str("stream_closed", "code", 64)?),
            },
            _ => Control::Unknown,
        })
    }
}

/// Every frame `next` yields, encoded one after the other (a session's outbox in one
/// write).
pub(crate) fn encode_frames(mut next: impl FnMut() -> Option<Control>) -> bytes::Bytes {
    let mut wire = Vec::new();
    while let Some(frame) = next() {
        frame.encode(&mut wire);
    }
    bytes::Bytes::from(wire)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Reads control frames from a byte stream, one at a time, holding at most one
/// frame's body. Sans-IO: hand it what arrived, in any pieces.
///
/// ```
/// use eventplane::tunnel::protocol::{Control, ControlDecoder, FrameError};
/// let mut wire = Vec::new();
/// Control::Heartbeat.encode(&mut wire);
/// Control::Draining.encode(&mut wire);
/// let mut decoder = ControlDecoder::default();
/// let (first, second) = wire.split_at(3); // any split
/// let mut input = first;
/// assert_eq!(decoder.decode(&mut input)?, None);
/// let mut input = second;
/// assert_eq!(decoder.decode(&mut input)?, Some(Control::Heartbeat));
/// assert_eq!(decoder.decode(&mut input)?, Some(Control::Draining));
/// // A forged length is refused before anything of it is buffered.
/// let mut forged = &[0xff, 0xff, 0xff, 0xff][..];
/// assert!(matches!(decoder.decode(&mut forged), Err(FrameError::Oversized { .. })));
/// # Ok::<(), FrameError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ControlDecoder {
    max: usize,
    header: [u8; 4],
    header_len: usize,
    /// The body being assembled, once the header is complete.
    body: Option<(usize, Vec<u8>)>,
}

impl Default for ControlDecoder {
    fn default() -> Self {
        ControlDecoder::new(MAX_CONTROL_FRAME)
    }
}

impl ControlDecoder {
    /// A decoder accepting bodies of at most `max_frame` bytes.
    pub fn new(max_frame: usize) -> ControlDecoder {
        ControlDecoder {
            max: max_frame,
            header: [0; 4],
            header_len: 0,
            body: None,
        }
    }

    /// Takes bytes from the front of `input` until one frame is complete, and returns
    /// it; `Ok(None)` when `input` ran out first (the partial frame is kept). After an
    /// error the stream is unusable.
    pub fn decode(&mut self, input: &mut &[u8]) -> Result<Option<Control>, FrameError> {
        loop {
            if let Some((len, body)) = &mut self.body {
                let want = *len - body.len();
                let take = want.min(input.len());
                let (now, rest) = input.split_at(take);
                body.extend_from_slice(now);
                *input = rest;
                if body.len() < *len {
                    return Ok(None);
                }
                let frame = Control::decode_body(body);
                self.body = None;
                self.header_len = 0;
                return frame.map(Some);
            }
            let Some((&byte, rest)) = input.split_first() else {
                return Ok(None);
            };
            *input = rest;
            if let Some(slot) = self.header.get_mut(self.header_len) {
                *slot = byte;
            }
            self.header_len += 1;
            if self.header_len == 4 {
                let len = u32::from_be_bytes(self.header) as usize;
                if len > self.max {
                    return Err(FrameError::Oversized { len, max: self.max });
                }
                self.body = Some((len, Vec::with_capacity(len)));
            }
        }
    }

    /// Bytes of a partial frame held now.
    pub fn buffered(&self) -> usize {
        self.header_len + self.body.as_ref().map_or(0, |(_, b)| b.len())
    }
}

/// Whether `target` can be a `subscribe`'s target: `tcp://host:port`, 1 ..= 1024
/// bytes. What no broker could dial is never sent.
pub(crate) fn is_valid_target(target: &str) -> bool {
    !target.is_empty() && target.len() <= MAX_NAME_LEN && crate::zmtp::parse_tcp(target).is_ok()
}
