//! Publish fan-out: our `PubSocket` vs the zeromq crate's `PubSocket` and libzmq's own
//! PUB (`benches/libzmq_pub.c`, when `EVENTPLANE_LIBZMQ_PUB` names it), delivering
//! `[4 B topic, 8 B seq, 100 B payload]` messages to 1, 8, 64 and 256 subscribers
//! over loopback (`EVENTPLANE_PUB_SUBSCRIBERS=1,8` picks others).
//!
//! The subscribers are identical for both publishers: a thread each that performs a
//! minimal ZMTP 3.0 handshake, subscribes to everything and counts bytes, so the
//! measurement is the publisher's. Both publishers drop for a full subscriber queue
//! instead of blocking, so the sender keeps at most `WINDOW` messages in flight per
//! subscriber (well below either queue's capacity): "subscribers keep up". Time runs
//! until every subscriber has received every message. Zero drops on both sides is a
//! precondition the bench asserts (ours from `PubStats`, zeromq's as sent − received),
//! not a measurement of loss.
//!
//! The publisher runs on a current-thread runtime (one core); the subscriber threads
//! share the other. Besides criterion's wall-clock rate, the bench prints the
//! publisher's own CPU time per message (`zmtp_pub: … ns per message` lines): on two
//! cores, with N subscriber threads reading, the wall clock also pays for the readers,
//! while the publisher's CPU time is what fanning out costs it. The sender sleeps on a `Notify` while its window is full, so it
//! never competes with them for CPU. libzmq's PUB runs in a process of its own (its
//! application thread and its I/O thread), sending without loss (`XPUB_NODROP`: it
//! waits for room instead of dropping) as many messages as each iteration asks for.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

#[path = "common/procfs.rs"]
mod procfs;
#[path = "common/watchdog.rs"]
mod watchdog;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::{Duration, Instant};
use tokio::sync::Notify;

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use eventplane::zmtp::codec::{encode_greeting, encoded_len};
use eventplane::zmtp::{Config, Message, PubSocket};
use zeromq::{Socket, SocketSend, ZmqMessage};

const WINDOW: u64 = 4096;

/// A wait that a drop (a message that never arrives) would make endless fails instead.
async fn within<F: std::future::Future>(wait: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("a subscriber stopped receiving: the publisher dropped or stalled")
}
const BATCH: u64 = 256;

fn message() -> Message {
    Message::from_parts([
        Bytes::from_static(b"kvev"),
        Bytes::copy_from_slice(&7u64.to_be_bytes()),
        Bytes::from(vec![0xab; 100]),
    ])
}

/// A byte-counting subscriber thread; `received` counts whole messages, and every read
/// wakes the sender through `progress`.
fn spawn_counter(endpoint: &str, msg_len: u64, progress: Arc<Notify>) -> Arc<AtomicU64> {
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let endpoint = endpoint[6..].to_owned();
    // Connected from the thread: the publisher's accept loop runs on the runtime that
    // calls this, and must go on accepting while hundreds connect.
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(&endpoint).unwrap();
        s.set_nodelay(true).unwrap();
        let mut hello = BytesMut::new();
        encode_greeting(&mut hello);
        hello[11] = 0; // ZMTP 3.0: no commands but READY, as zeromq-rs requires
        hello.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB");
        s.write_all(&hello).unwrap();
        // Skip the peer's greeting and READY.
        let mut greeting = [0u8; 64];
        s.read_exact(&mut greeting).unwrap();
        let mut header = [0u8; 2];
        s.read_exact(&mut header).unwrap();
        let mut ready = vec![0u8; header[1] as usize];
        s.read_exact(&mut ready).unwrap();
        // Subscribe to everything, once the handshake is done (libzmq takes a message
        // that arrives before it sent its own READY for a malformed command).
        s.write_all(b"\x00\x01\x01").unwrap();
        let mut buf = vec![0u8; 256 << 10];
        let mut bytes = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    bytes += n as u64;
                    counter.store(bytes / msg_len, Ordering::Release);
                    progress.notify_waiters();
                }
            }
        }
    });
    received
}

/// The subscribers' counters, each relative to its own baseline (subscribers that
/// joined at different times saw different numbers of probe messages).
struct Counters {
    counters: Vec<Arc<AtomicU64>>,
    baselines: Vec<u64>,
    progress: Arc<Notify>,
}

