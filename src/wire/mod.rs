//! Event-plane wire layouts: how a message's frames carry the topic, the publisher id,
//! the sequence and the payload, for every kind of publisher we read and write.
//!
//! One place for every layout: [`EventPublisher`](crate::publish::EventPublisher)
//! writes with [`Dialect::encode`], the [`DynamicSubscriber`](crate::subscriber) and the
//! engine listener ([`kv::engine::EngineListener`](crate::kv::engine::EngineListener)) read with
//! [`Layout::parse`], and one sequence tracker serves them all.
//!
//! | [`Layout`] | frames | written by |
//! |---|---|---|
//! | `Raw` | anything | any PUB |
//! | `TopicSeq` | `[topic, seq u64be, payload…]` | vLLM / SGLang engines |
//! | `TopicPublisherSeq` | `[topic, publisher_id u64be, seq u64be, payload…]` | our `EventPublisher` ([`Dialect::EventPlane`]) |
//! | `Dynamo` | `[topic, publisher_id u64be, seq u64be, 0x01 + u32be len + envelope]` | NVIDIA Dynamo ≥ 1.6, our `EventPublisher` with [`Dialect::Dynamo`] |
//!
//! A Dynamo message's fourth frame is a msgpack envelope
//! `{publisher_id, sequence, published_at, topic, payload: bin}` whose identity must
//! equal frames 0–2 ([`parse_dynamo_frame`]). A message that does not fit its layout
//! is skipped with a [`WireError`]; readers count each reason ([`MalformedStats`]) and
//! go on.

mod dynamo;
mod seq;

use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

pub use dynamo::{DynamoEnvelope, encode_dynamo_frame, parse_dynamo_frame};
pub(crate) use seq::{SeqStep, SeqTracker};

use crate::zmtp::Message;

/// How a publisher frames its messages (what a reader expects).
///
/// ```
/// use eventplane::wire::Layout;
/// // What our own `EventPublisher` sends, so a reader with the defaults sees its gaps.
/// assert_eq!(Layout::default(), Layout::TopicPublisherSeq);
/// assert_eq!(Layout::TopicPublisherSeq.as_str(), "topic-publisher-seq");
/// assert_eq!("dynamo".parse::<Layout>()?, Layout::Dynamo);
/// # Ok::<(), eventplane::wire::UnknownName>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Layout {
    /// Any frames; no sequence.
    Raw,
    /// `[topic, seq u64be, payload…]` (vLLM / SGLang engines).
    TopicSeq,
    /// `[topic, publisher_id u64be, seq u64be, payload…]` (our `EventPublisher`; the
    /// default).
    #[default]
    TopicPublisherSeq,
    /// `[topic, publisher_id u64be, seq u64be, 0x01 + u32be len + msgpack envelope]`
    /// (Dynamo's event plane): exactly four frames, the envelope's identity equal to
    /// frames 0–2.
    Dynamo,
}

impl Layout {
    /// Every layout, in the order of [`as_str`](Self::as_str)'s documentation.
    pub const ALL: [Layout; 4] = [
        Layout::Raw,
        Layout::TopicSeq,
        Layout::TopicPublisherSeq,
        Layout::Dynamo,
    ];

