//! Feeding a [`RouterIndex`] from the event plane: each publisher's events checked
//! for loss by their dense ids, attributed to the publisher's identity, and its
//! departure applied.

use smallvec::SmallVec;

use super::KvDecodeError;
use super::event::{DpRank, KvEventData, RouterEvent, WorkerId};
use super::index::{IndexRefusal, RouterIndex, RouterIndexConfig, RouterIndexStats};
use super::sink::decode_router_payload;
use crate::discovery::{ChannelId, Instance};
use crate::hash::FastMap;
use crate::subscriber::{Delivery, Item, Notice};
use crate::wire::Wire;

/// (worker, rank)s one publisher may feed. A publisher speaks for one worker (its
/// ranks: a handful); one with no known identity could name any number, so past
/// this its events for further ranks are refused and counted
/// ([`IndexFeedStats::refused_rank_events`]).
const MAX_RANKS_PER_PUBLISHER: usize = 64;

/// What the router holds of one publisher.
#[derive(Debug, Default)]
struct Followed {
    /// The id its next event must have (ids are dense from 1); 0 before the first.
    next_id: u64,
    /// Whether its first connection was seen (a second one is a reconnect).
    connected: bool,
    /// The (worker, rank)s it fed.
    fed: SmallVec<[(WorkerId, DpRank); 2]>,
}

/// Why a publisher's blocks were dropped from the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wipe {
    /// Its event ids skipped: events were lost on the way (its queue, the network,
    /// this router's lanes).
    IdGap {
        /// The id that was due.
        expected: u64,
        /// The id that came.
        got: u64,
    },
    /// It connected again: what it sent while disconnected is gone.
    Reconnected,
    /// It left discovery (or the bus).
    Departed,
}

/// A wipe that dropped blocks: which publisher, why, how many blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wiped {
    /// The publisher.
    pub publisher: ChannelId,
    /// Why.
    pub cause: Wipe,
    /// Blocks dropped from the index.
    pub blocks: u64,
}

/// Counters of an [`IndexFeed`], with its index's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct IndexFeedStats {
    /// The index's sizes and counters.
    pub index: RouterIndexStats,
    /// Publishers followed now.
    pub publishers: u64,
    /// Router events applied (whole or in part).
    pub events: u64,
    /// Events refused by the index ([`IndexRefusal`]; its stats say why).
    pub refused_events: u64,
    /// Events refused because their publisher fed its cap of (worker, rank)s.
    pub refused_rank_events: u64,
    /// Payloads that did not decode.
    pub undecodable: u64,
    /// Publishers' views lost and wiped: event id gaps.
    pub wipes_id_gap: u64,
    /// ... reconnections.
    pub wipes_reconnect: u64,
    /// Publishers that departed (their blocks dropped).
    pub departed: u64,
    /// Blocks dropped by wipes and departures.
    pub wiped_blocks: u64,
}

