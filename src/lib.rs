//! # eventplane
//!
//! Event-plane building blocks for LLM-inference clusters — routers, KV-aware
//! schedulers and workers — as an embeddable library.
//!
//! ```text
//!  engine (vLLM / SGLang)          worker process                      router process
//!  ZMQ PUB [topic, seq, msgpack] ─► kv::engine::EngineListener         Discovery (memory | etcd | kube)
//!                                     │ bounded lists                     │ watch
//!                                     ▼                                   ▼
//!                                  kv::pipeline::Processor             subscriber::DynamicSubscriber
//!                                   coalesce → dedup → ids              per publisher: zmtp::SubSocket
//!                                     │                                   → bounded lossy::Lane
//!                                     ▼                                 lanes → fair lossy::Merge
//!                                  kv::pipeline::EventPlaneSink           → Stream<Delivery>
//!                                     │                                   │
//!                                     ▼                                   ▼
//!                                  publish::EventPublisher ──────────► Dialect::decode_router_events
//!                                   zmtp::PubSocket, registered          → the router's index
//!                                   in Discovery
//!                                   [topic, publisher_id, seq, router events]
//! ```
//!
//! Every arrow is bounded, and every place that can drop counts what it drops.
//!
//! ## What is here
//! Start with the [`guide`]: a router and a worker process, start to finish, the
//! bounds, and a tracing setup. The semantics and wire formats behind every module are
//! in the repository's `docs/DESIGN.md`, which the docs cite as "DESIGN §N".
//!
//! - [`zmtp`]: a pure-Rust, bounded ZMTP 3.x implementation — a sans-IO codec and
//!   session, and async [`SubSocket`](zmtp::SubSocket) / [`PubSocket`](zmtp::PubSocket)
//!   over any byte stream. It interoperates with libzmq and zeromq-rs, and a forged
//!   frame header costs a closed connection, never an allocation of the claimed size.
//! - [`discovery`]: the dyn-compatible [`Discovery`] trait with
//!   a strict watch contract (initial sync ending in `Resync`, bounded per-watcher
//!   backlogs that collapse into a `Resync`, stale removals suppressed by incarnation),
//!   the embedded [`MemoryDiscovery`],
//!   [`StaticDiscovery`](discovery::StaticDiscovery), and the distributed
//!   `EtcdDiscovery` (feature `etcd`) and `KubeDiscovery` (feature `kube`).
//! - [`subscriber`]: [`DynamicSubscriber`] — connects to
//!   every publisher discovery reports and merges their streams into bounded, lossy,
//!   fair per-publisher lanes: every drop counted, memory bounded, no publisher able to
//!   starve another.
//! - [`publish`]: [`EventPublisher`] — a `PubSocket` on an
//!   OS-assigned port, registered in discovery, with sequence numbers.
//! - [`wire`]: the message layouts of every publisher we read or write — engines',
//!   ours, and NVIDIA Dynamo's (a framed msgpack envelope) — with their parsers,
//!   encoders and sequence tracking, in one place.
//! - [`lossy`]: the lanes and fair merge on their own (sync core, wakers).
//! - [`net`]: jittered [`Backoff`](net::Backoff), the [`AddrFilter`](net::AddrFilter)
//!   SSRF guard, [`RateLimitedWarn`](net::RateLimitedWarn).
//! - [`kv`]: the KV-event model, the sans-IO coalescer, dedup filter and id stamping,
//!   the processor loop, engine ingress (vLLM / SGLang msgpack batches) and the
//!   event-plane sink with its router-side decoder, in our schema or Dynamo's,
//!   [`kv::pipeline::Worker`], which wires engine → listener → processor → publisher, the
//!   router's index, and the recovery of a worker's blocks after loss.
//! - `metrics` (feature `metrics`): every component's counters through the `metrics`
//!   facade, with their catalogue.
//! - `admin` (feature `admin`): a bounded HTTP/1.1 endpoint for `/metrics`, `/readyz`
//!   and `/livez`, for processes that serve their own (the services do).
//! - `tunnel` (feature `tunnel`): routers outside the cluster — the router's event bus,
//!   the in-cluster broker, and sources (workers that dial out).
//! - [`guide`] (documentation only): a router and a worker, start to finish, and every
//!   guarantee and bound.
//!
//! ## Next to Dynamo
//! A router built on eventplane follows Dynamo ≥ 1.6 workers as they run, and an
//! eventplane worker feeds a Dynamo router, neither side changed: Dynamo's etcd
//! records (`EtcdDiscovery` in `Dialect::Dynamo`, feature `etcd`; `KubeDiscovery`), its
//! frames and its router-event schema: one [`Dialect`] names ours or Dynamo's for all
//! three ([`Dialect::layout`], [`Dialect::encode_router_events`]). Ours is the default.
//!
//! ## Features
//! - `etcd`: `discovery::EtcdDiscovery`, distributed discovery on etcd v3 (pulls
//!   `etcd-client`, which needs `protoc` at build time).
//! - `kube`: `discovery::KubeDiscovery`, discovery on Kubernetes through Dynamo's
//!   `DynamoWorkerMetadata` resources joined with EndpointSlice or Pod readiness
//!   (pulls `kube` and `k8s-openapi`).
//! - `dynamo-recovery`: `kv::dynamo_recovery`, Dynamo 1.6.1's KV recovery on its
//!   request plane, both ends (`etcd` and `kube` enable it; pulls `serde_json`).
//! - `test-support`: `discovery::conformance` (a conformance suite for any
//!   `Discovery` backend) and `discovery::FaultDiscovery` (fault injection for
//!   consumers).
//! - `metrics`: [`metrics`], every component's counters through the `metrics` facade
//!   (one naming scheme, closed label sets; a [`metrics::Exporter`] samples each
//!   component's `stats()`).
//! - `tunnel`: [`tunnel`], routers outside the cluster reaching publishers inside it
//!   through an event broker: the sans-IO protocol (frames, sessions, budgets,
//!   rendezvous), the router's [`EventBus`](tunnel::EventBus) (TLS + HTTP/2), the
//!   [`Broker`](tunnel::Broker), and `DynamicSubscriberBuilder::tunnel`. The
//!   `event-broker` service (`services/`) is the broker as a process.
//!
//! - `admin`: [`admin`], a bounded HTTP/1.1 endpoint for `/metrics`, `/readyz` and
//!   `/livez` (no dependency: tokio only).
//! - `unstable`: internals outside the semver promise, public for fuzzing, tests and
//!   benchmarks: the tunnel's sans-IO protocol (`tunnel::protocol`) and `zmtp::Pair`.
//!
//! Every component also has a plain `stats()` snapshot, so users without a metrics
//! stack still see every counter.
//!
//! ## Cancel safety
//! Every `recv`-style method (`SubSocket::recv`/`recv_many`,
//! `DynamicSubscriber::recv`/`recv_many`, `DiscoveryStream::next`) is cancel-safe: state
//! lives in the socket or stream, never in the future, so using them in `select!` loses
//! nothing. `Drop` only signals tasks to stop; it never blocks or spawns. Long-running
//! parts (the subscriber, `EngineListener`, `Processor`, `kv::pipeline::Worker`) take
//! `.cancellation(&token)` ([`CancellationToken`]) and report their final counters.
//!
//! ## Tracing
//! The crate logs through `tracing` and never installs a subscriber. Connections get a
//! span (`endpoint`, `publisher_id`); drops and reconnects warn at most once a minute
//! per publisher, with the count of what was suppressed; payloads are never logged.
//!
//! ## Stability
//! Pre-1.0: minor versions may break the API. Public enums are `#[non_exhaustive]`.
//! What feature `unstable` adds may change in any release. The rest of the surface is
//! listed name by name in the repository's `public-api.txt`, which CI compares with
//! rustdoc's view of the crate, so it changes only on purpose. Defaults are stated on
//! the setter or field they belong to, not exported as constants.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub mod admin;
mod config;
mod counter;
pub mod discovery;
pub mod guide;
mod hash;
pub mod kv;
pub mod lossy;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod msgpack;
pub mod net;
pub mod publish;
mod reader;
mod slots;
pub mod subscriber;
mod time;
#[cfg(feature = "tunnel")]
#[cfg_attr(docsrs, doc(cfg(feature = "tunnel")))]
pub mod tunnel;
pub mod wire;
pub mod zmtp;

