//! `kv-relay`: the worker-side KV job as a process — an engine's KV events in, router
//! events out on a bound PUB, optionally registered in etcd.
//!
//! ```text
//! kv-relay --connect EP --topic T --block-size B --worker-id W [--bind EP2]
//!          [--publish-topic kv-events] [--batch-timeout-ms MS]
//!          [--engine-replay EP] [--engine-dp-rank R]
//!          [--wire eventplane|dynamo]
//!          [(--etcd URL | --kube) --namespace NS --component C [--advertise-host H]
//!           [--endpoint E] [--dp-rank R]]
//!          [--bus-url https://ROUTER:PORT --bus-ca PEM --bus-token-file FILE
//!           --client-id ID --namespace NS --component C [--dp-rank R]]
//! ```
//! With `--bus-url` (feature `tunnel`) it is a *source* (DESIGN §7.4): for a worker
//! the router cannot reach and that has no broker beside it, it dials out to the
//! router's event bus (`kv-router --bus-listen`, whose `--bus-clients` has a
//! `[[source]]` entry for ID), announces its publisher (NS/C/publish-topic, worker W,
//! rank R, the wire) and serves the router's subscription from its own socket, as one
//! more subscriber: the same send queue and drop counters. Its publisher id is derived
//! from ID, W and R, so a restarted relay is the same publisher restarting its
//! sequence (a router counts the reset). It reconnects with the broker's backoff; on
//! SIGTERM it publishes what it holds, then drains its session (`draining`) and exits
//! 0. `--bind` is optional with it (default `tcp://127.0.0.1:0`, for local
//! subscribers; nothing listens for the router). Run one relay, with its own
//! `--client-id` and `[[source]]` credential, per engine rank: a second session under
//! one client id supersedes the first. Its `--wire` must be the router's. A bus that
//! cannot be reached, a TLS name that does not match, or a denied credential never
//! ends the relay: it keeps publishing locally and retries (1 s doubling to 60 s),
//! logging why (`bus session failed`, `the bus denied the session … code=…`); the
//! stats line's `source` says `connected`, `session_failures` and `denied`. An
//! unreadable `--bus-ca` or token file, or a URL that is not `https://`, exits 2.
//! Runs `EngineListener → Processor → EventPlaneSink → EventPublisher`, the publisher
//! bound at EP2 (`--bind tcp://127.0.0.1:0` lets the OS pick the port).
//!
//! - `--wire eventplane` (default): `[publish-topic, publisher_id u64be, seq u64be,
//!   payload]`, sequences from 0, the payload a msgpack list of router events
//!   (`Dialect::decode_router_events`).
//! - `--wire dynamo`: Dynamo's frames (`[topic, publisher_id, seq, 0x01 + u32be len +
//!   envelope]`) and Dynamo's router-event schema: a Dynamo router
//!   reads them unchanged.
//!
//! Without `--etcd` the publisher is registered nowhere. With it (feature `etcd`), it
//! registers under its lease, with its worker identity (`worker_id` W, dp rank R,
//! default 0) so routers know whose events these are before decoding them: our record
//! (its `worker` field) with `--wire eventplane`; with `--wire dynamo`, Dynamo's two
//! records (`v1/event_channels/…` and `v1/event_sources/…`, which carries W and R)
//! under endpoint E (default `generate`). They are deleted on SIGTERM / Ctrl-C (the
//! handlers are installed before registering). With `--kube --wire dynamo` (feature
//! `kube`) the same two records go into this pod's `DynamoWorkerMetadata` resource,
//! server-side-applied as a Dynamo worker does (the pod from `/etc/podinfo` or
//! `POD_NAME`/`POD_UID`/`POD_NAMESPACE`, container mode with
//! `DYN_KUBE_DISCOVERY_MODE=container` and `CONTAINER_NAME`; the client configured as
//! kubectl's, or in-cluster); on SIGTERM the resource is applied with every map empty.
//!
//! When it loses track of the engine (its sequence skips or restarts, its connection
//! ends, a batch cannot be decoded) it publishes a `Cleared` for every rank it had
//! forwarded (DESIGN §4.6). With `--engine-replay` (the engine's replay ROUTER) it
//! first repairs from the engine's buffer and clears only when that cannot cover the
//! loss (services/README.md, "kv-relay: repairing from the engine's replay buffer"). Its event ids count per relay: Dynamo's router tracks ids
//! per (worker, rank), so for Dynamo's wire run one relay per data-parallel rank, as
//! vLLM publishes one stream per rank. A
//! bind on `0.0.0.0` needs `--advertise-host`. A Dynamo router indexes a worker's
//! events only once that worker serves the endpoint (its model card, `v1/mdc/…`, names
//! W): relay for a worker that registers its model, with its id as W.
//!
//! Prints the bound endpoint as the first stdout line, then nothing per event; runs
//! until Ctrl-C or SIGTERM, then prints its stats as one JSON object, the last line on
//! stderr. Exit codes: 0 after a signal; 2 on bad arguments (including an advertise
//! host that cannot be dialled); 3 when EP2 cannot be bound or etcd cannot be reached.

