#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::{HashMap, HashSet};

use super::*;
use crate::kv::KvEvent;

fn t(x: u64) -> TokensHash {
    TokensHash(x)
}

fn ev(worker: u64, rank: DpRank, data: KvEventData) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id: 1,
            dp_rank: rank,
            data,
        },
    }
}

/// A chain of blocks `(block hash, tokens hash)` under `parent`.
fn stored(worker: u64, rank: DpRank, parent: Option<u64>, blocks: &[(u64, u64)]) -> RouterEvent {
    ev(
        worker,
        rank,
        KvEventData::Stored {
            parent_hash: parent.map(BlockHash),
            blocks: blocks
                .iter()
                .map(|&(b, tk)| StoredBlock {
                    block_hash: BlockHash(b),
                    tokens_hash: t(tk),
                })
                .collect(),
        },
    )
}

fn removed(worker: u64, rank: DpRank, hashes: &[u64]) -> RouterEvent {
    ev(
        worker,
        rank,
        KvEventData::Removed {
            block_hashes: hashes.iter().map(|&h| BlockHash(h)).collect(),
        },
    )
}

fn scores(index: &RouterIndex, seq: &[u64]) -> Vec<(u64, DpRank, u32)> {
    let seq: Vec<TokensHash> = seq.iter().map(|&x| t(x)).collect();
    index
        .find_matches(&seq)
        .iter()
        .map(|s| (s.worker_id.0, s.dp_rank, s.blocks))
        .collect()
}

fn apply(index: &mut RouterIndex, e: &RouterEvent) -> Result<(), IndexRefusal> {
    index.apply(Some(e.worker_id), e)
}

#[test]
fn scores_count_leading_blocks_per_worker_and_rank() {
    let mut index = RouterIndex::default();
    // Two workers with their own block hashes for the same tokens share positions.
    apply(
        &mut index,
        &stored(1, 0, None, &[(11, 1), (12, 2), (13, 3)]),
    )
    .unwrap();
    apply(&mut index, &stored(2, 1, None, &[(21, 1), (22, 2)])).unwrap();
    apply(&mut index, &stored(2, 1, Some(22), &[(24, 4)])).unwrap();
    assert_eq!(scores(&index, &[1, 2, 3]), vec![(1, 0, 3), (2, 1, 2)]);
    assert_eq!(scores(&index, &[1, 2, 4, 9]), vec![(1, 0, 2), (2, 1, 3)]);
    assert_eq!(scores(&index, &[2, 3]), vec![]);
    assert_eq!(scores(&index, &[]), vec![]);
    let s = index.find_matches(&[t(1), t(2), t(3)]);
    assert_eq!(s.get(WorkerId(1), 0), 3);
    assert_eq!(s.get(WorkerId(1), 1), 0);
    assert_eq!(s.best().map(|b| b.worker_id), Some(WorkerId(1)));
    assert_eq!(index.stats().nodes, 4);
    assert_eq!(index.stats().blocks, 6);
}

#[test]
fn a_missing_leading_block_ends_the_score_there() {
    let mut index = RouterIndex::default();
    apply(
        &mut index,
        &stored(1, 0, None, &[(11, 1), (12, 2), (13, 3)]),
    )
    .unwrap();
    apply(
        &mut index,
        &stored(2, 0, None, &[(21, 1), (22, 2), (23, 3)]),
    )
    .unwrap();
    // Worker 1 evicts its first block, worker 2 its middle one.
    apply(&mut index, &removed(1, 0, &[11])).unwrap();
    apply(&mut index, &removed(2, 0, &[22])).unwrap();
    assert_eq!(scores(&index, &[1, 2, 3]), vec![(2, 0, 1)]);
    // Stored again, the evicted block restores the prefix behind it.
    apply(&mut index, &stored(2, 0, Some(21), &[(22, 2)])).unwrap();
    assert_eq!(scores(&index, &[1, 2, 3]), vec![(2, 0, 3)]);
}

