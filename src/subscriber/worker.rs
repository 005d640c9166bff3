//! The subscriber's tasks: the discovery watch loop that reconciles publishers, and
//! one connection task per publisher that reads into its lane.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::config::Config;
use super::link::Link;
use super::notice::{Notice, Notices};
use super::shared::{Delivery, PublisherCell, Shared};
use super::stats::Counters;
use crate::discovery::{ChannelId, DiscoveryEvent, Instance, Rewatch, Rewatched};
use crate::lossy::Merge;
use crate::net::{Backoff, random_unit};
use crate::wire::{MalformedStats, SeqStep, SeqTracker, WireError};
use crate::zmtp::{Error as ZmtpError, SubSocket};

/// After discovery removes a publisher, its connection keeps reading for up to this
/// long (or until the publisher closes it), so messages already sent are delivered.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// How often departed publishers whose lanes drained are folded into the totals (and
/// their lanes let go) when nothing else does it.
const SETTLE_INTERVAL: Duration = Duration::from_secs(1);

/// What the watch loop tracks per publisher.
struct Tracked {
    incarnation: u64,
    endpoint: String,
    /// Soft stop: finish reading what is in flight, then exit.
    drain: CancellationToken,
}

/// The discovery watch loop: re-watches with backoff, reconciles every event, and
/// closes the merge when cancelled.
pub(crate) async fn watch_loop(
    shared: Arc<Shared>,
    config: Arc<Config>,
    merge: Arc<Merge<Delivery>>,
) {
    let mut tracked = Tracking::default();
    let mut watch = Rewatch::new(
        config.discovery.clone(),
        config.query.clone(),
        Backoff::checked(config.rewatch_min, config.rewatch_max),
        config.cancel.clone(),
    );
    let mut settle = tokio::time::interval(SETTLE_INTERVAL);
    settle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            next = watch.next() => next,
            _ = settle.tick() => {
                // Departed publishers whose lanes drained let their lanes go.
                shared.settle_retired();
                // Read buffers whose frames the consumer has since dropped are freed.
                shared.retention.prune();
                continue;
            }
        };
        match next {
            None => break,
            Some(Rewatched::Event(event)) => apply(&shared, &config, &merge, &mut tracked, event),
            Some(Rewatched::Failed(e)) => {
                shared.rewatches.fetch_add(1, Ordering::Relaxed);
                warn_limited(&shared, "watch", || {
                    tracing::warn!(error = %crate::net::ErrorChain(&e), "discovery watch failed; retrying with backoff");
                });
            }
            Some(Rewatched::Ended(e)) => {
                shared.rewatches.fetch_add(1, Ordering::Relaxed);
                if let Some(e) = e {
                    warn_limited(&shared, "watch", || {
                        tracing::warn!(error = %crate::net::ErrorChain(&e), "discovery watch ended; re-watching, existing connections kept");
                    });
                }
            }
        }
    }
    // Cancelling the subscriber's token has already stopped every connection.
    tracked.followed.clear();
    merge.close();
}

fn warn_limited(shared: &Shared, key: &str, log: impl FnOnce()) {
    if shared.warn.check(key, Instant::now()).is_some() {
        log();
    }
}

/// What the watch loop knows of discovered publishers: the followed ones, and those
/// whose topic is not the subscriber's (not followed, counted).
#[derive(Default)]
struct Tracking {
    followed: HashMap<ChannelId, Tracked>,
    other_topic: std::collections::HashSet<ChannelId>,
}

fn apply(
    shared: &Arc<Shared>,
    config: &Arc<Config>,
    merge: &Arc<Merge<Delivery>>,
    tracking: &mut Tracking,
    event: DiscoveryEvent,
) {
    match event {
        DiscoveryEvent::Added(instance) => upsert(shared, config, merge, tracking, instance),
        DiscoveryEvent::Removed { id, incarnation } => {
            tracking.other_topic.remove(&id);
            // A late removal of an older incarnation must not cut its replacement.
            if tracking
                .followed
                .get(&id)
                .is_some_and(|t| incarnation >= t.incarnation)
            {
                stop(&mut tracking.followed, &id);
            }
        }
        DiscoveryEvent::Resync(all) => {
            shared.synced.store(true, Ordering::Relaxed);
            tracking.other_topic.clear();
            let keep: std::collections::HashSet<&ChannelId> = all.iter().map(|i| &i.id).collect();
            let gone: Vec<ChannelId> = tracking
                .followed
                .keys()
                .filter(|id| !keep.contains(id))
                .cloned()
                .collect();
            for id in gone {
                stop(&mut tracking.followed, &id);
            }
            for instance in all {
                upsert(shared, config, merge, tracking, instance);
            }
        }
    }
    shared
        .other_topic_publishers
        .store(tracking.other_topic.len(), Ordering::Relaxed);
}

