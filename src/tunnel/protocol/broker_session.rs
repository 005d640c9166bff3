//! The broker's end of a tunnel session as a sans-IO state machine (DESIGN §7.1–7.2),
//! and what both ends share: why a session ends, what a credential grants, heartbeats
//! and the bounded outbox (the router's end is in `router_session`). Sessions take
//! frames and time, and give frames to send, events, and the next instant they need a
//! call at; the I/O layer moves bytes and dials publishers.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::tunnel::protocol::announce::{AnnouncedSource, MAX_ANNOUNCE, Role, Target};
use crate::tunnel::protocol::frame::{
    CloseCode, Control, DenyCode, DrainReason, Hello, Limits, PROTOCOL_VERSION, RefuseCode, Welcome,
};

/// How long a broker waits for `welcome`, and a router for `hello`.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a router waits for a subscribe to be opened (or refused), and for its data
/// stream, before it gives up on it.
pub const PENDING_SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(30);

/// The most streams a broker keeps open at once, whatever a `welcome` allows.
pub const MAX_BROKER_STREAMS: u32 = 4096;

/// Control frames a session may have waiting to be sent before it fails: a peer that
/// sends commands and never reads the answers cannot grow this queue further.
pub const MAX_QUEUED_CONTROL: usize = 4096;

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionEnd {
    /// The handshake (`hello` / `welcome`) did not complete in time.
    #[error("the handshake did not complete within {0:?}")]
    HandshakeTimeout(Duration),
    /// The peer sent nothing for the idle timeout.
    #[error("the peer was silent for {0:?}")]
    IdleTimeout(Duration),
    /// No protocol version both sides speak.
    #[error("no common protocol version (peer offers {offered:?})")]
    NoCommonVersion {
        /// What the peer offered.
        offered: Vec<u32>,
    },
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    /// The peer let too many answers pile up unsent (it does not read).
    #[error("more than {MAX_QUEUED_CONTROL} control frames waited to be sent")]
    ControlBacklog,
    /// The router denied the hello: the credential does not grant what it claims.
    #[error("the router denied the session: {0}")]
    Denied(DenyCode),
    /// This side closed it.
    #[error("closed by this side")]
    Closed,
}

/// What a broker's credential lets its sessions claim (DESIGN §7.3): the client id
/// the hello must name (any, for a credential not bound to one) and the namespaces it
/// may cover (any, when unrestricted). A hello outside its grant is answered with
/// `denied` and the session ends.
///
/// ```
/// use eventplane::tunnel::protocol::{DenyCode, Grant, Hello};
/// let grant = Grant::namespaces(vec!["prod".into()]).with_client_id("broker-a");
/// assert_eq!(grant.check(&Hello::new("broker-a", vec!["prod".into()])), Ok(()));
/// assert_eq!(grant.check(&Hello::new("broker-b", vec!["prod".into()])), Err(DenyCode::ClientIdNotGranted));
/// assert_eq!(grant.check(&Hello::new("broker-a", vec!["dev".into()])), Err(DenyCode::NamespaceNotGranted));
/// assert!(Grant::any().check(&Hello::new("anyone", vec!["dev".into()])).is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    client_id: Option<String>,
    /// The role it grants (any, when unrestricted).
    role: Option<Role>,
    /// The workers a source may announce publishers for (any, when unrestricted).
    workers: Option<Vec<u64>>,
    namespaces: Option<Vec<String>>,
    /// Client ids (and their `.check`) it may not claim: bound to other credentials.
    reserved: Vec<String>,
}

impl Grant {
    /// No restriction: any client id, any namespace (a session with no credential
    /// policy, as in the sans-IO examples).
    pub fn any() -> Grant {
        Grant::default()
    }

    /// Any client id, only `namespaces`.
    pub fn namespaces(namespaces: Vec<String>) -> Grant {
        Grant {
            client_id: None,
            role: None,
            workers: None,
            namespaces: Some(namespaces),
            reserved: Vec::new(),
        }
    }

    /// Not `client_ids` (nor their `.check`): they belong to other credentials.
    #[must_use]
    pub fn reserving(mut self, client_ids: Vec<String>) -> Grant {
        self.reserved = client_ids;
        self
    }

    /// Bound to `client_id`: a hello naming another is denied (`client_id.check`, the
    /// session `event-broker --check-bus` opens, is its own too).
    #[must_use]
    pub fn with_client_id(mut self, client_id: impl Into<String>) -> Grant {
        self.client_id = Some(client_id.into());
        self
    }