#[test]
fn an_unknown_parent_refuses_the_whole_event() {
    let mut index = RouterIndex::default();
    apply(&mut index, &stored(1, 0, None, &[(11, 1)])).unwrap();
    // Unknown anywhere, and known only to another rank of the same worker.
    assert_eq!(
        apply(&mut index, &stored(1, 0, Some(99), &[(12, 2)])),
        Err(IndexRefusal::UnknownParent)
    );
    assert_eq!(
        apply(&mut index, &stored(1, 1, Some(11), &[(12, 2)])),
        Err(IndexRefusal::UnknownParent)
    );
    // Even with no blocks (Dynamo refuses it too).
    assert_eq!(
        apply(&mut index, &stored(1, 0, Some(99), &[])),
        Err(IndexRefusal::UnknownParent)
    );
    assert_eq!(index.stats().refused_unknown_parent, 3);
    assert_eq!(index.stats().blocks, 1);
    assert_eq!(index.ranks().collect::<Vec<_>>(), vec![(WorkerId(1), 0)]);
}

#[test]
fn a_chain_that_repeats_a_hash_is_refused_before_anything_is_applied() {
    let mut index = RouterIndex::default();
    apply(&mut index, &stored(1, 0, None, &[(11, 1)])).unwrap();
    let before = index.stats();
    for e in [
        stored(1, 0, None, &[(12, 2), (13, 3), (12, 4)]),
        stored(1, 0, Some(11), &[(12, 2), (11, 3)]),
        stored(1, 0, Some(11), &[(11, 2)]),
    ] {
        assert_eq!(apply(&mut index, &e), Err(IndexRefusal::InvalidChain));
    }
    let after = index.stats();
    assert_eq!(after.refused_invalid_chain, 3);
    assert_eq!((after.blocks, after.nodes), (before.blocks, before.nodes));
}

#[test]
fn empty_events_and_unknown_removes_create_nothing() {
    let mut index = RouterIndex::default();
    let empty = index.bytes();
    apply(&mut index, &stored(1, 0, None, &[])).unwrap();
    let many: Vec<u64> = (0..100_000).collect();
    apply(&mut index, &removed(1, 0, &many)).unwrap();
    apply(&mut index, &ev(1, 0, KvEventData::Cleared)).unwrap();
    assert_eq!(index.stats().ranks, 0);
    assert_eq!(index.stats().unknown_removed_blocks, 100_000);
    assert_eq!(index.bytes(), empty);
}

#[test]
fn clear_and_worker_removal_free_every_node_they_held() {
    let mut index = RouterIndex::default();
    for w in 0..4 {
        for r in 0..2 {
            let chain: Vec<(u64, u64)> = (0..50).map(|i| (w * 1000 + r * 100 + i, i)).collect();
            apply(&mut index, &stored(w, r as DpRank, None, &chain)).unwrap();
            // A branch of its own.
            let branch: Vec<(u64, u64)> = (0..10)
                .map(|i| (w * 1000 + r * 100 + 50 + i, 1000 * (w + 1) + i))
                .collect();
            apply(
                &mut index,
                &stored(w, r as DpRank, Some(w * 1000 + r * 100 + 9), &branch),
            )
            .unwrap();
        }
    }
    assert_eq!(index.stats().blocks, 8 * 60);
    assert_eq!(index.stats().nodes, 50 + 4 * 10);
    apply(&mut index, &ev(0, 1, KvEventData::Cleared)).unwrap();
    assert_eq!(index.rank_blocks(WorkerId(0), 1), 0);
    assert_eq!(index.rank_blocks(WorkerId(0), 0), 60);
    index.remove_worker(WorkerId(0));
    index.remove_worker(WorkerId(1));
    assert_eq!(index.stats().nodes, 50 + 2 * 10);
    assert_eq!(
        index.ranks().map(|(w, _)| w.0).collect::<HashSet<_>>(),
        HashSet::from([2, 3])
    );
    index.remove_worker(WorkerId(2));
    index.remove_worker(WorkerId(3));
    let s = index.stats();
    assert_eq!((s.blocks, s.nodes, s.ranks), (0, 0, 0));
    assert_eq!(scores(&index, &[0, 1, 2]), vec![]);
}

