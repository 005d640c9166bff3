//! Shared helpers for the integration tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

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

pub fn support_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/support")
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
    use eventplane::kv::{EngineDecoder, Pipeline, WorkerId};
    let mut decoder = EngineDecoder::new(WorkerId(worker), block_size);
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

/// Resident set size of this process, from /proc.
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
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
        require_pyzmq();
        let mut child = Command::new(PYTHON)
            .arg(support_dir().join("zmq_peer.py"))
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

/// Awaits `fut` within [`DEADLINE`].
pub async fn within<F: std::future::Future>(fut: F) -> F::Output {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .expect("test deadline passed")
}
