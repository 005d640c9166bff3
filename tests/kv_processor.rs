//! The KV processor loop in paused time: list boundaries, the batching timer, drain on
//! cancel and close, input gaps, publish errors, a stuck sink, and fencing.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use eventplane::discovery::BoxFuture;
use eventplane::kv::{
    BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, RouterEvent, StorageTier,
    StoredBlock, TokensHash, WorkerId,
    pipeline::{EventSink, IndexError, LocalIndex, Processor, ProcessorConfig, SinkError},
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const AT: Placement = Placement {
    worker_id: WorkerId(9),
    dp_rank: 0,
    tier: StorageTier::Device,
};

fn removed(id: u64, hash: u64) -> PlacementEvent {
    PlacementEvent {
        placement: AT,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Removed {
                block_hashes: vec![BlockHash(hash)],
            },
        },
    }
}

fn cleared(id: u64) -> PlacementEvent {
    PlacementEvent {
        placement: AT,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Cleared,
        },
    }
}

/// Collects every published batch.
#[derive(Default)]
struct Collect {
    batches: Mutex<Vec<Vec<RouterEvent>>>,
    fail: bool,
    hang: bool,
}

impl Collect {
    fn hashes(&self) -> Vec<Vec<u64>> {
        self.batches
            .lock()
            .unwrap()
            .iter()
            .flat_map(|b| b.iter())
            .map(|e| match &e.event.data {
                KvEventData::Removed { block_hashes } => block_hashes.iter().map(|h| h.0).collect(),
                _ => vec![],
            })
            .collect()
    }
}

impl EventSink for Collect {
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
        self.batches.lock().unwrap().push(events.to_vec());
        let (fail, hang) = (self.fail, self.hang);
        Box::pin(async move {
            if hang {
                std::future::pending::<()>().await;
            }
            if fail {
                return Err(SinkError("sink down".into()));
            }
            Ok(())
        })
    }
}

fn start(
    config: ProcessorConfig,
    sink: Arc<Collect>,
) -> (mpsc::Sender<Vec<PlacementEvent>>, Processor) {
    let (tx, rx) = mpsc::channel(16);
    (tx, Processor::new(config, rx, sink).unwrap())
}

#[tokio::test(start_paused = true)]
async fn without_a_timeout_every_list_boundary_flushes() {
    let sink = Arc::new(Collect::default());
    let (tx, p) = start(ProcessorConfig::default(), sink.clone());
    let task = tokio::spawn(p.run());
    tx.send(vec![removed(1, 1), removed(2, 2)]).await.unwrap();
    tx.send(vec![removed(3, 3)]).await.unwrap();
    drop(tx);
    let stats = task.await.unwrap();
    assert_eq!(sink.hashes(), vec![vec![1, 2], vec![3]]);
    assert_eq!(
        (stats.input_lists, stats.input_events, stats.output_events),
        (2, 3, 2)
    );
    assert_eq!(stats.merged_events, 1);
}

fn stored(id: u64, hash: u64) -> PlacementEvent {
    PlacementEvent {
        placement: AT,
        event: KvEvent {
            id,
            dp_rank: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: BlockHash(hash),
                    tokens_hash: TokensHash(hash),
                }],
            },
        },
    }
}

#[tokio::test(start_paused = true)]
async fn every_input_event_is_accounted_for() {
    let sink = Arc::new(Collect::default());
    let (tx, p) = start(ProcessorConfig::default(), sink.clone());
    let task = tokio::spawn(p.run());
    // Block 1 stored twice (no chain: not merged); its removal disappears in dedup.
    tx.send(vec![stored(1, 1), stored(2, 1)]).await.unwrap();
    tx.send(vec![removed(3, 1)]).await.unwrap();
    // Two removals of untracked blocks merge into one.
    tx.send(vec![removed(4, 2), removed(5, 3)]).await.unwrap();
    drop(tx);
    let stats = task.await.unwrap();
    assert_eq!(
        (
            stats.input_events,
            stats.output_events,
            stats.merged_events,
            stats.deduplicated_events,
            stats.withheld_events
        ),
        (5, 3, 1, 1, 0)
    );
    let published: usize = sink.batches.lock().unwrap().iter().map(Vec::len).sum();
    assert_eq!(published as u64, stats.output_events);
}

