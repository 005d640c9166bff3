//! `soak router`: a router on the library, as an application would write one, that
//! also keeps the soak's ledger. It follows every `kv-events` publisher of a namespace
//! in etcd — our records and wire, and Dynamo's — into the library's index
//! ([`IndexFeed`]: DESIGN §4.5–4.7, a loss repaired from the worker's recovery log
//! when its record names one, else wiped; `Departed` drops the publisher), with a
//! [`RecoveryDriver`] asking the workers, and counts, per publisher, what it was
//! handed and what the subscriber says it lost.
//!
//! Once a second it prints `fps {"t": unix_ms, "workers": {worker: fp}}`: each
//! worker's device-tier blocks as the engine fingerprints its own
//! ([`block_print`](crate::engine::block_print)), for the oracle's fidelity samples.
//!
//! The `fps` line also carries the consumer's deliveries and the subscribers' dials
//! so far (`delivered`, `dials`): the work the oracle judges RSS and fds against.
//!
//! stdin commands, one per line: `stall MS` (stop reading the subscribers for MS
//! milliseconds: lanes fill and drop; the lanes' counters are read at its start, at
//! its end and a second later, into a [`StallRecord`]), `dump` (prints `index {…}`:
//! blocks per worker and the publishers followed), `quit` (drains, stops, prints
//! `report {…}`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use eventplane::discovery::{ChannelId, Discovery, EtcdDiscovery, Query};
use eventplane::kv::router::{
    IndexFeed, IndexFeedStats, RecoveryClientConfig, RecoveryDriver, RouterIndexConfig, Wipe,
};
use eventplane::subscriber::{
    Delivery, DynamicSubscriber, Notice, PublisherStats, SubscriberHandle,
};
use eventplane::wire::Dialect;
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
    /// Times its blocks were wiped (a loss not repaired), departures aside.
    pub(crate) wipes: u64,
    /// Events decoded from the messages consumed (the relay's `output_events`, when
    /// the router followed it from its first message and lost none).
    pub(crate) events: u64,
    pub(crate) undecodable: u64,
    /// Followings still listed after the subscriber stopped (no `Retired` for them).
    pub(crate) unsettled: u64,
    /// Unix ms of each `Connected` (the first and every reconnect) and `Departed`, as
    /// the consumer took them: when faults took effect.
    pub(crate) connected_ms: Vec<u64>,
    pub(crate) departed_ms: Vec<u64>,
}

/// One stall as the router saw it, from the lanes' counters.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct StallRecord {
    /// Unix ms of its start (the command read) and end (the consumer reading again).
    pub(crate) start_ms: u64,
    pub(crate) end_ms: u64,
    /// Messages received during it, in all and the most from one publisher.
    pub(crate) received: u64,
    pub(crate) most_received: u64,
    /// Lane drops during it, in all.
    pub(crate) dropped: u64,
    /// Lane drops per publisher from its start to a second after its end (the
    /// consumer takes a moment to empty full lanes).
    pub(crate) dropped_by_publisher: BTreeMap<String, u64>,
    /// Lanes that dropped during it yet held less than the lane capacity at its end
    /// (nothing reads a stalled lane): (publisher, depth).
    pub(crate) short_lanes: Vec<(String, u64)>,
}

/// A lane's discovery, over the router's life.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct DiscoveryCounts {
    /// Watch streams the etcd backend re-established (`DiscoveryStats::reconnects`).
    pub(crate) reconnects: u64,
    /// Times the subscriber re-opened its watch (`SubscriberStats::rewatches`).
    pub(crate) rewatches: u64,
    /// Unix ms at which their sum was seen to grow (polled once a second).
    pub(crate) changed_ms: Vec<u64>,
}

/// One publisher's lane counters at an instant.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) received: u64,
    pub(crate) dropped: u64,
    pub(crate) depth: u64,
}

/// A stall's record from the lanes' counters at its start (`before`), at its end
/// before the consumer read again (`at_end`), and a second later (`after`). A
/// publisher followed anew meanwhile counts from zero: its counters are its own.
pub(crate) fn stall_record(
    (start_ms, end_ms): (u64, u64),
    before: &BTreeMap<String, Counts>,
    at_end: &BTreeMap<String, Counts>,
    after: &BTreeMap<String, Counts>,
    lane_capacity: u64,
) -> StallRecord {
    let since = |key: &str, now: &Counts| match before.get(key) {
        Some(b) if now.received >= b.received && now.dropped >= b.dropped => Counts {
            received: now.received - b.received,
            dropped: now.dropped - b.dropped,
            depth: now.depth,
        },
        _ => *now,
    };
    let mut r = StallRecord {
        start_ms,
        end_ms,
        ..StallRecord::default()
    };
    for (key, now) in at_end {
        let d = since(key.as_str(), now);
        r.received += d.received;
        r.most_received = r.most_received.max(d.received);
        r.dropped += d.dropped;
        if d.dropped > 0 && now.depth < lane_capacity {
            r.short_lanes.push((key.clone(), now.depth));
        }
    }
    for (key, now) in after {
        let d = since(key.as_str(), now);
        if d.dropped > 0 {
            r.dropped_by_publisher.insert(key.clone(), d.dropped);
        }
    }
    r
}

