//! A synthetic KV-event trace shaped like Mooncake's, for router indexes: deterministic
//! (seeded xorshift), shared by `benches/router_index.rs` and the side-by-side run
//! against Dynamo's `RadixTree` in `benches/vs-dynamo-index/` (both include this file
//! with `#[path]`).
//!
//! The cluster: `workers` engines (one data-parallel rank each), each caching at most
//! `capacity` blocks. Requests come from `prefixes` system prompts of 20–200 blocks,
//! picked with Zipf popularity (exponent 1): a request either starts a session on a
//! prompt (the prompt, then 30–100 blocks of its own) or continues one of the prompt's
//! live sessions (its whole history, then 10–60 new blocks), up to 400 blocks; every
//! turn then decodes 2–16 blocks of output, which the next turn's prompt includes. A
//! session runs on its home worker, 15% of its later turns on another one.
//!
//! Each worker is simulated as an engine with prefix caching: it stores the part of the
//! prompt it does not hold yet in chunks of at most 64 blocks (one `Stored` event
//! each, parent the last block it already holds on that path), then every output block
//! as its own event; before storing past `capacity` it evicts its least recently used
//! blocks that have no cached child (one `Removed` event listing them, tail first, as
//! an engine's LRU frees a request's blocks). Tokens hashes depend on the block's
//! tokens only; block hashes chain (parent hash, tokens hash), as engines with a fixed
//! hash seed compute them, so equal prefixes have equal block hashes on every worker.
//!
//! The trace keeps the simulation's final state, so [`Trace::expected`] gives the
//! exact overlap scores any correct index must return once every op is applied.
#![allow(dead_code)]

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
};

/// Blocks per `Stored` event of a prefill (chunked prefill).
pub const PREFILL_CHUNK: usize = 64;
/// Longest prompt, in blocks.
pub const MAX_PROMPT: usize = 400;
/// Live sessions kept per system prompt.
const SESSIONS_PER_PREFIX: usize = 4;

/// The trace's shape.
#[derive(Debug, Clone, Copy)]
pub struct TraceConfig {
    /// Workers (engines), one rank each.
    pub workers: usize,
    /// Blocks each worker caches at most.
    pub capacity: usize,
    /// System prompts.
    pub prefixes: usize,
    /// Requests simulated.
    pub requests: usize,
    /// Prompts kept as `find_matches` queries (a random sample of the last fifth of
    /// the requests').
    pub queries: usize,
    /// The generator's seed.
    pub seed: u64,
}

impl TraceConfig {
    /// 256 workers of 20,000 blocks, 300 system prompts, 150,000 requests.
    pub fn full() -> TraceConfig {
        TraceConfig {
            workers: 256,
            capacity: 20_000,
            prefixes: 300,
            requests: 150_000,
            queries: 10_000,
            seed: 0x5eed_cafe_f00d_0001,
        }
    }

    /// A small one for test mode: a second to generate and apply, evictions included.
    pub fn tiny() -> TraceConfig {
        TraceConfig {
            workers: 16,
            capacity: 1_000,
            prefixes: 40,
            requests: 3_000,
            queries: 500,
            seed: 0x5eed_cafe_f00d_0001,
        }
    }

    /// `full()` or `tiny()`, with `ROUTER_INDEX_WORKERS`, `ROUTER_INDEX_CAPACITY`,
    /// `ROUTER_INDEX_REQUESTS` read from the environment when set.
    pub fn from_env(tiny: bool) -> TraceConfig {
        let mut config = if tiny {
            TraceConfig::tiny()
        } else {
            TraceConfig::full()
        };
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        if let Some(v) = var("ROUTER_INDEX_WORKERS") {
            config.workers = v;
        }
        if let Some(v) = var("ROUTER_INDEX_CAPACITY") {
            config.capacity = v;
        }
        if let Some(v) = var("ROUTER_INDEX_REQUESTS") {
            config.requests = v;
        }
        config
    }
}

/// One engine event: a store of `blocks[start..end]` under `parent` (`None`: at the
/// root), or a remove of the block hashes `blocks[start..end]`.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    /// Worker index (0..workers).
    pub worker: u32,
    /// A store (else a remove).
    pub store: bool,
    /// A store's parent block hash.
    pub parent: Option<u64>,
    /// Its blocks in [`Trace::blocks`].
    pub start: usize,
    /// End of its blocks.
    pub end: usize,
}