#[tokio::test(start_paused = true)]
async fn with_a_timeout_the_first_event_after_idle_goes_alone_then_batches() {
    let sink = Arc::new(Collect::default());
    let config = ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(100)));
    let (tx, p) = start(config, sink.clone());
    let task = tokio::spawn(p.run());
    // Idle for a while: the first list goes out at once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    tx.send(vec![removed(1, 1)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(sink.hashes(), vec![vec![1]]);
    // Within 100 ms of that flush, lists batch — across list boundaries.
    tx.send(vec![removed(2, 2)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    tx.send(vec![removed(3, 3)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(sink.hashes().len(), 1, "nothing before the timer");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(sink.hashes(), vec![vec![1], vec![2, 3]]);
    drop(tx);
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_list_is_never_split_by_the_timer() {
    let sink = Arc::new(Collect::default());
    let config = ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(10)));
    let (tx, p) = start(config, sink.clone());
    // Queue the whole list before the processor runs; its timer is long past.
    tx.send((1..=50).map(|i| removed(i, i)).collect())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let task = tokio::spawn(p.run());
    drop(tx);
    task.await.unwrap();
    assert_eq!(sink.hashes(), vec![(1..=50).collect::<Vec<u64>>()]);
}

#[tokio::test(start_paused = true)]
async fn cancellation_drains_what_is_queued_then_stops() {
    let sink = Arc::new(Collect::default());
    let config = ProcessorConfig::default().batch_timeout(Some(Duration::from_secs(10)));
    let (tx, p) = start(config, sink.clone());
    let token = CancellationToken::new();
    let p = p.cancellation(&token);
    for i in 1..=3 {
        tx.send(vec![removed(i, i)]).await.unwrap();
    }
    token.cancel();
    let stats = tokio::spawn(p.run()).await.unwrap();
    // Everything queued went out (merged: the 10 s timer never fired), then it stopped
    // with the sender still open.
    assert_eq!(sink.hashes(), vec![vec![1, 2, 3]]);
    assert_eq!(stats.input_lists, 3);
    assert!(tx.send(vec![removed(4, 4)]).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn raw_id_gaps_count_forward_jumps_only() {
    let sink = Arc::new(Collect::default());
    let (tx, p) = start(ProcessorConfig::default(), sink.clone());
    tx.send(vec![removed(10, 1), removed(11, 2), removed(15, 3)])
        .await
        .unwrap();
    // An engine restart: ids regress, not a gap; then continue densely.
    tx.send(vec![removed(0, 4), removed(1, 5), removed(4, 6)])
        .await
        .unwrap();
    drop(tx);
    let stats = p.run().await;
    assert_eq!((stats.input_gaps, stats.input_gap_events), (2, 5));
}

#[tokio::test(start_paused = true)]
async fn publish_errors_are_counted_and_processing_continues() {
    let sink = Arc::new(Collect {
        fail: true,
        ..Collect::default()
    });
    let (tx, p) = start(ProcessorConfig::default(), sink.clone());
    tx.send(vec![removed(1, 1)]).await.unwrap();
    tx.send(vec![removed(2, 2)]).await.unwrap();
    drop(tx);
    let stats = p.run().await;
    assert_eq!(stats.publish_errors, 2);
    assert_eq!(sink.hashes().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_stuck_sink_does_not_block_shutdown_forever() {
    let sink = Arc::new(Collect {
        hang: true,
        ..Collect::default()
    });
    let config = ProcessorConfig::default()
        .batch_timeout(Some(Duration::from_secs(10)))
        .publish_timeout(Duration::from_secs(2));
    let (tx, p) = start(config, sink.clone());
    tx.send(vec![removed(1, 1)]).await.unwrap();
    drop(tx);
    let start = tokio::time::Instant::now();
    let stats = p.run().await;
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(stats.publish_errors, 1);
}

#[tokio::test(start_paused = true)]
async fn a_sink_that_never_answers_costs_its_batch_not_the_loop() {
    let sink = Arc::new(Collect {
        hang: true,
        ..Collect::default()
    });
    let config = ProcessorConfig::default().publish_timeout(Duration::from_secs(1));
    let (tx, p) = start(config, sink.clone());
    let handle = p.handle();
    let task = tokio::spawn(p.run());
    // Flushed at the list boundary: the publish hangs while the loop is running.
    tx.send(vec![removed(1, 1)]).await.unwrap();
    tx.send(vec![removed(2, 2)]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    handle.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("a stuck sink blocked shutdown")
        .unwrap();
    // Both batches were tried, both abandoned after the timeout, both counted.
    assert_eq!(sink.hashes(), vec![vec![1], vec![2]]);
    assert_eq!((stats.publish_timeouts, stats.publish_errors), (2, 2));
    assert_eq!(stats.output_events, 2);
}

/// An index that cannot apply a clear.
struct BrokenClears(Arc<Mutex<Vec<u64>>>);

impl LocalIndex for BrokenClears {
    fn apply(&mut self, event: &RouterEvent) -> Result<(), IndexError> {
        if matches!(event.event.data, KvEventData::Cleared) {
            return Err(IndexError("disk full".into()));
        }
        self.0.lock().unwrap().push(event.event.id);
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_local_clear_fences_the_processor() {
    let sink = Arc::new(Collect::default());
    let applied = Arc::new(Mutex::new(Vec::new()));
    let token = CancellationToken::new();
    let (tx, p) = start(ProcessorConfig::default(), sink.clone());
    let p = p
        .with_local_index(Box::new(BrokenClears(applied.clone())))
        .cancellation(&token);
    tx.send(vec![removed(1, 1), cleared(2), removed(3, 3)])
        .await
        .unwrap();
    tx.send(vec![removed(4, 4)]).await.unwrap();
    let stats = p.run().await;
    assert!(stats.fenced);
    // The fence stopped this processor (its child token), not the caller's token.
    assert!(!token.is_cancelled());
    // Only what preceded the clear was published; the clear and everything after it
    // were withheld, and the second list was never processed.
    let published = sink.batches.lock().unwrap().clone();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].len(), 1);
    assert_eq!(applied.lock().unwrap().clone(), vec![1]);
    assert_eq!(stats.input_lists, 1);
    // The clear and the removal after it: withheld, and counted.
    assert_eq!((stats.input_events, stats.output_events), (3, 1));
    assert_eq!(stats.withheld_events, 2);
}