/// A [`RouterIndex`] kept from what a [`DynamicSubscriber`](crate::subscriber::DynamicSubscriber)
/// delivers: the router side of the event plane, sans-IO.
///
/// - **Attribution.** Each event is applied as sent by its publisher's identity
///   ([`Instance::worker`], from discovery or granted on the bus): a payload naming
///   another worker is refused ([`IndexRefusal::ForeignWorker`]).
/// - **Loss.** Event ids are dense per publisher: an id other than the next one
///   means events were lost, so every (worker, rank) that publisher fed is cleared
///   before the event is applied (as Dynamo's router resets a worker on an id gap):
///   the index under-claims, never holds a block the worker may have evicted. So
///   does a reconnection.
/// - **Departure.** A publisher that departs takes the blocks of the ranks it fed
///   with it — unless another publisher fed that rank since (a restarted worker's new
///   publisher keeps what it sent).
///
/// Feed it [`Item`]s from [`recv_item`](crate::subscriber::DynamicSubscriber::recv_item),
/// in order; [`wiped`](Self::wiped) drains the wipes since the last call (for logs).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
/// use eventplane::kv::{
///     encode_router_events, local_block_hashes, BlockHash, IndexFeed, KvEvent, KvEventData,
///     RouterEvent, RouterIndexConfig, StorageTier, StoredBlock, WorkerId,
/// };
/// use eventplane::publish::EventPublisher;
/// use eventplane::subscriber::DynamicSubscriber;
/// use eventplane::wire::Wire;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
/// let mut router = DynamicSubscriber::builder(discovery.clone(), Query::new("prod"))
///     .topic("kv-events")
///     .notices(1024)
///     .spawn()?;
/// // A worker (id 7) publishes one stored block.
/// let worker = EventPublisher::builder(discovery, "prod", "worker", "kv-events")
///     .worker(7, 0)
///     .build()
///     .await?;
/// worker.wait_for_subscribers(1).await;
/// let tokens = local_block_hashes(&[1, 2, 3, 4], 4);
/// let block = StoredBlock { block_hash: BlockHash(70), tokens_hash: tokens[0] };
/// let data = KvEventData::Stored { parent_hash: None, blocks: vec![block] };
/// let event = RouterEvent { worker_id: WorkerId(7), tier: StorageTier::Device, event: KvEvent { id: 1, dp_rank: 0, data } };
/// worker.publish(encode_router_events(&[event])?);
///
/// let mut feed = IndexFeed::new(RouterIndexConfig::default());
/// while let Some(item) = router.recv_item().await {
///     let _ = feed.item(Wire::EventPlane, &item); // an undecodable payload is counted
///     if feed.index().stats().blocks == 1 {
///         break;
///     }
/// }
/// let best = feed.index().find_matches(&tokens).best().unwrap();
/// assert_eq!((best.worker_id, best.blocks), (WorkerId(7), 1));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct IndexFeed {
    index: RouterIndex,
    publishers: FastMap<ChannelId, Followed>,
    /// The publisher that last fed each (worker, rank).
    owners: FastMap<(WorkerId, DpRank), ChannelId>,
    /// Wipes not yet taken by [`wiped`](Self::wiped) (at most the last 64).
    wiped: Vec<Wiped>,
    stats: IndexFeedStats,
}

/// Wipes kept for [`IndexFeed::wiped`] between two calls; older ones are only
/// counted.
const MAX_WIPES_KEPT: usize = 64;

impl Default for IndexFeed {
    fn default() -> Self {
        IndexFeed::new(RouterIndexConfig::default())
    }
}

impl IndexFeed {
    /// A feed into an empty index.
    pub fn new(config: RouterIndexConfig) -> IndexFeed {
        IndexFeed {
            index: RouterIndex::new(config),
            publishers: FastMap::default(),
            owners: FastMap::default(),
            wiped: Vec::new(),
            stats: IndexFeedStats::default(),
        }
    }

    /// The index.
    pub fn index(&self) -> &RouterIndex {
        &self.index
    }

    /// Applies one item of the subscriber's ordered stream: a delivery's router
    /// events (decoded as `wire` carries them), or a notice.
    pub fn item(&mut self, wire: Wire, item: &Item) -> Result<(), KvDecodeError> {
        match item {
            Item::Delivery(d) => self.delivery(wire, d),
            Item::Notice(n) => {
                self.notice(n);
                Ok(())
            }
        }
    }

    /// Decodes a delivery's router events and applies them
    /// ([`apply`](Self::apply)); a payload that does not decode is counted and
    /// returned.
    pub fn delivery(&mut self, wire: Wire, delivery: &Delivery) -> Result<(), KvDecodeError> {
        let events = delivery
            .payload()
            .map(|p| decode_router_payload(wire, &p))
            .unwrap_or_else(|| Ok(Vec::new()));
        match events {
            Ok(events) => {
                self.apply(&delivery.source, &events);
                Ok(())
            }
            Err(e) => {
                self.stats.undecodable += 1;
                Err(e)
            }
        }
    }

    /// Applies `events` from the publisher `source`, in order.
    pub fn apply(&mut self, source: &Instance, events: &[RouterEvent]) {
        let sender = source.worker.map(|w| WorkerId(w.worker_id));
        if !self.publishers.contains_key(&source.id) {
            self.publishers
                .insert(source.id.clone(), Followed::default());
        }
        for ev in events {
            let Some(p) = self.publishers.get_mut(&source.id) else {
                return;
            };
            if p.next_id != 0 && ev.event.id != p.next_id {
                let cause = Wipe::IdGap {
                    expected: p.next_id,
                    got: ev.event.id,
                };
                self.wipe(&source.id, cause);
            }
            let Some(p) = self.publishers.get_mut(&source.id) else {
                return;
            };
            p.next_id = ev.event.id.saturating_add(1);
            let key = (ev.worker_id, ev.event.dp_rank);
            let known = p.fed.contains(&key);
            if !known && p.fed.len() >= MAX_RANKS_PER_PUBLISHER {
                self.stats.refused_rank_events += 1;
                continue;
            }
            // Only blocks stored make a publisher the rank's owner (whose loss or
            // departure clears it): an event that stored nothing takes nothing over.
            let stores =
                matches!(&ev.event.data, KvEventData::Stored { blocks, .. } if !blocks.is_empty());
            match self.index.apply(sender, ev) {
                Err(IndexRefusal::RankFull { .. } | IndexRefusal::IndexFull { .. }) => {
                    // Its leading blocks were stored.
                    self.stats.refused_events += 1;
                }
                Err(_) => {
                    self.stats.refused_events += 1;
                    continue;
                }
                Ok(()) => {}
            }
            self.stats.events += 1;
            if !stores {
                continue;
            }
            if !known {
                p.fed.push(key);
            }
            if self.owners.get(&key) != Some(&source.id) {
                self.owners.insert(key, source.id.clone());
            }
        }
    }

