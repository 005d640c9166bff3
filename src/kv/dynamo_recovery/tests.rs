//! Our router's end against our worker's, over loopback: the request plane's I/O.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use super::*;
use crate::kv::{
    BlockHash, KvEvent, KvEventData, RouterEvent, StorageTier, StoredBlock, TokensHash, WorkerId,
    pipeline::{LocalIndex, SharedWorkerLog, WorkerLogConfig},
};

fn stored(id: u64, hash: u64, parent: Option<u64>) -> RouterEvent {
    RouterEvent {
        worker_id: WorkerId(88),
        tier: StorageTier::Device,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Stored {
                parent_hash: parent.map(BlockHash),
                blocks: vec![StoredBlock {
                    block_hash: BlockHash(hash),
                    tokens_hash: TokensHash(hash),
                }],
            },
        },
    }
}

async fn worker() -> (DynamoQueryServer, SharedWorkerLog) {
    worker_with(DynamoQueryConfig::default()).await
}

/// A worker whose log holds events 1 to 6 (a chain 101..=106), served with `config`.
async fn worker_with(config: DynamoQueryConfig) -> (DynamoQueryServer, SharedWorkerLog) {
    let log = SharedWorkerLog::new(WorkerLogConfig::default());
    let mut keeper = log.clone();
    for id in 1..=6 {
        keeper
            .apply(&stored(id, 100 + id, (id > 1).then(|| 99 + id)))
            .unwrap();
    }
    let server = DynamoQueryServer::bind("tcp://127.0.0.1:0", log.clone(), config)
        .await
        .unwrap();
    (server, log)
}

#[tokio::test]
async fn a_router_gets_a_dump_and_events_back_through_its_call_home() {
    let (server, _log) = worker().await;
    let home = CallHomeListener::bind("127.0.0.1:0".parse().unwrap(), CallHomeConfig::default())
        .await
        .unwrap();
    let within = Duration::from_secs(5);
    for codec in [Codec::Msgpack, Codec::Json] {
        let tcp = format!(
            "{}/51515/ns/c/worker_kv_query_source_1",
            server.local_addr()
        );
        let target = QueryTarget::from_tcp(&tcp, codec, 88, 0).unwrap();
        let dump = home
            .query(&target, &KvQuery::recovery(88, 0, None), within)
            .await
            .unwrap();
        let KvAnswer::TreeDump {
            events,
            last_event_id,
        } = dump
        else {
            panic!("not a dump: {dump:?}");
        };
        let blocks: usize = events.iter().map(|e| e.event.data.block_count()).sum();
        assert_eq!((blocks, last_event_id), (6, 6), "{codec:?}");
        let since = home
            .query(&target, &KvQuery::recovery(88, 0, Some(5)), within)
            .await
            .unwrap();
        let KvAnswer::Events {
            events,
            last_event_id,
        } = since
        else {
            panic!("not events: {since:?}");
        };
        let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
        assert_eq!((ids, last_event_id), (vec![5, 6], 6));
        let too_new = home
            .query(&target, &KvQuery::recovery(88, 0, Some(9)), within)
            .await
            .unwrap();
        assert!(matches!(
            too_new,
            KvAnswer::TooNew {
                newest_available: 6,
                ..
            }
        ));
    }
    let s = server.stats();
    assert_eq!(
        (s.dumps, s.events, s.out_of_range, s.malformed),
        (2, 2, 2, 0)
    );
}

/// A worker reached at one address that calls home from another (a multi-homed host;
/// in the soak, a router in a network namespace reaching workers through a gateway):
/// its answer is the query's, by subject.
#[tokio::test]
async fn an_answer_from_another_address_of_the_worker_is_taken() {
    let log = SharedWorkerLog::new(WorkerLogConfig::default());
    let mut keeper = log.clone();
    keeper.apply(&stored(1, 101, None)).unwrap();
    // Reached at 127.0.0.2; the router's own address is 127.0.0.1, so the worker's
    // call home comes from 127.0.0.1.
    let server = DynamoQueryServer::bind("tcp://127.0.0.2:0", log, DynamoQueryConfig::default())
        .await
        .unwrap();
    let home = CallHomeListener::bind("127.0.0.1:0".parse().unwrap(), CallHomeConfig::default())
        .await
        .unwrap();
    let tcp = format!(
        "{}/51515/ns/c/worker_kv_query_source_1",
        server.local_addr()
    );
    let target = QueryTarget::from_tcp(&tcp, Codec::Msgpack, 88, 0).unwrap();
    let dump = home
        .query(
            &target,
            &KvQuery::recovery(88, 0, None),
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    assert!(
        matches!(
            dump,
            KvAnswer::TreeDump {
                last_event_id: 1,
                ..
            }
        ),
        "{dump:?}"
    );
}

#[tokio::test]
async fn a_call_home_that_names_no_query_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let home = CallHomeListener::bind("127.0.0.1:0".parse().unwrap(), CallHomeConfig::default())
        .await
        .unwrap();
    let mut stranger = tokio::net::TcpStream::connect(("127.0.0.1", home.port()))
        .await
        .unwrap();
    let hello = encode_two_part(
        br#"{"subject":"nobody asked","stream_type":"response"}"#,
        b"",
    );
    // Closed at once (no query is waiting on this address), perhaps before it
    // even read the hello: a reset.
    let _ = stranger.write_all(&hello).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stranger.read_to_end(&mut rest)).await;
    let closed = match &read {
        Ok(Ok(0)) => true,
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        _ => false,
    };
    assert!(closed, "not closed: {read:?}");
}