    /// The spelling of the examples' `--layout` flag: `raw`, `topic-seq`,
    /// `topic-publisher-seq`, `dynamo`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Layout::Raw => "raw",
            Layout::TopicSeq => "topic-seq",
            Layout::TopicPublisherSeq => "topic-publisher-seq",
            Layout::Dynamo => "dynamo",
        }
    }

    /// Checks `message` against this layout and, when given, the exact `topic` of
    /// frame 0; returns what the frames carry.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use eventplane::wire::{Layout, Dialect, WireError};
    /// let message = Dialect::Dynamo.encode(&Bytes::from_static(b"kv-events"), 42, 1, Bytes::from_static(b"p"));
    /// let framed = Layout::Dynamo.parse(Some(b"kv-events"), &message)?;
    /// assert_eq!((framed.publisher_id, framed.sequence), (Some(42), Some(1)));
    /// assert_eq!(framed.payload.as_deref(), Some(&b"p"[..]));
    /// assert_eq!(Layout::Dynamo.parse(Some(b"kv"), &message).unwrap_err(), WireError::WrongTopic);
    /// # Ok::<(), WireError>(())
    /// ```
    pub fn parse(&self, topic: Option<&[u8]>, message: &Message) -> Result<Framed, WireError> {
        let mut framed = self.locate(topic, message)?;
        framed.payload = framed.payload_at.and_then(|at| at.get(message));
        Ok(framed)
    }

    /// [`parse`](Self::parse) without making the payload's `Bytes` handle: only where it
    /// lies (`payload_at`), for readers that keep the message and slice it later.
    pub(crate) fn locate(
        &self,
        topic: Option<&[u8]>,
        message: &Message,
    ) -> Result<Framed, WireError> {
        if let Some(topic) = topic {
            if message.get(0) != Some(topic) {
                return Err(WireError::WrongTopic);
            }
        }
        let u64_at = |i: usize| -> Result<u64, WireError> {
            let frame = message.get(i).ok_or(WireError::Frames(message.len()))?;
            <[u8; 8]>::try_from(frame)
                .map(u64::from_be_bytes)
                .map_err(|_| WireError::IdFrame {
                    index: i,
                    len: frame.len(),
                })
        };
        let min_frames = |n: usize| {
            if message.len() < n {
                Err(WireError::Frames(message.len()))
            } else {
                Ok(())
            }
        };
        match self {
            Layout::Raw => Ok(Framed::default()),
            Layout::TopicSeq => {
                min_frames(3)?;
                Ok(Framed::with_payload(None, u64_at(1)?, message, 2, None))
            }
            Layout::TopicPublisherSeq => {
                min_frames(4)?;
                let publisher_id = u64_at(1)?;
                Ok(Framed::with_payload(
                    Some(publisher_id),
                    u64_at(2)?,
                    message,
                    3,
                    None,
                ))
            }
            Layout::Dynamo => {
                let (4, Some(topic), Some(frame)) = (message.len(), message.get(0), message.get(3))
                else {
                    return Err(WireError::Frames(message.len()));
                };
                let (publisher_id, sequence) = (u64_at(1)?, u64_at(2)?);
                let envelope = parse_dynamo_frame(frame)?;
                if envelope.topic.as_bytes() != topic {
                    return Err(WireError::Identity("topic"));
                }
                if envelope.publisher_id != publisher_id {
                    return Err(WireError::Identity("publisher_id"));
                }
                if envelope.sequence != sequence {
                    return Err(WireError::Identity("sequence"));
                }
                // The envelope's payload is a slice of the frame (empty or not): its
                // offset is where it starts.
                let start =
                    (envelope.payload.as_ptr() as usize).wrapping_sub(frame.as_ptr() as usize);
                let range = (start, envelope.payload.len());
                Ok(Framed::with_payload(
                    Some(publisher_id),
                    sequence,
                    message,
                    3,
                    Some(range),
                ))
            }
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Layout {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Layout, UnknownName> {
        Layout::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| UnknownName {
                name: s.chars().take(64).collect(),
                expected: "raw, topic-seq, topic-publisher-seq or dynamo",
            })
    }
}

/// Ours or NVIDIA Dynamo's: the one name for whose conventions a part speaks, at
/// every layer where the two differ.
///
/// | layer | [`EventPlane`](Dialect::EventPlane) (default) | [`Dynamo`](Dialect::Dynamo) | where |
/// |---|---|---|---|
/// | frames | `[topic, publisher_id, seq, payload]` | `[topic, publisher_id, seq, 0x01 + len + envelope]` | [`layout`](Self::layout), [`encode`](Self::encode), `EventPublisherBuilder::dialect` |
/// | router events | msgpack, our field names | Dynamo 1.6's schema | [`encode_router_events`](Self::encode_router_events), [`decode_router_events`](Self::decode_router_events) |
/// | etcd records | `{prefix}/v1/channels/…` | `v1/event_channels/…` + `v1/event_sources/…` | `EtcdDiscoveryBuilder::dialect` (Kubernetes: Dynamo's only) |
///
/// ```
/// use eventplane::wire::{Layout, Dialect};
/// assert_eq!(Dialect::default(), Dialect::EventPlane);
/// assert_eq!(Dialect::Dynamo.layout(), Layout::Dynamo);
/// assert_eq!("eventplane".parse::<Dialect>()?.layout(), Layout::TopicPublisherSeq);
/// # Ok::<(), eventplane::wire::UnknownName>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dialect {
    /// `[topic, publisher_id u64be, seq u64be, payload]`; router events as msgpack
    /// with our field names.
    #[default]
    EventPlane,
    /// Dynamo's frames (a framed msgpack envelope); router events in Dynamo's
    /// schema.
    Dynamo,
}

