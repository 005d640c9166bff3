//! Shared helpers for the integration tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

pub mod cases;
pub mod engine_peer;
pub mod etcd;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Debian's `python3-zmq` installs for the system interpreter, which may not be the
/// `python3` first on PATH.
pub const PYTHON: &str = "/usr/bin/python3";

/// Generous bound on anything a test awaits, so a bug fails the test instead of
/// hanging CI. Not a timing assertion.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Event `id` of `worker` storing one block, `hash` (its tokens hash the same), from
/// the root of the device tier, rank 0.
pub fn stored_at_root(worker: u64, id: u64, hash: u64) -> eventplane::kv::RouterEvent {
    use eventplane::kv::{
        BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash,
        WorkerId,
    };
    let block = StoredBlock {
        block_hash: BlockHash(hash),
        tokens_hash: TokensHash(hash),
    };
    RouterEvent {
        worker_id: WorkerId(worker),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: vec![block],
            },
        },
    }
}

/// This folder, from the library's tests and from the benches crate's (which include
/// this module by path from `benches/tests/`).
pub fn support_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let here = manifest.join("tests/support");
    if here.join("mod.rs").exists() {
        here
    } else {
        manifest.join("../tests/support")
    }
}

/// A ZMTP greeting with the given version and mechanism, as a peer would send it.
pub fn greeting(major: u8, minor: u8, mechanism: &[u8]) -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = major;
    g[11] = minor;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g
}

/// The three engine-batch fixtures (vLLM ≤ 0.23 arrays, vLLM ≥ 0.24 maps, SGLang), as
/// paths, in the order the tests publish them.
pub fn kv_fixture_files() -> Vec<String> {
    ["vllm_v023.msgpack", "vllm_v024.msgpack", "sglang.msgpack"]
        .iter()
        .map(|f| format!("{}/tests/fixtures/{f}", env!("CARGO_MANIFEST_DIR")))
        .collect()
}

/// The router events the sans-IO decoder and pipeline make of these engine batch
/// files, one list per file (what any transport path must reproduce exactly).
pub fn expected_router_events(
    files: &[String],
    worker: u64,
    block_size: usize,
) -> Vec<eventplane::kv::RouterEvent> {
    use eventplane::kv::{WorkerId, engine::EngineDecoder, pipeline::Pipeline};
    let mut decoder = EngineDecoder::new(WorkerId(worker), block_size).unwrap();
    let mut pipeline = Pipeline::default();
    let mut expected = Vec::new();
    for f in files {
        for ev in decoder.decode_batch(&std::fs::read(f).unwrap()).unwrap() {
            pipeline.push(ev, &mut expected);
        }
        pipeline.flush(&mut expected);
    }
    expected
}

/// The services of `services/` (`cargo build -p eventplane-services`).
pub const SERVICES: [&str; 3] = ["event-broker", "kv-relay", "kv-router"];

/// A built example binary, or one of the [`SERVICES`]: `cargo test` builds every
/// example next to the test binaries (target/<profile>/examples/<name>) and, with the
/// workspace's default members, the services (target/<profile>/<name>: the services
/// crate's own tests need them). `EVENTPLANE_EXAMPLES_DIR` and
/// `EVENTPLANE_SERVICES_DIR` point the tests at another build (to check that a test
/// fails on an older revision).
pub fn example(name: &str) -> PathBuf {
    let service = SERVICES.contains(&name);
    let var = if service {
        "EVENTPLANE_SERVICES_DIR"
    } else {
        "EVENTPLANE_EXAMPLES_DIR"
    };
    let dir = match std::env::var_os(var) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().unwrap();
            let profile = exe.parent().unwrap().parent().unwrap();
            if service {
                profile.to_path_buf()
            } else {
                profile.join("examples")
            }
        }
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built ({})",
        path.display(),
        if service {
            "cargo build -p eventplane-services; cargo test builds it"
        } else {
            "cargo test builds examples"
        }
    );
    path
}

