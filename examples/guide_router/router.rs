use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use eventplane::ConfigError;
use eventplane::discovery::{ChannelId, Discovery, Query, WorkerIdentity};
use eventplane::kv::{KvEventData, decode_router_events};
use eventplane::subscriber::{Delivery, DynamicSubscriber, Notice};

/// Follows every KV-event publisher of `namespace` (each worker registers one).
pub fn subscribe(
    discovery: Arc<dyn Discovery>,
    namespace: &str,
) -> Result<DynamicSubscriber, ConfigError> {
    DynamicSubscriber::builder(discovery, Query::new(namespace))
        .topic("kv-events")
        .notices(1024) // connections and departures, next to the messages
        .expect_worker_identity(true) // warns about a worker that registered none
        .spawn()
}

/// Which blocks each worker holds, kept honest: nothing is kept that the worker may
/// no longer hold.
#[derive(Debug, Default)]
pub struct Index {
    /// Block hashes per worker (its id and data-parallel rank, from discovery).
    pub blocks: HashMap<WorkerIdentity, HashSet<u64>>,
    /// Deliveries handled.
    pub deliveries: u64,
    /// Deliveries from publishers that registered no worker identity (skipped).
    pub unidentified: u64,
    /// Deliveries whose payload did not decode (that worker's blocks dropped).
    pub undecodable: u64,
    /// Times a worker's blocks were dropped because some of its events were lost.
    pub lost: u64,
    /// Connections to publishers so far (reconnections included).
    pub connections: u64,
    worker_of: HashMap<ChannelId, WorkerIdentity>,
    /// The id each publisher's next event must have: a worker numbers its events
    /// 1, 2, 3, … so any other id means events were lost on the way.
    next_id: HashMap<ChannelId, u64>,
}

impl Index {
    /// Applies one delivery's router events.
    pub fn deliver(&mut self, delivery: &Delivery) {
        self.deliveries += 1;
        // A publisher registered without a worker identity: count it (the subscriber
        // warns once a minute), or key such publishers by `source.id` instead.
        let Some(worker) = delivery.source.worker else {
            self.unidentified += 1;
            return;
        };
        self.worker_of.insert(delivery.source.id.clone(), worker);
        let Some(Ok(events)) = delivery.payload().map(|p| decode_router_events(&p)) else {
            self.undecodable += 1;
            self.blocks.remove(&worker); // what it holds now is unknown
            return;
        };
        let held = self.blocks.entry(worker).or_default();
        // 0: nothing seen from this publisher yet (ids start at 1).
        let next = self.next_id.entry(delivery.source.id.clone()).or_insert(0);
        for event in events {
            if *next != 0 && event.event.id != *next {
                // Events were lost between the worker and us (a full queue, a dropped
                // connection): what we hold of it may be stale. Drop it; what follows
                // rebuilds it. (Dynamo's router does the same on an id gap.)
                held.clear();
                self.lost += 1;
            }
            *next = event.event.id.saturating_add(1);
            match event.event.data {
                KvEventData::Stored { blocks, .. } => {
                    held.extend(blocks.iter().map(|b| b.block_hash.0))
                }
                KvEventData::Removed { block_hashes } => {
                    for h in block_hashes {
                        held.remove(&h.0);
                    }
                }
                // The engine reset its cache, or the worker lost track of its engine
                // (a dropped batch, an engine restart): it holds nothing we know of.
                KvEventData::Cleared => held.clear(),
                _ => {}
            }
        }
    }

    /// Applies one lifecycle notice (after the batch it came with).
    pub fn notice(&mut self, notice: Notice) {
        match notice {
            // It left, and every message it sent has been delivered.
            Notice::Departed(id) => {
                self.next_id.remove(&id);
                if let Some(worker) = self.worker_of.remove(&id) {
                    self.blocks.remove(&worker);
                }
            }
            // The instance, with its worker, before its first delivery.
            Notice::Connected(_) => self.connections += 1,
            // Gap, Reset: messages lost or renumbered; the event ids above tell which
            // events, in order, including those this process dropped itself.
            _ => {}
        }
    }
}

/// Feeds `index` from `router` until `done(index)` holds or the router stops.
pub async fn route(
    router: &mut DynamicSubscriber,
    index: &mut Index,
    done: impl Fn(&Index) -> bool,
) {
    let lifecycle = router.handle(); // to wait for notices while `router` receives
    let (mut batch, mut notices) = (Vec::new(), Vec::new());
    while !done(index) {
        tokio::select! {
            n = router.recv_many(&mut batch, 256) => if n == 0 { return }, // shut down
            () = lifecycle.notice_ready() => {} // a departure while nothing arrives
        }
        // The batch first: a publisher's `Departed` comes after its last delivery.
        for delivery in batch.drain(..) {
            index.deliver(&delivery);
        }
        router.take_notices(&mut notices);
        for notice in notices.drain(..) {
            index.notice(notice);
        }
    }
}
