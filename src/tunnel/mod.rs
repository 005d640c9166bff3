//! The tunnel (feature `tunnel`): routers outside a cluster following publishers
//! inside it, through an event broker that dials out to the router's event bus and
//! relays raw ZMTP bytes (DESIGN §7).
//!
//! What an application uses:
//! - [`EventBus`] ([`EventBusConfig`]): the router's end, a TLS + HTTP/2 server that
//!   runs broker and source sessions and opens publisher connections through them
//!   ([`EventBus::open_stream`] gives a [`TunnelStream`] a `SubSocket` runs ZMTP over;
//!   `DynamicSubscriberBuilder::tunnel` does it for every publisher a broker covers).
//!   Credentials: [`BusClients`], [`TokenDigest`], [`Secret`].
//! - [`Broker`] ([`BrokerConfig`]): the in-cluster end. It dials out to the bus, checks
//!   each target (advertised in its discovery view, allowed by its
//!   [`AddrFilter`](crate::net::AddrFilter)), connects under per-stage deadlines and
//!   relays raw bytes within a per-stream and per-session budget.
//! - [`Source`] ([`SourceConfig`]): a worker that dials out itself and serves its own
//!   publishers (and its recovery log, [`RecoveryStreams`]) through the bus;
//!   [`EventBus::announced`] is the router's discovery of them.
//! - TLS uses rustls with the ring provider ([`server_tls`], [`client_tls`]); errors are
//!   [`TunnelError`], and the closed code sets ([`RefuseCode`], [`CloseCode`],
//!   [`DenyCode`], [`DrainReason`], [`AnnounceRefusal`]) label its metrics.
//!
//! Under it, the protocol is sans-IO, so that every rule is testable without sockets
//! and with time passed in: control frames and their bounded codec, the broker and
//! router session state machines (handshake and version negotiation, heartbeats, stream
//! bookkeeping, pending subscribes that expire, draining), the relay budget and
//! rendezvous hashing. It is public as `tunnel::protocol` with feature `unstable`
//! only, outside the semver promise. Every default and bound is stated on the setter
//! or field that sets it, and tabled in the repository's `docs/guarantees.md`.

mod accept;
mod admission;
mod announce;
mod auth;
mod broker;
mod budget;
mod bus;
mod bus_state;
mod client;
mod codes;
mod config;
mod error;
mod fields;
mod frame;
mod io;
mod reconnect;
mod relay;
mod rendezvous;
mod router_session;
mod serve;
mod serving;
mod session;
mod source;
mod source_config;
mod sources;
mod view;

pub use announce::{AnnouncedSource, Role, Target};
pub use auth::{BusClients, TokenDigest};
pub use broker::{Broker, BrokerHandle, BrokerStats};
pub use bus::{BusStats, EventBus};
pub use config::{BrokerConfig, Deadlines, EventBusConfig, Resolver, SystemResolver};
pub use error::TunnelError;
pub use frame::{AnnounceRefusal, CloseCode, DenyCode, DrainReason, Limits, RefuseCode};
pub use io::{Secret, TunnelStream, client_tls, server_tls};
pub use serving::RecoveryStreams;
pub use source::{Source, SourceHandle, SourceStats};
pub use source_config::SourceConfig;
pub use sources::AnnouncedView;

// What the files of this folder share through `super::`.
pub(crate) use announce::{MAX_ANNOUNCE, MAX_SOURCE_NAME_LEN};
pub(crate) use budget::{
    H2_SEND_BUFFER_BYTES, MAX_SESSION_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES,
    MIN_STREAM_BUFFER_BYTES, RELAY_READ_BYTES, RelayBudget,
};
pub(crate) use config::JOIN_HOLD_DOWN;
pub(crate) use frame::{
    Control, ControlDecoder, Hello, MAX_CONTROL_FRAME, MAX_NAME_LEN, MAX_NAMESPACES,
};
pub(crate) use reconnect::Reconnect;
pub(crate) use rendezvous::{rendezvous_owner, rendezvous_ranked};
pub(crate) use router_session::{
    ANNOUNCE_BURST, ANNOUNCES_PER_SECOND, RouterSession, SessionEvent, SubscribeError,
};
pub(crate) use session::{
    BrokerEvent, BrokerSession, MAX_BROKER_STREAMS, PENDING_SUBSCRIBE_TIMEOUT, SessionEnd,
};

/// The tunnel's sans-IO protocol: control frames and their codec, the broker and
/// router session state machines, the relay budget, the reconnect policy and
/// rendezvous hashing (DESIGN §7).
///
/// **Not covered by semver** (feature `unstable`): it is public for the fuzz targets,
/// the test suites and anyone building another transport on the protocol, and may
/// change in any release. Applications use [`EventBus`], [`Broker`] and [`Source`].
///
/// ```
/// use std::time::Instant;
/// use eventplane::tunnel::protocol::{BrokerEvent, BrokerSession, Control, ControlDecoder, Hello, Limits, RouterSession, SessionEvent};
/// let now = Instant::now();
/// let mut broker = BrokerSession::new(Hello::new("broker-1", vec!["prod".into()]), now);
/// let mut router = RouterSession::new(1, Limits::default(), now);
/// // Frames cross as bytes, in both directions.
/// let mut pump = |from: &mut dyn FnMut() -> Option<Control>, to: &mut dyn FnMut(Control)| {
///     let mut wire = Vec::new();
///     while let Some(frame) = from() { frame.encode(&mut wire); }
///     let (mut decoder, mut input) = (ControlDecoder::default(), &wire[..]);
///     while let Some(frame) = decoder.decode(&mut input).unwrap() { to(frame); }
/// };
/// pump(&mut || broker.poll_transmit(), &mut |f| router.handle(f, now));
/// pump(&mut || router.poll_transmit(), &mut |f| broker.handle(f, now));
/// assert!(matches!(router.poll_event(), Some(SessionEvent::Welcomed { .. })));
/// assert!(matches!(broker.poll_event(), Some(BrokerEvent::Welcomed(_))));
/// ```
#[cfg(any(test, fuzzing, feature = "unstable"))]
#[cfg_attr(docsrs, doc(cfg(feature = "unstable")))]
pub mod protocol {
    pub use super::announce::{AnnouncedSource, Role, Target};
    pub use super::budget::{
        CHUNK_OVERHEAD, H2_SEND_BUFFER_BYTES, MAX_SESSION_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES,
        MIN_STREAM_BUFFER_BYTES, Overflow, PER_STREAM_UNCHARGED_BYTES, RELAY_READ_BYTES,
        RelayBudget,
    };
    pub use super::frame::{
        AnnounceRefusal, CloseCode, Control, ControlDecoder, DenyCode, DrainReason, FrameError,
        Hello, Limits, MAX_CONTROL_FRAME, MAX_NAME_LEN, MAX_NAMESPACES, MAX_VERSIONS,
        MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RefuseCode, Welcome,
    };
    pub use super::reconnect::{REBALANCE_WINDOW, Reconnect};
    pub use super::rendezvous::{rendezvous_owner, rendezvous_ranked, weight as rendezvous_weight};
    pub use super::router_session::{
        ANNOUNCE_BURST, ANNOUNCES_PER_SECOND, RouterSession, SessionEvent, SubscribeError,
    };
    pub use super::session::{
        BrokerEvent, BrokerSession, Grant, HANDSHAKE_TIMEOUT, MAX_BROKER_STREAMS,
        MAX_QUEUED_CONTROL, PENDING_SUBSCRIBE_TIMEOUT, SessionEnd,
    };
}

#[cfg(test)]
mod source_tests;
#[cfg(test)]
mod tests;
