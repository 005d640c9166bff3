//! Counters of the dynamic subscriber.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::discovery::ChannelId;
use crate::lossy::LaneStats;
use crate::wire::{MalformedCounters, MalformedStats};

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
    /// Dropped: the message did not fit the configured layout (the sum of
    /// [`malformed`](Self::malformed)).
    pub dropped_malformed: u64,
    /// The malformed messages by reason (frames, Dynamo header, length, envelope,
    /// identity).
    pub malformed: MalformedStats,
    /// Sequence jumps seen.
    pub gaps: u64,
    /// Messages missing in those jumps.
    pub gap_messages: u64,
    /// Sequence restarts: a regression, a restart at 0 on a new connection, or a jump
    /// forward of more than 2^32 (a
    /// restarted or confused publisher, not that many lost messages).
    pub sequence_resets: u64,
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
    /// The sequence of the first message received with one (layouts with sequences;
    /// `None` in [`SubscriberStats::total`]).
    pub first_sequence: Option<u64>,
    /// The sequence of the last message received with one (`None` in the total).
    pub last_sequence: Option<u64>,
}

impl PublisherStats {
    /// Adds `o` into `self`, saturating.
    pub(crate) fn add(&mut self, o: &PublisherStats) {
        let sum = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        sum(&mut self.received, o.received);
        sum(&mut self.delivered, o.delivered);
        sum(&mut self.dropped_lane_full, o.dropped_lane_full);
        sum(&mut self.dropped_budget, o.dropped_budget);
        sum(&mut self.dropped_filtered_topic, o.dropped_filtered_topic);
        sum(&mut self.dropped_malformed, o.dropped_malformed);
        self.malformed.add(&o.malformed);
        sum(&mut self.gaps, o.gaps);
        sum(&mut self.gap_messages, o.gap_messages);
        sum(&mut self.sequence_resets, o.sequence_resets);
        sum(&mut self.reconnects, o.reconnects);
        sum(&mut self.connect_failures, o.connect_failures);
        sum(&mut self.refused_by_filter, o.refused_by_filter);
        sum(&mut self.bytes, o.bytes);
        self.depth = self.depth.saturating_add(o.depth);
    }

    /// Every drop, whatever its reason (saturating).
    pub fn dropped(&self) -> u64 {
        self.dropped_lane_full
            .saturating_add(self.dropped_budget)
            .saturating_add(self.dropped_filtered_topic)
            .saturating_add(self.dropped_malformed)
    }
}

/// A snapshot of a [`DynamicSubscriber`](super::DynamicSubscriber)'s counters.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::subscriber::DynamicSubscriber;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::ConfigError> {
/// let sub = DynamicSubscriber::builder(Arc::new(MemoryDiscovery::new()), Query::new("ns")).spawn()?;
/// let stats = sub.stats();
/// assert!(stats.publishers.is_empty());
/// // Serializable, for logs and scripts.
/// assert!(serde_json::to_string(&stats).unwrap().contains("\"buffered_bytes\":0"));
/// # Ok(()) }
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
    /// Read buffers of earlier reads that buffered messages still keep alive, across
    /// all connections; small frames are copied out while this exceeds the ZMTP
    /// config's `max_retained_bytes`.
    pub retained_bytes: usize,
    /// Messages copied out of their read buffer because `retained_bytes` was over
    /// the limit.
    pub copied_messages: u64,
    /// The read buffers connections read into now (64 KiB each, or the frame being
    /// assembled): what the connections cost besides lanes and retained buffers.
    pub read_buffer_bytes: usize,
    /// Publishers discovery reported that were not followed because
    /// `max_publishers` were already followed.
    pub refused_publishers: u64,
    /// Publishers discovered now under the query whose topic is not this subscriber's
    /// (a typo such as `kv_events` for `kv-events`, or another stream in the same
    /// namespace): not followed, since none of their messages would match. A
    /// rate-limited warning names both topics.
    pub other_topic_publishers: usize,
    /// Publishers followed now whose discovery record carries no worker identity:
    /// their deliveries' `source.worker` is `None` (see
    /// [`expect_worker_identity`](super::DynamicSubscriberBuilder::expect_worker_identity)).
    pub unidentified_publishers: usize,
    /// [`Notice`](super::Notice)s dropped because the queue
    /// ([`notices`](super::DynamicSubscriberBuilder::notices)) was full.
    pub notices_dropped: u64,
    /// Times the discovery watch was re-opened.
    pub rewatches: u64,
    /// Whether the initial discovery sync completed: the subscriber has seen a
    /// complete view and dials everything in it (a readiness probe's signal; a
    /// re-watch keeps it set).
    pub synced: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) filtered_topic: AtomicU64,
    pub(crate) malformed: AtomicU64,
    pub(crate) malformed_by_reason: MalformedCounters,
    pub(crate) gaps: AtomicU64,
    pub(crate) gap_messages: AtomicU64,
    pub(crate) sequence_resets: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) connect_failures: AtomicU64,
    pub(crate) refused_by_filter: AtomicU64,
    /// The first sequence received plus one (0: none yet).
    pub(crate) first_sequence: AtomicU64,
    /// The last sequence received plus one (0: none yet).
    pub(crate) last_sequence: AtomicU64,
}

impl Counters {
    /// Notes sequence `s` as received (the first one noted is kept as the first).
    pub(crate) fn sequence(&self, s: u64) {
        let stored = s.saturating_add(1);
        let _ =
            self.first_sequence
                .compare_exchange(0, stored, Ordering::Relaxed, Ordering::Relaxed);
        self.last_sequence.store(stored, Ordering::Relaxed);
    }

    /// Adds `n`, saturating at `u64::MAX` instead of wrapping.
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        crate::counter::add(c, n);
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
            malformed: self.malformed_by_reason.snapshot(),
            gaps: l(&self.gaps),
            gap_messages: l(&self.gap_messages),
            sequence_resets: l(&self.sequence_resets),
            reconnects: l(&self.reconnects),
            connect_failures: l(&self.connect_failures),
            refused_by_filter: l(&self.refused_by_filter),
            bytes: l(&self.bytes),
            depth: lane.depth,
            first_sequence: l(&self.first_sequence).checked_sub(1),
            last_sequence: l(&self.last_sequence).checked_sub(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_saturate() {
        let c = Counters::default();
        Counters::add(&c.gap_messages, u64::MAX - 1);
        Counters::add(&c.gap_messages, 5);
        assert_eq!(c.gap_messages.load(Ordering::Relaxed), u64::MAX);
        let mut total = PublisherStats {
            bytes: u64::MAX,
            dropped_budget: u64::MAX,
            ..PublisherStats::default()
        };
        total.add(&PublisherStats {
            bytes: 1,
            dropped_malformed: 3,
            ..PublisherStats::default()
        });
        assert_eq!(total.bytes, u64::MAX);
        assert_eq!(total.dropped(), u64::MAX);
    }
}
