#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use crate::wire::Dialect;
use std::collections::{HashMap, HashSet};

use super::*;

fn ev(id: u64, rank: u32, data: KvEventData) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(3),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: rank,
            data,
        },
    }
}

fn stored(parent: Option<u64>, hashes: &[u64]) -> KvEventData {
    KvEventData::Stored {
        parent_hash: parent.map(BlockHash),
        blocks: hashes
            .iter()
            .map(|&h| StoredBlock {
                block_hash: BlockHash(h),
                tokens_hash: TokensHash(h ^ 0xabc),
            })
            .collect(),
    }
}

/// What a router holds after applying `events`: block -> (rank, parent, tokens hash).
fn view(events: &[RouterEvent]) -> HashMap<(u32, u64), (Option<u64>, u64)> {
    let mut v = HashMap::new();
    for e in events {
        let rank = e.event.dp_rank;
        match &e.event.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let mut parent = parent_hash.map(|p| p.0);
                for b in blocks {
                    v.insert((rank, b.block_hash.0), (parent, b.tokens_hash.0));
                    parent = Some(b.block_hash.0);
                }
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    v.remove(&(rank, h.0));
                }
            }
            KvEventData::Cleared => v.retain(|&(r, _), _| r != rank),
        }
    }
    v
}

/// A stream of stores (chains off held blocks), removals and clears over two ranks.
fn stream(n: u64, seed: u64) -> Vec<RouterEvent> {
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut held: Vec<Vec<u64>> = vec![Vec::new(), Vec::new()];
    let mut fresh = 1u64;
    let mut out = Vec::new();
    for id in 1..=n {
        let rank = (next() % 2) as u32;
        let h = &mut held[rank as usize];
        let data = match next() % 10 {
            0 if id % 7 == 0 => {
                h.clear();
                KvEventData::Cleared
            }
            0..=2 if !h.is_empty() => {
                let gone: Vec<u64> = (0..1 + next() % 3)
                    .map(|_| h[(next() % h.len() as u64) as usize])
                    .collect::<HashSet<_>>()
                    .into_iter()
                    .collect();
                h.retain(|b| !gone.contains(b));
                KvEventData::Removed {
                    block_hashes: gone.into_iter().map(BlockHash).collect(),
                }
            }
            _ => {
                let parent = (!h.is_empty() && next() % 2 == 0)
                    .then(|| h[(next() % h.len() as u64) as usize]);
                let len = 1 + next() % 4;
                let hashes: Vec<u64> = (fresh..fresh + len).collect();
                fresh += len;
                h.extend(&hashes);
                stored(parent, &hashes)
            }
        };
        out.push(ev(id, rank, data));
    }
    out
}

#[test]
fn a_dump_rebuilds_what_the_events_built_at_every_point() {
    for seed in [1, 7, 99] {
        let events = stream(400, seed);
        let mut log = WorkerLog::default();
        for (i, e) in events.iter().enumerate() {
            log.apply(e).unwrap();
            if i % 37 == 0 || i + 1 == events.len() {
                let dump = log.dump();
                assert_eq!(dump.current_id, e.event.id);
                assert!(dump.complete);
                assert!(dump.events.iter().all(|d| d.event.id == dump.current_id));
                assert_eq!(
                    view(&dump.events),
                    view(&events[..=i]),
                    "seed {seed} at {i}"
                );
            }
        }
        // Chains are packed: fewer events than blocks.
        let dump = log.dump();
        let stored: usize = dump
            .events
            .iter()
            .filter(|e| matches!(e.event.data, KvEventData::Stored { .. }))
            .map(|e| e.event.data.block_count())
            .sum();
        let ghosts: usize = dump
            .events
            .iter()
            .filter(|e| matches!(e.event.data, KvEventData::Removed { .. }))
            .map(|e| e.event.data.block_count())
            .sum();
        assert_eq!(stored - ghosts, log.stats().blocks);
        assert!(dump.events.len() < stored);
    }
}

