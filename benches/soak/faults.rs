//! The fault schedule: which fault, when, on what, for how long — a pure function of
//! the seed, so a failing run replays exactly (`--seed`).

use std::time::Duration;

use serde::Serialize;

use crate::rng::Rng;

/// A kind of fault (`--faults` names them; all on by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FaultKind {
    /// SIGKILL a relay, start it again: a new incarnation, the same worker id.
    RelayKill,
    /// SIGSTOP a relay past the engine's heartbeat timeout and write-stall timeout (3 s)
    /// and the routers' (3 s), then SIGCONT.
    RelayStop,
    /// SIGKILL etcd, start it again on the same data directory.
    EtcdRestart,
    /// Take a router's link down (in its network namespace) for longer than the lease
    /// TTL (10 s).
    RouterPartition,
    /// A router's consumer stops reading its subscribers for seconds.
    RouterStall,
    /// Stop a router (the last one: the first lives the whole run) and start a new one.
    RouterRestart,
}

impl FaultKind {
    pub(crate) const ALL: [FaultKind; 6] = [
        FaultKind::RelayKill,
        FaultKind::RelayStop,
        FaultKind::EtcdRestart,
        FaultKind::RouterPartition,
        FaultKind::RouterStall,
        FaultKind::RouterRestart,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            FaultKind::RelayKill => "relay_kill",
            FaultKind::RelayStop => "relay_stop",
            FaultKind::EtcdRestart => "etcd_restart",
            FaultKind::RouterPartition => "router_partition",
            FaultKind::RouterStall => "router_stall",
            FaultKind::RouterRestart => "router_restart",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// How long the fault holds, within its documented range.
    fn hold(self, rng: &mut Rng) -> Duration {
        match self {
            FaultKind::RelayKill => rng.millis(200, 2_000),
            FaultKind::RelayStop => rng.millis(4_000, 6_000),
            FaultKind::EtcdRestart => rng.millis(1_000, 4_000),
            FaultKind::RouterPartition => rng.millis(12_000, 15_000),
            FaultKind::RouterStall => rng.millis(4_000, 8_000),
            FaultKind::RouterRestart => Duration::ZERO,
        }
    }

    /// The workers a relay fault may hit, by parity: stops hit even workers, kills
    /// odd ones (with two workers or more), so a stopped relay is never killed after:
    /// its clean exit's counters then cover its engine reconnects (the engine leg of
    /// the ledger), and a killed one's successor covers a replayed history.
    fn parity(self, workers: usize) -> Option<usize> {
        match self {
            FaultKind::RelayStop if workers >= 2 => Some(0),
            FaultKind::RelayKill if workers >= 2 => Some(1),
            _ => None,
        }
    }

    /// Whether the fault targets a router (else a worker, or etcd).
    fn on_router(self) -> bool {
        matches!(
            self,
            FaultKind::RouterPartition | FaultKind::RouterStall | FaultKind::RouterRestart
        )
    }
}

/// One scheduled fault.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Fault {
    /// From the start of the fault window.
    pub(crate) at: Duration,
    pub(crate) kind: FaultKind,
    /// A worker or router index (0 for etcd).
    pub(crate) target: usize,
    pub(crate) hold: Duration,
}

/// `per_kind` faults of each kind, spread over `window`: each kind's faults fall one
/// per equal slice of the window, at a random point of it, on a random target, never
/// on a router or worker another fault still holds (then the next free target, or the
/// fault moves later).
pub(crate) fn schedule(
    seed: u64,
    window: Duration,
    kinds: &[FaultKind],
    per_kind: usize,
    workers: usize,
    routers: usize,
) -> Vec<Fault> {
    let mut rng = Rng::new(seed);
    let mut faults = Vec::new();
    for &kind in kinds {
        let slice = window / per_kind.max(1) as u32;
        // Relay faults go round their workers from a random one: three stops hit
        // three different relays (among them one without replay, `cluster.rs`).
        let choices = kind.parity(workers).map(|p| (workers - p).div_ceil(2));
        let offset = choices.map_or(0, |n| rng.below(n as u64) as usize);
        for i in 0..per_kind {
            let at = slice * i as u32 + rng.millis(0, slice.as_millis() as u64 * 3 / 4);
            let targets = if kind.on_router() { routers } else { workers };
            let target = if kind == FaultKind::EtcdRestart {
                0
            } else if kind == FaultKind::RouterRestart {
                // The last router: the first lives the whole run, so its RSS and fds
                // are judged over all of it.
                routers.saturating_sub(1)
            } else if let (Some(parity), Some(n)) = (kind.parity(workers), choices) {
                (offset + i) % n * 2 + parity
            } else {
                rng.below(targets as u64) as usize
            };
            let hold = kind.hold(&mut rng);
            faults.push(Fault {
                at,
                kind,
                target,
                hold,
            });
        }
    }
    faults.sort_by_key(|f| f.at);
    separate(&mut faults, workers, routers);
    faults
}

