//! Feeding a [`RouterIndex`] from the event plane: each publisher's events checked
//! for loss by their dense ids, attributed to the publisher's identity, and its
//! departure applied.

use smallvec::SmallVec;

use super::event::{DpRank, KvEventData, RouterEvent, StorageTier, WorkerId};
use super::index::{IndexRefusal, RouterIndex, RouterIndexConfig, RouterIndexStats};
use std::collections::VecDeque;
use std::time::Duration;

use super::{KvDecodeError, Recovered, RecoveryError, RecoveryRequest};
use crate::discovery::{ChannelId, Instance};
use crate::hash::FastMap;
use crate::subscriber::{Delivery, Item, Notice};
use crate::wire::Dialect;

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
    /// The worker its identity names (events are applied as sent by it).
    sender: Option<WorkerId>,
    /// The data-parallel rank its identity names.
    sender_rank: Option<DpRank>,
    /// Where its worker serves its recovery log.
    recovery: Option<String>,
    /// A recovery in progress.
    repair: Option<Repairing>,
    /// A dump was applied (first sight is over).
    rebuilt: bool,
    /// Recoveries in a row that failed: how long the next rebuild waits.
    failures: u32,
    /// The highest id of a live event seen (held or applied).
    last_live: u64,
    /// After a recovery answer current past the live events seen: which live events
    /// may still be late copies of what it applied (see [`Late`]).
    late: Option<Late>,
    /// Whether its first connection was seen (a second one is a reconnect).
    connected: bool,
    /// The (worker, rank)s it fed.
    fed: SmallVec<[(WorkerId, DpRank); 2]>,
    /// The (worker, rank)s another publisher took over from it, and which: while that
    /// one owns the rank, this one's events for it are dropped (an old relay's last
    /// or held events cannot take a rank back). Forgotten when it connects again.
    superseded: SmallVec<[((WorkerId, DpRank), ChannelId); 1]>,
}

