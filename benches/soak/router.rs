//! `soak router`: a router on the library, as an application would write one, that
//! also keeps the soak's ledger. It follows every `kv-events` publisher of a namespace
//! in etcd — our records and wire, and Dynamo's — indexes their blocks per publisher
//! (DESIGN §4.5: an event id that is not the next, or a reconnection, forgets that
//! publisher's blocks; `Departed` forgets the publisher), and counts, per publisher,
//! what it was handed and what the subscriber says it lost.
//!
//! stdin commands, one per line: `stall MS` (stop reading the subscribers for MS
//! milliseconds: lanes fill and drop), `dump` (prints `index {…}`: blocks per worker
//! and the publishers followed), `quit` (drains, stops, prints `report {…}`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use eventplane::discovery::{ChannelId, DynamoRecords, EtcdDiscovery, Query, RecordFormat};
use eventplane::kv::{KvEventData, StorageTier, decode_router_payload};
use eventplane::subscriber::{
    Delivery, DynamicSubscriber, Notice, PublisherStats, SubscriberHandle,
};
use eventplane::wire::Wire;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncBufReadExt;

use crate::engine::Held;

/// The router's knobs.
#[derive(Debug, Clone)]
pub(crate) struct RouterArgs {
    pub(crate) etcd: String,
    pub(crate) namespace: String,
    /// Small, so that a stalled consumer makes the lanes drop.
    pub(crate) lane_capacity: usize,
}

/// The subscriber's counters of one following of a publisher, as the report keeps
/// them.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Life {
    pub(crate) received: u64,
    pub(crate) delivered: u64,
    pub(crate) dropped_lane_full: u64,
    pub(crate) dropped_budget: u64,
    pub(crate) dropped_filtered_topic: u64,
    pub(crate) dropped_malformed: u64,
    pub(crate) gaps: u64,
    pub(crate) gap_messages: u64,
    pub(crate) sequence_resets: u64,
    pub(crate) reconnects: u64,
    pub(crate) depth: u64,
    pub(crate) first_sequence: Option<u64>,
    pub(crate) last_sequence: Option<u64>,
}

impl Life {
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped_lane_full
            + self.dropped_budget
            + self.dropped_filtered_topic
            + self.dropped_malformed
    }
}

impl From<&PublisherStats> for Life {
    fn from(s: &PublisherStats) -> Life {
        Life {
            received: s.received,
            delivered: s.delivered,
            dropped_lane_full: s.dropped_lane_full,
            dropped_budget: s.dropped_budget,
            dropped_filtered_topic: s.dropped_filtered_topic,
            dropped_malformed: s.dropped_malformed,
            gaps: s.gaps,
            gap_messages: s.gap_messages,
            sequence_resets: s.sequence_resets,
            reconnects: s.reconnects,
            depth: s.depth as u64,
            first_sequence: s.first_sequence,
            last_sequence: s.last_sequence,
        }
    }
}

/// What one publisher (one id: a relay incarnation) was credited with.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Ledger {
    pub(crate) wire: String,
    pub(crate) worker_id: Option<u64>,
    /// Messages the consumer took (counted here, not by the subscriber).
    pub(crate) consumed: u64,
    pub(crate) first_consumed: Option<u64>,
    pub(crate) last_consumed: Option<u64>,
    /// Messages whose sequence was not above the last consumed one.
    pub(crate) duplicates: u64,
    /// Messages consumed after `Departed` and before a new `Connected`.
    pub(crate) after_departure: u64,
    /// The subscriber's counters of each following that ended (`Retired`), then of the
    /// one still followed at exit.
    pub(crate) lives: Vec<Life>,
    pub(crate) departed: bool,
    pub(crate) connected: u64,
    /// Times its blocks were forgotten (an event id gap, a reconnection).
    pub(crate) wipes: u64,
    pub(crate) undecodable: u64,
    /// Followings still listed after the subscriber stopped (no `Retired` for them).
    pub(crate) unsettled: u64,
}

/// What a router process reports at exit.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct RouterReport {
    pub(crate) publishers: BTreeMap<String, Ledger>,
    pub(crate) notices_dropped: u64,
    pub(crate) events: u64,
    pub(crate) stalls: u64,
}

/// `index` output: every block held per worker, and the publishers followed.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct IndexDump {
    pub(crate) workers: BTreeMap<u64, Held>,
    /// Publisher ids followed now (by the subscriber) or indexed.
    pub(crate) publishers: BTreeSet<u64>,
}

type Blocks = HashMap<(u64, StorageTier), HashSet<u64>>;

#[derive(Default)]
struct Followed {
    blocks: Blocks,
    next_id: u64,
}

#[derive(Default)]
struct State {
    ledgers: HashMap<ChannelId, Ledger>,
    index: HashMap<ChannelId, Followed>,
    events: u64,
    stalls: u64,
}

