//! `kv_relay`: the worker-side KV job as a process — an engine's KV events in, router
//! events out on a bound PUB, optionally registered in etcd.
//!
//! ```text
//! kv_relay --connect EP --topic T --block-size B --worker-id W --bind EP2
//!          [--publish-topic kv-events] [--batch-timeout-ms MS]
//!          [--wire eventplane|dynamo]
//!          [(--etcd URL | --kube) --namespace NS --component C [--advertise-host H]
//!           [--endpoint E] [--dp-rank R]]
//! ```
//! Runs `EngineListener → Processor → EventPlaneSink → EventPublisher`, the publisher
//! bound at EP2 (`--bind tcp://127.0.0.1:0` lets the OS pick the port).
//!
//! - `--wire eventplane` (default): `[publish-topic, publisher_id u64be, seq u64be,
//!   payload]`, sequences from 0, the payload a msgpack list of router events
//!   (`kv::decode_router_events`).
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
//! forwarded (DESIGN §4.6). Its event ids count per relay: Dynamo's router tracks ids
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

mod common;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{CommandFactory, Parser};
use common::{EngineArgs, StartError, chain, stop_signal};
use eventplane::discovery::{BoxFuture, Discovery};
use eventplane::kv::Worker;
use eventplane::publish::{EventPublisher, PublishError};
use eventplane::wire::Wire;

#[derive(Parser, Debug)]
#[command(
    about = "Relay an engine's KV events as router events on a ZMQ PUB",
    after_help = "Exit codes: 0 after SIGTERM or Ctrl-C; 2 on bad arguments (including an \
                  --advertise-host that cannot be dialled); 3 when the endpoint cannot be \
                  bound or etcd cannot be reached.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug).",
    after_long_help = format!(
        "{}\n\nOutput: the bound endpoint, the first stdout line; then nothing per event. \
         Published on it: with --wire eventplane, [publish-topic, publisher_id u64be, seq \
         u64be, payload], seq from 0, payload a msgpack array of router events with named \
         fields (eventplane::kv::decode_router_events; kv_router --help shows them as \
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
    /// Where to publish router events (tcp://host:port; port 0 for any).
    #[arg(long)]
    bind: String,
    /// Topic of the published router events.
    #[arg(long = "publish-topic", default_value = "kv-events")]
    publish_topic: String,
    /// What to publish: our wire, or Dynamo's.
    #[arg(long, default_value = "eventplane")]
    wire: Wire,
    /// Register in this etcd (http://host:2379; repeat for a cluster). Needs feature
    /// `etcd`.
    #[arg(long, requires_all = ["namespace", "component"], group = "registry")]
    etcd: Vec<String>,
    /// Register in this pod's DynamoWorkerMetadata resource on Kubernetes (with
    /// --wire dynamo). Needs feature `kube`.
    #[arg(long, requires_all = ["namespace", "component"], group = "registry")]
    kube: bool,
    /// Namespace to register under (with --etcd).
    #[arg(long, requires = "registry")]
    namespace: Option<String>,
    /// Component to register under (with --etcd).
    #[arg(long, requires = "registry")]
    component: Option<String>,
    /// Dynamo endpoint to register under (with --etcd --wire dynamo; default
    /// `generate`).
    #[arg(long, requires = "registry")]
    endpoint: Option<String>,
    /// The worker's data-parallel rank, registered with its worker id (with --etcd;
    /// default 0): our record's `worker`, or Dynamo's `event_sources` record.
    #[arg(long = "dp-rank", requires = "registry")]
    dp_rank: Option<u32>,
    /// Host subscribers dial, when --bind is on a wildcard address (with --etcd).
    #[arg(long = "advertise-host", requires = "registry")]
    advertise_host: Option<String>,
}

