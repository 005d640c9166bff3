#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use super::*;
use crate::discovery::{Instance, Transport, WorkerIdentity};
use crate::kv::{
    BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash, WorkerId, pipeline::Dump,
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

/// Answers `w`'s outstanding request.
fn answer(
    feed: &mut IndexFeed,
    w: &Instance,
    answer: Result<Recovered, RecoveryError>,
    elapsed: Duration,
) {
    let serial = feed
        .publishers
        .get(&w.id)
        .and_then(|p| p.repair.as_ref())
        .map_or(0, |r| r.serial);
    feed.recovered(RecoveryAnswer {
        publisher: w.id.clone(),
        serial,
        answer,
        elapsed,
    });
}

/// Answers `w`'s outstanding request with a complete dump of `events` at `current_id`.
fn answer_dump(feed: &mut IndexFeed, w: &Instance, events: Vec<RouterEvent>, current_id: u64) {
    let dump = Dump {
        events,
        current_id,
        complete: true,
    };
    answer(feed, w, Ok(Recovered::Dump(dump)), Duration::from_millis(1));
}

/// A feed that sees `w` connect, and its dump request.
fn connected() -> (IndexFeed, Instance) {
    let w = worker();
    let mut feed = IndexFeed::default();
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    assert_eq!(feed.take_recoveries().len(), 1);
    (feed, w)
}

fn removed(id: u64, hash: u64) -> RouterEvent {
    let mut ev = stored(id, hash, None);
    ev.event.data = KvEventData::Removed {
        block_hashes: vec![BlockHash(hash)],
    };
    ev
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
    answer(
        &mut feed,
        &w,
        Ok(Recovered::Dump(empty)),
        Duration::from_millis(3),
    );
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
    answer(
        &mut feed,
        &w,
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

/// An answer that reached further than the live events held: the live events it
/// covered arrive after it (they were on their way) and are skipped, not taken for
/// ids going back.
#[test]
fn live_events_an_answer_already_applied_are_skipped_not_wiped() {
    let (mut feed, w) = following(2);
    // 3 lost; 4 arrives and is held; the worker is at 6 when it answers.
    feed.apply(&w, &[stored(4, 104, Some(103))]);
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Since(2));
    let since: Vec<RouterEvent> = (3..=6).map(|i| stored(i, 100 + i, Some(99 + i))).collect();
    answer(
        &mut feed,
        &w,
        Ok(Recovered::Events {
            events: since,
            current_id: 6,
        }),
        Duration::from_millis(2),
    );
    // 5 and 6 were on their way; 7 is new.
    feed.apply(
        &w,
        &[
            stored(5, 105, Some(104)),
            stored(6, 106, Some(105)),
            stored(7, 107, Some(106)),
        ],
    );
    assert_eq!(blocks(&feed), [101, 102, 103, 104, 105, 106, 107]);
    let s = feed.stats();
    assert_eq!(
        (s.late_duplicates, s.wipes_id_gap, s.repairs_since),
        (2, 0, 1)
    );
    // Past the answer, an id going back is what it always was: a wipe.
    feed.apply(&w, &[stored(5, 105, Some(104))]);
    assert_eq!(feed.stats().wipes_id_gap, 1);
}

/// A dump read before any live event: the live events it already applied arrive
/// after it, a run ending at its id, and are skipped. A worker process that restarts
/// its ids comes on a new connection: it is rebuilt from its own dump, and goes on
/// from there.
#[test]
fn late_copies_of_a_dump_read_first_are_skipped_and_a_restart_starts_over() {
    let (mut feed, w) = connected();
    answer_dump(
        &mut feed,
        &w,
        vec![stored(9, 109, None), stored(10, 110, Some(109))],
        10,
    );
    feed.apply(
        &w,
        &[
            stored(9, 109, None),
            stored(10, 110, Some(109)),
            stored(11, 111, Some(110)),
        ],
    );
    assert_eq!(blocks(&feed), [109, 110, 111]);
    let s = feed.stats();
    assert_eq!((s.late_duplicates, s.wipes_id_gap), (2, 0));
    // The worker process restarts (a new connection), its ids from 1.
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Since(11));
    answer(
        &mut feed,
        &w,
        Ok(Recovered::TooOld { oldest: 1 }),
        Duration::from_millis(1),
    );
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Dump);
    answer_dump(&mut feed, &w, vec![stored(1, 201, None)], 1);
    assert_eq!(blocks(&feed), [201]);
    feed.apply(&w, &[stored(2, 202, Some(201))]);
    assert_eq!(blocks(&feed), [201, 202]);
    assert_eq!(feed.stats().late_duplicates, 2);
}

