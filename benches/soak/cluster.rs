//! The cluster a soak runs: its flags, its processes (etcd, engines, relays, routers)
//! and the faults acted on them; supervision and sampling.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::effects::Injected;
use crate::engine::unix_ms;
use crate::faults::{Fault, FaultKind};
use crate::fidelity::Fidelity;
use crate::ledger::{RelayExit, Violation};
use crate::netns::Namespaces;
use crate::process::{Proc, sample};
use crate::resources::{self, Series};
use crate::router::{IndexDump, RouterReport};
/// The soak's own flags.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// Length of the run (faults, then the settle and the checks).
    #[arg(long, default_value_t = 3.0)]
    pub(crate) minutes: f64,
    /// Seeds the schedule and every engine's workload: a run replays from it.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Where to write the JSON report (also printed as a table).
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// Workers (engine + kv_relay pairs).
    #[arg(long, default_value_t = 8)]
    pub(crate) workers: usize,
    /// Every Nth worker's relay speaks Dynamo's wire and records (0: none).
    #[arg(long, default_value_t = 3)]
    pub(crate) dynamo_every: usize,
    /// `all`, `none`, or a comma list of relay_kill, relay_stop, etcd_restart,
    /// router_partition, router_stall, router_restart.
    #[arg(long, default_value = "all")]
    pub(crate) faults: String,
    /// Faults of each kind (default: one a minute, at least 2).
    #[arg(long)]
    pub(crate) faults_per_kind: Option<usize>,
    /// Each engine publishes a batch this often.
    #[arg(long, default_value_t = 100)]
    pub(crate) interval_ms: u64,
    /// Blocks each engine holds at most (FIFO eviction past it).
    #[arg(long, default_value_t = 256)]
    pub(crate) capacity: usize,
    /// The routers' lane capacity (small, so a stalled consumer drops).
    #[arg(long, default_value_t = 32)]
    pub(crate) lane_capacity: usize,
    /// How long the routers' indexes may take to converge once the engines settled.
    #[arg(long, default_value_t = 30)]
    pub(crate) converge_secs: u64,
    /// A router's index sample counts as exact when it equals what the engine held
    /// this long before it, at most (a stall or a partition delays, a wipe does not).
    #[arg(long = "lag-tolerance-ms", default_value_t = 20_000)]
    pub(crate) lag_tolerance_ms: u64,
    /// A kv_relay binary to use instead of building it (with --kv-router).
    #[arg(long, requires = "kv_router")]
    pub(crate) relay: Option<PathBuf>,
    /// A kv-router binary to use instead of building it (with --relay).
    #[arg(long = "kv-router", requires = "relay")]
    pub(crate) kv_router: Option<PathBuf>,
    /// Run the routers in this namespace (no partitions: that fault is skipped).
    #[arg(long)]
    pub(crate) no_netns: bool,
}

pub(crate) const ROUTERS: usize = 2;
pub(crate) const NAMESPACE: &str = "soak";
/// kv_relay's lease TTL (EtcdDiscovery's default).
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Phase {
    Start,
    End,
}

#[derive(Debug)]
pub(crate) struct Action {
    pub(crate) at: Instant,
    pub(crate) fault: Fault,
    pub(crate) phase: Phase,
}

/// What the shipped `kv-router` showed at the end.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(crate) struct KvRouterSummary {
    /// From the engines' settle to its index's size matching theirs (its admin
    /// gauge), ms; `None`: not within `--converge-secs`.
    pub(crate) converged_ms: Option<u64>,
    pub(crate) router_events: u64,
    pub(crate) index_blocks: u64,
    pub(crate) decode_errors: u64,
    /// Event-id gaps and reconnections that forgot blocks.
    pub(crate) lost_views: u64,
}