    /// Applies a lifecycle notice: a reconnection wipes what the publisher fed, a
    /// departure drops it.
    pub fn notice(&mut self, notice: &Notice) {
        match notice {
            Notice::Connected(instance) => {
                let p = self.publishers.entry(instance.id.clone()).or_default();
                if std::mem::replace(&mut p.connected, true) {
                    p.next_id = 0;
                    self.wipe(&instance.id, Wipe::Reconnected);
                }
            }
            Notice::Departed(id) => self.depart(id),
            _ => {}
        }
    }

    /// Drops the publishers `followed` says are no longer followed (after notices
    /// were dropped from a full queue, a `Departed` may be among them).
    pub fn retain_publishers(&mut self, mut followed: impl FnMut(&ChannelId) -> bool) {
        let gone: Vec<ChannelId> = self
            .publishers
            .keys()
            .filter(|id| !followed(id))
            .cloned()
            .collect();
        for id in gone {
            self.depart(&id);
        }
    }

    /// The wipes that dropped blocks since the last call (the last 64 of them).
    pub fn wiped(&mut self) -> Vec<Wiped> {
        std::mem::take(&mut self.wiped)
    }

    /// Counters, with the index's.
    pub fn stats(&self) -> IndexFeedStats {
        IndexFeedStats {
            index: self.index.stats(),
            publishers: self.publishers.len() as u64,
            ..self.stats
        }
    }

    fn depart(&mut self, id: &ChannelId) {
        if self.publishers.contains_key(id) {
            self.stats.departed += 1;
            self.wipe(id, Wipe::Departed);
            self.publishers.remove(id);
        }
    }

