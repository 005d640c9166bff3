//! Which metric each field of each stats type feeds.

use super::Samples;
use super::catalogue::*;
#[cfg(feature = "admin")]
use crate::admin::AdminStats;
use crate::discovery::DiscoveryStats;
use crate::kv::{
    engine::EngineListenerStats,
    pipeline::{ProcessorStats, RecoveryServerStats, WorkerStats},
    router::IndexFeedStats,
};
use crate::subscriber::SubscriberStats;
use crate::zmtp::PubStats;

mod sealed {
    // Nameable nowhere outside the crate: only its stats types implement `Sampled`.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// A stats snapshot an [`Exporter`](super::Exporter) can sample: the `stats()` of
/// each component (sealed: implemented by this crate's stats types).
pub trait Sampled: sealed::Sealed {
    /// Writes every metric this snapshot feeds.
    fn sample(&self, out: &mut Samples);
}

macro_rules! sampled {
    ($($ty:ty),* $(,)?) => {
        $(impl sealed::Sealed for $ty {})*
    };
}

#[cfg(feature = "admin")]
sampled!(AdminStats);
sampled!(
    PubStats,
    SubscriberStats,
    DiscoveryStats,
    EngineListenerStats,
    ProcessorStats,
    WorkerStats,
    IndexFeedStats,
    RecoveryServerStats
);

fn n(v: usize) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(feature = "admin")]
impl Sampled for AdminStats {
    fn sample(&self, out: &mut Samples) {
        out.counter(&ADMIN_REQUESTS, self.requests);
        out.counter(&ADMIN_REFUSED, self.refused_connections);
        out.counter(&ADMIN_EVICTED, self.evicted_connections);
        out.counter(&ADMIN_BAD, self.bad_requests);
        out.counter(&ADMIN_TIMEOUTS, self.timeouts);
    }
}

impl Sampled for PubStats {
    fn sample(&self, out: &mut Samples) {
        out.gauge(&PUB_CONNECTIONS, n(self.connections));
        out.gauge(&PUB_SUBSCRIBED, n(self.subscribed));
        out.counter(&PUB_MESSAGES, self.messages);
        out.counter(&PUB_QUEUED, self.queued);
        out.counter(&PUB_DROPPED, self.dropped);
        out.counter(&PUB_ACCEPTED, self.accepted);
        out.counter(&PUB_FAILED, self.failed);
        out.counter(&PUB_STALLED, self.stalled);
        out.counter(&PUB_REFUSED, self.refused);
        out.gauge(&PUB_PENDING_BYTES, n(self.pending_bytes));
    }
}

impl Sampled for SubscriberStats {
    fn sample(&self, out: &mut Samples) {
        let t = &self.total;
        out.gauge(&SUB_PUBLISHERS, n(self.publishers.len()));
        out.counter(&SUB_RECEIVED, t.received);
        out.counter(&SUB_RECEIVED_BYTES, t.bytes);
        out.counter(&SUB_DELIVERED, t.delivered);
        for (reason, v) in [
            ("lane_full", t.dropped_lane_full),
            ("budget", t.dropped_budget),
            ("filtered_topic", t.dropped_filtered_topic),
            ("malformed", t.dropped_malformed),
        ] {
            out.labelled(&SUB_DROPPED, reason, v);
        }
        let m = &t.malformed;
        for (reason, v) in [
            ("frames", m.frames),
            ("header", m.header),
            ("length", m.length),
            ("envelope", m.envelope),
            ("identity", m.identity),
        ] {
            out.labelled(&SUB_MALFORMED, reason, v);
        }
        out.counter(&SUB_GAPS, t.gaps);
        out.counter(&SUB_GAP_MESSAGES, t.gap_messages);
        out.counter(&SUB_SEQUENCE_RESETS, t.sequence_resets);
        out.counter(&SUB_RECONNECTS, t.reconnects);
        out.counter(&SUB_CONNECT_FAILURES, t.connect_failures);
        out.counter(&SUB_REFUSED_BY_FILTER, t.refused_by_filter);
        out.counter(&SUB_REFUSED_PUBLISHERS, self.refused_publishers);
        out.gauge(&SUB_QUEUED, n(t.depth));
        out.gauge(&SUB_BUFFERED_BYTES, n(self.buffered_bytes));
        out.gauge(&SUB_RETAINED_BYTES, n(self.retained_bytes));
        out.gauge(&SUB_READ_BUFFER_BYTES, n(self.read_buffer_bytes));
        out.counter(&SUB_COPIED, self.copied_messages);
        out.gauge(&SUB_OTHER_TOPIC, n(self.other_topic_publishers));
        out.gauge(&SUB_UNIDENTIFIED, n(self.unidentified_publishers));
        out.counter(&SUB_NOTICES_DROPPED, self.notices_dropped);
        out.counter(&SUB_REWATCHES, self.rewatches);
        out.gauge(&SUB_SYNCED, u64::from(self.synced));
    }
}

