//! `subscribe`: a ZMQ SUB on one or more endpoints, printing what arrives.
//!
//! ```text
//! subscribe --connect EP [--connect EP…] [--topic PREFIX…] [--count N]
//!           [--timeout-ms MS] [--format hex|quiet]
//! ```
//! `hex` prints one line per message: each frame in lower-case hex (an empty frame as
//! `-`), frames separated by one space. The last stderr line is
//! `received N messages, B bytes`.
//!
//! With one `--connect` the socket is read in place, up to 256 messages per call; with
//! several, one task per socket hands over batches through a channel of
//! [`BATCHES_IN_FLIGHT`] batches. Output is written per batch, under one lock.
//!
//! Exit codes: 0 when N messages arrived (or on Ctrl-C without `--count`); 1 on
//! timeout (connecting included) or when every publisher went away; 2 on a ZMTP
//! protocol error (stderr `protocol error: …`); 3 when it cannot connect.

use eventplane_cli as common;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use common::{chain, hex_line};
use eventplane::zmtp::{Config, Error, Message, SubSocket};
use tokio::sync::mpsc;

/// Messages asked of a socket per call.
const BATCH: usize = 256;

/// Batches in flight from the socket tasks when there are several sockets: with
/// `recv_many`'s own cap (256 messages or about 1 MiB), at most about 16 MiB wait.
const BATCHES_IN_FLIGHT: usize = 16;

#[derive(Parser, Debug)]
#[command(
    about = "Subscribe to ZMQ publishers and print their messages",
    after_help = "Exit codes: 0 when --count messages arrived (or on Ctrl-C without \
                  --count); 1 on timeout (connecting included) or when every publisher \
                  went away; 2 on a ZMTP protocol error; 3 when it cannot connect.\n\nLogs: warnings go to stderr; RUST_LOG sets the level (off, debug, or \
                  target=level pairs such as eventplane=debug)."
)]
struct Args {
    /// Publisher endpoint (tcp://host:port); repeat for several.
    #[arg(long = "connect", required = true)]
    connect: Vec<String>,
    /// Subscription prefix; repeat for several. Default: everything.
    #[arg(long = "topic")]
    topic: Vec<String>,
    /// Exit 0 after this many messages.
    #[arg(long)]
    count: Option<u64>,
    /// Exit 1 if the run lasts longer than this.
    #[arg(long = "timeout-ms")]
    timeout_ms: Option<u64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Hex)]
    format: Format,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Hex,
    Quiet,
}

/// Where the messages come from: the one socket itself, or the tasks reading several.
enum Source {
    One(Box<SubSocket>),
    Many(mpsc::Receiver<Result<Vec<Message>, Error>>),
}

impl Source {
    /// The next batch (appended to `batch`), a socket's failure, or `None` once every
    /// socket is gone. Cancel-safe: a batch is either delivered whole or not taken.
    async fn next(&mut self, batch: &mut Vec<Message>) -> Option<Result<(), Error>> {
        match self {
            Source::One(sub) => Some(sub.recv_many(batch, BATCH).await.map(drop)),
            Source::Many(rx) => match rx.recv().await? {
                Ok(mut got) => {
                    // Take the task's vector as it is (no copy into ours).
                    if batch.is_empty() {
                        std::mem::swap(batch, &mut got);
                    } else {
                        batch.append(&mut got);
                    }
                    Some(Ok(()))
                }
                Err(e) => Some(Err(e)),
            },
        }
    }
}

/// Reads `sub` until it fails or the receiver is gone, one batch per send.
async fn pump(mut sub: SubSocket, tx: mpsc::Sender<Result<Vec<Message>, Error>>) {
    loop {
        let mut batch = Vec::with_capacity(BATCH);
        let read = sub.recv_many(&mut batch, BATCH).await.map(|_| batch);
        let failed = read.is_err();
        if tx.send(read).await.is_err() || failed {
            return;
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let topics: Vec<String> = if args.topic.is_empty() {
        vec![String::new()]
    } else {
        args.topic.clone()
    };
    // The deadline covers connecting too: a peer that accepts and never answers
    // times out at --timeout-ms, not at the handshake's own limit.
    let deadline = args
        .timeout_ms
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    let mut sockets = Vec::new();
    for endpoint in &args.connect {
        let connecting = async {
            let mut sub = SubSocket::connect(endpoint, Config::default()).await?;
            for t in &topics {
                sub.subscribe(t.clone()).await?;
            }
            Ok::<_, Error>(sub)
        };
        let connected = match deadline {
            Some(d) => match tokio::time::timeout_at(d, connecting).await {
                Ok(connected) => connected,
                Err(_) => {
                    eprintln!(
                        "timed out connecting to {endpoint}: no TCP connection, or no ZMTP \
                         handshake from the peer, within --timeout-ms {}",
                        args.timeout_ms.unwrap_or_default()
                    );
                    eprintln!("received 0 messages, 0 bytes");
                    return ExitCode::from(1);
                }
            },
            None => connecting.await,
        };
        match connected {
            Ok(sub) => sockets.push(sub),
            Err(e) if e.is_protocol() => {
                eprintln!("{}", protocol_line(&e));
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("cannot connect to {endpoint}: {}", chain(&e));
                return ExitCode::from(3);
            }
        }
    }
    let mut open = sockets.len();
    let mut source = if sockets.len() == 1 {
        Source::One(Box::new(sockets.remove(0)))
    } else {
        let (tx, rx) = mpsc::channel(BATCHES_IN_FLIGHT);
        for sub in sockets {
            tokio::spawn(pump(sub, tx.clone()));
        }
        Source::Many(rx)
    };

    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);

    let (mut messages, mut bytes) = (0u64, 0u64);
    // One lock for the run; one write (the flush) per batch.
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let mut batch = Vec::with_capacity(BATCH);
    let code = loop {
        if args.count.is_some_and(|n| messages >= n) {
            break 0;
        }
        tokio::select! {
            next = source.next(&mut batch) => match next {
                Some(Ok(())) => {
                    // Never more than --count: the rest of the last batch is left.
                    let take = args
                        .count
                        .map_or(batch.len(), |n| batch.len().min((n - messages) as usize));
                    for m in batch.iter().take(take) {
                        bytes += m.byte_len() as u64;
                        if let Format::Hex = args.format {
                            let _ = writeln!(out, "{}", hex_line(m));
                        }
                    }
                    if let Format::Hex = args.format {
                        let _ = out.flush();
                    }
                    messages += take as u64;
                    batch.clear();
                }
                Some(Err(e)) if e.is_protocol() => {
                    let _ = out.flush();
                    eprintln!("{}", protocol_line(&e));
                    break 2;
                }
                Some(Err(e)) => {
                    eprintln!("connection lost: {}", chain(&e));
                    open -= 1;
                    if open == 0 || matches!(source, Source::One(_)) {
                        eprintln!("every publisher went away");
                        break 1;
                    }
                }
                None => {
                    eprintln!("every publisher went away");
                    break 1;
                }
            },
            () = &mut sleep => {
                eprintln!("timed out");
                break 1;
            }
            _ = &mut ctrl_c => break if args.count.is_some() { 1 } else { 0 },
        }
    };
    let _ = out.flush();
    eprintln!("received {messages} messages, {bytes} bytes");
    ExitCode::from(code)
}

/// `protocol error: …` for every protocol failure, a peer's ERROR command included.
fn protocol_line(e: &Error) -> String {
    match e {
        Error::Protocol(_) => e.to_string(),
        other => format!("protocol error: {other}"),
    }
}