/// The live events that may arrive after a recovery answer that already applied
/// them (they were on their way when it was read): a run of increasing ids ending at
/// most at `through`, each above `lo` and at least `next`. Ids may be missing from the
/// run (lost on the way, as the ones the answer repaired were): the answer covered
/// them too. Each is skipped; any other id ends it.
#[derive(Debug, Clone, Copy)]
struct Late {
    lo: u64,
    /// 0 until the run's first event.
    next: u64,
    through: u64,
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
    /// Its loss could not be repaired from its worker's recovery log (the request
    /// failed).
    RecoveryFailed,
    /// More of its live events arrived during its recovery than the feed holds.
    HeldOverflow,
    /// Another publisher stored into a (worker, rank) it fed: a restarted worker or
    /// relay speaks for that rank now, and what this one fed (perhaps evicted since,
    /// while it was away) is dropped before the newcomer's blocks are applied.
    Superseded,
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
    /// Losses repaired from the worker's recovery log: events since the gap.
    pub repairs_since: u64,
    /// ... a dump (first sight, or a gap the log no longer covered).
    pub repairs_dump: u64,
    /// ... a dump asked again after a recovery failed and wiped the publisher
    /// (a *rebuild*, retried with a backoff of up to 60 s).
    pub repairs_rebuild: u64,
    /// Rebuilds that failed too (asked again, later).
    pub rebuilds_failed: u64,
    /// Losses wiped because the recovery request failed.
    pub wipes_recovery_failed: u64,
    /// Losses wiped because too many live events arrived during recoveries, again and
    /// again.
    pub wipes_held_overflow: u64,
    /// Ranks dropped because another publisher took them over ([`Wipe::Superseded`]).
    pub wipes_superseded: u64,
    /// Events dropped because their publisher was superseded for their rank.
    pub superseded_events: u64,
    /// Live events dropped while held for a recovery (asked for again).
    pub held_dropped: u64,
    /// Recovery answers to requests no longer awaited (ignored).
    pub stale_answers: u64,
    /// Live events that arrived after a recovery answer had applied them (sent
    /// before the answer was read), skipped.
    pub late_duplicates: u64,
    /// Publishers recovering now (their live events held).
    pub recovering: u64,
    /// Publishers waiting for a rebuild (their live events applied meanwhile).
    pub rebuilding: u64,
    /// Live events held now for publishers that recover.
    pub held_events: u64,
    /// Of the last 256 repairs, the median and the 99th-percentile time from request
    /// to answer, in milliseconds.
    pub repair_p50_ms: u64,
    /// See `repair_p50_ms`.
    pub repair_p99_ms: u64,
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
/// - **Takeover.** A publisher that stores into a rank another publisher fed (a
///   restarted worker or relay, under a new publisher id) first clears it
///   ([`Wipe::Superseded`]): the earlier publisher's blocks may have been evicted
///   while it was away, and nothing would ever remove them.
/// - **Departure.** A publisher that departs takes the blocks of the ranks it fed
///   with it — unless another publisher took that rank over since (a restarted
///   worker's new publisher keeps what it sent).
///
/// Feed it [`Item`]s from [`recv_item`](crate::subscriber::DynamicSubscriber::recv_item),
/// in order; [`wiped`](Self::wiped) drains the wipes since the last call (for logs).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, WorkerId, router::{local_block_hashes, IndexFeed, RouterIndexConfig}};
/// use eventplane::publish::EventPublisher;
/// use eventplane::subscriber::DynamicSubscriber;
/// use eventplane::wire::Dialect;
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
/// worker.publish(Dialect::EventPlane.encode_router_events(&[event])?);
///
/// let mut feed = IndexFeed::new(RouterIndexConfig::default());
/// while let Some(item) = router.recv_item().await {
///     let _ = feed.item(Dialect::EventPlane, &item); // an undecodable payload is counted
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
    /// Live events held across publishers that recover, and their blocks.
    held_total: usize,
    held_blocks_total: usize,
    /// The last recovery request's serial.
    serial: u64,
    /// The last repairs' latencies, in milliseconds.
    latencies: VecDeque<u64>,
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
            held_total: 0,
            held_blocks_total: 0,
            serial: 0,
            latencies: VecDeque::new(),
            stats: IndexFeedStats::default(),
        }
    }

    /// The index.
    pub fn index(&self) -> &RouterIndex {
        &self.index
    }

    /// Applies one item of the subscriber's ordered stream: a delivery's router
    /// events (decoded in `dialect`), or a notice.
    pub fn item(&mut self, dialect: Dialect, item: &Item) -> Result<(), KvDecodeError> {
        match item {
            Item::Delivery(d) => self.delivery(dialect, d),
            Item::Notice(n) => {
                self.notice(n);
                Ok(())
            }
        }
    }

    /// Decodes a delivery's router events and applies them
    /// ([`apply`](Self::apply)); a payload that does not decode is counted and
    /// returned.
    pub fn delivery(&mut self, dialect: Dialect, delivery: &Delivery) -> Result<(), KvDecodeError> {
        let events = delivery
            .payload()
            .map(|p| dialect.decode_router_events(&p))
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

    /// Applies `events` from the publisher `source`, in order. With a recovery
    /// endpoint ([`Instance::recovery`]), a loss is repaired instead of wiped: see
    /// [`take_recoveries`](Self::take_recoveries).
    pub fn apply(&mut self, source: &Instance, events: &[RouterEvent]) {
        let sender = source.worker.map(|w| w.worker_id);
        let p = self.publishers.entry(source.id.clone()).or_default();
        p.sender = sender;
        p.sender_rank = source.worker.map(|w| w.dp_rank);
        p.recovery.clone_from(&source.recovery);
        self.endpoint_gone(&source.id);
        for ev in events {
            self.take(&source.id, ev.clone());
        }
    }

    /// One live event of publisher `id`: held while it recovers, a recovery started
    /// on a loss it can repair, a wipe on one it cannot.
    fn take(&mut self, id: &ChannelId, ev: RouterEvent) {
        let Some(p) = self.publishers.get_mut(id) else {
            return;
        };
        p.last_live = p.last_live.max(ev.event.id);
        let rebuilding = p.repair.as_ref().map(|r| r.rebuild);
        if rebuilding == Some(false) {
            return self.hold(id, ev);
        }
        if let Some(w) = p.late.take() {
            let id = ev.event.id;
            let late = id > w.lo && id >= w.next && id <= w.through;
            if late {
                p.late = (id < w.through).then_some(Late { next: id + 1, ..w });
                self.stats.late_duplicates += 1;
                return;
            }
        }
        if p.recovery.is_some() && p.next_id == 0 && !p.rebuilt {
            // First sight: what it fed before this router listened is in its dump.
            self.start_repair(id, RecoveryRequest::Dump);
            return self.hold(id, ev);
        }
        if p.next_id != 0 && ev.event.id != p.next_id {
            let cause = Wipe::IdGap {
                expected: p.next_id,
                got: ev.event.id,
            };
            if p.recovery.is_some() && ev.event.id > p.next_id && rebuilding.is_none() {
                let since = p.next_id - 1;
                self.start_repair(id, RecoveryRequest::Since(since));
                return self.hold(id, ev);
            }
            self.wipe(id, cause);
            if rebuilding.is_some() {
                // It is sending again: its rebuild need not wait out its back-off.
                self.hurry_rebuild(id);
            }
        }
        self.apply_event(id, &ev);
    }

    /// Applies one event of publisher `id` to the index; its id becomes the last seen.
    fn apply_event(&mut self, source: &ChannelId, ev: &RouterEvent) {
        let Some(p) = self.publishers.get_mut(source) else {
            return;
        };
        p.next_id = ev.event.id.saturating_add(1);
        let (sender, sender_rank) = (p.sender, p.sender_rank);
        let key = (ev.worker_id, ev.event.dp_rank);
        if !p.superseded.is_empty() && self.superseded(source, key) {
            self.stats.superseded_events += 1;
            return;
        }
        let Some(p) = self.publishers.get_mut(source) else {
            return;
        };
        let known = p.fed.contains(&key);
        if !known && p.fed.len() >= MAX_RANKS_PER_PUBLISHER {
            self.stats.refused_rank_events += 1;
            return;
        }
        // Only device-tier blocks stored make a publisher the rank's owner (whose
        // loss or departure clears it): an event that stored nothing takes nothing
        // over.
        let stores = ev.tier == StorageTier::Device
            && matches!(&ev.event.data, KvEventData::Stored { blocks, .. } if !blocks.is_empty());
        // A chain from the root that this publisher may write, for the rank its
        // identity names, takes the rank over from another publisher (a store under a
        // parent adds to what the owner holds: after a clear it would be refused, and
        // the owner's loss still clears it).
        let takes_over = stores
            && matches!(
                &ev.event.data,
                KvEventData::Stored {
                    parent_hash: None,
                    ..
                }
            )
            && self.index.admits(sender, ev.worker_id)
            && sender_rank.is_none_or(|r| r == ev.event.dp_rank)
            && self.owners.get(&key).is_some_and(|o| o != source);
        if takes_over {
            self.take_over(source, key);
            if let Some(p) = self.publishers.get_mut(source) {
                if !known {
                    p.fed.push(key);
                }
            }
        }
        match self.index.apply(sender, ev) {
            Err(
                IndexRefusal::RankFull { .. }
                | IndexRefusal::WorkerFull { .. }
                | IndexRefusal::IndexFull { .. },
            ) => {
                // Its leading blocks were stored.
                self.stats.refused_events += 1;
            }
            Err(_) => {
                self.stats.refused_events += 1;
                return;
            }
            Ok(()) => {}
        }
        self.stats.events += 1;
        if !stores {
            return;
        }
        if let Some(p) = self.publishers.get_mut(source) {
            if !p.fed.contains(&key) {
                p.fed.push(key);
            }
        }
        self.owners.entry(key).or_insert_with(|| source.clone());
    }

    /// `source` is about to store a chain from the root into `key`, which another
    /// publisher owns: what that one fed is dropped first ([`Wipe::Superseded`]), and
    /// its later events for `key` are dropped too. The index holds blocks per rank,
    /// not per publisher: keeping them would credit the worker with blocks the
    /// newcomer never vouched for (evicted while the earlier publisher was away), and
    /// the earlier publisher's departure no longer clears a rank it does not own.
    fn take_over(&mut self, source: &ChannelId, key: (WorkerId, DpRank)) {
        let Some(previous) = self.owners.insert(key, source.clone()) else {
            return;
        };
        let blocks = self.index.rank_blocks(key.0, key.1) as u64;
        self.index.clear_rank(key.0, key.1);
        if let Some(p) = self.publishers.get_mut(&previous) {
            p.fed.retain(|k| *k != key);
            p.superseded.retain(|(k, _)| *k != key);
            if p.superseded.len() < MAX_RANKS_PER_PUBLISHER {
                p.superseded.push((key, source.clone()));
            }
        }
        if blocks > 0 {
            self.stats.wipes_superseded += 1;
            self.stats.wiped_blocks += blocks;
            self.note_wipe(previous, Wipe::Superseded, blocks);
        }
    }

    /// Whether `id` was superseded for `key` by the publisher that owns it now.
    fn superseded(&self, id: &ChannelId, key: (WorkerId, DpRank)) -> bool {
        self.publishers.get(id).is_some_and(|p| {
            p.superseded
                .iter()
                .any(|(k, by)| *k == key && self.owners.get(&key) == Some(by))
        })
    }

    fn note_wipe(&mut self, publisher: ChannelId, cause: Wipe, blocks: u64) {
        if self.wiped.len() >= MAX_WIPES_KEPT {
            self.wiped.remove(0);
        }
        self.wiped.push(Wiped {
            publisher,
            cause,
            blocks,
        });
    }

    /// Applies a lifecycle notice: a reconnection wipes what the publisher fed, a
    /// departure drops it.
    pub fn notice(&mut self, notice: &Notice) {
        match notice {
            Notice::Connected(instance) => {
                let p = self.publishers.entry(instance.id.clone()).or_default();
                p.sender = instance.worker.map(|w| w.worker_id);
                p.sender_rank = instance.worker.map(|w| w.dp_rank);
                // A new connection speaks for its ranks again (it recovers, or its
                // next chain from the root takes them over).
                p.superseded.clear();
                p.recovery.clone_from(&instance.recovery);
                // A new connection: what it sends is not a late copy of an answer.
                p.late = None;
                let again = std::mem::replace(&mut p.connected, true);
                if p.repair.as_ref().is_some_and(|r| r.rebuild) && p.recovery.is_some() {
                    // Back: its rebuild need not wait out its back-off.
                    return self.hurry_rebuild(&instance.id);
                }
                if p.repair.is_some() {
                    return self.endpoint_gone(&instance.id);
                }
                if p.recovery.is_some() {
                    // What it sent while away is in its log; at first sight, all of it.
                    let request = match p.next_id {
                        0 => RecoveryRequest::Dump,
                        next => RecoveryRequest::Since(next - 1),
                    };
                    self.start_repair(&instance.id, request);
                } else if again {
                    p.next_id = 0;
                    self.wipe(&instance.id, Wipe::Reconnected);
                }
            }
            Notice::Departed(id) => self.depart(id),
            Notice::Reset { id, .. } => {
                // Its sequence restarted (another process behind it): what follows is
                // not a late copy either, and it may take its ranks back.
                if let Some(p) = self.publishers.get_mut(id) {
                    p.late = None;
                    p.superseded.clear();
                }
            }
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
        let (recovering, rebuilding, held_events, repair_p50_ms, repair_p99_ms) =
            self.repair_gauges();
        IndexFeedStats {
            index: self.index.stats(),
            publishers: self.publishers.len() as u64,
            recovering,
            rebuilding,
            held_events,
            repair_p50_ms,
            repair_p99_ms,
            ..self.stats
        }
    }

    fn depart(&mut self, id: &ChannelId) {
        let (held, blocks) = self
            .publishers
            .get(id)
            .and_then(|p| p.repair.as_ref())
            .map_or((0, 0), Repairing::held);
        self.held_total = self.held_total.saturating_sub(held);
        self.held_blocks_total = self.held_blocks_total.saturating_sub(blocks);
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
        p.late = None;
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
            Wipe::RecoveryFailed => self.stats.wipes_recovery_failed += 1,
            Wipe::HeldOverflow => self.stats.wipes_held_overflow += 1,
            Wipe::Superseded => self.stats.wipes_superseded += 1,
            Wipe::Departed => {}
        }
        self.stats.wiped_blocks += blocks;
        if blocks > 0 || cause == Wipe::Departed {
            self.note_wipe(id.clone(), cause, blocks);
        }
    }
}

// Repair from the workers' recovery logs (sans-IO: the feed says what to ask, the
// application asks and hands the answer back); in a file of its own, same module.
include!("feed_heal.rs");

#[cfg(test)]
#[path = "feed_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "feed_heal_tests.rs"]
mod heal_tests;
