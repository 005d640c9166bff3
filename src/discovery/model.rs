//! The discovery data model: channel ids and their path form, transports, instances,
//! queries and watch events.

use std::fmt;

use super::DiscoveryError;

/// Largest publisher id: 2^53 − 1, so ids survive JSON numbers parsed as doubles.
///
/// ```
/// use eventplane::discovery::{ChannelId, MAX_PUBLISHER_ID};
/// assert_eq!(MAX_PUBLISHER_ID, (1 << 53) - 1); // exact as a JSON double
/// assert!(ChannelId::new("ns", "c", "t", MAX_PUBLISHER_ID + 1).is_err());
/// ```
pub const MAX_PUBLISHER_ID: u64 = (1 << 53) - 1;

/// Identifies one publisher's channel: `namespace / component / topic / publisher_id`.
///
/// The path form `{ns}/{component}/{topic}/{publisher_id:x}` percent-encodes each
/// segment: `[A-Za-z0-9_-]` stay, every other byte becomes `%XX` (upper-case hex), so
/// `/`, `.`, `*`, `>` and spaces can never change the path's structure.
///
/// ```
/// use eventplane::discovery::ChannelId;
/// let id = ChannelId::new("prod", "vllm worker", "kv/events", 42)?;
/// assert_eq!(id.to_path(), "prod/vllm%20worker/kv%2Fevents/2a");
/// assert_eq!(ChannelId::from_path(&id.to_path())?, id);
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelId {
    /// Shared by every copy: a subscriber keeps an id in several tables per
    /// publisher, and thousands of publishers make copies of three strings add up.
    segments: std::sync::Arc<Segments>,
    publisher_id: u64,
}

#[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Segments {
    namespace: String,
    component: String,
    topic: String,
}

impl fmt::Debug for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelId")
            .field("namespace", &self.segments.namespace)
            .field("component", &self.segments.component)
            .field("topic", &self.segments.topic)
            .field("publisher_id", &self.publisher_id)
            .finish()
    }
}

impl serde::Serialize for ChannelId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = serializer.serialize_struct("ChannelId", 4)?;
        out.serialize_field("namespace", &self.segments.namespace)?;
        out.serialize_field("component", &self.segments.component)?;
        out.serialize_field("topic", &self.segments.topic)?;
        out.serialize_field("publisher_id", &self.publisher_id)?;
        out.end()
    }
}

impl ChannelId {
    /// A channel id. Segments must be non-empty; `publisher_id` must be at most
    /// [`MAX_PUBLISHER_ID`].
    pub fn new(
        namespace: impl Into<String>,
        component: impl Into<String>,
        topic: impl Into<String>,
        publisher_id: u64,
    ) -> Result<ChannelId, DiscoveryError> {
        let segments = Segments {
            namespace: namespace.into(),
            component: component.into(),
            topic: topic.into(),
        };
        for (name, seg) in [
            ("namespace", &segments.namespace),
            ("component", &segments.component),
            ("topic", &segments.topic),
        ] {
            if seg.is_empty() {
                return Err(DiscoveryError::invalid(format!("{name} is empty")));
            }
        }
        if publisher_id > MAX_PUBLISHER_ID {
            return Err(DiscoveryError::invalid(format!(
                "publisher_id {publisher_id} exceeds 2^53-1"
            )));
        }
        Ok(ChannelId {
            segments: std::sync::Arc::new(segments),
            publisher_id,
        })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.segments.namespace
    }
    /// The component.
    pub fn component(&self) -> &str {
        &self.segments.component
    }
    /// The topic.
    pub fn topic(&self) -> &str {
        &self.segments.topic
    }
    /// The publisher id (≤ 2^53 − 1).
    pub fn publisher_id(&self) -> u64 {
        self.publisher_id
    }

    /// The percent-encoded path form.
    pub fn to_path(&self) -> String {
        let s = &self.segments;
        let mut out =
            String::with_capacity(s.namespace.len() + s.component.len() + s.topic.len() + 20);
        for seg in [&s.namespace, &s.component, &s.topic] {
            encode_segment(seg, &mut out);
            out.push('/');
        }
        out.push_str(&format!("{:x}", self.publisher_id));
        out
    }

