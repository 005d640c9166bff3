//! The `subscribe` and `publish` examples are contracts (DESIGN §6): flags, output
//! format and exit codes. These tests run the built binaries.
#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    missing_docs
)]

mod support;

use eventplane::wire::Dialect;
use std::process::Stdio;
use std::time::Duration;

use support::{example, within};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;

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
    let (_held, port) = support::refusing_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
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
    let files = support::kv_fixture_files();
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
    let endpoint = publisher.local_endpoint().unwrap();
    let out = run_example(
        "kv_listen",
        &["--connect", endpoint, "--topic", "kv", "--block-size", "4"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "--worker-id is required");
    let out = run_example(
        "kv_listen",
        &[
            "--connect",
            endpoint,
            "--topic",
            "kv",
            "--block-size",
            "4",
            "--worker-id",
            "1",
            "--count",
            "1",
            "--timeout-ms",
            "300",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
}

#[tokio::test]
async fn demo_runs_and_accounts_for_every_event() {
    let out = run_demo(&["--engines", "3", "--seconds", "2", "--rate", "6000"]).await;
    let stdout = success_stdout(&out);
    let value = |label: &str| table_value(&stdout, label);
    let published = value("engine events published");
    assert!(published > 0);
    // Every engine event is accounted for, stage by stage, exactly.
    let into_workers = value("engine events into worker pipelines");
    assert_eq!(
        published,
        value("lost between engine and worker")
            + value("rejected by the workers' decoders")
            + into_workers,
        "{stdout}"
    );
    let emitted = value("router events emitted");
    assert_eq!(
        into_workers,
        value("merged by coalescing")
            + value("removed by dedup")
            + value("withheld by a fenced processor")
            + emitted,
        "{stdout}"
    );
    assert!(value("merged by coalescing") > 0 && value("removed by dedup") > 0);
    let discarded = value("discarded by the router");
    assert_eq!(
        emitted,
        value("lost on the event plane")
            + discarded
            + value("router events applied to the router index"),
        "{stdout}"
    );
    assert_eq!(value("unaccounted engine events"), 0, "{stdout}");
    // At this modest rate nothing is lost anywhere but the message the demo discards.
    assert_eq!(
        value("router events applied to the router index") + discarded,
        emitted
    );
    assert_eq!(value("drops (router lanes, all reasons)"), 0);
    assert_repaired(&stdout);
    assert!(stdout.contains("left; engine 3 joined"), "{stdout}");
    assert!(value("index entries (worker × block)") > 0);
}

#[cfg(feature = "tunnel")]
#[tokio::test]
async fn demo_through_the_tunnel_reaches_every_worker_only_through_the_broker() {
    let out = run_demo(&[
        "--tunnel",
        "--engines",
        "3",
        "--seconds",
        "2",
        "--rate",
        "6000",
    ])
    .await;
    let stdout = success_stdout(&out);
    let value = |label: &str| table_value(&stdout, label);
    assert!(
        stdout.contains("tunnel: broker joined the event bus"),
        "{stdout}"
    );
    // Three workers, then one more: each reached through the broker (the router's
    // own dials to loopback are refused).
    assert!(value("streams through the broker") >= 4, "{stdout}");
    // No worker accepted a connection but the broker's: the router dialled none.
    assert_eq!(
        value("worker connections not through the bus"),
        0,
        "{stdout}"
    );
    assert!(value("bytes relayed publishers → router") > 0);
    assert_eq!(value("unaccounted engine events"), 0, "{stdout}");
    assert_eq!(
        value("router events applied to the router index") + value("discarded by the router"),
        value("router events emitted"),
        "{stdout}"
    );
    // Its recoveries went through the broker too (the router dials nothing).
    assert!(value("recoveries among them") >= 4, "{stdout}");
    assert_repaired(&stdout);
}

/// `demo --tunnel --sources`: the odd workers dial out as sources, the even ones sit
/// behind the broker; every worker is reached through the bus, and the ledger balances.
#[cfg(feature = "tunnel")]
#[tokio::test]
async fn demo_with_half_the_workers_dialling_out_balances_its_ledger() {
    let out = run_demo(&[
        "--tunnel",
        "--sources",
        "--engines",
        "4",
        "--seconds",
        "2",
        "--rate",
        "6000",
    ])
    .await;
    let stdout = success_stdout(&out);
    let value = |label: &str| table_value(&stdout, label);
    assert!(
        stdout.contains("the odd workers dial out as sources"),
        "{stdout}"
    );
    // Workers 0, 2 (and 4, joining) behind the broker; 1 and 3 dialling out.
    assert!(value("streams through the broker") >= 2, "{stdout}");
    assert!(value("streams from workers dialling out") >= 2, "{stdout}");
    assert_eq!(
        value("worker connections not through the bus"),
        0,
        "{stdout}"
    );
    assert_eq!(value("unaccounted engine events"), 0, "{stdout}");
    assert_eq!(
        value("router events applied to the router index") + value("discarded by the router"),
        value("router events emitted"),
        "{stdout}"
    );
    assert_repaired(&stdout);
}

/// The demo's injected loss was repaired from the worker's log, not wiped, and the
/// index held every worker's blocks exactly when it stopped.
#[track_caller]
fn assert_repaired(stdout: &str) {
    let value = |label: &str| table_value(stdout, label);
    assert!(value("discarded by the router") >= 8, "{stdout}");
    // A repair beyond each worker's first-sight dump (events since the loss, or a
    // dump when the loss was right at the worker's start).
    assert!(
        value("index repairs from the events since a loss")
            + value("index repairs from a worker's dump")
            > value("workers"),
        "{stdout}"
    );
    assert_eq!(value("index wipes"), 0, "{stdout}");
    assert_eq!(
        value("whose blocks the index held exactly"),
        value("workers"),
        "{stdout}"
    );
}

/// The number ending the line of the demo's table that starts with `label`.
fn table_value(stdout: &str, label: &str) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} in\n{stdout}"));
    line.split_whitespace().last().unwrap().parse().unwrap()
}

