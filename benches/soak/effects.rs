//! Faults as they were injected, and what each must have done: the effect a router's
//! report shows for it (audit M1), and the loss each may explain (audit H1). Pure
//! functions over the records and the routers' reports; each violation names the
//! fault (its kind, process and time) or the router and publisher.
//!
//! Times are unix milliseconds: the harness stamps faults with the clock the routers
//! stamp their notices, stalls and discovery counters with (one machine).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cluster::LEASE_TTL;
use crate::engine::REPLAY_BUFFER;
use crate::faults::FaultKind;
use crate::ledger::{self, Violation};
use crate::router::{Ledger, RouterReport};

/// The routers' ZMTP heartbeat (`router.rs`, `lane`): a ping a second, the connection
/// dropped 3 s after one goes unanswered, so a silent peer is noticed within 4 s.
pub(crate) const HEARTBEAT_NOTICED_MS: u64 = 4_000;
/// The subscriber's reconnect backoff ceiling (`reconnect_max`, 5 s:
/// `src/subscriber/config.rs`).
pub(crate) const RECONNECT_MAX_MS: u64 = 5_000;
/// etcd watch reconnects back off 250 ms → 5 s (`src/discovery/etcd/mod.rs`); the
/// router polls its discovery counters once a second.
pub(crate) const REWATCH_MAX_MS: u64 = 6_000;
/// Room for scheduling: process starts, the harness's 100 ms loop, a loaded machine.
pub(crate) const SLACK_MS: u64 = 5_000;
/// A stop shorter than this may end before the routers' heartbeat notices it (4–6 s
/// stops are scheduled): its effect is not judged.
pub(crate) const STOP_JUDGED_MS: u64 = HEARTBEAT_NOTICED_MS + 500;
/// A relay fault's burst (what the relay publishes when it resumes or restarts, or
/// what its engine replays to it) reaches routers this long after the fault's end at
/// most.
const BURST_TAIL_MS: u64 = 30_000;
const LEASE_TTL_MS: u64 = LEASE_TTL.as_millis() as u64;

/// One fault as injected.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Injected {
    pub(crate) kind: FaultKind,
    /// The router or worker slot as scheduled (0 for etcd).
    pub(crate) target: usize,
    /// The process acted on: `router r0#2`, `relay w3#1`, `etcd#2`.
    pub(crate) process: String,
    /// The worker id (engine `w3` is worker 4) whose publishers a relay fault hits.
    pub(crate) worker: Option<u64>,
    /// When it was injected.
    pub(crate) start_ms: u64,
    /// When it was undone: the CONT, the respawn, the link up, etcd healthy again, a
    /// stall's scheduled end, a restarted router's spawn (`None`: never undone).
    pub(crate) end_ms: Option<u64>,
    /// Seconds from the run's start at injection (for people).
    pub(crate) at_s: f64,
    /// Whose messages or view it affects, in words; the publishers themselves are
    /// resolved from the routers' reports (by worker id and time).
    pub(crate) affects: String,
}

impl Injected {
    fn end(&self) -> u64 {
        self.end_ms.unwrap_or(self.start_ms)
    }

    fn hold(&self) -> u64 {
        self.end().saturating_sub(self.start_ms)
    }
}

/// Faults judged and not judged (the router quit too soon, followed nothing yet, or
/// was partitioned meanwhile), per kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct Judged {
    pub(crate) judged: u64,
    pub(crate) not_judged: u64,
}

