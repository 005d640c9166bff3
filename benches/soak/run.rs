//! The orchestrator: starts the cluster, runs the fault schedule, settles, stops
//! everything cleanly, checks the oracle and writes the report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cluster::{
    Action, Cluster, KvRouterSummary, LEASE_TTL, Phase, ROUTERS, RunArgs, metric, router_name,
};
use crate::effects::{self, Injected, Judged};
use crate::engine::Held;
use crate::engine::unix_ms;
use crate::faults::{Fault, FaultKind, schedule};
use crate::fidelity::{Disturbed, Fidelity, FidelityReport, Recovery};
use crate::ledger::{self, Published, RelayExit, Violation};
use crate::netns::Namespaces;
use crate::process::{Proc, free_port};
use crate::resources::{self, PerWork, SAMPLE_EVERY, Trend};
use crate::router::{IndexDump, RouterReport};

/// How long after its scheduled length a run may take at most: the settle's bounded
/// waits (engines, convergence, relay exits, departures, reports) add up to ≈ 6 min
/// at worst.
const RUN_GRACE: Duration = Duration::from_secs(600);
/// How long after the fault window the cluster may take to be whole again (every
/// process up, routers ready, no partition) before the settle.
const WHOLE_WITHIN: Duration = Duration::from_secs(90);
/// How long after a fault's end each router's index of each worker it touched may
/// take to be current again (audit M2), at least: a killed relay's lease (10 s), the
/// heartbeat's notice (4 s), the reconnect backoff (5 s), the repair, and slack.
/// Longer with big, slow engines (capacity × interval / 2: an index a stale clear
/// wiped is current once its engine evicted what it held before).
const RECOVER_WITHIN_MS: u64 = 30_000;
/// Head loss (audit H2): a router up before a relay started must follow it from
/// within this many seconds of its messages.
const HEAD_SECS: f64 = 2.0;
/// How long the routers may take to be ready before the relays start.
const ROUTERS_READY_WITHIN: Duration = Duration::from_secs(60);

pub(crate) async fn main(args: RunArgs, bench_dir: PathBuf) -> ExitCode {
    match soak(args, bench_dir).await {
        Ok(passed) if passed => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::from(2)
        }
    }
}

/// Builds the shipped `kv-relay` and `kv-router` (release); their paths.
fn build_services(bench_dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let root = bench_dir.parent().ok_or("no workspace root")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("soak: building kv-relay and kv-router (release)");
    let status = std::process::Command::new(cargo)
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "eventplane-services",
            "--bin",
            "kv-relay",
            "--bin",
            "kv-router",
        ])
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building kv-relay and kv-router failed: {status}"));
    }
    let target =
        std::env::var("CARGO_TARGET_DIR").map_or_else(|_| root.join("target"), PathBuf::from);
    Ok((
        target.join("release/kv-relay"),
        target.join("release/kv-router"),
    ))
}

fn kinds(spec: &str, netns: bool) -> Result<Vec<FaultKind>, String> {
    let mut kinds = match spec {
        "all" => FaultKind::ALL.to_vec(),
        "none" => Vec::new(),
        list => list
            .split(',')
            .map(|k| FaultKind::parse(k.trim()).ok_or_else(|| format!("unknown fault kind {k:?}")))
            .collect::<Result<_, _>>()?,
    };
    if !netns {
        kinds.retain(|k| *k != FaultKind::RouterPartition);
    }
    Ok(kinds)
}

