//! Guides: the two processes users build, start to finish, and the setup around them.
//! Every example here is compiled and run as a test.
//!
//! - [The router side](#the-router-side): subscribe → decode → index per worker →
//!   handle gaps and departures.
//! - [The worker side](#the-worker-side): engine → [`kv::Worker`] → publisher.
//! - [Bounds](#bounds): every memory bound, set in one place.
//! - [As a `Stream`](#as-a-stream).
//! - [Tracing](#tracing): seeing the crate's warnings.
//!
//! # The router side
//! A router follows every worker's KV-event publisher through discovery and keeps an
//! index of which worker holds which block. Three things keep that index honest:
//!
//! - **Who sent it.** A publisher registered with
//!   [`EventPublisherBuilder::worker`](crate::publish::EventPublisherBuilder::worker)
//!   carries its worker identity in discovery, so every delivery's `source.worker`
//!   names the worker before the payload is decoded.
//! - **What was lost.** With [`notices`](crate::subscriber::DynamicSubscriberBuilder::notices)
//!   on, a [`Notice::Gap`](crate::subscriber::Notice::Gap) or `Reset` says that a
//!   publisher's messages went missing: that worker's entries are incomplete until it
//!   clears or re-sends.
//! - **Who left.** `Notice::Departed` comes once every message the departed publisher
//!   sent was handed over: drop that worker's entries then, not earlier. Handle each
//!   batch before the notices, and wait for notices beside `recv_many`
//!   ([`SubscriberHandle::notice_ready`](crate::subscriber::SubscriberHandle::notice_ready)):
//!   otherwise a departure among quiet workers is heard only when a message arrives.
//!
//! ```
//! use std::collections::{HashMap, HashSet};
//! use std::sync::Arc;
//! use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, WorkerIdentity};
//! use eventplane::kv::{decode_router_events, KvEventData};
//! use eventplane::subscriber::{DynamicSubscriber, Notice};
//! # use eventplane::kv::{encode_router_events, KvEvent, RouterEvent, StorageTier, StoredBlock, BlockHash, TokensHash, WorkerId};
//! # use eventplane::publish::EventPublisher;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new()); // or EtcdDiscovery
//! let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("prod"))
//!     .topic("kv-events")
//!     .notices(1024)
//!     .spawn()?;
//! # let worker = EventPublisher::builder(discovery, "prod", "w", "kv-events").worker(7, 0).build().await?;
//! # worker.wait_for_subscribers(1).await;
//! # let data = KvEventData::Stored { parent_hash: None, blocks: vec![StoredBlock { block_hash: BlockHash(42), tokens_hash: TokensHash(1) }] };
//! # worker.publish(encode_router_events(&[RouterEvent { worker_id: WorkerId(7), tier: StorageTier::Device, event: KvEvent { id: 1, dp_rank: 0, data } }])?);
//! let mut blocks: HashMap<WorkerIdentity, HashSet<u64>> = HashMap::new();
//! let mut worker_of: HashMap<ChannelId, WorkerIdentity> = HashMap::new();
//! let mut incomplete: HashSet<WorkerIdentity> = HashSet::new();
//! let (mut unidentified, mut undecodable) = (0u64, 0u64);
//! let lifecycle = router.handle(); // waits for notices while `router` receives
//! let (mut batch, mut notices) = (Vec::new(), Vec::new());
//! loop {
//!     tokio::select! {
//!         n = router.recv_many(&mut batch, 256) => if n == 0 { break }, // shut down
//!         () = lifecycle.notice_ready() => {} // a departure while nothing arrives
//!     }
//!     // The batch first: a publisher's `Departed` comes after its last delivery.
//!     for delivery in batch.drain(..) {
//!         // A publisher registered without `.worker(..)`: count it, or key by source.id.
//!         let Some(worker) = delivery.source.worker else { unidentified += 1; continue };
//!         worker_of.insert(delivery.source.id.clone(), worker);
//!         let Some(Ok(events)) = delivery.payload().map(|p| decode_router_events(&p)) else {
//!             undecodable += 1; // and `incomplete.insert(worker)`, if that matters
//!             continue;
//!         };
//!         let held = blocks.entry(worker).or_default();
//!         for event in events {
//!             match event.event.data {
//!                 KvEventData::Stored { blocks: b, .. } => held.extend(b.iter().map(|b| b.block_hash.0)),
//!                 KvEventData::Removed { block_hashes } => block_hashes.iter().for_each(|h| { held.remove(&h.0); }),
//!                 KvEventData::Cleared => { held.clear(); incomplete.remove(&worker); }
//!                 _ => {}
//!             }
//!         }
//!     }
//!     router.take_notices(&mut notices);
//!     for notice in notices.drain(..) {
//!         match notice {
//!             Notice::Gap { id, .. } | Notice::Reset { id } => incomplete.extend(worker_of.get(&id).copied()),
//!             Notice::Departed(id) => {
//!                 if let Some(w) = worker_of.remove(&id) { blocks.remove(&w); incomplete.remove(&w); }
//!             }
//!             _ => {} // Connected: the instance, with its worker, before its first delivery
//!         }
//!     }
//! #   if blocks.get(&WorkerIdentity::new(7, 0)).is_some_and(|b| b.contains(&42)) { break; }
//! }
//! # assert_eq!((incomplete.len(), unidentified, undecodable), (0, 0, 0));
//! # Ok(()) }
//! ```
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
//! discovery. [`kv::Worker`] wires listener, processor and sink; `shutdown` publishes
//! what was queued, then drains and unregisters the publisher.
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use eventplane::discovery::MemoryDiscovery;
//! use eventplane::kv::{EngineListenerConfig, ProcessorConfig, Worker, WorkerId};
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
//! The pieces stay usable alone: an [`EngineListener`](crate::kv::EngineListener)
//! feeding your own channel, a [`Processor`](crate::kv::Processor) over your own
//! [`EventSink`](crate::kv::EventSink) (or [`Worker::with_sink`](crate::kv::Worker::with_sink)),
//! or the sans-IO [`Pipeline`](crate::kv::Pipeline) with no task at all. The
//! `kv_relay` example is this as a command-line process, with etcd and Dynamo's wire.
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
//!     .drop_policy(DropPolicy::DropOldest) // freshest data wins (default DropNewest)
//!     .zmtp_config(zmtp)
//!     .spawn()?;
//! # drop(router);
//! # Ok(()) }
//! ```
//!
//! On the worker side: [`kv::WorkerBuilder::queue_capacity`], the processor's
//! [`ProcessorConfig`](crate::kv::ProcessorConfig) (batching, dedup caps), and the
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

#[allow(unused_imports)] // for the intra-doc links above
use crate::{kv, subscriber};
