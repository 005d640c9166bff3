//! The etcd watch: a task per watch that follows etcd and feeds a bounded backlog,
//! and the stream that drains it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use etcd_client::{Event, WatchOptions, WatchStream};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, warn};

use super::record::prefix_end;
use super::shared::{Shared, Sources};
use crate::discovery::backlog::{Backlog, Ended, WatchStream as Backlogged};
use crate::discovery::{DiscoveryError, DiscoveryEvent, DiscoveryStream, Instance, Query};
use crate::net::random_unit;

/// etcd's event type numbers (mvccpb.Event.EventType).
const PUT: i32 = 0;
const DELETE: i32 = 1;

/// Attempts at a consistent read + watch before `watch` gives up (each failure is a
/// compaction racing the read).
const ESTABLISH_ATTEMPTS: usize = 3;

/// Starts a watch: reads at revision R, watches from R + 1, waits for etcd's ack.
/// Cancelled before etcd acknowledged, it returns a stream that has ended at once.
pub(super) async fn start(
    shared: Arc<Shared>,
    query: Query,
    cancel: CancellationToken,
) -> Result<DiscoveryStream, DiscoveryError> {
    let prefix = shared.keys().query_prefix(&query);
    let mut attempt = 0;
    let (snapshot, sources, stream) = loop {
        attempt += 1;
        let established = tokio::select! {
            biased;
            () = cancel.cancelled() => {
                return Ok(DiscoveryStream::with_cancellation(Ended, cancel.clone()));
            }
            r = establish(&shared, &prefix, &query) => r,
        };
        match established {
            Ok(ok) => break ok,
            Err(Establish::Compacted(reason)) if attempt < ESTABLISH_ATTEMPTS => {
                debug!(%reason, "compaction raced the initial read; reading again");
            }
            Err(Establish::Compacted(reason)) => {
                return Err(DiscoveryError::WatchEnded { reason });
            }
            Err(Establish::Failed(e)) => return Err(e),
        }
    };
    let backlog = Backlog::start(
        shared.config_watch_buffer(),
        Arc::clone(&shared.counters.watch),
        snapshot,
    );
    let task_cancel = cancel.child_token();
    let span = tracing::debug_span!("etcd_watch", prefix = %prefix);
    tokio::spawn(
        Follower {
            shared,
            query,
            prefix,
            backlog: Arc::clone(&backlog),
            cancel: task_cancel.clone(),
            sources: std::sync::Mutex::new(sources),
        }
        .run(stream)
        .instrument(span),
    );
    Ok(DiscoveryStream::with_cancellation(
        Backlogged::following(backlog, task_cancel.drop_guard()),
        cancel,
    ))
}

enum Establish {
    /// The read revision was compacted before the watch started: read again.
    Compacted(String),
    Failed(DiscoveryError),
}

/// One consistent read, then a watch from the revision after it, acknowledged.
async fn establish(
    shared: &Shared,
    prefix: &str,
    query: &Query,
) -> Result<(Vec<Instance>, Sources, WatchStream), Establish> {
    let (revision, snapshot, sources) = shared
        .snapshot_with_sources(prefix, query)
        .await
        .map_err(Establish::Failed)?;
    let options = WatchOptions::new()
        .with_range(prefix_end(prefix.as_bytes()))
        .with_start_revision(revision.saturating_add(1))
        .with_prev_key();
    let mut client = shared.client().watch_client();
    let mut stream = shared
        .request("watch", client.watch(prefix, Some(options)))
        .await
        .map_err(Establish::Failed)?;
    let ack = shared
        .request("watch", stream.message())
        .await
        .map_err(Establish::Failed)?;
    match ack {
        Some(r) if r.created() && !r.canceled() => Ok((snapshot, sources, stream)),
        Some(r) if r.compact_revision() > 0 => Err(Establish::Compacted(format!(
            "revision {} compacted (compact revision {})",
            revision + 1,
            r.compact_revision()
        ))),
        Some(r) => Err(Establish::Failed(DiscoveryError::WatchEnded {
            reason: format!("etcd refused the watch: {}", r.cancel_reason()),
        })),
        None => Err(Establish::Failed(DiscoveryError::WatchEnded {
            reason: "etcd closed the watch stream before acknowledging it".to_owned(),
        })),
    }
}

/// The task following one etcd watch.
struct Follower {
    shared: Arc<Shared>,
    query: Query,
    prefix: String,
    backlog: Arc<Backlog>,
    cancel: CancellationToken,
    /// Dynamo's format: the recovery endpoint each publisher's `event_sources`
    /// record names (as many as etcd holds records, like the backlog's view).
    sources: std::sync::Mutex<Sources>,
}

