//! Peak RSS of a publisher process under hostile subscribers: our `PubSocket` and the
//! zeromq crate's `PubSocket`, each in a child process of its own (release build,
//! default configuration), under the same floods:
//!
//! - `ping`: a subscriber completes the handshake, subscribes, then writes 1.3 GB of
//!   PING commands (16-byte context) and never reads;
//! - `big+sub`: 40 × [an 8 MiB message, a subscription with a unique 1000-byte
//!   prefix], dialling again whenever the publisher closes the connection;
//! - `ignored+sub`: 4096 × [64 KiB of 1000-byte messages the publisher ignores, a
//!   subscription with a unique 1000-byte prefix] on one connection.
//!
//! Each flood stops early when a write stays blocked for 2 s (the publisher stopped
//! reading). Reported: the growth of the child's peak RSS (VmHWM) over its RSS before
//! the flood, the bytes the publisher accepted, and how the connection ended.
//!
//! `cargo bench --bench pub_flood_rss`
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

#[path = "common/watchdog.rs"]
mod watchdog;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: u64 = 1 << 20;
const CHILD_ENV: &str = "PUB_FLOOD_RSS_CHILD";

fn main() {
    if let Ok(which) = std::env::var(CHILD_ENV) {
        run_publisher(&which);
        return;
    }
    watchdog::arm("pub_flood_rss", Duration::from_secs(2700));
    // `cargo bench` passes `--bench`; a filter argument picks floods by name.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!(
        "{:<12} {:<11} {:>14} {:>12}  ending",
        "publisher", "flood", "peak RSS +MiB", "accepted MiB"
    );
    for flood in ["ping", "big+sub", "ignored+sub"] {
        if filter.as_deref().is_some_and(|f| !flood.contains(f)) {
            continue;
        }
        for publisher in ["eventplane", "zeromq"] {
            let (mut child, endpoint) = spawn_publisher(publisher);
            let pid = child.id();
            // The peak from here on (its start-up peak left out).
            std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
            let before = status_bytes(pid, "VmRSS");
            let (accepted, ending) = rt.block_on(run_flood(flood, &endpoint));
            // A publisher that died under the flood has no VmHWM to read: fail, not 0.
            assert!(
                matches!(child.try_wait(), Ok(None)),
                "{publisher} died under {flood}"
            );
            let grown = status_bytes(pid, "VmHWM").saturating_sub(before);
            println!(
                "{publisher:<12} {flood:<11} {:>14.1} {:>12.1}  {ending}",
                grown as f64 / MIB as f64,
                accepted as f64 / MIB as f64
            );
            let _ = child.kill();
            let _ = child.wait();
            // The bound this bench exists to show: whatever the flood, our publisher
            // process grows by a few MiB (the figures above are ≤ 6 MiB).
            if publisher == "eventplane" {
                assert!(
                    grown < 16 * MIB,
                    "{flood}: our publisher grew by {} MiB",
                    grown / MIB
                );
                // And it served the flood the way docs/guarantees.md says.
                let expected = match flood {
                    "big+sub" => "40 of 40 connections closed",
                    _ => "served throughout",
                };
                assert_eq!(ending, expected, "{flood}");
            }
        }
    }
}

fn spawn_publisher(which: &str) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, which)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let endpoint = line.trim().trim_start_matches("tcp://").to_owned();
    (child, endpoint)
}

