//! What the subscriber's tasks share: the delivery type, the table of followed
//! publishers (each with its lane and counters) and the departed publishers' totals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio_util::task::TaskTracker;

use super::stats::{Counters, PublisherStats};
use crate::discovery::{ChannelId, Instance};
use crate::lossy::Lane;
use crate::net::RateLimitedWarn;
use crate::wire::{PayloadAt, SeqTracker};
use crate::zmtp::Message;
use crate::zmtp::retain::Retention;

use super::notice::{Notice, Notices};

/// Lane handles are per publisher; a type alias keeps signatures short.
pub(crate) type DeliveryLane = Lane<Delivery>;

/// One message from one publisher.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
/// use eventplane::publish::EventPublisher;
/// use eventplane::subscriber::{DynamicSubscriber, Layout};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
/// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
///     .topic("t")
///     .layout(Layout::TopicPublisherSeq)
///     .spawn()?;
/// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
/// publisher.wait_for_subscribers(1).await;
/// publisher.publish("payload");
/// let delivery = sub.recv().await.ok_or("stopped")?;
/// assert_eq!(delivery.source.id.publisher_id(), publisher.publisher_id());
/// assert_eq!(delivery.sequence, Some(0));
/// assert_eq!(delivery.message.get(3), Some(&b"payload"[..]));
/// assert_eq!(delivery.payload().as_deref(), Some(&b"payload"[..]));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery {
    /// The publisher, as discovery described it when the message was read.
    pub source: Arc<Instance>,
    /// The message's sequence number, for layouts that carry one.
    pub sequence: Option<u64>,
    /// The message (all frames).
    pub message: Message,
    /// Where the layout placed the payload (see [`payload`](Self::payload)).
    payload_at: Option<PayloadAt>,
}

impl Delivery {
    pub(crate) fn new(
        source: Arc<Instance>,
        sequence: Option<u64>,
        message: Message,
        payload_at: Option<PayloadAt>,
    ) -> Delivery {
        Delivery {
            source,
            sequence,
            message,
            payload_at,
        }
    }

    /// The payload as the layout places it: the first payload frame, or for
    /// [`Layout::Dynamo`](crate::wire::Layout::Dynamo) the envelope's payload, sharing the message's buffer.
    /// `None` for [`Layout::Raw`](crate::wire::Layout::Raw).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
    /// # use eventplane::publish::EventPublisher;
    /// # use eventplane::subscriber::{DynamicSubscriber, Layout};
    /// use eventplane::wire::Dialect;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    /// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
    ///     .topic("kv-events")
    ///     .layout(Layout::Dynamo)
    ///     .spawn()?;
    /// let publisher = EventPublisher::builder(discovery, "ns", "c", "kv-events")
    ///     .dialect(Dialect::Dynamo)
    ///     .build()
    ///     .await?;
    /// publisher.wait_for_subscribers(1).await;
    /// publisher.publish("payload");
    /// let delivery = sub.recv().await.ok_or("stopped")?;
    /// assert_eq!(delivery.sequence, Some(0)); // Dynamo counts from 0, as we do
    /// assert_eq!(delivery.payload().as_deref(), Some(&b"payload"[..]));
    /// # Ok(()) }
    /// ```
    pub fn payload(&self) -> Option<Bytes> {
        self.payload_at?.get(&self.message)
    }
}

pub(crate) struct Shared {
    pub(super) publishers: Mutex<HashMap<ChannelId, Arc<PublisherCell>>>,
    pub(super) retired: Mutex<Retired>,
    /// Read buffers that delivered messages keep alive, across every connection.
    pub(crate) retention: Arc<Retention>,
    pub(crate) refused_publishers: AtomicU64,
    /// Publishers discovered now whose topic is not the subscriber's.
    pub(crate) other_topic_publishers: std::sync::atomic::AtomicUsize,
    pub(crate) rewatches: AtomicU64,
    /// Set once the first complete view came from discovery (the initial sync).
    pub(crate) synced: std::sync::atomic::AtomicBool,
    pub(crate) tracker: TaskTracker,
    pub(crate) warn: RateLimitedWarn,
    /// Lifecycle notices for the consumer (none kept unless enabled).
    pub(crate) notices: Notices,
    /// Where the sequences of recently departed publishers stood: one that comes
    /// back under the same id (a source reconnecting, a lease re-granted) continues
    /// from there, so what it lost meanwhile counts as a gap or a reset, never as
    /// nothing. Bounded by `max_publishers`, oldest forgotten first.
    pub(crate) departed_sequences: Mutex<DepartedSequences>,
    /// Told when a connection task of a publisher left its sequence state behind.
    pub(crate) sequence_handover: tokio::sync::Notify,
    /// Permits to dial: `max_concurrent_dials` connections resolve, connect and
    /// handshake at once.
    pub(crate) dials: tokio::sync::Semaphore,
}

/// The last sequence state of departed publishers, at most `capacity`.
#[derive(Debug, Default)]
pub(crate) struct DepartedSequences {
    capacity: usize,
    states: HashMap<ChannelId, SeqTracker>,
    order: std::collections::VecDeque<ChannelId>,
    /// Connection tasks running per publisher (a replacement may start while its
    /// predecessor drains; it waits for the predecessor's state).
    running: HashMap<ChannelId, usize>,
}

impl DepartedSequences {
    pub(crate) fn new(capacity: usize) -> DepartedSequences {
        DepartedSequences {
            capacity,
            ..DepartedSequences::default()
        }
    }

