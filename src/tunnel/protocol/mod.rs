//! The tunnel's sans-IO protocol: control frames and their codec, the broker and
//! router session state machines, the relay budget, the reconnect policy and
//! rendezvous hashing (DESIGN §7).
//!
//! **Not covered by semver** (feature `unstable`): it is public for the fuzz targets,
//! the test suites and anyone building another transport on the protocol, and may
//! change in any release. Applications use [`EventBus`](crate::tunnel::EventBus),
//! [`Broker`](crate::tunnel::Broker) and [`Source`](crate::tunnel::Source).
//!
//! ```
//! use std::time::Instant;
//! use eventplane::tunnel::protocol::{BrokerEvent, BrokerSession, Control, ControlDecoder, Hello, Limits, RouterSession, SessionEvent};
//! let now = Instant::now();
//! let mut broker = BrokerSession::new(Hello::new("broker-1", vec!["prod".into()]), now);
//! let mut router = RouterSession::new(1, Limits::default(), now);
//! // Frames cross as bytes, in both directions.
//! let mut pump = |from: &mut dyn FnMut() -> Option<Control>, to: &mut dyn FnMut(Control)| {
//!     let mut wire = Vec::new();
//!     while let Some(frame) = from() { frame.encode(&mut wire); }
//!     let (mut decoder, mut input) = (ControlDecoder::default(), &wire[..]);
//!     while let Some(frame) = decoder.decode(&mut input).unwrap() { to(frame); }
//! };
//! pump(&mut || broker.poll_transmit(), &mut |f| router.handle(f, now));
//! pump(&mut || router.poll_transmit(), &mut |f| broker.handle(f, now));
//! assert!(matches!(router.poll_event(), Some(SessionEvent::Welcomed { .. })));
//! assert!(matches!(broker.poll_event(), Some(BrokerEvent::Welcomed(_))));
//! ```

// Without `unstable` this module is private: its re-exports, and the parts only the
// tests, the fuzz targets and protocol users call, serve nothing in the crate.
#![cfg_attr(
    not(any(test, fuzzing, feature = "unstable")),
    allow(unused_imports, unreachable_pub, dead_code)
)]

pub(crate) mod announce;
pub(crate) mod broker_session;
pub(crate) mod budget;
pub(crate) mod codes;
pub(crate) mod fields;
pub(crate) mod frame;
pub(crate) mod reconnect;
pub(crate) mod rendezvous;
pub(crate) mod router_session;

pub use announce::{AnnouncedSource, Role, Target};
pub(crate) use announce::{MAX_ANNOUNCE, MAX_SOURCE_NAME_LEN};
pub use broker_session::{
    BrokerEvent, BrokerSession, Grant, HANDSHAKE_TIMEOUT, MAX_BROKER_STREAMS, MAX_QUEUED_CONTROL,
    PENDING_SUBSCRIBE_TIMEOUT, SessionEnd,
};
pub use budget::{
    CHUNK_OVERHEAD, H2_SEND_BUFFER_BYTES, MAX_SESSION_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES,
    MIN_STREAM_BUFFER_BYTES, Overflow, PER_STREAM_UNCHARGED_BYTES, RELAY_READ_BYTES, RelayBudget,
};
pub use frame::{
    AnnounceRefusal, CloseCode, Control, ControlDecoder, DenyCode, DrainReason, FrameError, Hello,
    Limits, MAX_CONTROL_FRAME, MAX_NAME_LEN, MAX_NAMESPACES, MAX_VERSIONS, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION, RefuseCode, Welcome,
};
pub use reconnect::{REBALANCE_WINDOW, Reconnect};
pub use rendezvous::{rendezvous_owner, rendezvous_ranked, weight as rendezvous_weight};
pub use router_session::{
    ANNOUNCE_BURST, ANNOUNCES_PER_SECOND, RouterSession, SessionEvent, SubscribeError,
};
