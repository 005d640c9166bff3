//! `soak engine`: an inference engine stand-in. It publishes vLLM-shaped KV event
//! batches (`[topic, seq u64be, msgpack [ts, events, dp_rank]]`) on a ZMQ PUB, from a
//! cache model that behaves the way routers must survive: chained stores that extend
//! earlier chains, repeated stores of a held block (so the relay's ref-counted dedup
//! matters), FIFO eviction as `BlockRemoved`, two storage tiers, and rare clears.
//!
//! The engine is the soak's ground truth. It holds a block while the block's store
//! count is above zero — the same rule the relay's dedup applies (DESIGN §4.2) — and
//! prints what it holds when told to settle.
//!
//! stdin commands, one per line: `settle` (stop reusing and clearing; store only new
//! blocks until every block held at the command has been evicted; then stop publishing
//! and print `held {"gpu":[…],"cpu":[…]}`), `quit`.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use eventplane::zmtp::{Config, Message, PubSocket};
use serde::Serialize;
use tokio::io::AsyncBufReadExt;

use crate::rng::Rng;

/// The engine's knobs (`soak engine --help` is not offered: the orchestrator starts it).
#[derive(Debug, Clone)]
pub(crate) struct EngineArgs {
    pub(crate) worker: u64,
    pub(crate) seed: u64,
    pub(crate) interval: Duration,
    pub(crate) capacity: usize,
    pub(crate) block_size: u32,
}

/// The two tiers the engine stores in: `GPU` (the relay's `device`) and `CPU`
/// (`host_pinned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Tier {
    Gpu,
    Cpu,
}

impl Tier {
    fn medium(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
        }
    }
}