impl Sampled for IndexFeedStats {
    fn sample(&self, out: &mut Samples) {
        let i = &self.index;
        out.gauge(&KV_INDEX_BLOCKS, i.blocks);
        out.gauge(&KV_INDEX_NODES, i.nodes);
        out.gauge(&KV_INDEX_RANKS, i.ranks);
        out.gauge(&KV_INDEX_BYTES, i.bytes);
        out.counter(&KV_INDEX_EVENTS, self.events);
        for (reason, v) in [
            ("foreign_worker", i.refused_foreign),
            ("unidentified", i.refused_unidentified),
            ("unknown_parent", i.refused_unknown_parent),
            ("invalid_chain", i.refused_invalid_chain),
            ("too_many_ranks", self.refused_rank_events),
        ] {
            out.labelled(&KV_INDEX_REFUSED_EVENTS, reason, v);
        }
        for (reason, v) in [
            ("rank_full", i.refused_rank_full_blocks),
            ("worker_full", i.refused_worker_full_blocks),
            ("index_full", i.refused_index_full_blocks),
        ] {
            out.labelled(&KV_INDEX_REFUSED_BLOCKS, reason, v);
        }
        for (reason, v) in [
            ("id_gap", self.wipes_id_gap),
            ("reconnect", self.wipes_reconnect),
            ("recovery_failed", self.wipes_recovery_failed),
            ("held_overflow", self.wipes_held_overflow),
            ("superseded", self.wipes_superseded),
        ] {
            out.labelled(&KV_INDEX_WIPES, reason, v);
        }
        out.labelled(&KV_INDEX_REPAIRS, "since", self.repairs_since);
        out.labelled(&KV_INDEX_REPAIRS, "dump", self.repairs_dump);
        out.labelled(&KV_INDEX_REPAIRS, "rebuild", self.repairs_rebuild);
        out.gauge(&KV_INDEX_RECOVERING, self.recovering);
        out.gauge(&KV_INDEX_REBUILDING, self.rebuilding);
        out.counter(&KV_INDEX_REBUILDS_FAILED, self.rebuilds_failed);
        out.gauge(&KV_INDEX_HELD, self.held_events);
        out.counter(&KV_INDEX_HELD_DROPPED, self.held_dropped);
        out.counter(&KV_INDEX_LATE_DUPLICATES, self.late_duplicates);
        out.counter(&KV_INDEX_SUPERSEDED_EVENTS, self.superseded_events);
        out.counter(&KV_INDEX_STALE_ANSWERS, self.stale_answers);
        out.gauge(&KV_INDEX_REPAIR_P99, self.repair_p99_ms);
        out.counter(&KV_INDEX_WIPED_BLOCKS, self.wiped_blocks);
        out.counter(&KV_INDEX_UNDECODABLE, self.undecodable);
    }
}