fn upsert(
    shared: &Arc<Shared>,
    config: &Arc<Config>,
    merge: &Arc<Merge<Delivery>>,
    tracking: &mut Tracking,
    instance: Instance,
) {
    if let Some(topic) = &config.topic {
        if instance.id.topic().as_bytes() != &topic[..] {
            // None of its messages could match: following it would only look like a
            // silent publisher.
            if tracking.other_topic.len() < config.max_publishers {
                tracking.other_topic.insert(instance.id.clone());
            }
            stop(&mut tracking.followed, &instance.id);
            warn_limited(shared, "other_topic", || {
                tracing::warn!(
                    id = %instance.id,
                    publisher_topic = %instance.id.topic(),
                    subscriber_topic = %String::from_utf8_lossy(topic),
                    "discovered publisher has another topic: not followed \
                     (counted in other_topic_publishers)"
                );
            });
            return;
        }
    }
    tracking.other_topic.remove(&instance.id);
    let tracked = &mut tracking.followed;
    let endpoint = instance.transport.endpoint().to_owned();
    if !tracked.contains_key(&instance.id) && tracked.len() >= config.max_publishers {
        crate::counter::add(&shared.refused_publishers, 1);
        warn_limited(shared, "max_publishers", || {
            tracing::warn!(
                max_publishers = config.max_publishers,
                id = %instance.id,
                "publisher limit reached: not following this publisher (counted)"
            );
        });
        return;
    }
    if let Some(t) = tracked.get_mut(&instance.id) {
        if instance.incarnation < t.incarnation {
            return;
        }
        if t.endpoint == endpoint {
            // Same endpoint, newer incarnation: keep the connection.
            t.incarnation = instance.incarnation;
            if let Some(cell) = shared.lock().get(&instance.id) {
                *cell.instance.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(instance);
            }
            return;
        }
        tracing::debug!(id = %instance.id, %endpoint, "publisher moved; replacing its connection");
        stop(tracked, &instance.id.clone());
    }
    tracing::debug!(id = %instance.id, %endpoint, worker = ?instance.worker, "following a discovered publisher");
    let cancel = config.cancel.child_token();
    let drain = CancellationToken::new();
    let cell = Arc::new(PublisherCell {
        instance: Mutex::new(Arc::new(instance.clone())),
        counters: Counters::default(),
        lane: merge.lane(),
        ended: std::sync::atomic::AtomicBool::new(false),
    });
    shared.insert(instance.id.clone(), cell.clone());
    tracked.insert(
        instance.id.clone(),
        Tracked {
            incarnation: instance.incarnation,
            endpoint: endpoint.clone(),
            drain: drain.clone(),
        },
    );
    let span = tracing::debug_span!(
        "publisher",
        publisher_id = instance.id.publisher_id(),
        %endpoint
    );
    shared.tracker.spawn(
        connection_loop(
            shared.clone(),
            config.clone(),
            instance.id.clone(),
            cell,
            endpoint,
            cancel,
            drain,
        )
        .instrument(span),
    );
}

fn stop(tracked: &mut HashMap<ChannelId, Tracked>, id: &ChannelId) {
    if let Some(t) = tracked.remove(id) {
        // The connection finishes reading what is in flight (bounded by
        // `DRAIN_GRACE`), then its task retires the publisher's counters.
        t.drain.cancel();
        tracing::debug!(%id, "publisher gone; draining its connection");
    }
}

