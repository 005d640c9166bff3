//! `soak engine`: an inference engine stand-in. It publishes vLLM-shaped KV event
//! batches (`[topic, seq u64be, msgpack [ts, events, dp_rank]]`) on a ZMQ PUB, from a
//! cache model that behaves the way routers must survive: chained stores that extend
//! earlier chains, repeated stores of a held block (so the relay's ref-counted dedup
//! matters), FIFO eviction as `BlockRemoved`, two storage tiers, and rare clears.
//!
//! The engine is the soak's ground truth. It holds a block while the block's store
//! count is above zero — the same rule the relay's dedup applies (DESIGN §4.2). After
//! each batch it notes a fingerprint of its device-tier blocks (an XOR of their mixed
//! hashes, the one a router computes over its index) and prints the second's notes
//! once a second: `fps [[unix_ms, fp], …]`, what the oracle samples routers against.
//!
//! Like vLLM, SGLang and TensorRT-LLM it serves a replay endpoint (a ROUTER: a request
//! `["", start_seq u64be]` answered with `["", topic, seq, payload]` per buffered batch
//! from `start_seq`, then the end marker with sequence `u64::MAX`), keeping its last
//! [`REPLAY_BUFFER`] batches. It prints `bound EP` then `replay EP` at start.
//!
//! stdin commands, one per line: `start` (publishing starts: the soak says it once
//! the relays are started, so that a relay's replay of the engine's history at its
//! start is a handful of batches, not a burst), `settle` (stop publishing, print
//! `published {"batches":N,"events":E}` — what it sent, the engine leg of the ledger —
//! and `held {"gpu":[…],"cpu":[…]}`: everything it holds, no final eviction), `quit`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use eventplane::zmtp::{Config, DealerSocket, Message, PubSocket};
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
    /// XOR of [`block_print`] over the device-tier blocks held.
    fingerprint: u64,
}

/// A block's share of a fingerprint (engine and router compute the same).
pub(crate) fn block_print(hash: u64) -> u64 {
    crate::rng::mix(hash ^ 0x5eed_f1e1_d0c5_0a4b)
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
            fingerprint: 0,
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
        let n = self.counts.entry((tier, hash)).or_default();
        *n += 1;
        if *n == 1 && tier == Tier::Gpu {
            self.fingerprint ^= block_print(hash);
        }
    }

    /// The fingerprint of the device-tier blocks held now.
    pub(crate) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The next batch's events.
    pub(crate) fn tick(&mut self) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        if self.rng.below(1000) < 2 {
            self.fifo.clear();
            self.counts.clear();
            self.tails.clear();
            self.fingerprint = 0;
            events.push(EngineEvent::Cleared(("AllBlocksCleared",)));
            return events;
        }
        for _ in 0..1 + self.rng.below(3) {
            if !self.fifo.is_empty() && self.rng.below(10) == 0 {
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
                    if tier == Tier::Gpu {
                        self.fingerprint ^= block_print(hash);
                    }
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

/// Batches kept for replay: 10,000, the engines' default.
pub(crate) const REPLAY_BUFFER: usize = 10_000;

/// The batches kept for replay, oldest first.
type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

const TOPIC: &[u8] = b"kv-events";

/// Milliseconds since the epoch: the clock engines and routers stamp prints with.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
    let socket = PubSocket::bind("tcp://127.0.0.1:0", config.clone())
        .await
        .map_err(|e| e.to_string())?;
    println!("bound {}", socket.local_endpoint().unwrap_or_default());
    let buffer: Buffer = Arc::default();
    let replay = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = replay.local_addr().map_err(|e| e.to_string())?;
    println!("replay tcp://{addr}");
    tokio::spawn(serve_replay(replay, buffer.clone(), config));
    let mut cache = Cache::new(&args);
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let mut tick = tokio::time::interval(args.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut report = tokio::time::interval(Duration::from_secs(1));
    let mut prints: Vec<(u64, u64)> = vec![(unix_ms(), 0)];
    let mut seq = 0u64;
    let mut events_sent = 0u64;
    let mut started = false;
    let mut quiet = false;
    loop {
        tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(l)) if l.trim() == "settle" && !quiet => {
                    quiet = true;
                    if !prints.is_empty() {
                        let line = serde_json::to_string(&prints).map_err(|e| e.to_string())?;
                        println!("fps {line}");
                    }
                    println!("published {{\"batches\":{seq},\"events\":{events_sent}}}");
                    let held = serde_json::to_string(&cache.held()).map_err(|e| e.to_string())?;
                    println!("held {held}");
                }
                Ok(Some(l)) if l.trim() == "start" => started = true,
                Ok(Some(l)) if l.trim() == "quit" => return Ok(()),
                Ok(Some(_)) => {}
                _ => return Ok(()),
            },
            _ = report.tick(), if !quiet && !prints.is_empty() => {
                let line = serde_json::to_string(&prints).map_err(|e| e.to_string())?;
                println!("fps {line}");
                prints.clear();
            }
            _ = tick.tick(), if started && !quiet => {
                let events = cache.tick();
                events_sent += events.len() as u64;
                let ts = seq as f64 * args.interval.as_secs_f64();
                let payload = Bytes::from(
                    rmp_serde::to_vec(&(ts, events, 0u32)).map_err(|e| e.to_string())?,
                );
                if let Ok(mut b) = buffer.lock() {
                    if b.len() >= REPLAY_BUFFER {
                        b.pop_front();
                    }
                    b.push_back((seq, payload.clone()));
                }
                socket.send(Message::from_parts([
                    Bytes::from_static(TOPIC),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ]));
                prints.push((unix_ms(), cache.fingerprint()));
                seq += 1;
            }
        }
    }
}

/// Serves replay requests, one task per connection.
async fn serve_replay(listener: tokio::net::TcpListener, buffer: Buffer, config: Config) {
    while let Ok((stream, _)) = listener.accept().await {
        let (buffer, config) = (buffer.clone(), config.clone());
        tokio::spawn(async move {
            let Ok(mut socket) = DealerSocket::accept_as_router(stream, config).await else {
                return;
            };
            while let Ok(request) = socket.recv().await {
                let Some(start) = request
                    .get(1)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_be_bytes)
                else {
                    continue;
                };
                let batches: Vec<(u64, Bytes)> = match buffer.lock() {
                    Ok(b) => b.iter().filter(|(s, _)| *s >= start).cloned().collect(),
                    Err(_) => return,
                };
                for (seq, payload) in batches {
                    let reply = Message::from_parts([
                        Bytes::new(),
                        Bytes::from_static(TOPIC),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ]);
                    if socket.send(&reply).await.is_err() {
                        return;
                    }
                }
                let end = Message::from_parts([
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
                    Bytes::new(),
                ]);
                if socket.send(&end).await.is_err() {
                    return;
                }
            }
        });
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
    fn the_cache_stays_within_capacity_and_its_fingerprint_is_what_it_holds() {
        let mut cache = Cache::new(&args());
        let mut reused = 0;
        for _ in 0..2000 {
            for ev in cache.tick() {
                if let EngineEvent::Stored(_, h, None, ..) = &ev {
                    reused += usize::from(h.len() == 1);
                }
            }
            assert!(cache.fifo.len() <= 64);
            let expected = cache
                .held()
                .gpu
                .iter()
                .fold(0, |fp, h| fp ^ block_print(*h));
            assert_eq!(cache.fingerprint(), expected);
        }
        assert!(reused > 50, "reuse happens: {reused}");
        assert!(!cache.held().gpu.is_empty());
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