use eventplane_services::common;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser};
use common::{EngineArgs, StartError, chain, stop_signal};
use eventplane::discovery::{Backend, Connected, Discovery, WorkerIdentity};
use eventplane::kv::pipeline::{RecoveryServer, SharedWorkerLog, Worker, WorkerLogConfig};
use eventplane::metrics::Exporter;
use eventplane::publish::{EventPublisher, PublishError};
use eventplane::wire::Dialect;
use eventplane_services::served::{RecoveryCodec, Served};
use eventplane_services::service::{self, ServiceArgs};

#[derive(Parser, Debug)]
#[command(
    name = "kv-relay",
    version = service::VERSION,
    about = "Relay an engine's KV events as router events on a ZMQ PUB (optionally announced on a router's event bus)",
    after_help = "Exit codes: 0 after SIGTERM or Ctrl-C; 2 on bad arguments (including an \
                  --advertise-host that cannot be dialled, an unreadable --bus-ca or \
                  --bus-token-file); 3 when the endpoint cannot be bound or etcd cannot be \
                  reached. An unreachable or refusing --bus-url never exits: it retries \
                  with backoff and logs why.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug).",
    after_long_help = format!(
        "{}\n\nOutput: the bound endpoint, the first stdout line; then nothing per event. \
         Published on it: with --wire eventplane, [publish-topic, publisher_id u64be, seq \
         u64be, payload], seq from 0, payload a msgpack array of router events with named \
         fields (eventplane::wire::Dialect::decode_router_events; kv-router --help shows them as \
         JSON); with --wire dynamo, Dynamo's frames and router-event schema. With --etcd, \
         registered under a lease: our record (key \
         /eventplane/v1/channels/NS/C/TOPIC/PUBLISHER_ID_HEX, value {{\"id\":{{...}}, \
         \"transport\":{{...}}, \"worker\":{{\"worker_id\":W,\"dp_rank\":R}}}}) or Dynamo's \
         two; deleted at exit. The last stderr line, at exit: the counters as one JSON \
         object {{\"wire\", \"registered_publisher_id\", \"listener\", \"processor\", \
         \"published_messages\", \"publisher\"}}.\n\nExit codes: 0 after SIGTERM or \
         Ctrl-C; 2 on bad arguments (including an --advertise-host that cannot be \
         dialled); 3 when the endpoint cannot be bound or etcd cannot be reached.\n\n\
         Logs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
         target=level pairs such as eventplane=debug).",
        common::ENGINE_INPUT_HELP
    )
)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Where to publish router events (tcp://host:port; port 0 for any). Optional
    /// with --bus-url (default tcp://127.0.0.1:0).
    #[arg(long, required_unless_present = "bus_url")]
    bind: Option<String>,
    /// Topic of the published router events.
    #[arg(long = "publish-topic", default_value = "kv-events")]
    publish_topic: String,
    /// Serve this worker's recovery endpoint here (tcp://host:port; port 0 for any):
    /// its last router events and a dump of its blocks, for routers that lost some
    /// (`kv::pipeline::RecoveryServer`). Printed as the second stdout line, `recovery EP`.
    /// Registered with --etcd or --kube; with --bus-url announced and served through
    /// the bus session instead (routers never dial it, so tcp://127.0.0.1:0 will do;
    /// local processes can still connect to it). With --wire dynamo and --etcd or
    /// --kube, it serves Dynamo 1.6.1's KV queries instead (the worker recovery
    /// Dynamo's router asks for, `kv::dynamo_recovery::DynamoQueryServer`), registered
    /// as the record's `recovery_target`.
    #[arg(long = "recovery-bind")]
    recovery_bind: Option<String>,
    /// The codec Dynamo's router is asked to use with the recovery endpoint (with
    /// --wire dynamo): msgpack or json.
    #[arg(
        long = "recovery-codec",
        default_value = "msgpack",
        requires = "recovery_bind"
    )]
    recovery_codec: RecoveryCodec,
    /// Router events the recovery log keeps for routers that lost some (with
    /// --recovery-bind; default 1024, kv::pipeline::DEFAULT_RECOVERY_EVENTS): a loss within them
    /// is repaired with the events, an older one with a dump.
    #[arg(long = "recovery-events", requires = "recovery_bind")]
    recovery_events: Option<usize>,
    /// Blocks those kept events may carry in all (default 262144,
    /// kv::pipeline::DEFAULT_RECOVERY_EVENT_BLOCKS).
    #[arg(long = "recovery-event-blocks", requires = "recovery_bind")]
    recovery_event_blocks: Option<usize>,
    /// Messages queued per subscriber before the publisher drops (and counts) them.
    #[arg(long = "publisher-queue", default_value_t = 10_000)]
    publisher_queue: usize,
    /// What to publish: our wire, or Dynamo's.
    #[arg(long, default_value = "eventplane")]
    wire: Dialect,
    /// Register in this etcd (http://host:2379; repeat for a cluster). Needs feature
    /// `etcd`.
    #[arg(long, requires_all = ["namespace", "component"], group = "registry")]
    etcd: Vec<String>,
    /// Dial out to this event bus (https://host:port) and announce the publisher
    /// there, as a source (instead of --etcd or --kube). Needs feature `tunnel`,
    /// --bus-ca, --bus-token-file, --client-id, --namespace and --component.
    #[arg(
        long = "bus-url",
        requires_all = ["bus_ca", "bus_token_file", "client_id", "namespace", "component"],
        group = "registry"
    )]
    bus_url: Option<String>,
    /// The CA bundle (PEM) the bus certificate must chain to.
    #[arg(long = "bus-ca", requires = "bus_url")]
    bus_ca: Option<std::path::PathBuf>,
    /// A file holding this source's bearer token.
    #[arg(long = "bus-token-file", requires = "bus_url")]
    bus_token_file: Option<std::path::PathBuf>,
    /// This source's client id (its `[[source]]` credential on the bus is bound to it;
    /// one per relay: a second session under the same id supersedes the first).
    #[arg(long = "client-id", requires = "bus_url")]
    client_id: Option<String>,
    /// Register in this pod's DynamoWorkerMetadata resource on Kubernetes (with
    /// --wire dynamo). Needs feature `kube`.
    #[arg(long, requires_all = ["namespace", "component"], group = "registry")]
    kube: bool,
    /// Namespace to register under (with --etcd or --kube), or to announce in (with
    /// --bus-url).
    #[arg(long, requires = "registry")]
    namespace: Option<String>,
    /// Component to register under, or to announce (with --etcd, --kube or --bus-url).
    #[arg(long, requires = "registry")]
    component: Option<String>,
    /// Dynamo endpoint to register under (with --etcd --wire dynamo or --kube, refused
    /// otherwise; default `generate`).
    #[arg(long, requires = "registry")]
    endpoint: Option<String>,
    /// The worker's data-parallel rank, registered or announced with its worker id
    /// (with --etcd, --kube or --bus-url; default 0): our record's `worker`, Dynamo's
    /// `event_sources` record, or the announcement's.
    #[arg(long = "dp-rank", requires = "registry")]
    dp_rank: Option<u32>,
    /// Host subscribers dial, when --bind is on a wildcard address (with --etcd).
    #[arg(
        long = "advertise-host",
        requires = "registry",
        conflicts_with = "bus_url"
    )]
    advertise_host: Option<String>,
    #[command(flatten)]
    service: ServiceArgs,
}

