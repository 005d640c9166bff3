//! Repair from an engine's replay buffer, sans-IO.
//!
//! vLLM, SGLang and TensorRT-LLM keep their last batches (10,000 by default) and serve
//! them on a ZMQ ROUTER: a request `["", start_seq u64be]` is answered with one reply
//! per buffered batch whose sequence is at least `start_seq`, then an end marker
//! (sequence `u64::MAX`, `-1` as the engines spell it, with an empty payload). Two
//! reply layouts exist after the empty delimiter: `[seq, payload]` (vLLM ≤ 0.25) and
//! `[topic, seq, payload]` (vLLM ≥ 0.26, SGLang; the end marker's topic is empty).
//!
//! [`Repair`] decides, from the live batches and the replies, what the listener
//! applies, when it asks for a replay and when it must give up and clear. It keeps an
//! *anchor*: the sequence and xxh3-64 digest of the last batch applied. A replay asks
//! from the anchor itself, so its first reply proves continuity (the same batch) or a
//! new engine behind the same endpoint (another batch at that number): a relay that
//! reconnects tells an engine restart from a network blip without guessing.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::zmtp::Message;

/// How long a replay waits for its next reply (the first one included) before it
/// gives up and the listener clears: 2 s. Engines answer between two of their own
/// batches (vLLM polls its replay socket at least every 100 ms).
pub(crate) const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest one replay may take, replies arriving or not: 30 s.
pub(crate) const DEFAULT_REPLAY_DEADLINE: Duration = Duration::from_secs(30);

/// Most batches applied from one replay: 10,000 (an engine's default buffer). A
/// replay that has more stops there; what follows is asked for by the next one.
pub(crate) const DEFAULT_MAX_REPLAY_BATCHES: u64 = 10_000;

/// Most live batches held while a replay runs: 4,096. Beyond it (or
/// [`MAX_HELD_BYTES`]) live batches are dropped, counted in
/// [`EngineReplayStats::held_dropped`], and fetched by a further replay (the engine
/// still buffers them).
pub(crate) const MAX_HELD_BATCHES: usize = 4096;

/// Most payload bytes of live batches held while a replay runs: 16 MiB.
pub(crate) const MAX_HELD_BYTES: usize = 16 << 20;

/// After a replay failed (timeout, unreachable endpoint), gaps within this long are
/// cleared at once instead of waiting for another timeout: 5 s.
pub(crate) const REPLAY_RETRY_AFTER: Duration = Duration::from_secs(5);

/// How long the engine must be quiet, after live batches or a replay that brought
/// some, before one more replay asks whether anything followed: 250 ms at first. An
/// engine's PUB drops the *last* batches of a burst as readily as the middle ones, and
/// with nothing published after them no gap would show until the engine's next batch.
/// Each probe that finds nothing doubles the wait, up to [`REPLAY_TAIL_PROBE_MAX`]; one
/// that finds batches starts it over.
pub(crate) const REPLAY_TAIL_PROBE: Duration = Duration::from_millis(250);

/// The longest wait before a tail probe: 4 s (see [`REPLAY_TAIL_PROBE`]).
pub(crate) const REPLAY_TAIL_PROBE_MAX: Duration = Duration::from_secs(4);

/// Rounds in a row that apply nothing before the repair gives up (`no_progress`).
const MAX_BARREN_ROUNDS: u32 = 2;

/// Batches whose digests are kept to tell a late live copy of a replayed batch from a
/// new engine's batch under the same number.
const RECENT: usize = 1024;

/// The end marker's sequence: `-1` as a signed 64-bit big-endian integer.
const END_SEQ: u64 = u64::MAX;

/// Why a loss could not be repaired from the engine's buffer, so the listener cleared
/// the worker's blocks in every router.
///
/// ```
/// use eventplane::kv::engine::ReplayFallback;
/// assert_eq!(ReplayFallback::TooNew.as_str(), "too_new");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplayFallback {
    /// The replay endpoint could not be reached (or its connection failed).
    Unreachable,
    /// No reply within the replay timeout, or the replay ran past its deadline.
    Timeout,
    /// The engine's buffer no longer holds the first missing batch.
    TooNew,
    /// A new engine behind the endpoint: the batch at the anchor's number differs, the
    /// buffer is empty, or the live sequence went backwards. The new engine's buffer
    /// is replayed from 0 after the clear.
    Restart,
    /// Replays in a row brought nothing that closed the gap.
    NoProgress,
}

