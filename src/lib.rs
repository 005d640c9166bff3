//! # eventplane
//!
//! Event-plane building blocks for LLM-inference clusters — routers, KV-aware
//! schedulers and workers — as an embeddable library.
//!
//! ```text
//!  inference engine (vLLM / SGLang)
//!    ZMQ PUB [topic, seq, msgpack batch] ──► zmtp::SubSocket ──► your code
//!                                            zmtp::PubSocket ──► ZMQ SUBs (libzmq, zeromq-rs, …)
//! ```
//!
//! ## What is here
//! - [`zmtp`]: a pure-Rust, bounded ZMTP 3.x implementation — a sans-IO codec and
//!   session, and async [`SubSocket`](zmtp::SubSocket) / [`PubSocket`](zmtp::PubSocket)
//!   over any byte stream. It interoperates with libzmq and zeromq-rs, and a forged
//!   frame header costs a closed connection, never an allocation of the claimed size.
//! - [`discovery`]: the dyn-compatible [`Discovery`](discovery::Discovery) trait with
//!   a strict watch contract (initial sync ending in `Resync`, bounded per-watcher
//!   backlogs that collapse into a `Resync`, stale removals suppressed by incarnation),
//!   the embedded [`MemoryDiscovery`](discovery::MemoryDiscovery) and
//!   [`StaticDiscovery`](discovery::StaticDiscovery).
//!
//! The dynamic subscriber with fair lossy lanes, the KV-event pipeline and the etcd
//! backend are built on these layers (see the project's CHANGELOG for what has
//! landed).
//!
//! ## Features
//! - `etcd`: distributed discovery on etcd (planned).
//! - `test-support`: `discovery::conformance` (a conformance suite for any
//!   `Discovery` backend) and `discovery::FaultDiscovery` (fault injection for
//!   consumers).
//! - `metrics`: counters through the `metrics` facade (planned).
//!
//! ## Cancel safety
//! Every `recv`-style method is cancel-safe: state lives in the socket, never in the
//! future. `Drop` only signals tasks to stop; it never blocks or spawns.
//!
//! ## Stability
//! Pre-1.0: minor versions may break the API. Public enums are `#[non_exhaustive]`.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod discovery;
pub mod lossy;
pub mod net;
pub mod publish;
pub mod subscriber;
pub mod zmtp;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