/// One publisher: dial, handshake, subscribe, read; on failure back off and dial again,
/// until cancelled.
async fn connection_loop(
    shared: Arc<Shared>,
    config: Arc<Config>,
    id: ChannelId,
    cell: Arc<PublisherCell>,
    endpoint: String,
    cancel: CancellationToken,
    drain: CancellationToken,
) {
    // A publisher back under the same id continues from where it departed (its
    // predecessor, if still draining, hands its state over within its grace).
    let sequences = || {
        shared
            .departed_sequences
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    };
    if !sequences().enter(&id) {
        let handed_over = async {
            loop {
                let told = shared.sequence_handover.notified();
                tokio::pin!(told);
                told.as_mut().enable();
                if !sequences().has_predecessor(&id) {
                    return;
                }
                told.await;
            }
        };
        let _ = tokio::time::timeout(DRAIN_GRACE + Duration::from_secs(1), handed_over).await;
    }
    let mut seq = sequences().take(&id);
    seq.new_connection();
    run_connection(
        &shared, &config, &cell, &endpoint, &mut seq, &cancel, &drain,
    )
    .await;
    shared.retire(&id, &cell);
    sequences().leave(&id, seq);
    shared.sequence_handover.notify_waiters();
}

async fn run_connection(
    shared: &Shared,
    config: &Config,
    cell: &PublisherCell,
    endpoint: &str,
    seq: &mut SeqTracker,
    cancel: &CancellationToken,
    drain: &CancellationToken,
) {
    let mut backoff = Backoff::checked(config.reconnect_min, config.reconnect_max);
    // When the latest connection was made (none yet: `None`).
    let mut connected_at = None;
    while !cancel.is_cancelled() && !drain.is_cancelled() {
        let previous = connected_at;
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            r = connect_and_read(shared, config, cell, endpoint, seq, &mut connected_at, drain) => r,
        };
        if drain.is_cancelled() {
            return;
        }
        // Connected (this time) at least `healthy_after` ago: the next failure starts
        // the backoff over.
        if connected_at != previous
            && connected_at.is_some_and(|at| at.elapsed() >= config.healthy_after)
        {
            backoff.reset();
        }
        let key = format!("conn:{endpoint}");
        match &outcome {
            // (Drain is set, returned above.)
            Outcome::Left => return,
            Outcome::Refused(addr) => warn_limited(shared, &key, || {
                tracing::warn!(%addr, "endpoint refused by the address filter; not dialling");
            }),
            // A clean close is what a publisher leaving discovery does (its removal
            // usually arrives a moment later): not worth a warning. A publisher that
            // is really gone fails the reconnect, and that warns.
            Outcome::Failed(ZmtpError::Closed) => {
                tracing::debug!(
                    "publisher closed its connection; reconnecting with backoff unless it left discovery"
                );
            }
            Outcome::Failed(e) => warn_limited(shared, &key, || {
                tracing::warn!(error = %crate::net::ErrorChain(&e), "publisher connection failed; reconnecting with backoff");
            }),
        }
        let delay = backoff.next_delay(random_unit());
        tokio::select! {
            () = cancel.cancelled() => return,
            () = drain.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// Resolves when `drain` has been signalled and `DRAIN_GRACE` has passed since.
async fn drain_deadline(drain: &CancellationToken) {
    drain.cancelled().await;
    tokio::time::sleep(DRAIN_GRACE).await;
}

enum Outcome {
    Refused(String),
    Failed(ZmtpError),
    /// The publisher left discovery before it was connected.
    Left,
}

async fn connect_and_read(
    shared: &Shared,
    config: &Config,
    cell: &PublisherCell,
    endpoint: &str,
    seq: &mut SeqTracker,
    connected_at: &mut Option<tokio::time::Instant>,
    drain: &CancellationToken,
) -> Outcome {
    let counters = &cell.counters;
    let instance = cell
        .instance
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    // Boxed: the dial's state (resolution, connect, handshake) lives only while it
    // runs, so the connection task stays the size of its reading state.
    // A publisher that leaves discovery gives up its place in the queue for a permit,
    // and its dial.
    let dialled = async {
        tokio::select! {
            r = async {
                // Never closed, so a permit always comes; held through the handshake.
                let _permit = shared.dials.acquire().await;
                dial(shared, config, &instance).await
            } => Some(r),
            () = drain.cancelled() => None,
        }
    };
    let mut sub = match Box::pin(dialled).await {
        None => return Outcome::Left,
        Some(Ok(s)) => s,
        Some(Err(ZmtpError::Refused { addr })) => {
            Counters::add(&counters.refused_by_filter, 1);
            return Outcome::Refused(addr.to_string());
        }
        Some(Err(e)) => {
            Counters::add(&counters.connect_failures, 1);
            return Outcome::Failed(e);
        }
    };
    if connected_at.is_some() {
        Counters::add(&counters.reconnects, 1);
    }
    // Health is judged from here: waiting for a permit and dialling are not health.
    *connected_at = Some(tokio::time::Instant::now());
    seq.new_connection();
    tracing::debug!("connected");
    if config.expect_worker_identity && instance.worker.is_none() {
        let key = format!("unidentified:{}", instance.id);
        if let Some(suppressed) = shared.warn.check(&key, Instant::now()) {
            tracing::warn!(
                id = %instance.id,
                suppressed,
                "publisher registered no worker identity: its deliveries have no `source.worker` \
                 (a worker registers one with EventPublisherBuilder::worker, kv-relay from \
                 --worker-id; other registrars write the record's `worker` field)"
            );
        }
    }
    if shared.notices.enabled() {
        let instance = cell
            .instance
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        shared.notices.push(Notice::Connected(instance));
    }
    // Made on the first warning: an idle connection holds no key.
    let (mut drop_key, mut malformed_key) = (None::<String>, None::<String>);
    // Created once: a publisher that keeps sending after it left discovery is cut
    // `DRAIN_GRACE` after the removal, not kept alive batch after batch.
    let deadline = drain_deadline(drain);
    tokio::pin!(deadline);
    loop {
        let source = cell
            .instance
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut filing = Filing::new(cell, &shared.notices);
        // The socket hands each message straight to `filing`, which pushes the call's
        // messages into the lane under one lock; its vector lives for the call only,
        // so between reads a connection holds no batch.
        // `recv_with` is cancel-safe: the drain deadline loses nothing.
        let received = tokio::select! {
            r = sub.recv_with(config.recv_batch, |message| {
                filing.file(config, seq, &source, message);
            }) => Some(r),
            () = &mut deadline => None,
        };
        let (dropped, malformed) = filing.flush();
        if malformed.total() > 0 {
            let key = malformed_key.get_or_insert_with(|| format!("malformed:{endpoint}"));
            if let Some(suppressed) = shared.warn.check(key, Instant::now()) {
                tracing::warn!(
                    %endpoint,
                    layout = ?config.layout,
                    malformed = malformed.total(),
                    wrong_frames = malformed.frames,
                    earlier_malformed_events = suppressed,
                    "messages do not fit the subscriber's layout and are dropped (counted in \
                     stats): does this publisher send another layout? EventPublisher sends \
                     TopicPublisherSeq (the default), engines TopicSeq, Dynamo's workers Dynamo"
                );
            }
        }
        if dropped > 0 {
            let key = drop_key.get_or_insert_with(|| format!("drop:{endpoint}"));
            if let Some(suppressed) = shared.warn.check(key, Instant::now()) {
                tracing::warn!(
                    dropped,
                    earlier_drop_events = suppressed,
                    "consumer is slow: dropping this publisher's messages (lane or budget full); \
                     counted in stats"
                );
            }
        }
        match received {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Outcome::Failed(e),
            None => return Outcome::Failed(ZmtpError::SocketClosed),
        }
    }
}

/// Slots a receive's filing vector starts with; it grows if the receive brings more.
const FILING_START: usize = 16;

/// One receive's messages on their way into the publisher's lane: located by the
/// layout, sequence-checked, and pushed into the lane together (one lock of the
/// merge, one wake of the consumer), with the counters updated before the push (so
/// `received` never trails what the lane counts).
struct Filing<'a> {
    cell: &'a PublisherCell,
    notices: &'a Notices,
    /// Grows with the receive (from [`FILING_START`] slots), freed after it.
    out: Vec<(Delivery, usize)>,
    received: u64,
    bytes: u64,
    filtered: u64,
    malformed: MalformedStats,
    /// The first and last sequences filed, noted in the counters with `received`.
    sequences: Option<(u64, u64)>,
}

impl<'a> Filing<'a> {
    fn new(cell: &'a PublisherCell, notices: &'a Notices) -> Filing<'a> {
        Filing {
            cell,
            notices,
            out: Vec::new(),
            received: 0,
            bytes: 0,
            filtered: 0,
            malformed: MalformedStats::default(),
            sequences: None,
        }
    }

    fn file(
        &mut self,
        config: &Config,
        seq: &mut SeqTracker,
        source: &Arc<Instance>,
        message: crate::zmtp::Message,
    ) {
        let size = message.byte_len();
        self.received += 1;
        self.bytes += size as u64;
        match config.layout.locate(config.topic.as_deref(), &message) {
            Ok(framed) => {
                if let Some(s) = framed.sequence {
                    let counters = &self.cell.counters;
                    self.sequences = Some(self.sequences.map_or((s, s), |(f, _)| (f, s)));
                    match seq.observe_from(framed.publisher_id, s) {
                        SeqStep::InOrder => {}
                        SeqStep::Gap(missing) => {
                            Counters::add(&counters.gaps, 1);
                            Counters::add(&counters.gap_messages, missing);
                            self.notices.push(Notice::Gap {
                                id: source.id.clone(),
                                missing,
                            });
                        }
                        SeqStep::Reset => {
                            Counters::add(&counters.sequence_resets, 1);
                            self.notices.push(Notice::Reset {
                                id: source.id.clone(),
                            });
                        }
                    }
                }
                if self.out.capacity() == 0 {
                    // A receive of one message (a trickle over thousands of publishers)
                    // must not allocate a full batch.
                    self.out.reserve(FILING_START);
                }
                self.out.push((
                    Delivery::new(source.clone(), framed.sequence, message, framed.payload_at),
                    size,
                ));
            }
            Err(WireError::WrongTopic) => self.filtered += 1,
            Err(e) => self.malformed.count(&e),
        }
    }

    /// Counts what was filed and pushes it into the lane; returns the lane's drops
    /// and the messages the layout refused.
    fn flush(mut self) -> (usize, MalformedStats) {
        let counters = &self.cell.counters;
        Counters::add(&counters.received, std::mem::take(&mut self.received));
        Counters::add(&counters.bytes, std::mem::take(&mut self.bytes));
        Counters::add(&counters.filtered_topic, std::mem::take(&mut self.filtered));
        if let Some((first, last)) = self.sequences.take() {
            counters.sequence(first);
            counters.sequence(last);
        }
        let malformed = std::mem::take(&mut self.malformed);
        if malformed.total() > 0 {
            Counters::add(&counters.malformed, malformed.total());
            counters.malformed_by_reason.add(&malformed);
        }
        if self.out.is_empty() {
            return (0, malformed);
        }
        (self.cell.lane.push_many(self.out), malformed)
    }
}