/// Everything running, and what it told.
pub(crate) struct Cluster {
    pub(crate) args: RunArgs,
    pub(crate) logs: PathBuf,
    pub(crate) exe: PathBuf,
    pub(crate) relay_bin: PathBuf,
    /// The shipped `kv-router`, a third router beside the soak's two: it follows the
    /// workers on our wire, unfaulted, and is judged on its final index, its decode
    /// errors and its resources.
    pub(crate) kv_router_bin: PathBuf,
    pub(crate) kv_router: Option<Proc>,
    pub(crate) kv_router_admin: u16,
    pub(crate) kv_router_summary: Option<KvRouterSummary>,
    pub(crate) ns: Option<Namespaces>,
    pub(crate) etcd: Option<Proc>,
    pub(crate) etcd_port: u16,
    pub(crate) etcd_peer: u16,
    pub(crate) etcd_data: PathBuf,
    pub(crate) etcd_incarnation: usize,
    /// Relays and routers may fail to start while etcd is away: until then, not a
    /// violation.
    pub(crate) etcd_settled_at: Instant,
    /// Engine `w` is worker `w + 1`.
    pub(crate) engines: Vec<Proc>,
    pub(crate) engine_dead: Vec<bool>,
    pub(crate) engine_endpoints: Vec<String>,
    /// Each engine's replay endpoint (its ROUTER).
    pub(crate) engine_replays: Vec<String>,
    pub(crate) relays: Vec<Option<Proc>>,
    pub(crate) relay_incarnation: Vec<usize>,
    pub(crate) relay_held: Vec<bool>,
    pub(crate) relay_respawn_at: Vec<Option<Instant>>,
    pub(crate) routers: Vec<Option<Proc>>,
    pub(crate) router_ready: Vec<bool>,
    pub(crate) router_incarnation: Vec<usize>,
    pub(crate) router_respawn_at: Vec<Option<Instant>>,
    pub(crate) partitioned: Vec<bool>,
    pub(crate) router_reports: Vec<(String, RouterReport)>,
    pub(crate) relay_exits: Vec<RelayExit>,
    pub(crate) violations: Vec<Violation>,
    pub(crate) series: BTreeMap<String, Series>,
    pub(crate) start: Instant,
    /// The same instant in unix ms (routers stamp their work with it).
    pub(crate) start_unix: u64,
    /// Faults that took effect, by kind.
    pub(crate) injected: BTreeMap<&'static str, u64>,
    /// Every fault that took effect, as injected (the oracle's `effects`).
    pub(crate) records: Vec<Injected>,
    pub(crate) start_retries: u64,
    pub(crate) fidelity: Fidelity,
}

pub(crate) fn etcd_url(host: &str, port: u16) -> String {
    format!("http://{host}:{port}")
}

impl Cluster {
    pub(crate) fn router_etcd(&self) -> String {
        let host = self.ns.as_ref().map_or("127.0.0.1", |n| n.host_address());
        etcd_url(host, self.etcd_port)
    }