/// A `find_matches` query: a request's prompt.
#[derive(Debug, Clone)]
pub struct Query {
    /// Its tokens hashes (what a router computes from the tokens).
    pub tokens: Vec<u64>,
    /// Its block hashes (for the expected scores).
    pub blocks: Vec<u64>,
}

/// The generated trace.
#[derive(Debug)]
pub struct Trace {
    /// Its shape.
    pub config: TraceConfig,
    /// Every event, in order.
    pub ops: Vec<Op>,
    /// `(block hash, tokens hash)` of every op's blocks (tokens hash 0 for removes).
    pub blocks: Vec<(u64, u64)>,
    /// Prompts to query with.
    pub queries: Vec<Query>,
    /// Stored and removed blocks in the ops.
    pub stored_blocks: usize,
    /// Removed blocks in the ops.
    pub removed_blocks: usize,
    /// Store and remove events.
    pub store_ops: usize,
    /// Remove events.
    pub remove_ops: usize,
    /// Each worker's blocks at the end.
    model: Vec<Engine>,
}

/// The worker ids the trace's events carry (worker index + 1000).
pub fn worker_id(worker: u32) -> u64 {
    u64::from(worker) + 1000
}

/// xorshift64, with a multiplied output.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (0 is mapped to a non-zero state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// splitmix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A block's tokens hash from what its tokens are (never 0).
fn tokens(kind: u64, owner: u64, position: usize) -> u64 {
    mix(mix(kind ^ mix(owner)) ^ position as u64).max(1)
}

/// A block's hash, chained on its parent's (never 0).
fn chain_hash(parent: u64, tokens: u64) -> u64 {
    mix(parent.rotate_left(29) ^ tokens ^ 0x6a09_e667_f3bc_c909).max(1)
}

/// The block hashes are already uniform: tables key by them as they are.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Map<K, V> = HashMap<K, V, BuildHasherDefault<Identity>>;

/// A block an engine caches.
#[derive(Debug, Clone, Copy)]
struct Cached {
    /// Its parent (0: at the root).
    parent: u64,
    /// Cached children.
    children: u32,
    /// Last request that used it.
    tick: u64,
}

/// One engine's prefix cache.
#[derive(Debug, Default)]
struct Engine {
    blocks: Map<u64, Cached>,
    /// `(tick, hash)` of the blocks without cached children: the eviction order.
    leaves: BTreeSet<(u64, u64)>,
}

impl Engine {
    /// Evicts least recently used leaves (none used by request `now`) until `n` more
    /// blocks fit in `capacity`; appends them to `removed`. The blocks that fit.
    fn make_room(&mut self, n: usize, capacity: usize, now: u64, removed: &mut Vec<u64>) -> usize {
        while self.blocks.len() + n > capacity {
            let Some(&(tick, hash)) = self.leaves.first() else {
                break;
            };
            if tick >= now {
                break;
            }
            self.leaves.pop_first();
            let Some(gone) = self.blocks.remove(&hash) else {
                continue;
            };
            removed.push(hash);
            if let Some(parent) = self.blocks.get_mut(&gone.parent) {
                parent.children -= 1;
                if parent.children == 0 {
                    self.leaves.insert((parent.tick, gone.parent));
                }
            }
        }
        n.min(capacity.saturating_sub(self.blocks.len()))
    }

    /// Caches `chain` (its first block under `parent`, 0: the root) at tick `now`.
    fn store(&mut self, parent: u64, chain: &[(u64, u64)], now: u64) {
        let mut at = parent;
        for &(hash, _) in chain {
            if let Some(p) = self.blocks.get_mut(&at) {
                if p.children == 0 {
                    self.leaves.remove(&(p.tick, at));
                }
                p.children += 1;
            }
            self.blocks.insert(
                hash,
                Cached {
                    parent: at,
                    children: 0,
                    tick: now,
                },
            );
            at = hash;
        }
        if at != parent {
            self.leaves.insert((now, at));
        }
    }

    /// How many leading blocks of `chain` it caches; marks them used at `now`.
    fn touch(&mut self, chain: &[(u64, u64)], now: u64) -> usize {
        let mut held = 0;
        for &(hash, _) in chain {
            let Some(b) = self.blocks.get_mut(&hash) else {
                break;
            };
            if b.children == 0 {
                self.leaves.remove(&(b.tick, hash));
                self.leaves.insert((now, hash));
            }
            b.tick = now;
            held += 1;
        }
        held
    }

    /// How many leading blocks of `blocks` it caches.
    fn held(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }
}