pub use config::ConfigError;
// The entry types, also at their modules' paths.
pub use discovery::{Discovery, MemoryDiscovery};
pub use kv::{pipeline::Worker, router::RouterIndex};
pub use publish::EventPublisher;
pub use subscriber::DynamicSubscriber;
pub use wire::Dialect;

/// The token every long-running part of the crate stops on, re-exported so applications
/// need no `tokio-util` dependency of their own to build one.
///
/// One style throughout: each long-running part takes `.cancellation(&token)` before it
/// runs and stops when that token is cancelled, using a child of it (so stopping one
/// part never cancels the caller's token); its handle's `cancel()` stops that part
/// alone. The parts: [`DynamicSubscriberBuilder`](subscriber::DynamicSubscriberBuilder),
/// [`EngineListener`](kv::engine::EngineListener), [`Processor`](kv::pipeline::Processor) and
/// [`WorkerBuilder`](kv::pipeline::WorkerBuilder). ([`Discovery::watch`]
/// takes a token as an argument: it is the backend's side of the same contract.)
///
/// ```
/// use std::sync::Arc;
/// use eventplane::CancellationToken;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::subscriber::DynamicSubscriber;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::ConfigError> {
/// let stop = CancellationToken::new();
/// let mut sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns"))
///     .cancellation(&stop)
///     .spawn()?;
/// stop.cancel();
/// assert!(sub.recv().await.is_none());
/// # Ok(()) }
/// ```
pub use tokio_util::sync::CancellationToken;

/// A boxed, `Send` future: what the crate's dyn-compatible traits
/// ([`Discovery`], [`EventSink`](kv::pipeline::EventSink)) return.
///
/// ```
/// use eventplane::BoxFuture;
/// fn answer() -> BoxFuture<'static, u32> {
///     Box::pin(async { 42 })
/// }
/// # let _ = answer();
/// ```
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
