//! `kv-router`: the router-side KV job as a process — follow every publisher of router
//! events, decode them, keep a block index.
//!
//! ```text
//! kv-router (--etcd URL [--dynamo] | --kube [--kube-namespace K]… --dynamo
//!            | --static EP… [--wire eventplane|dynamo] | --bus-listen … alone)
//!           --namespace NS [--component C] [--endpoint E] --topic T
//!           [--count N] [--timeout-ms MS] [--format json|quiet] [--dump-index]
//!           [--max-index-blocks N] [--max-publishers N]
//!           [--bus-listen ADDR --bus-cert PEM --bus-key PEM
//!            (--bus-clients FILE | --bus-token-file FILE)]
//! ```
//! With `--bus-listen` (feature `tunnel`) it also runs an event bus there: brokers
//! inside a cluster dial in (`event-broker`), and the publishers of every namespace a
//! broker credential grants are reached through the brokers covering it; the others
//! directly. `--bus-clients` lists one credential per broker, bound to its client id
//! and namespaces:
//! ```toml
//! [[broker]]
//! client_id = "broker-a"
//! token_sha256 = "…"        # sha256sum of the token the broker sends (64 hex digits)
//! namespaces = ["prod"]
//! ```
//! `--bus-token-file` instead trusts one shared token, granted `--namespace` only.
//! `[[source]]` tables (the same three keys, and optionally `worker_ids = [..]`, the
//! workers it may speak for) grant a *source*: a `kv-relay --bus-url …` the router
//! cannot reach dials in and announces its own publisher (DESIGN §7.4), only in its
//! namespaces. The router follows the announced publishers of its wire
//! beside those of `--etcd`/`--kube`/`--static`, or alone when none is given.
//! A `DynamicSubscriber` over etcd (feature `etcd`), Kubernetes (feature `kube`:
//! Dynamo's `DynamoWorkerMetadata` resources joined with EndpointSlice readiness, in
//! the kubeconfig's namespace or each `--kube-namespace`; the client configured as
//! kubectl's, or in-cluster) or a static list of endpoints.
//! With `--dynamo` it follows Dynamo's records (`v1/event_channels/…`, every endpoint
//! unless `--endpoint E`) and reads Dynamo's wire: it follows Dynamo 1.6 workers as
//! they run, or `kv-relay --wire dynamo`. Without it, our records and wire.
//!
//! Prints one JSON line per router event, as `kv_listen` does
//! (`{"worker_id":…,"tier":…,"event":{"id":…,"dp_rank":…,"data":…}}`; none with
//! `--format quiet`), and applies each to a block index, one per publisher. Nothing is
//! kept that a worker may no longer hold: a `cleared` empties every tier of its worker
//! and rank; an event id that is not the publisher's next one (events lost on the way)
//! or a reconnection forgets that publisher's blocks first; a publisher that leaves
//! discovery takes its blocks with it (stderr lines say so). `--help` has the
//! formats. On Ctrl-C / SIGTERM or after N events it prints its stats as one JSON
//! object, the last line on stderr: the subscriber's counters, decode errors per reason,
//! the index size and the blocks it refused past `--max-index-blocks`, the bus's
//! counters with `--bus-listen` (with `--dump-index`, the index itself). Exit codes: 0 on a signal or after N events; 1 on timeout (or if
//! the subscriber stops); 2 on bad arguments; 3 when discovery cannot be reached (or
//! --bus-listen cannot be bound).

use eventplane_services::common;

use std::collections::HashSet;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser, ValueEnum};
use common::{StartError, chain, optional_timeout, static_discovery, stop_signal};
use eventplane::discovery::{Backend, ChannelId, Discovery, Query};
use eventplane::kv::{
    RouterEvent,
    router::{IndexFeed, RecoveryClientConfig, RecoveryDriver, RouterIndexConfig, Wipe},
};
use eventplane::metrics::Exporter;
use eventplane::subscriber::{DynamicSubscriber, DynamicSubscriberBuilder, Item, Notice};
use eventplane::wire::Dialect;
use eventplane_services::score::{ScoreServer, SharedFeed};
use eventplane_services::service::{self, ServiceArgs};
use std::future::Future;