#[test]
fn caps_keep_the_leading_blocks_that_fit_and_count_the_rest() {
    let mut index = RouterIndex::new(
        RouterIndexConfig::default()
            .max_blocks_per_rank(5)
            .max_blocks(8),
    );
    let chain: Vec<(u64, u64)> = (0..7).map(|i| (100 + i, i)).collect();
    assert_eq!(
        apply(&mut index, &stored(1, 0, None, &chain)),
        Err(IndexRefusal::RankFull { refused: 2 })
    );
    assert_eq!(scores(&index, &[0, 1, 2, 3, 4, 5, 6]), vec![(1, 0, 5)]);
    let chain: Vec<(u64, u64)> = (0..5).map(|i| (200 + i, i)).collect();
    assert_eq!(
        apply(&mut index, &stored(2, 0, None, &chain)),
        Err(IndexRefusal::IndexFull { refused: 2 })
    );
    let s = index.stats();
    assert_eq!(
        (
            s.blocks,
            s.refused_rank_full_blocks,
            s.refused_index_full_blocks
        ),
        (8, 2, 2)
    );
    // Room again once a worker leaves.
    index.remove_worker(WorkerId(1));
    apply(&mut index, &stored(2, 0, Some(202), &[(203, 3), (204, 4)])).unwrap();
    assert_eq!(scores(&index, &[0, 1, 2, 3, 4]), vec![(2, 0, 5)]);
}

#[test]
fn a_worker_with_many_ranks_cannot_take_the_whole_index() {
    let mut index = RouterIndex::new(
        RouterIndexConfig::default()
            .max_blocks_per_rank(4)
            .max_blocks_per_worker(6),
    );
    let chain: Vec<(u64, u64)> = (0..4).map(|i| (100 + i, i)).collect();
    apply(&mut index, &stored(1, 0, None, &chain)).unwrap();
    let chain: Vec<(u64, u64)> = (0..4).map(|i| (200 + i, i)).collect();
    assert_eq!(
        apply(&mut index, &stored(1, 1, None, &chain)),
        Err(IndexRefusal::WorkerFull { refused: 2 })
    );
    assert_eq!(
        apply(&mut index, &stored(1, 2, None, &[(300, 0)])),
        Err(IndexRefusal::WorkerFull { refused: 1 })
    );
    // Another worker still has room; the first gets room back as it lets go.
    apply(&mut index, &stored(2, 0, None, &[(400, 0)])).unwrap();
    apply(&mut index, &removed(1, 0, &[103, 102])).unwrap();
    apply(&mut index, &stored(1, 2, None, &[(300, 0), (301, 1)])).unwrap();
    index.clear_rank(WorkerId(1), 1);
    apply(&mut index, &stored(1, 3, None, &[(500, 0), (501, 1)])).unwrap();
    let s = index.stats();
    assert_eq!((s.blocks, s.refused_worker_full_blocks), (7, 3));
    assert_eq!(
        scores(&index, &[0, 1, 2]),
        vec![(1, 0, 2), (1, 2, 2), (1, 3, 2), (2, 0, 1)]
    );
}

#[test]
fn the_byte_cap_holds_whatever_the_workers_send() {
    let cap = 256 << 10;
    let mut index = RouterIndex::new(RouterIndexConfig::default().max_bytes(cap));
    let mut refused = 0;
    for w in 0..64u64 {
        let chain: Vec<(u64, u64)> = (0..2000).map(|i| (i, w << 32 | i)).collect();
        if apply(&mut index, &stored(w, 0, None, &chain)).is_err() {
            refused += 1;
        }
        assert!(index.bytes() <= cap, "{} > {cap}", index.bytes());
    }
    assert!(refused > 0);
    assert!(index.stats().refused_index_full_blocks > 0);
    assert_eq!(index.stats().bytes, index.bytes() as u64);
}