impl Follower {
    async fn run(self, mut stream: WatchStream) {
        loop {
            let message = tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                m = stream.message() => m,
            };
            let problem = match message {
                Ok(Some(response)) if response.canceled() || response.compact_revision() > 0 => {
                    format!(
                        "watch canceled by etcd: {:?} (compact revision {})",
                        response.cancel_reason(),
                        response.compact_revision()
                    )
                }
                Ok(Some(response)) => {
                    self.apply(response.events());
                    continue;
                }
                Ok(None) => "etcd closed the watch stream".to_owned(),
                Err(e) => format!("watch stream failed: {e}"),
            };
            drop(stream);
            match self.reconnect(&problem).await {
                Some(s) => stream = s,
                None => break,
            }
        }
        self.backlog.finish();
    }

    /// Backs off, reads afresh, watches again and queues a `Resync`. `None` when
    /// cancelled first: every step (the backoff, each page of the read, the watch's
    /// creation and its acknowledgement) gives way to the token, which the consumer's
    /// stream also cancels when dropped, so a watch cancelled against an unreachable
    /// etcd stops at once instead of after its request timeouts.
    async fn reconnect(&self, problem: &str) -> Option<WatchStream> {
        if let Some(suppressed) = self
            .shared
            .warn
            .check("watch-reconnect", std::time::Instant::now())
        {
            warn!(problem, suppressed, "etcd watch lost; reconnecting");
        }
        let mut backoff = self.shared.backoff();
        loop {
            let delay = backoff.next_delay(random_unit());
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return None,
                () = tokio::time::sleep(delay) => {}
            }
            let established = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return None,
                r = establish(&self.shared, &self.prefix, &self.query) => r,
            };
            match established {
                Ok((snapshot, sources, stream)) => {
                    *self.sources.lock().unwrap_or_else(|e| e.into_inner()) = sources;
                    self.shared
                        .counters
                        .reconnects
                        .fetch_add(1, Ordering::Relaxed);
                    debug!(
                        instances = snapshot.len(),
                        "etcd watch re-established; resyncing"
                    );
                    self.backlog.resync(snapshot);
                    return Some(stream);
                }
                Err(Establish::Compacted(reason)) => debug!(%reason, "reading again"),
                Err(Establish::Failed(e)) => {
                    debug!(error = %crate::net::ErrorChain(&e), "etcd watch reconnect failed")
                }
            }
        }
    }

    fn apply(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let keys = self.shared.keys();
        let max_value = self.shared.config.max_value_bytes;
        let mut st = self.backlog.lock();
        let mut pushed = false;
        // Dynamo's `event_sources` first: a channel written in the same transaction
        // is announced with its recovery endpoint at once.
        let mut sources = self.sources.lock().unwrap_or_else(|e| e.into_inner());
        let mut named = Vec::new();
        for event in events {
            let Some(kv) = event.kv() else { continue };
            let value = (event.0.r#type == PUT).then(|| kv.value());
            match keys.source(kv.key(), value, max_value) {
                Some(Ok((id, _))) if !self.query.matches(&id) => {}
                Some(Ok((id, Some(recovery)))) if sources.get(&id) != Some(&recovery) => {
                    sources.insert(id.clone(), recovery);
                    named.push(id);
                }
                Some(Ok((_, Some(_)))) => {}
                // Deleted, or no longer naming one: the publisher again, without it.
                Some(Ok((id, None))) if sources.remove(&id).is_some() => named.push(id),
                Some(Ok((_, None))) => {}
                Some(Err(e)) => {
                    self.shared.skipped(kv.key(), &e);
                    // A record turned malformed names no recovery endpoint any more.
                    let id = keys.source(kv.key(), None, max_value).and_then(Result::ok);
                    if let Some((id, _)) = id.filter(|(id, _)| sources.remove(id).is_some()) {
                        named.push(id);
                    }
                }
                None => {}
            }
        }
        for event in events {
            let Some(kv) = event.kv() else { continue };
            if keys.source(kv.key(), None, max_value).is_some() {
                continue;
            }
            let change = match event.0.r#type {
                PUT => match keys.parse(kv.key(), kv.value(), kv.mod_revision(), max_value) {
                    Ok(Some(mut instance)) if self.query.matches(&instance.id) => {
                        if let Some(recovery) = sources.get(&instance.id) {
                            instance.recovery = Some(recovery.clone());
                        }
                        match st.current.get_mut(&instance.id) {
                            // Same endpoint again (a detach, or a foreign refresh):
                            // not a change. Track the newer revision silently.
                            Some(known)
                                if known.transport == instance.transport
                                    && known.recovery == instance.recovery =>
                            {
                                known.incarnation = known.incarnation.max(instance.incarnation);
                                None
                            }
                            Some(known) if known.incarnation > instance.incarnation => None,
                            _ => {
                                st.current.insert(instance.id.clone(), instance.clone());
                                Some(DiscoveryEvent::Added(instance))
                            }
                        }
                    }
                    Ok(_) => None,
                    Err(e) => {
                        self.shared.skipped(kv.key(), &e);
                        // A record that turned malformed no longer names a publisher.
                        keys.id_of(kv.key())
                            .ok()
                            .and_then(|id| st.current.remove(&id))
                            .map(|old| DiscoveryEvent::Removed {
                                id: old.id,
                                incarnation: old.incarnation,
                            })
                    }
                },
                DELETE => keys
                    .id_of(kv.key())
                    .ok()
                    .and_then(|id| st.current.remove(&id))
                    .map(|old| {
                        let deleted = event
                            .prev_kv()
                            .and_then(|p| u64::try_from(p.mod_revision()).ok())
                            .unwrap_or(0);
                        DiscoveryEvent::Removed {
                            id: old.id,
                            incarnation: old.incarnation.max(deleted),
                        }
                    }),
                other => {
                    self.shared
                        .counters
                        .malformed
                        .fetch_add(1, Ordering::Relaxed);
                    debug!(event_type = other, "skipping an etcd event of unknown type");
                    None
                }
            };
            if let Some(change) = change {
                pushed = true;
                self.backlog.push(&mut st, change);
            }
        }
        // A recovery endpoint named, changed or gone after its channel: the publisher
        // again, as it is now.
        for id in named {
            let recovery = sources.get(&id).cloned();
            let Some(known) = st.current.get_mut(&id) else {
                continue;
            };
            if known.recovery != recovery {
                known.recovery = recovery;
                let again = DiscoveryEvent::Added(known.clone());
                pushed = true;
                self.backlog.push(&mut st, again);
            }
        }
        Backlog::wake(st, pushed);
    }
}
