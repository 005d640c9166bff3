//! A source (DESIGN §7.4): a KV listener the router cannot reach dials out to the
//! router's event bus, announces its publishers, and serves every `subscribe` for one
//! of them from that publisher's own socket, as one more subscriber connection.

pub(crate) mod config;
pub(crate) mod serving;
#[cfg(test)]
mod tests;

pub use config::SourceConfig;
pub use serving::RecoveryStreams;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::Request;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::net::random_unit;
use crate::tunnel::client::{BusSession, Ending, Outcome, feed, open_session};
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::{BrokerBody, ChannelBody, StreamBytes, TUNNEL_WRITE_CHUNKS, next_chunk};
use crate::tunnel::protocol::announce::AnnouncedSource;
use crate::tunnel::protocol::codes::CodeCounts;
use crate::tunnel::source::serving::{Announced, Serving};
use crate::tunnel::{
    BrokerEvent, BrokerSession, CloseCode, ControlDecoder, Hello, MAX_ANNOUNCE, Reconnect,
    RefuseCode,
};
use crate::zmtp::StreamAcceptor;

/// How long a [`Source`] waits to announce again the publishers the bus refused
/// ([`SourceStats::refused_publishers`]); a publisher counts as refused until twice
/// this has passed since its last refusal.
pub(crate) const ANNOUNCE_RETRY: Duration = Duration::from_secs(10);

/// `announce` frames a [`Source`] keeps short of the router's
/// [`ANNOUNCE_BURST`](crate::tunnel::ANNOUNCE_BURST): the router's bucket starts when it
/// accepts the session, up to this many frames' time (at
/// [`ANNOUNCES_PER_SECOND`](crate::tunnel::ANNOUNCES_PER_SECOND), a second) after the
/// source's.
const ANNOUNCE_PACE_MARGIN: u32 = 4;

/// Counters of a [`Source`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SourceStats {
    /// Sessions the bus welcomed.
    pub sessions: u64,
    /// Session attempts that failed, and welcomed sessions that ended without a drain.
    pub session_failures: u64,
    /// Whether a session is welcomed now.
    pub connected: bool,
    /// Publishers announced now.
    pub announced: usize,
    /// Data streams opened (subscribers served through the bus).
    pub streams_opened: u64,
    /// Data streams open now.
    pub streams_open: u64,
    /// Subscribes refused, by code.
    pub refused: HashMap<String, u64>,
    /// Sessions the bus denied, by code (`DenyCode`).
    pub denied: HashMap<String, u64>,
    /// Announced publishers the bus refused, by code (`AnnounceRefusal`): another
    /// source's credential holds the channel, or the bus (or this credential's share
    /// of it) is full.
    pub announce_refused: HashMap<String, u64>,
    /// Publishers the bus refuses now (refused within twice 10 s): a
    /// source with any is not fully served (kv-relay's `/readyz` fails).
    pub refused_publishers: usize,
    /// Bytes sent to the router.
    pub bytes_up: u64,
    /// Bytes read from the router (subscriptions, handshakes).
    pub bytes_down: u64,
}

/// What the session tasks and the handles share.
struct Shared {
    config: SourceConfig,
    /// The publishers to announce, and where each serves its subscribers.
    publishers: Mutex<HashMap<u64, Announced>>,
    /// Told when `publishers` changed.
    changed: Notify,
    sessions: AtomicU64,
    session_failures: AtomicU64,
    connected: AtomicBool,
    streams_opened: AtomicU64,
    open: AtomicU64,
    refused: CodeCounts,
    denied: CodeCounts,
    announce_refused: CodeCounts,
    /// When the bus last refused each publisher (only announced ones are kept).
    refused_at: Mutex<HashMap<u64, Instant>>,
    bytes: Arc<StreamBytes>,
}