impl State {
    /// Applies a batch of `lane` with the notices queued by then: a `Connected` before
    /// it (its connection's messages come after it; in the batch, perhaps), the others
    /// after it (a `Departed` follows its publisher's last delivery, perhaps in the
    /// batch). A `Departed` followed by a `Connected` of the same publisher (it left
    /// and came back) is applied before, with it.
    fn batch(&mut self, lane: &mut Lane, batch: &mut Vec<Delivery>, notices: &mut Vec<Notice>) {
        lane.sub.take_notices(notices);
        let returned = |i: usize, id: &ChannelId, all: &[Notice]| {
            all.iter()
                .skip(i + 1)
                .any(|n| matches!(n, Notice::Connected(c) if &c.id == id))
        };
        let before: Vec<bool> = notices
            .iter()
            .enumerate()
            .map(|(i, n)| match n {
                Notice::Connected(_) => true,
                Notice::Departed(id) => returned(i, id, notices),
                _ => false,
            })
            .collect();
        let mut after = Vec::new();
        for (n, first) in notices.drain(..).zip(before) {
            if first {
                self.notice(n);
            } else {
                after.push(n);
            }
        }
        for d in batch.drain(..) {
            self.deliver(lane.wire, &d);
        }
        for n in after {
            self.notice(n);
        }
    }

    fn deliver(&mut self, wire: Wire, d: &Delivery) {
        let id = &d.source.id;
        // The id is cloned once per publisher, never per message.
        if !self.ledgers.contains_key(id) {
            self.ledgers.insert(id.clone(), Ledger::default());
        }
        let Some(l) = self.ledgers.get_mut(id) else {
            return;
        };
        if l.wire.is_empty() {
            l.wire = wire.as_str().to_owned();
        }
        l.consumed += 1;
        if l.departed {
            l.after_departure += 1;
        }
        if let Some(s) = d.sequence {
            if l.last_consumed.is_some_and(|last| s <= last) {
                l.duplicates += 1;
            }
            l.first_consumed.get_or_insert(s);
            l.last_consumed = Some(s);
        }
        let Some(events) = d
            .payload()
            .and_then(|p| decode_router_payload(wire, &p).ok())
        else {
            l.undecodable += 1;
            return;
        };
        if !self.index.contains_key(id) {
            self.index.insert(id.clone(), Followed::default());
        }
        let Some(f) = self.index.get_mut(id) else {
            return;
        };
        for ev in &events {
            l.worker_id = Some(ev.worker_id.0);
            if f.next_id != 0 && ev.event.id != f.next_id {
                f.blocks.clear();
                l.wipes += 1;
            }
            f.next_id = ev.event.id.saturating_add(1);
            let key = (ev.worker_id.0, ev.tier);
            match &ev.event.data {
                KvEventData::Stored { blocks, .. } => {
                    let set = f.blocks.entry(key).or_default();
                    set.extend(blocks.iter().map(|b| b.block_hash.0));
                }
                KvEventData::Removed { block_hashes } => {
                    if let Some(set) = f.blocks.get_mut(&key) {
                        for h in block_hashes {
                            set.remove(&h.0);
                        }
                    }
                }
                KvEventData::Cleared => f.blocks.retain(|(w, _), _| *w != ev.worker_id.0),
                _ => {}
            }
        }
        self.events += events.len() as u64;
    }

    fn notice(&mut self, n: Notice) {
        match n {
            Notice::Connected(instance) => {
                let l = self.ledgers.entry(instance.id.clone()).or_default();
                l.departed = false;
                l.connected += 1;
                if l.connected > 1 {
                    if let Some(f) = self.index.get_mut(&instance.id) {
                        f.blocks.clear();
                        f.next_id = 0;
                        l.wipes += 1;
                    }
                }
            }
            Notice::Retired { id, stats } => {
                self.ledgers
                    .entry(id)
                    .or_default()
                    .lives
                    .push(Life::from(&*stats));
            }
            Notice::Departed(id) => {
                self.ledgers.entry(id.clone()).or_default().departed = true;
                self.index.remove(&id);
            }
            _ => {}
        }
    }

    fn dump(&self, followed: &[ChannelId]) -> IndexDump {
        let mut dump = IndexDump::default();
        for (id, f) in &self.index {
            dump.publishers.insert(id.publisher_id());
            for ((worker, tier), set) in &f.blocks {
                let held = dump.workers.entry(*worker).or_default();
                match tier {
                    StorageTier::Device => held.gpu.extend(set),
                    _ => held.cpu.extend(set),
                }
            }
        }
        dump.publishers
            .extend(followed.iter().map(ChannelId::publisher_id));
        for held in dump.workers.values_mut() {
            for v in [&mut held.gpu, &mut held.cpu] {
                v.sort_unstable();
                v.dedup();
            }
        }
        dump.workers
            .retain(|_, h| !h.gpu.is_empty() || !h.cpu.is_empty());
        dump
    }
}