    /// Only for sessions in `role` (a hello taking another is denied
    /// `role_not_granted`).
    #[must_use]
    pub fn with_role(mut self, role: Role) -> Grant {
        self.role = Some(role);
        self
    }

    /// A source's announcements only for workers `worker_ids` (each announced
    /// publisher must name one of them; `worker_not_granted` otherwise).
    #[must_use]
    pub fn with_workers(mut self, worker_ids: Vec<u64>) -> Grant {
        self.workers = Some(worker_ids);
        self
    }

    /// The role it grants, if bound to one.
    pub fn role(&self) -> Option<Role> {
        self.role
    }

    /// The client id it is bound to, if any.
    pub fn client_id(&self) -> Option<&str> {
        self.client_id.as_deref()
    }

    /// Whether it lets a session cover `namespace`.
    pub fn covers(&self, namespace: &str) -> bool {
        self.namespaces
            .as_ref()
            .is_none_or(|n| n.iter().any(|g| g == namespace))
    }

    /// Whether `hello` stays within the grant, or why not.
    pub fn check(&self, hello: &Hello) -> Result<(), DenyCode> {
        // `ID.check` is the session `event-broker --check-bus` opens as `ID`.
        let own = |id: &String| {
            hello.client_id == *id
                || hello
                    .client_id
                    .strip_suffix(".check")
                    .is_some_and(|base| base == id)
        };
        if self.client_id.as_ref().is_some_and(|id| !own(id)) || self.reserved.iter().any(own) {
            return Err(DenyCode::ClientIdNotGranted);
        }
        if self.role.is_some_and(|r| r != hello.role) {
            return Err(DenyCode::RoleNotGranted);
        }
        // `--check-bus` proves a broker's credential; a source has no such session
        // (it would be a second session announcing under the same grant).
        if hello.role == Role::Source && hello.client_id.ends_with(".check") {
            return Err(DenyCode::ClientIdNotGranted);
        }
        if !hello.namespaces.iter().all(|n| self.covers(n)) {
            return Err(DenyCode::NamespaceNotGranted);
        }
        hello.sources.iter().try_for_each(|s| self.check_source(s))
    }

    /// Whether a source may announce `source`: its namespace is granted, and its
    /// worker too when the grant names workers.
    pub fn check_source(&self, source: &AnnouncedSource) -> Result<(), DenyCode> {
        if !self.covers(&source.namespace) {
            return Err(DenyCode::NamespaceNotGranted);
        }
        let worker_granted = match (&self.workers, source.worker) {
            (None, _) => true,
            (Some(ids), Some(w)) => ids.contains(&w.worker_id.0),
            (Some(_), None) => false,
        };
        if worker_granted {
            Ok(())
        } else {
            Err(DenyCode::WorkerNotGranted)
        }
    }
}

/// Heartbeats both ways and the idle deadline, with time passed in.
#[derive(Debug, Clone)]
pub(crate) struct Liveness {
    pub(crate) interval: Duration,
    pub(crate) idle: Duration,
    pub(crate) last_sent: Instant,
    pub(crate) last_heard: Instant,
}

impl Liveness {
    pub(crate) fn new(limits: &Limits, now: Instant) -> Liveness {
        Liveness {
            interval: limits.heartbeat_interval,
            idle: limits.idle_timeout,
            last_sent: now,
            last_heard: now,
        }
    }

    pub(crate) fn next_deadline(&self) -> Instant {
        (self.last_sent + self.interval).min(self.last_heard + self.idle)
    }
}

/// A bounded outgoing queue; overflowing it ends the session.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    pub(crate) frames: VecDeque<Control>,
}

impl Outbox {
    pub(crate) fn push(&mut self, frame: Control) -> Result<(), SessionEnd> {
        if self.frames.len() >= MAX_QUEUED_CONTROL {
            return Err(SessionEnd::ControlBacklog);
        }
        self.frames.push_back(frame);
        Ok(())
    }
}

/// A token bucket over stream opens (and a source's `announce` frames): a burst of
/// `burst`, then `rate` a second.
#[derive(Debug, Clone)]
pub(crate) struct OpenRate {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl OpenRate {
    pub(crate) fn new(rate: u32, burst: u32, now: Instant) -> OpenRate {
        OpenRate {
            rate: f64::from(rate.max(1)),
            burst: f64::from(burst.max(1)),
            tokens: f64::from(burst.max(1)),
            last: now,
        }
    }

