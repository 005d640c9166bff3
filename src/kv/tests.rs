use super::*;

/// Router events of every tier and kind, with integers of every msgpack width.
pub(crate) fn every_tier_and_kind() -> Vec<RouterEvent> {
    let mut events = Vec::new();
    for (i, tier) in [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
    ]
    .into_iter()
    .enumerate()
    {
        let big = u64::MAX - i as u64;
        for data in [
            KvEventData::Stored {
                parent_hash: Some(BlockHash(big)),
                blocks: (0..20)
                    .map(|b| StoredBlock {
                        block_hash: BlockHash(b << (3 * i)),
                        tokens_hash: TokensHash(big >> b),
                    })
                    .collect(),
            },
            KvEventData::Stored {
                parent_hash: None,
                blocks: vec![],
            },
            KvEventData::Removed {
                block_hashes: (0..300).map(|h| BlockHash(h * 1000)).collect(),
            },
            KvEventData::Cleared,
        ] {
            events.push(RouterEvent {
                worker_id: WorkerId(big >> (16 * i)),
                tier,
                event: KvEvent {
                    id: 1 << (20 * i),
                    dp_rank: u32::MAX >> (8 * i),
                    data,
                },
            });
        }
    }
    events
}

fn at(worker: u64, rank: u32, tier: StorageTier) -> Placement {
    Placement {
        worker_id: WorkerId(worker),
        dp_rank: rank,
        tier,
    }
}

const A: Placement = Placement {
    worker_id: WorkerId(1),
    dp_rank: 0,
    tier: StorageTier::Device,
};

fn stored(parent: Option<u64>, hashes: &[u64]) -> KvEventData {
    KvEventData::Stored {
        parent_hash: parent.map(BlockHash),
        blocks: hashes
            .iter()
            .map(|&h| StoredBlock {
                block_hash: BlockHash(h),
                tokens_hash: TokensHash(h * 10),
            })
            .collect(),
    }
}

fn removed(hashes: &[u64]) -> KvEventData {
    KvEventData::Removed {
        block_hashes: hashes.iter().copied().map(BlockHash).collect(),
    }
}

/// Runs the coalescer over `input`, flushing at the end.
fn coalesce(max: usize, input: Vec<(Placement, KvEventData)>) -> Vec<(Placement, KvEventData)> {
    let mut c = Coalescer::new(max).unwrap();
    let mut out = Vec::new();
    for (p, d) in input {
        c.push(p, d, &mut |p, d| out.push((p, d)));
    }
    c.flush(&mut |p, d| out.push((p, d)));
    out
}

#[test]
fn coalesce_same_placement_and_kind_only() {
    let out = coalesce(
        128,
        vec![
            (A, stored(None, &[1])),
            (A, removed(&[9])),
            (A, removed(&[8])),
            (at(1, 1, StorageTier::Device), removed(&[7])),
            (at(2, 1, StorageTier::Device), removed(&[6])),
            (at(2, 1, StorageTier::Disk), removed(&[5])),
        ],
    );
    assert_eq!(
        out,
        vec![
            (A, stored(None, &[1])),
            (A, removed(&[9, 8])),
            (at(1, 1, StorageTier::Device), removed(&[7])),
            (at(2, 1, StorageTier::Device), removed(&[6])),
            (at(2, 1, StorageTier::Disk), removed(&[5])),
        ]
    );
}

#[test]
fn stores_merge_only_when_the_chain_extends_keeping_the_first_parent() {
    let out = coalesce(
        128,
        vec![
            (A, stored(Some(100), &[1, 2])),
            (A, stored(Some(2), &[3])),
            (A, stored(Some(3), &[4, 5])),
            // Broken chain: parent is not the last pending block.
            (A, stored(Some(4), &[6])),
            // No parent: a new chain.
            (A, stored(None, &[7])),
        ],
    );
    assert_eq!(
        out,
        vec![
            (A, stored(Some(100), &[1, 2, 3, 4, 5])),
            (A, stored(Some(4), &[6])),
            (A, stored(None, &[7])),
        ]
    );
}

#[test]
fn cleared_flushes_then_passes_alone() {
    let out = coalesce(
        128,
        vec![
            (A, removed(&[1])),
            (A, KvEventData::Cleared),
            (A, KvEventData::Cleared),
            (A, removed(&[2])),
        ],
    );
    assert_eq!(
        out,
        vec![
            (A, removed(&[1])),
            (A, KvEventData::Cleared),
            (A, KvEventData::Cleared),
            (A, removed(&[2])),
        ]
    );
}

#[test]
fn cap_flushes_at_once_and_big_events_bypass() {
    let mut c = Coalescer::new(4).unwrap();
    let mut out = Vec::new();
    c.push(A, removed(&[1, 2]), &mut |p, d| out.push((p, d)));
    assert!(out.is_empty());
    // Reaching the cap emits at once, without a flush.
    c.push(A, removed(&[3, 4]), &mut |p, d| out.push((p, d)));
    assert_eq!(out, vec![(A, removed(&[1, 2, 3, 4]))]);
    assert!(!c.has_pending());
    // A merge that would exceed the cap emits the pending event first.
    c.push(A, removed(&[5, 6, 7]), &mut |p, d| out.push((p, d)));
    c.push(A, removed(&[8, 9]), &mut |p, d| out.push((p, d)));
    assert_eq!(out.last(), Some(&(A, removed(&[5, 6, 7]))));
    // An event alone over the cap bypasses pending, after flushing it.
    c.push(A, removed(&[10, 11, 12, 13, 14]), &mut |p, d| {
        out.push((p, d))
    });
    assert_eq!(
        out[2..],
        [(A, removed(&[8, 9])), (A, removed(&[10, 11, 12, 13, 14]))]
    );
    assert!(!c.has_pending());
}