impl ReplayFallback {
    /// Every cause, in the order of [`as_str`](Self::as_str)'s labels.
    pub const ALL: [ReplayFallback; 5] = [
        ReplayFallback::Unreachable,
        ReplayFallback::Timeout,
        ReplayFallback::TooNew,
        ReplayFallback::Restart,
        ReplayFallback::NoProgress,
    ];

    /// The label in stats and metrics: `unreachable`, `timeout`, `too_new`, `restart`,
    /// `no_progress`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ReplayFallback::Unreachable => "unreachable",
            ReplayFallback::Timeout => "timeout",
            ReplayFallback::TooNew => "too_new",
            ReplayFallback::Restart => "restart",
            ReplayFallback::NoProgress => "no_progress",
        }
    }
}

/// Replay fallbacks by cause.
///
/// ```
/// use eventplane::kv::{engine::{ReplayFallback, ReplayFallbacks}};
/// let f = ReplayFallbacks::default();
/// assert_eq!(f.get(ReplayFallback::Timeout), 0);
/// assert_eq!(f.total(), 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ReplayFallbacks {
    /// [`ReplayFallback::Unreachable`].
    pub unreachable: u64,
    /// [`ReplayFallback::Timeout`].
    pub timeout: u64,
    /// [`ReplayFallback::TooNew`].
    pub too_new: u64,
    /// [`ReplayFallback::Restart`].
    pub restart: u64,
    /// [`ReplayFallback::NoProgress`].
    pub no_progress: u64,
}

impl ReplayFallbacks {
    /// The count of one cause.
    pub fn get(&self, cause: ReplayFallback) -> u64 {
        match cause {
            ReplayFallback::Unreachable => self.unreachable,
            ReplayFallback::Timeout => self.timeout,
            ReplayFallback::TooNew => self.too_new,
            ReplayFallback::Restart => self.restart,
            ReplayFallback::NoProgress => self.no_progress,
        }
    }

    /// All causes together.
    pub fn total(&self) -> u64 {
        ReplayFallback::ALL.iter().map(|c| self.get(*c)).sum()
    }

    fn add(&mut self, cause: ReplayFallback) {
        let slot = match cause {
            ReplayFallback::Unreachable => &mut self.unreachable,
            ReplayFallback::Timeout => &mut self.timeout,
            ReplayFallback::TooNew => &mut self.too_new,
            ReplayFallback::Restart => &mut self.restart,
            ReplayFallback::NoProgress => &mut self.no_progress,
        };
        *slot += 1;
    }
}

/// Counters of an engine listener's replays (all 0 without a replay endpoint).
///
/// ```
/// let stats = eventplane::kv::engine::EngineReplayStats::default();
/// assert_eq!((stats.replays, stats.repairs, stats.fallbacks.total()), (0, 0, 0));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct EngineReplayStats {
    /// Replay requests sent.
    pub replays: u64,
    /// Batches applied from replies.
    pub replayed_batches: u64,
    /// Losses (a gap, a connection, a reconnection) closed by replay alone, without a
    /// clear.
    pub repairs: u64,
    /// Losses that ended in a clear, by cause.
    pub fallbacks: ReplayFallbacks,
    /// Replayed or held batches skipped because they were already applied.
    pub duplicate_batches: u64,
    /// Live batches dropped while a replay ran because 4,096 or
    /// 16 MiB were held (fetched again by a further replay).
    pub held_dropped: u64,
    /// Replies that were not a replay reply (wrong delimiter, topic or sequence frame).
    pub malformed_replies: u64,
}

/// Bounds of one engine's replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReplayLimits {
    pub(crate) timeout: Duration,
    pub(crate) deadline: Duration,
    pub(crate) max_batches: u64,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        ReplayLimits {
            timeout: DEFAULT_REPLAY_TIMEOUT,
            deadline: DEFAULT_REPLAY_DEADLINE,
            max_batches: DEFAULT_MAX_REPLAY_BATCHES,
        }
    }
}