/// A stall under way, or just over (its drops are charged to it for a second more).
struct StallWatch {
    start_ms: u64,
    end_ms: u64,
    before: BTreeMap<String, Counts>,
    at_end: Option<BTreeMap<String, Counts>>,
    until: Option<tokio::time::Instant>,
}

impl StallWatch {
    fn finish(self, after: &BTreeMap<String, Counts>, lane_capacity: u64) -> StallRecord {
        // Cut short (another stall, or quit): it ends now.
        let (at_end, end_ms) = match &self.at_end {
            Some(m) => (m, self.end_ms),
            None => (after, crate::engine::unix_ms()),
        };
        stall_record(
            (self.start_ms, end_ms),
            &self.before,
            at_end,
            after,
            lane_capacity,
        )
    }
}

/// Every publisher's lane counters now, in both lanes, by `ChannelId` as reports
/// name them.
fn snapshot(lanes: [&Lane; 2]) -> BTreeMap<String, Counts> {
    lanes
        .iter()
        .flat_map(|l| l.handle.stats().publishers)
        .map(|(id, s)| {
            let counts = Counts {
                received: s.received,
                dropped: s.dropped_lane_full,
                depth: s.depth as u64,
            };
            (id.to_string(), counts)
        })
        .collect()
}

/// What a router process reports at exit.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct RouterReport {
    pub(crate) publishers: BTreeMap<String, Ledger>,
    pub(crate) notices_dropped: u64,
    pub(crate) events: u64,
    pub(crate) stalls: u64,
    /// Wipes by wire (`eventplane`, `dynamo`), then cause (`id_gap`, `reconnected`,
    /// `recovery_failed`, `held_overflow`).
    pub(crate) wipes: BTreeMap<String, BTreeMap<String, u64>>,
    /// Losses repaired from the workers' logs: events since the gap.
    pub(crate) repairs_since: u64,
    /// ... a dump (a publisher's first sight included).
    pub(crate) repairs_dump: u64,
    /// ... a dump asked again after a failed recovery wiped the publisher.
    pub(crate) repairs_rebuild: u64,
    /// Live events skipped as late copies of a recovery answer.
    pub(crate) late_duplicates: u64,
    /// Live events dropped while held for a recovery (asked for again).
    pub(crate) held_dropped: u64,
    /// Of the last 256 repairs, the 99th-percentile time from request to answer.
    pub(crate) repair_p99_ms: u64,
    /// Unix ms when its lanes were up (`ready`) and when it was told to quit.
    pub(crate) ready_ms: u64,
    pub(crate) quit_ms: u64,
    /// Every stall, as the lanes went through it.
    pub(crate) stall_records: Vec<StallRecord>,
    /// Each lane's discovery, by wire.
    pub(crate) discovery: BTreeMap<String, DiscoveryCounts>,
    /// Unix ms at which the lanes' dials after a publisher's first (reconnects and
    /// failed dials) were seen to grow, polled once a second: when the router noticed
    /// a connection was gone.
    pub(crate) dials_ms: Vec<u64>,
}

/// `index` output: every block held per worker, and the publishers followed.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct IndexDump {
    pub(crate) workers: BTreeMap<u64, Held>,
    /// Publisher ids followed now (by the subscriber) or indexed.
    pub(crate) publishers: BTreeSet<u64>,
}

struct State {
    ledgers: HashMap<ChannelId, Ledger>,
    /// The router's index, fed by both lanes.
    feed: IndexFeed,
    /// Wipes by wire, then cause.
    wipes: BTreeMap<String, BTreeMap<String, u64>>,
    stalls: u64,
    stall_records: Vec<StallRecord>,
    /// Messages the consumer took, every publisher.
    delivered: u64,
    ready_ms: u64,
    /// The lanes' dials after a publisher's first, as last polled, and when they grew.
    dials: u64,
    dials_ms: Vec<u64>,
}

