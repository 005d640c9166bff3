#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use super::*;
use crate::discovery::{Instance, Transport, WorkerIdentity};
use crate::kv::{
    BlockHash, Dump, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash, WorkerId,
};
use crate::subscriber::Notice;

fn worker() -> Instance {
    let id = ChannelId::new("ns", "c", "t", 1).unwrap();
    Instance::new(id, Transport::zmq("tcp://127.0.0.1:1"), 1)
        .with_worker(WorkerIdentity::new(7, 0))
        .with_recovery("tcp://127.0.0.1:2")
}

/// Event `id` storing block `hash` under `parent`.
fn stored(id: u64, hash: u64, parent: Option<u64>) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(7),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 0,
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

fn blocks(feed: &IndexFeed) -> Vec<u64> {
    let mut v: Vec<u64> = feed
        .index()
        .rank_block_hashes(WorkerId(7), 0)
        .map(|h| h.0)
        .collect();
    v.sort_unstable();
    v
}

/// A feed that rebuilt the worker from an empty dump and then applied ids 1..=n.
fn following(n: u64) -> (IndexFeed, Instance) {
    let w = worker();
    let mut feed = IndexFeed::default();
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    let need = feed.take_recoveries();
    assert_eq!(need.len(), 1);
    assert_eq!(need[0].request, RecoveryRequest::Dump);
    assert_eq!(need[0].endpoint, "tcp://127.0.0.1:2");
    let empty = Dump {
        events: Vec::new(),
        current_id: 0,
        complete: true,
    };
    feed.recovered(&w.id, Ok(Recovered::Dump(empty)), Duration::from_millis(3));
    let events: Vec<RouterEvent> = (1..=n)
        .map(|i| stored(i, 100 + i, (i > 1).then(|| 99 + i)))
        .collect();
    feed.apply(&w, &events);
    (feed, w)
}

#[test]
fn a_gap_is_repaired_from_the_events_since_without_a_wipe() {
    let (mut feed, w) = following(2);
    // Events 3 and 4 were lost; 5 arrives.
    feed.apply(&w, &[stored(5, 105, Some(104))]);
    assert_eq!(blocks(&feed), [101, 102], "kept, and 5 held");
    assert_eq!(feed.stats().held_events, 1);
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Since(2));
    assert!(feed.take_recoveries().is_empty(), "asked once");
    feed.apply(&w, &[stored(6, 106, Some(105))]);
    let since = vec![
        stored(3, 103, Some(102)),
        stored(4, 104, Some(103)),
        stored(5, 105, Some(104)),
    ];
    feed.recovered(
        &w.id,
        Ok(Recovered::Events {
            events: since,
            current_id: 5,
        }),
        Duration::from_millis(7),
    );
    assert_eq!(blocks(&feed), [101, 102, 103, 104, 105, 106]);
    let s = feed.stats();
    assert_eq!(
        (s.repairs_since, s.wipes_id_gap, s.held_events, s.recovering),
        (1, 0, 0, 0)
    );
    assert!(feed.wiped().is_empty());
}

#[test]
fn at_first_sight_a_dump_rebuilds_and_held_events_after_it_follow() {
    let w = worker();
    let mut feed = IndexFeed::default();
    feed.apply(
        &w,
        &[stored(41, 141, Some(140)), stored(42, 142, Some(141))],
    );
    assert!(blocks(&feed).is_empty(), "held until the dump");
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Dump);
    // The dump is current at 41: it has 140 and 141; 42 follows it.
    let mut chain = stored(41, 140, None);
    if let KvEventData::Stored { blocks, .. } = &mut chain.event.data {
        blocks.push(StoredBlock {
            block_hash: BlockHash(141),
            tokens_hash: TokensHash(141),
        });
    }
    let dump = Dump {
        events: vec![chain],
        current_id: 41,
        complete: true,
    };
    feed.recovered(&w.id, Ok(Recovered::Dump(dump)), Duration::from_millis(1));
    assert_eq!(blocks(&feed), [140, 141, 142]);
    assert_eq!(feed.stats().repairs_dump, 1);
    // Live again.
    feed.apply(&w, &[stored(43, 143, Some(142))]);
    assert_eq!(blocks(&feed).len(), 4);
}

