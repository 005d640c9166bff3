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

mod broker;
mod bus;
mod client;
mod config;
mod deadlines;
mod error;
mod io;
#[cfg(any(test, fuzzing, feature = "unstable"))]
#[cfg_attr(docsrs, doc(cfg(feature = "unstable")))]
pub mod protocol;
#[cfg(not(any(test, fuzzing, feature = "unstable")))]
mod protocol;
mod source;

pub use broker::{Broker, BrokerHandle, BrokerStats};
pub use bus::{AnnouncedView, BusClients, BusStats, EventBus, TokenDigest};
pub use config::{BrokerConfig, Deadlines, EventBusConfig, Resolver, SystemResolver};
pub use error::TunnelError;
pub use io::{Secret, TunnelStream, client_tls, server_tls};
pub use protocol::{
    AnnounceRefusal, AnnouncedSource, CloseCode, DenyCode, DrainReason, Limits, RefuseCode, Role,
    Target,
};
pub use source::{RecoveryStreams, Source, SourceConfig, SourceHandle, SourceStats};

// What the parts of the tunnel share.
pub(crate) use config::JOIN_HOLD_DOWN;
pub(crate) use protocol::{
    ANNOUNCE_BURST, ANNOUNCES_PER_SECOND, BrokerEvent, BrokerSession, Control, ControlDecoder,
    H2_SEND_BUFFER_BYTES, Hello, MAX_ANNOUNCE, MAX_BROKER_STREAMS, MAX_CONTROL_FRAME, MAX_NAME_LEN,
    MAX_NAMESPACES, MAX_SESSION_BUFFER_BYTES, MAX_SOURCE_NAME_LEN, MAX_STREAM_BUFFER_BYTES,
    MIN_STREAM_BUFFER_BYTES, PENDING_SUBSCRIBE_TIMEOUT, RELAY_READ_BYTES, Reconnect, RelayBudget,
    RouterSession, SessionEnd, SessionEvent, SubscribeError, rendezvous_owner, rendezvous_ranked,
};

#[cfg(test)]
mod tests;
