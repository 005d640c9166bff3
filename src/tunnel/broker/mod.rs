//! The event broker (DESIGN §7.2): inside the cluster, it dials out to the router's
//! event bus, and per `subscribe` checks the target, connects to the publisher and
//! relays raw bytes both ways, without parsing them.

pub(crate) mod relay;
pub(crate) mod view;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::net::random_unit;
use crate::tunnel::broker::relay::{Counters, Relay, Report, Reported, relay};
use crate::tunnel::broker::view::View;
use crate::tunnel::client::{BusSession, Ending, Outcome, feed, open_session};
use crate::tunnel::config::BrokerConfig;
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::next_chunk;
use crate::tunnel::protocol::codes::CodeCounts;
use crate::tunnel::{
    BrokerEvent, BrokerSession, ControlDecoder, DrainReason, Hello, Reconnect, RelayBudget,
};

/// Counters of a [`Broker`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct BrokerStats {
    /// Sessions welcomed by the bus.
    pub sessions: u64,
    /// Session attempts that failed before their welcome, and welcomed sessions that
    /// ended without a drain (lost, timed out, closed or superseded by the bus).
    pub session_failures: u64,
    /// Whether a session is welcomed now.
    pub connected: bool,
    /// Streams opened to publishers.
    pub streams_opened: u64,
    /// Streams relaying now.
    pub streams_open: u64,
    /// Rebalances that came within a minute of the previous one and so waited the
    /// normal backoff instead of 250–500 ms.
    pub rebalances_throttled: u64,
    /// Subscribes refused, by code.
    pub refused: HashMap<String, u64>,
    /// Sessions the bus denied, by code (`DenyCode`): the credential does not grant
    /// this client id or these namespaces.
    pub denied: HashMap<String, u64>,
    /// DNS lookups that found all `max_dns_lookups` slots taken and waited (within
    /// the DNS deadline).
    pub dns_saturated: u64,
    /// Streams closed by the broker, by code.
    pub closed: HashMap<String, u64>,
    /// Bytes relayed publisher → router.
    pub bytes_up: u64,
    /// Bytes relayed router → publisher.
    pub bytes_down: u64,
    /// The most the broker ever had queued toward the router in one session (its
    /// streams together, chunk overheads included), kept up to date while it runs.
    pub buffer_high_water: u64,
    /// Whether every namespace's initial discovery list is complete (the broker
    /// dials the bus only then).
    pub discovery_ready: bool,
    /// Endpoints advertised in its discovery view now (distinct within each
    /// namespace): publishers' and their workers' recovery endpoints.
    pub advertised_endpoints: usize,
    /// Discovery instances not advertised, or advertised without their recovery
    /// endpoint: their namespace already held 65,536 instances or 16 MiB of them (a
    /// new incarnation is held to it too), or an endpoint is over 1 KiB.
    pub view_ignored: u64,
}