#[test]
fn moved_blocks_stay_under_the_byte_cap_and_their_room_comes_back() {
    // Two blocks moved under each other in turn: each move leaves its old position
    // in place (a block below it is still held) and makes a new one.
    let cap = 64 << 10;
    let mut index = RouterIndex::new(RouterIndexConfig::default().max_bytes(cap));
    apply(&mut index, &stored(1, 0, None, &[(1, 1), (2, 2)])).unwrap();
    let mut refused = 0;
    for k in 0..20_000u64 {
        let (parent, moved) = if k % 2 == 0 { (2, 1) } else { (1, 2) };
        if apply(&mut index, &stored(1, 0, Some(parent), &[(moved, 10 + k)])).is_err() {
            refused += 1;
        }
        assert!(index.bytes() <= cap, "{} > {cap} at {k}", index.bytes());
    }
    assert!(refused > 0);
    assert_eq!(index.stats().blocks, 2);
    // Once that worker is gone, the room is everyone's again.
    index.remove_worker(WorkerId(1));
    apply(&mut index, &stored(2, 0, None, &[(5, 5), (6, 6)])).unwrap();
    assert_eq!(scores(&index, &[5, 6]), vec![(2, 0, 2)]);
}

#[test]
fn sparse_tables_are_compacted_and_stay_right() {
    let mut index = RouterIndex::default();
    // 80,000 positions in chains of 100 from the root, shared by a second rank
    // for the first half; then all but every tenth chain evicted.
    for c in 0..800u64 {
        let chain: Vec<(u64, u64)> = (0..100).map(|i| (c * 1000 + i + 1, c * 1000 + i)).collect();
        apply(&mut index, &stored(1, 0, None, &chain)).unwrap();
        if c < 400 {
            let chain: Vec<(u64, u64)> = (0..50)
                .map(|i| ((c * 1000 + i + 1) << 20, c * 1000 + i))
                .collect();
            apply(&mut index, &stored(2, 0, None, &chain)).unwrap();
        }
    }
    let full = index.bytes();
    for c in (0..800u64).filter(|c| c % 10 != 0) {
        let tail: Vec<u64> = (0..100).rev().map(|i| c * 1000 + i + 1).collect();
        apply(&mut index, &removed(1, 0, &tail)).unwrap();
    }
    index.clear_rank(WorkerId(2), 0);
    index.tree.check();
    let s = index.stats();
    assert_eq!((s.blocks, s.nodes), (8_000, 8_000));
    assert!(index.bytes() < full / 4, "{} of {full}", index.bytes());
    for c in (0..800u64).filter(|c| c % 10 == 0) {
        let seq: Vec<u64> = (0..100).map(|i| c * 1000 + i).collect();
        assert_eq!(scores(&index, &seq), vec![(1, 0, 100)]);
        assert!(index.holds(WorkerId(1), 0, BlockHash(c * 1000 + 100)));
    }
    // Storing under, and evicting, renumbered positions works as before.
    let last = 790 * 1000;
    apply(&mut index, &stored(1, 0, Some(last + 100), &[(1 << 40, 7)])).unwrap();
    let mut seq: Vec<u64> = (0..100).map(|i| last + i).collect();
    seq.push(7);
    assert_eq!(scores(&index, &seq), vec![(1, 0, 101)]);
    let tail: Vec<u64> = (50..100).rev().map(|i| last + i + 1).collect();
    apply(&mut index, &removed(1, 0, &tail)).unwrap();
    index.tree.check();
    assert_eq!(index.stats().blocks, 7_951);
    assert_eq!(scores(&index, &seq), vec![(1, 0, 50)]);
}

#[test]
fn the_byte_count_does_not_drift_with_churn() {
    let mut index = RouterIndex::default();
    let mut next = 0u64;
    let mut held: Vec<u64> = Vec::new();
    let mut after_round = Vec::new();
    for _ in 0..60 {
        // Fill a rank to ~900 blocks (chains of 10 from the root), evict 800.
        while held.len() < 900 {
            let chain: Vec<(u64, u64)> = (0..10).map(|i| (next + i, next + i)).collect();
            apply(&mut index, &stored(1, 0, None, &chain)).unwrap();
            held.extend(chain.iter().map(|c| c.0));
            next += 10;
        }
        let gone: Vec<u64> = held.drain(..800).collect();
        apply(&mut index, &removed(1, 0, &gone)).unwrap();
        after_round.push(index.bytes());
    }
    // Settled: the same churn costs the same bytes, round after round.
    let settled = after_round[10];
    assert!(
        after_round[10..].iter().all(|&b| b <= settled * 5 / 4),
        "{after_round:?}"
    );
    assert_eq!(index.stats().blocks, 100);
}