/// One subscriber per record format and wire.
struct Lane {
    wire: Wire,
    sub: DynamicSubscriber,
    handle: SubscriberHandle,
}

async fn lane(args: &RouterArgs, wire: Wire) -> Result<Lane, String> {
    let format = match wire {
        Wire::Dynamo => RecordFormat::Dynamo(DynamoRecords::new()),
        _ => RecordFormat::EventPlane,
    };
    let discovery = EtcdDiscovery::builder([args.etcd.clone()])
        .record_format(format)
        .connect()
        .await
        .map_err(|e| format!("cannot reach discovery: {e}"))?;
    let zmtp = eventplane::zmtp::Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_timeout(Some(Duration::from_secs(3)))
        .build()
        .map_err(|e| e.to_string())?;
    let sub = DynamicSubscriber::builder(
        Arc::new(discovery),
        Query::new(args.namespace.clone()).topic("kv-events"),
    )
    .topic("kv-events")
    .layout(wire.layout())
    .lane_capacity(args.lane_capacity)
    .zmtp_config(zmtp)
    .notices(1 << 16)
    .spawn()
    .map_err(|e| e.to_string())?;
    let handle = sub.handle();
    Ok(Lane { wire, sub, handle })
}

/// Runs the router until `quit` (or stdin closes); prints the report.
pub(crate) async fn run(args: RouterArgs) -> Result<(), String> {
    let mut lanes = [
        lane(&args, Wire::EventPlane).await?,
        lane(&args, Wire::Dynamo).await?,
    ];
    println!("ready");
    let mut state = State::default();
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let (mut batch_a, mut batch_b) = (Vec::with_capacity(256), Vec::with_capacity(256));
    let mut notices = Vec::new();
    let [a, b] = &mut lanes;
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let line = line.ok().flatten().unwrap_or_else(|| "quit".to_owned());
                let mut words = line.split_whitespace();
                match (words.next(), words.next().and_then(|w| w.parse().ok())) {
                    (Some("stall"), Some(ms)) => {
                        state.stalls += 1;
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    (Some("dump"), _) => {
                        let followed: Vec<ChannelId> = [&*a, &*b]
                            .iter()
                            .flat_map(|l| l.handle.stats().publishers.into_iter().map(|(id, _)| id))
                            .collect();
                        for l in [&mut *a, &mut *b] {
                            l.sub.take_notices(&mut notices);
                            for n in notices.drain(..) { state.notice(n); }
                        }
                        let dump = serde_json::to_string(&state.dump(&followed)).map_err(|e| e.to_string())?;
                        println!("index {dump}");
                    }
                    (Some("quit"), _) => break,
                    _ => {}
                }
            }
            () = a.handle.notice_ready() => {}
            () = b.handle.notice_ready() => {}
            _ = a.sub.recv_many(&mut batch_a, 256) => state.batch(a, &mut batch_a, &mut notices),
            _ = b.sub.recv_many(&mut batch_b, 256) => state.batch(b, &mut batch_b, &mut notices),
        }
        for l in [&mut *a, &mut *b] {
            l.sub.take_notices(&mut notices);
            for n in notices.drain(..) {
                state.notice(n);
            }
        }
    }
    let report = finish(lanes, state).await;
    println!(
        "report {}",
        serde_json::to_string(&report).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// Drains what the lanes hold, stops, and closes every ledger with the counters of
/// the publishers still followed.
async fn finish(mut lanes: [Lane; 2], mut state: State) -> RouterReport {
    let mut batch = Vec::new();
    let mut notices = Vec::new();
    let mut report = RouterReport::default();
    for l in &mut lanes {
        // Stopped first: every connection ends and its following retires; then what
        // the lanes still hold is taken (nothing arrives any more; `recv_many` returns
        // 0 once drained), so that every following settles and tells its counters in
        // a `Retired`. A drain that never ends is the driver's `router_reports`
        // violation (no report within its bound), not a silent cut.
        l.handle.shutdown().await;
        while l.sub.recv_many(&mut batch, 256).await > 0 {
            state.batch(l, &mut batch, &mut notices);
        }
        let stats = l.handle.stats();
        l.sub.take_notices(&mut notices);
        for n in notices.drain(..) {
            state.notice(n);
        }
        // A following still listed (it never retired): its counters now, flagged.
        for (id, s) in stats.publishers {
            let l = state.ledgers.entry(id).or_default();
            l.unsettled += 1;
            l.lives.push(Life::from(&s));
        }
        report.notices_dropped += stats.notices_dropped;
    }
    report.events = state.events;
    report.stalls = state.stalls;
    report.publishers = state
        .ledgers
        .into_iter()
        .map(|(id, l)| (id.to_string(), l))
        .collect();
    report
}
