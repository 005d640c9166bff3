//! `kv_listen`: an engine's KV events in, router events out as JSON lines.
//!
//! ```text
//! kv_listen --connect EP --topic T --block-size B --worker-id W [--count N]
//!           [--timeout-ms MS] [--batch-timeout-ms MS]
//! ```
//! Runs `EngineListener → Processor` and prints each published `RouterEvent` as one
//! line of JSON (snake_case, externally tagged); its stats are the last stderr line,
//! one JSON object (`listener`, `processor`). Exits 0 after N router events (or on
//! Ctrl-C without `--count`), 1 on timeout, 2 when an argument is refused.

use eventplane_cli as common;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use common::{EngineArgs, optional_timeout, stop_signal};
use eventplane::BoxFuture;
use eventplane::kv::{
    RouterEvent,
    pipeline::{EventSink, SinkError, Worker},
};
use tokio::sync::Notify;

#[derive(Parser, Debug)]
#[command(
    about = "Print an engine's KV events as router events (JSON lines)",
    after_help = "Exit codes: 0 after --count router events (or on Ctrl-C without \
                  --count); 1 on timeout; 2 when an argument is refused.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug).",
    after_long_help = format!(
        "{}\n\nOutput: one router event per stdout line. {}\nThe last stderr line, \
         at exit: the counters as one JSON object {{\"listener\": {{...}}, \"processor\": \
         {{...}}}}.\n\nExit codes: 0 after --count router events (or on Ctrl-C without \
         --count); 1 on timeout; 2 when an argument is refused.\n\nLogs: warnings go to \
         stderr; RUST_LOG sets the level (off, debug, or target=level pairs such as \
         eventplane=debug).",
        common::ENGINE_INPUT_HELP,
        common::ROUTER_EVENT_HELP
    )
)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Exit 0 after this many router events.
    #[arg(long)]
    count: Option<u64>,
    /// Exit 1 if the run lasts longer than this.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
}

/// Prints each event as a JSON line and counts.
struct Print {
    printed: AtomicU64,
    target: Option<u64>,
    reached: Arc<Notify>,
}

impl EventSink for Print {
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
        // One lock and one write per batch (stdout alone flushes every line).
        let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
        for ev in events {
            if self
                .target
                .is_some_and(|t| self.printed.load(Ordering::Relaxed) >= t)
            {
                break;
            }
            if let Err(e) = serde_json::to_writer(&mut out, ev) {
                return Box::pin(async move { Err(SinkError(Box::new(e))) });
            }
            let _ = out.write_all(b"\n");
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
    common::init_tracing();
    let args = Args::parse();
    let reached = Arc::new(Notify::new());
    let sink = Arc::new(Print {
        printed: AtomicU64::new(0),
        target: args.count,
        reached: reached.clone(),
    });
    let worker = match args
        .engine
        .start(|engine| Worker::with_sink(engine, sink.clone()))
    {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return Ok(ExitCode::from(2));
        }
    };

    let code = tokio::select! {
        () = reached.notified() => 0,
        () = optional_timeout(args.timeout_ms) => {
            eprintln!("timed out after {} router events", sink.printed.load(Ordering::Relaxed));
            1
        }
        () = stop_signal() => if args.count.is_some() { 1 } else { 0 },
    };
    // Stops taking engine batches, prints what was queued, stops.
    let stats = worker.shutdown().await;
    // One JSON object, the last stderr line, as kv-relay and kv-router print theirs.
    eprintln!(
        "{}",
        serde_json::json!({"listener": stats.listener, "processor": stats.processor})
    );
    Ok(ExitCode::from(code))
}
