//! Announced sources (DESIGN §7.4): what a session's second client role, the
//! *source*, says about the publishers it serves itself, and the target kinds a
//! `subscribe` may name.
//!
//! A source is a KV listener the router cannot dial (behind NAT, no broker beside it):
//! it dials out to the bus, announces its publishers (`hello`, then `announce` /
//! `withdraw`), and serves each `subscribe{target: announced{publisher_id}}` from its
//! own `PubSocket`, as one more subscriber connection.

use crate::discovery::{ChannelId, WorkerIdentity};
use crate::msgpack::Value;
use crate::wire::Dialect;

use crate::tunnel::protocol::fields::{Fields, FrameError, Writer};

/// Most sources one `hello`, `announce` or `withdraw` frame may carry.
pub(crate) const MAX_ANNOUNCE: usize = 64;

/// Longest namespace, component or topic of an announced source, in bytes (so that
/// [`MAX_ANNOUNCE`] of them fit one control frame).
pub(crate) const MAX_SOURCE_NAME_LEN: usize = 256;

/// The role a client takes on its session (named in its `hello`).
///
/// ```
/// use eventplane::tunnel::Role;
/// assert_eq!(Role::parse("source"), Some(Role::Source));
/// assert_eq!(Role::Broker.as_str(), "broker");
/// assert_eq!(Role::parse("router"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Role {
    /// Relays publishers it can reach, for any `tcp://` target in its discovery view.
    #[default]
    Broker,
    /// Serves the publishers it announces, and only those (protocol version 2).
    Source,
}

impl Role {
    /// The role's name on the wire.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Broker => "broker",
            Role::Source => "source",
        }
    }

    /// The role named `text`, if this version knows it.
    pub fn parse(text: &str) -> Option<Role> {
        match text {
            "broker" => Some(Role::Broker),
            "source" => Some(Role::Source),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A publisher a source announces: the channel it publishes, the worker whose events
/// these are, and the wire layout subscribers read it with.
///
/// ```
/// use eventplane::discovery::{ChannelId, WorkerIdentity};
/// use eventplane::tunnel::AnnouncedSource;
/// use eventplane::wire::Dialect;
/// let id = ChannelId::new("prod", "backend", "kv-events", 7)?;
/// let source = AnnouncedSource::new(&id, Dialect::Dynamo).with_worker(WorkerIdentity::new(42, 0));
/// assert_eq!(source.channel_id()?, id);
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AnnouncedSource {
    /// The publisher id (unique within the bus: a router addresses the source by it).
    pub publisher_id: u64,
    /// Its discovery namespace (the credential must grant it).
    pub namespace: String,
    /// Its component.
    pub component: String,
    /// Its topic.
    pub topic: String,
    /// The worker whose events it publishes.
    pub worker: Option<WorkerIdentity>,
    /// How its messages are framed.
    pub dialect: Dialect,
    /// Whether the source also serves its worker's recovery log
    /// ([`Source::announce_with_recovery`](crate::tunnel::Source::announce_with_recovery)):
    /// a router then asks it for what it lost through a
    /// [`Target::Recovery`] stream. `"recovery": true` on the wire, absent when
    /// `false` (a router of an earlier version ignores it).
    pub recovery: bool,
}

impl AnnouncedSource {
    /// The source publishing channel `id` in `dialect`.
    pub fn new(id: &ChannelId, dialect: Dialect) -> AnnouncedSource {
        AnnouncedSource {
            publisher_id: id.publisher_id(),
            namespace: id.namespace().to_owned(),
            component: id.component().to_owned(),
            topic: id.topic().to_owned(),
            worker: None,
            dialect,
            recovery: false,
        }
    }

    /// Naming the worker whose events it publishes.
    #[must_use]
    pub fn with_worker(mut self, worker: WorkerIdentity) -> AnnouncedSource {
        self.worker = Some(worker);
        self
    }

    /// Saying it serves its worker's recovery log (set by
    /// [`Source::announce_with_recovery`](crate::tunnel::Source::announce_with_recovery)).
    #[must_use]
    pub fn with_recovery(mut self) -> AnnouncedSource {
        self.recovery = true;
        self
    }

    /// The channel it publishes (an error when a name or the id is out of bounds).
    pub fn channel_id(&self) -> Result<ChannelId, crate::discovery::DiscoveryError> {
        ChannelId::new(
            &self.namespace,
            &self.component,
            &self.topic,
            self.publisher_id,
        )
    }

    /// Why it cannot be announced, if it cannot.
    pub(crate) fn check(&self) -> Result<(), &'static str> {
        let long = [&self.namespace, &self.component, &self.topic]
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_SOURCE_NAME_LEN);
        if long {
            return Err("has a namespace, component or topic empty or over 256 bytes");
        }
        self.channel_id()
            .map(drop)
            .map_err(|_| "is not a valid channel")
    }

    pub(crate) fn encode(&self, w: &mut Writer<'_>) {
        let entries = 5 + if self.worker.is_some() { 2 } else { 0 } + u8::from(self.recovery);
        w.map(entries);
        w.entry_uint("publisher_id", self.publisher_id);
        w.entry_str("namespace", &self.namespace);
        w.entry_str("component", &self.component);
        w.entry_str("topic", &self.topic);
        w.entry_str("wire", self.dialect.as_str());
        if let Some(worker) = self.worker {
            w.entry_uint("worker_id", worker.worker_id.0);
            w.entry_uint("dp_rank", u64::from(worker.dp_rank));
        }
        if self.recovery {
            w.str("recovery");
            w.bool(true);
        }
    }

    pub(crate) fn decode(value: &Value<'_>, frame: &'static str) -> Result<Self, FrameError> {
        let bad = |reason| FrameError::OutOfBounds {
            frame,
            field: "sources",
            reason,
        };
        if !matches!(value, Value::Map(_)) {
            return Err(FrameError::Field {
                frame,
                field: "sources",
            });
        }
        let f = Fields { value };
        let name = |field| f.str(frame, field, MAX_SOURCE_NAME_LEN).map(str::to_owned);
        let worker = match (value.get("worker_id"), value.get("dp_rank")) {
            (None, None) => None,
            _ => Some(WorkerIdentity::new(
                f.u64(frame, "worker_id")?,
                f.u32(frame, "dp_rank")?,
            )),
        };
        let source = AnnouncedSource {
            publisher_id: f.u64(frame, "publisher_id")?,
            namespace: name("namespace")?,
            component: name("component")?,
            topic: name("topic")?,
            worker,
            dialect: f
                .str(frame, "wire", 32)?
                .parse()
                .map_err(|_| bad("names a wire this version does not know"))?,
            recovery: matches!(value.get("recovery"), Some(Value::Bool(true))),
        };
        source.check().map_err(bad)?;
        Ok(source)
    }
}

