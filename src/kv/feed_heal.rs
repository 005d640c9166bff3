/// Live events a feed holds for one publisher while its recovery runs: 4,096 events
/// carrying at most 65,536 blocks (and, across publishers, 2^18 events and 2^22
/// blocks). Past any of these, live
/// events are dropped (counted in [`IndexFeedStats::held_dropped`]) and asked for by
/// another recovery once this one is applied; after three such recoveries in a row the
/// publisher is wiped ([`Wipe::HeldOverflow`]). Removals and clears are applied at once
/// as well as held: the index never credits a worker with a block it said it dropped.
pub(crate) const FEED_MAX_HELD_EVENTS: usize = 4096;

/// How far past the live events a recovery's answer may reach and still have the live
/// copies of what it applied, arriving after it, skipped as late (ids going back are
/// otherwise a loss): 2^20 ids. A window is three ids whatever its length: this bounds
/// no memory, only how far an answer may claim to be ahead. It covers what the path
/// from a worker's log to the router holds in flight, which is counted in messages
/// and bytes, not events (a tunnel stream and a relay's queue held over 5,000 in a
/// test), so it is far above [`FEED_MAX_HELD_EVENTS`].
pub(crate) const FEED_MAX_LATE_EVENTS: u64 = 1 << 20;

/// Blocks one publisher's held events may carry.
const MAX_HELD_BLOCKS: usize = 1 << 16;

const MAX_HELD_TOTAL: usize = 1 << 18;

const MAX_HELD_BLOCKS_TOTAL: usize = 1 << 22;

/// Recoveries in a row whose live events overflowed before the publisher is wiped.
const MAX_OVERFLOWS: u32 = 3;

/// Requests for one loss (a `too_old` answered by a dump, an answer that did not close
/// the gap) before it is given up and the publisher wiped.
const MAX_ROUNDS: u32 = 4;

/// The longest a publisher wiped by a failed recovery waits between two requests for
/// its dump: 60 s. Its first rebuild is asked 1 s after the failure, and each one that
/// fails too doubles the wait up to this; meanwhile its live events are applied as
/// they come (an id gap among them wipes it again and asks at once). A rebuild that
/// succeeds replaces what the publisher fed, as a first dump does, and repairs what
/// it sent meanwhile from the worker's log. It hears of the publisher again (a
/// reconnection, an event after a gap) and asks at once.
pub(crate) const REBUILD_MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How long the rebuild after `failures` failed recoveries in a row waits.
fn rebuild_delay(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let doubled = Duration::from_secs(1u64 << (failures - 1).min(16));
    doubled.min(REBUILD_MAX_BACKOFF)
}

/// Repair latencies kept for the percentiles.
const LATENCIES: usize = 256;

/// A recovery the application must make for the feed: ask `endpoint` for `request`
/// (with [`kv::router::recover`](crate::kv::router::recover)) and hand the answer to
/// [`IndexFeed::recovered`] as a [`RecoveryAnswer`] with this `serial`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryNeed {
    /// The publisher whose events are being repaired.
    pub publisher: ChannelId,
    /// Where its worker serves its recovery log.
    pub endpoint: String,
    /// What to ask.
    pub request: RecoveryRequest,
    /// Which request this is: an answer to an earlier one (a publisher that left and
    /// came back meanwhile) is ignored.
    pub serial: u64,
    /// How long to wait before asking: zero but for a rebuild after failures (see
    /// 60 s). [`RecoveryDriver`](crate::kv::router::RecoveryDriver) waits it.
    pub delay: Duration,
    /// A rebuild: the dump of a publisher a failed recovery wiped, asked again (its
    /// live events are not held meanwhile). The same need may be handed out again,
    /// with the same serial and no delay, when the publisher is heard from: it
    /// replaces the one waiting.
    pub rebuild: bool,
}