#[test]
fn events_are_indexed_only_under_their_publishers_identity() {
    let mut index = RouterIndex::default();
    let e = stored(8, 0, None, &[(1, 1)]);
    assert_eq!(
        index.apply(Some(WorkerId(7)), &e),
        Err(IndexRefusal::ForeignWorker {
            named: WorkerId(8),
            sender: WorkerId(7)
        })
    );
    // A publisher with no known identity: indexed by default, refused when strict.
    index.apply(None, &e).unwrap();
    let mut strict =
        RouterIndex::new(RouterIndexConfig::default().attribution(Attribution::Strict));
    assert_eq!(strict.apply(None, &e), Err(IndexRefusal::Unidentified));
    // A foreign Cleared cannot wipe another worker either.
    let clear = ev(8, 0, KvEventData::Cleared);
    assert!(index.apply(Some(WorkerId(7)), &clear).is_err());
    assert_eq!(scores(&index, &[1]), vec![(8, 0, 1)]);
    assert_eq!(index.stats().refused_foreign, 2);
    assert_eq!(strict.stats().refused_unidentified, 1);
}

#[test]
fn other_tiers_are_counted_and_left_out_but_cleared_covers_them() {
    let mut index = RouterIndex::default();
    let mut host = stored(1, 0, None, &[(1, 1)]);
    host.tier = StorageTier::HostPinned;
    apply(&mut index, &host).unwrap();
    assert_eq!(index.stats().other_tier_events, 1);
    assert_eq!(scores(&index, &[1]), vec![]);
    apply(&mut index, &stored(1, 0, None, &[(1, 1)])).unwrap();
    let mut clear = ev(1, 0, KvEventData::Cleared);
    clear.tier = StorageTier::Disk;
    apply(&mut index, &clear).unwrap();
    assert_eq!(scores(&index, &[1]), vec![]);
}

#[test]
fn duplicate_moved_and_conflicting_blocks() {
    let mut index = RouterIndex::default();
    apply(&mut index, &stored(1, 0, None, &[(11, 1), (12, 2)])).unwrap();
    // The same chain again: nothing changes.
    apply(&mut index, &stored(1, 0, None, &[(11, 1), (12, 2)])).unwrap();
    assert_eq!(index.stats().duplicate_blocks, 2);
    assert_eq!(index.stats().blocks, 2);
    // Another hash for a position the rank holds: refused, the chain goes on from it.
    apply(&mut index, &stored(1, 0, None, &[(31, 1), (33, 3)])).unwrap();
    assert_eq!(index.stats().conflicting_blocks, 1);
    assert_eq!(scores(&index, &[1, 3]), vec![(1, 0, 2)]);
    // Block 12 stored again elsewhere moves there.
    apply(&mut index, &stored(1, 0, Some(33), &[(12, 2)])).unwrap();
    assert_eq!(scores(&index, &[1, 2]), vec![(1, 0, 1)]);
    assert_eq!(scores(&index, &[1, 3, 2]), vec![(1, 0, 3)]);
    apply(&mut index, &removed(1, 0, &[12, 33, 11])).unwrap();
    let s = index.stats();
    assert_eq!((s.blocks, s.nodes, s.ranks), (0, 0, 0));
}

/// The index against a plain model: each rank's blocks by hash, each block's
/// position as its full path of tokens hashes. Short chains over a tiny alphabet
/// (positions shared and split all the time).
#[test]
fn random_streams_match_a_plain_model() {
    model_run(0x9e37_79b9_7f4a_7c15, 20_000, 5, 3, 7);
}

/// The same with chains longer than a run holds, over a larger alphabet: runs split,
/// merge back and chain across their length cap.
#[test]
fn long_chains_match_a_plain_model() {
    model_run(
        0x2545_f491_4f6c_dd1d,
        3_000,
        3 * tree::MAX_RUN as u64,
        2,
        400,
    );
}

/// A path of tokens hashes, as a hash of it (`root()`, then `child(path, tokens)`).
fn child(path: u64, tokens: u64) -> u64 {
    let mut x = path.rotate_left(17) ^ tokens.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)).max(1)
}