/// The wire's label in reports.
fn wire_name(wire: Dialect) -> String {
    wire.as_str().to_owned()
}

fn cause_name(cause: Wipe) -> &'static str {
    match cause {
        Wipe::IdGap { .. } => "id_gap",
        Wipe::Reconnected => "reconnected",
        Wipe::Departed => "departed",
        Wipe::RecoveryFailed => "recovery_failed",
        Wipe::HeldOverflow => "held_overflow",
        Wipe::Superseded => "superseded",
        _ => "other",
    }
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
            self.deliver(lane, &d);
        }
        for n in after {
            self.notice(n);
        }
        self.count_wipes();
    }

    /// Credits the wipes the feed made to their publishers.
    fn count_wipes(&mut self) {
        for w in self.feed.wiped() {
            if w.cause == Wipe::Departed {
                continue;
            }
            let l = self.ledgers.entry(w.publisher).or_default();
            l.wipes += 1;
            *self
                .wipes
                .entry(l.wire.clone())
                .or_default()
                .entry(cause_name(w.cause).to_owned())
                .or_default() += 1;
        }
    }

    fn deliver(&mut self, lane: &mut Lane, d: &Delivery) {
        let id = &d.source.id;
        // The id is cloned once per publisher, never per message.
        if !self.ledgers.contains_key(id) {
            self.ledgers.insert(id.clone(), Ledger::default());
        }
        let Some(l) = self.ledgers.get_mut(id) else {
            return;
        };
        if l.wire.is_empty() {
            l.wire = wire_name(lane.wire);
        }
        l.consumed += 1;
        self.delivered += 1;
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
        // Decoded here too, for the ledger's event count (the feed decodes its own).
        let events = d
            .payload()
            .and_then(|p| lane.wire.decode_router_events(&p).ok());
        if let Some(events) = &events {
            l.events += events.len() as u64;
        }
        // Dynamo's records name no worker: its events do (for the faults' bookkeeping).
        l.worker_id = d
            .source
            .worker
            .map(|w| w.worker_id.0)
            .or(l.worker_id)
            .or_else(|| events.and_then(|e| e.first().map(|e| e.worker_id.0)));
        if self.feed.delivery(lane.wire, d).is_err() {
            l.undecodable += 1;
        }
    }

    fn notice(&mut self, n: Notice) {
        self.feed.notice(&n);
        match n {
            Notice::Connected(instance) => {
                let l = self.ledgers.entry(instance.id.clone()).or_default();
                l.departed = false;
                l.connected += 1;
                l.connected_ms.push(crate::engine::unix_ms());
                l.worker_id = instance.worker.map(|w| w.worker_id.0).or(l.worker_id);
            }
            Notice::Retired { id, stats } => {
                self.ledgers
                    .entry(id)
                    .or_default()
                    .lives
                    .push(Life::from(&*stats));
            }
            Notice::Departed(id) => {
                let l = self.ledgers.entry(id).or_default();
                l.departed = true;
                l.departed_ms.push(crate::engine::unix_ms());
            }
            _ => {}
        }
    }
}

/// Every worker's device-tier blocks in the index, and the publishers the
/// subscribers follow.
fn dump(feed: &IndexFeed, followed: &[ChannelId]) -> IndexDump {
    let mut dump = IndexDump::default();
    let index = feed.index();
    for (worker, rank) in index.ranks() {
        let held = dump.workers.entry(worker.0).or_default();
        held.gpu
            .extend(index.rank_block_hashes(worker, rank).map(|h| h.0));
    }
    dump.publishers
        .extend(followed.iter().map(ChannelId::publisher_id));
    for held in dump.workers.values_mut() {
        held.gpu.sort_unstable();
        held.gpu.dedup();
    }
    dump.workers.retain(|_, h| !h.gpu.is_empty());
    dump
}

/// Each worker's fingerprint over the index.
fn fingerprints(feed: &IndexFeed) -> BTreeMap<u64, u64> {
    let mut fps = BTreeMap::new();
    let index = feed.index();
    for (worker, rank) in index.ranks() {
        let fp = fps.entry(worker.0).or_insert(0u64);
        for h in index.rank_block_hashes(worker, rank) {
            *fp ^= crate::engine::block_print(h.0);
        }
    }
    fps
}

#[derive(Serialize)]
struct Prints {
    t: u64,
    workers: BTreeMap<u64, u64>,
    /// Messages the consumer took so far.
    delivered: u64,
    /// Dials after a publisher's first so far, both lanes: reconnects and failures.
    dials: u64,
}