#[test]
fn too_old_asks_for_a_dump_and_a_failure_wipes() {
    let (mut feed, w) = following(3);
    feed.apply(&w, &[stored(9, 109, None)]);
    feed.take_recoveries();
    feed.recovered(&w.id, Ok(Recovered::TooOld { oldest: 8 }), Duration::ZERO);
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Dump);
    feed.recovered(
        &w.id,
        Err(RecoveryError::Timeout(Duration::from_secs(5))),
        Duration::from_secs(5),
    );
    // Wiped, and the held event starts it over.
    assert_eq!(blocks(&feed), [109]);
    let s = feed.stats();
    assert_eq!((s.wipes_recovery_failed, s.recovering), (1, 0));
    assert_eq!(feed.wiped()[0].cause, Wipe::RecoveryFailed);
    feed.apply(&w, &[stored(10, 110, Some(109))]);
    assert_eq!(blocks(&feed), [109, 110]);
}

#[test]
fn a_reconnect_asks_for_what_was_sent_meanwhile() {
    let (mut feed, w) = following(2);
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(2));
    feed.recovered(
        &w.id,
        Ok(Recovered::Events {
            events: vec![stored(3, 103, Some(102))],
            current_id: 3,
        }),
        Duration::ZERO,
    );
    assert_eq!(blocks(&feed), [101, 102, 103]);
    assert_eq!(feed.stats().wipes_reconnect, 0);
}

#[test]
fn live_events_past_the_hold_are_dropped_and_fetched_by_another_recovery() {
    let (mut feed, w) = following(1);
    // 2 was lost; 3.. arrive, more than the feed holds.
    let last = 3 + FEED_MAX_HELD_EVENTS as u64 + 10;
    let events: Vec<RouterEvent> = (3..=last).map(|i| stored(i, 1000 + i, None)).collect();
    feed.apply(&w, &events);
    assert_eq!(feed.stats().held_dropped, 11);
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(1));
    feed.recovered(
        &w.id,
        Ok(Recovered::Events {
            events: vec![stored(2, 102, Some(101))],
            current_id: last,
        }),
        Duration::ZERO,
    );
    // The held ones are applied and the dropped ones asked for.
    let held_last = 2 + FEED_MAX_HELD_EVENTS as u64;
    assert_eq!(
        feed.take_recoveries()[0].request,
        RecoveryRequest::Since(held_last)
    );
    let rest: Vec<RouterEvent> = (held_last + 1..=last)
        .map(|i| stored(i, 1000 + i, None))
        .collect();
    feed.recovered(
        &w.id,
        Ok(Recovered::Events {
            events: rest,
            current_id: last,
        }),
        Duration::ZERO,
    );
    assert_eq!(blocks(&feed).len(), 2 + (last - 2) as usize);
    let s = feed.stats();
    assert_eq!(
        (
            s.wipes_held_overflow,
            s.recovering,
            s.held_events,
            s.repairs_since
        ),
        (0, 0, 0, 2)
    );
}

#[test]
fn a_publisher_that_overflows_recovery_after_recovery_is_wiped() {
    let (mut feed, w) = following(1);
    let mut next = 3u64;
    for round in 0..=MAX_OVERFLOWS {
        // More live events than the feed holds, on every recovery.
        let events: Vec<RouterEvent> = (next..next + FEED_MAX_HELD_EVENTS as u64 + 5)
            .map(|i| stored(i, 1000 + i, None))
            .collect();
        next += FEED_MAX_HELD_EVENTS as u64 + 5;
        feed.apply(&w, &events);
        assert_eq!(feed.take_recoveries().len(), 1, "round {round}");
        feed.recovered(
            &w.id,
            Ok(Recovered::Events {
                events: Vec::new(),
                current_id: next,
            }),
            Duration::ZERO,
        );
    }
    let s = feed.stats();
    assert_eq!((s.wipes_held_overflow, s.recovering), (1, 0));
}