#[tokio::test]
async fn a_frame_past_its_bound_closes_the_connection_and_is_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, _log) = worker().await;
    let mut peer = tokio::net::TcpStream::connect(server.local_addr())
        .await
        .unwrap();
    // A path of 65,535 bytes announced: past the 1,024 accepted.
    peer.write_all(&[0xff, 0xff]).await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), peer.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(0))), "not closed: {read:?}");
    assert_eq!(server.stats().malformed, 1);
}

/// What the feed gets from a Dynamo worker (ours, over loopback): a partial answer
/// completed by asking past it, "nothing missed" for a start just past the newest, a
/// refusal for a start beyond it, and a dump with the dump's id.
#[tokio::test]
async fn the_feeds_view_of_a_dynamo_worker() {
    use crate::kv::router::{Recovered, RecoveryClientConfig, RecoveryError, RecoveryRequest};
    // Two events an answer: asking from 2 takes three answers (2-3, 4-5, 6).
    let (server, _log) = worker_with(DynamoQueryConfig {
        max_answer_events: 2,
        ..DynamoQueryConfig::default()
    })
    .await;
    let home = CallHomeListener::bind("127.0.0.1:0".parse().unwrap(), CallHomeConfig::default())
        .await
        .unwrap();
    let endpoint = format!(
        "dynamo+msgpack://{}/1/ns/c/e?worker_id=88&dp_rank=0",
        server.local_addr()
    );
    let asking = RecoveryClientConfig::default();
    let ask = |request| recover_dynamo(&home, &endpoint, request, &asking);
    let Ok(Recovered::Events { events, current_id }) = ask(RecoveryRequest::Since(1)).await else {
        panic!("no events");
    };
    let ids: Vec<u64> = events.iter().map(|e| e.event.id).collect();
    assert_eq!((ids, current_id), (vec![2, 3, 4, 5, 6], 6));
    // Caught up: asked from 7, which Dynamo calls too new.
    let caught_up = ask(RecoveryRequest::Since(6)).await.unwrap();
    assert_eq!(
        caught_up,
        Recovered::Events {
            events: Vec::new(),
            current_id: 6
        }
    );
    // Further than the worker went (it restarted, say): refused, not retried.
    let behind = ask(RecoveryRequest::Since(9)).await.unwrap_err();
    assert!(
        matches!(&behind, RecoveryError::Refused(why) if why.contains("TooNew")),
        "{behind:?}"
    );
    assert!(!behind.is_transient());
    let Ok(Recovered::Dump(dump)) = ask(RecoveryRequest::Dump).await else {
        panic!("no dump");
    };
    let blocks: usize = dump.events.iter().map(|e| e.event.data.block_count()).sum();
    assert_eq!((blocks, dump.current_id), (6, 6));
    assert!(dump.events.iter().all(|e| e.event.id == 6));
    // Not ours to ask: a target without its worker.
    let bare = format!("dynamo+msgpack://{}/1/ns/c/e", server.local_addr());
    let refused = recover_dynamo(&home, &bare, RecoveryRequest::Dump, &asking).await;
    assert!(matches!(refused, Err(RecoveryError::Malformed(_))));
}

/// A worker that accepts a query and vanishes before acknowledging it: a connection
/// failure, which the feed may retry.
#[tokio::test]
async fn a_worker_that_vanishes_mid_query_is_a_connection_failure() {
    use crate::kv::router::{RecoveryClientConfig, RecoveryRequest};
    let vanishing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = vanishing.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((conn, _)) = vanishing.accept().await {
            drop(conn);
        }
    });
    let home = CallHomeListener::bind("127.0.0.1:0".parse().unwrap(), CallHomeConfig::default())
        .await
        .unwrap();
    let endpoint = format!("dynamo+json://{at}/1/ns/c/e?worker_id=88&dp_rank=0");
    let failed = recover_dynamo(
        &home,
        &endpoint,
        RecoveryRequest::Dump,
        &RecoveryClientConfig::default(),
    )
    .await
    .unwrap_err();
    assert!(failed.is_transient(), "{failed:?}");
}