// One thread: the relay is one sequential pipeline (listener → processor → publisher),
// and on a multi-thread runtime every hand-off between its tasks woke another thread,
// which cost CPU for no throughput (bench `kv_worker`).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    service::print_man_page_if_asked(Args::command());
    // Before anything is registered: a SIGTERM from now on is handled (records deleted).
    let stop = stop_signal();
    let args = Args::parse();
    let recorder = match service::start(&args.service, "warn") {
        Ok(r) => r,
        Err(code) => return code,
    };
    if args.kube && args.wire != Dialect::Dynamo {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--kube writes Dynamo's resources: it needs --wire dynamo",
            )
            .exit();
    }
    if args.endpoint.is_some() && args.wire != Dialect::Dynamo {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--endpoint names a Dynamo endpoint in Dynamo's records: it needs --wire dynamo",
            )
            .exit();
    }
    if let Err(e) = args.engine.processor_config() {
        eprintln!("{e}");
        return ExitCode::from(2);
    }
    // The worker's recovery log, kept before publishing, served to routers.
    let recovery = match &args.recovery_bind {
        Some(bind) => {
            let mut config = WorkerLogConfig::default();
            if let Some(n) = args.recovery_events {
                config = config.events(n);
            }
            if let Some(n) = args.recovery_event_blocks {
                config = config.event_blocks(n);
            }
            if let Err(e) = config.validate() {
                eprintln!("invalid --recovery-{}: {e}", e.field().replace('_', "-"));
                return ExitCode::from(2);
            }
            let log = SharedWorkerLog::new(config);
            let dynamo = args.wire == Dialect::Dynamo && args.bus_url.is_none();
            match Served::bind(bind, log.clone(), dynamo.then_some(args.recovery_codec)).await {
                Ok(server) => Some((Arc::new(server), log)),
                Err(e) => {
                    eprintln!("cannot bind --recovery-bind {bind}: {e}");
                    return ExitCode::from(3);
                }
            }
        }
        None => None,
    };
    let mut registry_stats: Option<Arc<dyn Discovery>> = None;
    let (builder, discovery) = if args.etcd.is_empty() && !args.kube {
        let mut builder = EventPublisher::unregistered(args.publish_topic.clone());
        if let Some(client_id) = &args.client_id {
            builder = builder.publisher_id(source_publisher_id(
                client_id,
                args.engine.worker_id,
                args.dp_rank.unwrap_or(0),
            ));
        }
        (builder, None)
    } else {
        let connected = match registry(&args).await {
            Ok(c) => c,
            Err(e) => return e.report(),
        };
        let discovery = connected.discovery().clone();
        registry_stats = Some(discovery.clone());
        let mut builder = EventPublisher::builder(
            discovery,
            args.namespace.clone().unwrap_or_default(),
            args.component.clone().unwrap_or_default(),
            args.publish_topic.clone(),
        );
        if let Some(host) = &args.advertise_host {
            builder = builder.advertise_host(host.clone());
        }
        // Routers see whose events these are in discovery, before any payload.
        builder = builder.worker(args.engine.worker_id, args.dp_rank.unwrap_or(0));
        // And where to ask for what they lose of them.
        if let Some((server, _)) = &recovery {
            let wildcard = ["://0.0.0.0:", "://[::]:"]
                .iter()
                .any(|w| server.local_endpoint().contains(w));
            if wildcard && args.advertise_host.is_none() {
                eprintln!(
                    "invalid --recovery-bind: a wildcard host cannot be registered; give --advertise-host"
                );
                return ExitCode::from(2);
            }
            builder = builder.recovery(advertised(
                &server.local_endpoint(),
                args.advertise_host.as_deref(),
            ));
        }
        (builder, Some(connected))
    };
    let bind = args
        .bind
        .clone()
        .unwrap_or_else(|| "tcp://127.0.0.1:0".to_owned());
    let zmtp = match eventplane::zmtp::Config::builder()
        .send_queue_messages(args.publisher_queue)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("invalid --publisher-queue: {e}");
            return ExitCode::from(2);
        }
    };
    let publisher = match builder
        .bind(bind.clone())
        .dialect(args.wire)
        .zmtp_config(zmtp)
        .build()
        .await
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot bind or register {bind}: {}", chain(&e));
            if let Some(connected) = discovery {
                connected.close().await;
            }
            let bad_argument = matches!(
                e,
                PublishError::AdvertiseHost { .. }
                    | PublishError::Bind(eventplane::zmtp::Error::InvalidEndpoint { .. })
            );
            return ExitCode::from(if bad_argument { 2 } else { 3 });
        }
    };
    let endpoint = publisher.local_endpoint().unwrap_or_default().to_owned();
    let registered = publisher.instance().map(|i| i.id.publisher_id());
    let publisher_id = publisher.publisher_id();
    // As a source: announced on the bus, served from this publisher's socket.
    let ours = recovery.as_ref().and_then(|(s, _)| s.ours());
    let source = match source(&args, &publisher, ours) {
        Ok(s) => s,
        Err(e) => return e.report(),
    };
    let log = recovery.as_ref().map(|(_, log)| log.clone());
    // EngineListener → Processor → EventPlaneSink → this publisher.
    let worker = match args.engine.start(|engine| {
        let builder = Worker::builder(engine, publisher);
        match log {
            Some(log) => builder.local_index(Box::new(log)),
            None => builder,
        }
    }) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // Ready once the engine is connected (the publisher is bound and registered by
    // now: `build` returned).
    let admin = match (&args.service.admin_listen, &recorder) {
        (Some(listen), Some(recorder)) => {
            let mut exporter = Exporter::new().source({
                let worker = worker.handle();
                move || worker.stats()
            });
            if let Some(d) = registry_stats {
                exporter = exporter.source(move || d.stats());
            }
            exporter = with_source_stats(exporter, &source);
            if let Some((server, _)) = &recovery {
                exporter = Served::export(server, exporter);
            }
            let probed = worker.handle();
            let announced = source_probe(&source);
            let ready = move || {
                if !probed.stats().listener.connected {
                    return Err("no connection to the engine".to_owned());
                }
                announced()
            };
            match service::Admin::start(listen, recorder, exporter, ready).await {
                Ok(admin) => Some(admin),
                Err(e) => {
                    eprintln!("--admin-listen {listen}: {e}");
                    worker.shutdown().await;
                    if let Some(connected) = discovery {
                        connected.close().await;
                    }
                    return ExitCode::from(2);
                }
            }
        }
        _ => None,
    };
    println!("{endpoint}");
    if let Some((server, _)) = &recovery {
        println!("recovery {}", server.local_endpoint());
    }

    stop.await;
    if let Some(admin) = admin {
        admin.stop().await;
    }
    // Publishes what was queued, then drains the publisher and deletes its records.
    let worker_stats = worker.shutdown().await;
    if let Some(connected) = discovery {
        connected.close().await;
    }
    // Its streams ended with the publisher: the drain says `draining` and is quick.
    let source_stats = stop_source(source).await;
    let stats = serde_json::json!({
        "wire": args.wire.as_str(),
        "registered_publisher_id": registered,
        "listener": worker_stats.listener,
        "processor": worker_stats.processor,
        "published_messages": worker_stats.published_messages,
        "publisher": worker_stats.publisher,
        "publisher_id": publisher_id,
        "source": source_stats,
        "recovery": recovery.as_ref().map(|(server, log)| serde_json::json!({
            "server": server.stats(),
            "log": log.stats(),
        })),
    });
    eprintln!("{stats}");
    ExitCode::SUCCESS
}