/// The publisher process: binds, prints its endpoint, publishes 10 small messages a
/// second on topic `t`, until killed.
fn run_publisher(which: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        match which {
            "eventplane" => {
                use eventplane::zmtp::{Config, Message, PubSocket};
                let socket = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
                    .await
                    .unwrap();
                announce(socket.local_endpoint().unwrap());
                loop {
                    socket.send(Message::from_parts(["t", "tick"]));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            _ => {
                use zeromq::{Socket, SocketSend, ZmqMessage};
                let mut socket = zeromq::PubSocket::new();
                let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap();
                announce(&endpoint.to_string());
                loop {
                    let msg = ZmqMessage::try_from(vec![
                        bytes::Bytes::from_static(b"t"),
                        bytes::Bytes::from_static(b"tick"),
                    ])
                    .unwrap();
                    let _ = socket.send(msg).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
}

fn announce(endpoint: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{endpoint}").unwrap();
    out.flush().unwrap();
}

fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// A ZMTP 3.1 subscriber's greeting and READY, then the ZMTP 3.0 subscription
/// message `0x01 t` (accepted by both publishers; zeromq-rs refuses commands).
fn hello() -> Vec<u8> {
    // Our own greeting is a SUB's: ZMTP 3.1, NULL, not as-server.
    let mut g = bytes::BytesMut::new();
    eventplane::zmtp::codec::encode_greeting(&mut g);
    let mut g = g.to_vec();
    g.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
    g.extend_from_slice(b"\x00\x02\x01t");
    g
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        out.push(0x02);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(0x00);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
    out
}

fn subscription(i: u32) -> Vec<u8> {
    let mut prefix = vec![1u8];
    prefix.extend_from_slice(&i.to_be_bytes());
    prefix.resize(1001, b'x');
    frame(&prefix)
}

/// Writes `data`; `Err` with the reason when the peer closed or stopped reading.
async fn write(stream: &mut TcpStream, data: &[u8]) -> Result<(), &'static str> {
    match tokio::time::timeout(Duration::from_secs(2), stream.write_all(data)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("closed by the publisher"),
        Err(_) => Err("publisher stopped reading"),
    }
}

/// Whether the publisher closed the connection (read until EOF, briefly).
async fn closed(stream: &mut TcpStream) -> bool {
    let mut buf = vec![0u8; 64 << 10];
    let probe = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_millis(500), probe)
        .await
        .unwrap_or(false)
}

async fn run_flood(flood: &str, endpoint: &str) -> (u64, String) {
    let mut accepted = 0u64;
    match flood {
        "ping" => {
            let mut s = TcpStream::connect(endpoint).await.unwrap();
            s.write_all(&hello()).await.unwrap();
            let mut ping = b"\x04\x17\x04PING\x00\x00".to_vec();
            ping.extend_from_slice(&[0x5a; 16]);
            let chunk = ping.repeat(40_000);
            while accepted < 1300 * MIB {
                if let Err(why) = write(&mut s, &chunk).await {
                    return (accepted, why.to_owned());
                }
                accepted += chunk.len() as u64;
            }
            let ending = if closed(&mut s).await {
                "closed after the flood"
            } else {
                "served throughout"
            };
            (accepted, ending.to_owned())
        }
        "big+sub" => {
            let big = frame(&vec![7u8; 8 << 20]);
            let mut reconnects = 0;
            for i in 0..40u32 {
                let mut s = TcpStream::connect(endpoint).await.unwrap();
                let mut script = hello();
                script.extend_from_slice(&big);
                script.extend(subscription(i));
                let written = write(&mut s, &script).await;
                if written.is_ok() {
                    accepted += script.len() as u64;
                }
                if written.is_err() || closed(&mut s).await {
                    reconnects += 1;
                }
            }
            (accepted, format!("{reconnects} of 40 connections closed"))
        }
        _ => {
            let mut s = TcpStream::connect(endpoint).await.unwrap();
            s.write_all(&hello()).await.unwrap();
            let ignored = frame(&[2u8; 1000]).repeat(64);
            for i in 0..4096u32 {
                let mut chunk = ignored.clone();
                chunk.extend(subscription(i));
                if let Err(why) = write(&mut s, &chunk).await {
                    return (accepted, why.to_owned());
                }
                accepted += chunk.len() as u64;
            }
            // Let the publisher finish reading before the peak is taken.
            tokio::time::sleep(Duration::from_millis(500)).await;
            (accepted, "served throughout".to_owned())
        }
    }
}