/// The live copies of what a dump applied may be more than a feed holds while it
/// waits (a relay's queue and a tunnel stream held over 5,000 in a test): a run of
/// 6,000 after the dump is skipped whole, and the stream goes on past it.
#[test]
fn a_late_run_longer_than_the_held_bound_is_skipped() {
    let w = worker();
    let mut feed = IndexFeed::default();
    // First sight at 1: held, and the dump asked.
    feed.apply(&w, &[stored(1, 1, None)]);
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Dump);
    let late = 2 + FEED_MAX_HELD_EVENTS as u64 + 2_000;
    let chain: Vec<RouterEvent> = (1..=late)
        .map(|i| stored(i, i, (i > 1).then(|| i - 1)))
        .collect();
    answer_dump(&mut feed, &w, chain.clone(), late);
    let copies = chain.get(1..).unwrap_or_default();
    feed.apply(&w, copies);
    feed.apply(&w, &[stored(late + 1, late + 1, Some(late))]);
    let s = feed.stats();
    assert_eq!((s.late_duplicates, s.wipes_id_gap), (late - 1, 0), "{s:?}");
    assert_eq!(blocks(&feed).len() as u64, late + 1);
}

/// A dump that claims an id far past the live events opens no window either: the
/// next live event is what it is (here, ids going back: a wipe), and the stream
/// goes on from it.
#[test]
fn a_dump_claiming_an_id_far_ahead_does_not_freeze_the_publisher() {
    let (mut feed, w) = connected();
    // A live event arrives while the dump is awaited.
    feed.apply(&w, &[stored(5, 105, None)]);
    answer_dump(&mut feed, &w, vec![stored(5, 105, None)], u64::MAX);
    feed.apply(&w, &[stored(6, 106, None), stored(7, 107, None)]);
    let s = feed.stats();
    assert_eq!((s.late_duplicates, s.wipes_id_gap), (0, 1));
    assert_eq!(blocks(&feed), [106, 107]);
}

/// Ids 1..=2 applied, 3 lost, 4 held, then an answer with 3..=8: live copies of 5..=8
/// may follow.
fn answered_through_8() -> (IndexFeed, Instance) {
    let (mut feed, w) = following(2);
    feed.apply(&w, &[stored(4, 104, Some(103))]);
    feed.take_recoveries();
    let since: Vec<RouterEvent> = (3..=8).map(|i| stored(i, 100 + i, Some(99 + i))).collect();
    answer(
        &mut feed,
        &w,
        Ok(Recovered::Events {
            events: since,
            current_id: 8,
        }),
        Duration::from_millis(2),
    );
    (feed, w)
}