#[derive(Parser, Debug)]
#[command(
    name = "kv-router",
    version = service::VERSION,
    about = "Follow router-event publishers (ours or Dynamo's) into a block index",
    after_help = "Exit codes: 0 on SIGTERM / Ctrl-C or after --count events; 1 on timeout or \
                  if the subscriber stops; 2 on bad arguments; 3 when discovery cannot be \
                  reached or --bus-listen cannot be bound.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug).",
    after_long_help = format!(
        "The index: the library's RouterIndex, every worker's device-tier blocks per \
         (worker, dp rank) in one prefix tree, scored as Dynamo's router scores them \
         (leading blocks held; --serve answers those scores). stored adds under its \
         parent as that worker and rank stored it (an unknown parent refuses the \
         event), removed removes, cleared empties its worker and rank. An event is \
         indexed only under its publisher's worker identity (from discovery or the \
         bus): a payload naming another worker is refused and counted. \
         Event ids are dense per publisher: an event whose id is not the next one \
         follows lost events (a full queue, a dropped connection, this router's own \
         lanes), so what that publisher fed is forgotten before it is applied, as \
         Dynamo's router does; so does a reconnection (what was sent meanwhile is \
         lost). A publisher that left discovery takes its ranks with it (unless \
         another publisher fed them since). \
         So nothing is kept that a worker may no longer hold (its relay also sends \
         cleared when it lost track of its engine).\n\nOutput: one router event per stdout line (none \
         with --format quiet). {}\nOn stderr: `event bus listening on ADDR` (with \
         --bus-listen), `publisher ID left: forgot N blocks`, `publisher ID lost \
         events (id N after M): forgot K blocks` (at most ten of those), `publisher ID \
         reconnected: forgot K blocks`, and last, at exit, the counters as \
         one JSON object: {{\"wire\", \"router_events\", \"index_blocks\", \
         \"index_refused\" (stored blocks past --max-index-blocks or the index's caps, \
         not indexed), \"index_stats\": {{blocks, nodes, ranks, bytes, refused_blocks, \
         refused_events by reason, other_tier_events, unknown_removed_blocks, \
         wiped_blocks}}, with --serve \"serve\": {{scored, refused, \
         refused_connections}}, \
         \"publishers\", \"unidentified_deliveries\" (from publishers that registered no \
         worker identity: every delivery with --static or --dynamo, whose publishers \
         carry none), \"lost_views\" (event id gaps and reconnections that forgot \
         blocks), \"decode_errors\": \
         {{\"frames\", \"header\", \"length\", \"envelope\", \"identity\", \"payload\"}}, \
         \"subscriber\": {{...}}, with --bus-listen \"bus\": {{...}} (the event bus's \
         counters), and with --dump-index \"index\"}}.\n\nExit codes: 0 on \
         SIGTERM / Ctrl-C or after --count events; 1 on timeout or if the subscriber \
         stops; 2 on bad arguments; 3 when discovery cannot be reached or --bus-listen \
         cannot be bound.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, \
         debug, or target=level pairs such as eventplane=debug).",
        common::ROUTER_EVENT_HELP
    )
)]
#[command(group(clap::ArgGroup::new("source").args(["etcd", "kube", "static_endpoints"])))]
#[command(group(clap::ArgGroup::new("bus_credentials").args(["bus_clients", "bus_token_file"])))]
struct Args {
    /// etcd endpoint (http://host:2379); repeat for a cluster. Needs feature `etcd`.
    #[arg(long)]
    etcd: Vec<String>,
    /// Follow Dynamo workers on Kubernetes through their DynamoWorkerMetadata
    /// resources (with --dynamo). Needs feature `kube`.
    #[arg(long, requires = "dynamo")]
    kube: bool,
    /// Kubernetes namespace to follow (with --kube; repeat for several; default: the
    /// kubeconfig's namespace, or the pod's in-cluster).
    #[arg(long = "kube-namespace", requires = "kube")]
    kube_namespace: Vec<String>,
    /// Follow Dynamo's records (etcd's, or with --kube its resources) and read
    /// Dynamo's wire.
    #[arg(long, conflicts_with = "static_endpoints")]
    dynamo: bool,
    /// Publisher endpoints (tcp://host:port), instead of discovery.
    #[arg(long = "static", num_args = 1..)]
    static_endpoints: Vec<String>,
    /// The publishers' wire (--dynamo implies dynamo; with --etcd, our records name
    /// publishers of either wire).
    #[arg(long, default_value = "eventplane", conflicts_with = "dynamo")]
    wire: Dialect,
    /// Namespace to follow. With --static, the endpoints become publishers 0, 1, … of
    /// NS/{C or "static"}/TOPIC (a broker must cover NS to carry them).
    #[arg(long)]
    namespace: String,
    /// Component to follow (default: every component of the namespace).
    #[arg(long)]
    component: Option<String>,
    /// Dynamo endpoint to follow (with --dynamo or --kube, refused otherwise; default:
    /// every endpoint).
    #[arg(long)]
    endpoint: Option<String>,
    /// Topic of the router events.
    #[arg(long)]
    topic: String,
    /// Exit 0 after this many router events.
    #[arg(long)]
    count: Option<u64>,
    /// Exit 1 if the run lasts longer than this.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
    /// One JSON line per router event, or nothing.
    #[arg(long, value_enum, default_value = "json")]
    format: Format,
    /// Blocks the index holds per worker and dp rank; stored blocks past it are not
    /// indexed, counted in the stats line's `index_refused` (the index under-claims,
    /// never over-claims, what a worker holds). The whole index holds at most 2^24
    /// blocks and 2 GiB.
    #[arg(long = "max-index-blocks", default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_index_blocks: u64,
    /// How long one recovery may take, from dialling the worker (or opening a stream
    /// through the bus) to the end of its answer; past it the worker is wiped
    /// (`wipes.recovery_failed`). Raise it for large workers behind slow links.
    #[arg(long = "recovery-timeout-ms", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    recovery_timeout_ms: u64,
    /// With --dynamo: where Dynamo workers dial back with their answers to recovery
    /// queries (ip:port, port 0 for any; workers dial the address the router reached
    /// them from, so the ip must be one of those, or a wildcard). Workers whose
    /// records carry a `recovery_target` (a Dynamo worker with its local indexer,
    /// `kv-relay --wire dynamo --recovery-bind`) are then repaired, not wiped.
    #[arg(
        long = "call-home-bind",
        default_value = "0.0.0.0:0",
        requires = "dynamo"
    )]
    call_home_bind: std::net::SocketAddr,
    /// A network discovery may name for this router to dial (CIDR; repeat for
    /// several): publishers and recovery endpoints elsewhere are refused and counted
    /// (`refused_by_filter`). Without it, what etcd, Kubernetes or the bus name is
    /// dialled anywhere but loopback, link-local, metadata and the other special
    /// ranges (a record can name any address: give the workers' networks, e.g. the
    /// pod CIDR); a special range, loopback included, is reached only through a CIDR
    /// inside it (127.0.0.0/8). --static endpoints, given here, are dialled as given.
    #[arg(long = "allow-cidr")]
    allow_cidr: Vec<eventplane::net::Cidr>,
    /// Publishers followed at most (default: the library's, 4,096); past it a
    /// publisher is refused and counted. Each costs one open file: the soft limit is
    /// raised to the hard limit at start.
    #[arg(long = "max-publishers", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_publishers: Option<u64>,
    /// Serve the index's overlap scores on this address (ip:port): `POST
    /// /v1/scores` with `{"local_hashes": [u64, ...]}` or `{"tokens": [u32, ...],
    /// "block_size": N}` answers `{"scores": [{"worker_id", "dp_rank", "blocks"}, ...]}`
    /// (every worker and rank holding the first block, with how many leading blocks
    /// it holds; device tier). Bounded: 1 MiB bodies (413), 65,536 hashes (400), 64
    /// connections; malformed requests get a 4xx with {"error": "..."}.
    #[arg(long, value_parser = service::listen_address)]
    serve: Option<String>,
    /// Add the final index to the stats line: `"index": [{"worker_id", "dp_rank",
    /// "tier", "block_hashes": [...]}, ...]`, sorted.
    #[arg(long = "dump-index")]
    dump_index: bool,
    /// Run an event bus here (host:port) for brokers inside the cluster and sources
    /// (`kv-relay --bus-url`): publishers of a namespace a broker credential grants are
    /// reached through the brokers covering it (none up: they wait), the others
    /// directly; with `[[source]]` credentials, the publishers sources announce with
    /// this router's --wire are followed too (alone, without --etcd/--kube/--static).
    /// Needs feature `tunnel`, --bus-cert, --bus-key, and --bus-clients or
    /// --bus-token-file.
    #[arg(long = "bus-listen", requires_all = ["bus_cert", "bus_key", "bus_credentials"])]
    bus_listen: Option<String>,
    /// The bus's TLS certificate chain (PEM).
    #[arg(long = "bus-cert", requires = "bus_listen")]
    bus_cert: Option<std::path::PathBuf>,
    /// The bus's TLS private key (PEM).
    #[arg(long = "bus-key", requires = "bus_listen")]
    bus_key: Option<std::path::PathBuf>,
    /// The bus's credentials (TOML): `[[broker]]` and `[[source]]` tables of
    /// `client_id`, `token_sha256` (hex SHA-256 of the client's token) and
    /// `namespaces` (what a broker may cover, or a source announce in). A client can
    /// claim no other client id, role or namespace.
    #[arg(long = "bus-clients", requires = "bus_listen")]
    bus_clients: Option<std::path::PathBuf>,
    /// A file holding one shared bearer token, for a single trusted broker: any client
    /// id, granted --namespace only.
    #[arg(long = "bus-token-file", requires = "bus_listen")]
    bus_token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    service: ServiceArgs,
}

