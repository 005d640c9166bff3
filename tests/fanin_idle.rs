//! Fan-in at scale, in the small:
//! - what an idle publisher costs a `DynamicSubscriber`, counted by the allocator: a
//!   fleet of real libzmq publishers (Debian's python3-zmq, in another process) is
//!   followed through `MemoryDiscovery`; once every publisher has delivered a message
//!   and gone quiet, the heap the subscriber holds per publisher and its descriptors
//!   are checked. Thousands of publishers make this the subscriber's dominant cost;
//! - how many publishers it dials at once (`max_concurrent_dials`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    missing_docs
)]

mod support;

use std::alloc::System;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use cap::Cap;
use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
use eventplane::subscriber::{DynamicSubscriber, Layout};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// Publishers followed: enough that per-publisher costs dwarf the subscriber's fixed
/// ones, few enough to fit the common default of 1,024 open files (the test raises
/// its soft limit to the hard one anyway).
const PUBLISHERS: usize = 768;

/// The two tests take turns: the counts of heap and descriptors are process-wide.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Heap one idle publisher may hold in the subscriber: its connection task, ZMTP
/// session and socket, lane, counters and discovery record, and no read buffer.
const IDLE_HEAP_PER_PUBLISHER: usize = 6 << 10;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_publisher_costs_its_connection_and_little_else() {
    let _turn = TURN.lock().await;
    let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current = limit.maximum;
    let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit);
    let mut fleet = Command::new(support::PYTHON)
        .arg(support::support_dir().join("zmq_fleet.py"))
        .arg(PUBLISHERS.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 with zmq (apt-get install python3-zmq)");
    let mut stdin = fleet.stdin.take().unwrap();
    let mut lines = BufReader::new(fleet.stdout.take().unwrap()).lines();
    let mut endpoints = Vec::new();
    loop {
        let line = tokio::time::timeout(support::DEADLINE, lines.next_line())
            .await
            .expect("the fleet binds its publishers")
            .unwrap()
            .expect("the fleet printed END");
        if line == "END" {
            break;
        }
        endpoints.push(line);
    }
    assert_eq!(endpoints.len(), PUBLISHERS);
    let memory = MemoryDiscovery::new();
    let mut guards = Vec::new();
    for (i, endpoint) in endpoints.iter().enumerate() {
        let id = ChannelId::new("fanin", "worker", "kvev", i as u64).unwrap();
        guards.push(
            memory
                .register(id, Transport::zmq(endpoint.clone()))
                .await
                .unwrap(),
        );
    }
    let (heap_before, fds_before) = (ALLOCATOR.allocated(), open_fds());
    let mut sub = DynamicSubscriber::builder(Arc::new(memory.clone()), Query::new("fanin"))
        .topic("kvev")
        .layout(Layout::TopicSeq)
        .spawn()
        .unwrap();
    // Until every publisher has delivered (libzmq drops what it sends before a
    // subscription arrives: send again until each one's first message is in).
    let mut rounds = 0u64;
    let everyone = async {
        loop {
            stdin.write_all(b"send kvev 1\n").await.unwrap();
            assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("sent"));
            rounds += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
            let stats = sub.stats();
            let heard = stats
                .publishers
                .iter()
                .filter(|(_, p)| p.received > 0)
                .count();
            if heard == PUBLISHERS {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), everyone)
        .await
        .expect("every publisher delivers within 60 s");
    // Quiet: every publisher's last message (the fleet numbers its rounds from 0;
    // each publisher was subscribed before the last one went) is in and taken by
    // the consumer (what it holds is its own), every connection has given its read
    // buffer back (its peer had nothing more), and the read buffers those messages
    // were sliced from are freed (`stats` prunes them).
    let last = rounds - 1;
    let mut taken = Vec::new();
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        while tokio::time::timeout(Duration::from_millis(10), sub.recv_many(&mut taken, 1024))
            .await
            .is_ok()
        {
            taken.clear();
        }
        let stats = sub.stats();
        let behind = stats
            .publishers
            .iter()
            .filter(|(_, p)| p.last_sequence != Some(last))
            .count();
        let t = &stats.total;
        if behind == 0
            && t.delivered == t.received
            && stats.buffered_bytes == 0
            && stats.read_buffer_bytes == 0
            && stats.retained_bytes == 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not quiet after {:?}: {behind} publishers without message {last}, {} of {} \
             received delivered, {} B buffered, {} B in read buffers, {} B retained",
            support::DEADLINE,
            t.delivered,
            t.received,
            stats.buffered_bytes,
            stats.read_buffer_bytes,
            stats.retained_bytes
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(taken);
    let (heap, fds) = (ALLOCATOR.allocated(), open_fds());
    let per_publisher = heap.saturating_sub(heap_before) / PUBLISHERS;
    eprintln!(
        "{PUBLISHERS} idle publishers: {per_publisher} B of heap each, {} descriptors beyond \
         the publishers",
        (fds - fds_before).saturating_sub(PUBLISHERS)
    );
    assert!(
        per_publisher <= IDLE_HEAP_PER_PUBLISHER,
        "{per_publisher} B of heap per idle publisher, over {IDLE_HEAP_PER_PUBLISHER}"
    );
    // One descriptor per publisher, a few for the runtime.
    assert!(
        fds - fds_before <= PUBLISHERS + 8,
        "{} descriptors",
        fds - fds_before
    );
    sub.handle().shutdown().await;
    drop(guards);
}

#[tokio::test]
async fn publishers_are_dialled_at_most_max_concurrent_dials_at_a_time() {
    let _turn = TURN.lock().await;
    // Six publishers that accept and never answer the greeting: each dial holds its
    // permit until the handshake times out (10 s), so exactly the permitted number of
    // connections arrive; the others wait for a permit.
    async fn accepted_with(dials: Option<usize>, expected: usize) -> usize {
        let memory = MemoryDiscovery::new();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut held = Vec::new();
        let mut guards = Vec::new();
        for i in 0..6u64 {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
            let accepted = accepted.clone();
            held.push(tokio::spawn(async move {
                let mut streams = Vec::new();
                while let Ok((stream, _)) = listener.accept().await {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    streams.push(stream);
                }
            }));
            let id = ChannelId::new("dials", "worker", "kvev", i).unwrap();
            guards.push(memory.register(id, Transport::zmq(endpoint)).await.unwrap());
        }
        let mut builder = DynamicSubscriber::builder(Arc::new(memory), Query::new("dials"));
        if let Some(dials) = dials {
            builder = builder.max_concurrent_dials(dials);
        }
        let sub = builder.spawn().unwrap();
        // Until the expected dials connected, and for 1.5 s at least (for any beyond
        // them to show): far shorter than the handshake timeout that would free a
        // permit.
        let start = tokio::time::Instant::now();
        let n = loop {
            let n = accepted.load(std::sync::atomic::Ordering::SeqCst);
            if n >= expected && start.elapsed() >= Duration::from_millis(1500) {
                break n;
            }
            assert!(
                start.elapsed() < support::DEADLINE,
                "{n} of {expected} dials accepted in {:?}",
                support::DEADLINE
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        sub.handle().shutdown().await;
        for task in held {
            task.abort();
        }
        n
    }
    assert_eq!(accepted_with(Some(2), 2).await, 2);
    assert_eq!(
        accepted_with(None, 6).await,
        6,
        "the default (256) dials them all"
    );
}