/// Resolves, checks the addresses against the filter (DNS rebinding is caught at dial
/// time), dials, handshakes and subscribes.
async fn dial(
    shared: &Shared,
    config: &Config,
    instance: &Instance,
) -> Result<SubSocket<Link>, ZmtpError> {
    let endpoint = instance.transport.endpoint();
    let link = match tunnel_link(config, instance).await {
        Some(link) => link?,
        None => Link::Tcp(
            crate::zmtp::dial_filtered(endpoint, &config.zmtp, &config.addr_filter).await?,
        ),
    };
    // Every connection counts the read buffers its messages keep alive in one
    // account: past `max_retained_bytes` in total, small frames are copied out.
    let mut sub =
        SubSocket::handshake_sharing(link, config.zmtp.clone(), shared.retention.clone()).await?;
    // Re-subscribed on every new connection.
    sub.subscribe(config.topic.clone().unwrap_or_default())
        .await?;
    Ok(sub)
}

/// A stream through the broker that owns `instance`, when the configured bus grants
/// its namespace; `None` to dial directly (not granted, or no broker up and the
/// direct fallback on).
#[cfg(feature = "tunnel")]
async fn tunnel_link(config: &Config, instance: &Instance) -> Option<Result<Link, ZmtpError>> {
    let announced = instance.transport.is_announced();
    let Some(bus) = config.bus.as_ref() else {
        // Announced by a source on a bus: reached only through it.
        return announced.then(|| {
            Err(ZmtpError::Io(std::io::Error::other(
                "an announced publisher is reached only through the bus it was announced on (DynamicSubscriberBuilder::tunnel)",
            )))
        });
    };
    let opened = bus
        .reach(
            &instance.id,
            instance.transport.endpoint(),
            announced,
            false,
            config.tunnel_direct_fallback,
        )
        .await?;
    Some(
        opened
            .map(Link::Tunnel)
            .map_err(|e| ZmtpError::Io(std::io::Error::other(e))),
    )
}

#[cfg(not(feature = "tunnel"))]
async fn tunnel_link(_: &Config, instance: &Instance) -> Option<Result<Link, ZmtpError>> {
    instance.transport.is_announced().then(|| {
        Err(ZmtpError::Io(std::io::Error::other(
            "an announced publisher is reached only through an event bus (feature `tunnel`)",
        )))
    })
}
