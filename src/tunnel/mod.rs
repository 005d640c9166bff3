//! The tunnel (feature `tunnel`): routers outside a cluster following publishers
//! inside it, through an event broker that dials out to the router's event bus and
//! relays raw ZMTP bytes (DESIGN §7).
//!
//! This part is the protocol, sans-IO, so that every rule is testable without sockets
//! and with time passed in:
//! - [`Control`] frames and their bounded codec ([`ControlDecoder`]): `hello`,
//!   `welcome`, heartbeats, `subscribe` / `unsubscribe`, `drain`, and the broker's
//!   `stream_opened` / `stream_refused` / `stream_closed` / `draining`, with closed code
//!   sets ([`RefuseCode`], [`CloseCode`], [`DrainReason`]; anything else reads as
//!   `Unknown`);
//! - the two session state machines, [`BrokerSession`] and [`RouterSession`]
//!   (handshake and version negotiation, heartbeats and the idle timeout, stream
//!   bookkeeping, pending subscribes that expire after 30 s, late data streams refused
//!   with `unknown_stream`, draining), and the broker's [`Reconnect`] policy (jittered
//!   backoff, rebalance throttling);
//! - [`RelayBudget`], the per-stream and per-session byte accounting of what a broker
//!   queues toward the router (64 B charged per chunk);
//! - [`rendezvous_owner`], which broker carries which publisher.
//!
//! On top, the transport: [`EventBus`], the router's TLS + HTTP/2 server that runs
//! broker sessions and opens publisher connections through them
//! ([`EventBus::open_stream`] gives a [`TunnelStream`] a `SubSocket` can run ZMTP over),
//! and [`Broker`], which dials out to the bus, checks each target (advertised in its
//! discovery view, allowed by its [`AddrFilter`](crate::net::AddrFilter)), connects under
//! per-stage deadlines and relays raw bytes within its [`RelayBudget`]. TLS uses rustls
//! with the ring provider ([`server_tls`], [`client_tls`]).
//!
//! ```
//! use std::time::Instant;
//! use eventplane::tunnel::{BrokerEvent, BrokerSession, Control, ControlDecoder, Hello, Limits, RouterEvent, RouterSession};
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
//! assert!(matches!(router.poll_event(), Some(RouterEvent::Welcomed { .. })));
//! assert!(matches!(broker.poll_event(), Some(BrokerEvent::Welcomed(_))));
//! ```

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

pub use announce::{AnnouncedSource, MAX_ANNOUNCE, MAX_SOURCE_NAME_LEN, Role, Target};
pub use auth::{BusClients, MAX_BUS_CLIENTS, TokenDigest};
pub use broker::{Broker, BrokerHandle, BrokerStats};
pub use bus::{BusStats, EventBus, OPEN_ATTEMPTS};
pub use config::{
    AUTH_TIMEOUT, BUS_CONNECT_TIMEOUT, BrokerConfig, CONNECT_ATTEMPT_TIMEOUT, CONNECT_TIMEOUT,
    DNS_TIMEOUT, Deadlines, EventBusConfig, JOIN_HOLD_DOWN, MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_CLIENT, MAX_DNS_LOOKUPS, MAX_PENDING_CONNECTIONS, MAX_PENDING_PER_SOURCE,
    OPENS_PER_SECOND, RESPONSE_TIMEOUT, Resolver, SESSION_START_TIMEOUT, STREAM_SLOT_TIMEOUT,
    SystemResolver, TLS_HANDSHAKE_TIMEOUT,
};
pub use error::TunnelError;
pub use io::{MIN_TOKEN_LEN, Secret, TunnelStream, client_tls, server_tls};
pub use serve::MAX_REQUESTS_BEFORE_AUTH;
pub use serving::RecoveryStreams;
pub use view::{MAX_VIEW_BYTES, MAX_VIEW_INSTANCES};

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
    ANNOUNCE_BURST, ANNOUNCES_PER_SECOND, RouterEvent, RouterSession, SubscribeError,
};
pub use session::{
    BrokerEvent, BrokerSession, Grant, HANDSHAKE_TIMEOUT, MAX_BROKER_STREAMS, MAX_QUEUED_CONTROL,
    PENDING_SUBSCRIBE_TIMEOUT, SessionEnd,
};
pub use source::{ANNOUNCE_RETRY, Source, SourceHandle, SourceStats};
pub use source_config::{MAX_SOURCE_PUBLISHERS, SourceConfig};
pub use sources::AnnouncedView;

#[cfg(test)]
mod source_tests;
#[cfg(test)]
mod tests;