/// The answer to a [`RecoveryNeed`], for [`IndexFeed::recovered`].
#[derive(Debug)]
#[non_exhaustive]
pub struct RecoveryAnswer {
    /// The publisher asked about.
    pub publisher: ChannelId,
    /// The need's serial.
    pub serial: u64,
    /// What the worker answered.
    pub answer: Result<Recovered, RecoveryError>,
    /// From request to answer.
    pub elapsed: Duration,
}

impl RecoveryAnswer {
    /// The answer to `need`.
    pub fn new(
        need: &RecoveryNeed,
        answer: Result<Recovered, RecoveryError>,
        elapsed: Duration,
    ) -> RecoveryAnswer {
        RecoveryAnswer {
            publisher: need.publisher.clone(),
            serial: need.serial,
            answer,
            elapsed,
        }
    }
}

/// A publisher's recovery in progress.
#[derive(Debug)]
struct Repairing {
    request: RecoveryRequest,
    serial: u64,
    /// Handed to the application by `take_recoveries`.
    asked: bool,
    /// Its live events since the loss, in order.
    held: VecDeque<RouterEvent>,
    /// Blocks those events carry.
    held_blocks: usize,
    /// Live events were dropped because too many were held: once this recovery is
    /// applied, another asks for them.
    overflowed: bool,
    /// Recoveries in a row that overflowed.
    overflows: u32,
    /// Requests made for this loss.
    rounds: u32,
    /// The highest live id seen before it started: a live event above it arrived
    /// while it was awaited (and was held).
    live_at_start: u64,
    /// A rebuild after a failed recovery: live events are applied, not held.
    rebuild: bool,
    /// A rebuild to ask for without its back-off (the publisher was heard from).
    urgent: bool,
}

impl Repairing {
    fn held(&self) -> (usize, usize) {
        (self.held.len(), self.held_blocks)
    }
}

/// Why an answer does not close the loss.
enum Unusable {
    /// Ask for a dump instead.
    AskDump,
    /// Give up: wipe; and whether asking again later may succeed (a rebuild).
    Fail(&'static str, bool),
}

impl IndexFeed {
    /// The recoveries to make now (each publisher's once): ask each
    /// [`RecoveryNeed::endpoint`] and hand the answer to
    /// [`recovered`](Self::recovered). Until then the publisher's live events are
    /// held (4,096) and its blocks stay as they were (but for what
    /// it removes meanwhile).
    ///
    /// A publisher with a recovery endpoint ([`Instance::recovery`](crate::discovery::Instance::recovery))
    /// is recovered at first sight (a dump: what it fed before this router listened),
    /// on an event id gap (the events since), and when it reconnects (the events
    /// since, which its log keeps). One whose recovery failed for a reason that may
    /// pass (unreachable, too slow) is rebuilt: its dump is asked again after
    /// [`RecoveryNeed::delay`], which grows while rebuilds fail too
    /// (60 s); an application making the requests itself waits
    /// that delay. A rebuild's need is handed out again, same serial, no delay, when
    /// the publisher is heard from meanwhile.
    pub fn take_recoveries(&mut self) -> Vec<RecoveryNeed> {
        let mut out = Vec::new();
        for (id, p) in &mut self.publishers {
            let (Some(r), Some(endpoint)) = (p.repair.as_mut(), &p.recovery) else {
                continue;
            };
            let first = !std::mem::replace(&mut r.asked, true);
            let hurry = std::mem::take(&mut r.urgent);
            if first || hurry {
                out.push(RecoveryNeed {
                    publisher: id.clone(),
                    endpoint: endpoint.clone(),
                    request: r.request,
                    serial: r.serial,
                    delay: if r.rebuild && !hurry {
                        rebuild_delay(p.failures)
                    } else {
                        Duration::ZERO
                    },
                    rebuild: r.rebuild,
                });
            }
        }
        out
    }