/// Zipf sampling over `0..n` with exponent `s`.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut total = 0.0;
        let mut cdf: Vec<f64> = (0..n)
            .map(|i| {
                total += 1.0 / ((i + 1) as f64).powf(s);
                total
            })
            .collect();
        for c in &mut cdf {
            *c /= total;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// A conversation: its chain so far (system prompt included) and its home worker.
struct Session {
    id: u64,
    home: u32,
    chain: Vec<(u64, u64)>,
}

/// Appends `n` blocks of session `id`'s own tokens to `chain`.
fn extend(chain: &mut Vec<(u64, u64)>, id: u64, n: usize) {
    for _ in 0..n {
        let parent = chain.last().map_or(0x9e37_79b9_7f4a_7c15, |b| b.0);
        let t = tokens(2, id, chain.len());
        chain.push((chain_hash(parent, t), t));
    }
}

impl Trace {
    /// Simulates `config`'s cluster and records its events.
    pub fn generate(config: TraceConfig) -> Trace {
        assert!(
            config.capacity > MAX_PROMPT + 16,
            "a worker must hold one whole request"
        );
        let mut rng = Rng::new(config.seed);
        let zipf = Zipf::new(config.prefixes, 1.0);
        // The system prompts' chains.
        let prompts: Vec<Vec<(u64, u64)>> = (0..config.prefixes)
            .map(|p| {
                let n = rng.range(20, 200);
                let mut chain = Vec::with_capacity(n);
                let mut parent = 0x9e37_79b9_7f4a_7c15;
                for i in 0..n {
                    let t = tokens(1, p as u64, i);
                    parent = chain_hash(parent, t);
                    chain.push((parent, t));
                }
                chain
            })
            .collect();
        let mut sessions: Vec<Vec<Session>> = (0..config.prefixes).map(|_| Vec::new()).collect();
        let mut next_session = 0u64;
        let mut engines: Vec<Engine> = (0..config.workers).map(|_| Engine::default()).collect();
        let mut trace = Trace {
            config,
            ops: Vec::new(),
            blocks: Vec::new(),
            queries: Vec::new(),
            stored_blocks: 0,
            removed_blocks: 0,
            store_ops: 0,
            remove_ops: 0,
            model: Vec::new(),
        };
        // Queries are sampled from the last fifth of the requests: what the router is
        // asked about the cluster's current state.
        let query_from = config.requests - config.requests / 5;
        let query_chance = config.queries as f64 / (config.requests / 5).max(1) as f64;
        let mut removed = Vec::new();
        for request in 0..config.requests {
            let now = request as u64 + 1;
            let p = zipf.sample(&mut rng);
            let pool = &mut sessions[p];
            // Continue a live session, or start one.
            let mut turn = None;
            if !pool.is_empty() && rng.chance(0.6) {
                let i = rng.range(0, pool.len() - 1);
                let input = rng.range(10, 60);
                if pool[i].chain.len() + input <= MAX_PROMPT {
                    turn = Some((i, input));
                } else {
                    pool.swap_remove(i);
                }
            }
            let (i, worker) = match turn {
                Some((i, input)) => {
                    let s = &mut pool[i];
                    extend(&mut s.chain, s.id, input);
                    let worker = if rng.chance(0.85) {
                        s.home
                    } else {
                        rng.range(0, config.workers - 1) as u32
                    };
                    (i, worker)
                }
                None => {
                    let id = next_session;
                    next_session += 1;
                    let mut chain = prompts[p].clone();
                    extend(&mut chain, id, rng.range(30, 100));
                    let home = rng.range(0, config.workers - 1) as u32;
                    if pool.len() >= SESSIONS_PER_PREFIX {
                        let k = rng.range(0, pool.len() - 1);
                        pool.swap_remove(k);
                    }
                    pool.push(Session { id, home, chain });
                    (pool.len() - 1, home)
                }
            };
            let session = &mut pool[i];
            if request >= query_from
                && rng.chance(query_chance)
                && trace.queries.len() < config.queries
            {
                trace.queries.push(Query {
                    tokens: session.chain.iter().map(|b| b.1).collect(),
                    blocks: session.chain.iter().map(|b| b.0).collect(),
                });
            }
            let engine = &mut engines[worker as usize];
            // Prefill: what the worker lacks of the prompt, in chunks.
            let held = engine.touch(&session.chain, now);
            let mut at = held;
            let prompt_len = session.chain.len();
            let output = rng.range(2, 16);
            extend(&mut session.chain, session.id, output);
            let mut todo: Vec<usize> = Vec::new();
            while at < prompt_len {
                let n = (prompt_len - at).min(PREFILL_CHUNK);
                todo.push(n);
                at += n;
            }
            // Decode: one block per event.
            todo.extend(std::iter::repeat_n(1, output));
            let mut at = held;
            for n in todo {
                removed.clear();
                let fits = engine.make_room(n, config.capacity, now, &mut removed);
                if !removed.is_empty() {
                    let start = trace.blocks.len();
                    trace.blocks.extend(removed.iter().map(|&h| (h, 0)));
                    trace.ops.push(Op {
                        worker,
                        store: false,
                        parent: None,
                        start,
                        end: trace.blocks.len(),
                    });
                    trace.remove_ops += 1;
                    trace.removed_blocks += removed.len();
                }
                if fits == 0 {
                    break;
                }
                let parent = at.checked_sub(1).map(|k| session.chain[k].0);
                let blocks = &session.chain[at..at + fits];
                engine.store(parent.unwrap_or(0), blocks, now);
                let start = trace.blocks.len();
                trace.blocks.extend_from_slice(blocks);
                trace.ops.push(Op {
                    worker,
                    store: true,
                    parent,
                    start,
                    end: trace.blocks.len(),
                });
                trace.store_ops += 1;
                trace.stored_blocks += fits;
                at += fits;
                if fits < n {
                    break;
                }
            }
        }
        trace.model = engines;
        trace
    }

    /// Blocks held at the end, over every worker (one per worker holding one).
    pub fn held_blocks(&self) -> usize {
        self.model.iter().map(|e| e.blocks.len()).sum()
    }

    /// Distinct blocks held at the end (tree nodes).
    pub fn distinct_blocks(&self) -> usize {
        let mut all: Map<u64, ()> = Map::default();
        for e in &self.model {
            all.extend(e.blocks.keys().map(|&h| (h, ())));
        }
        all.len()
    }

    /// The overlap scores of query `q` once every op is applied: `(worker id, leading
    /// blocks held)` for each worker holding its first block, ordered by worker id.
    pub fn expected(&self, q: usize) -> Vec<(u64, u32)> {
        let blocks = &self.queries[q].blocks;
        self.model
            .iter()
            .enumerate()
            .filter_map(|(w, e)| {
                let held = e.held(blocks);
                (held > 0).then(|| (worker_id(w as u32), held as u32))
            })
            .collect()
    }

    /// One line on the trace's shape.
    pub fn describe(&self) -> String {
        let lens: Vec<usize> = self.queries.iter().map(|q| q.tokens.len()).collect();
        let mean = lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64;
        format!(
            "{} workers × {} blocks, {} system prompts, {} requests: {} events ({} stores of \
             {} blocks, {} removes of {} blocks); {} blocks held at the end ({} distinct); \
             {} queries of {}–{} blocks (mean {mean:.0})",
            self.config.workers,
            self.config.capacity,
            self.config.prefixes,
            self.config.requests,
            self.ops.len(),
            self.store_ops,
            self.stored_blocks,
            self.remove_ops,
            self.removed_blocks,
            self.held_blocks(),
            self.distinct_blocks(),
            self.queries.len(),
            lens.iter().min().unwrap_or(&0),
            lens.iter().max().unwrap_or(&0),
        )
    }

    /// The ops as eventplane router events (device tier, rank 0, event ids in order).
    pub fn router_events(&self) -> Vec<RouterEvent> {
        self.ops
            .iter()
            .enumerate()
            .map(|(id, op)| {
                let blocks = &self.blocks[op.start..op.end];
                let data = if op.store {
                    KvEventData::Stored {
                        parent_hash: op.parent.map(BlockHash),
                        blocks: blocks
                            .iter()
                            .map(|&(b, t)| StoredBlock {
                                block_hash: BlockHash(b),
                                tokens_hash: TokensHash(t),
                            })
                            .collect(),
                    }
                } else {
                    KvEventData::Removed {
                        block_hashes: blocks.iter().map(|&(b, _)| BlockHash(b)).collect(),
                    }
                };
                RouterEvent {
                    worker_id: WorkerId(worker_id(op.worker)),
                    tier: StorageTier::Device,
                    event: KvEvent {
                        id: id as u64 + 1,
                        dp_rank: 0,
                        data,
                    },
                }
            })
            .collect()
    }

    /// The queries as eventplane tokens hashes.
    pub fn query_hashes(&self) -> Vec<Vec<TokensHash>> {
        self.queries
            .iter()
            .map(|q| q.tokens.iter().map(|&t| TokensHash(t)).collect())
            .collect()
    }
}