#[test]
fn events_since_an_id_follow_it_until_the_ring_no_longer_holds_them() {
    let events = stream(100, 5);
    let mut log = WorkerLog::new(WorkerLogConfig::default().events(10));
    for e in &events {
        log.apply(e).unwrap();
    }
    let Since::Events(tail) = log.since(95) else {
        panic!("95 is kept")
    };
    assert_eq!(tail, events[95..].to_vec());
    // The oldest kept is 91: asking after 90 gets 91..; after 89 misses 90.
    assert!(matches!(log.since(90), Since::Events(v) if v.len() == 10));
    assert_eq!(log.since(89), Since::TooOld { oldest: 91 });
    assert_eq!(log.since(100), Since::Events(Vec::new()));
    // A router ahead of the worker (another worker process since): only a dump can
    // say what it holds.
    assert_eq!(log.since(500), Since::TooOld { oldest: 91 });
    let stats = log.stats();
    assert_eq!(
        (stats.events, stats.oldest_id, stats.last_id),
        (10, 91, 100)
    );
}

#[test]
fn the_ring_is_bounded_by_the_blocks_its_events_carry() {
    let mut log = WorkerLog::new(WorkerLogConfig::default().event_blocks(8));
    for id in 1..=10u64 {
        log.apply(&ev(
            id,
            0,
            stored(None, &[id * 10, id * 10 + 1, id * 10 + 2]),
        ))
        .unwrap();
    }
    // 3 blocks per event, at most 8 blocks: the last 2 events.
    assert_eq!(log.stats().events, 2);
    assert_eq!(log.since(7), Since::TooOld { oldest: 9 });
}

#[test]
fn blocks_past_the_bound_are_counted_and_the_dump_says_it_is_partial() {
    let mut log = WorkerLog::new(WorkerLogConfig::default().max_blocks(4));
    log.apply(&ev(1, 0, stored(None, &[1, 2, 3]))).unwrap();
    log.apply(&ev(2, 0, stored(Some(3), &[4, 5, 6]))).unwrap();
    assert_eq!(log.stats().untracked_blocks, 2);
    let dump = log.dump();
    assert!(!dump.complete);
    assert_eq!(view(&dump.events).len(), 4);
}

#[test]
fn an_id_break_drops_what_no_longer_leads_up_to_the_newest_event() {
    let mut log = WorkerLog::default();
    log.apply(&ev(1, 0, stored(None, &[1]))).unwrap();
    log.apply(&ev(2, 0, stored(Some(1), &[2]))).unwrap();
    // The processor restarted its ids (a new worker process reusing the log).
    log.apply(&ev(1, 0, KvEventData::Cleared)).unwrap();
    assert_eq!(log.stats().id_breaks, 1);
    assert_eq!(
        log.since(0),
        Since::Events(vec![ev(1, 0, KvEventData::Cleared)])
    );
    assert!(log.dump().events.is_empty());
}

mod endpoint {
    use super::*;
    use crate::kv::{
        pipeline::RecoveryServer,
        router::{Recovered, RecoveryClientConfig, RecoveryRequest, recover},
    };
    use crate::zmtp::{Config, DealerSocket, Message};

    async fn serving(
        events: &[RouterEvent],
        config: WorkerLogConfig,
    ) -> (RecoveryServer, SharedWorkerLog) {
        let log = SharedWorkerLog::new(config);
        let mut feeder = log.clone();
        for e in events {
            feeder.apply(e).unwrap();
        }
        let server = RecoveryServer::bind("tcp://127.0.0.1:0", log.clone())
            .await
            .unwrap();
        (server, log)
    }

    #[tokio::test]
    async fn since_dump_and_too_old_over_a_real_socket() {
        let events = stream(3000, 11);
        let (server, log) = serving(&events, WorkerLogConfig::default()).await;
        let at = server.local_endpoint().to_owned();
        let cfg = RecoveryClientConfig::default;
        let Recovered::Events {
            events: tail,
            current_id,
        } = recover(&at, RecoveryRequest::Since(2990), cfg())
            .await
            .unwrap()
        else {
            panic!("kept")
        };
        assert_eq!((tail, current_id), (events[2990..].to_vec(), 3000));
        assert_eq!(
            recover(&at, RecoveryRequest::Since(10), cfg())
                .await
                .unwrap(),
            Recovered::TooOld {
                oldest: 3000 - 1024 + 1
            }
        );
        let Recovered::Dump(dump) = recover(&at, RecoveryRequest::Dump, cfg()).await.unwrap()
        else {
            panic!("a dump")
        };
        assert_eq!(dump, log.with(WorkerLog::dump));
        assert_eq!(view(&dump.events), view(&events));
        // A second dump at the same id is shared, not built again.
        recover(&at, RecoveryRequest::Dump, cfg()).await.unwrap();
        let stats = server.stats();
        assert_eq!((stats.dump_requests, stats.dumps_built), (2, 1));
        assert_eq!((stats.since_requests, stats.too_old), (1, 1));
    }

