//! A worker's answer to a Dynamo router's KV query, from its recovery log (sans-IO),
//! by Dynamo 1.6.1's rules: no start, or a start older than what the log keeps, gets
//! a dump (`TreeDump`, synthetic ids 0); a start past the newest event, `TooNew`; an
//! end before the start, `InvalidRange`; otherwise the events from the start on.

use super::query::{KvAnswer, KvQuery};
use crate::kv::{
    RouterEvent,
    pipeline::{Since, WorkerLog},
};

/// What `log` answers to `query`: only the events of the rank it names, at most
/// `max_events` of them (the answer then stops at the last one sent, and Dynamo's
/// router asks again from there).
pub fn answer(log: &WorkerLog, query: &KvQuery, max_events: usize) -> KvAnswer {
    let newest = log.stats().last_id;
    if let (Some(start), Some(end)) = (query.start_event_id, query.end_event_id) {
        if end < start {
            return KvAnswer::InvalidRange {
                start_id: start,
                end_id: end,
            };
        }
    }
    let rank = query.dp_rank;
    let of_rank = move |e: &RouterEvent| e.event.dp_rank == rank;
    match query.start_event_id {
        Some(start) if start > newest => KvAnswer::TooNew {
            requested_start: Some(start),
            requested_end: query.end_event_id,
            newest_available: newest,
        },
        Some(start) => match log.since(start.saturating_sub(1)) {
            // Through the end asked for, if any (ids past it are left to the live
            // stream and the router's next query).
            Since::Events(events) => {
                let mut end = query.end_event_id.unwrap_or(u64::MAX).min(newest);
                let mut sent = 0usize;
                let mut kept = Vec::new();
                for e in events {
                    if e.event.id > end {
                        break;
                    }
                    if !of_rank(&e) {
                        continue;
                    }
                    if sent == max_events.max(1) {
                        // Full: the cursor stops before this one.
                        end = e.event.id.saturating_sub(1);
                        break;
                    }
                    sent += 1;
                    kept.push(e);
                }
                KvAnswer::Events {
                    events: kept,
                    last_event_id: end,
                }
            }
            _ => tree_dump(log, &of_rank),
        },
        None => tree_dump(log, &of_rank),
    }
}

fn tree_dump(log: &WorkerLog, of_rank: &dyn Fn(&RouterEvent) -> bool) -> KvAnswer {
    let dump = log.dump();
    let events = dump
        .events
        .into_iter()
        .filter(|e| of_rank(e))
        .map(|mut e| {
            e.event.id = 0;
            e
        })
        .collect();
    KvAnswer::TreeDump {
        events,
        last_event_id: dump.current_id,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::kv::{
        BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash, WorkerId,
        pipeline::{LocalIndex, WorkerLogConfig},
    };

    fn stored(id: u64, rank: u32, hash: u64, parent: Option<u64>) -> RouterEvent {
        RouterEvent {
            worker_id: WorkerId(88),
            tier: StorageTier::Device,
            event: KvEvent {
                id,
                dp_rank: rank,
                data: KvEventData::Stored {
                    parent_hash: parent.map(BlockHash),
                    blocks: vec![StoredBlock {
                        block_hash: BlockHash(hash),
                        tokens_hash: TokensHash(hash),
                    }],
                },
            },
        }
    }

    /// A log of ids 1..=10: rank 0 a chain 101..=105 (odd ids), rank 1 201..=205.
    fn log(kept: usize) -> WorkerLog {
        let mut log = WorkerLog::new(WorkerLogConfig::default().events(kept));
        for i in 0..5u64 {
            let parent = (i > 0).then(|| 100 + i);
            log.apply(&stored(2 * i + 1, 0, 101 + i, parent)).unwrap();
            let parent = (i > 0).then(|| 200 + i);
            log.apply(&stored(2 * i + 2, 1, 201 + i, parent)).unwrap();
        }
        log
    }

    #[test]
    fn dynamo_s_rules_from_the_log() {
        let log = log(1024);
        // Activation: a dump of the rank asked, ids 0, current at 10.
        let KvAnswer::TreeDump {
            events,
            last_event_id,
        } = answer(&log, &KvQuery::recovery(88, 0, None), 1024)
        else {
            panic!("not a dump");
        };
        assert_eq!(last_event_id, 10);
        assert!(
            events
                .iter()
                .all(|e| e.event.id == 0 && e.event.dp_rank == 0)
        );
        let blocks: usize = events.iter().map(|e| e.event.data.block_count()).sum();
        assert_eq!(blocks, 5);
        // A gap from 5: the rank's events 5, 7, 9.
        let KvAnswer::Events {
            events,
            last_event_id,
        } = answer(&log, &KvQuery::recovery(88, 0, Some(5)), 1024)
        else {
            panic!("not events");
        };
        let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
        assert_eq!((ids, last_event_id), (vec![5, 7, 9], 10));
        // Past the newest.
        assert_eq!(
            answer(&log, &KvQuery::recovery(88, 0, Some(11)), 1024),
            KvAnswer::TooNew {
                requested_start: Some(11),
                requested_end: None,
                newest_available: 10
            }
        );
        // Through an end: what is past it is not sent, the cursor stops there.
        let mut q = KvQuery::recovery(88, 0, Some(3));
        q.end_event_id = Some(7);
        let KvAnswer::Events {
            events,
            last_event_id,
        } = answer(&log, &q, 1024)
        else {
            panic!("not events");
        };
        let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
        assert_eq!((ids, last_event_id), (vec![3, 5, 7], 7));
        // At most so many: the cursor stops at the last one sent.
        let KvAnswer::Events {
            events,
            last_event_id,
        } = answer(&log, &KvQuery::recovery(88, 0, Some(1)), 2)
        else {
            panic!("not events");
        };
        let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
        assert_eq!((ids, last_event_id), (vec![1, 3], 4));
        // An end before the start.
        let mut q = KvQuery::recovery(88, 0, Some(5));
        q.end_event_id = Some(3);
        assert_eq!(
            answer(&log, &q, 1024),
            KvAnswer::InvalidRange {
                start_id: 5,
                end_id: 3
            }
        );
    }

    #[test]
    fn a_start_older_than_the_log_keeps_gets_a_dump() {
        let log = log(4);
        assert!(matches!(
            answer(&log, &KvQuery::recovery(88, 1, Some(2)), 1024),
            KvAnswer::TreeDump {
                last_event_id: 10,
                ..
            }
        ));
        assert!(matches!(
            answer(&log, &KvQuery::recovery(88, 1, Some(8)), 1024),
            KvAnswer::Events {
                last_event_id: 10,
                ..
            }
        ));
    }
}