/// Late copies come in increasing order, some perhaps lost on the way (a lane that
/// dropped them: the answer covered those too); an id at or below one already skipped
/// ends the window.
#[test]
fn late_copies_with_gaps_are_skipped_and_an_id_going_back_ends_the_window() {
    let (mut feed, w) = answered_through_8();
    // 5 was lost on the way as well: 6 is still a late copy, and so is 8.
    feed.apply(&w, &[stored(6, 106, Some(105)), stored(8, 108, Some(107))]);
    feed.apply(&w, &[stored(9, 109, Some(108))]);
    let s = feed.stats();
    assert_eq!((s.late_duplicates, s.wipes_id_gap), (2, 0));
    assert_eq!(blocks(&feed), [101, 102, 103, 104, 105, 106, 107, 108, 109]);
    // Another window, and an id that goes back within it: a wipe.
    let (mut feed, w) = answered_through_8();
    feed.apply(&w, &[stored(6, 106, Some(105)), stored(5, 105, Some(104))]);
    let s = feed.stats();
    assert_eq!((s.late_duplicates, s.wipes_id_gap), (1, 1));
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
    answer_dump(&mut feed, &w, vec![chain], 41);
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
    answer(
        &mut feed,
        &w,
        Ok(Recovered::TooOld { oldest: 8 }),
        Duration::ZERO,
    );
    let need = feed.take_recoveries();
    assert_eq!(need[0].request, RecoveryRequest::Dump);
    answer(
        &mut feed,
        &w,
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
    answer(
        &mut feed,
        &w,
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
    // The worker published them all before it answered: its answer has them all.
    let since: Vec<RouterEvent> = (2..=last).map(|i| stored(i, 1000 + i, None)).collect();
    let all = Recovered::Events {
        events: since,
        current_id: last,
    };
    answer(&mut feed, &w, Ok(all), Duration::ZERO);
    // Events were dropped: one more request makes sure nothing followed.
    assert_eq!(
        feed.take_recoveries()[0].request,
        RecoveryRequest::Since(last)
    );
    let nothing_more = Recovered::Events {
        events: Vec::new(),
        current_id: last,
    };
    answer(&mut feed, &w, Ok(nothing_more), Duration::ZERO);
    assert_eq!(blocks(&feed).len(), 1 + (last - 1) as usize);
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
    let mut sent = 2u64; // 2 was lost
    for round in 0..=MAX_OVERFLOWS {
        // More live events than the feed holds, during every recovery.
        let burst = FEED_MAX_HELD_EVENTS as u64 + 5;
        let events: Vec<RouterEvent> = (sent + 1..=sent + burst)
            .map(|i| stored(i, 1000 + i, None))
            .collect();
        sent += burst;
        feed.apply(&w, &events);
        let need = feed.take_recoveries();
        assert_eq!(need.len(), 1, "round {round}");
        let RecoveryRequest::Since(after) = need[0].request else {
            panic!("{:?}", need[0].request)
        };
        let since = (after + 1..=sent)
            .map(|i| stored(i, 1000 + i, None))
            .collect();
        let events = Recovered::Events {
            events: since,
            current_id: sent,
        };
        answer(&mut feed, &w, Ok(events), Duration::ZERO);
    }
    let s = feed.stats();
    assert_eq!((s.wipes_held_overflow, s.recovering), (1, 0));
}

// Reproductions from an attack review of the first version (each failed on it).

#[test]
fn too_old_answered_to_a_dump_fails_instead_of_looping() {
    let (mut feed, w) = following(2);
    feed.apply(&w, &[removed(5, 101)]);
    for _ in 0..3 {
        if feed.take_recoveries().is_empty() {
            break;
        }
        answer(
            &mut feed,
            &w,
            Ok(Recovered::TooOld { oldest: 0 }),
            Duration::ZERO,
        );
    }
    let s = feed.stats();
    assert_eq!((s.recovering, s.wipes_recovery_failed), (0, 1));
    assert!(!blocks(&feed).contains(&101));
}

#[test]
fn a_since_answer_that_does_not_reach_its_current_id_is_not_a_repair() {
    let (mut feed, w) = following(2);
    feed.apply(&w, &[removed(5, 101)]);
    // The removal is applied at once, while the recovery runs.
    assert_eq!(blocks(&feed), [102]);
    for _ in 0..10 {
        if feed.take_recoveries().is_empty() {
            break;
        }
        // Claims to be at 4 but sends nothing.
        let short = Recovered::Events {
            events: Vec::new(),
            current_id: 4,
        };
        answer(&mut feed, &w, Ok(short), Duration::ZERO);
    }
    let s = feed.stats();
    assert_eq!(s.repairs_since, 0);
    assert_eq!((s.recovering, s.wipes_recovery_failed), (0, 1), "{s:?}");
}

#[test]
fn a_recovery_whose_endpoint_is_gone_fails_instead_of_holding_forever() {
    let (mut feed, w) = following(2);
    feed.apply(&w, &[stored(5, 105, None)]);
    let mut gone = w.clone();
    gone.recovery = None;
    feed.apply(&gone, &[removed(6, 101)]);
    assert!(feed.take_recoveries().is_empty());
    let s = feed.stats();
    assert_eq!(
        (s.recovering, s.held_events, s.wipes_recovery_failed),
        (0, 0, 1)
    );
    assert_eq!(blocks(&feed), [105]);
}

#[test]
fn a_worker_whose_ids_went_back_is_rebuilt_from_a_dump() {
    let (mut feed, w) = following(3);
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(3));
    // A new worker process under the same publisher: its ids start again.
    feed.apply(&w, &[stored(1, 201, None), stored(2, 202, Some(201))]);
    let behind = Recovered::Events {
        events: Vec::new(),
        current_id: 2,
    };
    answer(&mut feed, &w, Ok(behind), Duration::ZERO);
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Dump);
    let mut chain = stored(2, 201, None);
    if let KvEventData::Stored { blocks, .. } = &mut chain.event.data {
        blocks.push(StoredBlock {
            block_hash: BlockHash(202),
            tokens_hash: TokensHash(202),
        });
    }
    let dump = Dump {
        events: vec![chain],
        current_id: 2,
        complete: true,
    };
    answer(&mut feed, &w, Ok(Recovered::Dump(dump)), Duration::ZERO);
    assert_eq!(blocks(&feed), [201, 202]);
}

