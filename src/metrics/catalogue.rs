//! Every metric the crate exports: its name, kind, label and meaning, in one table.
//! [`Sampled`](super::Sampled) implementations name these constants, so a series can
//! only be one of them; [`CATALOGUE`] lists them all for descriptions and the catalogue page (docs/metrics.md).

use super::{Kind, Metric};

/// Defines one constant per metric and [`CATALOGUE`] listing them in order.
macro_rules! catalogue {
    (@label) => { None };
    (@label $label:literal) => { Some($label) };
    ($(
        $(#[$section:meta])*
        $id:ident: $kind:ident $name:literal [$($label:literal)?] $source:literal $help:literal;
    )*) => {
        $(
            $(#[$section])*
            pub(crate) const $id: Metric = Metric {
                name: $name,
                kind: Kind::$kind,
                label: catalogue!(@label $($label)?),
                source: $source,
                help: $help,
            };
        )*
        /// Every metric, grouped by the component whose stats it reads.
        pub static CATALOGUE: &[Metric] = &[$($id,)*];
    };
}

catalogue! {
    // zmtp::PubSocket and publish::EventPublisher: `PubStats`.
    PUB_CONNECTIONS: Gauge "eventplane_pub_connections" [] "PubStats"
        "Subscriber connections whose handshake completed and that are open.";
    PUB_SUBSCRIBED: Gauge "eventplane_pub_subscribed_connections" [] "PubStats"
        "Of those, connections holding at least one subscription.";
    PUB_MESSAGES: Counter "eventplane_pub_messages_total" [] "PubStats"
        "Messages sent (calls to send).";
    PUB_QUEUED: Counter "eventplane_pub_queued_total" [] "PubStats"
        "Messages queued to subscribers, one per matching subscriber.";
    PUB_DROPPED: Counter "eventplane_pub_dropped_total" [] "PubStats"
        "Messages dropped because a subscriber's queue was full.";
    PUB_ACCEPTED: Counter "eventplane_pub_accepted_connections_total" [] "PubStats"
        "Connections accepted.";
    PUB_FAILED: Counter "eventplane_pub_failed_connections_total" [] "PubStats"
        "Connections that ended with an error (protocol, timeout, I/O).";
    PUB_STALLED: Counter "eventplane_pub_stalled_connections_total" [] "PubStats"
        "Of those, connections closed because the subscriber read nothing for write_stall_timeout.";
    PUB_REFUSED: Counter "eventplane_pub_refused_connections_total" [] "PubStats"
        "Connections closed on accept because max_connections were open.";
    PUB_PENDING_BYTES: Gauge "eventplane_pub_pending_bytes" [] "PubStats"
        "Bytes pending toward all subscribers (each bounded by send_queue_bytes).";

    // subscriber::DynamicSubscriber: `SubscriberStats` (all publishers together).
    SUB_PUBLISHERS: Gauge "eventplane_subscriber_publishers" [] "SubscriberStats"
        "Publishers followed now.";
    SUB_RECEIVED: Counter "eventplane_subscriber_received_total" [] "SubscriberStats"
        "Messages read from publishers.";
    SUB_RECEIVED_BYTES: Counter "eventplane_subscriber_received_bytes_total" [] "SubscriberStats"
        "Bytes of the messages read from publishers.";
    SUB_DELIVERED: Counter "eventplane_subscriber_delivered_total" [] "SubscriberStats"
        "Messages handed to the consumer.";
    SUB_DROPPED: Counter "eventplane_subscriber_dropped_total" ["reason"] "SubscriberStats"
        "Messages dropped, by reason: lane_full, budget, filtered_topic, malformed.";
    SUB_MALFORMED: Counter "eventplane_subscriber_malformed_total" ["reason"] "SubscriberStats"
        "Malformed messages, by reason: frames, header, length, envelope, identity.";
    SUB_GAPS: Counter "eventplane_subscriber_gaps_total" [] "SubscriberStats"
        "Sequence jumps seen.";
    SUB_GAP_MESSAGES: Counter "eventplane_subscriber_gap_messages_total" [] "SubscriberStats"
        "Messages missing in those jumps.";
    SUB_SEQUENCE_RESETS: Counter "eventplane_subscriber_sequence_resets_total" [] "SubscriberStats"
        "Sequence restarts (a restarted or confused publisher).";
    SUB_RECONNECTS: Counter "eventplane_subscriber_reconnects_total" [] "SubscriberStats"
        "Publisher connections that ended and were dialled again.";
    SUB_CONNECT_FAILURES: Counter "eventplane_subscriber_connect_failures_total" [] "SubscriberStats"
        "Dials or handshakes that failed.";
    SUB_REFUSED_BY_FILTER: Counter "eventplane_subscriber_refused_by_filter_total" [] "SubscriberStats"
        "Endpoints refused by the address filter (never dialled).";
    SUB_REFUSED_PUBLISHERS: Counter "eventplane_subscriber_refused_publishers_total" [] "SubscriberStats"
        "Publishers not followed because max_publishers were followed.";
    SUB_QUEUED: Gauge "eventplane_subscriber_queued_messages" [] "SubscriberStats"
        "Messages waiting in the lanes now.";
    SUB_BUFFERED_BYTES: Gauge "eventplane_subscriber_buffered_bytes" [] "SubscriberStats"
        "Bytes buffered across all lanes (at most max_buffered_bytes).";
    SUB_RETAINED_BYTES: Gauge "eventplane_subscriber_retained_bytes" [] "SubscriberStats"
        "Read buffers that buffered messages still keep alive.";
    SUB_READ_BUFFER_BYTES: Gauge "eventplane_subscriber_read_buffer_bytes" [] "SubscriberStats"
        "Read buffers the connections read into now.";
    SUB_COPIED: Counter "eventplane_subscriber_copied_messages_total" [] "SubscriberStats"
        "Messages copied out of their read buffer (retained bytes over max_retained_bytes).";
    SUB_OTHER_TOPIC: Gauge "eventplane_subscriber_other_topic_publishers" [] "SubscriberStats"
        "Publishers discovered under the query with another topic (not followed).";
    SUB_UNIDENTIFIED: Gauge "eventplane_subscriber_unidentified_publishers" [] "SubscriberStats"
        "Publishers followed whose record carries no worker identity.";
    SUB_NOTICES_DROPPED: Counter "eventplane_subscriber_notices_dropped_total" [] "SubscriberStats"
        "Notices dropped because their queue was full.";
    SUB_REWATCHES: Counter "eventplane_subscriber_rewatches_total" [] "SubscriberStats"
        "Times the discovery watch was re-opened.";
    SUB_SYNCED: Gauge "eventplane_subscriber_discovery_synced" [] "SubscriberStats"
        "1 once the initial discovery sync completed.";

    // discovery::Discovery backends: `DiscoveryStats`.
    DISC_REGISTRATIONS: Gauge "eventplane_discovery_registrations" [] "DiscoveryStats"
        "Live registrations.";
    DISC_WATCHERS: Gauge "eventplane_discovery_watchers" [] "DiscoveryStats"
        "Open watch streams.";
    DISC_BUFFERED: Gauge "eventplane_discovery_buffered_events" [] "DiscoveryStats"
        "Events waiting in watch backlogs.";
    DISC_OVERFLOW_RESYNCS: Counter "eventplane_discovery_overflow_resyncs_total" [] "DiscoveryStats"
        "Watch backlogs that overflowed and collapsed into a Resync.";
    DISC_EXPIRED: Counter "eventplane_discovery_expired_total" [] "DiscoveryStats"
        "Registrations removed because their lease expired.";
    DISC_MALFORMED: Counter "eventplane_discovery_malformed_records_total" [] "DiscoveryStats"
        "Malformed records skipped.";
    DISC_LEASE_LOSSES: Counter "eventplane_discovery_lease_losses_total" [] "DiscoveryStats"
        "Leases found lost (registrations put again).";
    DISC_RECONNECTS: Counter "eventplane_discovery_reconnects_total" [] "DiscoveryStats"
        "Watch streams to a remote store re-established.";

    // kv::engine::EngineListener: `EngineListenerStats`, its decoder's `EngineStats`.
    KV_LISTENER_MALFORMED: Counter "eventplane_kv_listener_malformed_messages_total" [] "EngineListenerStats"
        "Engine messages that were not [topic, seq, payload] with the exact topic.";
    KV_LISTENER_GAPS: Counter "eventplane_kv_listener_sequence_gaps_total" [] "EngineListenerStats"
        "Forward jumps in the engine's batch sequence.";
    KV_LISTENER_GAP_BATCHES: Counter "eventplane_kv_listener_gap_batches_total" [] "EngineListenerStats"
        "Batches missing in those jumps.";
    KV_LISTENER_RESETS: Counter "eventplane_kv_listener_sequence_resets_total" [] "EngineListenerStats"
        "Engine sequence restarts.";
    KV_LISTENER_RECONNECTS: Counter "eventplane_kv_listener_reconnects_total" [] "EngineListenerStats"
        "Engine connections that ended and were dialled again.";
    KV_LISTENER_CONNECT_FAILURES: Counter "eventplane_kv_listener_connect_failures_total" [] "EngineListenerStats"
        "Dials or handshakes to the engine that failed.";
    KV_LISTENER_DISCARDED: Counter "eventplane_kv_listener_discarded_events_total" [] "EngineListenerStats"
        "Decoded events discarded on cancel while the processor's input was full.";
    KV_LISTENER_STALE_CLEARS: Counter "eventplane_kv_listener_stale_clears_total" [] "EngineListenerStats"
        "Cleared events made because the listener lost track of the engine.";
    KV_LISTENER_UNTRACKED_RANKS: Counter "eventplane_kv_listener_untracked_ranks_total" [] "EngineListenerStats"
        "Events forwarded for a rank beyond the tracked ones.";
    KV_LISTENER_CONNECTED: Gauge "eventplane_kv_listener_connected" [] "EngineListenerStats"
        "1 while a connection to the engine is up.";
    KV_REPLAY_REQUESTS: Counter "eventplane_kv_listener_replays_total" [] "EngineListenerStats"
        "Replay requests sent to the engine's replay endpoint.";
    KV_REPLAY_BATCHES: Counter "eventplane_kv_listener_replayed_batches_total" [] "EngineListenerStats"
        "Engine batches applied from replay replies.";
    KV_REPLAY_REPAIRS: Counter "eventplane_kv_listener_replay_repairs_total" [] "EngineListenerStats"
        "Losses repaired from the engine's replay buffer without a clear.";
    KV_REPLAY_FALLBACKS: Counter "eventplane_kv_listener_replay_fallbacks_total" ["cause"] "EngineListenerStats"
        "Losses the replay buffer could not repair (cleared), by cause: unreachable, timeout, too_new, restart, no_progress.";
    KV_REPLAY_HELD_DROPPED: Counter "eventplane_kv_listener_replay_held_dropped_total" [] "EngineListenerStats"
        "Live batches dropped while a replay ran (fetched by a further replay).";
    KV_DECODER_BATCHES: Counter "eventplane_kv_decoder_batches_total" [] "EngineListenerStats"
        "Engine batches decoded.";
    KV_DECODER_MALFORMED: Counter "eventplane_kv_decoder_malformed_batches_total" [] "EngineListenerStats"
        "Engine batches rejected whole.";
    KV_DECODER_OVERSIZED: Counter "eventplane_kv_decoder_oversized_batches_total" [] "EngineListenerStats"
        "Of those, batches over the element or event budget.";
    KV_DECODER_EVENTS: Counter "eventplane_kv_decoder_events_total" [] "EngineListenerStats"
        "Engine events decoded.";
    KV_DECODER_FAILED: Counter "eventplane_kv_decoder_failed_events_total" [] "EngineListenerStats"
        "Engine events that failed alone (unknown tag, wrong shape).";
    KV_DECODER_FAILED_REMOVALS: Counter "eventplane_kv_decoder_failed_removals_total" [] "EngineListenerStats"
        "Of those, removals of the wrong shape.";
    KV_DECODER_TRUNCATED: Counter "eventplane_kv_decoder_truncated_events_total" [] "EngineListenerStats"
        "Stored events cut at a block without exactly block_size tokens.";
    KV_DECODER_SELF_REFERENCING: Counter "eventplane_kv_decoder_self_referencing_total" [] "EngineListenerStats"
        "Stored events dropped because their hashes repeat.";

    // kv::router::IndexFeed and its kv::router::RouterIndex: `IndexFeedStats`.
    KV_INDEX_BLOCKS: Gauge "eventplane_kv_index_blocks" [] "IndexFeedStats"
        "Blocks the router index holds (one per worker and rank holding one).";
    KV_INDEX_NODES: Gauge "eventplane_kv_index_nodes" [] "IndexFeedStats"
        "Distinct block positions in the router index.";
    KV_INDEX_RANKS: Gauge "eventplane_kv_index_ranks" [] "IndexFeedStats"
        "Worker ranks holding at least one block.";
    KV_INDEX_BYTES: Gauge "eventplane_kv_index_bytes" [] "IndexFeedStats"
        "Bytes the router index's tables take, spare capacity included.";
    KV_INDEX_EVENTS: Counter "eventplane_kv_index_events_total" [] "IndexFeedStats"
        "Router events applied to the index.";
    KV_INDEX_REFUSED_EVENTS: Counter "eventplane_kv_index_refused_events_total" ["reason"] "IndexFeedStats"
        "Router events refused, by reason: foreign_worker, unidentified, unknown_parent, invalid_chain, too_many_ranks.";
    KV_INDEX_REFUSED_BLOCKS: Counter "eventplane_kv_index_refused_blocks_total" ["reason"] "IndexFeedStats"
        "Stored blocks not indexed, by reason: rank_full, worker_full, index_full.";
    KV_INDEX_WIPES: Counter "eventplane_kv_index_wipes_total" ["reason"] "IndexFeedStats"
        "Publishers' views lost and cleared, by reason: id_gap, reconnect, recovery_failed, held_overflow, superseded.";
    KV_INDEX_REPAIRS: Counter "eventplane_kv_index_repairs_total" ["kind"] "IndexFeedStats"
        "Losses repaired from the workers' recovery logs, by kind: since, dump, rebuild (a dump asked again after a failed recovery wiped the publisher).";
    KV_INDEX_RECOVERING: Gauge "eventplane_kv_index_recovering_publishers" [] "IndexFeedStats"
        "Publishers whose recovery is in progress (their live events held).";
    KV_INDEX_REBUILDING: Gauge "eventplane_kv_index_rebuilding_publishers" [] "IndexFeedStats"
        "Publishers wiped by a failed recovery whose dump is asked again (after a back-off).";
    KV_INDEX_REBUILDS_FAILED: Counter "eventplane_kv_index_rebuilds_failed_total" [] "IndexFeedStats"
        "Rebuilds that failed too (asked again after a longer back-off).";
    KV_INDEX_HELD: Gauge "eventplane_kv_index_held_events" [] "IndexFeedStats"
        "Live events held for publishers that recover.";
    KV_INDEX_HELD_DROPPED: Counter "eventplane_kv_index_held_dropped_total" [] "IndexFeedStats"
        "Live events dropped while their publisher recovered (too many held), asked for again.";
    KV_INDEX_LATE_DUPLICATES: Counter "eventplane_kv_index_late_duplicates_total" [] "IndexFeedStats"
        "Live events a recovery answer had already applied (on their way when it was read), skipped.";
    KV_INDEX_SUPERSEDED_EVENTS: Counter "eventplane_kv_index_superseded_events_total" [] "IndexFeedStats"
        "Events dropped because another publisher took their rank over from their publisher.";
    KV_INDEX_STALE_ANSWERS: Counter "eventplane_kv_index_stale_answers_total" [] "IndexFeedStats"
        "Recovery answers to requests no longer awaited, ignored.";
    KV_INDEX_REPAIR_P99: Gauge "eventplane_kv_index_repair_p99_milliseconds" [] "IndexFeedStats"
        "The 99th percentile of the last 256 repairs' time from request to answer.";
    KV_INDEX_WIPED_BLOCKS: Counter "eventplane_kv_index_wiped_blocks_total" [] "IndexFeedStats"
        "Blocks dropped by wipes and departures.";
    KV_INDEX_UNDECODABLE: Counter "eventplane_kv_index_undecodable_total" [] "IndexFeedStats"
        "Deliveries whose router events did not decode.";

    // kv::pipeline::Processor: `ProcessorStats`.
    KV_PROCESSOR_INPUT_LISTS: Counter "eventplane_kv_processor_input_lists_total" [] "ProcessorStats"
        "Event lists received from the listener.";
    KV_PROCESSOR_INPUT_EVENTS: Counter "eventplane_kv_processor_input_events_total" [] "ProcessorStats"
        "Events received from the listener.";
    KV_PROCESSOR_INPUT_GAPS: Counter "eventplane_kv_processor_input_gaps_total" [] "ProcessorStats"
        "Jumps in the input's event ids.";
    KV_PROCESSOR_INPUT_GAP_EVENTS: Counter "eventplane_kv_processor_input_gap_events_total" [] "ProcessorStats"
        "Events missing in those jumps.";
    KV_PROCESSOR_OUTPUT_EVENTS: Counter "eventplane_kv_processor_output_events_total" [] "ProcessorStats"
        "Router events handed to the sink.";
    KV_PROCESSOR_MERGED: Counter "eventplane_kv_processor_merged_events_total" [] "ProcessorStats"
        "Events merged into a neighbour by batching.";
    KV_PROCESSOR_DEDUPLICATED: Counter "eventplane_kv_processor_deduplicated_events_total" [] "ProcessorStats"
        "Events removed by ref-counted deduplication.";
    KV_PROCESSOR_WITHHELD: Counter "eventplane_kv_processor_withheld_events_total" [] "ProcessorStats"
        "Events not published because the processor was fenced.";
    KV_PROCESSOR_PUBLISH_ERRORS: Counter "eventplane_kv_processor_publish_errors_total" [] "ProcessorStats"
        "Sink calls that failed (timeouts included).";
    KV_PROCESSOR_PUBLISH_TIMEOUTS: Counter "eventplane_kv_processor_publish_timeouts_total" [] "ProcessorStats"
        "Of those, sink calls abandoned after publish_timeout.";
    KV_PROCESSOR_DEDUP_RESETS: Counter "eventplane_kv_processor_dedup_resets_total" [] "ProcessorStats"
        "Times the dedup table was reset (a Cleared, or its cap reached).";
    KV_PROCESSOR_FENCED: Gauge "eventplane_kv_processor_fenced" [] "ProcessorStats"
        "1 once the processor fenced itself (its local index failed to apply a Cleared).";
    KV_WORKER_PUBLISHED: Counter "eventplane_kv_worker_published_messages_total" [] "WorkerStats"
        "Messages the worker's sink published.";

    // kv::pipeline::RecoveryServer (`RecoveryServerStats`) and
    // kv::dynamo_recovery::DynamoQueryServer (`DynamoQueryStats`): a worker's recovery endpoint.
    KV_RECOVERY_CONNECTIONS: Counter "eventplane_kv_recovery_connections_total" ["outcome"] "RecoveryServerStats, DynamoQueryStats"
        "Recovery request connections, by outcome: accepted, refused (closed at once: too many were open).";
    KV_RECOVERY_ANSWERS: Counter "eventplane_kv_recovery_answers_total" ["kind"] "RecoveryServerStats, DynamoQueryStats"
        "Recovery requests answered, by kind: events, dump, too_old (ours: a loss older than the log), out_of_range (Dynamo's TooNew or InvalidRange).";
    KV_RECOVERY_UNANSWERED: Counter "eventplane_kv_recovery_unanswered_total" ["reason"] "RecoveryServerStats, DynamoQueryStats"
        "Recovery requests not answered, by reason: malformed, busy (Dynamo's: max_queued_answers were waiting), call_home_refused (the address to answer was not the asker's, or the filter refused it), call_home_failed.";

    // admin::AdminServer: `AdminStats`.
    ADMIN_REQUESTS: Counter "eventplane_admin_requests_total" [] "AdminStats"
        "Requests the admin endpoint answered.";
    ADMIN_REFUSED: Counter "eventplane_admin_refused_connections_total" [] "AdminStats"
        "Admin connections closed on accept: every slot was busy answering.";
    ADMIN_EVICTED: Counter "eventplane_admin_evicted_connections_total" [] "AdminStats"
        "Admin connections closed to make room while they waited for their request head.";
    ADMIN_BAD: Counter "eventplane_admin_bad_requests_total" [] "AdminStats"
        "Admin requests answered 400 or 431.";
    ADMIN_TIMEOUTS: Counter "eventplane_admin_timeouts_total" [] "AdminStats"
        "Admin connections closed for not sending a request head, or not taking the answer, within request_timeout.";

    // tunnel::EventBus: `BusStats`.
    BUS_SESSIONS: Gauge "eventplane_bus_sessions" [] "BusStats"
        "Broker and source sessions welcomed now.";
    BUS_SESSIONS_STARTED: Counter "eventplane_bus_sessions_started_total" [] "BusStats"
        "Sessions started.";
    BUS_SUPERSEDED: Counter "eventplane_bus_superseded_sessions_total" [] "BusStats"
        "Sessions ended because a newer one of the same client id arrived.";
    BUS_UNAUTHORIZED: Counter "eventplane_bus_unauthorized_total" [] "BusStats"
        "Requests refused for a wrong or missing credential.";
    BUS_DENIED: Counter "eventplane_bus_denied_total" ["code"] "BusStats"
        "Hellos denied, by DenyCode.";
    BUS_PENDING_EVICTED: Counter "eventplane_bus_pending_evicted_total" [] "BusStats"
        "Unauthenticated connections closed to make room in their full pool, or in their source's share of it.";
    BUS_PENDING_TIMEOUTS: Counter "eventplane_bus_pending_timeouts_total" [] "BusStats"
        "Connections closed for not completing TLS or authenticating in time.";
    BUS_PENDING: Gauge "eventplane_bus_pending_connections" [] "BusStats"
        "Connections held unauthenticated now.";
    BUS_CONNECTIONS_REFUSED: Counter "eventplane_bus_connections_refused_total" [] "BusStats"
        "Authenticated connections refused (max_connections or the credential's share).";
    BUS_BAD_TARGETS: Counter "eventplane_bus_bad_targets_total" [] "BusStats"
        "Opens refused before reaching any broker (a malformed target).";
    BUS_STREAMS_OPENED: Counter "eventplane_bus_streams_opened_total" [] "BusStats"
        "Streams opened through a broker or source.";
    BUS_STREAMS_FAILED: Counter "eventplane_bus_streams_failed_total" [] "BusStats"
        "Streams refused, closed before opening, or expired.";
    BUS_UNKNOWN_STREAMS: Counter "eventplane_bus_unknown_streams_total" [] "BusStats"
        "Data streams refused with unknown_stream.";
    BUS_STREAMS_MOVED: Counter "eventplane_bus_streams_moved_total" [] "BusStats"
        "Streams ended because a joining broker became their publisher's owner.";
    BUS_STREAMS_OPEN: Gauge "eventplane_bus_streams_open" [] "BusStats"
        "Data streams open now.";
    BUS_FALLBACKS: Counter "eventplane_bus_fallbacks_total" [] "BusStats"
        "Subscribes the owner could not serve that were tried through the runner-up.";
    BUS_STREAMS_PENDING: Gauge "eventplane_bus_streams_pending" [] "BusStats"
        "Subscribes waiting for their broker's answer now.";
    BUS_REFUSED: Counter "eventplane_bus_refused_total" ["code"] "BusStats"
        "Subscribes brokers refused, by RefuseCode.";
    BUS_CLOSED: Counter "eventplane_bus_closed_total" ["code"] "BusStats"
        "Streams brokers closed, by CloseCode.";
    BUS_READ_BYTES: Counter "eventplane_bus_read_bytes_total" [] "BusStats"
        "Bytes the router read from publishers through the tunnel.";
    BUS_WRITTEN_BYTES: Counter "eventplane_bus_written_bytes_total" [] "BusStats"
        "Bytes the router wrote to publishers through the tunnel.";
    BUS_SOURCE_SESSIONS: Gauge "eventplane_bus_source_sessions" [] "BusStats"
        "Source sessions welcomed now (also counted in eventplane_bus_sessions).";
    BUS_ANNOUNCED: Gauge "eventplane_bus_announced_sources" [] "BusStats"
        "Publishers sources announce now.";
    BUS_ANNOUNCE_REFUSED: Counter "eventplane_bus_announce_refused_total" ["reason"] "BusStats"
        "Announced publishers ignored, by reason: held_by_another_source, superseded_session, bus_full.";

    // tunnel::Broker: `BrokerStats`.
    BROKER_SESSIONS: Counter "eventplane_broker_sessions_total" [] "BrokerStats"
        "Sessions the bus welcomed.";
    BROKER_SESSION_FAILURES: Counter "eventplane_broker_session_failures_total" [] "BrokerStats"
        "Session attempts that failed, and sessions that ended without a drain.";
    BROKER_CONNECTED: Gauge "eventplane_broker_connected" [] "BrokerStats"
        "1 while a session is welcomed.";
    BROKER_STREAMS_OPENED: Counter "eventplane_broker_streams_opened_total" [] "BrokerStats"
        "Streams opened to publishers.";
    BROKER_STREAMS_OPEN: Gauge "eventplane_broker_streams_open" [] "BrokerStats"
        "Streams relaying now.";
    BROKER_REBALANCES_THROTTLED: Counter "eventplane_broker_rebalances_throttled_total" [] "BrokerStats"
        "Rebalances within a minute of the previous one (they waited the normal backoff).";
    BROKER_REFUSED: Counter "eventplane_broker_refused_total" ["code"] "BrokerStats"
        "Subscribes refused, by RefuseCode.";
    BROKER_DENIED: Counter "eventplane_broker_denied_total" ["code"] "BrokerStats"
        "Sessions the bus denied, by DenyCode.";
    BROKER_DNS_SATURATED: Counter "eventplane_broker_dns_saturated_total" [] "BrokerStats"
        "DNS lookups that waited for a slot.";
    BROKER_CLOSED: Counter "eventplane_broker_closed_total" ["code"] "BrokerStats"
        "Streams the broker closed, by CloseCode.";
    BROKER_UP_BYTES: Counter "eventplane_broker_up_bytes_total" [] "BrokerStats"
        "Bytes relayed publisher to router.";
    BROKER_DOWN_BYTES: Counter "eventplane_broker_down_bytes_total" [] "BrokerStats"
        "Bytes relayed router to publisher.";
    BROKER_HIGH_WATER: Gauge "eventplane_broker_buffer_high_water_bytes" [] "BrokerStats"
        "The most the broker had queued toward the router in one session.";
    BROKER_DISCOVERY_READY: Gauge "eventplane_broker_discovery_ready" [] "BrokerStats"
        "1 once every namespace's initial discovery list is complete.";
    BROKER_ADVERTISED: Gauge "eventplane_broker_advertised_endpoints" [] "BrokerStats"
        "Endpoints advertised in the broker's discovery view.";
    BROKER_VIEW_IGNORED: Counter "eventplane_broker_view_ignored_total" [] "BrokerStats"
        "Discovery instances not advertised (the view's bounds, or an endpoint over 1 KiB).";

    // tunnel::Source: `SourceStats`.
    SOURCE_SESSIONS: Counter "eventplane_source_sessions_total" [] "SourceStats"
        "Sessions the bus welcomed.";
    SOURCE_SESSION_FAILURES: Counter "eventplane_source_session_failures_total" [] "SourceStats"
        "Session attempts that failed, and sessions that ended without a drain.";
    SOURCE_CONNECTED: Gauge "eventplane_source_connected" [] "SourceStats"
        "1 while a session is welcomed.";
    SOURCE_ANNOUNCED: Gauge "eventplane_source_announced" [] "SourceStats"
        "Publishers announced now.";
    SOURCE_STREAMS_OPENED: Counter "eventplane_source_streams_opened_total" [] "SourceStats"
        "Data streams opened (subscribers served through the bus).";
    SOURCE_STREAMS_OPEN: Gauge "eventplane_source_streams_open" [] "SourceStats"
        "Data streams open now.";
    SOURCE_REFUSED: Counter "eventplane_source_refused_total" ["code"] "SourceStats"
        "Subscribes refused, by RefuseCode.";
    SOURCE_DENIED: Counter "eventplane_source_denied_total" ["code"] "SourceStats"
        "Sessions the bus denied, by DenyCode.";
    SOURCE_ANNOUNCE_REFUSED: Counter "eventplane_source_announce_refused_total" ["code"] "SourceStats"
        "Announced publishers the bus refused, by AnnounceRefusal.";
    SOURCE_REFUSED_PUBLISHERS: Gauge "eventplane_source_refused_publishers" [] "SourceStats"
        "Publishers the bus refuses now (refused within the last 20 s).";
    SOURCE_UP_BYTES: Counter "eventplane_source_up_bytes_total" [] "SourceStats"
        "Bytes sent to the router.";
    SOURCE_DOWN_BYTES: Counter "eventplane_source_down_bytes_total" [] "SourceStats"
        "Bytes read from the router.";
}