    #[tokio::test]
    async fn a_bad_request_is_refused_and_an_oversized_one_never_assembled() {
        let (server, _log) = serving(&stream(10, 3), WorkerLogConfig::default()).await;
        let at = server.local_endpoint().to_owned();
        let mut d = DealerSocket::connect(&at, Config::default()).await.unwrap();
        d.send(&Message::from_parts([&b""[..], b"delete everything"]))
            .await
            .unwrap();
        let answer = d.recv().await.unwrap();
        assert_eq!(answer.get(1), Some(&b"error"[..]));
        assert!(d.recv().await.is_err(), "closed after refusing");
        // A request frame larger than any request fails the connection as it arrives.
        let mut d = DealerSocket::connect(&at, Config::default()).await.unwrap();
        d.send(&Message::from_parts([vec![0u8; 1 << 20]]))
            .await
            .ok();
        assert!(d.recv().await.is_err());
        assert_eq!(server.stats().malformed_requests, 1);
        // The endpoint still serves.
        let ok = recover(
            &at,
            RecoveryRequest::Since(9),
            RecoveryClientConfig::default(),
        )
        .await;
        assert!(
            matches!(ok, Ok(Recovered::Events { current_id: 10, .. })),
            "{ok:?}"
        );
    }

    /// A hostile worker answers with many events that carry no blocks: within the
    /// byte bound on the wire, over it decoded. The decoded size is held to
    /// `max_bytes` too.
    #[tokio::test]
    async fn an_answer_of_empty_events_is_held_to_the_byte_bound_decoded() {
        let empties: Vec<RouterEvent> =
            (1..=1000).map(|i| ev(i, 0, KvEventData::Cleared)).collect();
        let payload =
            bytes::Bytes::from(Dialect::EventPlane.encode_router_events(&empties).unwrap());
        held_to_the_bound_decoded(b"events", payload, empties.len()).await;
        // Packed, as dumps are: 10 bytes an event on the wire.
        let empties: Vec<RouterEvent> = (1..=1000)
            .map(|i| {
                let mut e = ev(1, 0, KvEventData::Cleared);
                e.event.dp_rank = i;
                e
            })
            .collect();
        let payload = super::blocks::encode(&empties, 8192).remove(0);
        held_to_the_bound_decoded(b"blocks", payload, empties.len()).await;
    }