/// Moves faults off targets a fault still holds (next free target of the same
/// kind, else later), so that every fault injected is one fault, recovered from
/// before the next on the same process.
fn separate(faults: &mut [Fault], workers: usize, routers: usize) {
    // Busy-until, from the window's start, per router and per worker (etcd: one).
    let mut routers_busy = vec![Duration::ZERO; routers];
    let mut workers_busy = vec![Duration::ZERO; workers];
    let mut etcd_busy = Duration::ZERO;
    let margin = Duration::from_secs(3);
    for f in faults.iter_mut() {
        let busy = match f.kind {
            FaultKind::EtcdRestart => std::slice::from_mut(&mut etcd_busy),
            k if k.on_router() => &mut routers_busy[..],
            _ => &mut workers_busy[..],
        };
        // A restart stays on its router; other faults may move to a free target.
        let candidates = if f.kind == FaultKind::RouterRestart {
            1
        } else {
            busy.len()
        };
        let parity = f.kind.parity(workers);
        let allowed = |t: &usize| parity.is_none_or(|p| t % 2 == p);
        let free = (0..candidates)
            .map(|i| (f.target + i) % busy.len())
            .filter(allowed)
            .find(|&t| busy[t] <= f.at);
        let t = match free {
            Some(t) => t,
            None if f.kind == FaultKind::RouterRestart => {
                f.at = busy[f.target];
                f.target
            }
            None => {
                let (t, until) = busy
                    .iter()
                    .enumerate()
                    .filter(|(t, _)| allowed(t))
                    .min_by_key(|(_, u)| **u)
                    .map(|(t, u)| (t, *u))
                    .unwrap_or((0, f.at));
                f.at = until;
                t
            }
        };
        f.target = t;
        busy[t] = f.at + f.hold + margin;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_replays_from_its_seed_and_never_stacks_faults_on_a_target() {
        let window = Duration::from_secs(120);
        let a = schedule(7, window, &FaultKind::ALL, 2, 4, 2);
        assert_eq!(a, schedule(7, window, &FaultKind::ALL, 2, 4, 2));
        assert_ne!(a, schedule(8, window, &FaultKind::ALL, 2, 4, 2));
        for kind in FaultKind::ALL {
            assert_eq!(a.iter().filter(|f| f.kind == kind).count(), 2, "{kind:?}");
        }
        // Stops hit even workers, kills odd ones: a stopped relay is never killed;
        // three of a kind hit three different relays.
        let b = schedule(7, window, &FaultKind::ALL, 3, 8, 2);
        for kind in [FaultKind::RelayStop, FaultKind::RelayKill] {
            let hit: std::collections::BTreeSet<usize> = b
                .iter()
                .filter(|f| f.kind == kind)
                .map(|f| f.target)
                .collect();
            assert_eq!(hit.len(), 3, "{kind:?}: {b:?}");
        }
        for f in a.iter().chain(&b) {
            match f.kind {
                FaultKind::RelayStop => assert_eq!(f.target % 2, 0, "{f:?}"),
                FaultKind::RelayKill => assert_eq!(f.target % 2, 1, "{f:?}"),
                _ => {}
            }
        }
        // Restarts only ever hit the last router: the first lives the whole run.
        assert!(
            a.iter()
                .filter(|f| f.kind == FaultKind::RouterRestart)
                .all(|f| f.target == 1)
        );
        for (i, f) in a.iter().enumerate() {
            for g in &a[i + 1..] {
                let same = f.kind.on_router() == g.kind.on_router()
                    && (f.kind == FaultKind::EtcdRestart) == (g.kind == FaultKind::EtcdRestart)
                    && f.target == g.target;
                assert!(!same || g.at >= f.at + f.hold, "{f:?} then {g:?}");
            }
        }
    }
}