fn violation(invariant: &'static str, at: String, detail: String) -> Violation {
    Violation {
        invariant,
        at,
        detail,
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

/// Whether the ledger's publisher was followed at `t`: connected at or before it and
/// not departed since.
pub(crate) fn followed_at(l: &Ledger, t: u64) -> bool {
    let Some(c) = l.connected_ms.iter().copied().filter(|c| *c <= t).max() else {
        return false;
    };
    !l.departed_ms.iter().any(|d| (c..=t).contains(d))
}

/// From the publisher's first `Connected` to its last `Departed` (when after its last
/// `Connected`), else to `until` (the router's quit).
pub(crate) fn span(l: &Ledger, until: u64) -> Option<(u64, u64)> {
    let first = l.connected_ms.iter().copied().min()?;
    let last_connected = l.connected_ms.iter().copied().max().unwrap_or(first);
    let end = match l.departed_ms.iter().copied().max() {
        Some(d) if d >= last_connected => d,
        _ => until,
    };
    Some((first, end.max(first)))
}

/// How much later than usual router `process` may see an effect within `window`: its
/// own stalls (notices wait for the consumer) and partitions (nothing arrives, then a
/// reconnect), and etcd restarts (discovery stands still; leases run again from the
/// restart). Fault `skip` (the one judged) aside.
fn held_up(faults: &[Injected], skip: usize, process: &str, window: (u64, u64)) -> u64 {
    faults
        .iter()
        .enumerate()
        .filter(|(i, f)| *i != skip && overlaps((f.start_ms, f.end()), window))
        .map(|(_, f)| match f.kind {
            FaultKind::RouterStall | FaultKind::RouterPartition if f.process == process => {
                f.hold() + RECONNECT_MAX_MS
            }
            FaultKind::EtcdRestart => f.hold() + LEASE_TTL_MS,
            _ => 0,
        })
        .sum()
}

fn of_worker(r: &RouterReport, worker: u64) -> impl Iterator<Item = (&String, &Ledger)> {
    r.publishers
        .iter()
        .filter(move |(_, l)| l.worker_id == Some(worker))
}

/// The effect each fault must have had (audit M1), judged in the router processes
/// that lived through it:
/// - `router_stall`: a stall recorded by that router process within 10 s of the
///   injection, with lane drops > 0;
/// - `router_partition`: of the publishers it followed at the partition (not
///   departed, no relay fault of their own meanwhile), at least one connected again
///   after it started, by its end + `reconnect_max` + slack. Not every one: the CI
///   run at `2af74c6` (`target/soak-ci.json`) had 3,290 lane drops where its three
///   stalls explain ≈ 570, and 21 gaps where its partitions and stops would make ≈ 30
///   if every connection were re-made, so some connections outlive a partition and
///   deliver its backlog at once (into full lanes). With the SUB heartbeat timeout
///   disabled (audit M1) none is re-made;
/// - `relay_stop` (≥ 4.5 s): in every router that followed the relay at the stop, a
///   new `Connected` of it (its heartbeat dropped the connection) by the stop's end +
///   `reconnect_max` + slack;
/// - `relay_kill`: in every router that followed the relay, a `Departed` of that
///   incarnation within the lease TTL + 10 s, and a new incarnation (a publisher of
///   the same worker first connected after the kill) within 10 s of the respawn;
/// - `etcd_restart`: in every router not partitioned meanwhile, each lane's discovery
///   reconnected or re-watched between the kill and 15 s after etcd was back;
/// - `router_restart`: the old router process reported.
///
/// Windows grow by what held the router up meanwhile ([`held_up`]).
pub(crate) fn check_effects(
    faults: &[Injected],
    reports: &[(String, RouterReport)],
    out: &mut Vec<Violation>,
) -> BTreeMap<&'static str, Judged> {
    let mut judged: BTreeMap<&'static str, Judged> = BTreeMap::new();
    let report = |name: &str| reports.iter().find(|(n, _)| n == name).map(|(_, r)| r);
    for (i, f) in faults.iter().enumerate() {
        let Some(end) = f.end_ms else {
            judged.entry(f.kind.name()).or_default().not_judged += 1;
            continue;
        };
        let at = format!("{} {} at {:.1}s", f.kind.name(), f.process, f.at_s);
        let mut count = |ok: bool| {
            let j = judged.entry(f.kind.name()).or_default();
            if ok {
                j.judged += 1;
            } else {
                j.not_judged += 1;
            }
        };
        match f.kind {
            FaultKind::RouterStall => {
                let Some(r) = report(f.process.as_str()) else {
                    count(false);
                    continue;
                };
                count(true);
                let recorded = r.stall_records.iter().find(|s| {
                    (f.start_ms.saturating_sub(1_000)..=f.start_ms + 10_000).contains(&s.start_ms)
                });
                match recorded {
                    None => out.push(violation(
                        "stall_effect",
                        at,
                        format!(
                            "the router recorded no stall within 10 s of the injection ({} stalls in all)",
                            r.stalls
                        ),
                    )),
                    Some(s) if s.dropped == 0 => out.push(violation(
                        "stall_effect",
                        at,
                        format!(
                            "no lane dropped: {} messages received during it, at most {} from one publisher",
                            s.received, s.most_received
                        ),
                    )),
                    Some(_) => {}
                }
            }
            FaultKind::RouterPartition => {
                let Some(r) = report(f.process.as_str()) else {
                    count(false);
                    continue;
                };
                let base = (f.start_ms, end + RECONNECT_MAX_MS + SLACK_MS);
                let deadline = base.1 + held_up(faults, i, &f.process, base);
                // A relay killed or stopped meanwhile has its own timing (and a dead
                // one never comes back): judged by its own fault.
                let relay_fault = |worker: Option<u64>| {
                    faults.iter().any(|g| {
                        matches!(g.kind, FaultKind::RelayKill | FaultKind::RelayStop)
                            && g.worker.is_some()
                            && g.worker == worker
                            && overlaps((g.start_ms, g.end()), (f.start_ms, deadline))
                    })
                };
                let followed: Vec<(&String, &Ledger)> = r
                    .publishers
                    .iter()
                    .filter(|(_, l)| followed_at(l, f.start_ms) && !relay_fault(l.worker_id))
                    .filter(|(_, l)| {
                        !l.departed_ms
                            .iter()
                            .any(|d| *d > f.start_ms && *d <= deadline)
                    })
                    .collect();
                if r.quit_ms < deadline || followed.is_empty() {
                    count(false);
                    continue;
                }
                count(true);
                // Its heartbeat drops what it can no longer hear, and it dials again
                // (in vain, while cut off): the relays' own heartbeats close their
                // side too, but nothing of that reaches a cut-off router, so a
                // router that only learns of it when the link is back has not
                // noticed it (audit M1: the SUB heartbeat timeout disabled).
                let noticed = r
                    .dials_ms
                    .iter()
                    .any(|t| (f.start_ms + HEARTBEAT_NOTICED_MS..=end).contains(t));
                if !noticed && f.hold() > HEARTBEAT_NOTICED_MS + 2_000 {
                    out.push(violation(
                        "partition_noticed",
                        at.clone(),
                        format!(
                            "no dial between {} ms into the {} ms partition and its end: the router never noticed it was cut off",
                            HEARTBEAT_NOTICED_MS,
                            f.hold()
                        ),
                    ));
                }
                let reconnected = followed
                    .iter()
                    .filter(|(_, l)| {
                        l.connected_ms
                            .iter()
                            .any(|c| *c > f.start_ms && *c <= deadline)
                    })
                    .count();
                if reconnected == 0 {
                    let keys: Vec<&str> = followed.iter().map(|(k, _)| k.as_str()).collect();
                    out.push(violation(
                        "partition_effect",
                        at,
                        format!(
                            "none of the {} publishers followed at the partition connected again within {} ms: {keys:?}",
                            followed.len(),
                            deadline - f.start_ms
                        ),
                    ));
                }
            }
            FaultKind::RelayStop | FaultKind::RelayKill => {
                let Some(worker) = f.worker else {
                    count(false);
                    continue;
                };
                if f.kind == FaultKind::RelayStop && f.hold() < STOP_JUDGED_MS {
                    count(false);
                    continue;
                }
                for (name, r) in reports {
                    let followed: Vec<(&String, &Ledger)> = of_worker(r, worker)
                        .filter(|(_, l)| followed_at(l, f.start_ms))
                        .collect();
                    if r.ready_ms > f.start_ms || followed.is_empty() {
                        continue;
                    }
                    let base = if f.kind == FaultKind::RelayStop {
                        (f.start_ms, end + RECONNECT_MAX_MS + SLACK_MS)
                    } else {
                        (
                            f.start_ms,
                            (f.start_ms + LEASE_TTL_MS).max(end) + 2 * SLACK_MS,
                        )
                    };
                    let deadline = base.1 + held_up(faults, i, name, base);
                    // A stopped relay killed before the router could reconnect to it
                    // (a partition of the router meanwhile, say) has no successor
                    // connection to make: judged by the kill.
                    let killed = faults.iter().any(|g| {
                        g.kind == FaultKind::RelayKill
                            && g.process == f.process
                            && (f.start_ms..=deadline).contains(&g.start_ms)
                    });
                    if r.quit_ms < deadline || (f.kind == FaultKind::RelayStop && killed) {
                        count(false);
                        continue;
                    }
                    count(true);
                    let at = format!("{at}, {name} worker {worker}");
                    if f.kind == FaultKind::RelayStop {
                        let reconnected = followed.iter().any(|(_, l)| {
                            l.connected_ms
                                .iter()
                                .any(|c| *c > f.start_ms && *c <= deadline)
                        });
                        if !reconnected {
                            out.push(violation(
                                "relay_stop_effect",
                                at,
                                format!(
                                    "still connected: no new Connected within {} ms of a {} ms stop (the heartbeat must drop a silent relay)",
                                    deadline - f.start_ms,
                                    f.hold()
                                ),
                            ));
                        }
                        continue;
                    }
                    let departed = followed.iter().any(|(_, l)| {
                        l.departed_ms
                            .iter()
                            .any(|d| (f.start_ms..=deadline).contains(d))
                    });
                    let new_incarnation = of_worker(r, worker)
                        .filter(|(k, _)| !followed.iter().any(|(g, _)| g == k))
                        .filter_map(|(_, l)| l.connected_ms.iter().copied().min())
                        .any(|c| (f.start_ms..=deadline).contains(&c));
                    if !departed || !new_incarnation {
                        out.push(violation(
                            "relay_kill_effect",
                            at,
                            format!(
                                "within {} ms: Departed of the killed incarnation {departed}, a new incarnation {new_incarnation}",
                                deadline - f.start_ms
                            ),
                        ));
                    }
                }
            }
            FaultKind::EtcdRestart => {
                let deadline = end + REWATCH_MAX_MS + 2 * SLACK_MS;
                for (name, r) in reports {
                    let partitioned = faults.iter().any(|g| {
                        g.kind == FaultKind::RouterPartition
                            && g.process == *name
                            && overlaps((g.start_ms, g.end()), (f.start_ms, deadline))
                    });
                    if r.ready_ms + 1_000 > f.start_ms || r.quit_ms < deadline || partitioned {
                        continue;
                    }
                    count(!r.discovery.is_empty());
                    for (wire, d) in &r.discovery {
                        if !d
                            .changed_ms
                            .iter()
                            .any(|t| (f.start_ms..=deadline).contains(t))
                        {
                            out.push(violation(
                                "etcd_restart_effect",
                                format!("{at}, {name} lane {wire}"),
                                format!(
                                    "no discovery reconnect or re-watch within {} ms ({} reconnects, {} re-watches over its life)",
                                    deadline - f.start_ms,
                                    d.reconnects,
                                    d.rewatches
                                ),
                            ));
                        }
                    }
                }
            }
            FaultKind::RouterRestart => {
                count(true);
                if report(f.process.as_str()).is_none() {
                    out.push(violation(
                        "router_restart_effect",
                        at,
                        "the restarted router never reported".to_owned(),
                    ));
                }
            }
        }
    }
    judged
}

/// Loss tied to faults (audit H1), per router process and publisher:
/// - drops other than a full lane (budget, topic, malformed): none, ever;
/// - every lane drop falls in one of the router's stalls (from its start to a second
///   after its end, as the router measured), unless a partition of the router (a
///   connection that outlived it delivers its backlog at once: see `check_effects`)
///   or a relay fault on the publisher's worker (its burst on resuming or restarting)
///   overlapped the following: then at most [`loss_bound`] of those faults;
/// - gap messages: zero for a publisher that no fault affected (no partition of this
///   router, no stop of its relay while followed); else at most [`loss_bound`] of the
///   faults that did;
/// - in every stall, a lane that dropped held exactly the lane capacity at its end.
///
/// Neither a stall nor a kill nor an etcd restart can make a gap: a stalled consumer's
/// connections keep reading (the lanes drop, counted as drops); a killed relay's
/// successor is a new publisher, followed from its first message; an etcd restart
/// shorter than the lease TTL leaves every registration and connection as it was.
/// Neither an etcd restart nor a router restart can make a lane drop: neither delays
/// the consumer or sends a burst, and the relays' live rate (10 messages/s each) is
/// far below what an unstalled consumer drains.
pub(crate) fn check_losses(
    faults: &[Injected],
    reports: &[(String, RouterReport)],
    rate_per_s: f64,
    lane_capacity: u64,
    out: &mut Vec<Violation>,
) {
    for (name, r) in reports {
        for s in &r.stall_records {
            if !s.short_lanes.is_empty() {
                out.push(violation(
                    "lanes_fill_in_a_stall",
                    format!("{name} stall at {} ms", s.start_ms),
                    format!(
                        "lanes that dropped yet held less than their capacity {lane_capacity} at the stall's end (publisher, depth): {:?}",
                        s.short_lanes
                    ),
                ));
            }
        }
        for (key, l) in &r.publishers {
            let at = format!("{name} publisher {key}");
            let stats = ledger::sum(l).stats;
            let other =
                stats.dropped_budget + stats.dropped_filtered_topic + stats.dropped_malformed;
            if other > 0 {
                out.push(violation(
                    "drops_explained",
                    at.clone(),
                    format!(
                        "{other} drops for the byte budget, the topic or a malformed message: no fault causes those"
                    ),
                ));
            }
            let followed = span(l, r.quit_ms).unwrap_or((r.ready_ms, r.quit_ms));
            let in_stalls: u64 = r
                .stall_records
                .iter()
                .filter_map(|s| s.dropped_by_publisher.get(key))
                .sum();
            let outside = stats.dropped_lane_full.saturating_sub(in_stalls);
            let bursts: Vec<&Injected> = faults
                .iter()
                .filter(|f| match f.kind {
                    FaultKind::RouterPartition => f.process == *name,
                    FaultKind::RelayStop | FaultKind::RelayKill => {
                        f.worker.is_some() && f.worker == l.worker_id
                    }
                    _ => false,
                })
                .filter(|f| overlaps((f.start_ms, f.end() + BURST_TAIL_MS), followed))
                .collect();
            let burst = loss_bound(&bursts, rate_per_s);
            if outside > burst {
                out.push(violation(
                    "drops_explained",
                    at.clone(),
                    format!(
                        "{outside} lane drops outside this router's stalls ({in_stalls} in them); its partitions and relay faults on its worker allow {burst}"
                    ),
                ));
            }
            let affecting: Vec<&Injected> = faults
                .iter()
                .filter(|f| match f.kind {
                    FaultKind::RouterPartition => f.process == *name,
                    FaultKind::RelayStop => f.worker.is_some() && f.worker == l.worker_id,
                    _ => false,
                })
                .filter(|f| overlaps((f.start_ms, f.end() + BURST_TAIL_MS), followed))
                .collect();
            let bound = loss_bound(&affecting, rate_per_s);
            if stats.gap_messages > bound {
                let (invariant, why) = if affecting.is_empty() {
                    (
                        "gaps_explained",
                        "no fault affected it (no partition of this router, no stop of its relay)"
                            .to_owned(),
                    )
                } else {
                    (
                        "gaps_bounded",
                        format!(
                            "the {} faults that affected it allow {bound}: {:?}",
                            affecting.len(),
                            affecting
                                .iter()
                                .map(|f| format!("{} {} {} ms", f.kind.name(), f.process, f.hold()))
                                .collect::<Vec<_>>()
                        ),
                    )
                };
                out.push(violation(
                    invariant,
                    at,
                    format!(
                        "{} messages lost in {} gaps; {why}",
                        stats.gap_messages, stats.gaps
                    ),
                ));
            }
        }
    }
}

/// The messages a relay publishes while `faults` keep a router from it, at most: per
/// fault, its hold plus the heartbeat's notice, the reconnect backoff's ceiling and
/// the slack ([`SLACK_MS`]), at `rate_per_s` (one message per engine batch: the
/// engines' batches are far below the 128 events that split a message). A kill's
/// successor asks its engine for everything it still buffers (no anchor yet: from 0,
/// `src/kv/replay.rs`), so its burst is the engine's history: the batches since the
/// run's start (and a minute before it), at most the engine's replay buffer.
pub(crate) fn loss_bound(faults: &[&Injected], rate_per_s: f64) -> u64 {
    faults
        .iter()
        .map(|f| {
            let s = if f.kind == FaultKind::RelayKill {
                (f.at_s + 60.0).min(REPLAY_BUFFER as f64 / rate_per_s.max(1e-9))
            } else {
                (f.hold() + HEARTBEAT_NOTICED_MS + RECONNECT_MAX_MS + SLACK_MS) as f64 / 1000.0
            };
            (s * rate_per_s).ceil() as u64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::FaultKind::{
        EtcdRestart, RelayKill, RelayStop, RouterPartition, RouterStall,
    };
    use crate::router::{DiscoveryCounts, Life, StallRecord};

    const T0: u64 = 1_000_000;

    fn fault(kind: FaultKind, process: &str, worker: Option<u64>, at: u64, hold: u64) -> Injected {
        Injected {
            kind,
            target: 0,
            process: process.to_owned(),
            worker,
            start_ms: T0 + at,
            end_ms: Some(T0 + at + hold),
            at_s: at as f64 / 1000.0,
            affects: String::new(),
        }
    }

    /// A publisher of `worker` followed from `T0`, with its counters.
    fn ledger(worker: u64, connected: &[u64], departed: &[u64], life: Life) -> Ledger {
        Ledger {
            worker_id: Some(worker),
            connected_ms: connected.iter().map(|t| T0 + t).collect(),
            departed_ms: departed.iter().map(|t| T0 + t).collect(),
            lives: vec![life],
            ..Ledger::default()
        }
    }

    fn router(publishers: Vec<(&str, Ledger)>) -> RouterReport {
        let mut r = RouterReport {
            ready_ms: T0,
            quit_ms: T0 + 300_000,
            ..RouterReport::default()
        };
        for (k, l) in publishers {
            r.publishers.insert(k.to_owned(), l);
        }
        r
    }

    fn names(out: &[Violation]) -> Vec<&'static str> {
        out.iter().map(|v| v.invariant).collect()
    }

    fn effects(faults: &[Injected], r: RouterReport) -> Vec<&'static str> {
        let mut out = Vec::new();
        check_effects(faults, &[("router r0#1".to_owned(), r)], &mut out);
        names(&out)
    }

    #[test]
    fn a_stop_must_drop_the_connection() {
        let stop = [fault(RelayStop, "relay w3#1", Some(4), 60_000, 5_000)];
        // Reconnected 2 s after the CONT: the heartbeat dropped the silent relay.
        let ok = router(vec![("p", ledger(4, &[0, 67_000], &[], Life::default()))]);
        assert_eq!(effects(&stop, ok), Vec::<&str>::new());
        // The SUB heartbeat timeout disabled (audit M1): the connection outlives it.
        let kept = router(vec![("p", ledger(4, &[0], &[], Life::default()))]);
        assert_eq!(effects(&stop, kept), ["relay_stop_effect"]);
        // A reconnect 20 s late (audit H1 c: reconnect_min 20 s) is no effect of it.
        let late = router(vec![("p", ledger(4, &[0, 85_000], &[], Life::default()))]);
        assert_eq!(effects(&stop, late), ["relay_stop_effect"]);
        // Killed before the router could reconnect (it was partitioned): the kill
        // judges it, not the stop.
        let mut killed = stop.to_vec();
        killed.push(fault(RouterPartition, "router r0#1", None, 62_000, 14_000));
        killed.push(fault(RelayKill, "relay w3#1", Some(4), 74_000, 1_000));
        let kept = router(vec![
            ("p", ledger(4, &[0], &[86_000], Life::default())),
            ("q", ledger(4, &[76_000], &[], Life::default())),
        ]);
        let mut out = Vec::new();
        check_effects(&killed, &[("router r0#1".to_owned(), kept)], &mut out);
        assert_eq!(names(&out), Vec::<&str>::new());
        // Too short to judge.
        let short = [fault(RelayStop, "relay w3#1", Some(4), 60_000, 4_000)];
        let kept = router(vec![("p", ledger(4, &[0], &[], Life::default()))]);
        assert_eq!(effects(&short, kept), Vec::<&str>::new());
    }

    #[test]
    fn a_partition_must_reconnect_every_publisher_followed() {
        let cut = [fault(RouterPartition, "router r0#1", None, 60_000, 13_000)];
        // It dialled (in vain) 5 s into the partition: its heartbeat noticed.
        let noticed = |mut r: RouterReport| {
            r.dials_ms = vec![T0 + 65_000];
            r
        };
        let ok = noticed(router(vec![
            ("a", ledger(1, &[0, 76_000], &[], Life::default())),
            ("b", ledger(2, &[0, 78_000], &[], Life::default())),
            // Departed meanwhile (its relay was killed): not expected back.
            ("c", ledger(3, &[0], &[70_000], Life::default())),
            // Its relay killed late in the partition: judged by the kill.
            ("d", ledger(4, &[0], &[], Life::default())),
        ]));
        let mut faults = cut.to_vec();
        faults.push(fault(RelayKill, "relay w3#1", Some(4), 72_000, 500));
        let mut out = Vec::new();
        check_effects(&faults, &[("router r0#1".to_owned(), ok)], &mut out);
        // The kill's own judgment: neither a Departed nor a new incarnation here.
        assert_eq!(names(&out), ["relay_kill_effect"]);
        // One connection outlived it: still an effect.
        let one = noticed(router(vec![
            ("a", ledger(1, &[0, 76_000], &[], Life::default())),
            ("b", ledger(2, &[0], &[], Life::default())),
        ]));
        assert_eq!(effects(&cut, one.clone()), Vec::<&str>::new());
        // Reconnected once the link was back (the relays closed their side), yet no
        // dial while cut off: its own heartbeat never fired (audit M1).
        let mut deaf = one;
        deaf.dials_ms = vec![T0 + 74_000];
        assert_eq!(effects(&cut, deaf), ["partition_noticed"]);
        // Every connection outlived it.
        let stuck = noticed(router(vec![
            ("a", ledger(1, &[0], &[], Life::default())),
            ("b", ledger(2, &[0], &[], Life::default())),
        ]));
        assert_eq!(effects(&cut, stuck), ["partition_effect"]);
    }

    #[test]
    fn a_kill_must_end_the_incarnation_and_start_another() {
        let kill = [fault(RelayKill, "relay w0#1", Some(1), 60_000, 1_000)];
        let ok = router(vec![
            ("old", ledger(1, &[0], &[71_000], Life::default())),
            ("new", ledger(1, &[61_500], &[], Life::default())),
        ]);
        assert_eq!(effects(&kill, ok), Vec::<&str>::new());
        let ghost = router(vec![
            ("old", ledger(1, &[0], &[], Life::default())),
            ("new", ledger(1, &[61_500], &[], Life::default())),
        ]);
        assert_eq!(effects(&kill, ghost), ["relay_kill_effect"]);
    }

    #[test]
    fn a_stall_must_drop_and_an_etcd_restart_must_rewatch() {
        let stall = [fault(RouterStall, "router r0#1", None, 60_000, 5_000)];
        let record = |dropped| StallRecord {
            start_ms: T0 + 60_050,
            end_ms: T0 + 65_050,
            received: 400,
            most_received: 50,
            dropped,
            ..StallRecord::default()
        };
        let mut r = router(vec![]);
        r.stall_records.push(record(120));
        assert_eq!(effects(&stall, r.clone()), Vec::<&str>::new());
        r.stall_records[0] = record(0);
        assert_eq!(effects(&stall, r), ["stall_effect"]);
        assert_eq!(effects(&stall, router(vec![])), ["stall_effect"]);

        let etcd = [fault(EtcdRestart, "etcd#1", None, 60_000, 2_000)];
        let mut r = router(vec![]);
        let counts = |changed: &[u64]| DiscoveryCounts {
            reconnects: changed.len() as u64,
            rewatches: 0,
            changed_ms: changed.iter().map(|t| T0 + t).collect(),
        };
        r.discovery.insert("eventplane".into(), counts(&[63_000]));
        r.discovery.insert("dynamo".into(), counts(&[64_000]));
        assert_eq!(effects(&etcd, r.clone()), Vec::<&str>::new());
        r.discovery.insert("dynamo".into(), counts(&[]));
        assert_eq!(effects(&etcd, r), ["etcd_restart_effect"]);
    }

    fn losses(faults: &[Injected], r: RouterReport) -> Vec<&'static str> {
        let mut out = Vec::new();
        check_losses(faults, &[("router r0#1".to_owned(), r)], 10.0, 32, &mut out);
        names(&out)
    }

    fn lost(gaps: u64, gap_messages: u64, lane_full: u64) -> Life {
        Life {
            gaps,
            gap_messages,
            dropped_lane_full: lane_full,
            ..Life::default()
        }
    }

    #[test]
    fn gaps_need_a_fault_and_stay_within_its_bound() {
        let stop = [fault(RelayStop, "relay w1#1", Some(2), 60_000, 5_000)];
        // Worker 2 stopped 5 s: (5 + 4 + 5 + 5) s × 10/s = 190 messages at most.
        let r = router(vec![
            ("a", ledger(2, &[0, 67_000], &[], lost(1, 90, 0))),
            ("b", ledger(1, &[0], &[], lost(0, 0, 0))),
        ]);
        assert_eq!(losses(&stop, r), Vec::<&str>::new());
        // A publisher no fault touched lost messages (audit H1 b, c).
        let r = router(vec![("b", ledger(1, &[0], &[], lost(1, 3, 0)))]);
        assert_eq!(losses(&stop, r), ["gaps_explained"]);
        // Far more than the stop can explain (a reconnect 20 s late).
        let r = router(vec![("a", ledger(2, &[0, 87_000], &[], lost(1, 270, 0)))]);
        assert_eq!(losses(&stop, r), ["gaps_bounded"]);
    }

    #[test]
    fn a_kill_may_burst_its_engines_history() {
        let kill = fault(RelayKill, "relay w0#1", Some(1), 60_000, 1_000);
        let stop = fault(RelayStop, "relay w0#2", Some(1), 90_000, 5_000);
        // (60 s into the run + 60 s) × 10/s, and (5 + 14) s × 10/s.
        assert_eq!(loss_bound(&[&kill, &stop], 10.0), 1_200 + 190);
        let late = fault(RelayKill, "relay w0#1", Some(1), 3_000_000, 1_000);
        assert_eq!(loss_bound(&[&late], 10.0), REPLAY_BUFFER as u64);
    }

    #[test]
    fn lane_drops_belong_to_stalls_whose_lanes_filled() {
        let stall = [fault(RouterStall, "router r0#1", None, 60_000, 5_000)];
        let mut r = router(vec![("a", ledger(1, &[0], &[], lost(0, 0, 18)))]);
        r.stall_records.push(StallRecord {
            start_ms: T0 + 60_050,
            end_ms: T0 + 65_050,
            received: 50,
            most_received: 50,
            dropped: 18,
            dropped_by_publisher: [("a".to_owned(), 18)].into(),
            short_lanes: Vec::new(),
        });
        assert_eq!(losses(&stall, r.clone()), Vec::<&str>::new());
        // Drops outside any stall, with no partition nor relay fault (audit H1 b).
        let mut more = r.clone();
        more.publishers.get_mut("a").unwrap().lives[0].dropped_lane_full = 20;
        assert_eq!(losses(&stall, more.clone()), ["drops_explained"]);
        // A partition's backlog may drop, within its bound: (13 + 14) s × 10/s.
        let mut cut = stall.to_vec();
        cut.push(fault(RouterPartition, "router r0#1", None, 90_000, 13_000));
        assert_eq!(losses(&cut, more.clone()), Vec::<&str>::new());
        more.publishers.get_mut("a").unwrap().lives[0].dropped_lane_full = 18 + 271;
        assert_eq!(losses(&cut, more), ["drops_explained"]);
        // A lane that dropped at half its capacity (audit H1 a).
        r.stall_records[0].short_lanes.push(("a".to_owned(), 16));
        assert_eq!(losses(&stall, r), ["lanes_fill_in_a_stall"]);
    }
}