    /// Adds what the bucket gained since its last use, up to its burst.
    fn refill(&mut self, now: Instant) {
        let gained = now.saturating_duration_since(self.last).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + gained).min(self.burst);
        self.last = now;
    }

    /// Takes `n` at once, if the bucket holds them at `now`.
    pub(crate) fn take_n(&mut self, n: u32, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= f64::from(n) {
            self.tokens -= f64::from(n);
            true
        } else {
            false
        }
    }

    /// Spends `n` at `now` whatever the bucket holds: what it lacks is owed, and
    /// [`wait_for`](Self::wait_for) counts the debt.
    pub(crate) fn spend_n(&mut self, n: u32, now: Instant) {
        self.refill(now);
        self.tokens -= f64::from(n);
    }

    /// How long until the bucket holds `n` (as of its last take).
    pub(crate) fn wait_for(&self, n: u32) -> Duration {
        let missing = (f64::from(n) - self.tokens).max(0.0);
        Duration::from_secs_f64(missing / self.rate)
    }

    /// Takes one open, if the bucket holds one at `now`.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        self.take_n(1, now)
    }
}

/// What a broker session asks its I/O layer to do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerEvent {
    /// The router accepted the session, with these terms.
    Welcomed(Welcome),
    /// Check `target` (advertised? allowed address?), connect, and report with
    /// [`BrokerSession::stream_opened`] or [`BrokerSession::stream_refused`].
    Open {
        /// The stream.
        stream_id: u64,
        /// The publisher's endpoint.
        target: String,
    },
    /// A source's stream: serve publisher `publisher_id` (one it announces) as one
    /// more subscriber connection, and report with
    /// [`BrokerSession::stream_opened`] or [`BrokerSession::stream_refused`].
    Serve {
        /// The stream.
        stream_id: u64,
        /// The announced publisher.
        publisher_id: u64,
    },
    /// A source's stream to the recovery log of publisher `publisher_id` (one it
    /// announces): serve it from that worker's recovery endpoint, and report with
    /// [`BrokerSession::stream_opened`] or [`BrokerSession::stream_refused`].
    ServeRecovery {
        /// The stream.
        stream_id: u64,
        /// The announced publisher.
        publisher_id: u64,
    },
    /// The router did not take announced publishers (a source's session); they are no
    /// longer announced here, and may be announced again later.
    AnnounceRefused {
        /// Their ids.
        publisher_ids: Vec<u64>,
        /// Why.
        code: crate::tunnel::AnnounceRefusal,
    },
    /// Close the stream silently (the router unsubscribed).
    Close {
        /// The stream.
        stream_id: u64,
    },
    /// The session refused a subscribe itself (draining, full, a duplicate id, a bad
    /// target, the open rate); the `stream_refused` is already queued. For counting.
    Refused {
        /// The stream.
        stream_id: u64,
        /// Why.
        code: RefuseCode,
    },
    /// The router asks to drain: no new streams; open ones may run until `deadline`.
    Drain {
        /// How long open streams may still run.
        deadline: Duration,
        /// Why (it decides the reconnect delay: see [`Reconnect`](crate::tunnel::Reconnect)).
        reason: DrainReason,
    },
    /// The session is over; every stream of it ends with it.
    Ended(SessionEnd),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BrokerState {
    AwaitingWelcome { deadline: Instant },
    Active,
    Ended,
}

/// The broker's end of a session: sends `hello`, checks `welcome`, answers heartbeats,
/// turns commands into [`BrokerEvent`]s, and frames the I/O layer's answers.
///
/// ```
/// use std::time::Instant;
/// use eventplane::tunnel::protocol::{BrokerEvent, BrokerSession, Control, Hello, Limits, Welcome};
/// let now = Instant::now();
/// let mut broker = BrokerSession::new(Hello::new("broker-1", vec!["prod".into()]), now);
/// assert!(matches!(broker.poll_transmit(), Some(Control::Hello(_))));
/// broker.handle(Control::Welcome(Welcome::new(1, 9, Limits::default())), now);
/// assert!(matches!(broker.poll_event(), Some(BrokerEvent::Welcomed(_))));
/// broker.handle(Control::Subscribe { stream_id: 1, target: "tcp://10.0.0.5:5557".into() }, now);
/// assert!(matches!(broker.poll_event(), Some(BrokerEvent::Open { stream_id: 1, .. })));
/// broker.stream_opened(1);
/// assert_eq!(broker.poll_transmit(), Some(Control::StreamOpened { stream_id: 1 }));
/// ```
#[derive(Debug)]
pub struct BrokerSession {
    state: BrokerState,
    role: Role,
    /// A source's announced publishers.
    announced: HashSet<u64>,
    offered: Vec<u32>,
    limits: Limits,
    liveness: Option<Liveness>,
    /// Streams asked for and not yet refused or closed.
    streams: HashSet<u64>,
    draining: bool,
    outbox: Outbox,
    events: VecDeque<BrokerEvent>,
    /// Opens per second (the bucket starts at the welcome, with a burst of the
    /// session's stream limit).
    opens_per_second: Option<u32>,
    open_rate: Option<OpenRate>,
}

