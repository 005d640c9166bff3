//! `kv::router::RouterIndex` held to NVIDIA Dynamo 1.6.1's own index: the real
//! `dynamo._core.RadixTree` (PyPI `ai-dynamo-runtime==1.6.1`, in the virtualenv
//! `.ci/run` creates at `target/dynamo-venv`; `EVENTPLANE_DYNAMO_PYTHON` points
//! elsewhere), driven by `tests/dynamo_live/radix_tree.py`.
//!
//! A seeded random stream over 8 workers × 2 ranks — shared prefixes, branches,
//! duplicate stores, stores under unknown parents, removes (known and unknown
//! hashes), clears and worker removals — is applied to both, and `find_matches`
//! must agree on every query, including a round of queries after every clear and
//! removal. Removes take blocks the rank holds nothing below (what engines evict:
//! their LRU frees a request's blocks tail first); removing a block with descendants
//! still held is where Dynamo's answer depends on how its tree compressed edges (see
//! the `kv::router::RouterIndex` docs).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use eventplane::kv::{
    BlockHash, DpRank, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash,
    WorkerId,
    router::{IndexRefusal, RouterIndex, local_block_hashes},
};
use serde_json::{Value, json};
use support::dynamo_python;

mod support;

/// Dynamo's `RadixTree` in a Python process, one request line, one answer line.
struct Dynamo {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Dynamo {
    fn spawn() -> Dynamo {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/dynamo_live/radix_tree.py");
        let mut child = Command::new(dynamo_python())
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Dynamo {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    fn call(&mut self, request: Value) -> Value {
        writeln!(self.stdin, "{request}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        assert!(
            self.stdout.read_line(&mut line).unwrap() > 0,
            "Dynamo's process ended"
        );
        serde_json::from_str(&line).unwrap()
    }

    /// Applies an event; whether Dynamo refused it.
    fn apply(&mut self, e: &RouterEvent) -> bool {
        let data = serde_json::to_value(&e.event.data).unwrap();
        if std::env::var_os("EVENTPLANE_DEBUG").is_some() {
            println!("apply {} {} {data}", e.worker_id.0, e.event.dp_rank);
        }
        let answer = self.call(json!({
            "op": "event",
            "worker": e.worker_id.0,
            "event": {"event_id": e.event.id, "dp_rank": e.event.dp_rank, "data": data},
        }));
        if let Some(err) = answer.get("err") {
            println!("Dynamo: {err}");
        }
        answer.get("err").is_some()
    }

    fn find_matches(&mut self, seq: &[TokensHash]) -> Vec<(u64, DpRank, u32)> {
        let hashes: Vec<u64> = seq.iter().map(|h| h.0).collect();
        let answer = self.call(json!({"op": "query", "hashes": hashes}));
        answer["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s[0].as_u64().unwrap(),
                    s[1].as_u64().unwrap() as DpRank,
                    s[2].as_u64().unwrap() as u32,
                )
            })
            .collect()
    }
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ours(index: &RouterIndex, seq: &[TokensHash]) -> Vec<(u64, DpRank, u32)> {
    index
        .find_matches(seq)
        .iter()
        .map(|s| (s.worker_id.0, s.dp_rank, s.blocks))
        .collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let x = (a ^ b.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x ^ (x >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 1
}

/// A block's position: the choices from the root. Three choices per depth, so
/// workers share prefixes and branch.
type Path = Vec<u8>;

fn tokens_hash_of(path: &Path) -> TokensHash {
    // What the block's tokens hash to: its depth and choice (the same tokens may
    // stand under different prefixes).
    TokensHash(mix(path.len() as u64, u64::from(*path.last().unwrap())))
}

/// A worker's engine hash of the block at `path`: a chain hash, the same for every
/// worker and rank (engines hash a prefix alike when their hash seed is fixed, as
/// Dynamo's deployments set it). With hashes that differ between workers, Dynamo
/// 1.6.1 cannot find a parent that sits inside a compressed edge another worker
/// created (it looks the position up by the creator's hashes), where `RouterIndex`
/// looks every rank's hashes up as that rank sent them.
fn block_hash_of(_worker: u64, path: &Path) -> BlockHash {
    BlockHash(
        path.iter()
            .fold(mix(0, 7), |h, &c| mix(h, u64::from(c) + 1)),
    )
}

fn event(worker: u64, rank: DpRank, id: u64, data: KvEventData) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: rank,
            data,
        },
    }
}

#[test]
fn find_matches_equals_dynamos_radix_tree_over_a_random_stream() {
    let seed = std::env::var("EVENTPLANE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1dea_u64);
    println!("seed {seed} (EVENTPLANE_SEED replays it)");
    let mut rng = Rng(seed | 1);
    let mut dynamo = Dynamo::spawn();
    let mut index = RouterIndex::default();
    // Worker ids as Dynamo's are (instance ids can exceed 2^53).
    let workers: Vec<u64> = (0..8)
        .map(|w| if w == 7 { (1 << 60) + 7 } else { 100 + w })
        .collect();
    let mut held: HashMap<(u64, DpRank), BTreeSet<Path>> = HashMap::new();
    let (mut queries, mut scored, mut refused_stores, mut id) = (0, 0, 0, 0u64);

    let mut query_round = |index: &RouterIndex,
                           dynamo: &mut Dynamo,
                           held: &HashMap<(u64, DpRank), BTreeSet<Path>>,
                           rng: &mut Rng,
                           n: usize,
                           step: usize| {
        for _ in 0..n {
            // Along a held path (then off it), or anywhere.
            let mut path: Path = match held.values().filter(|s| !s.is_empty()).nth(rng.below(16)) {
                Some(set) if rng.below(4) != 0 => {
                    set.iter().nth(rng.below(set.len())).unwrap().clone()
                }
                _ => Vec::new(),
            };
            for _ in 0..rng.below(4) {
                path.push(rng.below(3) as u8);
            }
            if path.is_empty() {
                path.push(rng.below(3) as u8);
            }
            let seq: Vec<TokensHash> = (1..=path.len())
                .map(|k| tokens_hash_of(&path[..k].to_vec()))
                .collect();
            let want = dynamo.find_matches(&seq);
            assert_eq!(ours(index, &seq), want, "step {step}: query {path:?}");
            queries += 1;
            scored += usize::from(!want.is_empty());
        }
    };

    for step in 0..6_000 {
        let worker = workers[rng.below(workers.len())];
        let rank = rng.below(2) as DpRank;
        id += 1;
        let roll = rng.below(100);
        let set = held.entry((worker, rank)).or_default();
        match roll {
            0..=49 => {
                // Extend a held block (a branch), or start at the root.
                let parent: Option<Path> = if set.is_empty() || rng.below(4) == 0 {
                    None
                } else {
                    Some(set.iter().nth(rng.below(set.len())).unwrap().clone())
                };
                let mut path = parent.clone().unwrap_or_default();
                let mut blocks = Vec::new();
                for _ in 0..1 + rng.below(6) {
                    if path.len() >= 14 {
                        break;
                    }
                    path.push(rng.below(3) as u8);
                    blocks.push((
                        path.clone(),
                        StoredBlock {
                            block_hash: block_hash_of(worker, &path),
                            tokens_hash: tokens_hash_of(&path),
                        },
                    ));
                }
                let e = event(
                    worker,
                    rank,
                    id,
                    KvEventData::Stored {
                        parent_hash: parent.as_ref().map(|p| block_hash_of(worker, p)),
                        blocks: blocks.iter().map(|(_, b)| *b).collect(),
                    },
                );
                assert!(!dynamo.apply(&e), "step {step}: Dynamo refused a store");
                index.apply(Some(WorkerId(worker)), &e).unwrap();
                set.extend(blocks.into_iter().map(|(p, _)| p));
            }
            50..=54 => {
                // A parent this rank does not hold (never stored, or the other rank's).
                let parent = if rng.below(2) == 0 {
                    BlockHash(mix(id, 99))
                } else {
                    block_hash_of(worker, &vec![rng.below(3) as u8; 1 + rng.below(3)])
                };
                let mut path = vec![9u8];
                path.push(rng.below(3) as u8);
                let e = event(
                    worker,
                    rank,
                    id,
                    KvEventData::Stored {
                        parent_hash: Some(parent),
                        blocks: vec![StoredBlock {
                            block_hash: block_hash_of(worker, &path),
                            tokens_hash: tokens_hash_of(&path),
                        }],
                    },
                );
                if set.iter().any(|p| block_hash_of(worker, p) == parent) {
                    continue; // held after all
                }
                assert!(
                    dynamo.apply(&e),
                    "step {step}: Dynamo took an unknown parent"
                );
                assert_eq!(
                    index.apply(Some(WorkerId(worker)), &e),
                    Err(IndexRefusal::UnknownParent),
                    "step {step}"
                );
                refused_stores += 1;
            }
            55..=59 => {
                // A chain the rank holds, sent again from the root.
                if let Some(leaf) = set.iter().nth(rng.below(set.len().max(1))).cloned() {
                    let blocks = (1..=leaf.len())
                        .map(|k| {
                            let p = leaf[..k].to_vec();
                            StoredBlock {
                                block_hash: block_hash_of(worker, &p),
                                tokens_hash: tokens_hash_of(&p),
                            }
                        })
                        .collect();
                    let e = event(
                        worker,
                        rank,
                        id,
                        KvEventData::Stored {
                            parent_hash: None,
                            blocks,
                        },
                    );
                    assert!(!dynamo.apply(&e), "step {step}");
                    index.apply(Some(WorkerId(worker)), &e).unwrap();
                    for k in 1..=leaf.len() {
                        set.insert(leaf[..k].to_vec());
                    }
                }
            }
            60..=84 => {
                // Evict blocks the rank holds nothing below; now and then a hash it
                // never held.
                let leaves: Vec<Path> = set
                    .iter()
                    .filter(|p| {
                        !set.iter()
                            .any(|q| q.len() == p.len() + 1 && q.starts_with(p))
                    })
                    .cloned()
                    .collect();
                let mut gone = Vec::new();
                if !leaves.is_empty() {
                    for _ in 0..1 + rng.below(3) {
                        let leaf = &leaves[rng.below(leaves.len())];
                        if !gone.contains(leaf) {
                            gone.push(leaf.clone());
                        }
                    }
                }
                let mut hashes: Vec<BlockHash> =
                    gone.iter().map(|p| block_hash_of(worker, p)).collect();
                if rng.below(5) == 0 {
                    hashes.push(BlockHash(mix(id, 5)));
                }
                for p in &gone {
                    set.remove(p);
                }
                let e = event(
                    worker,
                    rank,
                    id,
                    KvEventData::Removed {
                        block_hashes: hashes,
                    },
                );
                dynamo.apply(&e);
                index.apply(Some(WorkerId(worker)), &e).unwrap();
            }
            85..=87 => {
                set.clear();
                let e = event(worker, rank, id, KvEventData::Cleared);
                assert!(!dynamo.apply(&e));
                index.apply(Some(WorkerId(worker)), &e).unwrap();
                query_round(&index, &mut dynamo, &held, &mut rng, 12, step);
            }
            88..=89 => {
                held.retain(|(w, _), _| *w != worker);
                dynamo.call(json!({"op": "remove_worker", "worker": worker}));
                index.remove_worker(WorkerId(worker));
                query_round(&index, &mut dynamo, &held, &mut rng, 12, step);
            }
            _ => query_round(&index, &mut dynamo, &held, &mut rng, 4, step),
        }
    }
    query_round(&index, &mut dynamo, &held, &mut rng, 500, 6_000);
    let stats = index.stats();
    println!(
        "{queries} queries ({scored} with a score), {refused_stores} stores under unknown parents, \
         index {} blocks in {} nodes, {} bytes",
        stats.blocks, stats.nodes, stats.bytes
    );
    assert!(
        queries > 3_000 && scored > queries / 2,
        "{queries} queries, {scored} scored"
    );
    assert!(refused_stores > 100);
    assert!(
        stats.duplicate_blocks > 100 && stats.removed_blocks > 1_000 && stats.cleared_ranks > 50
    );
}

#[test]
fn local_block_hashes_equal_dynamos_for_every_block_size() {
    let mut dynamo = Dynamo::spawn();
    let mut rng = Rng(0x70ce_5eed);
    for block_size in [1usize, 2, 4, 16, 32, 64, 100, 256] {
        for len in [
            0usize,
            1,
            block_size - 1,
            block_size,
            3 * block_size + 1,
            1000,
        ] {
            let tokens: Vec<u32> = (0..len)
                .map(|_| rng.next() as u32 >> (rng.below(3) * 8))
                .collect();
            let answer =
                dynamo.call(json!({"op": "hashes", "tokens": tokens, "block_size": block_size}));
            let want: Vec<u64> = answer["hashes"]
                .as_array()
                .unwrap_or_else(|| panic!("{answer}"))
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect();
            let got: Vec<u64> = local_block_hashes(&tokens, block_size)
                .iter()
                .map(|h| h.0)
                .collect();
            assert_eq!(got, want, "block size {block_size}, {len} tokens");
        }
    }
}