    pub(crate) async fn start_etcd(&mut self) -> Result<(), String> {
        self.etcd_incarnation += 1;
        let client = match &self.ns {
            Some(ns) => format!(
                "{},{}",
                etcd_url("127.0.0.1", self.etcd_port),
                etcd_url(ns.host_address(), self.etcd_port)
            ),
            None => etcd_url("127.0.0.1", self.etcd_port),
        };
        let peer = etcd_url("127.0.0.1", self.etcd_peer);
        let args: Vec<String> = ["--name", "soak", "--data-dir"]
            .iter()
            .map(|s| (*s).to_owned())
            .chain([
                self.etcd_data.display().to_string(),
                "--listen-client-urls".into(),
                client,
                "--advertise-client-urls".into(),
                etcd_url("127.0.0.1", self.etcd_port),
                "--listen-peer-urls".into(),
                peer.clone(),
                "--initial-advertise-peer-urls".into(),
                peer.clone(),
                "--initial-cluster".into(),
                format!("soak={peer}"),
                "--log-level=error".into(),
            ])
            .collect();
        let name = format!("etcd#{}", self.etcd_incarnation);
        let proc = Proc::spawn(name, Path::new("etcd"), &args, &self.logs, &[])?;
        self.etcd = Some(proc);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if healthy(self.etcd_port).await {
                self.etcd_settled_at = Instant::now();
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("etcd did not become healthy within 15 s".into())
    }

    /// Whether engine `w`'s relay reads it without its replay endpoint (every fourth,
    /// from the first): a loss it sees is then cleared (a stale `Cleared`, DESIGN
    /// §4.6), never repaired, as for an engine that serves no replay. Stops hit even
    /// workers, so some stops land on these.
    pub(crate) fn without_replay(&self, w: usize) -> bool {
        w % 4 == 0
    }

    /// Whether engine `w`'s relay speaks Dynamo's wire (and records).
    pub(crate) fn on_dynamo_wire(&self, w: usize) -> bool {
        self.args.dynamo_every > 0 && w % self.args.dynamo_every == self.args.dynamo_every - 1
    }

    pub(crate) fn spawn_relay(&mut self, w: usize) -> Result<(), String> {
        self.relay_incarnation[w] += 1;
        let dynamo = self.on_dynamo_wire(w);
        let (bind, host) = match &self.ns {
            Some(ns) => ("tcp://0.0.0.0:0", ns.host_address()),
            None => ("tcp://127.0.0.1:0", "127.0.0.1"),
        };
        let mut args: Vec<String> = [
            "--connect",
            &self.engine_endpoints[w],
            "--recovery-bind",
            bind,
            "--topic",
            "kv-events",
            "--block-size",
            "4",
            "--worker-id",
            &(w as u64 + 1).to_string(),
            "--bind",
            bind,
            "--advertise-host",
            host,
            "--wire",
            if dynamo { "dynamo" } else { "eventplane" },
            "--etcd",
            &etcd_url("127.0.0.1", self.etcd_port),
            "--namespace",
            NAMESPACE,
            "--component",
            "worker",
            "--publish-topic",
            "kv-events",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if !self.without_replay(w) {
            args.extend(["--engine-replay".to_owned(), self.engine_replays[w].clone()]);
        }
        let name = format!("relay w{w}#{}", self.relay_incarnation[w]);
        let proc = Proc::spawn(name, &self.relay_bin, &args, &self.logs, &[])?;
        self.relays[w] = Some(proc);
        Ok(())
    }

    /// Starts the shipped `kv-router` on the host (it follows our records and wire),
    /// with its admin endpoint (its index size is read there) and `--dump-index`.
    pub(crate) fn spawn_kv_router(&mut self) -> Result<(), String> {
        let host = self.ns.as_ref().map_or("127.0.0.1", |ns| ns.host_address());
        let args: Vec<String> = [
            "--etcd",
            &etcd_url("127.0.0.1", self.etcd_port),
            "--namespace",
            NAMESPACE,
            "--component",
            "worker",
            "--topic",
            "kv-events",
            "--format",
            "quiet",
            "--dump-index",
            "--admin-listen",
            &format!("127.0.0.1:{}", self.kv_router_admin),
            "--allow-cidr",
            &format!("{host}/32"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let proc = Proc::spawn(
            "kv-router".to_owned(),
            &self.kv_router_bin,
            &args,
            &self.logs,
            &[("RUST_LOG", "warn")],
        )?;
        self.kv_router = Some(proc);
        Ok(())
    }

    pub(crate) fn spawn_router(&mut self, r: usize) -> Result<(), String> {
        self.router_incarnation[r] += 1;
        let mut argv: Vec<String> = Vec::new();
        let program = match &self.ns {
            Some(ns) => {
                argv.extend(["netns", "exec", ns.name(r)].map(str::to_owned));
                argv.push(self.exe.display().to_string());
                PathBuf::from("ip")
            }
            None => self.exe.clone(),
        };
        argv.extend(
            [
                "router",
                "--etcd",
                &self.router_etcd(),
                "--namespace",
                NAMESPACE,
                "--lane-capacity",
                &self.args.lane_capacity.to_string(),
            ]
            .map(str::to_owned),
        );
        let name = format!("router r{r}#{}", self.router_incarnation[r]);
        // SOAK_ROUTER_LOG (a RUST_LOG spec) for a run's routers, e.g.
        // `warn,eventplane::kv=debug` to see why a repair failed.
        let log = std::env::var("SOAK_ROUTER_LOG").unwrap_or_else(|_| "warn".to_owned());
        let proc = Proc::spawn(name, &program, &argv, &self.logs, &[("RUST_LOG", &log)])?;
        self.routers[r] = Some(proc);
        self.router_ready[r] = false;
        Ok(())
    }

    /// Asks router `r` to quit and keeps its report.
    pub(crate) async fn quit_router(&mut self, r: usize) -> Result<(), String> {
        let Some(mut proc) = self.routers[r].take() else {
            return Ok(());
        };
        proc.tell("quit").await?;
        let report = proc.line("report ", Duration::from_secs(30)).await;
        for line in proc.take_lines() {
            if let Some(prints) = line.strip_prefix("fps ") {
                self.fidelity.router(r, prints);
                resources::note_work(&mut self.series, &proc.name, self.start_unix, prints);
            }
        }
        proc.wait(Duration::from_secs(10)).await;
        let report = report?;
        // Kept beside its log, whole (the run's report sums them).
        let file = self.logs.join(format!(
            "{}.report.json",
            proc.name.replace([' ', '#'], "-")
        ));
        let _ = std::fs::write(file, &report);
        let report: RouterReport =
            serde_json::from_str(&report).map_err(|e| format!("{}: {e}", proc.name))?;
        self.router_reports.push((proc.name.clone(), report));
        Ok(())
    }

    pub(crate) async fn dump(&mut self, r: usize) -> Result<IndexDump, String> {
        let proc = self.routers[r].as_mut().ok_or("router not running")?;
        proc.tell("dump").await?;
        let line = proc.line("index ", Duration::from_secs(10)).await?;
        serde_json::from_str(&line).map_err(|e| e.to_string())
    }

    pub(crate) fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub(crate) fn sample(&mut self) {
        let t = self.elapsed();
        let mut procs: Vec<(&str, &Proc)> = Vec::new();
        procs.extend(self.etcd.iter().map(|p| ("etcd", p)));
        procs.extend(self.engines.iter().map(|p| ("engine", p)));
        procs.extend(self.relays.iter().flatten().map(|p| ("relay", p)));
        procs.extend(self.routers.iter().flatten().map(|p| ("router", p)));
        procs.extend(self.kv_router.iter().map(|p| ("kv-router", p)));
        for (role, p) in procs {
            if let Some((rss, fds)) = sample(p.pid) {
                let s = self.series.entry(p.name.clone()).or_default();
                s.role = role.to_owned();
                s.samples.push((t, rss, fds));
            }
        }
    }

    /// Restarts what exited without being told to; a relay or router that could not
    /// start while etcd was away is retried, anything else that exits is a violation.
    pub(crate) async fn supervise(&mut self) {
        let now = Instant::now();
        let etcd_unsettled =
            self.etcd.is_none() || now < self.etcd_settled_at + Duration::from_secs(20);
        for w in 0..self.relays.len() {
            if let Some(p) = self.relays[w].as_mut() {
                if let Some(status) = p.exited() {
                    let last = p.last_log_line();
                    let name = p.name.clone();
                    self.relays[w] = None;
                    if etcd_unsettled && status.code() == Some(3) {
                        self.start_retries += 1;
                    } else {
                        self.violations.push(Violation {
                            invariant: "processes_stay_up",
                            at: name,
                            detail: format!("exited with {status}: {last}"),
                        });
                    }
                    self.relay_respawn_at[w] = Some(now + Duration::from_secs(1));
                }
            }
            if self.relays[w].is_none()
                && !self.relay_held[w]
                && self.relay_respawn_at[w].is_none_or(|at| now >= at)
            {
                self.relay_respawn_at[w] = None;
                if let Err(e) = self.spawn_relay(w) {
                    self.violations.push(Violation {
                        invariant: "processes_stay_up",
                        at: format!("relay w{w}"),
                        detail: e,
                    });
                }
            }
        }
        if let Some(p) = self.kv_router.as_mut() {
            if let Some(status) = p.exited() {
                self.violations.push(Violation {
                    invariant: "processes_stay_up",
                    at: p.name.clone(),
                    detail: format!("exited with {status}: {}", p.last_log_line()),
                });
                self.kv_router = None;
            }
        }
        for r in 0..self.routers.len() {
            if let Some(p) = self.routers[r].as_mut() {
                for line in p.take_lines() {
                    if line == "ready" {
                        self.router_ready[r] = true;
                    } else if let Some(prints) = line.strip_prefix("fps ") {
                        self.fidelity.router(r, prints);
                        let origin = self.start_unix;
                        resources::note_work(&mut self.series, &p.name, origin, prints);
                    }
                }
                if let Some(status) = p.exited() {
                    let (name, last) = (p.name.clone(), p.last_log_line());
                    self.routers[r] = None;
                    if self.router_ready[r] {
                        self.violations.push(Violation {
                            invariant: "processes_stay_up",
                            at: name,
                            detail: format!("exited with {status}: {last}"),
                        });
                    } else {
                        self.start_retries += 1;
                    }
                    self.router_respawn_at[r] = Some(now + Duration::from_secs(1));
                }
            }
            if self.routers[r].is_none() && self.router_respawn_at[r].is_none_or(|at| now >= at) {
                self.router_respawn_at[r] = None;
                if let Err(e) = self.spawn_router(r) {
                    self.violations.push(Violation {
                        invariant: "processes_stay_up",
                        at: format!("router r{r}"),
                        detail: e,
                    });
                }
            }
        }
        for (w, (p, dead)) in self
            .engines
            .iter_mut()
            .zip(&mut self.engine_dead)
            .enumerate()
        {
            for line in p.take_lines() {
                if let Some(prints) = line.strip_prefix("fps ") {
                    self.fidelity.engine(w as u64 + 1, prints);
                }
            }
            if *dead {
                continue;
            }
            if let Some(status) = p.exited() {
                *dead = true;
                self.violations.push(Violation {
                    invariant: "processes_stay_up",
                    at: p.name.clone(),
                    detail: format!("exited with {status}: {}", p.last_log_line()),
                });
            }
        }
    }

    /// Acts on a fault's start or end. A start whose target is not up within 5 s,
    /// whose signal or link command fails, or whose kill leaves the process running 5 s
    /// later is an error (the driver's `fault_took_effect` violation) and is neither
    /// recorded nor counted as injected; an end undoes only a start that took effect.
    pub(crate) async fn act(&mut self, a: &Action) -> Result<(), String> {
        let f = &a.fault;
        let t = f.target;
        if a.phase == Phase::End {
            let open = self
                .records
                .iter()
                .rposition(|r| r.kind == f.kind && r.target == t && r.end_ms.is_none());
            let Some(i) = open else {
                // Its start failed (already a violation): a held relay is let go.
                if f.kind == FaultKind::RelayKill {
                    self.relay_held[t] = false;
                }
                return Ok(());
            };
            let process = self.records[i].process.clone();
            let undone = self.undo(f, &process).await;
            self.records[i].end_ms = Some(unix_ms());
            return undone;
        }
        if !self.await_target(f.kind, t).await {
            return Err(format!(
                "the target ({:?} {t}) was not up within 5 s",
                f.kind
            ));
        }
        let start_ms = unix_ms();
        let at_s = self.elapsed();
        let process = self.inject(f).await?;
        let (worker, affects) = match f.kind {
            FaultKind::RelayKill | FaultKind::RelayStop => (
                Some(t as u64 + 1),
                format!("the publishers of worker {} in every router", t + 1),
            ),
            FaultKind::EtcdRestart => (None, "every router's discovery".to_owned()),
            _ => (None, format!("every publisher {process} follows")),
        };
        self.records.push(Injected {
            kind: f.kind,
            target: t,
            process,
            worker,
            start_ms,
            end_ms: None,
            at_s,
            affects,
        });
        *self.injected.entry(f.kind.name()).or_default() += 1;
        Ok(())
    }

    /// Waits up to 5 s, supervising, for a fault's target to be up: a relay or etcd
    /// running, a router ready. Whether it is.
    async fn await_target(&mut self, kind: FaultKind, t: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let up = match kind {
                FaultKind::RelayKill | FaultKind::RelayStop => {
                    self.relays.get(t).is_some_and(Option::is_some)
                }
                FaultKind::EtcdRestart => self.etcd.is_some(),
                _ => {
                    self.routers.get(t).is_some_and(Option::is_some)
                        && self.router_ready.get(t).copied().unwrap_or(false)
                }
            };
            if up || Instant::now() >= deadline {
                return up;
            }
            self.supervise().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Injects a fault on its target (up): the name of the process acted on.
    async fn inject(&mut self, f: &Fault) -> Result<String, String> {
        let t = f.target;
        let absent = || format!("{} target {t} is gone", f.kind.name());
        match f.kind {
            FaultKind::RelayKill => {
                self.relays[t].as_ref().ok_or_else(absent)?.signal("KILL")?;
                let mut p = self.relays[t].take().ok_or_else(absent)?;
                self.relay_held[t] = true;
                if p.ended_within(Duration::from_secs(5)).await.is_none() {
                    p.wait(Duration::from_secs(1)).await;
                    return Err(format!("{} still ran 5 s after SIGKILL", p.name));
                }
                Ok(p.name)
            }
            FaultKind::RelayStop => {
                let p = self.relays[t].as_ref().ok_or_else(absent)?;
                p.signal("STOP")?;
                match p.await_stopped(true, Duration::from_secs(1)).await {
                    Some('T') => Ok(p.name.clone()),
                    state => {
                        let _ = p.signal("CONT");
                        Err(format!(
                            "{} not stopped after SIGSTOP: state {state:?}",
                            p.name
                        ))
                    }
                }
            }
            FaultKind::EtcdRestart => {
                let mut p = self.etcd.take().ok_or_else(absent)?;
                if let Err(e) = p.signal("KILL") {
                    self.etcd = Some(p);
                    return Err(e);
                }
                if p.ended_within(Duration::from_secs(5)).await.is_none() {
                    p.wait(Duration::from_secs(1)).await;
                    return Err(format!("{} still ran 5 s after SIGKILL", p.name));
                }
                Ok(p.name)
            }
            FaultKind::RouterPartition => {
                let name = router_name(self, t);
                let ns = self.ns.as_ref().ok_or("partitions need --no-netns off")?;
                ns.link(t, false)?;
                self.partitioned[t] = true;
                Ok(name)
            }
            FaultKind::RouterStall => {
                let p = self.routers[t].as_mut().ok_or_else(absent)?;
                p.tell(&format!("stall {}", f.hold.as_millis())).await?;
                Ok(p.name.clone())
            }
            FaultKind::RouterRestart => {
                let name = router_name(self, t);
                self.quit_router(t).await?;
                self.spawn_router(t)?;
                Ok(name)
            }
        }
    }

    /// Undoes a fault that took effect on `process`: its error if the undoing failed.
    async fn undo(&mut self, f: &Fault, process: &str) -> Result<(), String> {
        let t = f.target;
        match f.kind {
            FaultKind::RelayKill => {
                self.relay_held[t] = false;
                if self.relays[t].is_none() {
                    self.spawn_relay(t)?;
                }
                Ok(())
            }
            FaultKind::RelayStop => {
                let p = self.relays[t]
                    .as_ref()
                    .filter(|p| p.name == process)
                    .ok_or_else(|| format!("{process} is gone before its SIGCONT"))?;
                p.signal("CONT")?;
                match p.await_stopped(false, Duration::from_secs(1)).await {
                    Some('T') => Err(format!("{process} still stopped after SIGCONT")),
                    _ => Ok(()),
                }
            }
            FaultKind::EtcdRestart => self.start_etcd().await,
            FaultKind::RouterPartition => {
                self.partitioned[t] = false;
                let ns = self.ns.as_ref().ok_or("partitions need --no-netns off")?;
                ns.link(t, true)
            }
            FaultKind::RouterStall | FaultKind::RouterRestart => Ok(()),
        }
    }

    /// Everything up, nothing held: what the settle needs.
    pub(crate) fn whole(&self) -> bool {
        self.etcd.is_some()
            && self.relays.iter().all(Option::is_some)
            && self.router_ready.iter().all(|r| *r)
            && !self.partitioned.iter().any(|p| *p)
    }

    /// What keeps it from being [`whole`](Self::whole), in words.
    pub(crate) fn not_whole(&self) -> String {
        let mut missing = Vec::new();
        if self.etcd.is_none() {
            missing.push("etcd down".to_owned());
        }
        for (w, p) in self.relays.iter().enumerate() {
            if p.is_none() {
                missing.push(format!("relay w{w} down"));
            }
        }
        for (r, ready) in self.router_ready.iter().enumerate() {
            if !ready {
                missing.push(format!("{} not ready", router_name(self, r)));
            }
        }
        for (r, cut) in self.partitioned.iter().enumerate() {
            if *cut {
                missing.push(format!("router r{r} partitioned"));
            }
        }
        missing.join(", ")
    }

    pub(crate) async fn shutdown(&mut self) {
        for w in 0..self.relays.len() {
            if let Some(p) = self.relays[w].as_ref() {
                let _ = p.signal("CONT");
                let _ = p.signal("TERM");
            }
        }
        for slot in &mut self.relays {
            if let Some(mut p) = slot.take() {
                p.wait(Duration::from_secs(5)).await;
            }
        }
        for slot in &mut self.routers {
            if let Some(mut p) = slot.take() {
                let _ = p.child.start_kill();
                p.wait(Duration::from_secs(5)).await;
            }
        }
        if let Some(mut p) = self.kv_router.take() {
            let _ = p.child.start_kill();
            p.wait(Duration::from_secs(5)).await;
        }
        for p in &mut self.engines {
            let _ = p.child.start_kill();
            p.wait(Duration::from_secs(5)).await;
        }
        if let Some(mut p) = self.etcd.take() {
            let _ = p.signal("TERM");
            p.wait(Duration::from_secs(5)).await;
        }
    }
}

/// The body of `GET path` on `127.0.0.1:port` (within 2 s), as text.
async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut body = Vec::new();
        s.read_to_end(&mut body).await.ok()?;
        Some(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
}

/// Whether etcd on `port` says it is healthy.
pub(crate) async fn healthy(port: u16) -> bool {
    http_get(port, "/health")
        .await
        .is_some_and(|body| body.contains("\"health\":\"true\""))
}

/// A Prometheus gauge or counter's value from an admin endpoint's `/metrics`.
pub(crate) async fn metric(port: u16, name: &str) -> Option<f64> {
    let body = http_get(port, "/metrics").await?;
    body.lines()
        .filter_map(|l| l.strip_prefix(name))
        .find_map(|rest| rest.strip_prefix(' ')?.trim().parse().ok())
}

pub(crate) fn router_name(c: &Cluster, r: usize) -> String {
    c.routers[r]
        .as_ref()
        .map(|p| p.name.clone())
        .unwrap_or_else(|| format!("router r{r}"))
}
