//! `watch`: a `DynamicSubscriber` over etcd or a static list of publishers, printing
//! every delivery.
//!
//! ```text
//! watch (--etcd URL | --static EP…) --namespace NS [--component C] --topic T
//!       [--layout raw|topic-seq|topic-publisher-seq|dynamo] [--count N] [--timeout-ms MS]
//! ```
//! One stdout line per delivery: `{publisher_id} {sequence or -} {frames}`, the frames
//! as `subscribe` prints them (lower-case hex, an empty frame as `-`, separated by one
//! space). On exit the subscriber's stats are printed as one JSON object, the last line
//! on stderr.
//!
//! With `--static`, the endpoints become publishers 0, 1, 2, … of
//! `NS/{C or "static"}/T`. `--etcd` needs the `etcd` feature
//! (`cargo run --features etcd --example watch -- --etcd http://127.0.0.1:2379 …`);
//! it lists under the default key prefix `/eventplane`.
//!
//! Exit codes: 0 after N deliveries (or on Ctrl-C / SIGTERM without `--count`); 1 on
//! timeout; 2 on bad arguments (`--etcd` without the feature included); 3 when
//! discovery cannot be reached.

use eventplane_cli as common;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use common::{StartError, hex_line, optional_timeout, static_discovery, stop_signal};
use eventplane::discovery::{Discovery, Query};
use eventplane::subscriber::{DynamicSubscriber, Layout};

#[derive(Parser, Debug)]
#[command(
    about = "Follow publishers through discovery and print what they send",
    after_help = "Exit codes: 0 after --count deliveries (or on Ctrl-C / SIGTERM without \
                  --count); 1 on timeout; 2 on bad arguments; 3 when discovery cannot be \
                  reached.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug).",
    after_long_help = "Output: one stdout line per delivery, `PUBLISHER_ID SEQUENCE FRAMES`: \
                       the publisher id from discovery (decimal), the sequence the layout \
                       carries (`-` for raw), then every frame in lower-case hex (an empty \
                       frame as `-`), separated by one space. At exit, the subscriber's stats \
                       as one JSON object, the last stderr line.\n\nWith --static, the \
                       endpoints become publishers 0, 1, 2, … of NS/{C or \"static\"}/TOPIC.\
                       \n\nExit codes: 0 after --count deliveries (or on Ctrl-C / SIGTERM \
                       without --count); 1 on timeout; 2 on bad arguments; 3 when discovery \
                       cannot be reached.\n\nLogs: warnings go to stderr; RUST_LOG sets the \
                       level (off, debug, or target=level pairs such as eventplane=debug)."
)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["etcd", "static_endpoints"])))]
struct Args {
    /// etcd endpoint (http://host:2379); repeat for a cluster. Needs feature `etcd`.
    #[arg(long)]
    etcd: Vec<String>,
    /// Publisher endpoints (tcp://host:port), instead of discovery.
    #[arg(long = "static", num_args = 1..)]
    static_endpoints: Vec<String>,
    /// Discovery namespace.
    #[arg(long)]
    namespace: String,
    /// Discovery component (default: any).
    #[arg(long)]
    component: Option<String>,
    /// Topic: the discovery topic and the exact first frame of every message.
    #[arg(long)]
    topic: String,
    /// Dialect layout of the messages: raw, topic-seq, topic-publisher-seq or dynamo.
    #[arg(long, default_value = "topic-publisher-seq")]
    layout: Layout,
    /// Exit 0 after this many deliveries.
    #[arg(long)]
    count: Option<u64>,
    /// Exit 1 if the run lasts longer than this.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
    /// Bytes the subscriber may buffer across all publishers before it drops
    /// (default: the library's, 64 MiB).
    #[arg(long = "max-buffered-bytes")]
    max_buffered_bytes: Option<usize>,
    /// Publishers followed at most (default: the library's, 4,096); past it a
    /// publisher is refused and counted. Each costs one open file: the soft limit is
    /// raised to the hard limit at start.
    #[arg(long = "max-publishers", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_publishers: Option<u64>,
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
    eventplane::discovery::Backend::etcd(&args.etcd)
        .connect()
        .await
        .map(|c| c.discovery().clone())
        .map_err(|e| StartError::etcd(&e))
}

#[tokio::main]
async fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    common::raise_fd_limit();
    let discovery = match discovery(&args).await {
        Ok(d) => d,
        Err(e) => return e.report(),
    };
    let mut query = Query::new(&args.namespace).topic(&args.topic);
    if let Some(c) = &args.component {
        query = query.component(c);
    }
    let mut builder = DynamicSubscriber::builder(discovery, query)
        .topic(args.topic.clone())
        .layout(args.layout);
    if let Some(bytes) = args.max_buffered_bytes {
        builder = builder.max_buffered_bytes(bytes);
    }
    if let Some(n) = args.max_publishers {
        builder = builder.max_publishers(usize::try_from(n).unwrap_or(usize::MAX));
    }
    let mut sub = match builder.spawn() {
        Ok(sub) => sub,
        Err(e) => {
            // Named as the flag that set it (clap refuses the other fields' zeros).
            let flag = e.field().replace('_', "-");
            eprintln!("invalid --{flag}: {e}");
            return ExitCode::from(2);
        }
    };
    let handle = sub.handle();

    let timeout = optional_timeout(args.timeout_ms);
    tokio::pin!(timeout);
    let stop = stop_signal();
    tokio::pin!(stop);
    let mut delivered = 0u64;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut batch = Vec::with_capacity(256);
    let code = loop {
        if args.count.is_some_and(|n| delivered >= n) {
            break 0;
        }
        tokio::select! {
            n = sub.recv_many(&mut batch, 256) => {
                if n == 0 {
                    eprintln!("the subscriber stopped");
                    break 1;
                }
                for d in batch.drain(..) {
                    if args.count.is_some_and(|n| delivered >= n) {
                        break;
                    }
                    delivered += 1;
                    let sequence = d.sequence.map_or_else(|| "-".to_owned(), |s| s.to_string());
                    let _ = writeln!(
                        out,
                        "{} {sequence} {}",
                        d.source.id.publisher_id(),
                        hex_line(&d.message)
                    );
                }
                let _ = out.flush();
            }
            () = &mut timeout => {
                eprintln!("timed out after {delivered} deliveries");
                break 1;
            }
            () = &mut stop => break if args.count.is_some() { 1 } else { 0 },
        }
    };
    let _ = out.flush();
    let stats = handle.stats();
    handle.shutdown().await;
    if stats.total.dropped_malformed > 0 {
        // Before the JSON line, which stays the last one.
        eprintln!(
            "hint: {} message(s) did not fit --layout {} and were dropped; a publisher \
             sending another layout? (EventPublisher: topic-publisher-seq, engines: \
             topic-seq, Dynamo workers: dynamo; --layout raw shows any message's frames)",
            stats.total.dropped_malformed, args.layout
        );
    }
    match serde_json::to_string(&stats) {
        Ok(json) => eprintln!("{json}"),
        Err(e) => eprintln!("{{\"error\":{:?}}}", e.to_string()),
    }
    ExitCode::from(code)
}