    /// Parses the path form; rejects wrong segment counts, bad escapes, non-UTF-8
    /// segments and out-of-range ids.
    pub fn from_path(path: &str) -> Result<ChannelId, DiscoveryError> {
        let mut parts = path.split('/');
        let (Some(ns), Some(comp), Some(topic), Some(id), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(DiscoveryError::invalid("path must have exactly 4 segments"));
        };
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(DiscoveryError::invalid("publisher id is not hex"));
        }
        let publisher_id = u64::from_str_radix(id, 16)
            .map_err(|_| DiscoveryError::invalid("publisher id out of range"))?;
        ChannelId::new(
            decode_segment(ns)?,
            decode_segment(comp)?,
            decode_segment(topic)?,
            publisher_id,
        )
    }
}

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_path())
    }
}

pub(crate) fn encode_segment(seg: &str, out: &mut String) {
    for &b in seg.as_bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0xf));
        }
    }
}

/// Upper-case hex digit of a nibble (`n < 16`).
fn hex_digit(n: u8) -> char {
    char::from(if n < 10 { b'0' + n } else { b'A' + n - 10 })
}

pub(crate) fn decode_segment(seg: &str) -> Result<String, DiscoveryError> {
    let mut out = Vec::with_capacity(seg.len());
    let mut bytes = seg.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hi = bytes.next().and_then(hex_value);
                let lo = bytes.next().and_then(hex_value);
                match (hi, lo) {
                    (Some(hi), Some(lo)) => out.push(hi << 4 | lo),
                    _ => return Err(DiscoveryError::invalid("truncated or non-hex escape")),
                }
            }
            b if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' => out.push(b),
            _ => return Err(DiscoveryError::invalid("unescaped reserved character")),
        }
    }
    String::from_utf8(out).map_err(|_| DiscoveryError::invalid("segment is not UTF-8"))
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// How the endpoint of an announced publisher begins.
pub(crate) const ANNOUNCED_SCHEME: &str = "announced://";

/// How to reach a publisher.
///
/// ```
/// use eventplane::discovery::Transport;
/// let t = Transport::zmq("tcp://10.0.0.5:41234");
/// assert_eq!(t.endpoint(), "tcp://10.0.0.5:41234");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// A ZMQ PUB at `tcp://host:port`.
    Zmq {
        /// The endpoint.
        endpoint: String,
    },
    /// A publisher a source announced on an event bus (feature `tunnel`, DESIGN
    /// §7.4): reached only through that bus, by its publisher id. `endpoint` names
    /// the announcing session (`announced://CLIENT_ID/SESSION_ID`), for logs; a new
    /// session is a new endpoint.
    Announced {
        /// The announcing session's name.
        endpoint: String,
    },
}

impl Transport {
    /// A ZMQ transport.
    pub fn zmq(endpoint: impl Into<String>) -> Transport {
        Transport::Zmq {
            endpoint: endpoint.into(),
        }
    }

    /// A publisher announced by session `session_id` of source `client_id`.
    ///
    /// ```
    /// use eventplane::discovery::Transport;
    /// let t = Transport::announced("gpu-box-1", 7);
    /// assert_eq!(t.endpoint(), "announced://gpu-box-1/7");
    /// assert!(t.is_announced());
    /// ```
    pub fn announced(client_id: &str, session_id: u64) -> Transport {
        Transport::Announced {
            endpoint: format!("{ANNOUNCED_SCHEME}{client_id}/{session_id}"),
        }
    }

    /// Whether it is reached through an event bus's announced source.
    pub fn is_announced(&self) -> bool {
        matches!(self, Transport::Announced { .. })
    }

    /// The endpoint to dial (for an announced publisher, its session's name).
    pub fn endpoint(&self) -> &str {
        match self {
            Transport::Zmq { endpoint } | Transport::Announced { endpoint } => endpoint,
        }
    }
}

