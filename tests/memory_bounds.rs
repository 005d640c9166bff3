//! Memory bounds measured where they matter: the peak RSS (VmHWM) of a subscriber
//! process this test owns, fed by floods, drained by a slow (not stalled) consumer,
//! and asserted against the budgets the process was given. A lane charge that
//! under-counts, a budget that is not enforced or a buffer that is kept shows up here
//! as real memory, not as a counter that agrees with itself.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use eventplane::zmtp::{Config, Message, PubSocket};
use support::{DEADLINE, proc_status_bytes, within};
use tokio::io::{AsyncBufReadExt, BufReader};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_fed_by_32_floods_with_a_slow_reader_stays_within_its_budget() {
    const PUBLISHERS: usize = 32;
    // Small next to what the floods offer (and next to 32 lanes × 4 MiB), so an
    // unenforced budget shows as memory far past the bound below.
    const BUDGET: u64 = 8 * MIB;
    let mut publishers = Vec::new();
    for _ in 0..PUBLISHERS {
        let p = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap();
        publishers.push(Arc::new(p));
    }
    let endpoints: Vec<String> = publishers
        .iter()
        .map(|p| p.local_endpoint().unwrap().to_owned())
        .collect();
    let mut args = vec!["--static".to_owned()];
    args.extend(endpoints);
    args.extend(
        [
            "--namespace",
            "ns",
            "--topic",
            "t",
            "--layout",
            "topic-seq",
            "--max-buffered-bytes",
        ]
        .map(String::from),
    );
    args.push(BUDGET.to_string());
    let (mut child, _) = support::spawn_example("watch", &args, false).await;
    let pid = child.id().unwrap();
    for p in &publishers {
        within(p.wait_for_subscribers(1)).await;
    }
    let before = support::reset_peak_rss(pid);

    // The reader takes a line (one delivery) every millisecond: slow, not stalled.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let stop = Arc::new(AtomicBool::new(false));
    let lines_read = Arc::new(AtomicU64::new(0));
    let reader = {
        let (stop, lines_read) = (stop.clone(), lines_read.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match within(lines.next_line()).await {
                    Ok(Some(_)) => {
                        n += 1;
                        lines_read.store(n, Ordering::Relaxed);
                    }
                    _ => break,
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            n
        })
    };
    let payload = Bytes::from(vec![0x5a; 1024]);
    let floods: Vec<_> = publishers
        .iter()
        .map(|p| {
            let (p, stop, payload) = (p.clone(), stop.clone(), payload.clone());
            tokio::spawn(async move {
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        p.send(Message::from_parts([
                            Bytes::from_static(b"t"),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload.clone(),
                        ]));
                        seq += 1;
                    }
                    tokio::task::yield_now().await;
                }
                seq
            })
        })
        .collect();
    // At least 4 s, and until the publishers have handed their connections three
    // budgets' worth of 1 KiB messages beyond what the reader took: what `watch` then
    // received passes twice its budget and overflowed it (the premises of the checks
    // below), for at most DEADLINE.
    let flooding = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let written: u64 = publishers
            .iter()
            .flat_map(|p| p.subscriber_stats())
            .map(|s| s.written)
            .sum();
        let read = lines_read.load(Ordering::Relaxed);
        let elapsed = flooding.elapsed();
        if elapsed >= Duration::from_secs(4) && written > read + 3 * BUDGET / 1024 {
            break;
        }
        assert!(
            elapsed < DEADLINE,
            "the floods wrote {written} messages in {elapsed:?} and {read} lines were read: \
             not {} messages beyond them",
            3 * BUDGET / 1024
        );
    }
    stop.store(true, Ordering::Relaxed);
    let mut offered = 0;
    for f in floods {
        offered += f.await.unwrap();
    }
    let read = within(reader).await.unwrap();
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(before);
    let stats = support::terminate_for_stats(child).await;
    eprintln!(
        "watch, {PUBLISHERS} floods ({offered} messages offered, {read} lines read): \
         +{} MiB peak RSS ({} MiB before)",
        grown / MIB,
        before / MIB
    );
    // What the process may hold: the lanes' budget, the retained read buffers (8 MiB
    // by default), per connection a 64 KiB read buffer and a message in assembly, and
    // the runtime's and allocator's working set (`support::RSS_SLACK`).
    let bound = BUDGET + 8 * MIB + PUBLISHERS as u64 * 256 * 1024 + support::RSS_SLACK;
    eprintln!(
        "figure: watch with --max-buffered-bytes 8 MiB, {PUBLISHERS} publishers flooding, a \
         line read per ms: +{} KiB peak RSS (bound {} KiB)",
        grown >> 10,
        bound >> 10
    );
    assert!(
        grown <= bound,
        "watch grew by {} MiB, past the {} MiB its budgets allow; buffered {}, total {}",
        grown / MIB,
        bound / MIB,
        stats["buffered_bytes"],
        stats["total"]
    );
    // The floods did exceed the global budget (not only a lane's own bound): the
    // bound above was exercised.
    let total = &stats["total"];
    assert!(total["dropped_budget"].as_u64().unwrap() > 0, "{total}");
    assert!(
        total["received"].as_u64().unwrap() > 2 * BUDGET / 1024,
        "{stats}"
    );
    assert!(total["delivered"].as_u64().unwrap() >= read, "{stats}");
}