#[test]
fn dedup_two_stores_then_removes() {
    let mut p = Pipeline::default();
    let mut out = Vec::new();
    let ev = |data| PlacementEvent {
        placement: A,
        event: KvEvent {
            id: 0,
            dp_rank: 0,
            data,
        },
    };
    p.push(ev(stored(None, &[1, 2, 3])), &mut out);
    p.flush(&mut out);
    p.push(ev(stored(None, &[1, 2, 3])), &mut out);
    p.flush(&mut out);
    assert_eq!(out.len(), 2);
    // First removal: everything still stored once more → nothing, and no id consumed.
    p.push(ev(removed(&[1, 2, 3])), &mut out);
    p.flush(&mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(p.next_id(), 3);
    // Second removal: all three pass, with the next dense id.
    p.push(ev(removed(&[1, 2, 3])), &mut out);
    p.flush(&mut out);
    assert_eq!(out.len(), 3);
    assert_eq!(out[2].event.data, removed(&[1, 2, 3]));
    assert_eq!(
        out.iter().map(|e| e.event.id).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
}

#[test]
fn dedup_counts_per_hash_including_repeats_within_an_event() {
    let mut d = DedupFilter::new(DedupMode::RefCounted);
    // Counts {1:2, 2:1, 3:2}; the repeat inside one event counts too.
    d.filter(&A, stored(None, &[1, 3, 1]));
    d.filter(&A, stored(None, &[2, 3]));
    assert_eq!(d.filter(&A, removed(&[1, 2, 3])), Some(removed(&[2])));
    assert_eq!(d.filter(&A, removed(&[1, 3])), Some(removed(&[1, 3])));
    assert_eq!(d.tracked(), 0);
}

#[test]
fn dedup_is_per_rank_and_tier() {
    let mut d = DedupFilter::new(DedupMode::RefCounted);
    let rank1 = at(1, 1, StorageTier::Device);
    let disk = at(1, 0, StorageTier::Disk);
    d.filter(&A, stored(None, &[1]));
    d.filter(&A, stored(None, &[1]));
    d.filter(&rank1, stored(None, &[1]));
    d.filter(&disk, stored(None, &[1]));
    assert_eq!(d.filter(&rank1, removed(&[1])), Some(removed(&[1])));
    assert_eq!(d.filter(&disk, removed(&[1])), Some(removed(&[1])));
    assert_eq!(d.filter(&A, removed(&[1])), None);
}

#[test]
fn cleared_forgets_every_tier_of_its_rank_only() {
    let mut d = DedupFilter::new(DedupMode::RefCounted);
    let rank1 = at(1, 1, StorageTier::Device);
    let host = at(1, 0, StorageTier::HostPinned);
    for p in [&A, &A, &rank1, &rank1, &host, &host] {
        d.filter(p, stored(None, &[5]));
    }
    assert_eq!(d.tracked(), 3);
    assert_eq!(
        d.filter(&A, KvEventData::Cleared),
        Some(KvEventData::Cleared)
    );
    assert_eq!(d.tracked(), 1);
    // Rank 0 forgot, in every tier: the removals pass as untracked.
    assert_eq!(d.filter(&A, removed(&[5])), Some(removed(&[5])));
    assert_eq!(d.filter(&host, removed(&[5])), Some(removed(&[5])));
    // Rank 1 still counts 2.
    assert_eq!(d.filter(&rank1, removed(&[5])), None);
    assert_eq!(d.filter(&rank1, removed(&[5])), Some(removed(&[5])));
}

#[test]
fn store_remove_store_starts_fresh_and_untracked_removes_pass() {
    let mut d = DedupFilter::new(DedupMode::RefCounted);
    d.filter(&A, stored(None, &[1]));
    assert_eq!(d.filter(&A, removed(&[1])), Some(removed(&[1])));
    d.filter(&A, stored(None, &[1]));
    assert_eq!(d.filter(&A, removed(&[1])), Some(removed(&[1])));
    assert_eq!(d.filter(&A, removed(&[42])), Some(removed(&[42])));
}

#[test]
fn set_like_bypasses() {
    let mut d = DedupFilter::new(DedupMode::SetLike);
    d.filter(&A, stored(None, &[1]));
    d.filter(&A, stored(None, &[1]));
    assert_eq!(d.filter(&A, removed(&[1])), Some(removed(&[1])));
    assert_eq!(d.tracked(), 0);
}

#[test]
fn ids_are_dense_from_one_across_kinds() {
    let mut p = Pipeline::new(128, DedupMode::RefCounted).unwrap();
    let mut out = Vec::new();
    let events = [
        stored(None, &[1]),
        removed(&[99]),
        KvEventData::Cleared,
        stored(None, &[2]),
        stored(None, &[2]),
        removed(&[2]), // filtered: 2 is stored twice
        removed(&[3]),
    ];
    for (i, data) in events.into_iter().enumerate() {
        p.push(
            PlacementEvent {
                placement: A,
                event: KvEvent {
                    id: 1000 + i as u64 * 7,
                    dp_rank: 0,
                    data,
                },
            },
            &mut out,
        );
        p.flush(&mut out);
    }
    let ids: Vec<u64> = out.iter().map(|e| e.event.id).collect();
    assert_eq!(ids, (1..=ids.len() as u64).collect::<Vec<_>>());
    assert_eq!(ids.len(), 6);
}
