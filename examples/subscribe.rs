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
//! Exit codes: 0 when N messages arrived (or on Ctrl-C without `--count`); 1 on
//! timeout or when every publisher went away; 2 on a ZMTP protocol error (stderr
//! `protocol error: …`); 3 when it cannot connect.

mod common;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use common::{chain, hex_line};
use eventplane::zmtp::{Config, Error, Message, SubSocket};
use tokio::sync::mpsc;

#[derive(Parser, Debug)]
#[command(about = "Subscribe to ZMQ publishers and print their messages")]
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

/// What a connection task reports.
enum Report {
    Message(Message),
    Failed(Error),
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let topics: Vec<String> = if args.topic.is_empty() {
        vec![String::new()]
    } else {
        args.topic.clone()
    };
    let mut sockets = Vec::new();
    for endpoint in &args.connect {
        let connected = async {
            let mut sub = SubSocket::connect(endpoint, Config::default()).await?;
            for t in &topics {
                sub.subscribe(t.clone()).await?;
            }
            Ok::<_, Error>(sub)
        }
        .await;
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

    let (tx, mut rx) = mpsc::channel::<Report>(1024);
    for mut sub in sockets {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                let report = match sub.recv().await {
                    Ok(m) => Report::Message(m),
                    Err(e) => Report::Failed(e),
                };
                let failed = matches!(report, Report::Failed(_));
                if tx.send(report).await.is_err() || failed {
                    return;
                }
            }
        });
    }
    drop(tx);

    let deadline = args
        .timeout_ms
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
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
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let code = loop {
        if args.count.is_some_and(|n| messages >= n) {
            break 0;
        }
        tokio::select! {
            report = rx.recv() => match report {
                Some(Report::Message(m)) => {
                    messages += 1;
                    bytes += m.byte_len() as u64;
                    if let Format::Hex = args.format {
                        let _ = writeln!(out, "{}", hex_line(&m));
                        if rx.is_empty() {
                            let _ = out.flush();
                        }
                    }
                }
                Some(Report::Failed(e)) if e.is_protocol() => {
                    let _ = out.flush();
                    eprintln!("{}", protocol_line(&e));
                    break 2;
                }
                Some(Report::Failed(e)) => {
                    eprintln!("connection lost: {}", chain(&e));
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