/// What the listener must do next, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Decode and forward this batch.
    Apply {
        seq: u64,
        payload: Bytes,
        replayed: bool,
    },
    /// Routers must drop this worker's blocks: the loss cannot be repaired.
    Clear(ReplayFallback),
    /// Send a replay request from this sequence.
    Request(u64),
    /// Drop the replay connection: each replay runs on a connection of its own, so
    /// what an abandoned one still sends never reaches the next.
    Disconnect,
}

/// One reply, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Batch(u64, Bytes),
    End,
}

/// Parses a reply as a DEALER receives it: `["", seq, payload]` or
/// `["", topic, seq, payload]`; `None` when it is neither or names another topic.
pub(crate) fn parse_reply(msg: &Message, topic: &[u8]) -> Option<Reply> {
    let (seq, payload) = match msg.len() {
        3 => (msg.get(1)?, msg.get(2)?),
        4 => {
            let t = msg.get(1)?;
            let (seq, payload) = (msg.get(2)?, msg.get(3)?);
            let end = seq == END_SEQ.to_be_bytes().as_slice();
            if t != topic && !(end && t.is_empty()) {
                return None;
            }
            (seq, payload)
        }
        _ => return None,
    };
    if !msg.get(0)?.is_empty() {
        return None;
    }
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq).ok()?);
    if seq == END_SEQ {
        return Some(Reply::End);
    }
    let at = msg.len() - 1;
    let payload = msg
        .part(at)
        .unwrap_or_else(|| Bytes::copy_from_slice(payload));
    Some(Reply::Batch(seq, payload))
}

/// The request frames for a replay from `start`.
pub(crate) fn request(start: u64) -> Message {
    Message::from_parts([Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())])
}

fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[derive(Debug)]
struct Round {
    from: u64,
    /// The anchor's digest, until the first reply has been checked against it.
    verify: Option<u64>,
    applied: u64,
    /// A batch of this replay was taken (applied or skipped as applied before).
    seen: bool,
    /// Replies went missing or were cut off: ask again once it ends.
    incomplete: bool,
    /// Asked with no loss known (a tail probe): failing, it only backs off.
    probe: bool,
    deadline: Instant,
    idle_deadline: Instant,
}

/// The repair state of one engine stream (see the module docs).
#[derive(Debug)]
pub(crate) struct Repair {
    limits: ReplayLimits,
    /// Sequence and digest of the last batch applied.
    anchor: Option<(u64, u64)>,
    /// The last [`RECENT`] batches applied, oldest first.
    recent: VecDeque<(u64, u64)>,
    /// A failed replay left nothing to compare with: the next live batch is the
    /// baseline.
    baseline: bool,
    round: Option<Round>,
    held: VecDeque<(u64, Bytes)>,
    held_bytes: usize,
    /// Live batches were dropped while held: fetch them by another replay.
    held_lost: bool,
    barren_rounds: u32,
    /// A loss is being repaired; `cleared` when it already ended in a clear.
    open_loss: bool,
    cleared: bool,
    /// The open loss had batches replayed.
    repaired_any: bool,
    /// After a failed replay, until when gaps clear at once, and the cause.
    failed_until: Option<(Instant, ReplayFallback)>,
    /// When to ask for what may have followed the last replay (see
    /// [`REPLAY_TAIL_PROBE`]); moved on by every live batch.
    probe: Option<Instant>,
    /// The current quiet time before a probe.
    probe_delay: Duration,
    stats: EngineReplayStats,
}

impl Repair {
    pub(crate) fn new(limits: ReplayLimits) -> Repair {
        Repair {
            limits,
            anchor: None,
            recent: VecDeque::new(),
            baseline: false,
            round: None,
            held: VecDeque::new(),
            held_bytes: 0,
            held_lost: false,
            barren_rounds: 0,
            open_loss: false,
            cleared: false,
            repaired_any: false,
            failed_until: None,
            probe: None,
            probe_delay: REPLAY_TAIL_PROBE,
            stats: EngineReplayStats::default(),
        }
    }

    pub(crate) fn stats(&self) -> EngineReplayStats {
        self.stats
    }

    /// `true` while a replay runs (its replies are awaited).
    pub(crate) fn replaying(&self) -> bool {
        self.round.is_some()
    }

