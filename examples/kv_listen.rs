//! `kv_listen`: an engine's KV events in, router events out as JSON lines.
//!
//! ```text
//! kv_listen --connect EP --topic T --block-size B --worker-id W [--count N]
//!           [--timeout-ms MS] [--batch-timeout-ms MS]
//! ```
//! Runs `EngineListener → Processor` and prints each published `RouterEvent` as one
//! line of JSON (snake_case, externally tagged). Exits 0 after N router events (or on
//! Ctrl-C without `--count`), 1 on timeout.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use eventplane::discovery::BoxFuture;
use eventplane::kv::{
    EngineListener, EngineListenerConfig, EventSink, Processor, ProcessorConfig, RouterEvent,
    SinkError, WorkerId,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "Print an engine's KV events as router events (JSON lines)")]
struct Args {
    /// The engine's ZMQ PUB endpoint.
    #[arg(long)]
    connect: String,
    /// The engine's topic.
    #[arg(long)]
    topic: String,
    /// Tokens per KV block in the engine.
    #[arg(long = "block-size")]
    block_size: usize,
    /// This worker's id.
    #[arg(long = "worker-id")]
    worker_id: u64,
    /// Exit 0 after this many router events.
    #[arg(long)]
    count: Option<u64>,
    /// Exit 1 if the run lasts longer than this.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
    /// Batch across engine lists for up to this long (max 15 000).
    #[arg(long = "batch-timeout-ms")]
    batch_timeout_ms: Option<u64>,
}

/// Prints each event as a JSON line and counts.
struct Print {
    printed: AtomicU64,
    target: Option<u64>,
    reached: Arc<Notify>,
}

impl EventSink for Print {
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
        let mut out = std::io::stdout().lock();
        for ev in events {
            if self
                .target
                .is_some_and(|t| self.printed.load(Ordering::Relaxed) >= t)
            {
                break;
            }
            let line = serde_json::to_string(ev).map_err(|e| SinkError(Box::new(e)));
            match line {
                Ok(line) => {
                    let _ = writeln!(out, "{line}");
                }
                Err(e) => return Box::pin(async move { Err(e) }),
            }
            let n = self.printed.fetch_add(1, Ordering::Relaxed) + 1;
            if self.target == Some(n) {
                self.reached.notify_one();
            }
        }
        let _ = out.flush();
        Box::pin(async { Ok(()) })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let config = ProcessorConfig::default()
        .batch_timeout(args.batch_timeout_ms.map(Duration::from_millis))?;
    let reached = Arc::new(Notify::new());
    let sink = Arc::new(Print {
        printed: AtomicU64::new(0),
        target: args.count,
        reached: reached.clone(),
    });
    let cancel = CancellationToken::new();
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let listener = EngineListener::new(
        EngineListenerConfig::new(
            &args.connect,
            args.topic.clone(),
            WorkerId(args.worker_id),
            args.block_size,
        ),
        tx,
    );
    let listening = tokio::spawn(listener.run(cancel.clone()));
    let processor = Processor::new(config, rx, sink.clone()).with_cancellation(cancel.clone());
    let processing = tokio::spawn(processor.run());

    let timeout = async {
        match args.timeout_ms {
            Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            None => std::future::pending().await,
        }
    };
    let code = tokio::select! {
        () = reached.notified() => 0,
        () = timeout => {
            eprintln!("timed out after {} router events", sink.printed.load(Ordering::Relaxed));
            1
        }
        _ = tokio::signal::ctrl_c() => if args.count.is_some() { 1 } else { 0 },
    };
    cancel.cancel();
    let listener_stats = listening.await?;
    let processor_stats = processing.await?;
    eprintln!("listener: {listener_stats:?}");
    eprintln!("processor: {processor_stats:?}");
    Ok(ExitCode::from(code))
}