impl Counters {
    fn connect(endpoint: &str, subscribers: usize, msg_len: u64) -> Counters {
        let progress = Arc::new(Notify::new());
        let counters = (0..subscribers)
            .map(|_| spawn_counter(endpoint, msg_len, progress.clone()))
            .collect();
        Counters {
            counters,
            baselines: vec![0; subscribers],
            progress,
        }
    }

    /// Messages the slowest subscriber received since its baseline.
    fn min_received(&self) -> u64 {
        self.counters
            .iter()
            .zip(&self.baselines)
            .map(|(c, b)| c.load(Ordering::Acquire) - b)
            .min()
            .unwrap_or(0)
    }

    fn rebase(&mut self) {
        for (c, b) in self.counters.iter().zip(&mut self.baselines) {
            *b = c.load(Ordering::Acquire);
        }
    }

    async fn wait_until(&self, target: u64) {
        loop {
            let progress = self.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            if self.min_received() >= target {
                return;
            }
            progress.await;
        }
    }
}

/// The publisher's CPU time over the messages it sent: the thread that runs ours and
/// the zeromq crate's (the subscriber threads excluded), libzmq's whole process (its
/// application and I/O threads; 10 ms clock ticks).
#[derive(Default)]
struct Cpu {
    messages: u64,
    time: Duration,
}

impl Cpu {
    fn add(&mut self, messages: u64, time: Duration) {
        self.messages += messages;
        self.time += time;
    }

    fn line(&self, who: &str, subs: usize) -> String {
        let per_message = self.time.as_nanos() as f64 / self.messages.max(1) as f64;
        format!(
            "{who}, {subs} subscriber(s): publisher CPU {:.3} s over {} messages: \
             {per_message:.1} ns per message",
            self.time.as_secs_f64(),
            self.messages
        )
    }
}

struct Ours {
    socket: PubSocket,
    counters: Counters,
    sent: u64,
}

struct Theirs {
    socket: zeromq::PubSocket,
    counters: Counters,
    sent: u64,
}

/// libzmq's PUB in its own process, told how many to send through its stdin.
struct Libzmq {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    counters: Counters,
    sent: u64,
}