impl BrokerSession {
    /// A session that starts by sending `hello`.
    pub fn new(hello: Hello, now: Instant) -> BrokerSession {
        let offered = hello.versions.clone();
        let role = hello.role;
        let announced = hello.sources.iter().map(|s| s.publisher_id).collect();
        let mut outbox = Outbox::default();
        outbox.frames.push_back(Control::Hello(hello));
        BrokerSession {
            state: BrokerState::AwaitingWelcome {
                deadline: now + HANDSHAKE_TIMEOUT,
            },
            role,
            announced,
            offered,
            limits: Limits::default(),
            liveness: None,
            streams: HashSet::new(),
            draining: false,
            outbox,
            events: VecDeque::new(),
            opens_per_second: None,
            open_rate: None,
        }
    }

    /// With stream opens limited to `per_second` after a burst of the session's
    /// stream limit: a subscribe past it is refused with `rate_limited` (default: no
    /// limit).
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use eventplane::tunnel::protocol::{BrokerSession, Control, Hello, Limits, RefuseCode, Welcome};
    /// let now = Instant::now();
    /// let mut broker = BrokerSession::new(Hello::new("b", vec!["prod".into()]), now).with_open_rate(10);
    /// broker.poll_transmit();
    /// broker.handle(Control::Welcome(Welcome::new(1, 1, Limits::default().with_max_streams(2))), now);
    /// let subscribe = |id| Control::Subscribe { stream_id: id, target: "tcp://10.0.0.5:5557".into() };
    /// broker.handle(subscribe(1), now);
    /// broker.stream_closed(1, eventplane::tunnel::protocol::CloseCode::UpstreamClosed);
    /// broker.handle(subscribe(2), now);
    /// broker.stream_closed(2, eventplane::tunnel::protocol::CloseCode::UpstreamClosed);
    /// broker.handle(subscribe(3), now); // the burst (2) is spent
    /// assert!(broker.poll_transmit().is_some()); // the two closes
    /// assert!(broker.poll_transmit().is_some());
    /// assert_eq!(broker.poll_transmit(), Some(Control::StreamRefused { stream_id: 3, code: RefuseCode::RateLimited }));
    /// broker.handle(subscribe(4), now + Duration::from_millis(100)); // one more a tenth of a second later
    /// assert!(!broker.has_transmit());
    /// ```
    #[must_use]
    pub fn with_open_rate(mut self, per_second: u32) -> BrokerSession {
        self.opens_per_second = Some(per_second);
        self
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Control> {
        let frame = self.outbox.frames.pop_front()?;
        Some(frame)
    }

    /// `true` while frames wait to be sent.
    pub fn has_transmit(&self) -> bool {
        !self.outbox.frames.is_empty()
    }

    /// The next event for the I/O layer.
    pub fn poll_event(&mut self) -> Option<BrokerEvent> {
        self.events.pop_front()
    }

    /// The limits in force (the `welcome`'s, once welcomed).
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// `true` once the session ended (an `Ended` event says why).
    pub fn is_ended(&self) -> bool {
        self.state == BrokerState::Ended
    }

    /// Streams open or being opened.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            BrokerState::AwaitingWelcome { deadline } => Some(deadline),
            BrokerState::Active => self.liveness.as_ref().map(Liveness::next_deadline),
            BrokerState::Ended => None,
        }
    }

    /// Sends a heartbeat when one is due; ends the session when the router was silent
    /// past the idle timeout, or the handshake ran out of time.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            BrokerState::AwaitingWelcome { deadline } if now >= deadline => {
                self.end(SessionEnd::HandshakeTimeout(HANDSHAKE_TIMEOUT));
            }
            BrokerState::Active => {
                let Some(l) = self.liveness.as_mut() else {
                    return;
                };
                if now >= l.last_heard + l.idle {
                    let idle = l.idle;
                    self.end(SessionEnd::IdleTimeout(idle));
                } else if now >= l.last_sent + l.interval {
                    l.last_sent = now;
                    self.send(Control::Heartbeat);
                }
            }
            _ => {}
        }
    }

    /// A frame from the router.
    pub fn handle(&mut self, frame: Control, now: Instant) {
        if let Some(l) = self.liveness.as_mut() {
            l.last_heard = now;
        }
        match (self.state, frame) {
            (BrokerState::Ended, _) => {}
            (BrokerState::AwaitingWelcome { .. }, Control::Welcome(welcome)) => {
                if !self.offered.contains(&welcome.version) {
                    return self.end(SessionEnd::Protocol(
                        "welcome names a version the hello did not offer",
                    ));
                }
                if self.role == Role::Source && welcome.version < PROTOCOL_VERSION {
                    return self.end(SessionEnd::Protocol(
                        "a source's session needs protocol version 2",
                    ));
                }
                let l = welcome.limits;
                if l.heartbeat_interval.is_zero() || l.idle_timeout <= l.heartbeat_interval {
                    return self.end(SessionEnd::Protocol(
                        "welcome's idle timeout must exceed a non-zero heartbeat interval",
                    ));
                }
                // A router cannot make this broker hold more than its own cap.
                self.limits = Limits {
                    max_streams: l.max_streams.min(MAX_BROKER_STREAMS),
                    ..l
                };
                self.liveness = Some(Liveness::new(&l, now));
                self.open_rate = self
                    .opens_per_second
                    .map(|rate| OpenRate::new(rate, self.limits.max_streams, now));
                self.state = BrokerState::Active;
                self.events.push_back(BrokerEvent::Welcomed(welcome));
            }
            (BrokerState::AwaitingWelcome { .. }, Control::Denied { code }) => {
                self.end(SessionEnd::Denied(code));
            }
            (BrokerState::AwaitingWelcome { .. }, _) => {
                self.end(SessionEnd::Protocol("the first frame was not a welcome"));
            }
            (BrokerState::Active, Control::Heartbeat | Control::Unknown) => {}
            (BrokerState::Active, Control::Denied { code }) => {
                self.end(SessionEnd::Denied(code));
            }
            (BrokerState::Active, Control::Subscribe { stream_id, target }) => {
                let refuse = if self.draining {
                    Some(RefuseCode::Draining)
                } else if self.streams.contains(&stream_id) {
                    Some(RefuseCode::DuplicateStream)
                } else if self.streams.len() >= self.limits.max_streams as usize {
                    Some(RefuseCode::TooManyStreams)
                } else if let Err(code) = self.servable(&target) {
                    Some(code)
                } else if self.open_rate.as_mut().is_some_and(|r| !r.take(now)) {
                    Some(RefuseCode::RateLimited)
                } else {
                    None
                };
                match refuse {
                    Some(code) => {
                        self.send(Control::StreamRefused { stream_id, code });
                        if !self.is_ended() {
                            self.events
                                .push_back(BrokerEvent::Refused { stream_id, code });
                        }
                    }
                    None => {
                        self.streams.insert(stream_id);
                        self.events.push_back(match target {
                            Target::Announced { publisher_id } => BrokerEvent::Serve {
                                stream_id,
                                publisher_id,
                            },
                            Target::Recovery { publisher_id } => BrokerEvent::ServeRecovery {
                                stream_id,
                                publisher_id,
                            },
                            Target::Tcp(target) => BrokerEvent::Open { stream_id, target },
                            // `servable` refused it above.
                            Target::Unsupported => return,
                        });
                    }
                }
            }
            (
                BrokerState::Active,
                Control::AnnounceRefused {
                    publisher_ids,
                    code,
                },
            ) if self.role == Role::Source => {
                let publisher_ids: Vec<u64> = publisher_ids
                    .into_iter()
                    .filter(|id| self.announced.remove(id))
                    .collect();
                if !publisher_ids.is_empty() {
                    self.events.push_back(BrokerEvent::AnnounceRefused {
                        publisher_ids,
                        code,
                    });
                }
            }
            (BrokerState::Active, Control::Unsubscribe { stream_id }) => {
                if self.streams.remove(&stream_id) {
                    self.events.push_back(BrokerEvent::Close { stream_id });
                }
            }
            (BrokerState::Active, Control::Drain { deadline, reason }) => {
                self.draining = true;
                self.events
                    .push_back(BrokerEvent::Drain { deadline, reason });
            }
            (BrokerState::Active, Control::Welcome(_)) => {
                self.end(SessionEnd::Protocol("a second welcome"));
            }
            (BrokerState::Active, _) => {
                self.end(SessionEnd::Protocol(
                    "a frame only a broker sends came from the router",
                ));
            }
        }
    }

    /// Whether this session's role serves `target`, or why not: a broker dials
    /// `tcp://` targets, a source serves the publishers it announces.
    fn servable(&self, target: &Target) -> Result<(), RefuseCode> {
        match (self.role, target) {
            (Role::Broker, Target::Tcp(t)) if crate::zmtp::parse_tcp(t).is_ok() => Ok(()),
            (Role::Broker, Target::Tcp(_)) => Err(RefuseCode::BadTarget),
            (
                Role::Source,
                Target::Announced { publisher_id } | Target::Recovery { publisher_id },
            ) => {
                if self.announced.contains(publisher_id) {
                    Ok(())
                } else {
                    Err(RefuseCode::TargetNotAnnounced)
                }
            }
            _ => Err(RefuseCode::UnsupportedTarget),
        }
    }

    /// A source announces `sources` (in frames of at most 64); the
    /// router may subscribe to them from now on. Queued before the welcome, they
    /// follow the `hello`.
    pub fn announce(&mut self, sources: Vec<AnnouncedSource>) {
        if self.role != Role::Source {
            return;
        }
        self.announced
            .extend(sources.iter().map(|s| s.publisher_id));
        let mut rest = sources;
        while !rest.is_empty() {
            let tail = rest.split_off(rest.len().min(MAX_ANNOUNCE));
            self.send(Control::Announce { sources: rest });
            rest = tail;
        }
    }

    /// A source withdraws `publisher_ids`: the router subscribes to them no more (the
    /// I/O layer closes their open streams).
    pub fn withdraw(&mut self, publisher_ids: Vec<u64>) {
        let mut ids: Vec<u64> = publisher_ids
            .into_iter()
            .filter(|id| self.announced.remove(id))
            .collect();
        while !ids.is_empty() {
            let tail = ids.split_off(ids.len().min(MAX_ANNOUNCE));
            self.send(Control::Withdraw { publisher_ids: ids });
            ids = tail;
        }
    }

    /// The publishers a source announces now.
    pub fn announced(&self) -> usize {
        self.announced.len()
    }

    /// The publisher connection for `stream_id` is up.
    pub fn stream_opened(&mut self, stream_id: u64) {
        if self.streams.contains(&stream_id) {
            self.send(Control::StreamOpened { stream_id });
        }
    }

    /// The subscribe for `stream_id` is refused (by the target checks, a deadline, …).
    pub fn stream_refused(&mut self, stream_id: u64, code: RefuseCode) {
        if self.streams.remove(&stream_id) {
            self.send(Control::StreamRefused { stream_id, code });
        }
    }

    /// An open stream ended on this side (publisher gone, buffer overflow).
    pub fn stream_closed(&mut self, stream_id: u64, code: CloseCode) {
        if self.streams.remove(&stream_id) {
            self.send(Control::StreamClosed { stream_id, code });
        }
    }

    /// The router ended its side of `stream_id`'s data stream: forget it silently
    /// (its `unsubscribe` may follow, or may never come; the slot is free either
    /// way).
    pub fn stream_forgotten(&mut self, stream_id: u64) {
        self.streams.remove(&stream_id);
    }

    /// This broker is shutting down: says `draining`, and refuses every new subscribe
    /// with `draining` from now on.
    pub fn begin_draining(&mut self) {
        if !self.draining {
            self.draining = true;
            self.send(Control::Draining);
        }
    }

    /// `true` once draining (asked by the router, or by [`begin_draining`](Self::begin_draining)).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Ends the session from this side.
    pub fn close(&mut self) {
        self.end(SessionEnd::Closed);
    }

    /// Ends the session for `why` (the I/O layer found the peer's bytes unusable).
    pub fn abort(&mut self, why: SessionEnd) {
        self.end(why);
    }

    fn send(&mut self, frame: Control) {
        if let Err(end) = self.outbox.push(frame) {
            self.end(end);
        }
    }

    fn end(&mut self, why: SessionEnd) {
        if self.state != BrokerState::Ended {
            self.state = BrokerState::Ended;
            self.streams.clear();
            self.outbox.frames.clear();
            self.events.push_back(BrokerEvent::Ended(why));
        }
    }
}