    /// Applies the answer to a [`RecoveryNeed`]. Events since the loss are applied
    /// and the held ones after them; a dump replaces what the publisher fed; `too_old`
    /// asks again for a dump; an answer that does not close the loss asks for a dump,
    /// at most four requests a loss; a failure wipes the publisher
    /// ([`Wipe::RecoveryFailed`]) and the held events start it over. An answer to an
    /// earlier request is ignored.
    pub fn recovered(&mut self, answer: RecoveryAnswer) {
        let RecoveryAnswer {
            publisher,
            serial,
            answer,
            elapsed,
        } = answer;
        let publisher = &publisher;
        let Some(p) = self.publishers.get_mut(publisher) else {
            return;
        };
        if p.repair
            .as_ref()
            .is_none_or(|r| r.serial != serial || !r.asked)
        {
            self.stats.stale_answers += 1;
            return;
        }
        let Some(mut repair) = p.repair.take() else {
            return;
        };
        let verdict = match answer {
            Ok(Recovered::TooOld { .. }) if repair.request == RecoveryRequest::Dump => {
                Err(Unusable::Fail("too_old answered to a dump", false))
            }
            Ok(Recovered::TooOld { .. }) => Err(Unusable::AskDump),
            Ok(Recovered::Events { events, current_id }) => {
                let applied = self.apply_since(publisher, repair.request, &events, current_id);
                if applied.is_ok() {
                    self.expect_late(publisher, &repair, current_id);
                }
                applied
            }
            Ok(Recovered::Dump(dump)) => {
                // It replaces what the publisher fed.
                self.clear_fed(publisher);
                self.reserve_for(publisher, &dump.events);
                for ev in &dump.events {
                    self.apply_event(publisher, ev);
                }
                self.index.end_reserve();
                if let Some(p) = self.publishers.get_mut(publisher) {
                    p.next_id = dump.current_id.saturating_add(1);
                    p.rebuilt = true;
                }
                self.expect_late(publisher, &repair, dump.current_id);
                if repair.rebuild {
                    self.stats.repairs_rebuild += 1;
                } else {
                    self.stats.repairs_dump += 1;
                }
                Ok(())
            }
            Err(e) => {
                tracing::debug!(%publisher, error = %crate::net::ErrorChain(&e), "recovery failed");
                Err(Unusable::Fail("the request failed", e.is_transient()))
            }
        };
        match verdict {
            Ok(()) => self.note_latency(elapsed),
            Err(Unusable::AskDump) if repair.rounds < MAX_ROUNDS => {
                repair.rounds += 1;
                repair.request = RecoveryRequest::Dump;
                repair.asked = false;
                repair.serial = self.next_serial();
                if let Some(p) = self.publishers.get_mut(publisher) {
                    p.repair = Some(repair);
                }
                return;
            }
            Err(Unusable::AskDump) => {
                return self.fail(publisher, repair, "too many requests", true);
            }
            Err(Unusable::Fail(why, retry)) => return self.fail(publisher, repair, why, retry),
        }
        if repair.rebuild {
            // What it sent while the rebuild was awaited was applied live, then
            // replaced by the dump: what came after the dump's id is in its log. The
            // back-off is over once that is repaired too.
            if let Some(p) = self.publishers.get_mut(publisher) {
                if p.next_id != 0 && p.last_live >= p.next_id {
                    let since = p.next_id - 1;
                    self.start_repair(publisher, RecoveryRequest::Since(since));
                } else {
                    p.failures = 0;
                }
            }
            return;
        }
        if let Some(p) = self.publishers.get_mut(publisher) {
            p.failures = 0;
        }
        if repair.overflowed {
            self.refetch(publisher, repair);
        } else {
            let rounds = repair.rounds;
            self.drain(publisher, repair);
            self.carry_rounds(publisher, rounds);
        }
    }