/// A field of /proc/<pid>/status in bytes (`VmRSS`, `VmHWM`, …).
pub fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Resets the peak RSS (VmHWM) of `pid` to its RSS now (Linux: `5` written to
/// /proc/PID/clear_refs) and returns that RSS in bytes: `VmHWM` read later minus this
/// is what the process grew to since, whatever its start-up peaked at.
pub fn reset_peak_rss(pid: u32) -> u64 {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
        .unwrap_or_else(|e| panic!("cannot reset the peak RSS of {pid}: {e}"));
    proc_status_bytes(pid, "VmRSS")
}

/// ZMTP 3.1 frames a raw test peer writes.
pub mod wire {
    /// `READY` with `Socket-Type` = `socket_type` (3 letters).
    pub fn ready(socket_type: &str) -> Vec<u8> {
        let mut body = b"\x05READY\x0bSocket-Type\x00\x00\x00".to_vec();
        body.push(socket_type.len() as u8);
        body.extend_from_slice(socket_type.as_bytes());
        command(&body)
    }

    /// A command frame around `body` (`name-len name data`).
    pub fn command(body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len() + 9);
        if body.len() > 255 {
            out.push(0x06);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(0x04);
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        out
    }

    /// `SUBSCRIBE prefix`.
    pub fn subscribe(prefix: &[u8]) -> Vec<u8> {
        let mut body = b"\x09SUBSCRIBE".to_vec();
        body.extend_from_slice(prefix);
        command(&body)
    }

    /// `PING` with TTL 0 and `context`.
    pub fn ping(context: &[u8]) -> Vec<u8> {
        let mut body = b"\x04PING\x00\x00".to_vec();
        body.extend_from_slice(context);
        command(&body)
    }

    /// One message frame; `more` sets MORE.
    pub fn frame(body: &[u8], more: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len() + 9);
        let more = u8::from(more);
        if body.len() > 255 {
            out.push(0x02 | more);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        out
    }

    /// The greeting and READY of a ZMTP 3.1 peer of `socket_type`.
    pub fn hello(socket_type: &str) -> Vec<u8> {
        let mut out = super::greeting(3, 1, b"NULL");
        out.extend_from_slice(&ready(socket_type));
        out
    }
}

/// The environment of a child process whose memory a test measures: glibc's mmap
/// threshold fixed at 128 KiB (its default's starting value; setting it turns off
/// glibc's raising it up to 32 MiB after large frees). A freed large buffer then goes
/// back to the system at once, so the peak RSS shows what the process held at its
/// peak, not what the allocator kept in its arenas for reuse.
pub const FIXED_MMAP_THRESHOLD: (&str, &str) = ("MALLOC_MMAP_THRESHOLD_", "131072");

/// How much a measured child may grow past the budgets in play: the runtime's and
/// allocator's working set in a debug build (the tests' own excess over budget: 0.1-0.9 MiB).
pub const RSS_SLACK: u64 = 2 << 20;

/// Starts example `name` with piped stdout and stderr (and
/// [`FIXED_MMAP_THRESHOLD`]); with `first_line`, also reads and returns the first
/// line it prints (an endpoint, usually).
pub async fn spawn_example<S: AsRef<std::ffi::OsStr>>(
    name: &str,
    args: &[S],
    first_line: bool,
) -> (Child, Option<String>) {
    let mut child = Command::new(example(name))
        .args(args)
        .env(FIXED_MMAP_THRESHOLD.0, FIXED_MMAP_THRESHOLD.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let line = if first_line {
        let mut reader = BufReader::new(child.stdout.as_mut().unwrap());
        let mut line = String::new();
        within(reader.read_line(&mut line)).await.unwrap();
        Some(line.trim().to_owned())
    } else {
        None
    };
    (child, line)
}

/// Stops an example with SIGTERM and returns the JSON stats it prints as the last line
/// of its stderr.
pub async fn terminate_for_stats(child: tokio::process::Child) -> serde_json::Value {
    let pid = child.id().unwrap();
    let killed = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    let out = within(child.wait_with_output()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    serde_json::from_str(stderr.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("no stats line ({e}): {stderr}"))
}

/// A loopback port that refuses connections for as long as the returned socket lives:
/// bound (so no other process can take it) but not listening.
pub fn refusing_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(([127, 0, 0, 1], 0).into()).unwrap();
    let port = socket.local_addr().unwrap().port();
    (socket, port)
}

/// Panics with a clear message unless the system Python can import `zmq`.
pub fn require_pyzmq() {
    let ok = std::process::Command::new(PYTHON)
        .args(["-c", "import zmq"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{PYTHON} cannot import zmq: install Debian's python3-zmq (.ci/run does)"
    );
}

/// A Python libzmq peer driven over stdin/stdout lines.
pub struct PyPeer {
    pub child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl PyPeer {
    pub fn spawn(args: &[&str]) -> PyPeer {
        PyPeer::script(support_dir().join("zmq_peer.py"), args)
    }

    /// Runs `script` with Debian's Python (pyzmq, msgpack), stdin and stdout piped.
    pub fn script(script: PathBuf, args: &[&str]) -> PyPeer {
        require_pyzmq();
        PyPeer::with_python(std::path::Path::new(PYTHON), script, args)
    }

    /// Runs `script` with `python`, stdin and stdout piped.
    pub fn with_python(python: &std::path::Path, script: PathBuf, args: &[&str]) -> PyPeer {
        let mut child = Command::new(python)
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        PyPeer {
            child,
            stdin,
            lines,
        }
    }

    /// The next stdout line.
    pub async fn line(&mut self) -> String {
        tokio::time::timeout(DEADLINE, self.lines.next_line())
            .await
            .expect("python peer silent")
            .unwrap()
            .expect("python peer exited")
    }

    pub async fn send_line(&mut self, line: &str) {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
    }

    pub async fn wait(mut self) -> std::process::ExitStatus {
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .expect("python peer did not exit")
            .unwrap()
    }
}

/// The engine users copy, `examples/engine.py` (pyzmq + msgpack), as a child process:
/// a real libzmq PUB sending vLLM-shaped KV batches, driven line by line.
pub struct EnginePy {
    peer: PyPeer,
    /// The endpoint it bound (`tcp://127.0.0.1:PORT`).
    pub endpoint: String,
}

impl EnginePy {
    /// Binds `bind` (port 0 for any) and, unless `--no-wait` is among `extra`, waits
    /// for a subscriber before it takes commands.
    pub async fn spawn(bind: &str, extra: &[&str]) -> EnginePy {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/engine.py");
        let args: Vec<&str> = ["--bind", bind].iter().chain(extra).copied().collect();
        let mut peer = PyPeer::script(script, &args);
        let bound = peer.line().await;
        let endpoint = bound
            .strip_prefix("bound ")
            .unwrap_or_else(|| panic!("engine.py said {bound:?}"))
            .to_owned();
        EnginePy { peer, endpoint }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.peer.child.id().unwrap()
    }

    /// The port it bound.
    pub fn port(&self) -> u16 {
        self.endpoint.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Sends one command (`store 1 2`, `remove 1`, `clear`, `skip`, or a JSON list of
    /// events) and returns the sequence number it used, once done.
    pub async fn send(&mut self, command: &str) -> u64 {
        self.peer.send_line(command).await;
        let ok = self.peer.line().await;
        ok.strip_prefix("ok ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("engine.py answered {ok:?} to {command:?}"))
    }

    /// Kills it at once (SIGKILL), as an engine crash.
    pub async fn kill(mut self) {
        self.peer.child.kill().await.unwrap();
    }
}

/// An example program as a child, its stdout read line by line and its stderr lines
/// handed over as they come.
pub struct Watched {
    pub child: Child,
    out: Lines<BufReader<ChildStdout>>,
    err: tokio::sync::mpsc::Receiver<String>,
}

impl Watched {
    pub fn spawn(name: &str, args: &[&str]) -> Watched {
        let mut child = Command::new(example(name))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        let (tx, err) = tokio::sync::mpsc::channel(256);
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        // EVENTPLANE_TEST_ECHO_STDERR=1 echoes the process's stderr (debugging a test).
        let echo = std::env::var_os("EVENTPLANE_TEST_ECHO_STDERR").is_some();
        let who = name.to_owned();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if echo {
                    eprintln!("[{who}] {line}");
                }
                if tx.send(line).await.is_err() {
                    break;
                }
            }
        });
        Watched { child, out, err }
    }

    /// The next stdout line.
    pub async fn line(&mut self) -> String {
        within(self.out.next_line())
            .await
            .unwrap()
            .expect("the process exited")
    }

    /// Reads stderr until a line contains `text`; returns it.
    pub async fn stderr_until(&mut self, text: &str) -> String {
        within(async {
            loop {
                let line = self.err.recv().await.expect("stderr closed");
                if line.contains(text) {
                    return line;
                }
            }
        })
        .await
    }

    /// SIGTERM, then [`exit_stats`](Self::exit_stats), asserting exit 0.
    pub async fn terminate(self) -> serde_json::Value {
        let pid = self.child.id().unwrap();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let (status, stats) = self.exit_stats().await;
        assert_eq!(status.code(), Some(0), "{stats}");
        stats
    }

    /// Waits for the exit; its status and its last stderr line as JSON (the stats the
    /// examples print).
    pub async fn exit_stats(mut self) -> (std::process::ExitStatus, serde_json::Value) {
        let status = within(self.child.wait()).await.unwrap();
        let mut last = String::new();
        while let Some(line) = within(self.err.recv()).await {
            last = line;
        }
        let stats =
            serde_json::from_str(&last).unwrap_or_else(|e| panic!("no stats line ({e}): {last}"));
        (status, stats)
    }
}

/// `kv_relay` for worker `worker_id` in front of the engine at `engine` (topic `topic`,
/// block size 4), publishing `wire`, registered in etcd at `etcd` under
/// `namespace/component`; returns once it printed its endpoint.
pub async fn spawn_kv_relay(
    engine: &str,
    topic: &str,
    worker_id: u64,
    wire: &str,
    etcd: &str,
    namespace: &str,
    component: &str,
) -> (Child, String) {
    let worker = worker_id.to_string();
    let (relay, endpoint) = spawn_example(
        "kv-relay",
        &[
            "--connect",
            engine,
            "--topic",
            topic,
            "--block-size",
            "4",
            "--worker-id",
            &worker,
            "--bind",
            "tcp://127.0.0.1:0",
            "--wire",
            wire,
            "--etcd",
            etcd,
            "--namespace",
            namespace,
            "--component",
            component,
        ],
        true,
    )
    .await;
    (relay, endpoint.unwrap())
}

/// `tcp://127.0.0.1:PORT` with a free port below the kernel's ephemeral range, for a
/// publisher that a test restarts on the same endpoint. An OS-assigned (ephemeral)
/// port does not do: a subscriber redialling it meanwhile may be given that very port
/// as its own local port and connect to itself, and the restarted publisher's bind then
/// fails with "address in use".
pub fn restartable_endpoint() -> String {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let start = 10_000u16.min(low.saturating_sub(1));
    let span = low.saturating_sub(start).max(1);
    // Spread over the range: by process (test binaries run at once) and by call
    // (tests of one binary run at once), then a scan.
    static CALLS: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let call = CALLS.fetch_add(97, std::sync::atomic::Ordering::Relaxed);
    let first = (std::process::id() as u16)
        .wrapping_mul(31)
        .wrapping_add(call)
        % span;
    for i in 0..span {
        let port = start + (first + i) % span;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return format!("tcp://127.0.0.1:{port}");
        }
    }
    panic!("no free port below the ephemeral range ({low})");
}

/// Awaits `fut` within [`DEADLINE`].
pub async fn within<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .expect("test deadline passed")
}

/// How late a deadline may fire in a deadline test: scheduling on a loaded 2-core CI
/// machine, not a tolerance of the component.
pub const DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// Awaits `fut` (within [`DEADLINE`]) and returns its output and how long it took.
pub async fn timed<F: std::future::Future>(fut: F) -> (F::Output, Duration) {
    let start = std::time::Instant::now();
    let output = within(fut).await;
    (output, start.elapsed())
}

/// How late a deadline may fire in [`assert_fired_at`], beyond its half: scheduling on
/// a loaded 2-core CI machine.
pub const FIRED_LATE_BY: Duration = Duration::from_millis(300);

/// Asserts that `what`, set to `deadline`, fired after `elapsed`: not before 0.9 ×
/// `deadline` (it did wait) and not after 1.5 × `deadline` + [`FIRED_LATE_BY`] (it was
/// this deadline: one of 300 ms or more applied three times over, a default or another
/// timer fails). Set `deadline` well under the default, so a component
/// that ignores its setting fails.
#[track_caller]
pub fn assert_fired_at(what: &str, elapsed: Duration, deadline: Duration) {
    let (earliest, latest) = (deadline.mul_f64(0.9), deadline.mul_f64(1.5) + FIRED_LATE_BY);
    assert!(
        elapsed >= earliest && elapsed <= latest,
        "{what}: fired after {elapsed:?}, set to {deadline:?} (allowed {earliest:?}..={latest:?})",
    );
}

/// The dp rank of warm-up clears: a rank the fixtures never use, so the router events
/// they become are easy to skip.
pub const WARM_RANK: u32 = 7;

/// A test engine: a PUB sending `[topic, seq u64be, batch]` with consecutive sequences,
/// as vLLM does.
pub struct Engine {
    pub socket: eventplane::zmtp::PubSocket,
    topic: Vec<u8>,
    seq: u64,
}

impl Engine {
    pub async fn bind(topic: &str) -> Engine {
        Engine::bind_at("tcp://127.0.0.1:0", topic).await
    }

    /// An engine on `endpoint` (a relay may be dialling it already).
    pub async fn bind_at(endpoint: &str, topic: &str) -> Engine {
        let socket =
            eventplane::zmtp::PubSocket::bind(endpoint, eventplane::zmtp::Config::default())
                .await
                .unwrap();
        Engine {
            socket,
            topic: topic.as_bytes().to_vec(),
            seq: 0,
        }
    }

    pub fn endpoint(&self) -> String {
        self.socket.local_endpoint().unwrap().to_owned()
    }

    /// Sends one engine batch (msgpack) with the next sequence number.
    pub fn send(&mut self, batch: Vec<u8>) {
        self.socket.send(eventplane::zmtp::Message::from_parts([
            self.topic.clone(),
            self.seq.to_be_bytes().to_vec(),
            batch,
        ]));
        self.seq += 1;
    }

    /// Batches sent so far.
    pub fn sent(&self) -> u64 {
        self.seq
    }

    /// Sends clears on [`WARM_RANK`] until `line` (waiting at most the given time)
    /// yields what came through at the far end; returns that. PUB/SUB drops what is sent
    /// before a subscription arrives, so a test's real data goes only after this.
    pub async fn warm_up(
        &mut self,
        mut line: impl AsyncFnMut(Duration) -> Option<String>,
    ) -> String {
        use eventplane::kv::engine::{EngineEvent, encode_engine_batch};
        let clear = encode_engine_batch(0.0, WARM_RANK, 4, &[EngineEvent::Cleared]).unwrap();
        let until = tokio::time::Instant::now() + DEADLINE;
        loop {
            assert!(
                tokio::time::Instant::now() < until,
                "no warm-up clear came through"
            );
            self.send(clear.clone());
            if let Some(l) = line(Duration::from_millis(100)).await {
                return l;
            }
        }
    }
}

/// What a live Dynamo 1.6.1 worker wrote (`tests/fixtures/dynamo-1.6.1-capture.json`).
pub fn dynamo_capture() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/dynamo-1.6.1-capture.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
};

/// The router events the capture's `decoded` section lists for one frame, built from
/// the JSON by hand (not by our decoder).
pub fn dynamo_decoded_events(decoded: &serde_json::Value) -> Vec<RouterEvent> {
    let u = |v: &serde_json::Value| v.as_u64().unwrap();
    decoded["payload"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let tier = match e["storage_tier"].as_str().unwrap() {
                "device" => StorageTier::Device,
                "host_pinned" => StorageTier::HostPinned,
                other => panic!("tier {other} not in the capture"),
            };
            assert_eq!(e["residency_domain"], "worker");
            let ev = &e["event"];
            let data = &ev["data"];
            let data = if data == "cleared" {
                KvEventData::Cleared
            } else if let Some(s) = data.get("stored") {
                assert!(s["start_position"].is_null());
                KvEventData::Stored {
                    parent_hash: s["parent_hash"].as_u64().map(BlockHash),
                    blocks: s["blocks"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| {
                            assert!(b["mm_extra_info"].is_null());
                            StoredBlock {
                                block_hash: BlockHash(u(&b["block_hash"])),
                                tokens_hash: TokensHash(u(&b["tokens_hash"])),
                            }
                        })
                        .collect(),
                }
            } else {
                KvEventData::Removed {
                    block_hashes: data["removed"]["block_hashes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| BlockHash(u(h)))
                        .collect(),
                }
            };
            RouterEvent {
                worker_id: WorkerId(u(&e["worker_id"])),
                tier,
                event: KvEvent {
                    id: u(&ev["event_id"]),
                    dp_rank: u32::try_from(u(&ev["dp_rank"])).unwrap(),
                    data,
                },
            }
        })
        .collect()
}

/// Every router event of the capture's frames, in order, from its hand-written
/// `decoded` section (the oracle for end-to-end tests: not our decoder's view).
pub fn dynamo_capture_events(capture: &serde_json::Value) -> Vec<RouterEvent> {
    capture["decoded"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(dynamo_decoded_events)
        .collect()
}

/// An `EventSink` that keeps every router event it is given.
#[derive(Default)]
pub struct CollectSink(pub std::sync::Mutex<Vec<eventplane::kv::RouterEvent>>);

impl eventplane::kv::pipeline::EventSink for CollectSink {
    fn publish<'a>(
        &'a self,
        events: &'a [eventplane::kv::RouterEvent],
    ) -> eventplane::BoxFuture<'a, Result<(), eventplane::kv::pipeline::SinkError>> {
        self.0.lock().unwrap().extend_from_slice(events);
        Box::pin(async { Ok(()) })
    }
}