#[derive(Debug, Serialize)]
struct Report {
    seed: u64,
    minutes: f64,
    workers: usize,
    dynamo_workers: usize,
    replay: String,
    /// Faults that took effect when injected, by kind.
    faults: BTreeMap<&'static str, u64>,
    schedule: Vec<Fault>,
    /// Every fault that took effect: its process, interval and whom it affects.
    injected: Vec<Injected>,
    /// Their effects judged in the routers' reports, or not (a router that quit too
    /// soon, followed nothing yet), by kind.
    effects: BTreeMap<&'static str, Judged>,
    router_events: u64,
    deliveries: u64,
    drops: BTreeMap<&'static str, u64>,
    gaps: u64,
    gap_messages: u64,
    resyncs: u64,
    /// Index wipes by wire, then cause (departures aside), over every router process.
    wipes: BTreeMap<String, BTreeMap<String, u64>>,
    /// Losses repaired from the workers' recovery logs: since the gap, by a dump.
    repairs_since: u64,
    repairs_dump: u64,
    /// ... by a dump asked again after a failed recovery wiped the publisher.
    repairs_rebuild: u64,
    late_duplicates: u64,
    held_dropped: u64,
    /// The worst of the router processes' repair p99s.
    repair_p99_ms: u64,
    /// Routers' indexes against the engines, sampled each second while faults ran.
    fidelity: FidelityReport,
    /// After each fault, the time each touched (router, worker) took to be current
    /// again: judged, the worst, and every one that took longer than the bound.
    recoveries_judged: usize,
    recovery_bound_ms: u64,
    recovery_worst_ms: Option<u64>,
    recoveries_late: Vec<Recovery>,
    /// Per engine: what it published (the ledger's first leg).
    engines_published: BTreeMap<u64, Published>,
    /// The shipped `kv-router`'s end (it follows the workers on our wire).
    kv_router: Option<KvRouterSummary>,
    convergence_ms: BTreeMap<String, Option<u64>>,
    relay_clean_exits: usize,
    router_reports: usize,
    start_retries: u64,
    resources: BTreeMap<String, Trend>,
    /// Every process's samples: (seconds from the start, RSS KiB, fds).
    samples: BTreeMap<String, Vec<(f64, u64, u64)>>,
    /// Growth per unit of work, by process (routers and relays).
    per_work: BTreeMap<String, PerWork>,
    violations: Vec<Violation>,
    passed: bool,
}