    /// After an answer current at `through`: the live events up to `through` that are
    /// still on their way arrive as late copies of what it applied, in order. When live
    /// events arrived while it was awaited (held), the late ones follow them directly;
    /// when none did, they are a run ending at `through` that starts above what was
    /// seen live and at most [`FEED_MAX_LATE_EVENTS`] ids before `through` (a worker
    /// claiming an id far ahead gets its next live event taken as what it is).
    fn expect_late(&mut self, publisher: &ChannelId, repair: &Repairing, through: u64) {
        let Some(p) = self.publishers.get_mut(publisher) else {
            return;
        };
        p.late = None;
        if p.last_live >= through {
            return;
        }
        let bound = FEED_MAX_LATE_EVENTS;
        p.late = if p.last_live > repair.live_at_start {
            let next = p.last_live + 1;
            (through - next < bound).then_some(Late {
                lo: p.last_live,
                next,
                through,
            })
        } else {
            Some(Late {
                lo: p.last_live.max(through.saturating_sub(bound)),
                next: 0,
                through,
            })
        };
    }

    /// Applies the events of a `since` answer; `Err` when they do not close the gap.
    fn apply_since(
        &mut self,
        publisher: &ChannelId,
        request: RecoveryRequest,
        events: &[RouterEvent],
        current_id: u64,
    ) -> Result<(), Unusable> {
        let asked = match request {
            RecoveryRequest::Since(after) => after,
            _ => return Err(Unusable::Fail("events answered to a dump", false)),
        };
        if current_id < asked {
            // Its ids went back: another worker process behind the publisher.
            return Err(Unusable::AskDump);
        }
        for ev in events {
            let next = self.publishers.get(publisher).map_or(0, |p| p.next_id);
            if ev.event.id < next {
                continue;
            }
            if ev.event.id != next || ev.event.id > current_id {
                return Err(Unusable::AskDump);
            }
            self.apply_event(publisher, ev);
        }
        let next = self.publishers.get(publisher).map_or(0, |p| p.next_id);
        if next <= current_id {
            // It says it is further than what it sent.
            return Err(Unusable::AskDump);
        }
        self.stats.repairs_since += 1;
        Ok(())
    }

    /// Gives a loss up: the publisher is wiped and its held events start it over.
    ///
    /// When asking again may succeed (`retry`: the worker was not reached, not in
    /// time, or the gap did not close), the publisher is rebuilt later: its dump is
    /// asked again, after a back-off ([`REBUILD_MAX_BACKOFF`]). A rebuild that fails
    /// wipes nothing more (what it fed since is what it sent live) and waits longer.
    /// An answer that would be the same again (too large, malformed, refused) waits
    /// for the publisher's next connection instead.
    fn fail(&mut self, publisher: &ChannelId, repair: Repairing, why: &'static str, retry: bool) {
        if repair.rebuild {
            tracing::debug!(%publisher, why, retry, "rebuild failed");
            if self.publishers.get(publisher).is_some_and(|p| p.recovery.is_some()) {
                self.stats.rebuilds_failed += 1;
            }
        } else {
            tracing::debug!(%publisher, why, "recovery given up; wiping the publisher");
            self.wipe(publisher, Wipe::RecoveryFailed);
            if let Some(p) = self.publishers.get_mut(publisher) {
                p.next_id = 0;
                p.rebuilt = true;
            }
            self.drain(publisher, repair);
        }
        let Some(p) = self.publishers.get_mut(publisher) else {
            return;
        };
        // The held events may have started another recovery (a gap among them).
        if retry && p.recovery.is_some() && p.repair.is_none() {
            p.failures = p.failures.saturating_add(1);
            self.start_repair(publisher, RecoveryRequest::Dump);
            if let Some(r) = self.publishers.get_mut(publisher).and_then(|p| p.repair.as_mut()) {
                r.rebuild = true;
            }
        }
    }

    /// A publisher waiting for its rebuild was heard from: its request is handed out
    /// again without its back-off, under the same serial (a request already being
    /// made goes on; the one waiting in a driver is replaced).
    fn hurry_rebuild(&mut self, id: &ChannelId) {
        if let Some(r) = self
            .publishers
            .get_mut(id)
            .and_then(|p| p.repair.as_mut())
            .filter(|r| r.rebuild)
        {
            r.urgent = true;
        }
    }