impl Sampled for DiscoveryStats {
    fn sample(&self, out: &mut Samples) {
        out.gauge(&DISC_REGISTRATIONS, n(self.registrations));
        out.gauge(&DISC_WATCHERS, n(self.watchers));
        out.gauge(&DISC_BUFFERED, n(self.buffered_events));
        out.counter(&DISC_OVERFLOW_RESYNCS, self.overflow_resyncs);
        out.counter(&DISC_EXPIRED, self.expired);
        out.counter(&DISC_MALFORMED, self.malformed);
        out.counter(&DISC_LEASE_LOSSES, self.lease_losses);
        out.counter(&DISC_RECONNECTS, self.reconnects);
    }
}

impl Sampled for EngineListenerStats {
    fn sample(&self, out: &mut Samples) {
        out.counter(&KV_LISTENER_MALFORMED, self.malformed_messages);
        out.counter(&KV_LISTENER_GAPS, self.seq_gaps);
        out.counter(&KV_LISTENER_GAP_BATCHES, self.seq_gap_batches);
        out.counter(&KV_LISTENER_RESETS, self.seq_resets);
        out.counter(&KV_LISTENER_RECONNECTS, self.reconnects);
        out.counter(&KV_LISTENER_CONNECT_FAILURES, self.connect_failures);
        out.counter(&KV_LISTENER_DISCARDED, self.discarded_events);
        out.counter(&KV_LISTENER_STALE_CLEARS, self.stale_clears);
        out.counter(&KV_LISTENER_UNTRACKED_RANKS, self.untracked_ranks);
        out.gauge(&KV_LISTENER_CONNECTED, u64::from(self.connected));
        let r = &self.replay;
        out.counter(&KV_REPLAY_REQUESTS, r.replays);
        out.counter(&KV_REPLAY_BATCHES, r.replayed_batches);
        out.counter(&KV_REPLAY_REPAIRS, r.repairs);
        for cause in crate::kv::engine::ReplayFallback::ALL {
            out.labelled(&KV_REPLAY_FALLBACKS, cause.as_str(), r.fallbacks.get(cause));
        }
        out.counter(&KV_REPLAY_HELD_DROPPED, r.held_dropped);
        let d = &self.decoder;
        out.counter(&KV_DECODER_BATCHES, d.batches);
        out.counter(&KV_DECODER_MALFORMED, d.malformed_batches);
        out.counter(&KV_DECODER_OVERSIZED, d.oversized_batches);
        out.counter(&KV_DECODER_EVENTS, d.events);
        out.counter(&KV_DECODER_FAILED, d.failed_events);
        out.counter(&KV_DECODER_FAILED_REMOVALS, d.failed_removals);
        out.counter(&KV_DECODER_TRUNCATED, d.truncated_events);
        out.counter(&KV_DECODER_SELF_REFERENCING, d.self_referencing);
    }
}

impl Sampled for ProcessorStats {
    fn sample(&self, out: &mut Samples) {
        out.counter(&KV_PROCESSOR_INPUT_LISTS, self.input_lists);
        out.counter(&KV_PROCESSOR_INPUT_EVENTS, self.input_events);
        out.counter(&KV_PROCESSOR_INPUT_GAPS, self.input_gaps);
        out.counter(&KV_PROCESSOR_INPUT_GAP_EVENTS, self.input_gap_events);
        out.counter(&KV_PROCESSOR_OUTPUT_EVENTS, self.output_events);
        out.counter(&KV_PROCESSOR_MERGED, self.merged_events);
        out.counter(&KV_PROCESSOR_DEDUPLICATED, self.deduplicated_events);
        out.counter(&KV_PROCESSOR_WITHHELD, self.withheld_events);
        out.counter(&KV_PROCESSOR_PUBLISH_ERRORS, self.publish_errors);
        out.counter(&KV_PROCESSOR_PUBLISH_TIMEOUTS, self.publish_timeouts);
        out.counter(&KV_PROCESSOR_DEDUP_RESETS, self.dedup_resets);
        out.gauge(&KV_PROCESSOR_FENCED, u64::from(self.fenced));
    }
}