impl Dialect {
    /// The layout subscribers read this dialect's frames with.
    pub fn layout(&self) -> Layout {
        match self {
            Dialect::EventPlane => Layout::TopicPublisherSeq,
            Dialect::Dynamo => Layout::Dynamo,
        }
    }

    /// The spelling of the examples' `--wire` flag: `eventplane` or `dynamo`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Dialect::EventPlane => "eventplane",
            Dialect::Dynamo => "dynamo",
        }
    }

    /// One message on this wire. Dynamo's envelope is stamped with the current time
    /// (`published_at`, milliseconds since the Unix epoch).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use eventplane::wire::Dialect;
    /// let topic = Bytes::from_static(b"t");
    /// let ours = Dialect::EventPlane.encode(&topic, 42, 0, Bytes::from_static(b"p"));
    /// assert_eq!(ours.len(), 4);
    /// assert_eq!(ours.get(1).unwrap(), &42u64.to_be_bytes());
    /// assert_eq!(ours.get(3).unwrap(), b"p");
    /// ```
    pub fn encode(
        &self,
        topic: &Bytes,
        publisher_id: u64,
        sequence: u64,
        payload: Bytes,
    ) -> Message {
        let id = Bytes::copy_from_slice(&publisher_id.to_be_bytes());
        self.encode_with_id(topic, publisher_id, &id, sequence, payload)
    }

    /// [`encode`](Self::encode) with the publisher-id frame made once by the caller
    /// (a publisher sends the same one with every message).
    pub(crate) fn encode_with_id(
        &self,
        topic: &Bytes,
        publisher_id: u64,
        id: &Bytes,
        sequence: u64,
        payload: Bytes,
    ) -> Message {
        let id = id.clone();
        let seq = Bytes::copy_from_slice(&sequence.to_be_bytes());
        match self {
            Dialect::EventPlane => Message::from_parts([topic.clone(), id, seq, payload]),
            Dialect::Dynamo => {
                let mut frame = Vec::with_capacity(payload.len() + topic.len() + 80);
                encode_dynamo_frame(
                    &String::from_utf8_lossy(topic),
                    publisher_id,
                    sequence,
                    unix_millis(),
                    &payload,
                    &mut frame,
                );
                Message::from_parts([topic.clone(), id, seq, Bytes::from(frame)])
            }
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Dialect {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Dialect, UnknownName> {
        [Dialect::EventPlane, Dialect::Dynamo]
            .into_iter()
            .find(|w| w.as_str() == s)
            .ok_or_else(|| UnknownName {
                name: s.chars().take(64).collect(),
                expected: "eventplane or dynamo",
            })
    }
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// What a message's frames carry, as its [`Layout`] places it.
///
/// ```
/// use eventplane::wire::Framed;
/// let raw = Framed::default();
/// assert_eq!((raw.publisher_id, raw.sequence, raw.payload), (None, None, None));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Framed {
    /// The publisher id, for layouts that carry one.
    pub publisher_id: Option<u64>,
    /// The sequence number, for layouts that carry one.
    pub sequence: Option<u64>,
    /// The payload (the first payload frame; for Dynamo the envelope's payload,
    /// sharing the frame's buffer), for every layout but `Raw`.
    pub payload: Option<Bytes>,
    /// Where the payload lies in the message.
    pub(crate) payload_at: Option<PayloadAt>,
}

/// A payload's place in its message: 12 bytes, where a `Bytes` handle takes 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PayloadAt {
    frame: u32,
    start: u32,
    len: u32,
}

impl PayloadAt {
    /// The payload of `message` this points at.
    pub(crate) fn get(self, message: &Message) -> Option<Bytes> {
        let start = usize::try_from(self.start).ok()?;
        let end = start.checked_add(usize::try_from(self.len).ok()?)?;
        message.slice_of(usize::try_from(self.frame).ok()?, start, end)
    }
}

impl Framed {
    /// Frame `frame` of `message`, or `range` (start, length) of it, as where the payload
    /// lies (the handle itself is made by [`Layout::parse`]).
    fn with_payload(
        publisher_id: Option<u64>,
        sequence: u64,
        message: &Message,
        frame: usize,
        range: Option<(usize, usize)>,
    ) -> Framed {
        let len = message.get(frame).map_or(0, <[u8]>::len);
        let (start, len) = range.unwrap_or((0, len));
        // Frames are below 4 GiB (`zmtp::Config` caps messages there).
        let payload_at = (|| {
            Some(PayloadAt {
                frame: u32::try_from(frame).ok()?,
                start: u32::try_from(start).ok()?,
                len: u32::try_from(len).ok()?,
            })
        })();
        Framed {
            publisher_id,
            sequence: Some(sequence),
            payload: None,
            payload_at,
        }
    }
}

/// Why a message does not fit its layout. Readers skip the message and count the
/// reason; none of these is fatal to a connection.
///
/// ```
/// use eventplane::wire::{Layout, WireError};
/// use eventplane::zmtp::Message;
/// let short = Message::from_parts([&b"t"[..], &[0u8; 8][..]]);
/// assert_eq!(Layout::TopicSeq.parse(None, &short).unwrap_err(), WireError::Frames(2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Frame 0 is not exactly the subscribed topic.
    #[error("frame 0 is not the subscribed topic")]
    WrongTopic,
    /// Too few frames (or, for Dynamo, not exactly four).
    #[error("{0} frames do not fit the layout")]
    Frames(usize),
    /// A publisher-id or sequence frame is not 8 bytes.
    #[error("frame {index} holds {len} bytes, not a u64")]
    IdFrame {
        /// The frame's index.
        index: usize,
        /// Its length.
        len: usize,
    },
    /// A Dynamo frame shorter than its header or of another version.
    #[error("Dynamo frame header: version {version:?}, or fewer than 5 bytes")]
    Header {
        /// The first byte, when there is one.
        version: Option<u8>,
    },
    /// A Dynamo frame whose header declares another envelope length than it holds.
    #[error("Dynamo frame declares {declared} envelope bytes but holds {actual}")]
    Length {
        /// The declared length.
        declared: u64,
        /// The bytes present.
        actual: u64,
    },
    /// A Dynamo envelope that is not the documented msgpack map.
    #[error("Dynamo envelope: {0}")]
    Envelope(&'static str),
    /// A Dynamo envelope whose topic, publisher id or sequence differs from frames 0–2.
    #[error("Dynamo envelope's {0} differs from the message's frames")]
    Identity(&'static str),
}

/// Messages skipped as malformed, by reason (a message with the wrong topic is
/// counted apart, as filtered).
///
/// ```
/// use eventplane::wire::{MalformedStats, WireError};
/// let mut stats = MalformedStats::default();
/// stats.count(&WireError::Identity("sequence"));
/// stats.count(&WireError::WrongTopic); // not malformed: filtered
/// assert_eq!((stats.identity, stats.total()), (1, 1));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct MalformedStats {
    /// Wrong frame count, or an id/sequence frame that is not 8 bytes.
    pub frames: u64,
    /// Dynamo header: short, or another version.
    pub header: u64,
    /// Dynamo header length differs from the envelope's.
    pub length: u64,
    /// Dynamo envelope not the documented map.
    pub envelope: u64,
    /// Dynamo envelope identity differs from the frames.
    pub identity: u64,
}

impl MalformedStats {
    /// Counts `err` under its reason (saturating); `WrongTopic` is not counted.
    pub fn count(&mut self, err: &WireError) {
        if let Some(slot) = self.slot(err) {
            *slot = slot.saturating_add(1);
        }
    }

    /// Every malformed message (saturating).
    pub fn total(&self) -> u64 {
        self.frames
            .saturating_add(self.header)
            .saturating_add(self.length)
            .saturating_add(self.envelope)
            .saturating_add(self.identity)
    }

    /// Adds `o` into `self`, saturating.
    pub fn add(&mut self, o: &MalformedStats) {
        let sum = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        sum(&mut self.frames, o.frames);
        sum(&mut self.header, o.header);
        sum(&mut self.length, o.length);
        sum(&mut self.envelope, o.envelope);
        sum(&mut self.identity, o.identity);
    }

    fn slot(&mut self, err: &WireError) -> Option<&mut u64> {
        Some(match err {
            WireError::WrongTopic => return None,
            WireError::Frames(_) | WireError::IdFrame { .. } => &mut self.frames,
            WireError::Header { .. } => &mut self.header,
            WireError::Length { .. } => &mut self.length,
            WireError::Envelope(_) => &mut self.envelope,
            WireError::Identity(_) => &mut self.identity,
        })
    }
}

/// Counters behind a [`MalformedStats`], shared between a reader task and its stats.
#[derive(Debug, Default)]
pub(crate) struct MalformedCounters {
    frames: std::sync::atomic::AtomicU64,
    header: std::sync::atomic::AtomicU64,
    length: std::sync::atomic::AtomicU64,
    envelope: std::sync::atomic::AtomicU64,
    identity: std::sync::atomic::AtomicU64,
}

impl MalformedCounters {
    /// Adds a batch's counts.
    pub(crate) fn add(&self, s: &MalformedStats) {
        use crate::counter::add;
        add(&self.frames, s.frames);
        add(&self.header, s.header);
        add(&self.length, s.length);
        add(&self.envelope, s.envelope);
        add(&self.identity, s.identity);
    }

    pub(crate) fn snapshot(&self) -> MalformedStats {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        MalformedStats {
            frames: l(&self.frames),
            header: l(&self.header),
            length: l(&self.length),
            envelope: l(&self.envelope),
            identity: l(&self.identity),
        }
    }
}

/// A name that is not one of the accepted spellings.
///
/// ```
/// let err = "zmq".parse::<eventplane::wire::Dialect>().unwrap_err();
/// assert_eq!(err.to_string(), "unknown name \"zmq\": expected eventplane or dynamo");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown name {name:?}: expected {expected}")]
pub struct UnknownName {
    name: String,
    expected: &'static str,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn msg(parts: &[&[u8]]) -> Message {
        Message::from_parts(parts.iter().map(|p| Bytes::copy_from_slice(p)))
    }

    #[test]
    fn each_layout_at_and_past_its_boundaries() {
        let seq = 7u64.to_be_bytes();
        let id = 9u64.to_be_bytes();
        let kv = Some(&b"kv"[..]);
        let m3 = msg(&[b"kv", &seq, b"p"]);
        let m4 = msg(&[b"kv", &id, &seq, b"p"]);
        let framed = Layout::TopicSeq.parse(kv, &m3).unwrap();
        assert_eq!(
            (framed.sequence, framed.payload.as_deref()),
            (Some(7), Some(&b"p"[..]))
        );
        let framed = Layout::TopicPublisherSeq.parse(kv, &m4).unwrap();
        assert_eq!((framed.publisher_id, framed.sequence), (Some(9), Some(7)));
        assert_eq!(
            Layout::TopicPublisherSeq.parse(None, &m3).unwrap_err(),
            WireError::Frames(3)
        );
        let m4_short_seq = msg(&[b"kv", &id, b"p", b"p"]);
        assert_eq!(
            Layout::TopicPublisherSeq
                .parse(None, &m4_short_seq)
                .unwrap_err(),
            WireError::IdFrame { index: 2, len: 1 }
        );
        assert_eq!(Layout::Raw.parse(None, &m3).unwrap(), Framed::default());
        assert_eq!(
            Layout::TopicSeq.parse(Some(b"k"), &m3).unwrap_err(),
            WireError::WrongTopic
        );
        assert_eq!(
            Layout::TopicSeq
                .parse(kv, &msg(&[b"kv", &seq]))
                .unwrap_err(),
            WireError::Frames(2)
        );
        assert_eq!(
            Layout::TopicSeq
                .parse(kv, &msg(&[b"kv", &seq[..7], b"p"]))
                .unwrap_err(),
            WireError::IdFrame { index: 1, len: 7 }
        );
    }

    #[test]
    fn dynamo_identity_must_match_the_frames() {
        let topic = Bytes::from_static(b"kv-events");
        let good = Dialect::Dynamo.encode(&topic, 5, 3, Bytes::from_static(b"x"));
        assert!(Layout::Dynamo.parse(None, &good).is_ok());
        let empty = Dialect::Dynamo.encode(&topic, 5, 3, Bytes::new());
        let framed = Layout::Dynamo.parse(None, &empty).unwrap();
        assert_eq!(framed.payload.as_deref(), Some(&b""[..]));
        assert_eq!(
            framed.payload_at.unwrap().get(&empty).as_deref(),
            Some(&b""[..])
        );
        let mut parts: Vec<Bytes> = good.clone().into_parts().collect();
        let with = |i: usize, b: &[u8], parts: &[Bytes]| {
            let mut p = parts.to_vec();
            p[i] = Bytes::copy_from_slice(b);
            Layout::Dynamo
                .parse(None, &Message::from_parts(p))
                .unwrap_err()
        };
        assert_eq!(with(0, b"kv-evente", &parts), WireError::Identity("topic"));
        assert_eq!(
            with(1, &6u64.to_be_bytes(), &parts),
            WireError::Identity("publisher_id")
        );
        assert_eq!(
            with(2, &4u64.to_be_bytes(), &parts),
            WireError::Identity("sequence")
        );
        assert!(matches!(with(3, b"\x02", &parts), WireError::Header { .. }));
        parts.push(Bytes::new());
        assert_eq!(
            Layout::Dynamo
                .parse(None, &Message::from_parts(parts))
                .unwrap_err(),
            WireError::Frames(5)
        );
        let mut stats = MalformedStats::default();
        for e in [
            WireError::Frames(5),
            WireError::Header { version: None },
            WireError::Length {
                declared: 1,
                actual: 0,
            },
            WireError::Envelope("x"),
            WireError::Identity("topic"),
            WireError::WrongTopic,
        ] {
            stats.count(&e);
        }
        assert_eq!(
            stats,
            MalformedStats {
                frames: 1,
                header: 1,
                length: 1,
                envelope: 1,
                identity: 1
            }
        );
    }

    #[test]
    fn names_round_trip() {
        for l in Layout::ALL {
            assert_eq!(l.as_str().parse::<Layout>().unwrap(), l);
        }
        for w in [Dialect::EventPlane, Dialect::Dynamo] {
            assert_eq!(w.as_str().parse::<Dialect>().unwrap(), w);
        }
        assert!("Dynamo".parse::<Dialect>().is_err());
    }
}
