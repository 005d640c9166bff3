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
        // Connections and departures, next to the messages. A full queue drops
        // notices (`stats().notices_dropped`): size it for the publishers you follow.
        .notices(4096)
        .expect_worker_identity(true) // warns about a worker that registered none
        .spawn()
}

/// What one publisher (one worker process) told us.
#[derive(Debug)]
pub struct Held {
    /// The worker it speaks for (its id and data-parallel rank, from discovery).
    pub worker: WorkerIdentity,
    /// The block hashes it holds, all tiers together.
    pub blocks: HashSet<u64>,
    /// The id its next event must have: a worker numbers its events 1, 2, 3, … so
    /// any other id means events were lost on the way. 0 before the first.
    next_id: u64,
    /// Whether its first `Connected` notice was handled (a second one is a reconnect).
    connected: bool,
}

impl Held {
    fn new(worker: WorkerIdentity) -> Held {
        Held {
            worker,
            blocks: HashSet::new(),
            next_id: 0,
            connected: false,
        }
    }
}

/// Which blocks each worker holds, kept honest: nothing is kept that the worker may
/// no longer hold. One entry per publisher, so a worker's restarted process (a new
/// publisher, the old one not yet gone from discovery) never mixes with the old one.
#[derive(Debug, Default)]
pub struct Index {
    /// Per publisher: its worker and blocks.
    pub publishers: HashMap<ChannelId, Held>,
    /// Deliveries handled.
    pub deliveries: u64,
    /// Deliveries from publishers that registered no worker identity (skipped).
    pub unidentified: u64,
    /// Deliveries whose payload did not decode (that publisher's blocks dropped).
    pub undecodable: u64,
    /// Times a publisher's blocks were dropped because some of its events were lost.
    pub lost: u64,
    /// Connections to publishers so far (reconnections included).
    pub connections: u64,
}

impl Index {
    /// The workers holding `block`.
    pub fn holders(&self, block: u64) -> impl Iterator<Item = WorkerIdentity> + '_ {
        self.publishers
            .values()
            .filter(move |p| p.blocks.contains(&block))
            .map(|p| p.worker)
    }

    /// Applies one delivery's router events.
    pub fn deliver(&mut self, delivery: &Delivery) {
        self.deliveries += 1;
        // A publisher registered without a worker identity: count it (the subscriber
        // warns once a minute), or key such publishers by `source.id` alone.
        let Some(worker) = delivery.source.worker else {
            self.unidentified += 1;
            return;
        };
        let id = &delivery.source.id;
        if !self.publishers.contains_key(id) {
            self.publishers.insert(id.clone(), Held::new(worker)); // cloned once, not per delivery
        }
        let Some(held) = self.publishers.get_mut(id) else {
            return;
        };
        let Some(Ok(events)) = delivery.payload().map(|p| decode_router_events(&p)) else {
            self.undecodable += 1;
            held.blocks.clear(); // what it holds now is unknown
            held.next_id = 0; // and the next id tells nothing more
            return;
        };
        for event in events {
            if held.next_id != 0 && event.event.id != held.next_id {
                // Events were lost between the worker and us (a full queue, a dropped
                // connection, our own lanes): what we hold of it may be stale. Drop
                // it; what follows rebuilds it. (Dynamo's router does the same.)
                held.blocks.clear();
                self.lost += 1;
            }
            held.next_id = event.event.id.saturating_add(1);
            match event.event.data {
                KvEventData::Stored { blocks, .. } => {
                    held.blocks.extend(blocks.iter().map(|b| b.block_hash.0))
                }
                // All tiers together: a removal from one tier may drop a block another
                // tier still holds (we under-count, never over-count).
                KvEventData::Removed { block_hashes } => {
                    for h in block_hashes {
                        held.blocks.remove(&h.0);
                    }
                }
                // The engine reset its cache, or the worker lost track of its engine
                // (a dropped batch, an engine restart): it holds nothing we know of.
                KvEventData::Cleared => held.blocks.clear(),
                _ => {}
            }
        }
    }

    /// Applies one lifecycle notice (after the batch it came with).
    pub fn notice(&mut self, notice: Notice) {
        match notice {
            // Connected, and again after a lost connection: what it sent meanwhile is
            // gone (its last clear perhaps with it), so drop what we hold of it.
            Notice::Connected(instance) => {
                self.connections += 1;
                let Some(worker) = instance.worker else {
                    return;
                };
                let held = self
                    .publishers
                    .entry(instance.id.clone())
                    .or_insert_with(|| Held::new(worker));
                if std::mem::replace(&mut held.connected, true) {
                    held.blocks.clear();
                    held.next_id = 0;
                    self.lost += 1;
                }
            }
            // It left, and every message it sent has been delivered.
            Notice::Departed(id) => {
                self.publishers.remove(&id);
            }
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