    /// When [`on_timeout`](Self::on_timeout) must run.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        match &self.round {
            Some(r) => Some(r.deadline.min(r.idle_deadline)),
            None => self.probe,
        }
    }

    /// Forget the anchor: routers were cleared for another reason (the engine was gone
    /// too long), so the next replay starts from 0 and rebuilds everything the engine
    /// still buffers.
    pub(crate) fn forget(&mut self) {
        self.anchor = None;
    }

    /// A connection to the engine's PUB is up: replay what was missed meanwhile (from
    /// the anchor, or everything buffered when there is none).
    pub(crate) fn on_connect(&mut self, now: Instant, out: &mut Vec<Step>) {
        if self.round.take().is_some() {
            // Asked over the old connection's lifetime: ask again, the anchor checked
            // against whatever engine is there now.
            out.push(Step::Disconnect);
        }
        self.open(now);
        // A new connection may be a new engine, with its replay endpoint back.
        self.failed_until = None;
        self.start_round(now, out);
    }

    /// A live batch.
    pub(crate) fn on_live(&mut self, now: Instant, seq: u64, payload: Bytes, out: &mut Vec<Step>) {
        if self.round.is_some() {
            self.hold(seq, payload);
            return;
        }
        self.take_live(now, seq, payload, out);
        self.close_if_done();
    }

    fn take_live(&mut self, now: Instant, seq: u64, payload: Bytes, out: &mut Vec<Step>) {
        let expected = self.expected();
        let baseline = std::mem::take(&mut self.baseline);
        if seq == expected || baseline {
            self.probe = Some(now + self.probe_delay);
            self.apply(seq, payload, false, out);
        } else if seq < expected {
            if self.applied_before(seq, &payload) {
                // Replayed first, delivered live after: already applied.
                self.stats.duplicate_batches += 1;
                return;
            }
            // Backwards with other content: a new engine behind the endpoint.
            self.open(now);
            self.fall_back(ReplayFallback::Restart, out);
            self.anchor = None;
            if self.failing(now).is_none() {
                self.hold(seq, payload);
                self.start_round(now, out);
                return;
            }
            self.apply(seq, payload, false, out);
        } else {
            self.open(now);
            if let Some(cause) = self.failing(now) {
                self.fall_back(cause, out);
                self.apply(seq, payload, false, out);
                return;
            }
            self.hold(seq, payload);
            self.start_round(now, out);
        }
    }

    /// Whether batch `seq` with this payload is among the last [`RECENT`] applied.
    fn applied_before(&self, seq: u64, payload: &[u8]) -> bool {
        self.recent
            .iter()
            .rev()
            .find(|(s, _)| *s == seq)
            .is_some_and(|(_, d)| *d == digest(payload))
    }

    /// A message on the replay connection.
    pub(crate) fn on_reply(&mut self, now: Instant, reply: Option<Reply>, out: &mut Vec<Step>) {
        let Some(reply) = reply else {
            self.stats.malformed_replies += 1;
            return;
        };
        let Some(round) = self.round.as_mut() else {
            // Nothing asked: a peer talking out of turn.
            self.stats.malformed_replies += 1;
            return;
        };
        let idle = now + self.limits.timeout;
        let (seq, payload) = match reply {
            Reply::End => return self.end_round(now, out),
            Reply::Batch(seq, payload) => (seq, payload),
        };
        if round.applied >= self.limits.max_batches {
            // Enough for one replay: skip the rest of it; the next one goes on.
            round.incomplete = true;
            return self.end_round(now, out);
        }
        let seen = std::mem::replace(&mut round.seen, true);
        if let Some(d) = round.verify.take() {
            if seq == round.from {
                if digest(&payload) == d {
                    // The same engine: what follows is what was missed.
                    round.idle_deadline = idle;
                    return;
                }
                return self.restart(now, out);
            }
            if seq < round.from {
                return self.restart(now, out);
            }
        }
        let expected = self.expected();
        if seq < expected {
            self.stats.duplicate_batches += 1;
            return;
        }
        if seq > expected {
            if seen {
                // A reply went missing (an engine's ROUTER drops at its high-water
                // mark): the rest is asked for again from what was applied.
                if let Some(r) = self.round.as_mut() {
                    r.incomplete = true;
                }
                return self.end_round(now, out);
            }
            // The buffer starts after what is missing.
            self.fall_back(ReplayFallback::TooNew, out);
        }
        if let Some(r) = self.round.as_mut() {
            r.applied += 1;
            // Only progress keeps a replay alive: a peer repeating old batches does
            // not hold live batches back until the deadline.
            r.idle_deadline = idle;
        }
        self.repaired_any = true;
        self.apply(seq, payload, true, out);
    }

    /// The replay connection failed or could not be made.
    pub(crate) fn on_unreachable(&mut self, now: Instant, out: &mut Vec<Step>) {
        if self.round.is_some() {
            self.give_up(now, ReplayFallback::Unreachable, out);
        }
    }

    /// Runs the replay's timers: past its deadline, or silent for the timeout before it
    /// applied anything, a replay gives up; one that applied batches and then went
    /// silent lost its end (an engine's ROUTER drops at its high-water mark), so the
    /// rest is asked for again on a new connection.
    pub(crate) fn on_timeout(&mut self, now: Instant, out: &mut Vec<Step>) {
        let Some(round) = self.round.as_mut() else {
            if self.probe.is_some_and(|at| at <= now) {
                self.start_round(now, out);
            }
            return;
        };
        if now >= round.deadline || (now >= round.idle_deadline && round.applied == 0) {
            self.give_up(now, ReplayFallback::Timeout, out);
        } else if now >= round.idle_deadline {
            round.incomplete = true;
            round.verify = None;
            self.end_round(now, out);
        }
    }

    fn give_up(&mut self, now: Instant, cause: ReplayFallback, out: &mut Vec<Step>) {
        let probe = self.round.take().is_some_and(|r| r.probe);
        out.push(Step::Disconnect);
        if probe {
            // Nothing was known to be missing: no clear, only a longer wait before
            // the next probe; what was held meanwhile is taken as live.
            self.probe_delay = (self.probe_delay * 2).min(REPLAY_TAIL_PROBE_MAX);
            self.held_lost = false;
            let held = std::mem::take(&mut self.held);
            self.held_bytes = 0;
            for (seq, payload) in held {
                if self.round.is_some() {
                    self.hold(seq, payload);
                } else {
                    self.take_live(now, seq, payload, out);
                }
            }
            if self.round.is_none() && self.probe.is_none() {
                self.probe = Some(now + self.probe_delay);
            }
            self.close_if_done();
            return;
        }
        self.fall_back(cause, out);
        self.failed_until = Some((now + REPLAY_RETRY_AFTER, cause));
        self.held_lost = false;
        self.baseline = self.anchor.is_none() && self.held.is_empty();
        // What was held follows the clear as the new truth, gaps and all.
        while let Some((seq, payload)) = self.held.pop_front() {
            self.held_bytes -= payload.len();
            if self.applied_before(seq, &payload) {
                self.stats.duplicate_batches += 1;
                continue;
            }
            if self.anchor.is_some_and(|(a, _)| seq <= a) {
                // Another batch under a number already applied: a new engine.
                self.fall_back(ReplayFallback::Restart, out);
                self.anchor = None;
            }
            self.apply(seq, payload, false, out);
        }
        self.close_if_done();
    }

    fn end_round(&mut self, now: Instant, out: &mut Vec<Step>) {
        let Some(round) = self.round.take() else {
            return;
        };
        // Whatever else this replay would have sent is not wanted.
        out.push(Step::Disconnect);
        if round.verify.is_some() {
            // Asked from the anchor and the buffer is empty: a new engine with nothing
            // published yet (an engine that published the anchor still buffers it).
            self.fall_back(ReplayFallback::Restart, out);
            self.anchor = None;
        }
        if round.applied > 0 {
            self.barren_rounds = 0;
        } else {
            self.barren_rounds += 1;
        }
        while let Some((seq, payload)) = self.held.pop_front() {
            let expected = self.expected();
            if seq < expected {
                self.held_bytes -= payload.len();
                self.stats.duplicate_batches += 1;
            } else if seq == expected {
                self.held_bytes -= payload.len();
                self.apply(seq, payload, false, out);
            } else if self.barren_rounds < MAX_BARREN_ROUNDS {
                self.held.push_front((seq, payload));
                self.open(now);
                return self.start_round(now, out);
            } else {
                self.held_bytes -= payload.len();
                self.fall_back(ReplayFallback::NoProgress, out);
                self.apply(seq, payload, false, out);
            }
        }
        let more = std::mem::take(&mut self.held_lost) || round.incomplete;
        if more && self.barren_rounds < MAX_BARREN_ROUNDS {
            self.open(now);
            return self.start_round(now, out);
        }
        if more {
            // Replies went missing twice in a row with nothing applied: say so.
            self.open(now);
            self.fall_back(ReplayFallback::NoProgress, out);
        }
        if round.applied > 0 {
            self.probe_delay = REPLAY_TAIL_PROBE;
        } else if !self.open_loss {
            self.probe_delay = (self.probe_delay * 2).min(REPLAY_TAIL_PROBE_MAX);
        }
        if round.applied > 0 || self.open_loss {
            self.probe = Some(now + self.probe_delay);
        }
        if round.applied > 0 && !self.open_loss {
            // A probe found batches the engine's PUB dropped at the end of a burst.
            self.stats.repairs += 1;
        }
        self.close_if_done();
    }

    fn restart(&mut self, now: Instant, out: &mut Vec<Step>) {
        self.fall_back(ReplayFallback::Restart, out);
        self.anchor = None;
        // The rest of this replay is the new engine's, from the old anchor on: ask
        // again from 0, on a new connection.
        self.round = None;
        out.push(Step::Disconnect);
        self.start_round(now, out);
    }

    fn start_round(&mut self, now: Instant, out: &mut Vec<Step>) {
        let (from, verify) = match self.anchor {
            Some((seq, d)) => (seq, Some(d)),
            None => (0, None),
        };
        self.probe = None;
        if !self.open_loss {
            self.barren_rounds = 0;
        }
        self.round = Some(Round {
            from,
            verify,
            applied: 0,
            seen: false,
            incomplete: false,
            probe: !self.open_loss,
            deadline: now + self.limits.deadline,
            idle_deadline: now + self.limits.timeout,
        });
        self.stats.replays += 1;
        out.push(Step::Request(from));
    }

    fn hold(&mut self, seq: u64, payload: Bytes) {
        if self.held.len() >= MAX_HELD_BATCHES || self.held_bytes + payload.len() > MAX_HELD_BYTES {
            self.stats.held_dropped += 1;
            self.held_lost = true;
            return;
        }
        self.held_bytes += payload.len();
        self.held.push_back((seq, payload));
    }

    fn apply(&mut self, seq: u64, payload: Bytes, replayed: bool, out: &mut Vec<Step>) {
        let d = digest(&payload);
        self.anchor = Some((seq, d));
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, d));
        if replayed {
            self.stats.replayed_batches += 1;
        }
        out.push(Step::Apply {
            seq,
            payload,
            replayed,
        });
    }

    fn fall_back(&mut self, cause: ReplayFallback, out: &mut Vec<Step>) {
        if !self.open_loss {
            self.open_loss = true;
            self.repaired_any = false;
            self.barren_rounds = 0;
        }
        self.stats.fallbacks.add(cause);
        self.cleared = true;
        out.push(Step::Clear(cause));
    }

    fn expected(&self) -> u64 {
        self.anchor.map_or(0, |(seq, _)| seq.saturating_add(1))
    }

    fn failing(&mut self, now: Instant) -> Option<ReplayFallback> {
        match self.failed_until {
            Some((until, cause)) if now < until => Some(cause),
            _ => {
                self.failed_until = None;
                None
            }
        }
    }

    fn open(&mut self, _now: Instant) {
        if !self.open_loss {
            self.open_loss = true;
            self.cleared = false;
            self.repaired_any = false;
            self.barren_rounds = 0;
        }
    }

    fn close_if_done(&mut self) {
        if self.open_loss && self.round.is_none() {
            // A repair is a loss closed by replayed batches alone (a connection
            // that missed nothing repaired nothing).
            if !self.cleared && self.repaired_any {
                self.stats.repairs += 1;
            }
            self.open_loss = false;
            self.cleared = false;
            self.repaired_any = false;
        }
    }
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