impl Sampled for WorkerStats {
    fn sample(&self, out: &mut Samples) {
        self.listener.sample(out);
        self.processor.sample(out);
        out.counter(&KV_WORKER_PUBLISHED, self.published_messages);
        if let Some(publisher) = &self.publisher {
            publisher.sample(out);
        }
    }
}

/// A recovery endpoint's series (ours or Dynamo's): its connections (accepted,
/// refused), then its answers and its unanswered requests by label.
fn recovery_endpoint(
    out: &mut Samples,
    [accepted, refused]: [u64; 2],
    answers: &[(&'static str, u64)],
    unanswered: &[(&'static str, u64)],
) {
    out.labelled(&KV_RECOVERY_CONNECTIONS, "accepted", accepted);
    out.labelled(&KV_RECOVERY_CONNECTIONS, "refused", refused);
    for (kind, v) in answers {
        out.labelled(&KV_RECOVERY_ANSWERS, kind, *v);
    }
    for (reason, v) in unanswered {
        out.labelled(&KV_RECOVERY_UNANSWERED, reason, *v);
    }
}

impl Sampled for RecoveryServerStats {
    fn sample(&self, out: &mut Samples) {
        recovery_endpoint(
            out,
            [self.connections, self.refused_connections],
            &[
                ("events", self.since_requests),
                ("dump", self.dump_requests),
                ("too_old", self.too_old),
            ],
            &[("malformed", self.malformed_requests)],
        );
    }
}

#[cfg(feature = "dynamo-recovery")]
mod dynamo_recovery {
    use super::super::Samples;
    use super::{Sampled, recovery_endpoint, sealed};
    use crate::kv::dynamo_recovery::DynamoQueryStats;

    sampled!(DynamoQueryStats);

    impl Sampled for DynamoQueryStats {
        fn sample(&self, out: &mut Samples) {
            recovery_endpoint(
                out,
                [self.connections, self.refused_connections],
                &[
                    ("events", self.events),
                    ("dump", self.dumps),
                    ("out_of_range", self.out_of_range),
                ],
                &[
                    ("malformed", self.malformed),
                    ("busy", self.busy),
                    ("call_home_refused", self.refused_call_homes),
                    ("call_home_failed", self.failed_call_homes),
                ],
            );
        }
    }
}

#[cfg(feature = "tunnel")]
mod tunnel {
    use std::collections::HashMap;

    use super::super::Samples;
    use super::super::catalogue::*;
    use super::{Sampled, n, sealed};
    use crate::tunnel::{
        AnnounceRefusal, BrokerStats, BusStats, CloseCode, DenyCode, RefuseCode, SourceStats,
    };

    sampled!(BusStats, BrokerStats, SourceStats);

    /// Counts by code, each code read into its closed set (text no version knows
    /// reads as `unknown`, so a label never carries what a peer made up).
    fn codes(
        out: &mut Samples,
        metric: &'static crate::metrics::Metric,
        counts: &HashMap<String, u64>,
        code: impl Fn(&str) -> &'static str,
    ) {
        for (text, v) in counts {
            out.labelled(metric, code(text), *v);
        }
    }

    fn refuse(text: &str) -> &'static str {
        RefuseCode::parse(text).as_str()
    }

    fn close(text: &str) -> &'static str {
        CloseCode::parse(text).as_str()
    }

    fn deny(text: &str) -> &'static str {
        DenyCode::parse(text).as_str()
    }

    fn announce_reason(text: &str) -> &'static str {
        AnnounceRefusal::parse(text).as_str()
    }

    impl Sampled for BusStats {
        fn sample(&self, out: &mut Samples) {
            out.gauge(&BUS_SESSIONS, n(self.sessions));
            out.counter(&BUS_SESSIONS_STARTED, self.sessions_started);
            out.counter(&BUS_SUPERSEDED, self.superseded);
            out.counter(&BUS_UNAUTHORIZED, self.unauthorized);
            codes(out, &BUS_DENIED, &self.denied, deny);
            out.counter(&BUS_PENDING_EVICTED, self.pending_evicted);
            out.counter(&BUS_PENDING_TIMEOUTS, self.pending_timeouts);
            out.gauge(&BUS_PENDING, n(self.pending));
            out.counter(&BUS_CONNECTIONS_REFUSED, self.connections_refused);
            out.counter(&BUS_BAD_TARGETS, self.bad_targets);
            out.counter(&BUS_STREAMS_OPENED, self.streams_opened);
            out.counter(&BUS_STREAMS_FAILED, self.streams_failed);
            out.counter(&BUS_UNKNOWN_STREAMS, self.unknown_streams);
            out.counter(&BUS_STREAMS_MOVED, self.streams_moved);
            out.gauge(&BUS_STREAMS_OPEN, n(self.streams_open));
            out.counter(&BUS_FALLBACKS, self.fallbacks);
            out.gauge(&BUS_STREAMS_PENDING, n(self.streams_pending));
            codes(out, &BUS_REFUSED, &self.refused, refuse);
            codes(out, &BUS_CLOSED, &self.closed, close);
            out.counter(&BUS_READ_BYTES, self.bytes_in);
            out.counter(&BUS_WRITTEN_BYTES, self.bytes_out);
            out.gauge(&BUS_SOURCE_SESSIONS, n(self.source_sessions));
            out.gauge(&BUS_ANNOUNCED, n(self.announced_sources));
            codes(
                out,
                &BUS_ANNOUNCE_REFUSED,
                &self.announce_refused,
                announce_reason,
            );
        }
    }

    impl Sampled for BrokerStats {
        fn sample(&self, out: &mut Samples) {
            out.counter(&BROKER_SESSIONS, self.sessions);
            out.counter(&BROKER_SESSION_FAILURES, self.session_failures);
            out.gauge(&BROKER_CONNECTED, u64::from(self.connected));
            out.counter(&BROKER_STREAMS_OPENED, self.streams_opened);
            out.gauge(&BROKER_STREAMS_OPEN, self.streams_open);
            out.counter(&BROKER_REBALANCES_THROTTLED, self.rebalances_throttled);
            codes(out, &BROKER_REFUSED, &self.refused, refuse);
            codes(out, &BROKER_DENIED, &self.denied, deny);
            out.counter(&BROKER_DNS_SATURATED, self.dns_saturated);
            codes(out, &BROKER_CLOSED, &self.closed, close);
            out.counter(&BROKER_UP_BYTES, self.bytes_up);
            out.counter(&BROKER_DOWN_BYTES, self.bytes_down);
            out.gauge(&BROKER_HIGH_WATER, self.buffer_high_water);
            out.gauge(&BROKER_DISCOVERY_READY, u64::from(self.discovery_ready));
            out.gauge(&BROKER_ADVERTISED, n(self.advertised_endpoints));
            out.counter(&BROKER_VIEW_IGNORED, self.view_ignored);
        }
    }

    impl Sampled for SourceStats {
        fn sample(&self, out: &mut Samples) {
            out.counter(&SOURCE_SESSIONS, self.sessions);
            out.counter(&SOURCE_SESSION_FAILURES, self.session_failures);
            out.gauge(&SOURCE_CONNECTED, u64::from(self.connected));
            out.gauge(&SOURCE_ANNOUNCED, n(self.announced));
            out.counter(&SOURCE_STREAMS_OPENED, self.streams_opened);
            out.gauge(&SOURCE_STREAMS_OPEN, self.streams_open);
            codes(out, &SOURCE_REFUSED, &self.refused, refuse);
            codes(out, &SOURCE_DENIED, &self.denied, deny);
            codes(
                out,
                &SOURCE_ANNOUNCE_REFUSED,
                &self.announce_refused,
                announce_reason,
            );
            out.gauge(&SOURCE_REFUSED_PUBLISHERS, n(self.refused_publishers));
            out.counter(&SOURCE_UP_BYTES, self.bytes_up);
            out.counter(&SOURCE_DOWN_BYTES, self.bytes_down);
        }
    }
}
