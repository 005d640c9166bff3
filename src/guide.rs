//! Guides: the two processes users build, start to finish, and the setup around them.
//! Every example here is compiled and run as a test.
//!
//! - [The router side](#the-router-side): subscribe → decode → index per worker →
//!   handle gaps and departures.
//! - [The worker side](#the-worker-side): engine → [`kv::pipeline::Worker`] → publisher.
//! - [Bounds](#bounds): every memory bound, set in one place.
//! - [As a `Stream`](#as-a-stream).
//! - [Tracing](#tracing): seeing the crate's warnings.
//!
//! # The router side
//! A router follows every worker's KV-event publisher through discovery and keeps an
//! index of which worker holds which block, to answer one question per request:
//! which worker holds the longest prefix of its blocks
//! ([`RouterIndex::find_matches`](crate::kv::router::RouterIndex::find_matches), with the
//! request's [`local_block_hashes`](crate::kv::router::local_block_hashes)). Three things
//! keep that index honest, and [`kv::router::IndexFeed`] does all
//! three, fed in order by
//! [`DynamicSubscriber::recv_item`](crate::subscriber::DynamicSubscriber::recv_item)
//! (deliveries and notices in one stream):
//!
//! - **Who sent it.** A worker registers its identity with its publisher
//!   ([`EventPublisherBuilder::worker`](crate::publish::EventPublisherBuilder::worker);
//!   `kv-relay` does, from `--worker-id` and `--dp-rank`), so every delivery's
//!   `source.worker` names the worker before the payload is decoded. An event naming
//!   another worker is refused; under [`Attribution::Strict`](crate::kv::router::Attribution)
//!   so are the events of a publisher that registered none, and
//!   [`expect_worker_identity`](crate::subscriber::DynamicSubscriberBuilder::expect_worker_identity)
//!   makes the subscriber warn about it.
//! - **What was lost.** Nothing is kept that the worker may no longer hold. A worker
//!   that loses track of its engine (a dropped batch, an engine restart) sends
//!   `Cleared`, and the index empties that worker's rank
//!   ([`EngineListener`](crate::kv::engine::EngineListener)). Events lost between worker and
//!   router — a full send queue, a dropped connection, this router's own lanes — show
//!   in the event ids, which a worker numbers 1, 2, 3, …: at an id that is not the
//!   next one the feed drops what that publisher fed before applying it, and what
//!   follows rebuilds it. Dynamo's router does the same (DESIGN §4.5, §4.6). (The
//!   subscriber's [`Notice::Gap`](crate::subscriber::Notice::Gap) reports the message
//!   sequence's gaps too, but only those before the router's lanes.)
//! - **Who left.** `Notice::Departed` comes once every message the departed publisher
//!   sent was handed over, and `recv_item` hands it out after them: the feed drops
//!   that publisher's ranks then, not earlier.
//!
//! The code below is `examples/guide_router/router.rs`, word for word: the
//! `guide_router` example runs it over etcd (`cargo run --features etcd --example
//! guide_router -- --etcd http://127.0.0.1:2379 --namespace prod`), and the test
//! suite runs that program against `kv-relay` workers fed by a real ZMQ engine,
//! through an engine restart. Here it runs against a worker in the same process.
//!
#![doc = concat!(
    "```\n",
    include_str!("../examples/guide_router/router.rs"),
    "# use eventplane::discovery::MemoryDiscovery;\n",
    "# use eventplane::kv::{KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId};\n",
    "# use eventplane::publish::EventPublisher;\n",
    "# #[tokio::main(flavor = \"current_thread\")]\n",
    "# async fn main() -> Result<(), Box<dyn std::error::Error>> {\n",
    "let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new()); // or EtcdDiscovery\n",
    "let mut router = subscribe(discovery.clone(), \"prod\")?;\n",
    "# let worker = EventPublisher::builder(discovery, \"prod\", \"w\", \"kv-events\").worker(7, 0).build().await?;\n",
    "# worker.wait_for_subscribers(1).await;\n",
    "# let data = KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(42), tokens_hash: TokensHash(1) }] };\n",
    "# worker.publish(Dialect::EventPlane.encode_router_events(&[RouterEvent { worker_id: WorkerId(7), tier: StorageTier::Device, event: KvEvent { id: 1, dp_rank: 0, data } }])?);\n",
    "let mut index = Index::default();\n",
    "let worker_7 = WorkerIdentity::new(7, 0);\n",
    "route(&mut router, &mut index, |i| i.holders(42).any(|w| w == worker_7)).await;\n",
    "println!(\"{} deliveries, {} unidentified, {} undecodable, {} lost\",\n",
    "    index.deliveries, index.unidentified(), index.undecodable(), index.lost());\n",
    "# assert_eq!((index.deliveries, index.unidentified(), index.undecodable(), index.lost()), (1, 0, 0, 0));\n",
    "# // Event 2 never arrives: at event 3 the worker's blocks are dropped, then 43 is added.\n",
    "# let data = KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(43), tokens_hash: TokensHash(1) }] };\n",
    "# worker.publish(Dialect::EventPlane.encode_router_events(&[RouterEvent { worker_id: WorkerId(7), tier: StorageTier::Device, event: KvEvent { id: 3, dp_rank: 0, data } }])?);\n",
    "# route(&mut router, &mut index, |i| i.holders(43).any(|w| w == worker_7)).await;\n",
    "# assert_eq!((index.holders(42).count(), index.lost()), (0, 1));\n",
    "# Ok(()) }\n",
    "```"
)]
//!
//! A topic typo does not fail silently: publishers discovered under the query with
//! another topic are not dialled, and
//! [`SubscriberStats::other_topic_publishers`](crate::subscriber::SubscriberStats::other_topic_publishers)
//! counts them (with a rate-limited warning naming both topics). Messages that do not
//! fit the layout are dropped, counted by reason in `malformed`, and warned about.
//!
//! # The worker side
//! A worker process relays one engine's KV events (vLLM, SGLang: a ZMQ PUB sending
//! `[topic, seq, msgpack batch]`) as router events on a publisher registered in
//! discovery. [`kv::pipeline::Worker`] wires listener, processor and sink; `shutdown` publishes
//! what was queued, then drains and unregisters the publisher.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use eventplane::discovery::MemoryDiscovery;
//! use eventplane::kv::{WorkerId, engine::EngineListenerConfig, pipeline::{ProcessorConfig, Worker}};
//! use eventplane::publish::EventPublisher;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let engine = eventplane::zmtp::PubSocket::bind("tcp://127.0.0.1:0", Default::default()).await?;
//! # let engine_endpoint = engine.local_endpoint().unwrap_or_default().to_owned();
//! let discovery = Arc::new(MemoryDiscovery::new()); // EtcdDiscovery across machines
//! let publisher = EventPublisher::builder(discovery, "prod", "worker", "kv-events")
//!     .worker(7, 0) // routers see it in every delivery's `source.worker`
//!     .build()
//!     .await?;
//! let worker = Worker::builder(
//!     // The engine's PUB endpoint and topic, this worker's id, tokens per KV block.
//!     EngineListenerConfig::new(&engine_endpoint, "", WorkerId(7), 16),
//!     publisher,
//! )
//! .processor(ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(10))))
//! .spawn()?;
//! // ... serve until told to stop (tokio::signal::ctrl_c().await, for instance), then:
//! let stats = worker.shutdown().await;
//! println!("{}", serde_json::to_string(&stats)?); // listener, processor, publisher counters
//! # Ok(()) }
//! ```
//!
//! The pieces stay usable alone: an [`EngineListener`](crate::kv::engine::EngineListener)
//! feeding your own channel, a [`Processor`](crate::kv::pipeline::Processor) over your own
//! [`EventSink`](crate::kv::pipeline::EventSink) (or [`Worker::with_sink`](crate::kv::pipeline::Worker::with_sink)),
//! or the sans-IO [`Pipeline`](crate::kv::pipeline::Pipeline) with no task at all. The
//! `kv-relay` service (`services/`) is this as a command-line process, with etcd and Dynamo's wire.
//!
//! # Bounds
//! Every queue is bounded and every bound is a setting with a default. A router's
//! memory for messages is about `max_buffered_bytes` plus twice the ZMTP
//! `max_retained_bytes`, whatever the publishers send (see the [`subscriber`] module):
//!
//! ```
//! use std::sync::Arc;
//! use eventplane::discovery::{MemoryDiscovery, Query};
//! use eventplane::lossy::DropPolicy;
//! use eventplane::subscriber::DynamicSubscriber;
//! use eventplane::zmtp;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), eventplane::ConfigError> {
//! let zmtp = zmtp::Config::builder()
//!     .max_frame_size(1 << 20)           // a larger frame closes its connection (default 8 MiB)
//!     .max_message_size(1 << 20)         // so does a larger message (default 16 MiB)
//!     .max_retained_bytes(16 << 20)      // read buffers kept alive by queued messages (default 8 MiB)
//!     .build()?;
//! let router = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("prod"))
//!     .lane_capacity(8192)               // messages per publisher (default 4096)
//!     .lane_bytes(8 << 20)               // bytes per publisher (default 4 MiB)
//!     .max_buffered_bytes(256 << 20)     // all lanes together (default 64 MiB)
//!     .max_publishers(8192)              // publishers followed (default 4096)
//!     .max_concurrent_dials(512)         // dialled at once (default 256)
//!     .drop_policy(DropPolicy::DropOldest) // freshest data wins (default DropNewest)
//!     .zmtp_config(zmtp)
//!     .spawn()?;
//! # drop(router);
//! # Ok(()) }
//! ```
//!
//! On the worker side: [`kv::pipeline::WorkerBuilder::queue_capacity`], the processor's
//! [`ProcessorConfig`](crate::kv::pipeline::ProcessorConfig) (batching, dedup caps), and the
//! publisher's `zmtp_config` (`send_queue_messages`, `send_queue_bytes` per
//! subscriber).
//!
//! # As a `Stream`
//! [`DynamicSubscriber`](crate::subscriber::DynamicSubscriber) is a
//! `Stream<Item = Delivery>`, for combinators (`futures-util`'s `StreamExt` here);
//! `recv_many` is the faster path when a batch at a time suits.
//!
//! ```
//! use std::sync::Arc;
//! use futures_util::StreamExt;
//! use eventplane::discovery::{MemoryDiscovery, Query};
//! use eventplane::publish::EventPublisher;
//! use eventplane::subscriber::DynamicSubscriber;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let discovery = Arc::new(MemoryDiscovery::new());
//! let router = DynamicSubscriber::builder(discovery.clone(), Query::new("prod")).topic("t").spawn()?;
//! let publisher = EventPublisher::builder(discovery, "prod", "w", "t").build().await?;
//! publisher.wait_for_subscribers(1).await;
//! for payload in ["a", "bb", "ccc"] {
//!     publisher.publish(payload);
//! }
//! let sizes: Vec<usize> = router
//!     .filter_map(|d| async move { d.payload().map(|p| p.len()) })
//!     .take(3)
//!     .collect()
//!     .await;
//! assert_eq!(sizes, [1, 2, 3]);
//! # Ok(()) }
//! ```
//!
//! # Tracing
//! The crate logs through [`tracing`](https://docs.rs/tracing) and never installs a
//! subscriber: without one, its warnings (drops, reconnects, a topic that matches no
//! publisher, messages of another layout) go nowhere. Install one at start-up; with
//! `tracing-subscriber` (features `fmt`, `std`, `registry`):
//!
//! ```
//! use tracing_subscriber::filter::Targets;
//! use tracing_subscriber::layer::SubscriberExt;
//! use tracing_subscriber::util::SubscriberInitExt;
//! // Warnings from everything, debug from the subscriber (reconnects, discovery events).
//! let filter = Targets::new()
//!     .with_default(tracing::Level::WARN)
//!     .with_target("eventplane::subscriber", tracing::Level::DEBUG);
//! let _ = tracing_subscriber::registry()
//!     .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
//!     .with(filter)
//!     .try_init();
//! ```
//!
//! `RUST_LOG`-style strings parse into the same filter (`"warn,eventplane=debug"
//! .parse::<Targets>()`); the examples read `RUST_LOG` that way, defaulting to `warn`.
//! Warnings are rate-limited: at most one a minute per publisher and kind, with the
//! count of those suppressed.
//!
//! The page's last part is the repository's `docs/guarantees.md`, included here so
//! that it has one source.
#![doc = include_str!("../docs/guarantees.md")]

#[allow(unused_imports)] // for the intra-doc links above
use crate::{kv, subscriber};