/// `endpoint` (`SCHEME://host:port`) as routers reach it: a wildcard host replaced
/// by `advertise`.
fn advertised(endpoint: &str, advertise: Option<&str>) -> String {
    let Some((scheme, rest)) = endpoint.split_once("://") else {
        return endpoint.to_owned();
    };
    match (rest.rsplit_once(':'), advertise) {
        (Some(("0.0.0.0" | "[::]" | "::", port)), Some(a)) => {
            if a.contains(':') {
                format!("{scheme}://[{a}]:{port}")
            } else {
                format!("{scheme}://{a}:{port}")
            }
        }
        _ => endpoint.to_owned(),
    }
}

/// The publisher id of source `client_id`'s worker `worker_id` at `dp_rank`: the same
/// across restarts and builds (64-bit FNV-1a of the three), so a router counts a
/// restart as a reset.
fn source_publisher_id(client_id: &str, worker_id: u64, dp_rank: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = client_id
        .bytes()
        .chain([0xff])
        .chain(worker_id.to_be_bytes())
        .chain(dp_rank.to_be_bytes());
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash & eventplane::discovery::MAX_PUBLISHER_ID
}

#[cfg(feature = "tunnel")]
type SourceHandle = eventplane::tunnel::Source;

/// With --bus-url: the source, started, announcing `publisher`.
#[cfg(feature = "tunnel")]
fn source(
    args: &Args,
    publisher: &EventPublisher,
    recovery: Option<&RecoveryServer>,
) -> Result<Option<SourceHandle>, StartError> {
    use eventplane::discovery::{ChannelId, WorkerIdentity};
    use eventplane::tunnel::{AnnouncedSource, Secret, Source, SourceConfig, client_tls};
    let (Some(url), Some(ca), Some(token), Some(client_id), Some(namespace), Some(component)) = (
        &args.bus_url,
        &args.bus_ca,
        &args.bus_token_file,
        &args.client_id,
        &args.namespace,
        &args.component,
    ) else {
        return Ok(None);
    };
    let refused =
        |e: eventplane::tunnel::TunnelError| StartError::Args(format!("--bus-url: {}", chain(&e)));
    let config = SourceConfig::new(
        url.clone(),
        client_id.clone(),
        vec![namespace.clone()],
        Secret::from_file(token).map_err(refused)?,
        client_tls(ca).map_err(refused)?,
    );
    let id = ChannelId::new(
        namespace,
        component,
        &args.publish_topic,
        publisher.publisher_id(),
    )
    .map_err(|e| StartError::Args(format!("--namespace/--component: {}", chain(&e))))?;
    let announced = AnnouncedSource::new(&id, args.wire).with_worker(WorkerIdentity::new(
        args.engine.worker_id,
        args.dp_rank.unwrap_or(0),
    ));
    let source = Source::spawn(config).map_err(refused)?;
    // With --recovery-bind, its recovery log is served through the session too.
    match recovery {
        Some(server) => {
            source.announce_with_recovery(announced, publisher.acceptor(), server.acceptor())
        }
        None => source.announce(announced, publisher.acceptor()),
    }
    .map_err(refused)?;
    Ok(Some(source))
}

