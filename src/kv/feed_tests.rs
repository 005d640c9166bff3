#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use super::*;
use crate::discovery::{Transport, WorkerIdentity};
use crate::kv::{BlockHash, KvEvent, KvEventData, StorageTier, StoredBlock, TokensHash};

fn instance(n: u64, worker: Option<u64>) -> Instance {
    let id = ChannelId::new("ns", "c", "t", n).unwrap();
    let i = Instance::new(id, Transport::zmq("tcp://127.0.0.1:1"), 1);
    match worker {
        Some(w) => i.with_worker(WorkerIdentity::new(w, 0)),
        None => i,
    }
}

fn stored(worker: u64, id: u64, hash: u64) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: BlockHash(hash),
                    tokens_hash: TokensHash(hash),
                }],
            },
        },
    }
}

#[test]
fn an_id_gap_wipes_what_the_publisher_fed_then_applies_the_event() {
    let mut feed = IndexFeed::default();
    let a = instance(1, Some(7));
    feed.apply(&a, &[stored(7, 1, 10), stored(7, 2, 11)]);
    assert_eq!(feed.index().stats().blocks, 2);
    feed.apply(&a, &[stored(7, 5, 12)]);
    assert_eq!(feed.index().stats().blocks, 1);
    let s = feed.stats();
    assert_eq!((s.wipes_id_gap, s.wiped_blocks), (1, 2));
    assert_eq!(
        feed.wiped(),
        [Wiped {
            publisher: a.id.clone(),
            cause: Wipe::IdGap {
                expected: 3,
                got: 5
            },
            blocks: 2
        }]
    );
}

#[test]
fn an_event_that_stores_nothing_takes_no_rank_over() {
    let mut feed = IndexFeed::default();
    let (owner, other) = (instance(1, None), instance(2, None));
    feed.apply(&owner, &[stored(7, 1, 10)]);
    // Another publisher's empty removal and refused store for the same rank.
    let empty = RouterEvent {
        event: KvEvent {
            data: KvEventData::Removed {
                block_hashes: vec![],
            },
            ..stored(7, 1, 0).event
        },
        ..stored(7, 1, 0)
    };
    let mut orphan = stored(7, 2, 11);
    if let KvEventData::Stored { parent_hash, .. } = &mut orphan.event.data {
        *parent_hash = Some(BlockHash(999));
    }
    feed.apply(&other, &[empty, orphan]);
    // The owner's departure still clears it.
    feed.notice(&Notice::Departed(owner.id.clone()));
    assert_eq!(feed.index().stats().blocks, 0);
}

#[test]
fn a_publisher_writes_only_its_own_workers_blocks() {
    let mut feed = IndexFeed::default();
    feed.apply(&instance(1, Some(7)), &[stored(8, 1, 10)]);
    assert_eq!(feed.index().stats().blocks, 0);
    assert_eq!(feed.stats().refused_events, 1);
    assert_eq!(feed.index().stats().refused_foreign, 1);
}

#[test]
fn a_new_publisher_for_a_rank_supersedes_the_old_one_whose_departure_keeps_it() {
    let mut feed = IndexFeed::default();
    let (old, new) = (instance(1, Some(7)), instance(2, Some(7)));
    let other = instance(3, Some(9));
    feed.apply(&old, &[stored(7, 1, 10)]);
    feed.apply(&other, &[stored(9, 1, 30)]);
    // A restarted relay for worker 7: what the old one fed (block 10, perhaps evicted
    // while it was away) is dropped before the newcomer's store.
    feed.apply(&new, &[stored(7, 1, 20)]);
    assert!(!feed.index().holds(WorkerId(7), 0, BlockHash(10)));
    assert_eq!(
        feed.wiped(),
        [Wiped {
            publisher: old.id.clone(),
            cause: Wipe::Superseded,
            blocks: 1
        }]
    );
    assert_eq!(feed.stats().wipes_superseded, 1);
    feed.notice(&Notice::Departed(old.id.clone()));
    // Worker 7's rank belongs to the new publisher: kept.
    assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 1);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(20)));
    feed.notice(&Notice::Departed(new.id.clone()));
    assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 0);
    feed.retain_publishers(|_| false);
    let s = feed.stats();
    assert_eq!((s.publishers, s.departed, s.index.blocks), (0, 3, 0));
}