    /// A loss that started another recovery while its held events drained keeps its
    /// count of requests.
    fn carry_rounds(&mut self, publisher: &ChannelId, rounds: u32) {
        if let Some(r) = self
            .publishers
            .get_mut(publisher)
            .and_then(|p| p.repair.as_mut())
        {
            r.rounds = r.rounds.max(rounds + 1);
            if r.rounds > MAX_ROUNDS {
                if let Some(r) = self
                    .publishers
                    .get_mut(publisher)
                    .and_then(|p| p.repair.take())
                {
                    self.fail(publisher, r, "the gap did not close", true);
                }
            }
        }
    }

    /// After a recovery whose live events overflowed: the held ones are applied, and
    /// another recovery asks for what was dropped after them (at most
    /// [`MAX_OVERFLOWS`] in a row, then the publisher is wiped and starts over).
    fn refetch(&mut self, publisher: &ChannelId, repair: Repairing) {
        let overflows = repair.overflows + 1;
        if overflows > MAX_OVERFLOWS {
            // It sends faster than it can be recovered: start over from the held.
            self.wipe(publisher, Wipe::HeldOverflow);
            if let Some(p) = self.publishers.get_mut(publisher) {
                p.next_id = 0;
            }
            return self.drain(publisher, repair);
        }
        self.drain(publisher, repair);
        let Some(p) = self.publishers.get_mut(publisher) else {
            return;
        };
        if p.repair.is_none() {
            let request = match p.next_id {
                0 => RecoveryRequest::Dump,
                next => RecoveryRequest::Since(next - 1),
            };
            self.start_repair(publisher, request);
        }
        // The held events may have started it already.
        if let Some(r) = self
            .publishers
            .get_mut(publisher)
            .and_then(|p| p.repair.as_mut())
        {
            r.overflows = overflows;
        }
    }

    /// Applies held events as live ones (a gap among them starts another recovery).
    fn drain(&mut self, publisher: &ChannelId, repair: Repairing) {
        let (events, blocks) = repair.held();
        self.held_total = self.held_total.saturating_sub(events);
        self.held_blocks_total = self.held_blocks_total.saturating_sub(blocks);
        let mut fresh = self
            .publishers
            .get(publisher)
            .is_some_and(|p| p.next_id == 0);
        for ev in repair.held {
            if fresh {
                // After a wipe the first held event is the new start.
                fresh = false;
                if let Some(p) = self.publishers.get_mut(publisher) {
                    p.next_id = ev.event.id;
                }
            }
            let next = self.publishers.get(publisher).map_or(0, |p| p.next_id);
            let recovering = self
                .publishers
                .get(publisher)
                .is_some_and(|p| p.repair.is_some());
            if !recovering && ev.event.id < next {
                continue;
            }
            self.take(publisher, ev);
        }
    }

    fn start_repair(&mut self, id: &ChannelId, request: RecoveryRequest) {
        let serial = self.next_serial();
        if let Some(p) = self.publishers.get_mut(id) {
            let overflows = p.repair.as_ref().map_or(0, |r| r.overflows);
            p.late = None;
            p.repair = Some(Repairing {
                request,
                serial,
                asked: false,
                held: VecDeque::new(),
                held_blocks: 0,
                overflowed: false,
                overflows,
                rounds: 0,
                // The event that started it (if one did) is held, not before.
                live_at_start: p.last_live.min(p.next_id.saturating_sub(1)),
                rebuild: false,
                urgent: false,
            });
        }
    }