/// With --bus-url, whether the source is reachable: a session with the router's bus,
/// and the publisher announced on it.
#[cfg(feature = "tunnel")]
fn source_probe(
    source: &Option<SourceHandle>,
) -> impl Fn() -> Result<(), String> + Send + Sync + use<> {
    let handle = source.as_ref().map(|s| s.handle());
    move || match handle.as_ref().map(|h| h.stats()) {
        None => Ok(()),
        Some(s) if !s.connected => Err("no session with the router's bus".to_owned()),
        Some(s) if s.announced == 0 => Err("nothing announced on the bus".to_owned()),
        Some(s) if s.refused_publishers > 0 => Err(format!(
            "the bus refuses {} announced publisher(s) (eventplane_source_announce_refused_total says why)",
            s.refused_publishers
        )),
        Some(_) => Ok(()),
    }
}

#[cfg(not(feature = "tunnel"))]
fn source_probe(_: &Option<SourceHandle>) -> impl Fn() -> Result<(), String> + Send + Sync + use<> {
    || Ok(())
}

/// Adds the source's counters, if any, to `exporter`.
#[cfg(feature = "tunnel")]
fn with_source_stats(exporter: Exporter, source: &Option<SourceHandle>) -> Exporter {
    match source {
        Some(s) => {
            let handle = s.handle();
            exporter.source(move || handle.stats())
        }
        None => exporter,
    }
}

