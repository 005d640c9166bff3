//! MemoryDiscovery beyond the conformance suite: leases in paused time, a silent
//! watcher under heavy churn, O(1) lookups, and StaticDiscovery.
#![allow(clippy::unwrap_used, clippy::panic, missing_docs)]

use std::collections::BTreeSet;
use std::time::Duration;

use eventplane::discovery::{
    ChannelId, Discovery, DiscoveryError, DiscoveryEvent, Instance, MemoryDiscovery, Query,
    StaticDiscovery, Transport,
};
use tokio_util::sync::CancellationToken;

fn id(n: u64) -> ChannelId {
    ChannelId::new("ns", "worker", "kv", n).unwrap()
}

fn ep(n: u64) -> Transport {
    Transport::zmq(format!("tcp://127.0.0.1:{}", 20_000 + n % 40_000))
}

#[tokio::test(start_paused = true)]
async fn detached_registration_expires_exactly_at_ttl() {
    let d = MemoryDiscovery::builder()
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    let live = d.register(id(1), ep(1)).await.unwrap();
    let crashed = d.register(id(2), ep(2)).await.unwrap();
    let mut w = d
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    for _ in 0..3 {
        w.next().await.unwrap().unwrap();
    }
    let start = tokio::time::Instant::now();
    crashed.detach();
    tokio::time::sleep(Duration::from_millis(9_999)).await;
    assert_eq!(d.list(Query::new("ns")).await.unwrap().len(), 2);
    match w.next().await.unwrap().unwrap() {
        DiscoveryEvent::Removed { id: gone, .. } => assert_eq!(gone, id(2)),
        other => panic!("{other:?}"),
    }
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    assert_eq!(d.stats().expired, 1);
    // The guarded registration's lease keeps being renewed: an hour later it is there.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(
        d.list(Query::new("ns")).await.unwrap(),
        vec![live.instance().clone()]
    );
    assert_eq!(d.stats().registrations, 1);
}

#[tokio::test(start_paused = true)]
async fn reregistration_survives_the_old_leases_expiry() {
    let d = MemoryDiscovery::builder()
        .ttl(Duration::from_secs(5))
        .build()
        .unwrap();
    let old = d.register(id(1), ep(1)).await.unwrap();
    old.detach();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The process comes back before the old lease runs out.
    let new = d.register(id(1), ep(2)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(d.get(&id(1)), Some(new.instance().clone()));
    assert_eq!(d.stats().expired, 0);
}

#[tokio::test]
async fn silent_watcher_under_heavy_churn_stays_bounded_then_resyncs() {
    let d = MemoryDiscovery::builder()
        .watch_buffer(1024)
        .build()
        .unwrap();
    let mut keep = Vec::new();
    for n in 0..10 {
        keep.push(d.register(id(1_000_000 + n), ep(n)).await.unwrap());
    }
    let mut w = d
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    // 100 000 registrations churn while the watcher never polls.
    let mut max_buffered = 0;
    for n in 0..100_000u64 {
        let g = d.register(id(n), ep(n)).await.unwrap();
        if n % 10_000 == 0 {
            keep.push(g);
        } else {
            drop(g);
        }
        if n % 997 == 0 {
            max_buffered = max_buffered.max(d.stats().buffered_events);
        }
    }
    assert!(max_buffered <= 1024, "backlog reached {max_buffered}");
    assert!(d.stats().overflow_resyncs >= 1);
    // Polling again: the backlog, initial sync included, collapsed into one Resync
    // equal to the true current set (the first Resync ends the initial sync).
    let truth: BTreeSet<(ChannelId, u64)> = d
        .list(Query::new("ns"))
        .await
        .unwrap()
        .into_iter()
        .map(|i| (i.id, i.incarnation))
        .collect();
    assert_eq!(truth.len(), 20);
    match w.next().await.unwrap().unwrap() {
        DiscoveryEvent::Resync(all) => {
            let got: BTreeSet<(ChannelId, u64)> =
                all.into_iter().map(|i| (i.id, i.incarnation)).collect();
            assert_eq!(got, truth);
        }
        other => panic!("expected the collapsed Resync, got {other:?}"),
    }
    assert_eq!(d.stats().buffered_events, 0);
}

#[tokio::test]
async fn one_slow_watcher_does_not_hold_back_another() {
    let d = MemoryDiscovery::builder().watch_buffer(16).build().unwrap();
    let _slow = d
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    let mut fast = d
        .watch(Query::new("ns"), CancellationToken::new())
        .await
        .unwrap();
    assert!(matches!(
        fast.next().await,
        Some(Ok(DiscoveryEvent::Resync(_)))
    ));
    let mut guards = Vec::new();
    for n in 0..100 {
        guards.push(d.register(id(n), ep(n)).await.unwrap());
        match fast.next().await.unwrap().unwrap() {
            DiscoveryEvent::Added(i) => assert_eq!(i.id, id(n)),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn lookups_and_clones_share_one_registry() {
    let d = MemoryDiscovery::new();
    let clone = d.clone();
    let g = d.register(id(5), ep(5)).await.unwrap();
    assert_eq!(clone.get(&id(5)), Some(g.instance().clone()));
    assert_eq!(clone.get(&id(6)), None);
    assert_eq!(clone.stats().registrations, 1);
    drop(g);
    assert_eq!(clone.get(&id(5)), None);
}

#[tokio::test]
async fn static_discovery() {
    let d =
        StaticDiscovery::from_endpoints("ns", "c", "t", ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
            .unwrap();
    let all = d.list(Query::new("ns")).await.unwrap();
    assert_eq!(all.len(), 2);
    assert!(
        d.list(Query::new("ns").component("c2"))
            .await
            .unwrap()
            .is_empty()
    );
    let cancel = CancellationToken::new();
    let mut w = d.watch(Query::new("ns"), cancel.clone()).await.unwrap();
    let mut events = Vec::new();
    for _ in 0..3 {
        events.push(w.next().await.unwrap().unwrap());
    }
    assert!(matches!(events[2], DiscoveryEvent::Resync(ref v) if v.len() == 2));
    cancel.cancel();
    assert!(w.next().await.is_none());
    let err = d
        .register(
            ChannelId::new("ns", "c", "t", 9).unwrap(),
            Transport::zmq("tcp://x:1"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DiscoveryError::Unsupported { .. }));
    let custom = StaticDiscovery::new(vec![Instance::new(
        ChannelId::new("a", "b", "c", 1).unwrap(),
        Transport::zmq("tcp://127.0.0.1:3"),
        7,
    )]);
    assert_eq!(
        custom.list(Query::new("a")).await.unwrap()[0].incarnation,
        7
    );
}
