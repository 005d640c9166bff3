//! The `metrics` feature: the subscriber's counters through the `metrics` facade.
//!
//! A sampler task reads [`SubscriberStats`] every
//! `metrics_interval` and adds the deltas to counters registered once per publisher
//! (pre-bound handles: no label look-up per message or per sample). Names:
//! `eventplane_subscriber_{received,delivered,bytes,gaps,gap_messages,reconnects,
//! connect_failures,refused_by_filter}_total` and
//! `eventplane_subscriber_dropped_total{reason}`, labelled `namespace`, `component`,
//! `topic`, `publisher_id`; gauges `eventplane_subscriber_lane_depth` (per
//! publisher) and `eventplane_subscriber_buffered_bytes`; counter
//! `eventplane_subscriber_rewatches_total`.

use std::collections::HashMap;
use std::time::Duration;

use metrics::{Counter, Gauge, counter, gauge};
use tokio_util::sync::CancellationToken;

use super::stats::{PublisherStats, SubscriberStats};
use crate::discovery::ChannelId;

struct Handles {
    received: Counter,
    delivered: Counter,
    bytes: Counter,
    gaps: Counter,
    gap_messages: Counter,
    reconnects: Counter,
    connect_failures: Counter,
    refused_by_filter: Counter,
    dropped_lane_full: Counter,
    dropped_budget: Counter,
    dropped_filtered_topic: Counter,
    dropped_malformed: Counter,
    depth: Gauge,
    last: PublisherStats,
}

impl Handles {
    fn new(id: &ChannelId) -> Handles {
        let labels = [
            ("namespace", id.namespace().to_owned()),
            ("component", id.component().to_owned()),
            ("topic", id.topic().to_owned()),
            ("publisher_id", id.publisher_id().to_string()),
        ];
        let dropped = |reason: &'static str| {
            let mut l = labels.to_vec();
            l.push(("reason", reason.to_owned()));
            counter!("eventplane_subscriber_dropped_total", &l)
        };
        Handles {
            received: counter!("eventplane_subscriber_received_total", &labels),
            delivered: counter!("eventplane_subscriber_delivered_total", &labels),
            bytes: counter!("eventplane_subscriber_bytes_total", &labels),
            gaps: counter!("eventplane_subscriber_gaps_total", &labels),
            gap_messages: counter!("eventplane_subscriber_gap_messages_total", &labels),
            reconnects: counter!("eventplane_subscriber_reconnects_total", &labels),
            connect_failures: counter!("eventplane_subscriber_connect_failures_total", &labels),
            refused_by_filter: counter!("eventplane_subscriber_refused_by_filter_total", &labels),
            dropped_lane_full: dropped("lane_full"),
            dropped_budget: dropped("budget"),
            dropped_filtered_topic: dropped("filtered_topic"),
            dropped_malformed: dropped("malformed"),
            depth: gauge!("eventplane_subscriber_lane_depth", &labels),
            last: PublisherStats::default(),
        }
    }

    fn emit(&mut self, now: &PublisherStats) {
        let pairs = [
            (&self.received, now.received, self.last.received),
            (&self.delivered, now.delivered, self.last.delivered),
            (&self.bytes, now.bytes, self.last.bytes),
            (&self.gaps, now.gaps, self.last.gaps),
            (&self.gap_messages, now.gap_messages, self.last.gap_messages),
            (&self.reconnects, now.reconnects, self.last.reconnects),
            (
                &self.connect_failures,
                now.connect_failures,
                self.last.connect_failures,
            ),
            (
                &self.refused_by_filter,
                now.refused_by_filter,
                self.last.refused_by_filter,
            ),
            (
                &self.dropped_lane_full,
                now.dropped_lane_full,
                self.last.dropped_lane_full,
            ),
            (
                &self.dropped_budget,
                now.dropped_budget,
                self.last.dropped_budget,
            ),
            (
                &self.dropped_filtered_topic,
                now.dropped_filtered_topic,
                self.last.dropped_filtered_topic,
            ),
            (
                &self.dropped_malformed,
                now.dropped_malformed,
                self.last.dropped_malformed,
            ),
        ];
        for (counter, new, old) in pairs {
            if new > old {
                counter.increment(new - old);
            }
        }
        self.depth.set(now.depth as f64);
        self.last = *now;
    }
}

/// Samples the subscriber's counters (`stats()`) every `interval` until `cancel`,
/// once more at the end.
pub(crate) async fn sampler(
    stats: impl Fn() -> SubscriberStats,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut per_publisher: HashMap<ChannelId, Handles> = HashMap::new();
    let buffered = gauge!("eventplane_subscriber_buffered_bytes");
    let rewatches = counter!("eventplane_subscriber_rewatches_total");
    let mut last_rewatches = 0;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stop = tokio::select! {
            () = cancel.cancelled() => true,
            _ = ticker.tick() => false,
        };
        let stats = stats();
        let mut seen = std::collections::HashSet::new();
        for (id, p) in &stats.publishers {
            per_publisher
                .entry(id.clone())
                .or_insert_with(|| Handles::new(id))
                .emit(p);
            seen.insert(id.clone());
        }
        per_publisher.retain(|id, h| {
            let keep = seen.contains(id);
            if !keep {
                h.depth.set(0.0);
            }
            keep
        });
        buffered.set(stats.buffered_bytes as f64);
        if stats.rewatches > last_rewatches {
            rewatches.increment(stats.rewatches - last_rewatches);
            last_rewatches = stats.rewatches;
        }
        if stop {
            return;
        }
    }
}