/// One rank of the model: its blocks' paths by hash, and the hash at each path.
#[derive(Default)]
struct RankModel {
    by_hash: HashMap<u64, u64>,
    by_path: HashMap<u64, u64>,
    /// The last chain stored (to evict slices of, as engines do).
    last: Vec<u64>,
}

impl RankModel {
    fn insert(&mut self, hash: u64, path: u64) {
        if let Some(old) = self.by_hash.insert(hash, path) {
            self.by_path.remove(&old);
        }
        self.by_path.insert(path, hash);
    }

    fn remove(&mut self, hash: u64) {
        if let Some(path) = self.by_hash.remove(&hash) {
            self.by_path.remove(&path);
        }
    }
}

fn model_run(seed: u64, steps: usize, max_chain: u64, alphabet: u64, max_query: u64) {
    const ROOT_PATH: u64 = 0;
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut index = RouterIndex::default();
    let mut model: HashMap<(u64, DpRank), RankModel> = HashMap::new();
    // Every path ever made: its parent path and last tokens hash (to spell queries).
    let mut spelled: HashMap<u64, (u64, u64)> = HashMap::new();
    let spell = |spelled: &HashMap<u64, (u64, u64)>, mut path: u64| {
        let mut tokens = Vec::new();
        while let Some(&(parent, t)) = spelled.get(&path) {
            tokens.push(t);
            path = parent;
        }
        tokens.reverse();
        tokens
    };
    let mut next_hash = 1u64;
    for step in 0..steps {
        let worker = next() % 6;
        let rank = (next() % 2) as DpRank;
        let held = model.entry((worker, rank)).or_default();
        match next() % 10 {
            0..=5 => {
                // Store a chain under a random held block (or the root), tokens from
                // a small alphabet so workers share positions.
                let parent = if held.by_hash.is_empty() || next() % 3 == 0 {
                    None
                } else {
                    let keys: Vec<u64> = held.by_hash.keys().copied().collect();
                    Some(keys[(next() as usize) % keys.len()])
                };
                let n = 1 + next() % max_chain;
                let mut blocks = Vec::new();
                for _ in 0..n {
                    let tokens = next() % alphabet;
                    let hash = if next() % 4 == 0 && !held.by_hash.is_empty() {
                        // Sometimes a hash the rank holds already (a duplicate or a move).
                        let keys: Vec<u64> = held.by_hash.keys().copied().collect();
                        keys[(next() as usize) % keys.len()]
                    } else {
                        next_hash += 1;
                        next_hash
                    };
                    blocks.push((hash, tokens));
                }
                let e = stored(worker, rank, parent, &blocks);
                let result = apply(&mut index, &e);
                held.last = blocks.iter().map(|b| b.0).collect();
                let mut hashes: HashSet<u64> = blocks.iter().map(|b| b.0).collect();
                let repeats =
                    hashes.len() < blocks.len() || parent.is_some_and(|p| !hashes.insert(p));
                if repeats {
                    assert_eq!(result, Err(IndexRefusal::InvalidChain), "step {step}");
                    continue;
                }
                let mut path = parent.map_or(ROOT_PATH, |p| held.by_hash[&p]);
                let mut refused = false;
                for &(hash, tokens) in &blocks {
                    let parent_path = path;
                    path = child(path, tokens);
                    spelled.insert(path, (parent_path, tokens));
                    // Held already, or held under another hash: the first stays.
                    if held.by_path.contains_key(&path) {
                        continue;
                    }
                    // Moving the block the chain hangs under is refused.
                    if held.by_hash.get(&hash) == Some(&parent_path) {
                        refused = true;
                        break;
                    }
                    held.insert(hash, path);
                }
                if refused {
                    assert_eq!(result, Err(IndexRefusal::InvalidChain), "step {step}");
                    // The model applied the blocks before the refused one; so did the index.
                } else {
                    assert_eq!(result, Ok(()), "step {step}");
                }
            }
            6..=7 => {
                let keys: Vec<u64> = held.by_hash.keys().copied().collect();
                let mut gone = Vec::new();
                if next() % 2 == 0 && !held.last.is_empty() {
                    // A slice of the last chain, tail first or head first.
                    let a = (next() as usize) % held.last.len();
                    let b = a + 1 + (next() as usize) % (held.last.len() - a);
                    gone.extend_from_slice(&held.last[a..b]);
                    if next() % 2 == 0 {
                        gone.reverse();
                    }
                }
                for _ in 0..(next() % 3) {
                    if next() % 5 == 0 || keys.is_empty() {
                        gone.push(u64::MAX - next() % 100);
                    } else {
                        gone.push(keys[(next() as usize) % keys.len()]);
                    }
                }
                for h in &gone {
                    held.remove(*h);
                }
                apply(&mut index, &removed(worker, rank, &gone)).unwrap();
            }
            8 if next() % 8 == 0 => {
                *held = RankModel::default();
                apply(&mut index, &ev(worker, rank, KvEventData::Cleared)).unwrap();
            }
            8 if next() % 16 == 0 => {
                model.retain(|(w, _), _| *w != worker);
                index.remove_worker(WorkerId(worker));
            }
            _ => {
                // A query along a random path, or along a held block's path and on.
                let len = 1 + next() % max_query;
                let mut seq: Vec<u64> = Vec::new();
                let paths: Vec<u64> = model
                    .values()
                    .flat_map(|r| r.by_hash.values().copied())
                    .collect();
                if next() % 2 == 0 && !paths.is_empty() {
                    seq = spell(&spelled, paths[(next() as usize) % paths.len()]);
                }
                seq.extend((0..len).map(|_| next() % alphabet));
                let prefixes: Vec<u64> = seq
                    .iter()
                    .scan(ROOT_PATH, |p, &t| {
                        *p = child(*p, t);
                        Some(*p)
                    })
                    .collect();
                let mut want: Vec<(u64, DpRank, u32)> = model
                    .iter()
                    .filter_map(|(&(w, r), held)| {
                        let k = prefixes
                            .iter()
                            .take_while(|p| held.by_path.contains_key(p))
                            .count();
                        (k > 0).then_some((w, r, k as u32))
                    })
                    .collect();
                want.sort_unstable();
                assert_eq!(scores(&index, &seq), want, "step {step}");
            }
        }
        let total: usize = model.values().map(|r| r.by_hash.len()).sum();
        assert_eq!(index.stats().blocks as usize, total, "step {step}");
        index.tree.check();
    }
    // Everything removed, nothing left behind.
    for w in 0..6 {
        index.remove_worker(WorkerId(w));
    }
    let s = index.stats();
    assert_eq!((s.blocks, s.nodes, s.ranks), (0, 0, 0));
}