/// A registered publisher as the backend knows it.
///
/// `incarnation` is assigned by the backend at every (re)registration and is strictly
/// greater than any earlier incarnation of the same id.
///
/// ```
/// use eventplane::discovery::{ChannelId, Instance, Transport};
/// let id = ChannelId::new("ns", "c", "t", 7)?;
/// let instance = Instance::new(id, Transport::zmq("tcp://127.0.0.1:5555"), 3);
/// assert_eq!(instance.incarnation, 3);
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Instance {
    /// The channel.
    pub id: ChannelId,
    /// How to reach it.
    pub transport: Transport,
    /// Strictly increasing per id across re-registrations.
    pub incarnation: u64,
    /// The worker whose events this publisher sends, when it registered one (see
    /// [`Discovery::register_with`](super::Discovery::register_with)). A router maps
    /// deliveries to workers with it instead of reading payloads.
    pub worker: Option<WorkerIdentity>,
    /// Where the worker serves its recovery log (`tcp://host:port`, a
    /// [`kv::pipeline::RecoveryServer`](crate::kv::pipeline::RecoveryServer)), when it registered one
    /// (see [`Discovery::register_instance`](super::Discovery::register_instance)): a
    /// router that lost some of this publisher's events asks there instead of
    /// forgetting the worker's blocks. From Dynamo's records, the worker's
    /// `recovery_target`: `dynamo+CODEC://HOST:PORT/PATH?worker_id=W&dp_rank=R`, asked
    /// over Dynamo's request plane (see
    /// [`RecoveryDriver::dynamo`](crate::kv::router::RecoveryDriver)).
    pub recovery: Option<String>,
}

impl Instance {
    /// An instance (backends and tests build these).
    pub fn new(id: ChannelId, transport: Transport, incarnation: u64) -> Instance {
        Instance {
            id,
            transport,
            incarnation,
            worker: None,
            recovery: None,
        }
    }

    /// The same instance, with the endpoint where its worker serves its recovery log.
    ///
    /// ```
    /// use eventplane::discovery::{ChannelId, Instance, Transport};
    /// let id = ChannelId::new("ns", "c", "t", 7)?;
    /// let instance = Instance::new(id, Transport::zmq("tcp://127.0.0.1:5555"), 1)
    ///     .with_recovery("tcp://127.0.0.1:5556");
    /// assert_eq!(instance.recovery.as_deref(), Some("tcp://127.0.0.1:5556"));
    /// # Ok::<(), eventplane::discovery::DiscoveryError>(())
    /// ```
    #[must_use]
    pub fn with_recovery(mut self, endpoint: impl Into<String>) -> Instance {
        self.recovery = Some(endpoint.into());
        self
    }

    /// What a backend registers of it: id, transport, worker, recovery endpoint (the
    /// incarnation is the backend's to give).
    pub(crate) fn into_registered(
        self,
    ) -> (ChannelId, Transport, Option<WorkerIdentity>, Option<String>) {
        (self.id, self.transport, self.worker, self.recovery)
    }

    /// The same instance, naming the worker it publishes for.
    ///
    /// ```
    /// use eventplane::discovery::{ChannelId, Instance, Transport, WorkerIdentity};
    /// let id = ChannelId::new("ns", "c", "t", 7)?;
    /// let instance = Instance::new(id, Transport::zmq("tcp://127.0.0.1:5555"), 1)
    ///     .with_worker(WorkerIdentity::new(42, 1));
    /// assert_eq!(instance.worker.map(|w| (w.worker_id.0, w.dp_rank)), Some((42, 1)));
    /// # Ok::<(), eventplane::discovery::DiscoveryError>(())
    /// ```
    #[must_use]
    pub fn with_worker(mut self, worker: WorkerIdentity) -> Instance {
        self.worker = Some(worker);
        self
    }
}

