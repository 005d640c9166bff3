//! `kv_relay`: the worker-side KV job as a process — an engine's KV events in, router
//! events out on a bound PUB.
//!
//! ```text
//! kv_relay --connect EP --topic T --block-size B --worker-id W --bind EP2
//!          [--publish-topic kv-events] [--batch-timeout-ms MS]
//! ```
//! Runs `EngineListener → Processor → EventPlaneSink → EventPublisher`, the publisher
//! bound at EP2 and registered nowhere (`--bind tcp://127.0.0.1:0` lets the OS pick the
//! port). Its messages are `[publish-topic, publisher_id u64be, seq u64be, payload]`,
//! the payload a msgpack list of router events (`kv::decode_router_events`).
//!
//! Prints the bound endpoint as the first stdout line, then nothing per event; runs
//! until Ctrl-C or SIGTERM, then prints its stats as one JSON object, the last line on
//! stderr. Exit codes: 0 after a signal; 2 on bad arguments; 3 when EP2 cannot be
//! bound.

mod common;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use common::{EngineArgs, chain, stop_signal};
use eventplane::kv::EventPlaneSink;
use eventplane::publish::EventPublisher;
use eventplane::zmtp::Config;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "Relay an engine's KV events as router events on a ZMQ PUB")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Where to publish router events (tcp://host:port; port 0 for any).
    #[arg(long)]
    bind: String,
    /// Topic of the published router events.
    #[arg(long = "publish-topic", default_value = "kv-events")]
    publish_topic: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let publisher = match EventPublisher::bind_unregistered(
        &args.bind,
        args.publish_topic.clone(),
        Config::default(),
    )
    .await
    {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("cannot bind {}: {}", args.bind, chain(&e));
            return ExitCode::from(3);
        }
    };
    let sink = Arc::new(EventPlaneSink::new(publisher.clone()));
    let cancel = CancellationToken::new();
    let pipeline = match args.engine.start(sink.clone(), &cancel) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    println!("{}", publisher.local_endpoint().unwrap_or_default());

    stop_signal().await;
    cancel.cancel();
    let listener_stats = pipeline.listener.await.unwrap_or_default();
    let processor_stats = pipeline.processor.await.unwrap_or_default();
    let messages = sink.messages();
    drop(sink);
    let publisher_stats = publisher.stats();
    if let Ok(p) = Arc::try_unwrap(publisher) {
        p.shutdown().await;
    }
    let stats = serde_json::json!({
        "listener": listener_stats,
        "processor": processor_stats,
        "published_messages": messages,
        "publisher": publisher_stats,
    });
    eprintln!("{stats}");
    ExitCode::SUCCESS
}
