//! Counters of the dynamic subscriber.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::discovery::ChannelId;
use crate::lossy::LaneStats;

/// Counters of one publisher (or, in [`SubscriberStats::total`], of all).
///
/// ```
/// use eventplane::subscriber::PublisherStats;
/// let stats = PublisherStats::default();
/// assert_eq!(stats.dropped(), 0); // lane_full + budget + filtered_topic + malformed
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PublisherStats {
    /// Messages read from the publisher's socket.
    pub received: u64,
    /// Messages handed to the consumer.
    pub delivered: u64,
    /// Dropped: the publisher's lane was full.
    pub dropped_lane_full: u64,
    /// Dropped: the global byte budget was exhausted.
    pub dropped_budget: u64,
    /// Dropped: frame 0 was not exactly the configured topic.
    pub dropped_filtered_topic: u64,
    /// Dropped: the message did not fit the configured layout.
    pub dropped_malformed: u64,
    /// Sequence jumps seen.
    pub gaps: u64,
    /// Messages missing in those jumps.
    pub gap_messages: u64,
    /// Connections that ended and were dialled again.
    pub reconnects: u64,
    /// Dials or handshakes that failed.
    pub connect_failures: u64,
    /// Endpoints refused by the address filter (never dialled).
    pub refused_by_filter: u64,
    /// Bytes of the messages received.
    pub bytes: u64,
    /// Messages waiting in the lane now.
    pub depth: usize,
}

impl PublisherStats {
    pub(crate) fn add(&mut self, o: &PublisherStats) {
        self.received += o.received;
        self.delivered += o.delivered;
        self.dropped_lane_full += o.dropped_lane_full;
        self.dropped_budget += o.dropped_budget;
        self.dropped_filtered_topic += o.dropped_filtered_topic;
        self.dropped_malformed += o.dropped_malformed;
        self.gaps += o.gaps;
        self.gap_messages += o.gap_messages;
        self.reconnects += o.reconnects;
        self.connect_failures += o.connect_failures;
        self.refused_by_filter += o.refused_by_filter;
        self.bytes += o.bytes;
        self.depth += o.depth;
    }

    /// Every drop, whatever its reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_lane_full
            + self.dropped_budget
            + self.dropped_filtered_topic
            + self.dropped_malformed
    }
}

/// A snapshot of a [`DynamicSubscriber`](super::DynamicSubscriber)'s counters.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::subscriber::DynamicSubscriber;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns")).spawn();
/// let stats = sub.stats();
/// assert!(stats.publishers.is_empty());
/// // Serializable, for logs and scripts.
/// assert!(serde_json::to_string(&stats).unwrap().contains("\"buffered_bytes\":0"));
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SubscriberStats {
    /// All publishers, including ones that have gone away.
    pub total: PublisherStats,
    /// The publishers tracked now.
    pub publishers: Vec<(ChannelId, PublisherStats)>,
    /// Bytes buffered across all lanes (charged sizes); at most `max_buffered_bytes`.
    pub buffered_bytes: usize,
    /// Times the discovery watch was re-opened.
    pub rewatches: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) filtered_topic: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) gaps: AtomicU64,
    pub(crate) gap_messages: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) connect_failures: AtomicU64,
    pub(crate) refused_by_filter: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        if n > 0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self, lane: LaneStats) -> PublisherStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PublisherStats {
            received: l(&self.received),
            delivered: lane.delivered,
            dropped_lane_full: lane.dropped_lane_full,
            dropped_budget: lane.dropped_budget,
            dropped_filtered_topic: l(&self.filtered_topic),
            dropped_malformed: l(&self.malformed),
            gaps: l(&self.gaps),
            gap_messages: l(&self.gap_messages),
            reconnects: l(&self.reconnects),
            connect_failures: l(&self.connect_failures),
            refused_by_filter: l(&self.refused_by_filter),
            bytes: l(&self.bytes),
            depth: lane.depth,
        }
    }
}