/// A worker (one engine instance; Dynamo: its instance id).
///
/// ```
/// use eventplane::kv::WorkerId;
/// // Serialized as the bare number.
/// assert_eq!(serde_json::to_string(&WorkerId(7)).unwrap(), "7");
/// assert_eq!(WorkerId::from(7), WorkerId(7));
/// ```
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct WorkerId(pub u64);

impl From<u64> for WorkerId {
    fn from(id: u64) -> WorkerId {
        WorkerId(id)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A data-parallel rank within a worker.
///
/// ```
/// use eventplane::kv::{DpRank, KvEvent, KvEventData};
/// let rank: DpRank = 2;
/// let ev = KvEvent { id: 1, dp_rank: rank, data: KvEventData::Cleared };
/// assert_eq!(ev.dp_rank, 2);
/// ```
pub type DpRank = u32;

/// Which worker a publisher speaks for: the identity Dynamo's records carry
/// (`worker_id`, `dp_rank`), travelling in the discovery record so that a router knows
/// the worker of every delivery before decoding it.
///
/// ```
/// use eventplane::discovery::{WorkerId, WorkerIdentity};
/// let w = WorkerIdentity::new(7, 0);
/// assert_eq!((w.worker_id, w.dp_rank), (WorkerId(7), 0));
/// assert_eq!(w.to_string(), "worker 7 rank 0");
/// ```
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerIdentity {
    /// The worker (Dynamo: the worker's instance id).
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
}

impl WorkerIdentity {
    /// A worker identity.
    pub fn new(worker_id: impl Into<WorkerId>, dp_rank: DpRank) -> WorkerIdentity {
        WorkerIdentity {
            worker_id: worker_id.into(),
            dp_rank,
        }
    }
}

impl fmt::Display for WorkerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} rank {}", self.worker_id, self.dp_rank)
    }
}

/// Which instances a `list` or `watch` covers: exact match on each given field.
///
/// ```
/// use eventplane::discovery::{ChannelId, Query};
/// let q = Query::new("ns").component("comp");
/// assert!(q.matches(&ChannelId::new("ns", "comp", "t", 1)?));
/// assert!(!q.matches(&ChannelId::new("ns", "comp2", "t", 1)?)); // no prefix accidents
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[must_use]
pub struct Query {
    namespace: String,
    component: Option<String>,
    topic: Option<String>,
}

impl Query {
    /// Everything in `namespace`.
    pub fn new(namespace: impl Into<String>) -> Query {
        Query {
            namespace: namespace.into(),
            component: None,
            topic: None,
        }
    }

    /// Only this component.
    pub fn component(mut self, component: impl Into<String>) -> Query {
        self.component = Some(component.into());
        self
    }

    /// Only this topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Query {
        self.topic = Some(topic.into());
        self
    }

    /// The namespace.
    pub fn namespace_filter(&self) -> &str {
        &self.namespace
    }
    /// The component, if restricted.
    pub fn component_filter(&self) -> Option<&str> {
        self.component.as_deref()
    }
    /// The topic, if restricted.
    pub fn topic_filter(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    /// Exact match on every given field.
    pub fn matches(&self, id: &ChannelId) -> bool {
        id.namespace() == self.namespace
            && self
                .component
                .as_deref()
                .is_none_or(|c| c == id.component())
            && self.topic.as_deref().is_none_or(|t| t == id.topic())
    }
}