async fn soak(args: RunArgs, bench_dir: PathBuf) -> Result<bool, String> {
    // Every flag as given: the run replays exactly.
    let replay = format!(
        "cargo run --release -p eventplane-benches --bin soak -- {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let (relay_bin, kv_router_bin) = match (&args.relay, &args.kv_router) {
        (Some(relay), Some(router)) => (relay.clone(), router.clone()),
        _ => build_services(&bench_dir)?,
    };
    let netns = !args.no_netns;
    let kinds = kinds(&args.faults, netns)?;
    let total = Duration::from_secs_f64(args.minutes.max(0.5) * 60.0);
    // Warm-up, the fault window, then a quiet tail (leases of killed relays expire)
    // and the settle.
    let warm_up = Duration::from_secs(15);
    let tail = Duration::from_secs(45);
    let window = total
        .saturating_sub(warm_up + tail)
        .max(Duration::from_secs(20));
    let per_kind = args
        .faults_per_kind
        .unwrap_or((args.minutes as usize).max(2));
    let plan = schedule(args.seed, window, &kinds, per_kind, args.workers, ROUTERS);
    eprintln!(
        "soak: seed {} — {} faults over {:?}; replay: {replay}",
        args.seed,
        plan.len(),
        window
    );
    for f in &plan {
        eprintln!(
            "soak:   at {:>6.1}s {:<17} target {} for {:?}",
            (warm_up + f.at).as_secs_f64(),
            f.kind.name(),
            f.target,
            f.hold
        );
    }

    let dir = bench_dir.parent().unwrap_or(&bench_dir).join(format!(
        "target/soak/{}-{}",
        args.seed,
        std::process::id()
    ));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let ns = if netns {
        Some(Namespaces::create(ROUTERS)?)
    } else {
        None
    };
    let w = args.workers;
    let mut c = Cluster {
        logs: logs.clone(),
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
        relay_bin,
        kv_router_bin,
        kv_router: None,
        kv_router_admin: free_port()?,
        kv_router_summary: None,
        ns,
        etcd: None,
        etcd_port: free_port()?,
        etcd_peer: free_port()?,
        etcd_data: dir.join("etcd"),
        etcd_incarnation: 0,
        etcd_settled_at: Instant::now(),
        engines: Vec::new(),
        engine_dead: vec![false; w],
        engine_endpoints: Vec::new(),
        engine_replays: Vec::new(),
        relays: (0..w).map(|_| None).collect(),
        relay_incarnation: vec![0; w],
        relay_held: vec![false; w],
        relay_respawn_at: vec![None; w],
        routers: (0..ROUTERS).map(|_| None).collect(),
        router_ready: vec![false; ROUTERS],
        router_incarnation: vec![0; ROUTERS],
        router_respawn_at: vec![None; ROUTERS],
        partitioned: vec![false; ROUTERS],
        router_reports: Vec::new(),
        relay_exits: Vec::new(),
        violations: Vec::new(),
        series: BTreeMap::new(),
        start: Instant::now(),
        start_unix: unix_ms(),
        injected: kinds.iter().map(|k| (k.name(), 0)).collect(),
        records: Vec::new(),
        start_retries: 0,
        fidelity: Fidelity::new(args.lag_tolerance_ms),
        args,
    };
    // Every wait in `drive` is bounded; this bounds them all (audit L5): a run that
    // hangs ends as a `harness_completes` violation, its processes stopped.
    let limit = total + RUN_GRACE;
    let result = match tokio::time::timeout(limit, drive(&mut c, &plan, warm_up, total)).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "the run did not finish within {limit:?} (its {total:?} and {RUN_GRACE:?})"
        )),
    };
    c.shutdown().await;
    drop(c.ns.take());
    // A harness step that failed (a router that stopped answering, an engine that
    // never settled) is a violation too; the oracle still runs on what was reported.
    let (truth, dumps, convergence, published) = match result {
        Ok(outcome) => outcome,
        Err(e) => {
            c.violations.push(Violation {
                invariant: "harness_completes",
                at: "soak".into(),
                detail: e,
            });
            Default::default()
        }
    };

    // The oracle.
    let mut violations = std::mem::take(&mut c.violations);
    for (name, report) in &c.router_reports {
        ledger::check_router(name, report, &mut violations);
    }
    let finals: Vec<(String, &RouterReport)> = c
        .router_reports
        .iter()
        .rev()
        .take(ROUTERS)
        .map(|(n, r)| (n.clone(), r))
        .collect();
    let live: BTreeSet<u64> = c
        .relay_exits
        .iter()
        .filter_map(|e| e.registered_id)
        .collect();
    let rate = 1000.0 / c.args.interval_ms.max(1) as f64;
    // Routers up before the relays started (their first incarnations): each relay's
    // first incarnation is followed from its head.
    let firsts: Vec<(String, &RouterReport)> = c
        .router_reports
        .iter()
        .filter(|(n, _)| first_incarnation(n))
        .map(|(n, r)| (n.clone(), r))
        .collect();
    let head = (HEAD_SECS * rate) as u64;
    for exit in &c.relay_exits {
        ledger::check_relay_exit(exit, &finals, &mut violations);
        if first_incarnation(&exit.name) {
            ledger::check_head(exit, &firsts, head, &mut violations);
        }
        let worker = exit
            .name
            .strip_prefix("relay w")
            .and_then(|r| r.split('#').next())
            .and_then(|w| w.parse::<u64>().ok())
            .map(|w| w + 1);
        let replayed = worker.is_some_and(|w| !c.without_replay(w as usize - 1));
        match worker.and_then(|w| published.get(&w)) {
            Some(p) => ledger::check_engine_leg(exit, *p, replayed, &mut violations),
            None => violations.push(Violation {
                invariant: "engine_leg",
                at: exit.name.clone(),
                detail: "its engine never said what it published".into(),
            }),
        }
    }
    if c.relay_exits.len() != w {
        violations.push(Violation {
            invariant: "relays_exit_cleanly",
            at: "relays".into(),
            detail: format!(
                "{} of {w} relays printed their stats at exit",
                c.relay_exits.len()
            ),
        });
    }
    for (router, dump) in &dumps {
        ledger::check_convergence(router, dump, &truth, Some(&live), &mut violations);
    }
    // Each fault's effect, and the loss each explains.
    let effects = effects::check_effects(&c.records, &c.router_reports, &mut violations);
    effects::check_losses(
        &c.records,
        &c.router_reports,
        rate,
        c.args.lane_capacity as u64,
        &mut violations,
    );
    let warm = warm_up.as_secs_f64() * 2.0; // per process, from its first sample
    let trends = resources::trends(&c.series, warm);
    // Peaks, slopes over time, and growth per message and per dial (relays: one
    // message per engine batch); router 0 lives the whole run: a 3-minute run judges it.
    let ours = (0..w).filter(|i| !c.on_dynamo_wire(*i)).count() as f64;
    let per_work = resources::check(
        &c.series,
        &trends,
        w,
        warm,
        resources::Rates {
            relay: rate,
            kv_router: rate * ours,
        },
        c.args.minutes >= 3.0,
        &mut violations,
    );

    // Totals.
    let mut drops: BTreeMap<&'static str, u64> = BTreeMap::new();
    let (mut deliveries, mut gaps, mut gap_messages, mut resyncs, mut events) = (0, 0, 0, 0, 0);
    let mut wipes: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let (mut repairs_since, mut repairs_dump, mut late_duplicates, mut held_dropped) = (0, 0, 0, 0);
    let mut repairs_rebuild = 0;
    let mut repair_p99_ms = 0;
    for (_, report) in &c.router_reports {
        events += report.events;
        for (wire, causes) in &report.wipes {
            for (cause, n) in causes {
                *wipes
                    .entry(wire.clone())
                    .or_default()
                    .entry(cause.clone())
                    .or_default() += n;
            }
        }
        repairs_since += report.repairs_since;
        repairs_dump += report.repairs_dump;
        repairs_rebuild += report.repairs_rebuild;
        late_duplicates += report.late_duplicates;
        held_dropped += report.held_dropped;
        repair_p99_ms = repair_p99_ms.max(report.repair_p99_ms);
        for l in report.publishers.values() {
            let s = ledger::sum(l).stats;
            deliveries += s.delivered;
            *drops.entry("lane_full").or_default() += s.dropped_lane_full;
            *drops.entry("budget").or_default() += s.dropped_budget;
            *drops.entry("filtered_topic").or_default() += s.dropped_filtered_topic;
            *drops.entry("malformed").or_default() += s.dropped_malformed;
            gaps += s.gaps;
            gap_messages += s.gap_messages;
            resyncs += l.wipes;
        }
    }
    // With faults off nothing is lost: no drop, no gap, no wipe, and no repair of a
    // loss (a repair since a gap follows events lost on the way, even when no
    // message was: a relay that drops a message before its sequence is taken).
    let wiped: u64 = wipes.values().flat_map(|c| c.values()).sum();
    let dropped = drops.values().sum::<u64>();
    if kinds.is_empty() && (dropped > 0 || gap_messages > 0 || wiped > 0 || repairs_since > 0) {
        violations.push(Violation {
            invariant: "self_check",
            at: "all routers".into(),
            detail: format!(
                "faults off, yet {dropped} drops, {gap_messages} gap messages, {wiped} index wipes {wipes:?} and {repairs_since} repairs since a loss"
            ),
        });
    }
    let dynamo_workers: BTreeSet<u64> = (0..w)
        .filter(|i| c.args.dynamo_every > 0 && i % c.args.dynamo_every == c.args.dynamo_every - 1)
        .map(|i| i as u64 + 1)
        .collect();
    let fidelity = c.fidelity.report(&dynamo_workers);
    let disturbed: Vec<Disturbed> = c.records.iter().map(disturbed).collect();
    // An index wiped by a stale clear is current again once its engine evicted every
    // block from before it (≈ capacity / 6 batches): the bound grows with that.
    let within_ms = RECOVER_WITHIN_MS.max(c.args.capacity as u64 * c.args.interval_ms / 2);
    let recoveries = c.fidelity.recoveries(&disturbed, ROUTERS, within_ms);
    let recovery_worst_ms = recoveries.iter().filter_map(|r| r.took_ms).max();
    let recoveries_judged = recoveries.len();
    let recoveries_late: Vec<Recovery> = recoveries
        .into_iter()
        .filter(|r| r.took_ms.is_none())
        .collect();
    for r in &recoveries_late {
        violations.push(Violation {
            invariant: "index_recovers",
            at: r.cell.clone(),
            detail: format!(
                "not current within {within_ms} ms of its faults' end ({:.1} s into the run)",
                r.end_ms.saturating_sub(c.start_unix) as f64 / 1000.0
            ),
        });
    }
    let passed = violations.is_empty();
    let report = Report {
        seed: c.args.seed,
        minutes: c.args.minutes,
        workers: w,
        dynamo_workers: dynamo_workers.len(),
        replay,
        faults: c.injected.clone(),
        schedule: plan,
        injected: std::mem::take(&mut c.records),
        effects,
        router_events: events,
        deliveries,
        drops,
        gaps,
        gap_messages,
        resyncs,
        wipes,
        repairs_since,
        repairs_dump,
        repairs_rebuild,
        late_duplicates,
        held_dropped,
        repair_p99_ms,
        fidelity,
        recoveries_judged,
        recovery_bound_ms: within_ms,
        recovery_worst_ms,
        recoveries_late,
        engines_published: published,
        kv_router: c.kv_router_summary.clone(),
        convergence_ms: convergence,
        relay_clean_exits: c.relay_exits.len(),
        router_reports: c.router_reports.len(),
        start_retries: c.start_retries,
        resources: trends,
        samples: c
            .series
            .iter()
            .map(|(name, s)| (name.clone(), s.samples.clone()))
            .collect(),
        per_work,
        violations,
        passed,
    };
    print_table(&report);
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    if let Some(path) = &c.args.report {
        std::fs::write(path, &json).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    eprintln!("soak: logs in {}", logs.display());
    Ok(passed)
}