impl Libzmq {
    fn start(program: &str, subs: usize, msg_len: u64) -> Libzmq {
        let mut child = Command::new(program)
            .arg(subs.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the libzmq publisher");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let endpoint = Self::line(&mut stdout);
        let counters = Counters::connect(&endpoint, subs, msg_len);
        assert_eq!(Self::line(&mut stdout), "ready");
        Libzmq {
            child,
            stdin,
            stdout,
            counters,
            sent: 0,
        }
    }

    fn line(stdout: &mut BufReader<ChildStdout>) -> String {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    fn send(&mut self, n: u64) {
        writeln!(self.stdin, "{n}").unwrap();
        self.stdin.flush().unwrap();
        self.sent += n;
    }
}

impl Drop for Libzmq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The subscriber counts to measure: `EVENTPLANE_PUB_SUBSCRIBERS` (comma-separated)
/// or 1, 8, 64 and 256.
fn subscriber_counts() -> Vec<usize> {
    std::env::var("EVENTPLANE_PUB_SUBSCRIBERS").map_or_else(
        |_| vec![1, 8, 64, 256],
        |v| v.split(',').map(|n| n.trim().parse().unwrap()).collect(),
    )
}

fn bench(c: &mut Criterion) {
    watchdog::arm("zmtp_pub", std::time::Duration::from_secs(2700));
    // 256 subscribers are two descriptors each in this process.
    procfs::raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let msg = message();
    let msg_len = encoded_len(&msg) as u64;
    let mut group = c.benchmark_group("zmtp_pub/100B");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    let mut report = Vec::new();
    let libzmq = std::env::var("EVENTPLANE_LIBZMQ_PUB").ok();
    if libzmq.is_none() {
        eprintln!("zmtp_pub: EVENTPLANE_LIBZMQ_PUB not set, skipping libzmq's PUB");
    }
    for subs in subscriber_counts() {
        // Ours.
        let mut ours = rt.block_on(async {
            let socket = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
                .await
                .unwrap();
            let ep = socket.local_endpoint().unwrap().to_owned();
            let counters = Counters::connect(&ep, subs, msg_len);
            socket.wait_for_subscribers(subs).await;
            Ours {
                socket,
                counters,
                sent: 0,
            }
        });
        let mut cpu = Cpu::default();
        group.bench_function(BenchmarkId::new("eventplane", subs), |b| {
            b.iter_custom(|iters| {
                let thread = procfs::thread_cpu();
                let elapsed = rt.block_on(async {
                    let start = Instant::now();
                    let end = ours.sent + iters;
                    while ours.sent < end {
                        let n = BATCH.min(end - ours.sent);
                        for _ in 0..n {
                            ours.socket.send(msg.clone());
                        }
                        ours.sent += n;
                        within(ours.counters.wait_until(ours.sent.saturating_sub(WINDOW))).await;
                    }
                    within(ours.counters.wait_until(end)).await;
                    start.elapsed()
                });
                cpu.add(iters, procfs::thread_cpu() - thread);
                elapsed
            })
        });
        report.push(cpu.line("eventplane", subs));
        report.push(format!(
            "eventplane, {subs} subscriber(s): sent {}, dropped {}",
            ours.sent,
            ours.socket.stats().dropped
        ));
        // A precondition of the comparison, not a measured loss rate: the window keeps
        // both publishers below their queues' capacity (zeromq's side asserts it too).
        assert_eq!(ours.socket.stats().dropped, 0, "our publisher dropped");

        // The zeromq crate.
        let mut theirs = rt.block_on(async {
            let mut socket = zeromq::PubSocket::new();
            let ep = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let mut counters = Counters::connect(&ep, subs, msg_len);
            // zeromq-rs has no subscriber count to await: probe until all receive,
            // let the last probes land, then count from there.
            let probe = ZmqMessage::try_from(msg.clone().into_parts().collect::<Vec<_>>()).unwrap();
            while counters.min_received() == 0 {
                socket.send(probe.clone()).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            counters.rebase();
            Theirs {
                socket,
                counters,
                sent: 0,
            }
        });
        let zmsg = ZmqMessage::try_from(msg.clone().into_parts().collect::<Vec<_>>()).unwrap();
        let mut cpu = Cpu::default();
        group.bench_function(BenchmarkId::new("zeromq", subs), |b| {
            b.iter_custom(|iters| {
                let thread = procfs::thread_cpu();
                let elapsed = rt.block_on(async {
                    let start = Instant::now();
                    let end = theirs.sent + iters;
                    while theirs.sent < end {
                        let n = BATCH.min(end - theirs.sent);
                        for _ in 0..n {
                            theirs.socket.send(zmsg.clone()).await.unwrap();
                        }
                        theirs.sent += n;
                        within(
                            theirs
                                .counters
                                .wait_until(theirs.sent.saturating_sub(WINDOW)),
                        )
                        .await;
                    }
                    // A drop would stall here forever: bound the wait and report it.
                    let done = tokio::time::timeout(
                        Duration::from_secs(10),
                        theirs.counters.wait_until(end),
                    )
                    .await;
                    assert!(done.is_ok(), "zeromq dropped messages");
                    start.elapsed()
                });
                cpu.add(iters, procfs::thread_cpu() - thread);
                elapsed
            })
        });
        report.push(cpu.line("zeromq", subs));
        report.push(format!(
            "zeromq, {subs} subscriber(s): sent {}, received (min) {}",
            theirs.sent,
            theirs.counters.min_received()
        ));
        drop(ours);
        drop(theirs);

        // libzmq's own PUB, in its process.
        let Some(program) = &libzmq else { continue };
        let mut zmq = Libzmq::start(program, subs, msg_len);
        let mut cpu = Cpu::default();
        group.bench_function(BenchmarkId::new("libzmq", subs), |b| {
            b.iter_custom(|iters| {
                let process = procfs::cpu_time(zmq.child.id());
                let elapsed = rt.block_on(async {
                    let start = Instant::now();
                    zmq.send(iters);
                    within(zmq.counters.wait_until(zmq.sent)).await;
                    let elapsed = start.elapsed();
                    assert_eq!(Libzmq::line(&mut zmq.stdout), "sent");
                    elapsed
                });
                cpu.add(iters, procfs::cpu_time(zmq.child.id()) - process);
                elapsed
            })
        });
        report.push(cpu.line("libzmq", subs));
        report.push(format!(
            "libzmq, {subs} subscriber(s): sent {}, received (min) {}",
            zmq.sent,
            zmq.counters.min_received()
        ));
    }
    group.finish();
    for line in report {
        eprintln!("zmtp_pub: {line}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
