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

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser, ValueEnum};
use common::{Index, StartError, chain, optional_timeout, static_discovery, stop_signal};
use eventplane::discovery::{ChannelId, Discovery, Query};
use eventplane::kv::{RouterEvent, decode_router_payload};
use eventplane::metrics::Exporter;
use eventplane::subscriber::{DynamicSubscriber, DynamicSubscriberBuilder, Notice};
use eventplane::wire::Wire;
use eventplane_services::service::{self, ServiceArgs};

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
        "The index: one per publisher, per (worker, dp rank, tier) a set of block hashes. \
         stored adds, removed removes, cleared empties every tier of its worker and rank. \
         Event ids are dense per publisher: an event whose id is not the next one \
         follows lost events (a full queue, a dropped connection, this router's own \
         lanes), so that publisher's blocks are forgotten before it is applied, as \
         Dynamo's router does; so does a reconnection (what was sent meanwhile is \
         lost). A publisher that left discovery takes its blocks with it. \
         So nothing is kept that a worker may no longer hold (its relay also sends \
         cleared when it lost track of its engine).\n\nOutput: one router event per stdout line (none \
         with --format quiet). {}\nOn stderr: `event bus listening on ADDR` (with \
         --bus-listen), `publisher ID left: forgot N blocks`, `publisher ID lost \
         events (id N after M): forgot K blocks` (at most ten of those), `publisher ID \
         reconnected: forgot K blocks`, and last, at exit, the counters as \
         one JSON object: {{\"wire\", \"router_events\", \"index_blocks\", \
         \"index_refused\" (stored blocks past --max-index-blocks, not indexed), \
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
    wire: Wire,
    /// Namespace to follow. With --static, the endpoints become publishers 0, 1, … of
    /// NS/{C or "static"}/TOPIC (a broker must cover NS to carry them).
    #[arg(long)]
    namespace: String,
    /// Component to follow (default: every component of the namespace).
    #[arg(long)]
    component: Option<String>,
    /// Dynamo endpoint to follow (with --dynamo; default: every endpoint).
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
    /// Blocks the index holds per publisher; stored blocks past it are not indexed,
    /// counted in the stats line's `index_refused` (the index under-claims, never
    /// over-claims, what a worker holds).
    #[arg(long = "max-index-blocks", default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_index_blocks: u64,
    /// Publishers followed at most (default: the library's, 4,096); past it a
    /// publisher is refused and counted. Each costs one open file: the soft limit is
    /// raised to the hard limit at start.
    #[arg(long = "max-publishers", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_publishers: Option<u64>,
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
    if args.kube {
        return kube(args).await;
    }
    etcd(args).await
}

#[cfg(feature = "kube")]
async fn kube(args: &Args) -> Result<Arc<dyn Discovery>, StartError> {
    use eventplane::discovery::{DynamoRecords, KubeDiscovery};
    let records = match &args.endpoint {
        Some(e) => DynamoRecords::new().endpoint(e.clone()),
        None => DynamoRecords::new(),
    };
    let mut builder = KubeDiscovery::builder().records(records);
    if !args.kube_namespace.is_empty() {
        builder = builder.namespaces(args.kube_namespace.clone());
    }
    let discovery = builder
        .connect()
        .await
        .map_err(|e| StartError::discovery("--kube", &e))?;
    // The first list tells whether the API server can be reached and read.
    discovery
        .list(Query::new(args.namespace.clone()))
        .await
        .map_err(|e| StartError::discovery("--kube", &e))?;
    Ok(Arc::new(discovery))
}

#[cfg(not(feature = "kube"))]
async fn kube(_: &Args) -> Result<Arc<dyn Discovery>, StartError> {
    Err(StartError::Args(
        "--kube needs the `kube` feature: build eventplane-services with feature kube".to_owned(),
    ))
}