type Outcome = (
    BTreeMap<u64, Held>,
    Vec<(String, IndexDump)>,
    BTreeMap<String, Option<u64>>,
    BTreeMap<u64, Published>,
);

/// Whether a process name (`router r1#1`, `relay w3#12`) is its slot's first.
fn first_incarnation(name: &str) -> bool {
    name.rsplit_once('#').is_some_and(|(_, n)| n == "1")
}

/// Whom a fault disturbed, and when.
fn disturbed(f: &Injected) -> Disturbed {
    let (router, worker) = match f.kind {
        FaultKind::RelayKill | FaultKind::RelayStop => (None, f.worker),
        FaultKind::RouterPartition | FaultKind::RouterStall | FaultKind::RouterRestart => {
            (Some(f.target), None)
        }
        FaultKind::EtcdRestart => (None, None),
    };
    Disturbed {
        router,
        worker,
        start_ms: f.start_ms,
        // Never undone: never judged.
        end_ms: f.end_ms.unwrap_or(u64::MAX / 4),
    }
}

/// Runs the cluster through its schedule and the settle; the engines' truth, the
/// routers' last indexes and their convergence times.
async fn drive(
    c: &mut Cluster,
    plan: &[Fault],
    warm_up: Duration,
    total: Duration,
) -> Result<Outcome, String> {
    c.start_etcd().await?;
    for w in 0..c.args.workers {
        let args: Vec<String> = [
            "engine".to_owned(),
            "--worker".into(),
            (w as u64 + 1).to_string(),
            "--seed".into(),
            c.args.seed.to_string(),
            "--interval-ms".into(),
            c.args.interval_ms.to_string(),
            "--capacity".into(),
            c.args.capacity.to_string(),
        ]
        .to_vec();
        let mut p = Proc::spawn(format!("engine w{w}"), &c.exe, &args, &c.logs, &[])?;
        let ep = p.line("bound ", Duration::from_secs(10)).await?;
        c.engine_endpoints.push(ep);
        let replay = p.line("replay ", Duration::from_secs(10)).await?;
        c.engine_replays.push(replay);
        c.engines.push(p);
    }
    for r in 0..ROUTERS {
        c.spawn_router(r)?;
    }
    // The relays start once the routers are up: each router follows them from their
    // first messages (the head-loss check).
    let ready_by = Instant::now() + ROUTERS_READY_WITHIN;
    // Held meanwhile: `supervise` (which reads the routers' lines) starts no relay.
    c.relay_held.iter_mut().for_each(|h| *h = true);
    while !c.router_ready.iter().all(|r| *r) {
        if Instant::now() >= ready_by {
            return Err(format!(
                "routers not ready within {ROUTERS_READY_WITHIN:?}: {}",
                c.not_whole()
            ));
        }
        c.supervise().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.relay_held.iter_mut().for_each(|h| *h = false);
    c.spawn_kv_router()?;
    for w in 0..c.args.workers {
        c.spawn_relay(w)?;
    }
    // The engines publish from now: a relay replays only what they sent since.
    for p in &mut c.engines {
        p.tell("start").await?;
    }
    c.start = Instant::now();
    c.start_unix = unix_ms();
    let mut actions: Vec<Action> = plan
        .iter()
        .flat_map(|f| {
            let at = Instant::now() + warm_up + f.at;
            [
                Action {
                    at,
                    fault: f.clone(),
                    phase: Phase::Start,
                },
                Action {
                    at: at + f.hold,
                    fault: f.clone(),
                    phase: Phase::End,
                },
            ]
        })
        .collect();
    actions.sort_by_key(|a| a.at);
    let mut next_sample = Instant::now();
    let settle_by = Instant::now() + total.saturating_sub(Duration::from_secs(30));
    loop {
        let now = Instant::now();
        while actions.first().is_some_and(|a| a.at <= now) {
            let a = actions.remove(0);
            if let Err(e) = c.act(&a).await {
                let at = format!(
                    "{} {:?} on {} at {:.1}s",
                    a.fault.kind.name(),
                    a.phase,
                    a.fault.target,
                    c.elapsed()
                );
                c.violations.push(Violation {
                    invariant: "fault_took_effect",
                    at,
                    detail: e,
                });
            }
            // A start that waited for its target (or took long) keeps its hold: its
            // end moves with it.
            let late = Instant::now().saturating_duration_since(a.at);
            if a.phase == Phase::Start && late > Duration::from_millis(500) {
                for b in actions
                    .iter_mut()
                    .filter(|b| b.phase == Phase::End && b.fault == a.fault)
                {
                    b.at += late;
                }
                actions.sort_by_key(|b| b.at);
            }
        }
        if now >= next_sample {
            c.sample();
            next_sample = now + SAMPLE_EVERY;
        }
        c.supervise().await;
        c.fidelity.judge(unix_ms());
        if actions.is_empty() && now >= settle_by && c.whole() {
            break;
        }
        if actions.is_empty() && now >= settle_by + WHOLE_WITHIN {
            return Err(format!(
                "{WHOLE_WITHIN:?} after the fault window, not whole: {}",
                c.not_whole()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Quiet: killed relays' leases expire, everything reconnects.
    let quiet_until = Instant::now() + LEASE_TTL + Duration::from_secs(5);
    while Instant::now() < quiet_until {
        c.supervise().await;
        c.fidelity.judge(unix_ms());
        if Instant::now() >= next_sample {
            c.sample();
            next_sample = Instant::now() + SAMPLE_EVERY;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "soak: {:.0}s: faults over; settling the engines",
        c.elapsed()
    );
    // The engines stop publishing and say what they hold (no final eviction: every
    // block they kept over the run must be in the routers' indexes); the fidelity
    // samples end here.
    c.supervise().await;
    c.fidelity.stop_at(unix_ms());
    for (p, dead) in c.engines.iter_mut().zip(&c.engine_dead) {
        if !*dead {
            p.tell("settle").await?;
        }
    }
    let mut truth = BTreeMap::new();
    let mut published = BTreeMap::new();
    for (w, p) in c.engines.iter_mut().enumerate() {
        if c.engine_dead.get(w).copied().unwrap_or(true) {
            continue;
        }
        let line = p.line("published ", Duration::from_secs(10)).await?;
        let sent: Published = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        published.insert(w as u64 + 1, sent);
        let line = p.line("held ", Duration::from_secs(10)).await?;
        let mut held: Held = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        // Routers index the device tier (`RouterIndex`); the host tier is the engine's.
        held.cpu.clear();
        if !held.gpu.is_empty() {
            truth.insert(w as u64 + 1, held);
        }
    }
    let quiet_at = Instant::now();
    let mut convergence = BTreeMap::new();
    let mut dumps = Vec::new();
    for r in 0..ROUTERS {
        let name = router_name(c, r);
        let deadline = quiet_at + Duration::from_secs(c.args.converge_secs);
        let mut converged = None;
        let mut last;
        loop {
            last = match c.dump(r).await {
                Ok(d) => d,
                Err(e) => {
                    c.violations.push(Violation {
                        invariant: "router_answers",
                        at: name.clone(),
                        detail: e,
                    });
                    IndexDump::default()
                }
            };
            if last.workers == truth && last.publishers.len() == c.args.workers {
                converged = Some(quiet_at.elapsed().as_millis() as u64);
                break;
            }
            if Instant::now() >= deadline || c.routers[r].is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        convergence.insert(name.clone(), converged);
        dumps.push((name, last));
    }
    c.sample();
    judge_kv_router(c, &truth, quiet_at).await;
    // Clean exits: every relay drains, prints its stats, leaves discovery.
    for p in c.relays.iter().flatten() {
        let _ = p.signal("TERM");
    }
    for w in 0..c.relays.len() {
        if let Some(mut p) = c.relays[w].take() {
            let status = p.wait(Duration::from_secs(15)).await;
            match RelayExit::parse(&p.name, &p.last_log_line()) {
                Some(exit) if status.is_some_and(|s| s.success()) => c.relay_exits.push(exit),
                _ => c.violations.push(Violation {
                    invariant: "relays_exit_cleanly",
                    at: p.name.clone(),
                    detail: format!("{status:?}: {}", p.last_log_line()),
                }),
            }
        }
    }
    // The routers see every relay leave (a `Departed` each), then report.
    for r in 0..ROUTERS {
        let name = router_name(c, r);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match c.dump(r).await {
                Ok(d) if d.publishers.is_empty() => break,
                Ok(d) if Instant::now() >= deadline => {
                    let ids: Vec<String> = d.publishers.iter().map(|p| format!("{p:x}")).collect();
                    c.violations.push(Violation {
                        invariant: "departures_noticed",
                        at: name.clone(),
                        detail: format!("20 s after every relay exited, still following {ids:?}"),
                    });
                    break;
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                Err(e) => {
                    c.violations.push(Violation {
                        invariant: "router_answers",
                        at: name.clone(),
                        detail: e,
                    });
                    break;
                }
            }
        }
        if let Err(e) = c.quit_router(r).await {
            c.violations.push(Violation {
                invariant: "router_reports",
                at: name,
                detail: e,
            });
        }
    }
    Ok((truth, dumps, convergence, published))
}

/// The shipped `kv-router`, once the engines settled (before the relays leave):
/// its index must come to hold exactly what the engines on our wire hold (its admin
/// gauge is polled until the sizes match, then it is stopped and its `--dump-index`
/// compared block for block), and it must have decoded every payload.
async fn judge_kv_router(c: &mut Cluster, truth: &BTreeMap<u64, Held>, quiet_at: Instant) {
    let ours: BTreeMap<u64, Held> = truth
        .iter()
        .filter(|(w, _)| !c.on_dynamo_wire(**w as usize - 1))
        .map(|(w, h)| (*w, h.clone()))
        .collect();
    let expected: usize = ours.values().map(|h| h.gpu.len()).sum();
    let v = |c: &mut Cluster, invariant, detail| {
        c.violations.push(Violation {
            invariant,
            at: "kv-router".into(),
            detail,
        })
    };
    let Some(mut p) = c.kv_router.take() else {
        v(c, "kv_router_converged", "not running at the settle".into());
        return;
    };
    let deadline = quiet_at + Duration::from_secs(c.args.converge_secs);
    let mut converged_ms = None;
    loop {
        let blocks = metric(c.kv_router_admin, "eventplane_kv_index_blocks").await;
        if blocks == Some(expected as f64) {
            converged_ms = Some(quiet_at.elapsed().as_millis() as u64);
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let _ = p.signal("TERM");
    let status = p.wait(Duration::from_secs(15)).await;
    let line = p.last_log_line();
    let Ok(stats) = serde_json::from_str::<serde_json::Value>(&line) else {
        v(c, "kv_router_exits_cleanly", format!("{status:?}: {line}"));
        return;
    };
    if !status.is_some_and(|s| s.success()) {
        v(c, "kv_router_exits_cleanly", format!("{status:?}"));
    }
    let mut index: BTreeMap<u64, Held> = BTreeMap::new();
    for entry in stats["index"].as_array().into_iter().flatten() {
        let (Some(worker), Some(hashes)) = (
            entry["worker_id"].as_u64(),
            entry["block_hashes"].as_array(),
        ) else {
            continue;
        };
        let held = index.entry(worker).or_default();
        held.gpu
            .extend(hashes.iter().filter_map(serde_json::Value::as_u64));
    }
    for held in index.values_mut() {
        held.gpu.sort_unstable();
        held.gpu.dedup();
    }
    index.retain(|_, h| !h.gpu.is_empty());
    let mut found = Vec::new();
    ledger::check_convergence(
        "kv-router",
        &IndexDump {
            workers: index,
            publishers: BTreeSet::new(),
        },
        &ours,
        None,
        &mut found,
    );
    c.violations.extend(found);
    let decode_errors: u64 = stats["decode_errors"].as_object().map_or(0, |m| {
        m.values().filter_map(serde_json::Value::as_u64).sum()
    });
    if decode_errors > 0 {
        v(
            c,
            "every_payload_decodes",
            format!("{decode_errors} decode errors: {}", stats["decode_errors"]),
        );
    }
    c.kv_router_summary = Some(KvRouterSummary {
        converged_ms,
        router_events: stats["router_events"].as_u64().unwrap_or(0),
        index_blocks: stats["index_blocks"].as_u64().unwrap_or(0),
        decode_errors,
        lost_views: stats["lost_views"].as_u64().unwrap_or(0),
    });
}

fn print_table(r: &Report) {
    println!(
        "soak: seed {}, {} min, {} workers ({} on Dynamo's wire)",
        r.seed, r.minutes, r.workers, r.dynamo_workers
    );
    println!(
        "{:<28} {:>12} {:>12} {:>12}",
        "fault", "injected", "judged", "not judged"
    );
    for (k, n) in &r.faults {
        let j = r.effects.get(k).copied().unwrap_or_default();
        println!("{k:<28} {n:>12} {:>12} {:>12}", j.judged, j.not_judged);
    }
    let f = &r.fidelity;
    let pct = |m: &BTreeMap<String, f64>| {
        m.iter()
            .map(|(w, v)| format!("{w} {:.3}%", v * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows: [(&str, String); 15] = [
        ("router events", r.router_events.to_string()),
        ("deliveries", r.deliveries.to_string()),
        ("drops", format!("{:?}", r.drops)),
        (
            "gaps / gap messages",
            format!("{} / {}", r.gaps, r.gap_messages),
        ),
        ("resyncs (index wipes)", r.resyncs.to_string()),
        ("wipes by wire, cause", format!("{:?}", r.wipes)),
        (
            "repairs since / dump / rebuild",
            format!(
                "{} / {} / {} (p99 {} ms; late copies skipped {}, held dropped {})",
                r.repairs_since,
                r.repairs_dump,
                r.repairs_rebuild,
                r.repair_p99_ms,
                r.late_duplicates,
                r.held_dropped
            ),
        ),
        (
            "fidelity (exact samples)",
            format!(
                "{} within {} ms of the engine; {} within 1 s",
                pct(&f.fidelity),
                f.lag_tolerance_ms,
                pct(&f.current)
            ),
        ),
        (
            "fidelity samples",
            format!(
                "{} ({} stale, {} matching no engine state); worst (router, worker) {:?}; exact lag p99 {} ms, worst {} ms",
                f.samples, f.stale, f.unmatched, f.worst_cell, f.lag_p99_ms, f.worst_lag_ms
            ),
        ),
        (
            "recovered after faults",
            format!(
                "{} judged, worst {:?} ms, {} late (bound {} ms)",
                r.recoveries_judged,
                r.recovery_worst_ms,
                r.recoveries_late.len(),
                r.recovery_bound_ms
            ),
        ),
        ("convergence ms", format!("{:?}", r.convergence_ms)),
        (
            "kv-router",
            match &r.kv_router {
                Some(k) => format!(
                    "converged {:?} ms; {} events, {} blocks, {} decode errors, {} lost views",
                    k.converged_ms, k.router_events, k.index_blocks, k.decode_errors, k.lost_views
                ),
                None => "no summary".to_owned(),
            },
        ),
        (
            "router reports / relay exits",
            format!("{} / {}", r.router_reports, r.relay_clean_exits),
        ),
        ("start retries (etcd away)", r.start_retries.to_string()),
        ("replay", r.replay.clone()),
    ];
    for (k, v) in rows {
        println!("{k:<28} {v}");
    }
    let mut by_role: BTreeMap<&str, (u64, f64, f64)> = BTreeMap::new();
    for (name, t) in &r.resources {
        let role = name.split([' ', '#']).next().unwrap_or("");
        let e = by_role.entry(role).or_insert((0, f64::MIN, f64::MIN));
        e.0 = e.0.max(t.peak_rss_kib);
        if t.judged {
            e.1 = e.1.max(t.rss_slope_kib_per_min);
            e.2 = e.2.max(t.fd_slope_per_min);
        }
    }
    for (role, (peak, rss, fds)) in by_role {
        let per: Vec<&PerWork> = r
            .per_work
            .iter()
            .filter(|(name, w)| w.judged && name.starts_with(role))
            .map(|(_, w)| w)
            .collect();
        let per_message = per
            .iter()
            .map(|w| w.rss_bytes_per_message)
            .fold(f64::MIN, f64::max);
        println!(
            "{:<28} peak {} KiB, worst slope {:.0} KiB/min, {:.2} fds/min; {} judged per message, worst {:.0} B",
            format!("resources {role}"),
            peak,
            rss.max(0.0),
            fds.max(0.0),
            per.len(),
            per_message.max(0.0)
        );
    }
    if r.violations.is_empty() {
        println!("every invariant held");
    } else {
        println!(
            "{} violations; the first: {:?}",
            r.violations.len(),
            r.violations[0]
        );
        println!("replay: {}", r.replay);
    }
}
