//! The `subscribe` and `publish` examples are contracts (DESIGN §6): flags, output
//! format and exit codes. These tests run the built binaries.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use std::path::PathBuf;
use std::process::Stdio;

use support::within;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/<test> → target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} not built (cargo test builds examples)",
        path.display()
    );
    path
}

fn payload_hex(seq: u64, size: usize) -> String {
    (0..size)
        .map(|i| format!("{:02x}", (seq + i as u64) % 251))
        .collect()
}

#[tokio::test]
async fn publish_then_subscribe_hex() {
    let mut publisher = Command::new(example("publish"))
        .args([
            "--bind",
            "tcp://127.0.0.1:0",
            "--topic",
            "cli",
            "--count",
            "50",
        ])
        .args(["--size", "20", "--linger-ms", "2000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(publisher.stdout.take().unwrap()).lines();
    let endpoint = within(lines.next_line()).await.unwrap().unwrap();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");

    let sub = Command::new(example("subscribe"))
        .args(["--connect", &endpoint, "--topic", "cli", "--count", "50"])
        .args(["--timeout-ms", "20000", "--format", "hex"])
        .output();
    let sub = within(sub).await.unwrap();
    let stderr = String::from_utf8_lossy(&sub.stderr);
    assert_eq!(sub.status.code(), Some(0), "{stderr}");
    let stdout = String::from_utf8(sub.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 50);
    for (seq, line) in lines.iter().enumerate() {
        let seq = seq as u64;
        let expect = format!(
            "{} {} {}",
            hex::encode(b"cli"),
            hex::encode(seq.to_be_bytes()),
            payload_hex(seq, 20)
        );
        assert_eq!(*line, expect);
    }
    assert_eq!(
        stderr.lines().last().unwrap(),
        format!("received 50 messages, {} bytes", 50 * (3 + 8 + 20))
    );
    let status = within(publisher.wait()).await.unwrap();
    assert!(status.success());
    let mut err = String::new();
    publisher
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .await
        .unwrap();
    assert_eq!(err.lines().last().unwrap(), "sent 50 messages, 0 dropped");
}

#[tokio::test]
async fn subscribe_exit_codes() {
    // 2: a hostile peer (bad greeting) → protocol error.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        let mut sink = [0u8; 256];
        let _ = s.read(&mut sink).await;
    });
    let out = within(
        Command::new(example("subscribe"))
            .args([
                "--connect",
                &endpoint,
                "--count",
                "1",
                "--timeout-ms",
                "5000",
            ])
            .output(),
    )
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("protocol error: bad greeting signature"),
        "{stderr}"
    );

    // 3: nothing listens.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", closed.local_addr().unwrap());
    drop(closed);
    let out = within(
        Command::new(example("subscribe"))
            .args(["--connect", &endpoint, "--count", "1"])
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(3));

    // 1: a publisher that never publishes.
    let publisher = eventplane::zmtp::PubSocket::bind("tcp://127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let out = within(
        Command::new(example("subscribe"))
            .args(["--connect", publisher.local_endpoint().unwrap()])
            .args(["--count", "1", "--timeout-ms", "300", "--format", "quiet"])
            .output(),
    )
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.lines().last().unwrap(),
        "received 0 messages, 0 bytes"
    );
}

#[tokio::test]
async fn publish_waits_for_k_subscribers_and_empty_frames_print_dash() {
    let mut publisher = Command::new(example("publish"))
        .args(["--bind", "tcp://127.0.0.1:0", "--topic", "", "--count", "3"])
        .args(["--size", "0", "--subscribers", "2"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(publisher.stdout.take().unwrap()).lines();
    let endpoint = within(lines.next_line()).await.unwrap().unwrap();
    let run = |ep: String| {
        Command::new(example("subscribe"))
            .args(["--connect", &ep, "--count", "3", "--timeout-ms", "20000"])
            .output()
    };
    let (a, b) = within(async { tokio::join!(run(endpoint.clone()), run(endpoint.clone())) }).await;
    for out in [a.unwrap(), b.unwrap()] {
        assert_eq!(out.status.code(), Some(0));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines,
            vec![
                "- 0000000000000000 -",
                "- 0000000000000001 -",
                "- 0000000000000002 -"
            ]
        );
    }
    assert!(within(publisher.wait()).await.unwrap().success());
}

mod hex {
    pub(crate) fn encode(bytes: impl AsRef<[u8]>) -> String {
        bytes.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[tokio::test]
async fn kv_listen_prints_router_events_as_json_lines() {
    let files: Vec<String> = ["vllm_v023.msgpack", "vllm_v024.msgpack", "sglang.msgpack"]
        .iter()
        .map(|f| format!("{}/tests/fixtures/{f}", env!("CARGO_MANIFEST_DIR")))
        .collect();
    let mut engine = support::PyPeer::spawn(&[
        "kvpub",
        "--topics",
        "kv",
        "--files",
        &files.join(","),
        "--seqs",
        "0,1,2",
    ]);
    let port = engine
        .line()
        .await
        .strip_prefix("port ")
        .unwrap()
        .to_owned();
    let expected = support::expected_router_events(&files, 11, 4);
    let out = within(
        Command::new(example("kv_listen"))
            .args([
                "--connect",
                &format!("tcp://127.0.0.1:{port}"),
                "--topic",
                "kv",
            ])
            .args(["--block-size", "4", "--worker-id", "11"])
            .args([
                "--count",
                &expected.len().to_string(),
                "--timeout-ms",
                "20000",
            ])
            .output(),
    )
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), expected.len());
    for (line, want) in lines.iter().zip(&expected) {
        assert_eq!(*line, serde_json::to_string(want).unwrap());
    }
    engine.send_line("exit").await;
    engine.wait().await;
}

#[tokio::test]
async fn kv_listen_times_out_with_exit_1() {
    let publisher = eventplane::zmtp::PubSocket::bind("tcp://127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let out = within(
        Command::new(example("kv_listen"))
            .args([
                "--connect",
                publisher.local_endpoint().unwrap(),
                "--topic",
                "kv",
            ])
            .args(["--block-size", "4", "--worker-id", "1", "--count", "1"])
            .args(["--timeout-ms", "300"])
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test]
async fn demo_runs_and_accounts_for_every_event() {
    let out = within(
        Command::new(example("demo"))
            .args(["--engines", "2", "--seconds", "3", "--rate", "4000"])
            .output(),
    )
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value = |label: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no {label:?} in\n{stdout}"));
        line.split_whitespace().last().unwrap().parse().unwrap()
    };
    let published = value("engine events published");
    assert!(published > 0);
    assert_eq!(value("engine events decoded by workers"), published);
    // Every router event the workers emitted reached the router, none dropped.
    assert_eq!(
        value("router events received by the router"),
        value("router events emitted (coalesced, deduped)")
    );
    assert_eq!(value("drops (router lanes, all reasons)"), 0);
    assert!(stdout.contains("left; engine 2 joined"), "{stdout}");
    assert!(value("index entries (worker × block)") > 0);
}