    /// Clears every rank `id` fed that no other publisher fed since.
    fn wipe(&mut self, id: &ChannelId, cause: Wipe) {
        let Some(p) = self.publishers.get_mut(id) else {
            return;
        };
        let fed = std::mem::take(&mut p.fed);
        let mut blocks = 0;
        for key in fed {
            if self.owners.get(&key) == Some(id) {
                self.owners.remove(&key);
                blocks += self.index.rank_blocks(key.0, key.1) as u64;
                self.index.clear_rank(key.0, key.1);
            }
        }
        match cause {
            Wipe::IdGap { .. } => self.stats.wipes_id_gap += 1,
            Wipe::Reconnected => self.stats.wipes_reconnect += 1,
            Wipe::Departed => {}
        }
        self.stats.wiped_blocks += blocks;
        if blocks > 0 || cause == Wipe::Departed {
            if self.wiped.len() >= MAX_WIPES_KEPT {
                self.wiped.remove(0);
            }
            self.wiped.push(Wiped {
                publisher: id.clone(),
                cause,
                blocks,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;
    use crate::discovery::{Transport, WorkerIdentity};
    use crate::kv::{BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash};

    fn instance(n: u64, worker: Option<u64>) -> Instance {
        let id = ChannelId::new("ns", "c", "t", n).unwrap();
        let i = Instance::new(id, Transport::zmq("tcp://127.0.0.1:1"), 1);
        match worker {
            Some(w) => i.with_worker(WorkerIdentity::new(w, 0)),
            None => i,
        }
    }

    fn stored(worker: u64, id: u64, hash: u64) -> RouterEvent {
        RouterEvent {
            worker_id: WorkerId(worker),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: 0,
                data: KvEventData::Stored {
                    parent_hash: None,
                    blocks: vec![StoredBlock {
                        block_hash: BlockHash(hash),
                        tokens_hash: TokensHash(hash),
                    }],
                },
            },
        }
    }

    #[test]
    fn an_id_gap_wipes_what_the_publisher_fed_then_applies_the_event() {
        let mut feed = IndexFeed::default();
        let a = instance(1, Some(7));
        feed.apply(&a, &[stored(7, 1, 10), stored(7, 2, 11)]);
        assert_eq!(feed.index().stats().blocks, 2);
        feed.apply(&a, &[stored(7, 5, 12)]);
        assert_eq!(feed.index().stats().blocks, 1);
        let s = feed.stats();
        assert_eq!((s.wipes_id_gap, s.wiped_blocks), (1, 2));
        assert_eq!(
            feed.wiped(),
            [Wiped {
                publisher: a.id.clone(),
                cause: Wipe::IdGap {
                    expected: 3,
                    got: 5
                },
                blocks: 2
            }]
        );
    }

    #[test]
    fn an_event_that_stores_nothing_takes_no_rank_over() {
        let mut feed = IndexFeed::default();
        let (owner, other) = (instance(1, None), instance(2, None));
        feed.apply(&owner, &[stored(7, 1, 10)]);
        // Another publisher's empty removal and refused store for the same rank.
        let empty = RouterEvent {
            event: KvEvent {
                data: KvEventData::Removed {
                    block_hashes: vec![],
                },
                ..stored(7, 1, 0).event
            },
            ..stored(7, 1, 0)
        };
        let mut orphan = stored(7, 2, 11);
        if let KvEventData::Stored { parent_hash, .. } = &mut orphan.event.data {
            *parent_hash = Some(BlockHash(999));
        }
        feed.apply(&other, &[empty, orphan]);
        // The owner's departure still clears it.
        feed.notice(&Notice::Departed(owner.id.clone()));
        assert_eq!(feed.index().stats().blocks, 0);
    }

    #[test]
    fn a_publisher_writes_only_its_own_workers_blocks() {
        let mut feed = IndexFeed::default();
        feed.apply(&instance(1, Some(7)), &[stored(8, 1, 10)]);
        assert_eq!(feed.index().stats().blocks, 0);
        assert_eq!(feed.stats().refused_events, 1);
        assert_eq!(feed.index().stats().refused_foreign, 1);
    }

    #[test]
    fn a_departure_keeps_ranks_another_publisher_fed_since() {
        let mut feed = IndexFeed::default();
        let (old, new) = (instance(1, Some(7)), instance(2, Some(7)));
        let other = instance(3, Some(9));
        feed.apply(&old, &[stored(7, 1, 10)]);
        feed.apply(&other, &[stored(9, 1, 30)]);
        feed.apply(&new, &[stored(7, 1, 20)]);
        feed.notice(&Notice::Departed(old.id.clone()));
        // Worker 7's rank now belongs to the new publisher: kept (both blocks).
        assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 2);
        feed.notice(&Notice::Departed(new.id.clone()));
        assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 0);
        feed.retain_publishers(|_| false);
        let s = feed.stats();
        assert_eq!((s.publishers, s.departed, s.index.blocks), (0, 3, 0));
    }

    #[test]
    fn a_reconnection_wipes_and_restarts_the_id_check() {
        let mut feed = IndexFeed::default();
        let a = instance(1, None);
        feed.notice(&Notice::Connected(std::sync::Arc::new(a.clone())));
        feed.apply(&a, &[stored(7, 1, 10)]);
        feed.notice(&Notice::Connected(std::sync::Arc::new(a.clone())));
        assert_eq!(feed.index().stats().blocks, 0);
        // The next event is taken whatever its id.
        feed.apply(&a, &[stored(7, 9, 11)]);
        let s = feed.stats();
        assert_eq!(
            (s.wipes_reconnect, s.wipes_id_gap, s.index.blocks),
            (1, 0, 1)
        );
    }

    #[test]
    fn a_publisher_without_identity_feeds_a_bounded_number_of_ranks() {
        let mut feed = IndexFeed::default();
        let a = instance(1, None);
        let events: Vec<RouterEvent> = (0..100).map(|w| stored(w, w + 1, w)).collect();
        feed.apply(&a, &events);
        let s = feed.stats();
        assert_eq!(s.index.ranks, MAX_RANKS_PER_PUBLISHER as u64);
        assert_eq!(s.refused_rank_events, 100 - MAX_RANKS_PER_PUBLISHER as u64);
    }
}