/// Talking to a service's admin endpoint (`--admin-listen`).
pub mod admin {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, Lines};
    use tokio::process::ChildStderr;

    use super::within;

    /// Waits until `metric` on the admin endpoint at `addr` reaches `at_least`.
    pub async fn until_metric(addr: &str, metric: &str, at_least: f64) {
        within(async {
            loop {
                let (_, body) = get(addr, "/metrics").await;
                if self::metric(&body, metric).is_some_and(|v| v >= at_least) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }

    /// One `GET path` on an admin endpoint: its status and body (status 0 when the
    /// connection failed or was closed without an answer: a full endpoint's refusal).
    pub async fn get(addr: &str, path: &str) -> (u16, String) {
        let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
            return (0, String::new());
        };
        let request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n");
        if s.write_all(request.as_bytes()).await.is_err() {
            return (0, String::new());
        }
        let mut out = Vec::new();
        if s.read_to_end(&mut out).await.is_err() {
            return (0, String::new());
        }
        let out = String::from_utf8_lossy(&out);
        let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
        (status, body.unwrap_or_default())
    }

    /// The sum of every series of `name` in a Prometheus text exposition.
    pub fn metric(text: &str, name: &str) -> Option<f64> {
        let values: Vec<f64> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }

    /// The address a service says its admin endpoint is on (its stderr).
    pub async fn admin_address(lines: &mut Lines<BufReader<ChildStderr>>) -> String {
        within(async {
            loop {
                let line = lines.next_line().await.unwrap().unwrap();
                if let Some(addr) = line.strip_prefix("admin endpoint on http://") {
                    return addr.to_owned();
                }
            }
        })
        .await
    }

    /// Polls `GET path` every 20 ms until `done(status, body)`; fails with the last
    /// answer after the test deadline.
    pub async fn until(addr: &str, path: &str, mut done: impl FnMut(u16, &str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + super::DEADLINE;
        loop {
            let (status, body) = get(addr, path).await;
            if done(status, &body) {
                return body;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "GET {path}: never there; last {status}: {body}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The Python of the virtualenv `.ci/run` makes (`target/dynamo-venv`: NVIDIA Dynamo
/// 1.6.1, PyPI `ai-dynamo-runtime==1.6.1`, with `pyzmq` and `msgpack`), or
/// `EVENTPLANE_DYNAMO_PYTHON`; fails, saying how to make it, when it cannot import
/// Dynamo.
pub fn dynamo_python() -> std::path::PathBuf {
    let path = std::env::var_os("EVENTPLANE_DYNAMO_PYTHON").map_or_else(
        || {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("target/dynamo-venv/bin/python")
        },
        std::path::PathBuf::from,
    );
    let ok = std::process::Command::new(&path)
        .args(["-c", "import dynamo._core, zmq, msgpack"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import Dynamo: run .ci/run, or `python3 -m venv target/dynamo-venv && \
         target/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1 pyzmq msgpack`",
        path.display()
    );
    path
}