// One thread: the relay is one sequential pipeline (listener → processor → publisher),
// and on a multi-thread runtime every hand-off between its tasks woke another thread,
// which cost CPU for no throughput (bench `kv_worker`).
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    common::init_tracing();
    // Before anything is registered: a SIGTERM from now on is handled (records deleted).
    let stop = stop_signal();
    let args = Args::parse();
    if args.kube && args.wire != Wire::Dynamo {
        Args::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--kube writes Dynamo's resources: it needs --wire dynamo",
            )
            .exit();
    }
    if args.endpoint.is_some() && args.wire != Wire::Dynamo {
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
    let (builder, discovery) = if args.etcd.is_empty() && !args.kube {
        (
            EventPublisher::unregistered(args.publish_topic.clone()),
            None,
        )
    } else {
        let registry = if args.kube {
            kube(&args).await
        } else {
            etcd(&args).await
        };
        let (discovery, closer) = match registry {
            Ok(d) => d,
            Err(e) => return e.report(),
        };
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
        (builder, Some(closer))
    };
    let publisher = match builder
        .bind(args.bind.clone())
        .wire(args.wire)
        .build()
        .await
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot bind or register {}: {}", args.bind, chain(&e));
            if let Some(close) = discovery {
                close().await;
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
    // EngineListener → Processor → EventPlaneSink → this publisher.
    let worker = match args
        .engine
        .start(|engine| Worker::builder(engine, publisher))
    {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    println!("{endpoint}");

    stop.await;
    // Publishes what was queued, then drains the publisher and deletes its records.
    let worker_stats = worker.shutdown().await;
    if let Some(close) = discovery {
        close().await;
    }
    let stats = serde_json::json!({
        "wire": args.wire.as_str(),
        "registered_publisher_id": registered,
        "listener": worker_stats.listener,
        "processor": worker_stats.processor,
        "published_messages": worker_stats.published_messages,
        "publisher": worker_stats.publisher,
    });
    eprintln!("{stats}");
    ExitCode::SUCCESS
}

/// Closes the discovery backend at exit (revoking its lease).
type Closer = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

#[cfg(feature = "etcd")]
async fn etcd(args: &Args) -> Result<(Arc<dyn Discovery>, Closer), StartError> {
    use eventplane::discovery::{DynamoRecords, EtcdDiscovery, RecordFormat};
    let format = match args.wire {
        Wire::Dynamo => RecordFormat::Dynamo(
            DynamoRecords::new()
                .endpoint(
                    args.endpoint
                        .clone()
                        .unwrap_or_else(|| "generate".to_owned()),
                )
                .worker(args.engine.worker_id, args.dp_rank.unwrap_or(0)),
        ),
        _ => RecordFormat::EventPlane,
    };
    let discovery = EtcdDiscovery::builder(&args.etcd)
        .record_format(format)
        .connect()
        .await
        .map_err(|e| StartError::etcd(&e))?;
    let closing = discovery.clone();
    let closer: Closer = Box::new(move || Box::pin(async move { closing.close().await }));
    Ok((Arc::new(discovery), closer))
}

#[cfg(feature = "kube")]
async fn kube(args: &Args) -> Result<(Arc<dyn Discovery>, Closer), StartError> {
    use eventplane::discovery::{DynamoRecords, KubeDiscovery, PodIdentity};
    let pod = PodIdentity::from_env().map_err(|e| StartError::discovery("--kube", &e))?;
    let records = DynamoRecords::new()
        .endpoint(
            args.endpoint
                .clone()
                .unwrap_or_else(|| "generate".to_owned()),
        )
        .worker(args.engine.worker_id, args.dp_rank.unwrap_or(0));
    let discovery = KubeDiscovery::builder()
        .records(records)
        .pod(pod)
        .connect()
        .await
        .map_err(|e| StartError::discovery("--kube", &e))?;
    let closing = discovery.clone();
    let closer: Closer = Box::new(move || Box::pin(async move { closing.close().await }));
    Ok((Arc::new(discovery), closer))
}

#[cfg(not(feature = "kube"))]
async fn kube(_: &Args) -> Result<(Arc<dyn Discovery>, Closer), StartError> {
    Err(StartError::Args(
        "--kube needs the `kube` feature: cargo run --features kube --example kv_relay".to_owned(),
    ))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(_: &Args) -> Result<(Arc<dyn Discovery>, Closer), StartError> {
    Err(StartError::Args(
        "--etcd needs the `etcd` feature: cargo run --features etcd --example kv_relay".to_owned(),
    ))
}
