//! Whole processes receiving the same stream: what a user runs, side by side.
//!
//! A loopback writer (`common/blaster.rs`) sends a pre-encoded stream of
//! `[4 B topic, 8 B seq, 100 B payload]` messages to one subscriber process, which
//! exits after [`MESSAGES`] of them. Timed from spawning the process to its exit, so
//! start-up, connect and handshake are included, as a user sees them; criterion's
//! per-message figure is a run's time over its messages (as many runs as its
//! iteration count needs):
//! - `eventplane/subscribe`: the `subscribe` example, `--format quiet --count N`
//!   (build it first: `cargo build --release --example subscribe`; `.ci/run` does);
//! - `eventplane/sub_socket`: a minimal loop on our `SubSocket::recv_many`, in a child
//!   process (this bench binary, re-run) — the socket's own speed as a process;
//! - `zeromq`: the same minimal loop on the zeromq crate's `SubSocket`;
//! - `eventplane/subscribe_before`: another build of `subscribe`, when
//!   `EVENTPLANE_SUBSCRIBE_BEFORE` names it (to compare two versions in one run);
//! - `libzmq`: libzmq's own SUB in C (`benches/libzmq_sub.c`), when
//!   `EVENTPLANE_LIBZMQ_SUB` names the built program (`benches/libzmq_compare.sh`
//!   builds it).
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

#[path = "common/blaster.rs"]
mod blaster;

#[path = "common/watchdog.rs"]
mod watchdog;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blaster::Blaster;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use eventplane::zmtp::{Config, SubSocket};
use zeromq::{Socket, SocketRecv};

const PAYLOAD: usize = 100;
/// Messages per process run.
const MESSAGES: u64 = 1_000_000;
/// Set in a child: `sub_socket ENDPOINT N` or `zeromq ENDPOINT N`.
const CHILD_ENV: &str = "EVENTPLANE_CLI_SUBSCRIBE_CHILD";

/// The `subscribe` example next to this bench's binary (`target/release/examples`).
fn subscribe_example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join("subscribe");
    path.exists().then_some(path)
}

/// Enough runs of `command(MESSAGES)` to cover `iters` messages, each against a fresh
/// writer; the time they took, scaled to `iters` messages.
fn runs(blaster: &Blaster, iters: u64, command: impl Fn(u64) -> Command) -> Duration {
    let n = iters.div_ceil(MESSAGES).max(1);
    let total: Duration = (0..n)
        .map(|_| timed(blaster, MESSAGES, command(MESSAGES)))
        .sum();
    total.mul_f64(iters as f64 / (n * MESSAGES) as f64)
}

/// Runs `command` against a fresh writer of `count` messages; the time from spawn to
/// a successful exit.
fn timed(blaster: &Blaster, count: u64, mut command: Command) -> Duration {
    let server = blaster.serve(count);
    let start = Instant::now();
    let out = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let elapsed = start.elapsed();
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    server.join().unwrap();
    elapsed
}

/// The `subscribe` CLI at `program`, quiet, for `count` messages.
fn cli(program: PathBuf, endpoint: &str) -> impl Fn(u64) -> Command {
    let endpoint = endpoint.to_owned();
    move |count| {
        let mut command = Command::new(&program);
        command.args(["--connect", &endpoint, "--format", "quiet"]);
        command.args(["--count", &count.to_string()]);
        command
    }
}

fn child(kind: &str, endpoint: &str, count: u64) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        match kind {
            "sub_socket" => {
                let mut sub = SubSocket::connect(endpoint, Config::default())
                    .await
                    .unwrap();
                sub.subscribe("").await.unwrap();
                let (mut got, mut batch) = (0u64, Vec::with_capacity(256));
                while got < count {
                    got += sub.recv_many(&mut batch, 256).await.unwrap() as u64;
                    batch.clear();
                }
            }
            "zeromq" => {
                let mut sub = zeromq::SubSocket::new();
                sub.subscribe("").await.unwrap();
                sub.connect(endpoint).await.unwrap();
                for _ in 0..count {
                    std::hint::black_box(sub.recv().await.unwrap());
                }
            }
            other => panic!("unknown child {other}"),
        }
    });
}

fn bench(c: &mut Criterion) {
    let blaster = Blaster::new(PAYLOAD);
    let this = std::env::current_exe().unwrap();
    let in_child = |kind: &'static str| {
        let this = this.clone();
        let endpoint = blaster.endpoint.clone();
        move |count: u64| {
            let mut command = Command::new(&this);
            command.env(CHILD_ENV, format!("{kind} {endpoint} {count}"));
            command
        }
    };
    let mut group = c.benchmark_group(format!("cli_subscribe/{PAYLOAD}B"));
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(5));
    match subscribe_example() {
        Some(program) => {
            let subscribe = cli(program, &blaster.endpoint);
            group.bench_function(BenchmarkId::new("eventplane", "subscribe"), |b| {
                b.iter_custom(|iters| runs(&blaster, iters, &subscribe))
            });
        }
        None => {
            // In test mode (.ci/run) a missing binary is a failure, not a skipped claim.
            assert!(
                !std::env::args().any(|a| a == "--test"),
                "target/release/examples/subscribe is missing: cargo build --release --example subscribe"
            );
            eprintln!(
                "cli_subscribe: target/release/examples/subscribe is missing \
                 (cargo build --release --example subscribe); skipping it"
            )
        }
    }
    if let Ok(program) = std::env::var("EVENTPLANE_SUBSCRIBE_BEFORE") {
        let before = cli(PathBuf::from(program), &blaster.endpoint);
        group.bench_function(BenchmarkId::new("eventplane", "subscribe_before"), |b| {
            b.iter_custom(|iters| runs(&blaster, iters, &before))
        });
    }
    let ours = in_child("sub_socket");
    group.bench_function(BenchmarkId::new("eventplane", "sub_socket"), |b| {
        b.iter_custom(|iters| runs(&blaster, iters, &ours))
    });
    let zeromq = in_child("zeromq");
    group.bench_function("zeromq", |b| {
        b.iter_custom(|iters| runs(&blaster, iters, &zeromq))
    });
    match std::env::var("EVENTPLANE_LIBZMQ_SUB") {
        Ok(program) => {
            let endpoint = blaster.endpoint.clone();
            let libzmq = move |count: u64| {
                let mut command = Command::new(&program);
                command.arg(&endpoint).arg(count.to_string());
                command
            };
            group.bench_function("libzmq", |b| {
                b.iter_custom(|iters| runs(&blaster, iters, &libzmq))
            });
        }
        Err(_) => eprintln!("cli_subscribe: EVENTPLANE_LIBZMQ_SUB not set, skipping libzmq"),
    }
    group.finish();
}

criterion_group!(benches, bench);

/// A child runs before criterion starts, so its start-up is the socket's, not the
/// harness's.
fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let mut parts = spec.split(' ');
        let (kind, endpoint, count) = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap().parse().unwrap(),
        );
        child(kind, endpoint, count);
        return;
    }
    watchdog::arm("cli_subscribe", std::time::Duration::from_secs(2700));
    benches();
    Criterion::default().configure_from_args().final_summary();
}