#[test]
fn router_index_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<RouterIndex>();
    check::<OverlapScores>();
}

/// A chain of `n` blocks 1..=n (tokens the same) for worker 7, rank 0, as events of 64.
fn long_chain(n: u64) -> Vec<RouterEvent> {
    let pairs: Vec<(u64, u64)> = (1..=n).map(|h| (h, h)).collect();
    pairs
        .chunks(64)
        .map(|c| stored(7, 0, c.first().filter(|b| b.0 > 1).map(|b| b.0 - 1), c))
        .collect()
}

#[test]
fn a_reserved_table_is_sized_once_counted_and_given_back() {
    let mut index = RouterIndex::default();
    index.reserve(WorkerId(7), 0, 10_000);
    for e in long_chain(10_000) {
        index.apply(Some(WorkerId(7)), &e).unwrap();
        let slot = index.rank_of[&(WorkerId(7), 0)];
        let rank = index.rank(slot).unwrap();
        assert!(rank.blocks.capacity() >= 10_000, "sized at once");
        assert_eq!(rank.cap_seen, rank.blocks.capacity());
        assert_eq!(
            index.rank_table_bytes,
            table_bytes(rank.cap_seen, BLOCK_ENTRY)
        );
    }
    index.end_reserve();
    assert_eq!(index.stats().blocks, 10_000);
    assert_eq!(
        scores(&index, &(1..=10_000).collect::<Vec<_>>()),
        vec![(7, 0, 10_000)]
    );
    index.clear_rank(WorkerId(7), 0);
    assert_eq!(index.rank_table_bytes, 0);
}