/// One event of vLLM's array form (DESIGN §4.4).
#[derive(Debug, Serialize, PartialEq)]
#[serde(untagged)]
pub(crate) enum EngineEvent {
    /// `[BlockStored, hashes, parent, token_ids, block_size, lora_id, medium]`
    Stored(
        &'static str,
        Vec<u64>,
        Option<u64>,
        Vec<u32>,
        u32,
        Option<u32>,
        &'static str,
    ),
    /// `[BlockRemoved, hashes, medium]`
    Removed(&'static str, Vec<u64>, &'static str),
    /// `[AllBlocksCleared]`
    Cleared((&'static str,)),
}

/// The engine's cache: what it stored, in eviction order, and each block's count.
#[derive(Debug)]
pub(crate) struct Cache {
    worker: u64,
    rng: Rng,
    capacity: usize,
    block_size: u32,
    /// (tier, hash, stamp): one entry per store, oldest first.
    fifo: VecDeque<(Tier, u64, u64)>,
    counts: HashMap<(Tier, u64), u32>,
    /// Tails of recent chains, to extend.
    tails: VecDeque<(Tier, u64)>,
    stamp: u64,
    fresh: u64,
    /// Set by `settle`: the stamp every held block must reach.
    settle_from: Option<u64>,
}

impl Cache {
    pub(crate) fn new(args: &EngineArgs) -> Cache {
        Cache {
            worker: args.worker,
            rng: Rng::new(args.seed ^ args.worker.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            capacity: args.capacity.max(8),
            block_size: args.block_size.max(1),
            fifo: VecDeque::new(),
            counts: HashMap::new(),
            tails: VecDeque::new(),
            stamp: 0,
            fresh: 0,
            settle_from: None,
        }
    }

    /// A hash never used before by this engine (and by no other: the worker id is in
    /// it), below 2^63 as Dynamo's signed hashes need.
    fn fresh_hash(&mut self) -> u64 {
        self.fresh += 1;
        crate::rng::mix(self.worker << 32 ^ self.fresh) >> 1
    }

    fn push(&mut self, tier: Tier, hash: u64) {
        self.stamp += 1;
        self.fifo.push_back((tier, hash, self.stamp));
        *self.counts.entry((tier, hash)).or_default() += 1;
    }

    /// Stops reuse and clears; [`settled`](Self::settled) once every block held now
    /// is gone.
    pub(crate) fn settle(&mut self) {
        self.settle_from = Some(self.stamp + 1);
    }

    /// Whether settling is over: every block held was stored after `settle`.
    pub(crate) fn settled(&self) -> bool {
        self.settle_from
            .is_some_and(|from| self.fifo.front().is_none_or(|&(_, _, s)| s >= from))
    }

    /// The next batch's events.
    pub(crate) fn tick(&mut self) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        let settling = self.settle_from.is_some();
        if !settling && self.rng.below(1000) < 2 {
            self.fifo.clear();
            self.counts.clear();
            self.tails.clear();
            events.push(EngineEvent::Cleared(("AllBlocksCleared",)));
            return events;
        }
        for _ in 0..1 + self.rng.below(3) {
            if !settling && !self.fifo.is_empty() && self.rng.below(10) == 0 {
                // A block stored again while held (vLLM re-caching a prefix): the
                // relay's dedup counts it and passes only its last removal.
                let i = self.rng.below(self.fifo.len() as u64) as usize;
                if let Some(&(tier, hash, _)) = self.fifo.get(i) {
                    self.push(tier, hash);
                    events.push(self.stored(tier, vec![hash], None));
                }
                continue;
            }
            let tier = if self.rng.below(5) == 0 {
                Tier::Cpu
            } else {
                Tier::Gpu
            };
            let parent = match self.rng.below(2) {
                0 => self.tails.iter().rev().find(|t| t.0 == tier).map(|t| t.1),
                _ => None,
            };
            let len = 1 + self.rng.below(6) as usize;
            let hashes: Vec<u64> = (0..len).map(|_| self.fresh_hash()).collect();
            for &h in &hashes {
                self.push(tier, h);
            }
            if let Some(&last) = hashes.last() {
                self.tails.push_back((tier, last));
                if self.tails.len() > 16 {
                    self.tails.pop_front();
                }
            }
            events.push(self.stored(tier, hashes, parent));
        }
        self.evict(&mut events);
        events
    }

    fn stored(&mut self, tier: Tier, hashes: Vec<u64>, parent: Option<u64>) -> EngineEvent {
        let tokens = (0..hashes.len() as u64 * u64::from(self.block_size))
            .map(|_| self.rng.below(32_000) as u32)
            .collect();
        EngineEvent::Stored(
            "BlockStored",
            hashes,
            parent,
            tokens,
            self.block_size,
            None,
            tier.medium(),
        )
    }

    /// Evicts the oldest stores past the capacity, one `BlockRemoved` per run of a
    /// tier.
    fn evict(&mut self, events: &mut Vec<EngineEvent>) {
        let mut run: Option<(Tier, Vec<u64>)> = None;
        while self.fifo.len() > self.capacity {
            let Some((tier, hash, _)) = self.fifo.pop_front() else {
                break;
            };
            if let Some(n) = self.counts.get_mut(&(tier, hash)) {
                *n -= 1;
                if *n == 0 {
                    self.counts.remove(&(tier, hash));
                }
            }
            match &mut run {
                Some((t, hashes)) if *t == tier => hashes.push(hash),
                _ => {
                    if let Some((t, hashes)) = run.take() {
                        events.push(EngineEvent::Removed("BlockRemoved", hashes, t.medium()));
                    }
                    run = Some((tier, vec![hash]));
                }
            }
        }
        if let Some((t, hashes)) = run {
            events.push(EngineEvent::Removed("BlockRemoved", hashes, t.medium()));
        }
    }

    /// What the engine holds: per tier, the sorted hashes with a count above zero.
    pub(crate) fn held(&self) -> Held {
        let mut held = Held::default();
        for &(tier, hash) in self.counts.keys() {
            match tier {
                Tier::Gpu => held.gpu.push(hash),
                Tier::Cpu => held.cpu.push(hash),
            }
        }
        held.gpu.sort_unstable();
        held.cpu.sort_unstable();
        held
    }
}

/// What an engine holds, per tier (`device`, `host_pinned` in router terms).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) struct Held {
    pub(crate) gpu: Vec<u64>,
    pub(crate) cpu: Vec<u64>,
}

/// Runs the engine until `quit` or stdin closes.
pub(crate) async fn run(args: EngineArgs) -> Result<(), String> {
    // A stopped relay stops answering heartbeats: dropped within 3 s, its batches
    // lost, a gap when it reads again.
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_timeout(Some(Duration::from_secs(3)))
        .write_stall_timeout(Some(Duration::from_secs(3)))
        .build()
        .map_err(|e| e.to_string())?;
    let socket = PubSocket::bind("tcp://127.0.0.1:0", config)
        .await
        .map_err(|e| e.to_string())?;
    println!("bound {}", socket.local_endpoint().unwrap_or_default());
    let mut cache = Cache::new(&args);
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut tick = tokio::time::interval(args.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut quiet = false;
    loop {
        tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(l)) if l.trim() == "settle" => cache.settle(),
                Ok(Some(l)) if l.trim() == "quit" => return Ok(()),
                Ok(Some(_)) => {}
                _ => return Ok(()),
            },
            _ = tick.tick(), if !quiet => {
                if cache.settled() {
                    quiet = true;
                    let held = serde_json::to_string(&cache.held()).map_err(|e| e.to_string())?;
                    println!("held {held}");
                    continue;
                }
                let events = cache.tick();
                let ts = seq as f64 * args.interval.as_secs_f64();
                let payload = rmp_serde::to_vec(&(ts, events, 0u32)).map_err(|e| e.to_string())?;
                socket.send(Message::from_parts([
                    Bytes::from_static(b"kv-events"),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ]));
                seq += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> EngineArgs {
        EngineArgs {
            worker: 7,
            seed: 1,
            interval: Duration::from_millis(10),
            capacity: 64,
            block_size: 4,
        }
    }

    #[test]
    fn the_cache_stays_within_capacity_and_settles_to_new_blocks_only() {
        let mut cache = Cache::new(&args());
        let mut reused = 0;
        for _ in 0..2000 {
            for ev in cache.tick() {
                if let EngineEvent::Stored(_, h, None, ..) = &ev {
                    reused += usize::from(h.len() == 1);
                }
            }
            assert!(cache.fifo.len() <= 64);
        }
        assert!(reused > 50, "reuse happens: {reused}");
        let before: Vec<u64> = cache.held().gpu;
        cache.settle();
        let mut n = 0;
        while !cache.settled() {
            cache.tick();
            n += 1;
            assert!(n < 1000, "settles");
        }
        let after = cache.held();
        assert!(after.gpu.iter().all(|h| !before.contains(h)));
        assert!(!after.gpu.is_empty());
    }

    #[test]
    fn a_batch_is_vllm_shaped_msgpack() {
        let ev = EngineEvent::Removed("BlockRemoved", vec![1, 2], "GPU");
        let bytes = rmp_serde::to_vec(&(0.5f64, vec![ev], 0u32)).unwrap();
        // [0.5, [["BlockRemoved", [1, 2], "GPU"]], 0]
        assert_eq!(bytes[0], 0x93);
        assert_eq!(&bytes[10..13], &[0x91, 0x93, 0xac]);
    }
}