/// Encodes `sources` as an array.
pub(crate) fn encode_sources(w: &mut Writer<'_>, sources: &[AnnouncedSource]) {
    w.array(sources.len());
    for source in sources {
        source.encode(w);
    }
}

/// Decodes the array `field` of at most [`MAX_ANNOUNCE`] sources.
pub(crate) fn decode_sources(
    f: &Fields<'_, '_>,
    frame: &'static str,
) -> Result<Vec<AnnouncedSource>, FrameError> {
    f.array(frame, "sources", MAX_ANNOUNCE)?
        .into_iter()
        .map(|v| AnnouncedSource::decode(v, frame))
        .collect()
}

/// What a `subscribe` asks to open.
///
/// ```
/// use eventplane::tunnel::Target;
/// assert_eq!(Target::from("tcp://10.0.0.5:5557"), Target::Tcp("tcp://10.0.0.5:5557".into()));
/// assert!(Target::Announced { publisher_id: 7 }.is_announced());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Target {
    /// A publisher endpoint a broker dials, `tcp://host:port` (a plain string on the
    /// wire, as in version 1). One the decoder cannot take (not a string, empty, over
    /// 1 KiB) reads as an empty string, refused with `bad_target`.
    Tcp(String),
    /// A publisher the session's source announced (`{"announced": {"publisher_id":
    /// N}}` on the wire; version 2).
    Announced {
        /// The announced publisher.
        publisher_id: u64,
    },
    /// The recovery log of a publisher the session's source announced with
    /// `recovery` (`{"recovery": {"publisher_id": N}}` on the wire): the source serves
    /// the stream from its recovery endpoint. A source of an earlier version refuses
    /// it with `unsupported_target`.
    Recovery {
        /// The announced publisher.
        publisher_id: u64,
    },
    /// A target kind this version does not know (a map from a newer peer): refused
    /// with `unsupported_target`.
    Unsupported,
}

impl Target {
    /// Whether it names an announced source.
    pub fn is_announced(&self) -> bool {
        matches!(self, Target::Announced { .. })
    }

    pub(crate) fn encode(&self, w: &mut Writer<'_>) {
        match self {
            Target::Tcp(endpoint) => w.str(endpoint),
            Target::Announced { publisher_id } => {
                w.map(1);
                w.str("announced");
                w.map(1);
                w.entry_uint("publisher_id", *publisher_id);
            }
            Target::Recovery { publisher_id } => {
                w.map(1);
                w.str("recovery");
                w.map(1);
                w.entry_uint("publisher_id", *publisher_id);
            }
            Target::Unsupported => w.map(0),
        }
    }

    pub(crate) fn decode(value: Option<&Value<'_>>) -> Target {
        match value {
            Some(Value::Map(_)) => {
                let id = |kind| {
                    value
                        .and_then(|v| v.get(kind))
                        .and_then(|a| a.get("publisher_id"))
                        .and_then(Value::as_u64)
                };
                match (id("announced"), id("recovery")) {
                    (Some(publisher_id), None) => Target::Announced { publisher_id },
                    (None, Some(publisher_id)) => Target::Recovery { publisher_id },
                    _ => Target::Unsupported,
                }
            }
            Some(v) => Target::Tcp(
                v.as_str()
                    .filter(|s| s.len() <= crate::tunnel::MAX_NAME_LEN)
                    .unwrap_or_default()
                    .to_owned(),
            ),
            None => Target::Tcp(String::new()),
        }
    }
}

impl From<String> for Target {
    fn from(endpoint: String) -> Target {
        Target::Tcp(endpoint)
    }
}

impl From<&str> for Target {
    fn from(endpoint: &str) -> Target {
        Target::Tcp(endpoint.to_owned())
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(endpoint) => f.write_str(endpoint),
            Target::Announced { publisher_id } => write!(f, "announced:{publisher_id:x}"),
            Target::Recovery { publisher_id } => write!(f, "recovery:{publisher_id:x}"),
            Target::Unsupported => f.write_str("(unsupported target)"),
        }
    }
}