/// A running broker: it keeps a session with the bus (reconnecting with backoff) until
/// [`shutdown`](Self::shutdown) drains it; [`abort`](Self::abort), or dropping it,
/// stops it at once.
#[derive(Debug)]
pub struct Broker {
    /// Stops the broker at once when it is dropped without `shutdown` or `abort`.
    _stop_on_drop: tokio_util::sync::DropGuard,
    cancel: CancellationToken,
    /// Cancelled by `abort`: every relay and the bus connection stop at once.
    hard: CancellationToken,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Broker {
    /// Validates `config` and starts the broker on the current Tokio runtime.
    pub fn spawn(config: BrokerConfig) -> Result<Broker, TunnelError> {
        config.validate()?;
        let hard = CancellationToken::new();
        // A hard stop stops the reconnect loop too.
        let cancel = hard.child_token();
        let view = View::spawn(config.discovery.clone(), &config.namespaces, &hard);
        let counters = Arc::new(Counters {
            sessions: AtomicU64::new(0),
            session_failures: AtomicU64::new(0),
            connected: std::sync::atomic::AtomicBool::new(false),
            streams_opened: AtomicU64::new(0),
            rebalances_throttled: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            high_water: AtomicU64::new(0),
            refused: CodeCounts::default(),
            closed: CodeCounts::default(),
            denied: CodeCounts::default(),
            dns: Arc::new(tokio::sync::Semaphore::new(config.max_dns_lookups)),
            dns_saturated: AtomicU64::new(0),
            open: AtomicU64::new(0),
            warn: crate::net::RateLimitedWarn::default(),
            view,
        });
        let task = tokio::spawn(run(config, cancel.clone(), hard.clone(), counters.clone()));
        Ok(Broker {
            _stop_on_drop: hard.clone().drop_guard(),
            cancel,
            hard,
            counters,
            task,
        })
    }

    /// Counters.
    pub fn stats(&self) -> BrokerStats {
        self.handle().stats()
    }

    /// A handle for counters that outlives [`shutdown`](Self::shutdown).
    pub fn handle(&self) -> BrokerHandle {
        BrokerHandle {
            counters: self.counters.clone(),
        }
    }

    /// Drains (says `draining`, refuses new subscribes, lets open streams run until
    /// the drain deadline) and stops.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
        self.hard.cancel();
    }

    /// Stops at once: open streams are cut and the bus connection dropped, as when the
    /// process is killed.
    pub fn abort(self) {
        self.hard.cancel();
        self.task.abort();
    }
}

/// The counters of a [`Broker`], readable after it stopped.
#[derive(Debug, Clone)]
pub struct BrokerHandle {
    counters: Arc<Counters>,
}

impl BrokerHandle {
    /// Counters.
    pub fn stats(&self) -> BrokerStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BrokerStats {
            sessions: l(&c.sessions),
            session_failures: l(&c.session_failures),
            connected: c.connected.load(Ordering::Relaxed),
            streams_opened: l(&c.streams_opened),
            rebalances_throttled: l(&c.rebalances_throttled),
            refused: c.refused.snapshot(),
            closed: c.closed.snapshot(),
            denied: c.denied.snapshot(),
            dns_saturated: l(&c.dns_saturated),
            streams_open: l(&c.open),
            bytes_up: l(&c.bytes_up),
            bytes_down: l(&c.bytes_down),
            buffer_high_water: l(&c.high_water),
            discovery_ready: c.view.is_ready(),
            advertised_endpoints: c.view.endpoints(),
            view_ignored: c.view.ignored(),
        }
    }
}