#[test]
fn an_answer_to_an_earlier_request_is_ignored() {
    let (mut feed, w) = following(2);
    feed.apply(&w, &[stored(5, 105, Some(104))]);
    let first = feed.take_recoveries().remove(0);
    // It left and came back: a new publisher record, a new recovery.
    feed.notice(&Notice::Departed(w.id.clone()));
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    let second = feed.take_recoveries().remove(0);
    assert_ne!(first.serial, second.serial);
    let late = Err(RecoveryError::Timeout(Duration::from_secs(5)));
    feed.recovered(RecoveryAnswer::new(&first, late, Duration::from_secs(5)));
    let s = feed.stats();
    assert_eq!(
        (s.stale_answers, s.wipes_recovery_failed, s.recovering),
        (1, 0, 1)
    );
}

/// Blocks `first..=last` as one chain from the root, as a dump at `id` carries them.
fn chain(id: u64, first: u64, last: u64) -> RouterEvent {
    let mut ev = stored(id, first, None);
    if let KvEventData::Stored { blocks, .. } = &mut ev.event.data {
        blocks.extend((first + 1..=last).map(|h| StoredBlock {
            block_hash: BlockHash(h),
            tokens_hash: TokensHash(h),
        }));
    }
    ev
}

fn timed_out(feed: &mut IndexFeed, w: &Instance) {
    let timeout = Duration::from_secs(5);
    answer(feed, w, Err(RecoveryError::Timeout(timeout)), timeout);
}

/// Following ids 1..=3 (blocks 101..=103), then a gap whose recovery times out: the
/// publisher is wiped, and event 5 (block 105, from the root) starts it over.
fn wiped_by_a_failed_recovery() -> (IndexFeed, Instance) {
    let (mut feed, w) = following(3);
    feed.apply(&w, &[stored(5, 105, None)]);
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(3));
    timed_out(&mut feed, &w);
    assert_eq!(blocks(&feed), [105]);
    assert_eq!(feed.stats().wipes_recovery_failed, 1);
    (feed, w)
}

#[test]
fn a_failed_recovery_is_rebuilt_after_a_back_off_that_doubles() {
    let (mut feed, w) = wiped_by_a_failed_recovery();
    let s = feed.stats();
    assert_eq!((s.recovering, s.rebuilding), (0, 1));
    let need = feed.take_recoveries();
    assert_eq!(need.len(), 1);
    assert_eq!(
        (need[0].request, need[0].delay),
        (RecoveryRequest::Dump, Duration::from_secs(1))
    );
    // Meanwhile its live events are applied, not held.
    feed.apply(&w, &[stored(6, 106, Some(105))]);
    assert_eq!(blocks(&feed), [105, 106]);
    assert_eq!(feed.stats().held_events, 0);
    // Rebuilds that fail wipe nothing more, and wait twice as long each time, up to
    // a minute.
    let mut delays = Vec::new();
    for _ in 0..8 {
        timed_out(&mut feed, &w);
        delays.push(feed.take_recoveries()[0].delay.as_secs());
    }
    assert_eq!(delays, [2, 4, 8, 16, 32, 60, 60, 60]);
    let s = feed.stats();
    assert_eq!((s.wipes_recovery_failed, s.rebuilds_failed), (1, 8));
    assert_eq!(blocks(&feed), [105, 106]);
    // The worker answers at last: what it holds, the blocks before the loss too.
    let dump = vec![
        chain(6, 101, 103),
        stored(6, 105, None),
        stored(6, 106, Some(105)),
    ];
    answer_dump(&mut feed, &w, dump, 6);
    assert_eq!(blocks(&feed), [101, 102, 103, 105, 106]);
    let s = feed.stats();
    assert_eq!(
        (
            s.repairs_rebuild,
            s.repairs_dump,
            s.rebuilding,
            s.recovering
        ),
        (1, 1, 0, 0)
    );
    // Followed again: the next event is no gap, and a later failure starts at 1 s.
    feed.apply(&w, &[stored(7, 107, Some(106))]);
    assert_eq!(feed.stats().wipes_id_gap, 0);
    feed.apply(&w, &[stored(9, 109, None)]);
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(7));
    timed_out(&mut feed, &w);
    assert_eq!(feed.take_recoveries()[0].delay, Duration::from_secs(1));
}