/// Lifecycle notices queued between two batches (connections, gaps, departures).
const NOTICES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    Json,
    Quiet,
}

async fn discovery(args: &Args) -> Result<Arc<dyn Discovery>, StartError> {
    if !args.static_endpoints.is_empty() {
        return static_discovery(
            &args.namespace,
            args.component.as_deref(),
            &args.topic,
            &args.static_endpoints,
        )
        .map_err(|e| StartError::Args(format!("invalid --static publishers: {e}")));
    }
    // Dynamo's records (--dynamo on etcd; always on Kubernetes), narrowed to
    // --endpoint when given.
    let (mut backend, flag) = if args.kube {
        let backend = Backend::kube()
            .kube_namespaces(args.kube_namespace.clone())
            // The first list tells whether the API server can be reached and read.
            .check(Query::new(args.namespace.clone()));
        (backend, "--kube")
    } else if args.dynamo {
        (Backend::etcd(&args.etcd).dialect(Dialect::Dynamo), "--etcd")
    } else {
        (Backend::etcd(&args.etcd), "--etcd")
    };
    if let Some(endpoint) = &args.endpoint {
        backend = backend.dynamo_endpoint(endpoint.clone());
    }
    backend
        .connect()
        .await
        .map(|c| c.discovery().clone())
        .map_err(|e| StartError::discovery(flag, &e))
}

