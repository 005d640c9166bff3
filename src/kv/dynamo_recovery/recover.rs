//! A router's repair from a Dynamo worker: one [`RecoveryRequest`] asked through a
//! [`CallHomeListener`], its answer as [`Recovered`] (what the
//! [`RecoveryDriver`](crate::kv::router::RecoveryDriver) hands the feed), by Dynamo 1.6.1's
//! router rules where they differ from ours.

use super::client::{CallHomeListener, DynamoQueryError, QueryTarget};
use super::query::{KvAnswer, KvQuery};
use crate::kv::{
    pipeline::Dump,
    router::{Recovered, RecoveryClientConfig, RecoveryError, RecoveryRequest},
};

/// Asks the Dynamo worker `endpoint` names (`dynamo+CODEC://…`, see
/// [`QueryTarget::parse`]) for `request`, within the config's timeout and bounds.
///
/// - `Since(after)` asks from `after + 1`; `Events` answer the events and the id they
///   lead up to (`last_event_id`). A worker that answers part of them (ours answers
///   at most so many) is asked again past that id, within the timeout and bounds,
///   until an answer brings nothing new.
/// - `Dump` asks with no start; a `TreeDump` is the dump (its chains take its
///   `last_event_id`).
/// - `TooNew` for a start just past the worker's newest event is an empty `Events`
///   (nothing was missed).
/// - Any other `TooNew`, `InvalidRange`, `TreeDumpFailed` and `Error` are refusals: not asked
///   again until the publisher is heard from. (Dynamo's router applies what it held
///   instead, leaving the lost events out; the feed wipes the worker rather than
///   keep blocks it may no longer hold.)
pub(crate) async fn recover_dynamo(
    listener: &CallHomeListener,
    endpoint: &str,
    request: RecoveryRequest,
    config: &RecoveryClientConfig,
) -> Result<Recovered, RecoveryError> {
    let target = QueryTarget::parse(endpoint)
        .ok_or(RecoveryError::Malformed("not a Dynamo recovery target"))?;
    let start = match request {
        RecoveryRequest::Since(after) => Some(after.saturating_add(1)),
        RecoveryRequest::Dump => None,
    };
    let deadline = tokio::time::Instant::now() + config.timeout;
    let filter = config.filter.as_ref();
    let mut answer = ask(listener, &target, start, deadline, filter).await?;
    // The rest of a partial answer, while the worker has more.
    if let (
        KvAnswer::Events {
            events,
            last_event_id,
        },
        Some(_),
    ) = (&mut answer, start)
    {
        let mut rounds = 0;
        while rounds < MAX_ROUNDS && !events.is_empty() {
            rounds += 1;
            // A failed follow-up leaves a shorter answer, still a true one.
            let after = Some(last_event_id.saturating_add(1));
            let Ok(next) = ask(listener, &target, after, deadline, filter).await else {
                break;
            };
            match next {
                // Kept only within the bound on one answer: past it, the answer
                // stops where it was (the feed asks again from there).
                KvAnswer::Events {
                    events: more,
                    last_event_id: last,
                } if last > *last_event_id
                    && weight(events).saturating_add(weight(&more)) <= config.max_blocks =>
                {
                    let done = more.is_empty();
                    events.extend(more);
                    *last_event_id = last;
                    if done {
                        break;
                    }
                }
                // Nothing past it (`TooNew`, or no progress): complete.
                _ => break,
            }
        }
    }
    finish(answer, start, config)
}

/// Follow-up queries for one partial answer, at most.
const MAX_ROUNDS: usize = 64;

/// What an answer's events weigh against `max_blocks`: their blocks (stored or
/// removed), and one for each event.
fn weight(events: &[crate::kv::RouterEvent]) -> usize {
    events
        .iter()
        .map(|e| e.event.data.block_count().saturating_add(1))
        .fold(0usize, usize::saturating_add)
}

/// One query, within what is left of the request's time.
async fn ask(
    listener: &CallHomeListener,
    target: &QueryTarget,
    start: Option<u64>,
    deadline: tokio::time::Instant,
    filter: Option<&crate::net::AddrFilter>,
) -> Result<KvAnswer, RecoveryError> {
    let query = KvQuery::recovery(target.worker_id, target.dp_rank, start);
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    listener
        .query_through(target, &query, left, filter)
        .await
        .map_err(|e| match e {
            DynamoQueryError::Io(e) => RecoveryError::Connection(crate::zmtp::Error::Io(e)),
            DynamoQueryError::Timeout(t) => RecoveryError::Timeout(t),
            DynamoQueryError::Busy => RecoveryError::Busy,
            DynamoQueryError::Frame(_) => RecoveryError::TooLarge(listener.max_body()),
            DynamoQueryError::Malformed(_) => RecoveryError::Malformed("a Dynamo answer"),
            DynamoQueryError::Refused(why) => RecoveryError::Refused(why),
        })
}

/// An answer as the feed takes it.
fn finish(
    answer: KvAnswer,
    start: Option<u64>,
    config: &RecoveryClientConfig,
) -> Result<Recovered, RecoveryError> {
    match answer {
        // Asked from just past its newest: nothing was missed (Dynamo's worker calls
        // that too new; ours answers no events).
        KvAnswer::TooNew {
            newest_available, ..
        } if start == Some(newest_available.saturating_add(1)) => Ok(Recovered::Events {
            events: Vec::new(),
            current_id: newest_available,
        }),
        KvAnswer::Events {
            events,
            last_event_id,
        } => {
            if weight(&events) > config.max_blocks {
                return Err(RecoveryError::TooManyBlocks(config.max_blocks));
            }
            Ok(Recovered::Events {
                events,
                current_id: last_event_id,
            })
        }
        KvAnswer::TreeDump {
            mut events,
            last_event_id,
        } => {
            if events
                .iter()
                .map(|e| e.event.data.block_count())
                .sum::<usize>()
                > config.max_blocks
            {
                return Err(RecoveryError::TooManyBlocks(config.max_blocks));
            }
            for e in &mut events {
                e.event.id = last_event_id;
            }
            Ok(Recovered::Dump(Dump {
                events,
                current_id: last_event_id,
                complete: true,
            }))
        }
        other => Err(RecoveryError::Refused(other.summary())),
    }
}