#[test]
fn a_rebuild_repairs_what_was_sent_while_it_was_awaited() {
    let (mut feed, w) = wiped_by_a_failed_recovery();
    feed.take_recoveries();
    feed.apply(&w, &[stored(6, 106, Some(105)), stored(7, 107, Some(106))]);
    // The dump was built at 5, before 6 and 7 (which it replaces).
    answer_dump(
        &mut feed,
        &w,
        vec![chain(5, 101, 103), stored(5, 105, None)],
        5,
    );
    assert_eq!(blocks(&feed), [101, 102, 103, 105]);
    // What followed is asked for at once, from the worker's log.
    let need = feed.take_recoveries();
    assert_eq!(
        (need[0].request, need[0].delay),
        (RecoveryRequest::Since(5), Duration::ZERO)
    );
    let events = vec![stored(6, 106, Some(105)), stored(7, 107, Some(106))];
    answer(
        &mut feed,
        &w,
        Ok(Recovered::Events {
            events,
            current_id: 7,
        }),
        Duration::ZERO,
    );
    assert_eq!(blocks(&feed), [101, 102, 103, 105, 106, 107]);
    let s = feed.stats();
    assert_eq!((s.repairs_rebuild, s.wipes_id_gap), (1, 0));
}

#[test]
fn a_publisher_heard_from_again_is_rebuilt_at_once() {
    let (mut feed, w) = wiped_by_a_failed_recovery();
    for _ in 0..2 {
        feed.take_recoveries();
        timed_out(&mut feed, &w);
    }
    let waiting = feed.take_recoveries().remove(0);
    assert_eq!(waiting.delay, Duration::from_secs(4));
    // A gap while it waits: wiped (the index cannot vouch for it), and the same
    // request handed out again without its back-off (a driver replaces the waiting
    // one with it).
    feed.apply(&w, &[stored(8, 108, None)]);
    assert_eq!(blocks(&feed), [108]);
    assert_eq!(feed.stats().wipes_id_gap, 1);
    let now = feed.take_recoveries().remove(0);
    assert_eq!(
        (now.request, now.serial, now.delay, now.rebuild),
        (RecoveryRequest::Dump, waiting.serial, Duration::ZERO, true)
    );
    assert!(feed.take_recoveries().is_empty(), "handed out once");
    // Hurrying did not end the back-off: failing again waits longer.
    timed_out(&mut feed, &w);
    assert_eq!(feed.stats().rebuilds_failed, 3);
    assert_eq!(feed.take_recoveries()[0].delay, Duration::from_secs(8));
    // A reconnection while it waits hurries it too.
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    assert_eq!(feed.take_recoveries()[0].delay, Duration::ZERO);
    assert_eq!(feed.stats().rebuilding, 1);
}

#[test]
fn an_answer_that_would_be_the_same_again_is_not_asked_again_until_a_reconnection() {
    let (mut feed, w) = following(3);
    feed.apply(&w, &[stored(5, 105, None)]);
    feed.take_recoveries();
    let malformed = Err(RecoveryError::Malformed("unknown answer"));
    answer(&mut feed, &w, malformed, Duration::ZERO);
    let s = feed.stats();
    assert_eq!((s.wipes_recovery_failed, s.rebuilding), (1, 0));
    assert!(
        feed.take_recoveries().is_empty(),
        "no rebuild of a malformed answer"
    );
    assert_eq!(blocks(&feed), [105]);
    // Its next connection asks again.
    feed.notice(&Notice::Connected(std::sync::Arc::new(w.clone())));
    assert_eq!(feed.take_recoveries()[0].request, RecoveryRequest::Since(5));
}