/// One change seen by a watch. See [`Discovery::watch`](super::Discovery::watch) for
/// the contract.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, Transport};
/// use std::collections::HashMap;
/// // A consumer's state, driven by events.
/// let mut known: HashMap<ChannelId, Instance> = HashMap::new();
/// let id = ChannelId::new("ns", "c", "t", 1)?;
/// let events = [
///     DiscoveryEvent::Resync(vec![]),
///     DiscoveryEvent::Added(Instance::new(id.clone(), Transport::zmq("tcp://10.0.0.5:1"), 3)),
///     DiscoveryEvent::Removed { id: id.clone(), incarnation: 3 },
/// ];
/// for ev in events {
///     match ev {
///         DiscoveryEvent::Added(i) => { known.insert(i.id.clone(), i); }
///         DiscoveryEvent::Removed { id, .. } => { known.remove(&id); }
///         DiscoveryEvent::Resync(all) => known = all.into_iter().map(|i| (i.id.clone(), i)).collect(),
///         _ => {}
///     }
/// }
/// assert!(known.is_empty());
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiscoveryEvent {
    /// A new instance, or a re-registration (new incarnation or endpoint).
    Added(Instance),
    /// An instance went away.
    Removed {
        /// Which.
        id: ChannelId,
        /// The incarnation that went away.
        incarnation: u64,
    },
    /// The complete current set: replace all state with it. The first one marks the
    /// end of the initial sync.
    Resync(Vec<Instance>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_prints_and_serializes_flat_its_copies_share_their_names() {
        let id = ChannelId::new("ns", "comp", "kv", 7).unwrap();
        assert_eq!(
            format!("{id:?}"),
            r#"ChannelId { namespace: "ns", component: "comp", topic: "kv", publisher_id: 7 }"#
        );
        assert_eq!(
            serde_json::to_string(&id).unwrap(),
            r#"{"namespace":"ns","component":"comp","topic":"kv","publisher_id":7}"#
        );
        let copy = id.clone();
        assert!(std::ptr::eq(id.namespace(), copy.namespace()));
        assert_eq!(copy, ChannelId::new("ns", "comp", "kv", 7).unwrap());
    }

    #[test]
    fn path_round_trips_reserved_characters() {
        for seg in [
            "a/b",
            "v1.2",
            "100%",
            "*",
            ">",
            "with space",
            "ünïcødé ✓",
            "_-Az09",
        ] {
            let id = ChannelId::new(seg, seg, seg, MAX_PUBLISHER_ID).unwrap();
            let path = id.to_path();
            assert_eq!(path.matches('/').count(), 3, "{path}");
            assert!(
                path.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"%_-/".contains(&b))
            );
            assert_eq!(ChannelId::from_path(&path).unwrap(), id);
        }
        assert_eq!(
            ChannelId::new("a.b", "c", "d", 255).unwrap().to_path(),
            "a%2Eb/c/d/ff"
        );
    }

    #[test]
    fn decoding_rejects_bad_input() {
        for bad in [
            "ns/c/t",
            "ns/c/t/1/extra",
            "ns/c/t/",
            "ns/c/t/xyz",
            "ns/c/t/-1",
            "n%2/c/t/1",
            "n%/c/t/1",
            "n%zz/c/t/1",
            "n%g1/c/t/1",
            "n.s/c/t/1",
            "%FF/c/t/1",
            "/c/t/1",
            "ns/c/t/20000000000000",
            "ns/c/t/10000000000000000000",
        ] {
            assert!(ChannelId::from_path(bad).is_err(), "{bad}");
        }
        assert!(ChannelId::from_path("n%2Fs/c/t/1fffffffffffff").is_ok());
    }

    #[test]
    fn publisher_id_bound() {
        assert!(ChannelId::new("n", "c", "t", MAX_PUBLISHER_ID).is_ok());
        assert!(ChannelId::new("n", "c", "t", MAX_PUBLISHER_ID + 1).is_err());
        assert!(ChannelId::new("", "c", "t", 1).is_err());
    }

    #[test]
    fn query_exact_fields() {
        let id = ChannelId::new("ns", "comp", "topic", 1).unwrap();
        assert!(Query::new("ns").matches(&id));
        assert!(!Query::new("n").matches(&id));
        assert!(!Query::new("nss").matches(&id));
        assert!(Query::new("ns").topic("topic").matches(&id));
        assert!(!Query::new("ns").topic("top").matches(&id));
        assert!(
            !Query::new("ns")
                .component("comp")
                .topic("topic2")
                .matches(&id)
        );
        assert!(
            Query::new("ns")
                .component("comp")
                .topic("topic")
                .matches(&id)
        );
    }
}