#[cfg(not(feature = "tunnel"))]
fn with_source_stats(exporter: Exporter, _: &Option<SourceHandle>) -> Exporter {
    exporter
}

/// Drains the source, if any; its counters.
#[cfg(feature = "tunnel")]
async fn stop_source(source: Option<SourceHandle>) -> Option<serde_json::Value> {
    serde_json::to_value(source?.shutdown().await).ok()
}

#[cfg(not(feature = "tunnel"))]
async fn stop_source(_: Option<SourceHandle>) -> Option<serde_json::Value> {
    None
}

#[cfg(not(feature = "tunnel"))]
type SourceHandle = std::convert::Infallible;

#[cfg(not(feature = "tunnel"))]
fn source(
    args: &Args,
    _: &EventPublisher,
    _: Option<&RecoveryServer>,
) -> Result<Option<SourceHandle>, StartError> {
    if args.bus_url.is_some() {
        return Err(StartError::Args(
            "--bus-url needs the `tunnel` feature: build eventplane-services with feature tunnel"
                .to_owned(),
        ));
    }
    Ok(None)
}

/// Where this relay registers: etcd (`--etcd`, our records or, with `--wire dynamo`,
/// Dynamo's) or Kubernetes (`--kube`, as the pod the environment names); Dynamo's
/// records under `--endpoint` (default `generate`) for this engine's worker.
async fn registry(args: &Args) -> Result<Connected, StartError> {
    let (backend, flag) = if args.kube {
        (Backend::kube().kube_pod_from_env(true), "--kube")
    } else {
        (Backend::etcd(&args.etcd).dialect(args.wire), "--etcd")
    };
    // Our records carry the worker per registration; Dynamo's per backend.
    let backend = if args.kube || args.wire == Dialect::Dynamo {
        backend
            .dynamo_endpoint(
                args.endpoint
                    .clone()
                    .unwrap_or_else(|| "generate".to_owned()),
            )
            .worker(WorkerIdentity::new(
                args.engine.worker_id,
                args.dp_rank.unwrap_or(0),
            ))
    } else if let Some(endpoint) = &args.endpoint {
        backend.dynamo_endpoint(endpoint.clone()) // refused: our records have none
    } else {
        backend
    };
    backend
        .connect()
        .await
        .map_err(|e| StartError::discovery(flag, &e))
}