#[cfg(feature = "etcd")]
async fn etcd(args: &Args) -> Result<Arc<dyn Discovery>, StartError> {
    use eventplane::discovery::{DynamoRecords, EtcdDiscovery, RecordFormat};
    let format = if args.dynamo {
        let records = DynamoRecords::new();
        RecordFormat::Dynamo(match &args.endpoint {
            Some(e) => records.endpoint(e.clone()),
            None => records,
        })
    } else {
        RecordFormat::EventPlane
    };
    EtcdDiscovery::builder(&args.etcd)
        .record_format(format)
        .connect()
        .await
        .map(|d| Arc::new(d) as Arc<dyn Discovery>)
        .map_err(|e| StartError::etcd(&e))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(_: &Args) -> Result<Arc<dyn Discovery>, StartError> {
    Err(StartError::Args(
        "--etcd needs the `etcd` feature: build eventplane-services with feature etcd".to_owned(),
    ))
}

/// What the router holds of one publisher.
#[derive(Default)]
struct Followed {
    index: Index,
    /// The id its next event must have (ids are dense from 1); 0 before the first.
    next_id: u64,
    /// Whether its first connection was seen (a second one is a reconnect).
    connected: bool,
}

/// The router's view: one block index per publisher, so a departing publisher takes
/// exactly what it reported with it (a restarted worker's new publisher, or another
/// publisher naming the same worker id, keeps its own), and what could not be decoded.
#[derive(Default)]
struct Router {
    publishers: HashMap<ChannelId, Followed>,
    /// Blocks each publisher's index holds at most.
    max_index_blocks: usize,
    /// Stored blocks not indexed (an index at its cap), of publishers gone too.
    index_refused: u64,
    events: u64,
    payload_errors: u64,
    /// Deliveries from publishers that registered no worker identity.
    unidentified: u64,
    /// Times a publisher's events were lost (an event id other than the next, a
    /// reconnection): its blocks forgotten.
    lost: u64,
}

/// `id`'s entry, made on first sight with an index of at most `cap` blocks (the id
/// is cloned only then; always `Some`).
fn followed<'a>(
    publishers: &'a mut HashMap<ChannelId, Followed>,
    id: &ChannelId,
    cap: usize,
) -> Option<&'a mut Followed> {
    if !publishers.contains_key(id) {
        let entry = Followed {
            index: Index::with_cap(cap),
            ..Followed::default()
        };
        publishers.insert(id.clone(), entry);
    }
    publishers.get_mut(id)
}

impl Router {
    fn blocks(&self) -> usize {
        self.publishers.values().map(|p| p.index.size()).sum()
    }

    /// Applies `events` of publisher `id`, in order. Event ids are dense per
    /// publisher: an id other than the next means events were lost on the way (its
    /// queue, the network, our own lanes), so what is held of it may be stale and is
    /// forgotten first (as Dynamo's router resets a worker on an id gap): no ghosts.
    fn apply(&mut self, id: &ChannelId, events: &[RouterEvent]) {
        let Some(p) = followed(&mut self.publishers, id, self.max_index_blocks) else {
            return;
        };
        for ev in events {
            if p.next_id != 0 && ev.event.id != p.next_id {
                self.lost += 1;
                if p.index.size() > 0 && self.lost <= 10 {
                    eprintln!(
                        "publisher {id} lost events (id {} after {}): forgot {} blocks",
                        ev.event.id,
                        p.next_id - 1,
                        p.index.size()
                    );
                }
                p.index.clear();
            }
            p.next_id = ev.event.id.saturating_add(1);
            let before = p.index.refused();
            p.index.apply(ev);
            self.index_refused += p.index.refused() - before;
        }
    }

    /// Applies what the subscriber noticed: a reconnected publisher's blocks are
    /// forgotten, a departed one's index dropped (after its last delivery).
    fn notice(&mut self, notice: Notice) {
        match notice {
            // Connected again after a lost connection: what it sent meanwhile is gone
            // (a clear perhaps with it), so what is held of it may be stale.
            Notice::Connected(instance) => {
                let Some(p) = followed(&mut self.publishers, &instance.id, self.max_index_blocks)
                else {
                    return;
                };
                if std::mem::replace(&mut p.connected, true) {
                    if p.index.size() > 0 {
                        self.lost += 1;
                        eprintln!(
                            "publisher {} reconnected: forgot {} blocks",
                            instance.id,
                            p.index.size()
                        );
                    }
                    p.index.clear();
                    p.next_id = 0;
                }
            }
            Notice::Departed(id) => self.forget(&id),
            _ => {}
        }
    }

    fn forget(&mut self, id: &ChannelId) {
        let forgot = self.publishers.remove(id).map_or(0, |p| p.index.size());
        eprintln!("publisher {id} left: forgot {forgot} blocks");
    }

    /// After notices were dropped (a full queue), a `Departed` may be among them:
    /// forgets the publishers the subscriber no longer follows.
    fn reconcile(&mut self, followed: &HashSet<ChannelId>) {
        let gone: Vec<ChannelId> = self
            .publishers
            .keys()
            .filter(|id| !followed.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            self.forget(&id);
        }
    }