    /// A connection task of `id` starts; `true` when it is the only one.
    pub(crate) fn enter(&mut self, id: &ChannelId) -> bool {
        let n = self.running.entry(id.clone()).or_default();
        *n += 1;
        *n == 1
    }

    /// Whether `id` has more than one connection task (a predecessor still drains).
    pub(crate) fn has_predecessor(&self, id: &ChannelId) -> bool {
        self.running.get(id).is_some_and(|n| *n > 1)
    }

    /// A connection task of `id` ends, leaving `seq` behind.
    pub(crate) fn leave(&mut self, id: &ChannelId, seq: SeqTracker) {
        if let Some(n) = self.running.get_mut(id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.running.remove(id);
            }
        }
        self.remember(id, seq);
    }

    /// Remembers `id`'s state (if it saw any message), forgetting the oldest past the
    /// capacity.
    pub(crate) fn remember(&mut self, id: &ChannelId, seq: SeqTracker) {
        if !seq.has_seen() || self.capacity == 0 {
            return;
        }
        if self.states.insert(id.clone(), seq).is_none() {
            self.order.push_back(id.clone());
        }
        while self.states.len() > self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.states.remove(&old);
                }
                None => break,
            }
        }
    }

    /// The state `id` departed with, if remembered (and forgets it).
    pub(crate) fn take(&mut self, id: &ChannelId) -> SeqTracker {
        match self.states.remove(id) {
            Some(seq) => {
                self.order.retain(|o| o != id);
                seq
            }
            None => SeqTracker::default(),
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("publishers", &self.lock().len())
            .finish_non_exhaustive()
    }
}

pub(crate) struct PublisherCell {
    pub(crate) instance: Mutex<Arc<Instance>>,
    pub(crate) counters: Counters,
    pub(crate) lane: DeliveryLane,
    /// Set once its connection task has ended: nothing enters its lane any more.
    pub(crate) ended: std::sync::atomic::AtomicBool,
}

impl PublisherCell {
    pub(super) fn snapshot(&self) -> PublisherStats {
        self.counters.snapshot(self.lane.stats())
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<ChannelId, Arc<PublisherCell>>> {
        self.publishers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a departed publisher out of the list once its connection task has ended
    /// (a replacement under the same id stays listed). Its counters keep counting
    /// until its lane is drained — messages still in it are delivered after this —
    /// and then join the retired total.
    pub(crate) fn retire(&self, id: &ChannelId, cell: &Arc<PublisherCell>) {
        cell.ended.store(true, Ordering::Release);
        // Lock order: retired, then publishers (as `stats`), so a cell is never
        // missing from both.
        let mut retired = self.lock_retired();
        {
            let mut publishers = self.lock();
            if publishers.get(id).is_some_and(|c| Arc::ptr_eq(c, cell)) {
                publishers.remove(id);
            }
        }
        retired.add(cell);
        self.settle_locked(&mut retired);
    }

    /// Lists `cell` for `id`; a cell it replaces (a publisher that moved) keeps
    /// counting with the departed ones while its connection drains.
    pub(crate) fn insert(&self, id: ChannelId, cell: Arc<PublisherCell>) {
        let mut retired = self.lock_retired();
        if let Some(old) = self.lock().insert(id, cell) {
            retired.add(&old);
        }
    }

    /// Folds drained departed publishers into the retired total (their lanes closed).
    pub(crate) fn settle_retired(&self) {
        self.settle_locked(&mut self.lock_retired());
    }

    /// Settles `retired` (held by the caller) and sends [`Notice::Departed`] for each
    /// settled publisher whose id is not followed again (a moved publisher is).
    pub(super) fn settle_locked(&self, retired: &mut Retired) {
        let settled = retired.settle();
        if settled.is_empty() || !self.notices.enabled() {
            return;
        }
        let publishers = self.lock();
        for (id, stats) in settled {
            let followed = publishers.contains_key(&id);
            self.notices.push(Notice::Retired {
                id: id.clone(),
                stats: Box::new(stats),
            });
            if !followed {
                self.notices.push(Notice::Departed(id));
            }
        }
    }

    pub(super) fn lock_retired(&self) -> MutexGuard<'_, Retired> {
        self.retired.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Departed publishers: those whose lanes are drained, summed; the others still
/// counting (their lanes hold messages the consumer has not taken yet).
#[derive(Default)]
pub(super) struct Retired {
    total: PublisherStats,
    draining: Vec<Arc<PublisherCell>>,
}

impl Retired {
    fn add(&mut self, cell: &Arc<PublisherCell>) {
        if !self.draining.iter().any(|c| Arc::ptr_eq(c, cell)) {
            self.draining.push(cell.clone());
        }
    }

    /// Folds the departed publishers whose connection ended and whose lanes are empty
    /// into the total (their counters are final) and lets their lanes go; returns
    /// their ids and final counters.
    fn settle(&mut self) -> Vec<(ChannelId, PublisherStats)> {
        let total = &mut self.total;
        let mut settled = Vec::new();
        self.draining.retain(|cell| {
            if !cell.ended.load(Ordering::Acquire) {
                return true;
            }
            let s = cell.snapshot();
            if s.depth > 0 {
                return true;
            }
            total.add(&s);
            let id = cell
                .instance
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .id
                .clone();
            settled.push((id, s));
            false
        });
        settled
    }

    /// The total of every departed publisher, drained or not (settle first).
    pub(super) fn sum(&self) -> PublisherStats {
        let mut sum = self.total;
        for cell in &self.draining {
            sum.add(&cell.snapshot());
        }
        sum
    }
}