/// Runs the demo to completion, its drains patient (a busy machine may stall a
/// worker for seconds: that is not loss), and checks that no drain gave up.
async fn run_demo(args: &[&str]) -> std::process::Output {
    let args: Vec<&str> = args.iter().copied().chain(["--drain-secs", "10"]).collect();
    let out = run_example("demo", &args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("drain gave up") && !stdout.contains("never decoded"),
        "{stdout}"
    );
    out
}

/// Runs an example to completion (bounded by the test deadline).
async fn run_example(name: &str, args: &[&str]) -> std::process::Output {
    within(Command::new(example(name)).args(args).output())
        .await
        .unwrap()
}

/// Asserts exit 0 (showing stderr otherwise) and returns stdout.
fn success_stdout(out: &std::process::Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The last stderr line, parsed as the JSON stats object the examples print on exit.
fn stats_json(stderr: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(stderr);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: last stderr line {last:?}"))
}

/// The `publish` CLI sending 20 × 3-byte `[topic, seq, payload]` once subscribed,
/// and the endpoint it bound.
async fn spawn_publish(topic: &str) -> (tokio::process::Child, String) {
    let mut publisher = Command::new(example("publish"))
        .args(["--bind", "tcp://127.0.0.1:0", "--topic", topic])
        .args(["--count", "20", "--size", "3", "--linger-ms", "2000"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(publisher.stdout.take().unwrap()).lines();
    let endpoint = within(lines.next_line()).await.unwrap().unwrap();
    (publisher, endpoint)
}

#[tokio::test]
async fn watch_static_prints_deliveries_and_stats() {
    let (mut publisher, endpoint) = spawn_publish("wt").await;
    let out = within(
        Command::new(example("watch"))
            .args(["--static", &endpoint, "--namespace", "ns", "--topic", "wt"])
            .args([
                "--layout",
                "topic-seq",
                "--count",
                "20",
                "--timeout-ms",
                "20000",
            ])
            .output(),
    )
    .await
    .unwrap();
    let stdout = success_stdout(&out);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 20);
    for (seq, line) in lines.iter().enumerate() {
        let seq = seq as u64;
        assert_eq!(
            *line,
            format!(
                "0 {seq} {} {} {}",
                hex::encode(b"wt"),
                hex::encode(seq.to_be_bytes()),
                payload_hex(seq, 3)
            )
        );
    }
    let stats = stats_json(&out.stderr);
    assert_eq!(stats["total"]["delivered"], 20, "{stats}");
    assert_eq!(stats["total"]["gaps"], 0, "{stats}");
    within(publisher.wait()).await.unwrap();
}

#[tokio::test]
async fn watch_on_another_layout_counts_malformed_and_says_why() {
    // `publish` sends [topic, seq, payload]; watch's default layout expects our
    // publisher's [topic, publisher_id, seq, payload].
    let (mut publisher, endpoint) = spawn_publish("wl").await;
    let out = within(
        Command::new(example("watch"))
            .args(["--static", &endpoint, "--namespace", "ns", "--topic", "wl"])
            .args(["--count", "1", "--timeout-ms", "3000"])
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "nothing fits: it times out");
    let stats = stats_json(&out.stderr);
    let malformed = stats["total"]["dropped_malformed"].as_u64().unwrap();
    assert!(malformed > 0, "{stats}");
    assert_eq!(stats["total"]["malformed"]["frames"], malformed, "{stats}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("did not fit --layout topic-publisher-seq"),
        "{stderr}"
    );
    // The library's own rate-limited warning (the examples log warnings by default).
    assert!(
        stderr.contains("do not fit the subscriber's layout"),
        "{stderr}"
    );
    within(publisher.wait()).await.unwrap();
}

#[tokio::test]
async fn watch_times_out_with_exit_1_and_still_prints_stats() {
    // Nothing listens there: the subscriber keeps redialling until the timeout.
    let (_held, port) = support::refusing_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let out = run_example(
        "watch",
        &[
            "--static",
            &endpoint,
            "--namespace",
            "ns",
            "--topic",
            "t",
            "--count",
            "1",
            "--timeout-ms",
            "300",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stats_json(&out.stderr)["total"]["delivered"], 0);
}

#[tokio::test]
async fn watch_follows_at_most_max_publishers_and_raises_its_open_file_limit() {
    // Two publishers that refuse connections (following one is redialling it), one
    // allowed; started with a soft limit of 256 open files.
    let (_a, a) = support::refusing_port();
    let (_b, b) = support::refusing_port();
    let (a, b) = (
        format!("tcp://127.0.0.1:{a}"),
        format!("tcp://127.0.0.1:{b}"),
    );
    let watch = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -S -n 256 && exec "$0" "$@""#)
        .arg(example("watch"))
        .args(["--static", &a, &b, "--namespace", "ns", "--topic", "t"])
        .args(["--max-publishers", "1", "--timeout-ms", "1500"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = watch.id().unwrap();
    // Once it runs (the limit is raised before the subscriber starts).
    let limits = within(async {
        loop {
            let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap();
            // Once it runs and has raised its soft limit to the hard one (before
            // the subscriber starts): polled, bounded by the deadline.
            let raised = limits
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .is_some_and(|f| f.get(3) == f.get(4));
            if comm.trim() == "watch" && raised {
                return limits;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        open_files[3], open_files[4],
        "soft limit raised to the hard one: {limits}"
    );
    let out = within(watch.wait_with_output()).await.unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "times out: nothing is delivered"
    );
    let stats = stats_json(&out.stderr);
    // Counted each time discovery offers it.
    assert!(
        stats["refused_publishers"].as_u64().unwrap() >= 1,
        "{stats}"
    );
    assert_eq!(stats["publishers"].as_array().unwrap().len(), 1, "{stats}");
}

#[tokio::test]
async fn the_examples_log_warnings_by_default_and_honour_rust_log() {
    // A publisher that refuses connections: the subscriber warns (rate-limited).
    let (_held, port) = support::refusing_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let args = [
        "--static",
        &endpoint,
        "--namespace",
        "ns",
        "--topic",
        "t",
        "--count",
        "1",
        "--timeout-ms",
        "500",
    ];
    let watch = |rust_log: Option<&'static str>| {
        let mut command = Command::new(example("watch"));
        command.args(args).env_remove("RUST_LOG");
        if let Some(value) = rust_log {
            command.env("RUST_LOG", value);
        }
        async move { within(command.output()).await.unwrap() }
    };
    let stderr = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).into_owned();

    let default = stderr(&watch(None).await);
    assert!(
        default.contains("WARN") && default.contains("publisher connection failed"),
        "{default}"
    );
    let off = stderr(&watch(Some("off")).await);
    assert!(!off.contains("WARN"), "{off}");
    let debug = stderr(&watch(Some("eventplane=debug")).await);
    assert!(debug.contains("DEBUG"), "{debug}");
    let bad = stderr(&watch(Some("eventplane=loud")).await);
    assert!(bad.contains("ignoring RUST_LOG"), "{bad}");
    assert!(bad.contains("WARN"), "the default still applies: {bad}");
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_follows_publishers_registered_in_etcd() {
    use std::sync::Arc;

    use eventplane::discovery::{Discovery, EtcdDiscovery};
    use eventplane::publish::EventPublisher;

    let server = support::etcd::EtcdServer::start().await;
    let discovery: Arc<dyn Discovery> =
        Arc::new(EtcdDiscovery::connect([server.url()]).await.unwrap());
    let publisher = EventPublisher::builder(discovery, "cli", "worker", "kv-events")
        .build()
        .await
        .unwrap();
    let watch = Command::new(example("watch"))
        .args(["--etcd", &server.url(), "--namespace", "cli"])
        .args(["--component", "worker", "--topic", "kv-events"])
        .args(["--count", "5", "--timeout-ms", "20000"])
        .kill_on_drop(true)
        .output();
    let watch = tokio::spawn(watch);
    within(publisher.wait_for_subscribers(1)).await;
    for n in 0..5u8 {
        publisher.publish(vec![n]);
    }
    let out = within(watch).await.unwrap().unwrap();
    let stdout = success_stdout(&out);
    let id = publisher.publisher_id();
    let expected: Vec<String> = (0..5u64)
        .map(|seq| {
            format!(
                "{id} {seq} {} {} {} {:02x}",
                hex::encode(b"kv-events"),
                hex::encode(id.to_be_bytes()),
                hex::encode(seq.to_be_bytes()),
                seq
            )
        })
        .collect();
    assert_eq!(stdout.lines().collect::<Vec<_>>(), expected);
}

#[tokio::test]
async fn kv_relay_publishes_router_events_and_reports_stats() {
    use eventplane::kv::engine::{EngineEvent, encode_engine_batch};
    use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};

    let engine = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let mut relay = Command::new(example("kv-relay"))
        .args([
            "--connect",
            engine.local_endpoint().unwrap(),
            "--topic",
            "kv",
        ])
        .args(["--block-size", "4", "--worker-id", "11"])
        .args(["--bind", "tcp://127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(relay.stdout.take().unwrap()).lines();
    let relay_endpoint = within(lines.next_line()).await.unwrap().unwrap();
    assert!(
        relay_endpoint.starts_with("tcp://127.0.0.1:"),
        "{relay_endpoint}"
    );
    within(engine.wait_for_subscribers(1)).await;
    let mut sub = within(SubSocket::connect(&relay_endpoint, Config::default()))
        .await
        .unwrap();
    sub.subscribe("kv-events").await.unwrap();

    // Until the relay's PUB has our subscription, send clears on a rank the fixtures
    // do not use; they come out as router events we skip.
    const WARM_RANK: u32 = 7;
    let clear = encode_engine_batch(0.0, WARM_RANK, 4, &[EngineEvent::Cleared]).unwrap();
    let mut seq = 0u64;
    let mut received = Vec::new();
    let warm_until = std::time::Instant::now() + support::DEADLINE;
    loop {
        assert!(
            std::time::Instant::now() < warm_until,
            "no warm-up clear came through the relay"
        );
        engine.send(Message::from_parts([
            b"kv".to_vec(),
            seq.to_be_bytes().to_vec(),
            clear.clone(),
        ]));
        seq += 1;
        if let Ok(m) = tokio::time::timeout(std::time::Duration::from_millis(100), sub.recv()).await
        {
            received.push(m.unwrap());
            break;
        }
    }
    let warmups = seq;
    let files = support::kv_fixture_files();
    for f in &files {
        engine.send(Message::from_parts([
            b"kv".to_vec(),
            seq.to_be_bytes().to_vec(),
            std::fs::read(f).unwrap(),
        ]));
        seq += 1;
    }
    let expected = support::expected_router_events(&files, 11, 4);
    let mut got = Vec::new();
    let mut messages = received.into_iter();
    while got.len() < expected.len() {
        let m = match messages.next() {
            Some(m) => m,
            None => within(sub.recv()).await.unwrap(),
        };
        assert_eq!(m.get(0).unwrap(), b"kv-events");
        for ev in Dialect::EventPlane
            .decode_router_events(m.get(3).unwrap())
            .unwrap()
        {
            if ev.event.dp_rank != WARM_RANK {
                got.push(ev);
            }
        }
    }
    // Ids are dense per relay: the warm-up clears took the first ones.
    for (g, e) in got.iter_mut().zip(&expected) {
        g.event.id -= warmups;
        assert_eq!(g, e);
    }
    assert_eq!(got.len(), expected.len());

    let pid = relay.id().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = within(relay.wait_with_output()).await.unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stats = stats_json(&out.stderr);
    assert_eq!(stats["listener"]["decoder"]["batches"], seq, "{stats}");
    assert_eq!(
        stats["processor"]["output_events"],
        warmups + expected.len() as u64,
        "{stats}"
    );
    assert_eq!(stats["publisher"]["dropped"], 0, "{stats}");
}

#[tokio::test]
async fn kv_relay_exits_3_when_it_cannot_bind() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let bind = format!("tcp://{}", taken.local_addr().unwrap());
    let out = run_example("kv-relay", &engine_args(&["--bind", &bind])).await;
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot bind"));
}

/// An engine pipeline's arguments (an engine nobody runs), then `extra`.
fn engine_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--connect",
        "tcp://127.0.0.1:1",
        "--topic",
        "kv",
        "--block-size",
        "4",
        "--worker-id",
        "1",
    ];
    args.extend_from_slice(extra);
    args
}

#[tokio::test]
async fn refused_arguments_exit_2_and_name_the_flag() {
    let engine = engine_args;
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        (
            "kv_listen",
            vec![
                "--connect",
                "127.0.0.1:1",
                "--topic",
                "kv",
                "--block-size",
                "4",
                "--worker-id",
                "1",
            ],
            "invalid --connect",
        ),
        (
            "kv_listen",
            vec![
                "--connect",
                "tcp://127.0.0.1:1",
                "--topic",
                "kv",
                "--block-size",
                "0",
                "--worker-id",
                "1",
            ],
            "invalid --block-size",
        ),
        (
            "kv_listen",
            engine(&["--batch-timeout-ms", "0"]),
            "invalid --batch-timeout-ms",
        ),
        (
            "kv-relay",
            engine(&["--batch-timeout-ms", "60000", "--bind", "tcp://127.0.0.1:0"]),
            "invalid --batch-timeout-ms",
        ),
        (
            "kv-relay",
            engine(&["--bind", "127.0.0.1:0"]),
            "cannot bind",
        ),
        (
            "watch",
            vec![
                "--static",
                "tcp://127.0.0.1:1",
                "--namespace",
                "ns",
                "--topic",
                "t",
                "--max-buffered-bytes",
                "0",
            ],
            "invalid --max-buffered-bytes",
        ),
        (
            "watch",
            vec![
                "--static",
                "127.0.0.1:5",
                "--namespace",
                "ns",
                "--topic",
                "t",
            ],
            "(write tcp://host:port)",
        ),
        (
            "publish",
            vec!["--bind", "tcp://127.0.0.1:99999", "--topic", "t"],
            "invalid --bind tcp://127.0.0.1:99999: invalid endpoint \"tcp://127.0.0.1:99999\": port is above 65535",
        ),
    ];
    for (example, args, says) in cases {
        let out = run_example(example, &args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{example} {args:?}: {stderr}");
        assert!(stderr.contains(says), "{example} {args:?}: {stderr}");
    }
}

#[tokio::test]
async fn subscribe_stops_at_count_within_a_batch_and_merges_several_publishers() {
    use eventplane::zmtp::{Message, PubSocket};
    let a = PubSocket::bind("tcp://127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let b = PubSocket::bind("tcp://127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let run = |endpoints: Vec<String>, count: &'static str| {
        let mut command = Command::new(example("subscribe"));
        for e in &endpoints {
            command.args(["--connect", e]);
        }
        command
            .args(["--count", count, "--timeout-ms", "10000"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    // One socket, read in place: ten messages arrive in one batch, four are printed.
    let one = run(vec![a.local_endpoint().unwrap().to_owned()], "4");
    within(a.wait_for_subscribers(1)).await;
    for i in 0..10u8 {
        a.send(Message::from_parts([vec![b'a'], vec![i]]));
    }
    let out = within(one.wait_with_output()).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["61 00", "61 01", "61 02", "61 03"]
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("received 4 messages, 8 bytes"));

    // Two sockets, one task each: every message of both, in each publisher's order.
    drop(a);
    let a = PubSocket::bind("tcp://127.0.0.1:0", Default::default())
        .await
        .unwrap();
    let endpoints = [a.local_endpoint().unwrap(), b.local_endpoint().unwrap()];
    let two = run(endpoints.iter().map(|e| e.to_string()).collect(), "6");
    within(a.wait_for_subscribers(1)).await;
    within(b.wait_for_subscribers(1)).await;
    for i in 0..3u8 {
        a.send(Message::from_parts([vec![b'a'], vec![i]]));
        b.send(Message::from_parts([vec![b'b'], vec![i]]));
    }
    let out = within(two.wait_with_output()).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{stdout}");
    for topic in ["61", "62"] {
        let mine: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with(topic))
            .collect();
        assert_eq!(mine, [0, 1, 2].map(|i| format!("{topic} 0{i}")), "{stdout}");
    }
}

#[tokio::test]
async fn subscribe_timeout_covers_a_peer_that_never_answers() {
    // Accepts the connection, never sends a greeting.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", silent.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let (conn, _) = silent.accept().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_secs(30)).await;
        drop(conn);
    });
    let out = run_example(
        "subscribe",
        &["--connect", &endpoint, "--timeout-ms", "300"],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Our timeout (exit 1), not the handshake's own 10 s limit (exit 3, "handshake
    // timed out").
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("timed out connecting to"), "{stderr}");
    hold.abort();
}

#[tokio::test]
async fn every_cli_lists_its_exit_codes_and_logging_in_help() {
    for example_name in [
        "subscribe",
        "publish",
        "watch",
        "kv_listen",
        "kv-relay",
        "kv-router",
        #[cfg(feature = "tunnel")]
        "event-broker",
    ] {
        let out = run_example(example_name, &["--help"]).await;
        let help = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{example_name}: {help}");
        assert!(
            help.contains("Exit codes:") && help.contains("RUST_LOG"),
            "{example_name} --help: {help}"
        );
    }
}