/// The longest `/readyz` waits for the first recoveries once discovery gave its view.
const RECOVERY_READY_BOUND: std::time::Duration = std::time::Duration::from_secs(10);

/// The router's view: the library's index, fed in order by the subscriber
/// (`kv::router::IndexFeed`: dense event ids per publisher, so an id gap or a reconnection
/// forgets what that publisher fed before anything more is applied, and a departed
/// publisher takes its ranks with it), and what could not be decoded.
struct Router {
    feed: SharedFeed,
    events: u64,
    payload_errors: u64,
    /// Deliveries from publishers that registered no worker identity.
    unidentified: u64,
    /// Id gaps reported on stderr so far (at most ten lines).
    gaps_said: u64,
    /// Failed recoveries are said at most once a second (with how many were not).
    failures_said: eventplane::net::RateLimitedWarn,
}

impl Router {
    fn feed(&self) -> std::sync::RwLockWriteGuard<'_, IndexFeed> {
        self.feed.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `events` of `source`, a few at a time, so a scoring request waits for
    /// at most a few events (a `cleared` costs what its rank holds).
    fn apply(&mut self, source: &eventplane::discovery::Instance, events: &[RouterEvent]) {
        let mut wiped = Vec::new();
        for chunk in events.chunks(64) {
            let mut feed = self.feed();
            feed.apply(source, chunk);
            wiped.append(&mut feed.wiped());
        }
        self.say(wiped);
    }

    /// A recovery's answer for `publisher` (see `kv::router::IndexFeed::recovered`).
    fn recovered(&mut self, answer: eventplane::kv::router::RecoveryAnswer) {
        if let Err(e) = &answer.answer {
            let now = std::time::Instant::now();
            if let Some(unsaid) = self.failures_said.check("recovery", now) {
                let more = match unsaid {
                    0 => String::new(),
                    n => format!(" ({n} more failures not shown)"),
                };
                eprintln!(
                    "publisher {}: recovery failed: {}{more}",
                    answer.publisher,
                    chain(e)
                );
            }
        }
        self.feed().recovered(answer);
        self.say_wipes();
    }

    fn notice(&mut self, notice: &Notice) {
        self.feed().notice(notice);
        self.say_wipes();
    }

    /// After notices were dropped (a full queue), a `Departed` may be among them:
    /// forgets the publishers the subscriber no longer follows.
    fn reconcile(&mut self, followed: &HashSet<ChannelId>) {
        self.feed().retain_publishers(|id| followed.contains(id));
        self.say_wipes();
    }

    /// One stderr line per wipe the feed noted (at most ten for id gaps).
    fn say_wipes(&mut self) {
        let wiped = self.feed().wiped();
        self.say(wiped);
    }

    fn say(&mut self, wiped: Vec<eventplane::kv::router::Wiped>) {
        for w in wiped {
            match w.cause {
                Wipe::IdGap { expected, got } => {
                    self.gaps_said += 1;
                    if self.gaps_said <= 10 {
                        eprintln!(
                            "publisher {} lost events (id {got} after {}): forgot {} blocks",
                            w.publisher,
                            expected.saturating_sub(1),
                            w.blocks
                        );
                    }
                }
                Wipe::Reconnected => {
                    eprintln!(
                        "publisher {} reconnected: forgot {} blocks",
                        w.publisher, w.blocks
                    )
                }
                Wipe::Superseded => eprintln!(
                    "publisher {} was superseded by another for its worker: forgot {} blocks",
                    w.publisher, w.blocks
                ),
                Wipe::RecoveryFailed | Wipe::HeldOverflow => eprintln!(
                    "publisher {} could not be repaired ({:?}): forgot {} blocks",
                    w.publisher, w.cause, w.blocks
                ),
                _ => eprintln!("publisher {} left: forgot {} blocks", w.publisher, w.blocks),
            }
        }
    }

    /// Every block held, one JSON object per (worker, dp rank) (device tier: the
    /// index scores that one).
    fn entries(&self) -> Vec<serde_json::Value> {
        let feed = self.feed.read().unwrap_or_else(|p| p.into_inner());
        let index = feed.index();
        index
            .ranks()
            .map(|(w, r)| {
                let mut hashes: Vec<_> = index.rank_block_hashes(w, r).collect();
                hashes.sort_unstable();
                serde_json::json!({
                    "worker_id": w,
                    "dp_rank": r,
                    "tier": "device",
                    "block_hashes": hashes,
                })
            })
            .collect()
    }
}