/// How a session ended, for the reconnect delay.
async fn run(
    config: BrokerConfig,
    cancel: CancellationToken,
    hard: CancellationToken,
    counters: Arc<Counters>,
) {
    let mut reconnect = Reconnect::with_backoff(crate::net::Backoff::checked(
        config.reconnect_min,
        config.reconnect_max,
    ));
    // No session before the view can answer: every subscribe would be refused.
    if !counters.view.is_ready() {
        tracing::info!(namespaces = ?config.namespaces, "waiting for the initial discovery lists");
        tokio::select! {
            () = cancel.cancelled() => return,
            () = counters.view.ready() => {}
        }
    }
    loop {
        let outcome = session(&config, &cancel, &hard, &counters, &mut reconnect).await;
        counters.connected.store(false, Ordering::Relaxed);
        let outcome = match outcome {
            Ok(Outcome::Failed) => {
                counters.session_failures.fetch_add(1, Ordering::Relaxed);
                Outcome::Failed
            }
            Ok(outcome) => outcome,
            Err(e) => {
                counters.session_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(bus = %config.bus_url, error = %crate::net::ErrorChain(&e), "bus session failed");
                Outcome::Failed
            }
        };
        let delay = match outcome {
            Outcome::Stopped => return,
            Outcome::Failed => reconnect.after_failure(random_unit()),
            Outcome::Drained(reason) => {
                let now = Instant::now();
                if reason == DrainReason::Rebalance && reconnect.is_throttled(now) {
                    counters
                        .rebalances_throttled
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "a second rebalance within a minute: reconnecting after the normal backoff"
                    );
                }
                reconnect.after_drain(reason, now, random_unit())
            }
        };
        tracing::info!(?delay, "reconnecting to the bus");
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

async fn session(
    config: &BrokerConfig,
    cancel: &CancellationToken,
    hard: &CancellationToken,
    counters: &Arc<Counters>,
    reconnect: &mut Reconnect,
) -> Result<Outcome, TunnelError> {
    let deadlines = config.deadlines;
    let BusSession {
        sender,
        authority,
        conn_done,
        ctrl_tx,
        body,
    } = open_session(
        &config.bus_url,
        &config.tls,
        &config.token,
        &deadlines,
        hard,
    )
    .await?;
    let mut body = body;
    let mut broker = BrokerSession::new(
        Hello::new(config.client_id.clone(), config.namespaces.clone()),
        Instant::now(),
    )
    .with_open_rate(config.opens_per_second);
    let mut decoder = ControlDecoder::default();
    let (report_tx, mut report_rx) = mpsc::channel::<Report>(1024);
    let budget = Arc::new(Mutex::new(RelayBudget::new(
        config.max_stream_buffer_bytes,
        config.max_session_buffer_bytes,
    )));
    // HTTP/2 stream slots: as many as the welcome allows (none before it).
    let slots = Arc::new(tokio::sync::Semaphore::new(0));
    let relay_ctx = Arc::new(Relay {
        slots: slots.clone(),
        config: config.clone(),
        view: counters.view.clone(),
        sender: sender.clone(),
        authority: authority.clone(),
        budget: budget.clone(),
        counters: counters.clone(),
    });
    let streams_cancel = hard.child_token();
    let tracker = TaskTracker::new();
    // Each relay's generation and stop.
    let mut stream_stops: HashMap<u64, (u64, CancellationToken)> = HashMap::new();
    let mut generations = 0u64;
    let mut ending = Ending::default();
    let mut stable_at: Option<tokio::time::Instant> = None;
    let outcome = loop {
        // Frames go out only as the router reads them; a router that stops reading
        // fills the session's bounded outbox, which ends the session.
        match ctrl_tx.try_reserve() {
            Ok(permit) if broker.has_transmit() => {
                permit.send(Ok(crate::tunnel::protocol::frame::encode_frames(|| {
                    broker.poll_transmit()
                })))
            }
            Err(mpsc::error::TrySendError::Closed(())) => broker.close(),
            _ => {}
        }
        let mut ended = false;
        while let Some(event) = broker.poll_event() {
            match event {
                BrokerEvent::Welcomed(welcome) => {
                    counters.sessions.fetch_add(1, Ordering::Relaxed);
                    counters.connected.store(true, Ordering::Relaxed);
                    // The backoff starts over only once the session held: a router
                    // that welcomes and then ends every session is not hammered.
                    stable_at = Some(tokio::time::Instant::now() + crate::tunnel::JOIN_HOLD_DOWN);
                    slots.add_permits(
                        welcome
                            .limits
                            .max_streams
                            .min(crate::tunnel::MAX_BROKER_STREAMS)
                            as usize,
                    );
                    *budget.lock().unwrap_or_else(|p| p.into_inner()) = RelayBudget::new(
                        (welcome.limits.max_stream_buffer_bytes as usize)
                            .min(config.max_stream_buffer_bytes),
                        config.max_session_buffer_bytes,
                    );
                    tracing::info!(client_id = %config.client_id, session_id = welcome.session_id, "bus session welcomed");
                }
                BrokerEvent::Open { stream_id, target } => {
                    let stop = streams_cancel.child_token();
                    generations += 1;
                    if let Some((_, earlier)) =
                        stream_stops.insert(stream_id, (generations, stop.clone()))
                    {
                        earlier.cancel();
                    }
                    tracker.spawn(relay(
                        relay_ctx.clone(),
                        Report {
                            stream_id,
                            generation: generations,
                            what: Reported::Opened,
                        },
                        target,
                        report_tx.clone(),
                        stop,
                    ));
                }
                // A broker's session never serves announced targets.
                BrokerEvent::Serve { .. }
                | BrokerEvent::ServeRecovery { .. }
                | BrokerEvent::AnnounceRefused { .. } => {}
                BrokerEvent::Close { stream_id } => {
                    if let Some((_, stop)) = stream_stops.remove(&stream_id) {
                        stop.cancel();
                    }
                }
                BrokerEvent::Refused { code, .. } => {
                    counters.refused.add(code.as_str());
                    if let Some(suppressed) = counters.warn.check(code.as_str(), Instant::now()) {
                        tracing::warn!(%code, suppressed, "refused a subscribe");
                    }
                }
                BrokerEvent::Drain { deadline, reason } => {
                    tracing::info!(?reason, ?deadline, "the router asks to drain");
                    ending.drain = Some((reason, tokio::time::Instant::now() + deadline));
                }
                BrokerEvent::Ended(end) => {
                    if let crate::tunnel::SessionEnd::Denied(code) = end {
                        counters.denied.add(code.as_str());
                        tracing::warn!(client_id = %config.client_id, %code, "the bus denied the session: its credential does not grant this client id or these namespaces");
                    } else {
                        tracing::info!(reason = %end, "bus session ended");
                    }
                    ended = true;
                }
            }
        }
        if ended {
            break ending.outcome();
        }
        // Drained with nothing open, or past the drain deadline: this session is done.
        let deadline = ending.deadline();
        if deadline.is_some() && broker.streams() == 0 {
            broker.close();
            continue;
        }
        let timer = ending.timer(&broker);
        tokio::select! {
            chunk = next_chunk(&mut body) => feed(&mut broker, &mut decoder, chunk),
            report = report_rx.recv() => if let Some(Report { stream_id: id, generation, what }) = report {
                // A relay the router let go of (and perhaps reused the id since):
                // nothing it says is about the stream now.
                let current = stream_stops.get(&id).is_some_and(|(g, _)| *g == generation);
                match what {
                    _ if !current => {}
                    Reported::Opened => {
                        counters.streams_opened.fetch_add(1, Ordering::Relaxed);
                        broker.stream_opened(id);
                    }
                    Reported::Refused(code) => {
                        counters.refused.add(code.as_str());
                        if let Some(suppressed) = counters.warn.check(code.as_str(), Instant::now()) {
                            tracing::warn!(%code, suppressed, "refused a subscribe");
                        }
                        stream_stops.remove(&id);
                        broker.stream_refused(id, code);
                    }
                    Reported::Closed(code) => {
                        counters.closed.add(code.as_str());
                        stream_stops.remove(&id);
                        broker.stream_closed(id, code);
                    }
                    Reported::Gone => {
                        stream_stops.remove(&id);
                        broker.stream_forgotten(id);
                    }
                }
            },
            () = crate::time::sleep_until_opt(stable_at) => {
                stable_at = None;
                reconnect.reset();
            }
            () = crate::time::sleep_until_opt(timer) => {
                let now = tokio::time::Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    broker.close();
                } else {
                    broker.handle_timeout(now.into_std());
                }
            }
            () = cancel.cancelled(), if ending.stopping.is_none() => {
                tracing::info!("draining before exit");
                broker.begin_draining();
                ending.stopping = Some(tokio::time::Instant::now() + config.drain_deadline);
            }
            () = conn_done.cancelled() => broker.close(),
            permit = ctrl_tx.reserve(), if broker.has_transmit() => match permit {
                Ok(permit) => permit.send(Ok(crate::tunnel::protocol::frame::encode_frames(|| broker.poll_transmit()))),
                Err(_) => broker.close(),
            },
        }
    };
    streams_cancel.cancel();
    // Relays blocked reporting to a session that is gone must not hold it up.
    drop(report_rx);
    tracker.close();
    tracker.wait().await;
    Ok(outcome)
}