    async fn held_to_the_bound_decoded(
        kind: &'static [u8],
        payload: bytes::Bytes,
        per_message: usize,
    ) {
        let max = 4 << 20;
        let empties = vec![(); per_message];
        // As many messages as fit the bound on the wire (frames included).
        let messages = max / (payload.len() + 64);
        let decoded = messages * empties.len() * size_of::<RouterEvent>();
        assert!(decoded > max, "the test needs answers larger decoded");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = format!("tcp://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut worker = DealerSocket::accept_as_router(stream, Config::default())
                .await
                .unwrap();
            let _request = worker.recv().await.unwrap();
            for _ in 0..messages {
                let msg = Message::from_parts([
                    bytes::Bytes::new(),
                    bytes::Bytes::from_static(kind),
                    payload.clone(),
                ]);
                if worker.send(&msg).await.is_err() {
                    return;
                }
            }
            let end = Message::from_parts([
                bytes::Bytes::new(),
                bytes::Bytes::from_static(b"end"),
                bytes::Bytes::copy_from_slice(&1000u64.to_be_bytes()),
                bytes::Bytes::from_static(&[1]),
            ]);
            let _ = worker.send(&end).await;
        });
        let config = RecoveryClientConfig {
            max_bytes: max,
            filter: None,
            ..RecoveryClientConfig::default()
        };
        let Err(err) = recover(&at, RecoveryRequest::Since(0), config).await else {
            panic!("an answer over the bound decoded was accepted");
        };
        assert!(
            matches!(err, crate::kv::router::RecoveryError::TooLarge(_)),
            "{err}"
        );
    }

    /// Streams handed to the acceptor (a tunnel source's) are held to the server's
    /// connection bound, and it says so before one is opened.
    #[tokio::test]
    async fn an_acceptor_is_held_to_the_connection_bound() {
        let (server, _log) = serving(&stream(10, 5), WorkerLogConfig::default()).await;
        let acceptor = server.acceptor();
        let mut routers = Vec::new();
        for _ in 0..crate::kv::recovery::endpoint::DEFAULT_RECOVERY_CONNECTIONS {
            assert!(acceptor.has_room());
            let (router, worker) = tokio::io::duplex(1 << 16);
            assert!(acceptor.accept_stream(worker));
            routers.push(router);
        }
        assert!(!acceptor.has_room());
        let (_router, worker) = tokio::io::duplex(1 << 16);
        assert!(!acceptor.accept_stream(worker));
        assert_eq!(server.stats().refused_connections, 1);
        // One that is served answers over the stream.
        let socket = DealerSocket::handshake(routers.remove(0), Config::default())
            .await
            .unwrap();
        let answer =
            crate::kv::router::recover_over(socket, RecoveryRequest::Since(9), 1 << 20, 1 << 20)
                .await
                .unwrap();
        assert!(matches!(answer, Recovered::Events { current_id: 10, .. }));
        drop(server);
        assert!(acceptor.is_closed() && !acceptor.accept_stream(tokio::io::duplex(64).1));
    }

    /// The dump shared between requests is the log's at its id *and* its id breaks:
    /// a new process that restarted the ids and reached the same id gets its own.
    #[tokio::test]
    async fn a_restarted_process_at_the_same_id_gets_its_own_dump() {
        let first: Vec<RouterEvent> = (1..=3).map(|i| ev(i, 0, stored(None, &[i]))).collect();
        let (server, log) = serving(&first, WorkerLogConfig::default()).await;
        let at = server.local_endpoint().to_owned();
        let dump = || async {
            match recover(&at, RecoveryRequest::Dump, RecoveryClientConfig::default()).await {
                Ok(Recovered::Dump(d)) => d,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(view(&dump().await.events), view(&first));
        let mut feeder = log.clone();
        feeder.apply(&ev(1, 0, KvEventData::Cleared)).unwrap();
        for i in 2..=3 {
            feeder.apply(&ev(i, 0, stored(None, &[10 + i]))).unwrap();
        }
        let again = dump().await;
        assert_eq!(again.current_id, 3);
        assert_eq!(again, log.with(WorkerLog::dump));
        assert_eq!(server.stats().dumps_built, 2);
    }

    #[tokio::test]
    async fn an_answer_over_the_clients_byte_bound_fails_it() {
        let (server, _log) = serving(&stream(2000, 4), WorkerLogConfig::default()).await;
        let config = RecoveryClientConfig {
            max_bytes: 1000,
            ..RecoveryClientConfig::default()
        };
        let err = recover(server.local_endpoint(), RecoveryRequest::Dump, config)
            .await
            .unwrap_err();
        assert!(
            matches!(err, crate::kv::router::RecoveryError::TooLarge(1000)),
            "{err}"
        );
    }
}

#[test]
fn a_removed_parent_of_held_blocks_is_dumped_to_place_them_then_removed() {
    let mut log = WorkerLog::default();
    log.apply(&ev(1, 0, stored(None, &[1, 2]))).unwrap();
    log.apply(&ev(2, 0, stored(Some(2), &[3]))).unwrap();
    // 2 goes while 3, under it, stays; then 1 goes too.
    log.apply(&ev(
        3,
        0,
        KvEventData::Removed {
            block_hashes: vec![BlockHash(2)],
        },
    ))
    .unwrap();
    log.apply(&ev(
        4,
        0,
        KvEventData::Removed {
            block_hashes: vec![BlockHash(1)],
        },
    ))
    .unwrap();
    assert_eq!(log.stats().blocks, 1);
    let dump = log.dump();
    // Stored 1, 2, 3 along their chain (the ghosts place 3), then 1 and 2 removed.
    assert_eq!(dump.events.len(), 2, "{:?}", dump.events);
    assert_eq!(dump.events[0].event.data.block_count(), 3);
    assert_eq!(
        dump.events[1].event.data,
        KvEventData::Removed {
            block_hashes: vec![BlockHash(1), BlockHash(2)]
        }
    );
    // 3 goes: its ghosts go with it.
    log.apply(&ev(
        5,
        0,
        KvEventData::Removed {
            block_hashes: vec![BlockHash(3)],
        },
    ))
    .unwrap();
    assert!(log.dump().events.is_empty());
    assert_eq!(log.stats().blocks, 0);
}