/// One subscriber per record format and wire.
struct Lane {
    wire: Dialect,
    sub: DynamicSubscriber,
    handle: SubscriberHandle,
    /// The subscriber's discovery (a clone: the same session), for its counters.
    discovery: EtcdDiscovery,
    counts: DiscoveryCounts,
}

impl Lane {
    /// Reads the lane's counters: notes when its discovery reconnected or re-watched;
    /// its dials after a publisher's first so far.
    fn poll(&mut self, now_ms: u64) -> u64 {
        let stats = self.handle.stats();
        let reconnects = self.discovery.stats().reconnects;
        if reconnects + stats.rewatches > self.counts.reconnects + self.counts.rewatches {
            self.counts.changed_ms.push(now_ms);
        }
        self.counts.reconnects = reconnects;
        self.counts.rewatches = stats.rewatches;
        stats.total.reconnects + stats.total.connect_failures
    }
}

async fn lane(args: &RouterArgs, wire: Dialect) -> Result<Lane, String> {
    let discovery = EtcdDiscovery::builder([args.etcd.clone()])
        .dialect(wire)
        .connect()
        .await
        .map_err(|e| format!("cannot reach discovery: {e}"))?;
    let zmtp = eventplane::zmtp::Config::builder()
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .heartbeat_timeout(Some(Duration::from_secs(3)))
        .build()
        .map_err(|e| e.to_string())?;
    let watched = discovery.clone();
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
    Ok(Lane {
        wire,
        sub,
        handle,
        discovery: watched,
        counts: DiscoveryCounts::default(),
    })
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Runs the router until `quit` (or stdin closes); prints the report.
pub(crate) async fn run(args: RouterArgs) -> Result<(), String> {
    let mut lanes = [
        lane(&args, Dialect::EventPlane).await?,
        lane(&args, Dialect::Dynamo).await?,
    ];
    println!("ready");
    let mut state = State {
        ledgers: HashMap::new(),
        feed: IndexFeed::new(RouterIndexConfig::default()),
        wipes: BTreeMap::new(),
        stalls: 0,
        stall_records: Vec::new(),
        delivered: 0,
        ready_ms: crate::engine::unix_ms(),
        dials: 0,
        dials_ms: Vec::new(),
    };
    // Dynamo-wire workers advertise Dynamo's KV query endpoint: their answers come
    // back on this listener.
    let home = eventplane::kv::dynamo_recovery::CallHomeListener::bind(
        std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
        eventplane::kv::dynamo_recovery::CallHomeConfig::default(),
    )
    .await
    .map_err(|e| format!("call-home listener: {e}"))?;
    let mut driver =
        RecoveryDriver::new(RecoveryClientConfig::default()).dynamo(std::sync::Arc::new(home));
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    let (mut batch_a, mut batch_b) = (Vec::with_capacity(256), Vec::with_capacity(256));
    let mut notices = Vec::new();
    // Once a second from a second after the start: samples spread evenly over the
    // router's life, a restart's rebuild included.
    let mut prints = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    prints.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let [a, b] = &mut lanes;
    // A stall stops the consumer (its lanes, notices and recoveries), not the
    // once-a-second prints: the index is sampled as it trails.
    let mut stalled_until: Option<tokio::time::Instant> = None;
    let mut watch: Option<StallWatch> = None;
    let capacity = args.lane_capacity as u64;
    loop {
        let stalled = stalled_until.is_some_and(|t| tokio::time::Instant::now() < t);
        if !stalled {
            if let (Some(_), Some(w)) = (stalled_until.take(), watch.as_mut()) {
                // The stall is over: the lanes as it left them, before the consumer
                // reads again; its drops are counted for a second more.
                w.at_end = Some(snapshot([&*a, &*b]));
                w.end_ms = crate::engine::unix_ms();
                w.until = Some(tokio::time::Instant::now() + Duration::from_secs(1));
            }
            let now = tokio::time::Instant::now();
            if let Some(w) = watch.take_if(|w| w.until.is_some_and(|u| now >= u)) {
                let record = w.finish(&snapshot([&*a, &*b]), capacity);
                state.stall_records.push(record);
            }
            driver.submit(state.feed.take_recoveries());
        }
        tokio::select! {
            line = lines.next_line() => {
                let line = line.ok().flatten().unwrap_or_else(|| "quit".to_owned());
                let mut words = line.split_whitespace();
                match (words.next(), words.next().and_then(|w| w.parse().ok())) {
                    (Some("stall"), Some(ms)) => {
                        state.stalls += 1;
                        let now = snapshot([&*a, &*b]);
                        if let Some(w) = watch.take() {
                            state.stall_records.push(w.finish(&now, capacity));
                        }
                        watch = Some(StallWatch {
                            start_ms: crate::engine::unix_ms(),
                            end_ms: 0,
                            before: now,
                            at_end: None,
                            until: None,
                        });
                        stalled_until = Some(tokio::time::Instant::now() + Duration::from_millis(ms));
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
                        let dump = serde_json::to_string(&dump(&state.feed, &followed)).map_err(|e| e.to_string())?;
                        println!("index {dump}");
                    }
                    (Some("quit"), _) => break,
                    _ => {}
                }
            }
            _ = prints.tick() => {
                let t = crate::engine::unix_ms();
                let dials = a.poll(t) + b.poll(t);
                if dials > state.dials {
                    state.dials = dials;
                    state.dials_ms.push(t);
                }
                let p = Prints { t, workers: fingerprints(&state.feed), delivered: state.delivered, dials };
                println!("fps {}", serde_json::to_string(&p).map_err(|e| e.to_string())?);
            }
            () = sleep_until(stalled_until), if stalled => {}
            answer = driver.next(), if !stalled => state.feed.recovered(answer),
            () = a.handle.notice_ready(), if !stalled => {}
            () = b.handle.notice_ready(), if !stalled => {}
            _ = a.sub.recv_many(&mut batch_a, 256), if !stalled => state.batch(a, &mut batch_a, &mut notices),
            _ = b.sub.recv_many(&mut batch_b, 256), if !stalled => state.batch(b, &mut batch_b, &mut notices),
        }
        if stalled {
            continue;
        }
        for l in [&mut *a, &mut *b] {
            l.sub.take_notices(&mut notices);
            for n in notices.drain(..) {
                state.notice(n);
            }
        }
        state.count_wipes();
    }
    let quit_ms = crate::engine::unix_ms();
    if let Some(w) = watch.take() {
        state
            .stall_records
            .push(w.finish(&snapshot([&*a, &*b]), capacity));
    }
    let mut report = finish(lanes, state).await;
    report.quit_ms = quit_ms;
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
        l.poll(crate::engine::unix_ms());
        report.discovery.insert(wire_name(l.wire), l.counts.clone());
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
    state.count_wipes();
    let f: IndexFeedStats = state.feed.stats();
    report.events = f.events;
    report.stalls = state.stalls;
    report.wipes = std::mem::take(&mut state.wipes);
    report.repairs_since = f.repairs_since;
    report.repairs_dump = f.repairs_dump;
    report.repairs_rebuild = f.repairs_rebuild;
    report.late_duplicates = f.late_duplicates;
    report.held_dropped = f.held_dropped;
    report.repair_p99_ms = f.repair_p99_ms;
    report.ready_ms = state.ready_ms;
    report.dials_ms = std::mem::take(&mut state.dials_ms);
    report.stall_records = std::mem::take(&mut state.stall_records);
    report.publishers = state
        .ledgers
        .into_iter()
        .map(|(id, l)| (id.to_string(), l))
        .collect();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(all: &[(&str, u64, u64, u64)]) -> BTreeMap<String, Counts> {
        all.iter()
            .map(|&(k, received, dropped, depth)| {
                let c = Counts {
                    received,
                    dropped,
                    depth,
                };
                (k.to_owned(), c)
            })
            .collect()
    }

    #[test]
    fn a_stall_record_charges_drops_and_finds_short_lanes() {
        let before = counts(&[("a", 100, 0, 1), ("b", 50, 0, 0)]);
        // `a` received 50 during the stall, dropped 18, its lane full at 32; `c`
        // appeared meanwhile (a new following: its own counters).
        let at_end = counts(&[("a", 150, 18, 32), ("b", 55, 0, 5), ("c", 40, 8, 32)]);
        let after = counts(&[("a", 152, 19, 0), ("b", 56, 0, 0), ("c", 41, 8, 0)]);
        let r = stall_record((1, 2), &before, &at_end, &after, 32);
        assert_eq!((r.received, r.most_received, r.dropped), (95, 50, 26));
        let charged: BTreeMap<String, u64> = [("a".to_owned(), 19), ("c".to_owned(), 8)].into();
        assert_eq!(r.dropped_by_publisher, charged);
        assert!(r.short_lanes.is_empty());
        // A lane that stopped taking messages at half its capacity (audit H1 a).
        let half = counts(&[("a", 150, 34, 16)]);
        let r = stall_record((1, 2), &before, &half, &half, 32);
        assert_eq!(r.short_lanes, [("a".to_owned(), 16)]);
    }
}