    fn next_serial(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// Holds a live event of a publisher that recovers. A removal or a clear is
    /// applied at once too: until the recovery is applied the index may miss what the
    /// worker stored meanwhile, never keep what it dropped.
    fn hold(&mut self, id: &ChannelId, ev: RouterEvent) {
        if matches!(
            ev.event.data,
            KvEventData::Removed { .. } | KvEventData::Cleared
        ) && !self.superseded(id, (ev.worker_id, ev.event.dp_rank))
        {
            let sender = self.publishers.get(id).and_then(|p| p.sender);
            if self.index.apply(sender, &ev).is_err() {
                self.stats.refused_events += 1;
            }
        }
        let blocks = ev.event.data.block_count();
        let (total, total_blocks) = (self.held_total, self.held_blocks_total);
        let Some(r) = self.publishers.get_mut(id).and_then(|p| p.repair.as_mut()) else {
            return;
        };
        let fits = r.held.len() < FEED_MAX_HELD_EVENTS
            && r.held_blocks + blocks <= MAX_HELD_BLOCKS
            && total < MAX_HELD_TOTAL
            && total_blocks + blocks <= MAX_HELD_BLOCKS_TOTAL;
        if fits {
            r.held.push_back(ev);
            r.held_blocks += blocks;
            self.held_total += 1;
            self.held_blocks_total += blocks;
            return;
        }
        // Too much arrived meanwhile: dropped here, asked for again once this
        // recovery is applied (its worker's log still has it).
        r.overflowed = true;
        self.stats.held_dropped += 1;
    }

    /// A publisher that recovers lost its recovery endpoint (its record changed): the
    /// recovery fails.
    fn endpoint_gone(&mut self, id: &ChannelId) {
        let Some(p) = self.publishers.get_mut(id) else {
            return;
        };
        if p.recovery.is_none() {
            p.late = None;
            if let Some(r) = p.repair.take() {
                self.fail(id, r, "the recovery endpoint is gone", false);
            }
        }
    }

    /// Sizes the index's tables for the blocks a dump is about to store, for the
    /// ranks its publisher may write: at most [`MAX_RANKS_PER_PUBLISHER`] of them (the
    /// feed refuses events for more), none it was superseded for.
    fn reserve_for(&mut self, publisher: &ChannelId, events: &[RouterEvent]) {
        let Some(sender) = self.publishers.get(publisher).map(|p| p.sender) else {
            return;
        };
        let mut ranks: SmallVec<[((WorkerId, DpRank), usize); 4]> = SmallVec::new();
        for ev in events {
            let KvEventData::Stored { blocks, .. } = &ev.event.data else {
                continue;
            };
            if ev.tier != StorageTier::Device || !self.index.admits(sender, ev.worker_id) {
                continue;
            }
            let key = (ev.worker_id, ev.event.dp_rank);
            let full = ranks.len() >= MAX_RANKS_PER_PUBLISHER;
            match ranks.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += blocks.len(),
                None if !full && !self.superseded(publisher, key) => {
                    ranks.push((key, blocks.len()));
                }
                None => {}
            }
        }
        for ((worker, rank), n) in ranks {
            self.index.reserve(worker, rank, n);
        }
    }

    /// Empties the ranks `id` fed (that no other publisher fed since), not counted as
    /// a wipe: a dump is about to fill them.
    fn clear_fed(&mut self, id: &ChannelId) {
        let Some(p) = self.publishers.get_mut(id) else {
            return;
        };
        for key in std::mem::take(&mut p.fed) {
            if self.owners.get(&key) == Some(id) {
                self.owners.remove(&key);
                self.index.clear_rank(key.0, key.1);
            }
        }
    }

    fn note_latency(&mut self, elapsed: Duration) {
        if self.latencies.len() >= LATENCIES {
            self.latencies.pop_front();
        }
        self.latencies
            .push_back(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX));
    }

    /// (recovering publishers, held events, p50 ms, p99 ms).
    fn repair_gauges(&self) -> (u64, u64, u64, u64, u64) {
        let (mut recovering, mut rebuilding) = (0, 0);
        for r in self.publishers.values().filter_map(|p| p.repair.as_ref()) {
            if r.rebuild {
                rebuilding += 1;
            } else {
                recovering += 1;
            }
        }
        let mut sorted: Vec<u64> = self.latencies.iter().copied().collect();
        sorted.sort_unstable();
        let at = |q: f64| {
            let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
            sorted.get(i).copied().unwrap_or(0)
        };
        (
            recovering,
            rebuilding,
            self.held_total as u64,
            at(0.5),
            at(0.99),
        )
    }
}
