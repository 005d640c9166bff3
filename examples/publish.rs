//! `publish`: a ZMQ PUB sending a numbered test stream.
//!
//! ```text
//! publish --bind EP --topic T [--count N] [--size BYTES] [--rate MSG_PER_SEC]
//!         [--subscribers K] [--linger-ms MS]
//! ```
//! Prints the bound endpoint on stdout first, waits until K subscribers have
//! subscribed (a subscription received, not just a TCP connect; default 1), sends
//! `[T, seq u64be, payload]` where payload byte i = (seq + i) mod 251, then lingers
//! (default 1000 ms) so queued messages drain, and exits 0. Without `--rate` it sends
//! as fast as the subscribers drain their queues, so nothing is dropped for a
//! subscriber that keeps up. The last stderr line is `sent N messages, D dropped`.
//! Exit codes: 0 when done; 2 on bad arguments (a malformed `--bind`); 3 when the
//! endpoint cannot be bound.

use eventplane_cli as common;

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use common::chain;
use eventplane::zmtp::{Config, Message, PubSocket};

#[derive(Parser, Debug)]
#[command(
    about = "Publish a numbered test stream on a ZMQ PUB socket",
    after_help = "Exit codes: 0 when done; 2 on bad arguments (a malformed --bind); 3 when \
                  the endpoint cannot be bound.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug)."
)]
struct Args {
    /// Endpoint to bind, e.g. tcp://127.0.0.1:0 (port 0: the OS picks one).
    #[arg(long)]
    bind: String,
    /// First frame of every message.
    #[arg(long)]
    topic: String,
    /// Messages to send (default: until Ctrl-C).
    #[arg(long)]
    count: Option<u64>,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 100)]
    size: usize,
    /// Messages per second (default: as fast as subscribers drain).
    #[arg(long)]
    rate: Option<f64>,
    /// Subscribers to wait for before sending.
    #[arg(long, default_value_t = 1)]
    subscribers: usize,
    /// How long to let queues drain before exiting.
    #[arg(long = "linger-ms", default_value_t = 1000)]
    linger_ms: u64,
}

/// Messages sent between waits for the queues to drain when no rate is set.
const UNPACED_BATCH: u64 = 1024;

fn payload(seq: u64, size: usize) -> Bytes {
    (0..size).map(|i| ((seq + i as u64) % 251) as u8).collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<std::process::ExitCode> {
    common::init_tracing();
    let args = Args::parse();
    let publisher = match PubSocket::bind(&args.bind, Config::default()).await {
        Ok(p) => p,
        Err(e) => {
            // A malformed endpoint is a bad argument (exit 2); an address that cannot
            // be bound is the machine's answer (exit 3). Both name the endpoint.
            let bad = matches!(e, eventplane::zmtp::Error::InvalidEndpoint { .. });
            if bad {
                eprintln!("invalid --bind {}: {}", args.bind, chain(&e));
            } else {
                eprintln!("cannot bind --bind {}: {}", args.bind, chain(&e));
            }
            return Ok(std::process::ExitCode::from(if bad { 2 } else { 3 }));
        }
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", publisher.local_endpoint().unwrap_or_default())?;
        out.flush()?;
    }
    tokio::select! {
        () = publisher.wait_for_subscribers(args.subscribers) => {}
        _ = tokio::signal::ctrl_c() => return Ok(std::process::ExitCode::SUCCESS),
    }
    let topic = Bytes::from(args.topic.clone());
    let start = tokio::time::Instant::now();
    let mut seq = 0u64;
    let send = async {
        while args.count.is_none_or(|n| seq < n) {
            publisher.send(Message::from_parts([
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload(seq, args.size),
            ]));
            seq += 1;
            match args.rate {
                Some(rate) if rate > 0.0 => {
                    let due = start + Duration::from_secs_f64(seq as f64 / rate);
                    if due > tokio::time::Instant::now() + Duration::from_millis(1) {
                        tokio::time::sleep_until(due).await;
                    }
                }
                _ if seq % UNPACED_BATCH == 0 => {
                    publisher.flush(Duration::from_secs(3600)).await;
                }
                _ => {}
            }
        }
    };
    tokio::select! {
        () = send => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let dropped = publisher.stats().dropped;
    publisher.close(Duration::from_millis(args.linger_ms)).await;
    eprintln!("sent {seq} messages, {dropped} dropped");
    Ok(std::process::ExitCode::SUCCESS)
}