#[test]
fn a_reservation_stays_within_the_caps() {
    // The byte cap leaves no room for a table of a million blocks: no hint kept.
    let mut index = RouterIndex::new(RouterIndexConfig::default().max_bytes(1 << 20));
    index.reserve(WorkerId(7), 0, 1_000_000);
    assert!(index.reserved.is_empty());
    // The rank's cap cuts a hint down to it, and the worker's what its ranks'
    // hints leave.
    let config = RouterIndexConfig::default()
        .max_blocks_per_rank(100)
        .max_blocks_per_worker(150);
    let mut index = RouterIndex::new(config);
    index.reserve(WorkerId(7), 0, 1_000_000);
    index.reserve(WorkerId(7), 1, 1_000_000);
    assert_eq!(
        index.reserved,
        vec![((WorkerId(7), 0), 100, None), ((WorkerId(7), 1), 50, None)]
    );
    // Spent: a rank made later is not sized by it.
    index.end_reserve();
    index
        .apply(Some(WorkerId(7)), &stored(7, 0, None, &[(1, 1)]))
        .unwrap();
    assert!(index.rank_table_bytes < table_bytes(100, BLOCK_ENTRY));
    // An existing rank's table grows at once, and is counted.
    index.reserve(WorkerId(7), 0, 99);
    let rank = index.rank(index.rank_of[&(WorkerId(7), 0)]).unwrap();
    assert!(rank.blocks.capacity() >= 100);
    assert_eq!(
        index.rank_table_bytes,
        table_bytes(rank.cap_seen, BLOCK_ENTRY)
    );
    // What the dump did not fill is given back at its end.
    index.end_reserve();
    let rank = index.rank(index.rank_of[&(WorkerId(7), 0)]).unwrap();
    assert!(rank.blocks.capacity() < 100, "{}", rank.blocks.capacity());
    assert_eq!(
        index.rank_table_bytes,
        table_bytes(rank.cap_seen, BLOCK_ENTRY)
    );
}

#[test]
fn hints_count_against_the_byte_cap_together() {
    // Room for about one table of 100,000 blocks at half of what is left: the
    // second hint, counted with the first, is not kept.
    let mut index = RouterIndex::new(RouterIndexConfig::default().max_bytes(4 << 20));
    index.reserve(WorkerId(1), 0, 100_000);
    index.reserve(WorkerId(2), 0, 100_000);
    assert_eq!(index.reserved.len(), 1);
}

#[test]
fn a_fresh_chain_moves_a_block_the_rank_holds_elsewhere() {
    // Rank holds 1, 2, 3 from the root; a new chain 10, 11, 2, 12 takes 2 along.
    let mut index = RouterIndex::default();
    let first: Vec<(u64, u64)> = vec![(1, 1), (2, 2), (3, 3)];
    apply(&mut index, &stored(7, 0, None, &first)).unwrap();
    let second: Vec<(u64, u64)> = vec![(10, 10), (11, 11), (2, 20), (12, 12)];
    apply(&mut index, &stored(7, 0, None, &second)).unwrap();
    assert_eq!(index.rank_blocks(WorkerId(7), 0), 6);
    assert_eq!(scores(&index, &[10, 11, 20, 12]), vec![(7, 0, 4)]);
    // 2 moved: the old path holds 1 only (3 is kept, unscored past the gap).
    assert_eq!(scores(&index, &[1, 2, 3]), vec![(7, 0, 1)]);
}

#[test]
fn fresh_chains_past_a_run_and_the_caps_store_what_fits() {
    // 300 blocks: three runs' worth (128 a run), under a rank cap of 200.
    let mut index = RouterIndex::new(RouterIndexConfig::default().max_blocks_per_rank(200));
    let pairs: Vec<(u64, u64)> = (1..=300).map(|h| (h, h)).collect();
    let refused = index.apply(Some(WorkerId(7)), &stored(7, 0, None, &pairs));
    assert_eq!(refused, Err(IndexRefusal::RankFull { refused: 100 }));
    assert_eq!(index.rank_blocks(WorkerId(7), 0), 200);
    let seq: Vec<u64> = (1..=300).collect();
    assert_eq!(scores(&index, &seq), vec![(7, 0, 200)]);
}