    /// Every block held, one JSON object per (worker, dp rank, tier).
    fn entries(&self) -> Vec<serde_json::Value> {
        let mut all: Vec<_> = self
            .publishers
            .values()
            .flat_map(|p| p.index.entries())
            .collect();
        all.sort_unstable();
        all.dedup();
        let mut out: Vec<serde_json::Value> = Vec::new();
        for chunk in all.chunk_by(|a, b| (a.0, a.1, a.2) == (b.0, b.1, b.2)) {
            let Some(&(w, r, t, _)) = chunk.first() else {
                continue;
            };
            out.push(serde_json::json!({
                "worker_id": w,
                "dp_rank": r,
                "tier": t,
                "block_hashes": chunk.iter().map(|e| e.3).collect::<Vec<_>>(),
            }));
        }
        out
    }
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
    let wire = if args.dynamo { Wire::Dynamo } else { args.wire };
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
    let builder = DynamicSubscriber::builder(discovery, query)
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
    let mut exporter = Exporter::new().source(move || discovery_stats.stats());
    let (builder, bus_stats) = match bus {
        Some(bus) => {
            exporter = (bus.exported)(exporter);
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
    // Ready once the first complete view came from discovery: every publisher in it
    // is being dialled.
    let admin = match (&args.service.admin_listen, &recorder) {
        (Some(listen), Some(recorder)) => {
            // The subscriber samples its own counters (`metrics_interval`).
            let probed = handle.clone();
            let ready = move || {
                if probed.synced() {
                    Ok(())
                } else {
                    Err("discovery has not given a complete view yet".to_owned())
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
    let mut router = Router {
        max_index_blocks: usize::try_from(args.max_index_blocks).unwrap_or(usize::MAX),
        ..Router::default()
    };
    let mut batch = Vec::with_capacity(256);
    let mut notices = Vec::new();
    // Notices dropped so far: a dropped `Departed` is made up for by a reconcile.
    let mut notices_dropped = 0;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let timeout = optional_timeout(args.timeout_ms);
    tokio::pin!(timeout);
    tokio::pin!(stop);
    let code = 'run: loop {
        if args.count.is_some_and(|n| router.events >= n) {
            break 'run 0;
        }
        tokio::select! {
            () = &mut stop => break 'run 0,
            () = &mut timeout => break 'run 1,
            () = handle.notice_ready() => {}
            _ = tick.tick() => {
                let stats = handle.stats();
                if stats.notices_dropped > notices_dropped {
                    notices_dropped = stats.notices_dropped;
                    let followed = stats.publishers.into_iter().map(|(id, _)| id).collect();
                    router.reconcile(&followed);
                }
            }
            n = sub.recv_many(&mut batch, 256) => {
                if n == 0 {
                    eprintln!("the subscriber stopped");
                    break 'run 1;
                }
                // One lock and one write per batch (stdout alone flushes every line).
                let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
                for delivery in batch.drain(..) {
                    // Warned about by the subscriber (expect_worker_identity); the
                    // events are indexed under the worker ids in their payload.
                    router.unidentified += u64::from(delivery.source.worker.is_none());
                    // Every layout but Raw places a payload; none is an undecodable one.
                    let Some(payload) = delivery.payload() else {
                        router.payload_errors += 1;
                        continue;
                    };
                    let events = match decode_router_payload(wire, &payload) {
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
                    router.apply(&delivery.source.id, events);
                    router.events += events.len() as u64;
                    if args.format == Format::Json {
                        for ev in events {
                            if serde_json::to_writer(&mut out, ev).is_ok() {
                                let _ = out.write_all(b"\n");
                            }
                        }
                    }
                    if args.count.is_some_and(|n| router.events >= n) {
                        let _ = out.flush();
                        break 'run 0;
                    }
                }
                let _ = out.flush();
            }
        }
        // After the batch: a publisher's `Departed` follows its last delivery.
        sub.take_notices(&mut notices);
        for notice in notices.drain(..) {
            router.notice(notice);
        }
    };
    if let Some(admin) = admin {
        admin.stop().await;
    }
    let stats = handle.stats();
    let m = stats.total.malformed;
    let mut summary = serde_json::json!({
        "wire": wire.as_str(),
        "router_events": router.events,
        "index_blocks": router.blocks(),
        "index_refused": router.index_refused,
        "publishers": stats.publishers.len(),
        "unidentified_deliveries": router.unidentified,
        "lost_views": router.lost,
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
    if let (Some(stats), Some(fields)) = (&bus_stats, summary.as_object_mut()) {
        fields.insert("bus".to_owned(), stats());
    }
    if let (true, Some(fields)) = (args.dump_index, summary.as_object_mut()) {
        fields.insert("index".to_owned(), router.entries().into());
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
    /// The publishers sources announce with the router's wire (when a `[[source]]`
    /// credential exists).
    announced: Option<Arc<dyn Discovery>>,
    stats: BusStatsFn,
    /// Adds the bus's counters to a metrics exporter.
    exported: Box<dyn FnOnce(Exporter) -> Exporter>,
}

#[cfg(feature = "tunnel")]
async fn start_bus(args: &Args, wire: Wire) -> Result<Option<Bus>, StartError> {
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
    Ok(Some(Bus {
        tunnel: Box::new(move |builder| builder.tunnel(bus)),
        announced,
        stats,
        exported,
    }))
}

#[cfg(not(feature = "tunnel"))]
async fn start_bus(args: &Args, _: Wire) -> Result<Option<Bus>, StartError> {
    if args.bus_listen.is_some() {
        return Err(StartError::Args(
            "--bus-listen needs the `tunnel` feature: build eventplane-services with feature tunnel".to_owned(),
        ));
    }
    Ok(None)
}
