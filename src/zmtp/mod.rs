//! A bounded, pure-Rust ZMTP 3.x (RFC 23 / RFC 37) implementation of PUB and SUB.
//!
//! Layers, bottom up:
//! - [`codec`]: greeting, frames, commands — pure functions and decoders, no I/O, no
//!   clock; every peer-declared size is checked before anything is buffered.
//! - [`Session`]: the sans-IO per-connection state machine (handshake, subscriptions,
//!   heartbeats with the time passed in).
//! - [`SubSocket`] and [`PubSocket`]: the only async types, over any
//!   `AsyncRead + AsyncWrite` stream or TCP.
//!
//! Only the `NULL` security mechanism is supported. Interoperability: libzmq ≥ 4.2
//! (ZMTP 3.1: SUBSCRIBE/CANCEL commands, PING/PONG) and zeromq-rs (ZMTP 3.0:
//! subscription messages, no commands but READY).
//!
//! ## Bounds
//! | bound | default | on violation |
//! |---|---|---|
//! | [`Config::max_frame_size`] | 8 MiB | [`ProtocolError::FrameTooLarge`], before allocation |
//! | [`Config::max_message_size`] | 16 MiB | [`ProtocolError::MessageTooLarge`] |
//! | [`Config::max_message_parts`] | 64 | [`ProtocolError::TooManyParts`] |
//! | [`Config::max_metadata_size`] | 64 KiB | [`ProtocolError::CommandTooLarge`] |
//! | [`Config::handshake_timeout`] | 10 s | [`TimeoutKind::Handshake`] |
//! | [`Config::heartbeat_interval`] | off | [`TimeoutKind::Heartbeat`] |
//! | [`Config::send_queue_messages`] / [`Config::send_queue_bytes`] | 10 000 / 16 MiB | message dropped for that subscriber, counted |
//! | [`Config::max_subscriptions`] / [`Config::max_subscription_size`] | 4096 / 1 KiB | [`ProtocolError::SubscriptionLimit`] |
//! | frames from a subscriber (PUB) | `max_subscription_size` + 1, commands 512 B; only commands before READY | [`ProtocolError::FrameTooLarge`] at the header |
//! | [`Config::max_connections`] (PUB) | 1024 | closed on accept, counted in [`PubStats::refused`] |
//! | pending output per peer (queue, write buffer, control) | [`Config::send_queue_bytes`]; one unsent PONG at most | dropped for that peer; reading pauses while 64 KiB wait |
//! | [`Config::write_stall_timeout`] | 30 s | [`TimeoutKind::WriteStall`] |
//! | [`Config::max_retained_bytes`] (SUB) | 8 MiB | small frames copied out, see [`SubSocket`'s memory](SubSocket#memory) |
//! | bytes one `recv_many` batch holds | 1 MiB | the batch ends |

pub mod codec;
mod config;
pub mod conformance;
mod dealer;
mod endpoint;
mod error;
mod io;
mod message;
mod prefix;
mod publish;
mod queue;
pub(crate) mod retain;
mod session;
mod sub;

pub use config::{Config, ConfigBuilder};
pub use dealer::DealerSocket;
pub(crate) use endpoint::parse_tcp;
pub use error::{Error, ProtocolError, TimeoutKind};
pub use message::{Message, Parts};
pub use publish::{PeerStats, PubSocket, PubStats, SendReport, StreamAcceptor};
pub use session::{Event, PeerInfo, Session, SessionStats, SocketType};
/// Two sessions back to back with a clock, for tests and benchmarks of the sans-IO
/// core (feature `unstable`: outside the semver promise).
#[cfg(any(test, fuzzing, feature = "unstable"))]
#[cfg_attr(docsrs, doc(cfg(feature = "unstable")))]
pub use session::{Pair, Side};
pub(crate) use sub::dial_filtered;
pub use sub::{SubBuffers, SubSocket};