/// The next item; what was written for the items before is flushed first when the
/// next one is not there yet (one write per burst, and nothing held back while
/// waiting).
async fn next_item(
    sub: &mut DynamicSubscriber,
    out: &mut std::io::BufWriter<std::io::Stdout>,
) -> Option<Item> {
    let mut next = std::pin::pin!(sub.recv_item());
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if let std::task::Poll::Ready(item) = next.as_mut().poll(&mut cx) {
        return item;
    }
    let _ = out.flush();
    next.await
}

#[tokio::main]
async fn main() -> ExitCode {
    service::print_man_page_if_asked(Args::command());
    let stop = stop_signal();
    let args = Args::parse();
    // Before the subscriber samples its counters.
    let recorder = match service::start(&args.service, "warn") {
        Ok(r) => r,
        Err(code) => return code,
    };
    common::raise_fd_limit();
    if args.endpoint.is_some() && !args.dynamo {
        // Checked here: `requires = "dynamo"` on --endpoint did not refuse a command
        // line without --dynamo (clap 4.5).
        Args::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "--endpoint names a Dynamo endpoint: it needs --dynamo",
            )
            .exit();
    }
    let wire = if args.dynamo {
        Dialect::Dynamo
    } else {
        args.wire
    };
    let bus = match start_bus(&args, wire).await {
        Ok(b) => b,
        Err(e) => return e.report(),
    };
    let announced_only = args.etcd.is_empty() && !args.kube && args.static_endpoints.is_empty();
    let announced = bus.as_ref().and_then(|b| b.announced.clone());
    let discovery: Arc<dyn Discovery> = match (announced_only, announced) {
        (true, Some(announced)) => announced,
        (true, None) => {
            return StartError::Args(
                "one of --etcd, --kube or --static is needed, or --bus-listen with \
                 [[source]] credentials in --bus-clients (to follow announced sources only)"
                    .to_owned(),
            )
            .report();
        }
        (false, announced) => match discovery(&args).await {
            Ok(d) => match announced {
                // Announced sources beside the publishers of discovery.
                Some(announced) => Arc::new(eventplane::discovery::Merged::new(vec![d, announced])),
                None => d,
            },
            Err(e) => return e.report(),
        },
    };
    let discovery_stats = discovery.clone();
    let mut query = Query::new(args.namespace.clone()).topic(args.topic.clone());
    if let Some(c) = &args.component {
        query = query.component(c.clone());
    }
    let filter = dial_filter(&args);
    let builder = DynamicSubscriber::builder(discovery, query)
        .addr_filter(filter.clone())
        .topic(args.topic.clone())
        // Our records name their worker, and so do Dynamo's resources on Kubernetes
        // (their `event_sources`); static endpoints cannot, and in etcd Dynamo's
        // worker identity is in its payload (`event_sources` is not read back).
        // Sources announce their worker too.
        .expect_worker_identity(
            announced_only || (args.static_endpoints.is_empty() && (args.kube || !args.dynamo)),
        )
        .layout(wire.layout());
    let builder = match args.max_publishers {
        Some(n) => builder.max_publishers(usize::try_from(n).unwrap_or(usize::MAX)),
        None => builder,
    };
    let feed: SharedFeed = Arc::new(std::sync::RwLock::new(IndexFeed::new(
        RouterIndexConfig::default()
            .max_blocks_per_rank(usize::try_from(args.max_index_blocks).unwrap_or(usize::MAX)),
    )));
    let sampled = feed.clone();
    let mut exporter = Exporter::new()
        .source(move || discovery_stats.stats())
        .source(move || sampled.read().unwrap_or_else(|p| p.into_inner()).stats());
    // Publishers whose workers serve a recovery log are repaired from it instead of
    // wiped (what discovery names is dialled through the subscriber's address filter,
    // the client's default), reached as their publishers are.
    let mut asking = RecoveryClientConfig::default();
    asking = asking.timeout(std::time::Duration::from_millis(args.recovery_timeout_ms));
    asking = asking.filter(Some(filter));
    let mut recovery = RecoveryDriver::new(asking);
    if args.dynamo {
        use eventplane::kv::dynamo_recovery::{CallHomeConfig, CallHomeListener};
        match CallHomeListener::bind(args.call_home_bind, CallHomeConfig::default()).await {
            Ok(home) => recovery = recovery.dynamo(Arc::new(home)),
            Err(e) => {
                eprintln!("cannot bind --call-home-bind {}: {e}", args.call_home_bind);
                return ExitCode::from(3);
            }
        }
    }
    let (builder, bus_stats) = match bus {
        Some(bus) => {
            exporter = (bus.exported)(exporter);
            recovery = (bus.recovery)(recovery);
            ((bus.tunnel)(builder), Some(bus.stats))
        }
        None => (builder, None),
    };
    let spawned = builder.notices(NOTICES).spawn();
    let mut sub = match spawned {
        Ok(sub) => sub,
        Err(e) => {
            eprintln!("invalid subscriber settings: {e}");
            return ExitCode::from(2);
        }
    };
    let handle = sub.handle();
    let sampled = handle.clone();
    let exporter = exporter.source(move || sampled.stats());
    // Ready once the first complete view came from discovery (every publisher in it
    // is being dialled) and the first recoveries are done: the workers that serve a
    // recovery log were rebuilt from their dumps (at most RECOVERY_READY_BOUND after
    // the view, so one dead worker cannot hold readiness down).
    let recovered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let admin = match (&args.service.admin_listen, &recorder) {
        (Some(listen), Some(recorder)) => {
            let probed = handle.clone();
            let rebuilt = recovered.clone();
            let ready = move || {
                if !probed.synced() {
                    Err("discovery has not given a complete view yet".to_owned())
                } else if !rebuilt.load(std::sync::atomic::Ordering::Relaxed) {
                    Err("the workers' first recoveries are still running".to_owned())
                } else {
                    Ok(())
                }
            };
            match service::Admin::start(listen, recorder, exporter, ready).await {
                Ok(admin) => Some(admin),
                Err(e) => {
                    eprintln!("--admin-listen {listen}: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        _ => None,
    };
    let serve = match &args.serve {
        Some(listen) => match ScoreServer::bind(listen, feed.clone()).await {
            Ok(server) => {
                eprintln!("scores on http://{}/v1/scores", server.local_addr());
                Some(server)
            }
            Err(e) => {
                return StartError::Unavailable(format!("cannot listen on --serve {listen}: {e}"))
                    .report();
            }
        },
        None => None,
    };
    let mut router = Router {
        feed,
        events: 0,
        payload_errors: 0,
        unidentified: 0,
        gaps_said: 0,
        failures_said: eventplane::net::RateLimitedWarn::new(std::time::Duration::from_secs(1)),
    };
    // One write per burst of items (stdout alone flushes every line).
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout());
    // Notices dropped so far: a dropped `Departed` is made up for by a reconcile.
    let mut notices_dropped = 0;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut synced_at: Option<tokio::time::Instant> = None;
    let timeout = optional_timeout(args.timeout_ms);
    tokio::pin!(timeout);
    tokio::pin!(stop);
    let code = 'run: loop {
        if args.count.is_some_and(|n| router.events >= n) {
            break 'run 0;
        }
        recovery.submit(router.feed().take_recoveries());
        tokio::select! {
            () = &mut stop => break 'run 0,
            () = &mut timeout => break 'run 1,
            answer = recovery.next() => router.recovered(answer),
            _ = tick.tick() => {
                if !recovered.load(std::sync::atomic::Ordering::Relaxed) && handle.synced() {
                    let since = *synced_at.get_or_insert_with(tokio::time::Instant::now);
                    // Rebuilds of workers whose recovery failed wait out their
                    // back-off in the driver: they do not hold readiness.
                    let fed = router.feed().stats();
                    let quiet = fed.recovering == 0 && recovery.pending() as u64 <= fed.rebuilding;
                    // A tick after the view: its publishers' first dumps were asked.
                    let settled = since.elapsed() >= std::time::Duration::from_secs(1) && quiet;
                    if settled || since.elapsed() >= RECOVERY_READY_BOUND {
                        recovered.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                let stats = handle.stats();
                if stats.notices_dropped > notices_dropped {
                    notices_dropped = stats.notices_dropped;
                    let followed = stats.publishers.into_iter().map(|(id, _)| id).collect();
                    router.reconcile(&followed);
                }
            }
            item = next_item(&mut sub, &mut out) => {
                // Deliveries and notices in one ordered stream: a publisher's
                // `Departed` follows its last delivery.
                let delivery = match item {
                    None => {
                        eprintln!("the subscriber stopped");
                        break 'run 1;
                    }
                    Some(Item::Notice(notice)) => {
                        router.notice(&notice);
                        continue;
                    }
                    Some(Item::Delivery(delivery)) => delivery,
                    Some(_) => continue,
                };
                // Warned about by the subscriber (expect_worker_identity); the
                // events are indexed under the worker ids in their payload.
                router.unidentified += u64::from(delivery.source.worker.is_none());
                // Every layout but Raw places a payload; none is an undecodable one.
                let Some(payload) = delivery.payload() else {
                    router.payload_errors += 1;
                    continue;
                };
                let events = match wire.decode_router_events(&payload) {
                    Ok(events) => events,
                    Err(e) => {
                        router.payload_errors += 1;
                        if router.payload_errors == 1 {
                            eprintln!("undecodable payload from {}: {}", delivery.source.id, chain(&e));
                        }
                        continue;
                    }
                };
                // Up to --count, applied and printed.
                let left = args.count.map_or(u64::MAX, |n| n.saturating_sub(router.events));
                let left = usize::try_from(left).unwrap_or(usize::MAX);
                let events = events.get(..events.len().min(left)).unwrap_or_default();
                router.apply(&delivery.source, events);
                router.events += events.len() as u64;
                if args.format == Format::Json {
                    for ev in events {
                        if serde_json::to_writer(&mut out, ev).is_ok() {
                            let _ = out.write_all(b"\n");
                        }
                    }
                }
            }
        }
    };
    let _ = out.flush();
    if let Some(admin) = admin {
        admin.stop().await;
    }
    let stats = handle.stats();
    let m = stats.total.malformed;
    let fed = router.feed().stats();
    let i = fed.index;
    let mut summary = serde_json::json!({
        "wire": wire.as_str(),
        "router_events": router.events,
        "index_blocks": i.blocks,
        "index_refused": i.refused_rank_full_blocks
            + i.refused_worker_full_blocks
            + i.refused_index_full_blocks,
        "index_stats": {
            "blocks": i.blocks,
            "nodes": i.nodes,
            "ranks": i.ranks,
            "bytes": i.bytes,
            "refused_blocks": {
                "rank_full": i.refused_rank_full_blocks,
                "worker_full": i.refused_worker_full_blocks,
                "index_full": i.refused_index_full_blocks,
            },
            "refused_events": {
                "foreign_worker": i.refused_foreign,
                "unidentified": i.refused_unidentified,
                "unknown_parent": i.refused_unknown_parent,
                "invalid_chain": i.refused_invalid_chain,
                "too_many_ranks": fed.refused_rank_events,
            },
            "other_tier_events": i.other_tier_events,
            "unknown_removed_blocks": i.unknown_removed_blocks,
            "wiped_blocks": fed.wiped_blocks,
        },
        "publishers": stats.publishers.len(),
        "unidentified_deliveries": router.unidentified,
        "lost_views": fed.wipes_id_gap
            + fed.wipes_reconnect
            + fed.wipes_recovery_failed
            + fed.wipes_held_overflow,
        "wipes": {
            "id_gap": fed.wipes_id_gap,
            "reconnect": fed.wipes_reconnect,
            "recovery_failed": fed.wipes_recovery_failed,
            "held_overflow": fed.wipes_held_overflow,
            "superseded": fed.wipes_superseded,
        },
        "superseded_events": fed.superseded_events,
        "repairs": {
            "since": fed.repairs_since,
            "dump": fed.repairs_dump,
            "rebuild": fed.repairs_rebuild,
            "p50_ms": fed.repair_p50_ms,
            "p99_ms": fed.repair_p99_ms,
            "recovering": fed.recovering,
            "rebuilding": fed.rebuilding,
            "rebuilds_failed": fed.rebuilds_failed,
            "held_events": fed.held_events,
            "late_duplicates": fed.late_duplicates,
            "held_dropped": fed.held_dropped,
            "stale_answers": fed.stale_answers,
        },
        "decode_errors": {
            "frames": m.frames,
            "header": m.header,
            "length": m.length,
            "envelope": m.envelope,
            "identity": m.identity,
            "payload": router.payload_errors,
        },
        "subscriber": stats,
    });
    if let (Some(serve), Some(fields)) = (&serve, summary.as_object_mut()) {
        fields.insert("serve".to_owned(), serve.stats());
    }
    if let (Some(stats), Some(fields)) = (&bus_stats, summary.as_object_mut()) {
        fields.insert("bus".to_owned(), stats());
    }
    if let (true, Some(fields)) = (args.dump_index, summary.as_object_mut()) {
        fields.insert("index".to_owned(), router.entries().into());
    }
    if let Some(serve) = serve {
        serve.stop().await;
    }
    handle.shutdown().await;
    eprintln!("{summary}");
    ExitCode::from(code)
}

/// The bus's counters, for the stats line.
type BusStatsFn = Box<dyn Fn() -> serde_json::Value>;

/// `--bus-clients`: one `[[broker]]` table per credential.
#[cfg(feature = "tunnel")]
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BusClientsFile {
    #[serde(default)]
    broker: Vec<BrokerEntry>,
    #[serde(default)]
    source: Vec<BrokerEntry>,
}

#[cfg(feature = "tunnel")]
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BrokerEntry {
    client_id: String,
    token_sha256: String,
    namespaces: Vec<String>,
    /// A source only: the workers it may announce publishers for (any, when absent).
    #[serde(default)]
    worker_ids: Option<Vec<u64>>,
}

/// The credentials of --bus-clients, or the one token of --bus-token-file granted
/// --namespace.
#[cfg(feature = "tunnel")]
fn bus_clients(args: &Args) -> Result<eventplane::tunnel::BusClients, String> {
    use eventplane::tunnel::{BusClients, Secret, TokenDigest};
    if let Some(token) = &args.bus_token_file {
        let token = Secret::from_file(token).map_err(|e| chain(&e))?;
        return BusClients::shared(&token, vec![args.namespace.clone()]).map_err(|e| chain(&e));
    }
    let Some(path) = &args.bus_clients else {
        return Err("--bus-clients or --bus-token-file is needed".to_owned());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--bus-clients {}: {e}", path.display()))?;
    let file: BusClientsFile =
        toml::from_str(&text).map_err(|e| format!("--bus-clients {}: {e}", path.display()))?;
    let mut clients = BusClients::new();
    let entries = file
        .broker
        .into_iter()
        .map(|e| (false, e))
        .chain(file.source.into_iter().map(|e| (true, e)));
    for (source, entry) in entries {
        let role = if source { "source" } else { "broker" };
        let at = |e: eventplane::tunnel::TunnelError| {
            format!("--bus-clients: {role} {:?}: {}", entry.client_id, chain(&e))
        };
        let digest = TokenDigest::from_hex(&entry.token_sha256).map_err(at)?;
        let (id, namespaces) = (entry.client_id.clone(), entry.namespaces.clone());
        clients = match (source, entry.worker_ids.clone()) {
            (true, Some(workers)) => clients.source_for_workers(id, digest, namespaces, workers),
            (true, None) => clients.source(id, digest, namespaces),
            (false, None) => clients.broker(id, digest, namespaces),
            (false, Some(_)) => {
                return Err(format!(
                    "--bus-clients: broker {:?}: worker_ids is for [[source]] entries",
                    entry.client_id
                ));
            }
        }
        .map_err(at)?;
    }
    if clients.is_empty() {
        return Err(format!(
            "--bus-clients {}: no [[broker]] or [[source]] entry",
            path.display()
        ));
    }
    Ok(clients)
}

/// With --bus-listen: the event bus, started.
struct Bus {
    /// Tells the subscriber to use it.
    tunnel: Box<dyn FnOnce(DynamicSubscriberBuilder) -> DynamicSubscriberBuilder>,
    /// Tells the recovery driver to use it (workers are asked for what the router lost
    /// the way their publishers are reached).
    recovery: Box<dyn FnOnce(RecoveryDriver) -> RecoveryDriver>,
    /// The publishers sources announce with the router's wire (when a `[[source]]`
    /// credential exists).
    announced: Option<Arc<dyn Discovery>>,
    stats: BusStatsFn,
    /// Adds the bus's counters to a metrics exporter.
    exported: Box<dyn FnOnce(Exporter) -> Exporter>,
}

#[cfg(feature = "tunnel")]
async fn start_bus(args: &Args, wire: Dialect) -> Result<Option<Bus>, StartError> {
    use eventplane::tunnel::{EventBus, EventBusConfig, server_tls};
    let (Some(listen), Some(cert), Some(key)) = (&args.bus_listen, &args.bus_cert, &args.bus_key)
    else {
        return Ok(None);
    };
    let refused =
        |e: eventplane::tunnel::TunnelError| StartError::Args(format!("event bus: {}", chain(&e)));
    let tls = server_tls(cert, key).map_err(refused)?;
    let clients = bus_clients(args).map_err(|e| StartError::Args(format!("event bus: {e}")))?;
    let sources = clients.has_sources();
    let bus = EventBus::bind(listen, tls, clients, EventBusConfig::default())
        .await
        .map_err(|e| {
            StartError::Unavailable(format!(
                "cannot listen on --bus-listen {listen}: {}",
                chain(&e)
            ))
        })?;
    eprintln!("event bus listening on {}", bus.local_addr());
    let stats = bus.clone();
    let stats: BusStatsFn =
        Box::new(move || serde_json::to_value(stats.stats()).unwrap_or_default());
    let sampled = bus.clone();
    let exported = Box::new(move |e: Exporter| e.source(move || sampled.stats()));
    let announced: Option<Arc<dyn Discovery>> =
        sources.then(|| Arc::new(bus.announced(wire)) as Arc<dyn Discovery>);
    let asked = bus.clone();
    Ok(Some(Bus {
        tunnel: Box::new(move |builder| builder.tunnel(bus)),
        recovery: Box::new(move |driver| driver.tunnel(asked, false)),
        announced,
        stats,
        exported,
    }))
}

#[cfg(not(feature = "tunnel"))]
async fn start_bus(args: &Args, _: Dialect) -> Result<Option<Bus>, StartError> {
    if args.bus_listen.is_some() {
        return Err(StartError::Args(
            "--bus-listen needs the `tunnel` feature: build eventplane-services with feature tunnel".to_owned(),
        ));
    }
    Ok(None)
}

/// What this router may dial: the operator's `--static` endpoints as given (loopback
/// included); what discovery names, never a special range (loopback included) unless
/// an `--allow-cidr` inside it reopens it, and only the `--allow-cidr` networks when
/// any is given.
fn dial_filter(args: &Args) -> eventplane::net::AddrFilter {
    use eventplane::net::AddrFilter;
    let base = if args.static_endpoints.is_empty() {
        AddrFilter::strict()
    } else {
        AddrFilter::default()
    };
    args.allow_cidr
        .iter()
        .fold(base, |f, cidr| f.allow_cidr(*cidr))
}