impl Shared {
    fn publishers(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Announced>> {
        self.publishers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refused_at(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Instant>> {
        self.refused_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishers announced now that the bus refused within twice [`ANNOUNCE_RETRY`].
    fn refused_publishers(&self) -> usize {
        let announced = self.publishers();
        let now = Instant::now();
        self.refused_at()
            .iter()
            .filter(|(id, at)| {
                announced.contains_key(id) && now.duration_since(**at) < 2 * ANNOUNCE_RETRY
            })
            .count()
    }
}

/// A running source: it keeps a session with the bus (reconnecting with the broker's
/// backoff), announces its publishers, and serves the router's subscribes for them,
/// each a data stream served by the publisher's socket as one more subscriber (the same
/// send queue bound and drop counters as a TCP subscriber). [`shutdown`](Self::shutdown)
/// drains; dropping it stops at once.
///
/// ```no_run
/// # async fn run(config: eventplane::tunnel::SourceConfig) -> Result<(), Box<dyn std::error::Error>> {
/// use eventplane::publish::EventPublisher;
/// use eventplane::tunnel::{AnnouncedSource, Source};
/// let publisher = EventPublisher::unregistered("kv-events").build().await?;
/// let source = Source::spawn(config)?;
/// let id = eventplane::discovery::ChannelId::new("prod", "backend", "kv-events", publisher.publisher_id())?;
/// source.announce(AnnouncedSource::new(&id, publisher.dialect()), publisher.acceptor())?;
/// // … publish …
/// publisher.shutdown().await;
/// source.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Source {
    _stop_on_drop: tokio_util::sync::DropGuard,
    cancel: CancellationToken,
    hard: CancellationToken,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// Reads a running [`Source`]'s counters, from [`Source::handle`].
#[derive(Debug, Clone)]
pub struct SourceHandle {
    shared: Arc<Shared>,
}

impl SourceHandle {
    /// Counters.
    pub fn stats(&self) -> SourceStats {
        stats_of(&self.shared)
    }
}

fn stats_of(s: &Shared) -> SourceStats {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    // Each takes the publishers' lock: not within one expression.
    let announced = s.publishers().len();
    let refused_publishers = s.refused_publishers();
    SourceStats {
        sessions: l(&s.sessions),
        session_failures: l(&s.session_failures),
        connected: s.connected.load(Ordering::Relaxed),
        announced,
        streams_opened: l(&s.streams_opened),
        streams_open: l(&s.open),
        refused: s.refused.snapshot(),
        denied: s.denied.snapshot(),
        announce_refused: s.announce_refused.snapshot(),
        refused_publishers,
        bytes_up: l(&s.bytes.written),
        bytes_down: l(&s.bytes.read),
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl Source {
    /// Validates `config` and starts the source on the current Tokio runtime.
    pub fn spawn(config: SourceConfig) -> Result<Source, TunnelError> {
        config.validate()?;
        let hard = CancellationToken::new();
        let cancel = hard.child_token();
        let shared = Arc::new(Shared {
            config,
            publishers: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            sessions: AtomicU64::new(0),
            session_failures: AtomicU64::new(0),
            connected: AtomicBool::new(false),
            streams_opened: AtomicU64::new(0),
            open: AtomicU64::new(0),
            refused: CodeCounts::default(),
            denied: CodeCounts::default(),
            announce_refused: CodeCounts::default(),
            refused_at: Mutex::new(HashMap::new()),
            bytes: Arc::new(StreamBytes::default()),
        });
        let task = tokio::spawn(run(shared.clone(), cancel.clone(), hard.clone()));
        Ok(Source {
            _stop_on_drop: hard.clone().drop_guard(),
            cancel,
            hard,
            shared,
            task,
        })
    }

    /// Announces `source` (again, as a new incarnation, if its id was announced),
    /// served by `acceptor`. Refused when it is not a valid channel, its namespace is
    /// not one of the config's, or `max_publishers` are announced.
    pub fn announce(
        &self,
        source: AnnouncedSource,
        acceptor: StreamAcceptor,
    ) -> Result<(), TunnelError> {
        self.announce_as(source, acceptor, None)
    }

    /// As [`announce`](Self::announce), with the worker's recovery log served by
    /// `recovery` (from [`RecoveryServer::acceptor`](crate::kv::pipeline::RecoveryServer::acceptor)):
    /// the announcement says so, and a router that lost the publisher's events asks
    /// for them through this session (a [`Target::Recovery`](crate::tunnel::Target::Recovery)
    /// stream, served within the recovery endpoint's own bounds).
    ///
    /// ```no_run
    /// # async fn run(source: eventplane::tunnel::Source, publisher: eventplane::publish::EventPublisher,
    /// #     id: eventplane::discovery::ChannelId) -> Result<(), Box<dyn std::error::Error>> {
    /// use eventplane::kv::{pipeline::{RecoveryServer, SharedWorkerLog, WorkerLogConfig}};
    /// use eventplane::tunnel::AnnouncedSource;
    /// let log = SharedWorkerLog::new(WorkerLogConfig::default());
    /// let recovery = RecoveryServer::bind("tcp://127.0.0.1:0", log).await?;
    /// source.announce_with_recovery(
    ///     AnnouncedSource::new(&id, publisher.dialect()),
    ///     publisher.acceptor(),
    ///     recovery.acceptor(),
    /// )?;
    /// # Ok(()) }
    /// ```
    pub fn announce_with_recovery(
        &self,
        source: AnnouncedSource,
        acceptor: StreamAcceptor,
        recovery: impl RecoveryStreams,
    ) -> Result<(), TunnelError> {
        self.announce_as(source.with_recovery(), acceptor, Some(Arc::new(recovery)))
    }

    fn announce_as(
        &self,
        mut source: AnnouncedSource,
        acceptor: StreamAcceptor,
        recovery: Option<Arc<dyn RecoveryStreams>>,
    ) -> Result<(), TunnelError> {
        source.recovery = recovery.is_some();
        let refuse = |reason: String| {
            Err(TunnelError::Config {
                field: "source",
                reason,
            })
        };
        if let Err(reason) = source.check() {
            return refuse(format!("publisher {:x} {reason}", source.publisher_id));
        }
        if !self.shared.config.namespaces.contains(&source.namespace) {
            return refuse(format!(
                "namespace {:?} is not one this source announces in",
                source.namespace
            ));
        }
        {
            let mut publishers = self.shared.publishers();
            if !publishers.contains_key(&source.publisher_id)
                && publishers.len() >= self.shared.config.max_publishers
            {
                return refuse(format!(
                    "{} publishers are announced already",
                    publishers.len()
                ));
            }
            publishers.insert(
                source.publisher_id,
                Announced {
                    source,
                    acceptor,
                    recovery,
                },
            );
        }
        self.shared.changed.notify_one();
        Ok(())
    }

    /// Withdraws publisher `publisher_id`: the router is told, and its streams close.
    pub fn withdraw(&self, publisher_id: u64) {
        if self.shared.publishers().remove(&publisher_id).is_some() {
            self.shared.changed.notify_one();
        }
    }

    /// Counters.
    pub fn stats(&self) -> SourceStats {
        stats_of(&self.shared)
    }

    /// A cloneable handle reading the counters (a metrics exporter's, a readiness
    /// probe's) while the source runs, and after.
    pub fn handle(&self) -> SourceHandle {
        SourceHandle {
            shared: self.shared.clone(),
        }
    }

    /// Drains (says `draining`; open streams may run until the drain deadline, or
    /// until their publishers close) and stops; its final counters.
    pub async fn shutdown(mut self) -> SourceStats {
        self.cancel.cancel();
        let _ = (&mut self.task).await;
        self.hard.cancel();
        self.stats()
    }

    /// Stops at once, as when the process is killed.
    pub fn abort(self) {
        self.hard.cancel();
        self.task.abort();
    }
}

async fn run(shared: Arc<Shared>, cancel: CancellationToken, hard: CancellationToken) {
    let config = &shared.config;
    let mut reconnect = Reconnect::with_backoff(crate::net::Backoff::checked(
        config.reconnect_min,
        config.reconnect_max,
    ));
    loop {
        let outcome = match session(&shared, &cancel, &hard, &mut reconnect).await {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::warn!(bus = %config.bus_url, error = %crate::net::ErrorChain(&e), "bus session failed");
                Outcome::Failed
            }
        };
        shared.connected.store(false, Ordering::Relaxed);
        let delay = match outcome {
            Outcome::Stopped => return,
            Outcome::Failed => {
                shared.session_failures.fetch_add(1, Ordering::Relaxed);
                reconnect.after_failure(random_unit())
            }
            Outcome::Drained(reason) => {
                reconnect.after_drain(reason, Instant::now(), random_unit())
            }
        };
        tracing::info!(?delay, "reconnecting to the bus");
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// `announce` frames `n` announcements take.
fn frames_for(n: usize) -> u32 {
    u32::try_from(n.div_ceil(MAX_ANNOUNCE)).unwrap_or(u32::MAX)
}

/// What a stream task reports to its session.
enum Report {
    Opened(u64),
    Refused(u64, RefuseCode),
    /// The subscriber connection ended (the router let go, or the publisher closed).
    Ended(u64),
}

async fn session(
    shared: &Arc<Shared>,
    cancel: &CancellationToken,
    hard: &CancellationToken,
    reconnect: &mut Reconnect,
) -> Result<Outcome, TunnelError> {
    let config = &shared.config;
    let BusSession {
        sender,
        authority,
        conn_done,
        ctrl_tx,
        mut body,
    } = open_session(
        &config.bus_url,
        &config.tls,
        &config.token,
        &config.deadlines,
        hard,
    )
    .await?;
    // What the router knows: the hello's first announcements, then the rest.
    let mut sent: HashMap<u64, AnnouncedSource> = shared
        .publishers()
        .values()
        .map(|a| (a.source.publisher_id, a.source.clone()))
        .collect();
    let mut all: Vec<AnnouncedSource> = sent.values().cloned().collect();
    let rest = all.split_off(all.len().min(MAX_ANNOUNCE));
    let mut client = BrokerSession::new(
        Hello::source(config.client_id.clone(), config.namespaces.clone(), all),
        Instant::now(),
    );
    // Announce frames paced as the router counts them (`ANNOUNCE_BURST`, then
    // `ANNOUNCES_PER_SECOND`): past them it ends the session. The router's bucket
    // starts when it accepts the session, which on a loaded host may come after this
    // one starts: a burst short by `ANNOUNCE_PACE_MARGIN` frames covers that late a
    // start and never runs ahead of it.
    let mut pace = crate::tunnel::protocol::broker_session::OpenRate::new(
        crate::tunnel::ANNOUNCES_PER_SECOND,
        crate::tunnel::ANNOUNCE_BURST - ANNOUNCE_PACE_MARGIN,
        Instant::now(),
    );
    // (What the hello did not carry goes at once: owed when over the burst.)
    pace.spend_n(frames_for(rest.len()), Instant::now());
    client.announce(rest);
    let mut decoder = ControlDecoder::default();
    let (report_tx, mut report_rx) = mpsc::channel::<Report>(1024);
    let slots = Arc::new(tokio::sync::Semaphore::new(0));
    let streams_cancel = hard.child_token();
    let tracker = TaskTracker::new();
    // Each open stream's publisher and stop.
    let mut streams: HashMap<u64, (u64, CancellationToken)> = HashMap::new();
    let mut ending = Ending::default();
    let mut stable_at: Option<tokio::time::Instant> = None;
    // When to announce again what the bus refused.
    let mut retry_at: Option<tokio::time::Instant> = None;
    let outcome = loop {
        let mut ended = false;
        while let Some(event) = client.poll_event() {
            match event {
                BrokerEvent::Welcomed(welcome) => {
                    shared.sessions.fetch_add(1, Ordering::Relaxed);
                    shared.connected.store(true, Ordering::Relaxed);
                    stable_at = Some(tokio::time::Instant::now() + crate::tunnel::JOIN_HOLD_DOWN);
                    slots.add_permits(
                        welcome
                            .limits
                            .max_streams
                            .min(crate::tunnel::MAX_BROKER_STREAMS)
                            as usize,
                    );
                    tracing::info!(client_id = %config.client_id, session_id = welcome.session_id, announced = sent.len(), "bus session welcomed: announcing as a source");
                    if sent.len() > welcome.limits.max_sources as usize {
                        tracing::error!(
                            announced = sent.len(),
                            max_sources = welcome.limits.max_sources,
                            "more publishers than the bus allows one source: it will deny the session (too_many_sources)"
                        );
                    }
                }
                BrokerEvent::Serve {
                    stream_id,
                    publisher_id,
                }
                | BrokerEvent::ServeRecovery {
                    stream_id,
                    publisher_id,
                } => {
                    let recovery = matches!(event, BrokerEvent::ServeRecovery { .. });
                    // A recovery stream of a publisher announced without one is
                    // refused as not announced.
                    let acceptor = shared.publishers().get(&publisher_id).and_then(|a| {
                        if recovery {
                            a.recovery.clone().map(Serving::Recovery)
                        } else {
                            Some(Serving::Publisher(a.acceptor.clone()))
                        }
                    });
                    let refusal = match &acceptor {
                        None => Some(RefuseCode::TargetNotAnnounced),
                        // Its publisher closed (the process is stopping).
                        Some(a) if a.is_closed() => Some(RefuseCode::Draining),
                        // Refused before the stream is opened, not closed after.
                        Some(a) if !a.has_room() => Some(RefuseCode::TooManyStreams),
                        Some(_) => None,
                    };
                    let (Some(acceptor), None) = (acceptor, refusal) else {
                        let code = refusal.unwrap_or(RefuseCode::TargetNotAnnounced);
                        shared.refused.add(code.as_str());
                        client.stream_refused(stream_id, code);
                        continue;
                    };
                    let stop = streams_cancel.child_token();
                    if let Some((_, earlier)) =
                        streams.insert(stream_id, (publisher_id, stop.clone()))
                    {
                        earlier.cancel();
                    }
                    tracker.spawn(serve(
                        shared.clone(),
                        Stream {
                            stream_id,
                            publisher_id,
                            sender: sender.clone(),
                            authority: authority.clone(),
                            slots: slots.clone(),
                        },
                        acceptor,
                        report_tx.clone(),
                        stop,
                    ));
                }
                BrokerEvent::Close { stream_id } => {
                    if let Some((_, stop)) = streams.remove(&stream_id) {
                        stop.cancel();
                    }
                }
                BrokerEvent::Refused { code, .. } => shared.refused.add(code.as_str()),
                BrokerEvent::AnnounceRefused {
                    publisher_ids,
                    code,
                } => {
                    tracing::warn!(client_id = %config.client_id, %code, refused = publisher_ids.len(), ?ANNOUNCE_RETRY, "the bus refused announced publishers: announcing them again later");
                    let now = Instant::now();
                    {
                        let announced = shared.publishers();
                        let mut refused = shared.refused_at();
                        refused.retain(|id, _| announced.contains_key(id));
                        for id in &publisher_ids {
                            shared.announce_refused.add(code.as_str());
                            // Announced again at the retry (as news: not sent now).
                            sent.remove(id);
                            if announced.contains_key(id) {
                                refused.insert(*id, now);
                            }
                        }
                    }
                    retry_at.get_or_insert(tokio::time::Instant::now() + ANNOUNCE_RETRY);
                }
                BrokerEvent::Drain { deadline, reason } => {
                    tracing::info!(?reason, ?deadline, "the router asks to drain");
                    ending.drain = Some((reason, tokio::time::Instant::now() + deadline));
                }
                BrokerEvent::Ended(end) => {
                    if let crate::tunnel::SessionEnd::Denied(code) = end {
                        shared.denied.add(code.as_str());
                        tracing::warn!(client_id = %config.client_id, %code, "the bus denied the session: its credential does not grant this client id, the source role, or these namespaces");
                    } else {
                        tracing::info!(reason = %end, "bus session ended");
                    }
                    ended = true;
                }
                // A source's session never relays `tcp://` targets.
                BrokerEvent::Open { .. } => {}
            }
        }
        if ended {
            break ending.outcome();
        }
        let deadline = ending.deadline();
        if deadline.is_some() && client.streams() == 0 {
            client.close();
            continue;
        }
        let timer = ending.timer(&client);
        tokio::select! {
            chunk = next_chunk(&mut body) => feed(&mut client, &mut decoder, chunk),
            report = report_rx.recv() => match report {
                Some(Report::Opened(id)) if streams.contains_key(&id) => {
                    shared.streams_opened.fetch_add(1, Ordering::Relaxed);
                    client.stream_opened(id);
                }
                Some(Report::Refused(id, code)) if streams.remove(&id).is_some() => {
                    shared.refused.add(code.as_str());
                    client.stream_refused(id, code);
                }
                Some(Report::Ended(id)) if streams.remove(&id).is_some() => {
                    client.stream_closed(id, CloseCode::UpstreamClosed);
                }
                _ => {}
            },
            () = shared.changed.notified() => {
                let now: HashMap<u64, AnnouncedSource> = shared
                    .publishers()
                    .values()
                    .map(|a| (a.source.publisher_id, a.source.clone()))
                    .collect();
                let gone: Vec<u64> = sent.keys().filter(|id| !now.contains_key(id)).copied().collect();
                let new: Vec<AnnouncedSource> = now
                    .values()
                    .filter(|s| sent.get(&s.publisher_id) != Some(*s))
                    .cloned()
                    .collect();
                let frames = frames_for(new.len());
                if !pace.take_n(frames, Instant::now()) {
                    // Later, with whatever changed meanwhile.
                    let at = tokio::time::Instant::now() + pace.wait_for(frames);
                    retry_at = Some(retry_at.map_or(at, |r| r.min(at)));
                    continue;
                }
                for (id, (publisher, stop)) in &streams {
                    if gone.contains(publisher) {
                        stop.cancel();
                        client.stream_closed(*id, CloseCode::UpstreamClosed);
                    }
                }
                streams.retain(|_, (publisher, _)| !gone.contains(publisher));
                client.withdraw(gone);
                client.announce(new);
                sent = now;
            }
            () = crate::time::sleep_until_opt(retry_at) => {
                retry_at = None;
                shared.changed.notify_one();
            }
            () = crate::time::sleep_until_opt(stable_at) => {
                stable_at = None;
                reconnect.reset();
            }
            () = crate::time::sleep_until_opt(timer) => {
                let now = tokio::time::Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    client.close();
                } else {
                    client.handle_timeout(now.into_std());
                }
            }
            () = cancel.cancelled(), if ending.stopping.is_none() => {
                tracing::info!("draining before exit");
                client.begin_draining();
                ending.stopping = Some(tokio::time::Instant::now() + config.drain_deadline);
            }
            () = conn_done.cancelled() => client.close(),
            permit = ctrl_tx.reserve(), if client.has_transmit() => match permit {
                Ok(permit) => permit.send(Ok(crate::tunnel::protocol::frame::encode_frames(|| client.poll_transmit()))),
                Err(_) => client.close(),
            },
        }
    };
    streams_cancel.cancel();
    drop(report_rx);
    tracker.close();
    tracker.wait().await;
    Ok(outcome)
}

/// One stream to open.
struct Stream {
    stream_id: u64,
    publisher_id: u64,
    sender: hyper::client::conn::http2::SendRequest<BrokerBody>,
    authority: String,
    slots: Arc<tokio::sync::Semaphore>,
}

/// Opens data stream `stream_id` (a slot, then the bus's answer, each under its
/// deadline) and hands it to the publisher's socket as one more subscriber; reports
/// when it ends.
async fn serve(
    shared: Arc<Shared>,
    stream: Stream,
    acceptor: Serving,
    report: mpsc::Sender<Report>,
    stop: CancellationToken,
) {
    let Stream {
        stream_id,
        publisher_id,
        mut sender,
        authority,
        slots,
    } = stream;
    let deadlines = shared.config.deadlines;
    let opened = async {
        let slot = match tokio::time::timeout(deadlines.stream_slot, slots.acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) => return Err(RefuseCode::StreamFailed),
            Err(_) => return Err(RefuseCode::StreamSlotTimeout),
        };
        // Publisher → router: what the socket writes, a few chunks at a time (its
        // send queue holds the rest, and drops what does not fit, counted).
        let (tx, rx) = mpsc::channel(TUNNEL_WRITE_CHUNKS);
        let request = Request::post(format!("https://{authority}/bus/v1/streams/{stream_id}"))
            .header(
                hyper::header::AUTHORIZATION,
                shared.config.token.header_value(),
            )
            .body(BrokerBody::Control(
                ChannelBody::new(rx).until(stop.clone()),
            ))
            .map_err(|_| RefuseCode::StreamFailed)?;
        match tokio::time::timeout(deadlines.response, sender.send_request(request)).await {
            Err(_) => Err(RefuseCode::ResponseTimeout),
            Ok(Ok(r)) if r.status().is_success() => Ok((slot, tx, r.into_body())),
            Ok(Ok(r)) if r.status() == hyper::StatusCode::NOT_FOUND => {
                Err(RefuseCode::UnknownStream)
            }
            Ok(_) => Err(RefuseCode::StreamFailed),
        }
    };
    let opened = tokio::select! {
        () = stop.cancelled() => return,
        r = opened => r,
    };
    let (slot, tx, incoming) = match opened {
        Ok(opened) => opened,
        Err(code) => {
            let _ = report.send(Report::Refused(stream_id, code)).await;
            return;
        }
    };
    let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
    let stream = crate::tunnel::io::TunnelStream::new(
        incoming,
        tx,
        shared.bytes.clone(),
        Box::new(move || {
            let _ = gone_tx.send(());
        }),
    );
    let label = format!("bus stream {stream_id:x} (publisher {publisher_id:x})");
    if !acceptor.accept(stream, label) {
        // Its socket closed meanwhile, or holds its `max_connections`.
        let code = if acceptor.is_closed() {
            RefuseCode::Draining
        } else {
            RefuseCode::TooManyStreams
        };
        let _ = report.send(Report::Refused(stream_id, code)).await;
        return;
    }
    let _ = report.send(Report::Opened(stream_id)).await;
    shared.open.fetch_add(1, Ordering::Relaxed);
    // The subscriber connection ends (the socket closed it, or the router's side
    // ended), or the session let go of it (its body resets; the socket's writes fail).
    tokio::select! {
        _ = gone => {}
        () = stop.cancelled() => {}
    }
    shared.open.fetch_sub(1, Ordering::Relaxed);
    drop(slot);
    let _ = report.send(Report::Ended(stream_id)).await;
}