/// Only a chain from the root that the newcomer may write takes a rank over: a
/// foreign worker's store, or a store under a parent, clears nothing; and the old
/// publisher's later events for the rank (its last live ones, or held ones drained
/// after a failed recovery) cannot take it back.
#[test]
fn a_takeover_needs_a_root_chain_the_newcomer_may_write_and_is_final() {
    let mut feed = IndexFeed::default();
    let (old, new) = (instance(1, Some(7)), instance(2, Some(7)));
    let foreign = instance(3, Some(9));
    feed.apply(&old, &[stored(7, 1, 10)]);
    // Worker 9's publisher naming worker 7: refused, and worker 7 keeps its block.
    feed.apply(&foreign, &[stored(7, 1, 30)]);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(10)));
    assert_eq!(feed.stats().wipes_superseded, 0);
    // The newcomer's store under the old one's block adds to it, no takeover.
    let mut child = stored(7, 1, 11);
    if let KvEventData::Stored { parent_hash, .. } = &mut child.event.data {
        *parent_hash = Some(BlockHash(10));
    }
    feed.apply(&new, &[child]);
    assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 2);
    assert_eq!(feed.stats().wipes_superseded, 0);
    // Its chain from the root does.
    feed.apply(&new, &[stored(7, 2, 20)]);
    assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 1);
    assert_eq!(feed.stats().wipes_superseded, 1);
    // The old publisher's late store and clear are dropped.
    let clear = RouterEvent {
        event: KvEvent {
            data: KvEventData::Cleared,
            ..stored(7, 3, 0).event
        },
        ..stored(7, 3, 0)
    };
    feed.apply(&old, &[stored(7, 2, 12), clear]);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(20)));
    assert!(!feed.index().holds(WorkerId(7), 0, BlockHash(12)));
    let s = feed.stats();
    assert_eq!((s.superseded_events, s.wipes_superseded), (2, 1));
    // Its departure leaves the newcomer's rank alone.
    feed.notice(&Notice::Departed(old.id.clone()));
    assert_eq!(feed.index().rank_blocks(WorkerId(7), 0), 1);
}

/// A host-tier chain or a chain for a rank the newcomer's identity does not name
/// takes nothing over; supersession lasts while the newcomer owns the rank, and ends
/// when the old publisher connects again.
#[test]
fn a_takeover_is_by_a_device_chain_for_the_publishers_own_rank_and_not_for_good() {
    let mut feed = IndexFeed::default();
    let (old, new) = (instance(1, Some(7)), instance(2, Some(7)));
    feed.apply(&old, &[stored(7, 1, 10)]);
    let mut host = stored(7, 1, 40);
    host.tier = StorageTier::HostPinned;
    feed.apply(&new, &[host]);
    // The newcomer is rank 1 of worker 7: its chain for rank 0 adds, no takeover.
    let rank1 = Instance {
        worker: Some(WorkerIdentity::new(7, 1)),
        ..new.clone()
    };
    feed.apply(&rank1, &[stored(7, 2, 41)]);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(10)));
    assert_eq!(feed.stats().wipes_superseded, 0);
    // As rank 0 it takes over; when it departs, the old publisher is heard again.
    feed.apply(&new, &[stored(7, 3, 20)]);
    assert_eq!(feed.stats().wipes_superseded, 1);
    feed.apply(&old, &[stored(7, 2, 11)]);
    assert_eq!(feed.stats().superseded_events, 1);
    feed.notice(&Notice::Departed(new.id.clone()));
    feed.apply(&old, &[stored(7, 3, 12)]);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(12)));
    // Superseded again, then it connects again: heard.
    let newer = instance(3, Some(7));
    feed.apply(&newer, &[stored(7, 1, 30)]);
    feed.apply(&old, &[stored(7, 4, 13)]);
    assert_eq!(feed.stats().superseded_events, 2);
    feed.notice(&Notice::Connected(std::sync::Arc::new(old.clone())));
    feed.apply(&old, &[stored(7, 1, 14)]);
    assert!(feed.index().holds(WorkerId(7), 0, BlockHash(14)));
    assert_eq!(feed.stats().superseded_events, 2);
}

#[test]
fn a_reconnection_wipes_and_restarts_the_id_check() {
    let mut feed = IndexFeed::default();
    let a = instance(1, None);
    feed.notice(&Notice::Connected(std::sync::Arc::new(a.clone())));
    feed.apply(&a, &[stored(7, 1, 10)]);
    feed.notice(&Notice::Connected(std::sync::Arc::new(a.clone())));
    assert_eq!(feed.index().stats().blocks, 0);
    // The next event is taken whatever its id.
    feed.apply(&a, &[stored(7, 9, 11)]);
    let s = feed.stats();
    assert_eq!(
        (s.wipes_reconnect, s.wipes_id_gap, s.index.blocks),
        (1, 0, 1)
    );
}

#[test]
fn a_publisher_without_identity_feeds_a_bounded_number_of_ranks() {
    let mut feed = IndexFeed::default();
    let a = instance(1, None);
    let events: Vec<RouterEvent> = (0..100).map(|w| stored(w, w + 1, w)).collect();
    feed.apply(&a, &events);
    let s = feed.stats();
    assert_eq!(s.index.ranks, MAX_RANKS_PER_PUBLISHER as u64);
    assert_eq!(s.refused_rank_events, 100 - MAX_RANKS_PER_PUBLISHER as u64);
}
