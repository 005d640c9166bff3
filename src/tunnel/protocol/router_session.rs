//! The router's end of a tunnel session as a sans-IO state machine (DESIGN §7.1,
//! §7.3): it waits for `hello`, holds it to the credential's grant, answers
//! `welcome`, and tracks every stream from subscribe to data stream to close.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::tunnel::protocol::announce::{AnnouncedSource, Role, Target};
use crate::tunnel::protocol::broker_session::{
    Grant, HANDSHAKE_TIMEOUT, Liveness, OpenRate, Outbox, PENDING_SUBSCRIBE_TIMEOUT, SessionEnd,
};
use crate::tunnel::protocol::frame::{
    AnnounceRefusal, CloseCode, Control, DenyCode, DrainReason, Limits, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION, RefuseCode, Welcome,
};

/// `announce` frames a source may send at once (its `hello` not counted): 1,024
/// publishers' worth of full frames, and room to spare.
pub const ANNOUNCE_BURST: u32 = 32;

/// `announce` frames a source may send a second after its burst; past it, the session
/// is denied `announcing_too_fast` (each frame may re-register up to
/// 64 publishers, which every router following the
/// bus then dials again).
pub const ANNOUNCES_PER_SECOND: u32 = 4;

/// What a router session tells its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionEvent {
    /// A client said `hello` and was welcomed (a source's first announcements follow
    /// as [`Announced`](Self::Announced)).
    Welcomed {
        /// Its client id (a session with the same id supersedes the older one).
        client_id: String,
        /// The namespaces it covers (a broker) or announces in (a source).
        namespaces: Vec<String>,
        /// The negotiated version.
        version: u32,
        /// Its role.
        role: Role,
    },
    /// A source announced publishers (within its grant and `max_sources`); one
    /// announced again replaces its earlier announcement.
    Announced(Vec<AnnouncedSource>),
    /// A source withdrew publishers it had announced.
    Withdrawn(Vec<u64>),
    /// The broker connected the publisher; the data stream follows.
    Opened(u64),
    /// The broker refused the subscribe.
    Refused {
        /// The stream.
        stream_id: u64,
        /// Why.
        code: RefuseCode,
    },
    /// An open stream ended on the broker's side: resubscribe.
    Closed {
        /// The stream.
        stream_id: u64,
        /// Why.
        code: CloseCode,
    },
    /// A subscribe got no answer, or no data stream, within
    /// [`PENDING_SUBSCRIBE_TIMEOUT`]: resubscribe (elsewhere, perhaps).
    Expired(u64),
    /// The broker is shutting down: move its subscriptions.
    BrokerDraining,
    /// The session is over; every stream of it ends with it.
    Ended(SessionEnd),
}

/// Why the router cannot subscribe through this session now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// The broker has not said `hello` yet, or the session ended.
    #[error("the session is not active")]
    NotActive,
    /// The broker is draining.
    #[error("the broker is draining")]
    Draining,
    /// The session's stream limit is reached.
    #[error("the session's stream limit is reached")]
    TooManyStreams,
    /// The stream id is in use in this session.
    #[error("the stream id is in use")]
    DuplicateStream,
    /// The target is empty, over [`MAX_NAME_LEN`](crate::tunnel::MAX_NAME_LEN) bytes, or not
    /// `tcp://host:port`: no broker could dial it, so it is never sent.
    #[error("the target is not a tcp://host:port of at most 1024 bytes")]
    BadTarget,
    /// The target's kind is not the session's role's: an announced target through a
    /// broker, a `tcp://` one through a source.
    #[error("the session's role does not serve this kind of target")]
    UnsupportedTarget,
    /// The source does not announce this publisher (now).
    #[error("the source does not announce this publisher")]
    NotAnnounced,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamState {
    /// Subscribed; until the deadline, waiting for `stream_opened` and the data stream.
    Pending { deadline: Instant, opened: bool },
    /// The data stream is attached.
    Active,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum RouterState {
    AwaitingHello { deadline: Instant },
    Active { draining: bool },
    Ended,
}

/// The router's end of a session: waits for `hello`, answers `welcome`, tracks every
/// stream from subscribe to data stream to close, and expires what never completes.
///
/// ```
/// use std::time::{Duration, Instant};
/// use eventplane::tunnel::protocol::{Control, Hello, Limits, RefuseCode, SessionEvent, RouterSession};
/// let now = Instant::now();
/// let limits = Limits::default().with_heartbeat(Duration::from_secs(10), Duration::from_secs(60));
/// let mut router = RouterSession::new(7, limits, now);
/// router.handle(Control::Hello(Hello::new("broker-1", vec!["prod".into()])), now);
/// assert!(matches!(router.poll_transmit(), Some(Control::Welcome(_))));
/// assert!(matches!(router.poll_event(), Some(SessionEvent::Welcomed { .. })));
/// router.subscribe(1, "tcp://10.0.0.5:5557".into(), now)?;
/// assert!(matches!(router.poll_transmit(), Some(Control::Subscribe { stream_id: 1, .. })));
/// // No answer and no data stream for 30 s: expired, and a late data stream is refused.
/// router.handle(Control::Heartbeat, now + Duration::from_secs(20)); // the broker is alive
/// router.handle_timeout(now + Duration::from_secs(31));
/// assert_eq!(router.poll_event(), Some(SessionEvent::Expired(1)));
/// assert_eq!(router.accept_data_stream(1), Err(RefuseCode::UnknownStream));
/// # Ok::<(), eventplane::tunnel::protocol::SubscribeError>(())
/// ```
#[derive(Debug)]
pub struct RouterSession {
    state: RouterState,
    session_id: u64,
    limits: Limits,
    liveness: Liveness,
    streams: HashMap<u64, StreamState>,
    outbox: Outbox,
    events: VecDeque<SessionEvent>,
    grant: Grant,
    role: Role,
    /// A source's announced publishers.
    announced: HashMap<u64, AnnouncedSource>,
    /// A source's `announce` frames ([`ANNOUNCE_BURST`], [`ANNOUNCES_PER_SECOND`]).
    announce_rate: OpenRate,
}

impl RouterSession {
    /// A session that waits for the broker's `hello` and will offer `limits`; any
    /// hello is accepted (see [`with_grant`](Self::with_grant)).
    pub fn new(session_id: u64, limits: Limits, now: Instant) -> RouterSession {
        RouterSession {
            state: RouterState::AwaitingHello {
                deadline: now + HANDSHAKE_TIMEOUT,
            },
            session_id,
            liveness: Liveness::new(&limits, now),
            limits,
            streams: HashMap::new(),
            outbox: Outbox::default(),
            events: VecDeque::new(),
            grant: Grant::any(),
            role: Role::Broker,
            announced: HashMap::new(),
            announce_rate: OpenRate::new(ANNOUNCES_PER_SECOND, ANNOUNCE_BURST, now),
        }
    }

    /// With the hello held to `grant`: one outside it is answered `denied` and the
    /// session ends with [`SessionEnd::Denied`].
    ///
    /// ```
    /// use std::time::Instant;
    /// use eventplane::tunnel::protocol::{Control, DenyCode, Grant, Hello, Limits, SessionEvent, RouterSession, SessionEnd};
    /// let now = Instant::now();
    /// let grant = Grant::namespaces(vec!["prod".into()]).with_client_id("broker-a");
    /// let mut router = RouterSession::new(1, Limits::default(), now).with_grant(grant);
    /// router.handle(Control::Hello(Hello::new("broker-b", vec!["prod".into()])), now);
    /// assert_eq!(router.poll_transmit(), Some(Control::Denied { code: DenyCode::ClientIdNotGranted }));
    /// assert_eq!(router.poll_event(), Some(SessionEvent::Ended(SessionEnd::Denied(DenyCode::ClientIdNotGranted))));
    /// ```
    #[must_use]
    pub fn with_grant(mut self, grant: Grant) -> RouterSession {
        self.grant = grant;
        self
    }

    /// Whether another subscribe fits under the session's stream limit.
    pub fn has_room(&self) -> bool {
        self.streams.len() < self.limits.max_streams as usize
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Control> {
        self.outbox.frames.pop_front()
    }

    /// `true` while frames wait to be sent.
    pub fn has_transmit(&self) -> bool {
        !self.outbox.frames.is_empty()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// `true` once the session ended.
    pub fn is_ended(&self) -> bool {
        self.state == RouterState::Ended
    }

    /// `true` while the broker can take subscribes.
    pub fn is_available(&self) -> bool {
        self.state == RouterState::Active { draining: false }
    }

    /// Streams subscribed and not yet closed, refused or expired.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            RouterState::AwaitingHello { deadline } => Some(deadline),
            RouterState::Active { .. } => {
                let pending = self.streams.values().filter_map(|s| match s {
                    StreamState::Pending { deadline, .. } => Some(*deadline),
                    StreamState::Active => None,
                });
                Some(pending.fold(self.liveness.next_deadline(), Instant::min))
            }
            RouterState::Ended => None,
        }
    }

    /// Heartbeats, the idle timeout, the handshake deadline, and expired subscribes.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            RouterState::AwaitingHello { deadline } if now >= deadline => {
                self.end(SessionEnd::HandshakeTimeout(HANDSHAKE_TIMEOUT));
            }
            RouterState::Active { .. } => {
                let l = &mut self.liveness;
                if now >= l.last_heard + l.idle {
                    let idle = l.idle;
                    return self.end(SessionEnd::IdleTimeout(idle));
                }
                if now >= l.last_sent + l.interval {
                    l.last_sent = now;
                    self.send(Control::Heartbeat);
                }
                let mut expired: Vec<u64> = self
                    .streams
                    .iter()
                    .filter(|(_, s)| matches!(s, StreamState::Pending { deadline, .. } if now >= *deadline))
                    .map(|(id, _)| *id)
                    .collect();
                expired.sort_unstable();
                for id in expired {
                    self.streams.remove(&id);
                    // The broker may have it open: tell it to let go.
                    self.send(Control::Unsubscribe { stream_id: id });
                    self.events.push_back(SessionEvent::Expired(id));
                }
            }
            _ => {}
        }
    }

    /// A frame from the broker.
    pub fn handle(&mut self, frame: Control, now: Instant) {
        self.liveness.last_heard = now;
        match (&self.state, frame) {
            (RouterState::Ended, _) => {}
            (RouterState::AwaitingHello { .. }, Control::Hello(hello)) => {
                // The highest version both speak (a source's role needs version 2).
                let oldest = match hello.role {
                    Role::Source => PROTOCOL_VERSION,
                    Role::Broker => MIN_PROTOCOL_VERSION,
                };
                let Some(version) = hello
                    .versions
                    .iter()
                    .copied()
                    .filter(|v| (oldest..=PROTOCOL_VERSION).contains(v))
                    .max()
                else {
                    return self.end(SessionEnd::NoCommonVersion {
                        offered: hello.versions,
                    });
                };
                let too_many = hello.sources.len() > self.limits.max_sources as usize;
                let checked = self.grant.check(&hello).and(if too_many {
                    Err(DenyCode::TooManySources)
                } else {
                    Ok(())
                });
                if let Err(code) = checked {
                    return self.deny(code);
                }
                self.role = hello.role;
                self.state = RouterState::Active { draining: false };
                self.liveness = Liveness::new(&self.limits, now);
                self.send(Control::Welcome(Welcome::new(
                    version,
                    self.session_id,
                    self.limits,
                )));
                self.events.push_back(SessionEvent::Welcomed {
                    client_id: hello.client_id,
                    namespaces: hello.namespaces,
                    version,
                    role: hello.role,
                });
                if !hello.sources.is_empty() {
                    self.announce(hello.sources);
                }
            }
            (RouterState::AwaitingHello { .. }, _) => {
                self.end(SessionEnd::Protocol("the first frame was not a hello"));
            }
            (RouterState::Active { .. }, Control::Heartbeat | Control::Unknown) => {}
            (RouterState::Active { .. }, Control::StreamOpened { stream_id }) => {
                if let Some(StreamState::Pending { opened, .. }) = self.streams.get_mut(&stream_id)
                {
                    *opened = true;
                    self.events.push_back(SessionEvent::Opened(stream_id));
                }
            }
            (RouterState::Active { .. }, Control::StreamRefused { stream_id, code }) => {
                if self.streams.remove(&stream_id).is_some() {
                    self.events
                        .push_back(SessionEvent::Refused { stream_id, code });
                }
            }
            (RouterState::Active { .. }, Control::StreamClosed { stream_id, code }) => {
                if self.streams.remove(&stream_id).is_some() {
                    self.events
                        .push_back(SessionEvent::Closed { stream_id, code });
                }
            }
            (RouterState::Active { .. }, Control::Announce { sources })
                if self.role == Role::Source =>
            {
                if let Err(code) = sources.iter().try_for_each(|s| self.grant.check_source(s)) {
                    return self.deny(code);
                }
                if !self.announce_rate.take(now) {
                    return self.deny(DenyCode::AnnouncingTooFast);
                }
                let new: HashSet<u64> = sources
                    .iter()
                    .map(|s| s.publisher_id)
                    .filter(|id| !self.announced.contains_key(id))
                    .collect();
                if self.announced.len() + new.len() > self.limits.max_sources as usize {
                    return self.deny(DenyCode::TooManySources);
                }
                self.announce(sources);
            }
            (RouterState::Active { .. }, Control::Withdraw { publisher_ids })
                if self.role == Role::Source =>
            {
                let gone: Vec<u64> = publisher_ids
                    .into_iter()
                    .filter(|id| self.announced.remove(id).is_some())
                    .collect();
                if !gone.is_empty() {
                    self.events.push_back(SessionEvent::Withdrawn(gone));
                }
            }
            (RouterState::Active { .. }, Control::Draining) => {
                self.state = RouterState::Active { draining: true };
                self.events.push_back(SessionEvent::BrokerDraining);
            }
            (RouterState::Active { .. }, _) => {
                self.end(SessionEnd::Protocol(
                    "a frame only a router sends came from the broker",
                ));
            }
        }
    }

    /// Asks the broker to relay `target` (`tcp://host:port`) as `stream_id`.
    pub fn subscribe(
        &mut self,
        stream_id: u64,
        target: String,
        now: Instant,
    ) -> Result<(), SubscribeError> {
        self.subscribe_to(stream_id, Target::Tcp(target), now)
    }

    /// Asks the session's client to open `target` as `stream_id`: a broker relays a
    /// `tcp://` target, a source serves a publisher it announces.
    ///
    /// ```
    /// use std::time::Instant;
    /// use eventplane::discovery::ChannelId;
    /// use eventplane::tunnel::protocol::{AnnouncedSource, Control, Hello, Limits, RouterSession, SubscribeError, Target};
    /// use eventplane::wire::Dialect;
    /// let now = Instant::now();
    /// let mut router = RouterSession::new(1, Limits::default(), now);
    /// let id = ChannelId::new("prod", "backend", "kv-events", 7)?;
    /// router.handle(Control::Hello(Hello::source("gpu-1", vec!["prod".into()], vec![AnnouncedSource::new(&id, Dialect::EventPlane)])), now);
    /// router.subscribe_to(1, Target::Announced { publisher_id: 7 }, now)?;
    /// assert_eq!(router.subscribe_to(2, Target::Announced { publisher_id: 8 }, now), Err(SubscribeError::NotAnnounced));
    /// assert_eq!(router.subscribe(3, "tcp://10.0.0.5:5557".into(), now), Err(SubscribeError::UnsupportedTarget));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn subscribe_to(
        &mut self,
        stream_id: u64,
        target: Target,
        now: Instant,
    ) -> Result<(), SubscribeError> {
        match self.state {
            RouterState::Active { draining: false } => {}
            RouterState::Active { draining: true } => return Err(SubscribeError::Draining),
            _ => return Err(SubscribeError::NotActive),
        }
        match (&target, self.role) {
            (Target::Tcp(t), Role::Broker)
                if !crate::tunnel::protocol::frame::is_valid_target(t) =>
            {
                return Err(SubscribeError::BadTarget);
            }
            (Target::Tcp(_), Role::Broker) => {}
            (Target::Announced { publisher_id }, Role::Source) => {
                if !self.announced.contains_key(publisher_id) {
                    return Err(SubscribeError::NotAnnounced);
                }
            }
            // Only a publisher announced with a recovery log is asked for it.
            (Target::Recovery { publisher_id }, Role::Source) => {
                if !self.announced.get(publisher_id).is_some_and(|s| s.recovery) {
                    return Err(SubscribeError::NotAnnounced);
                }
            }
            _ => return Err(SubscribeError::UnsupportedTarget),
        }
        if self.streams.contains_key(&stream_id) {
            return Err(SubscribeError::DuplicateStream);
        }
        if self.streams.len() >= self.limits.max_streams as usize {
            return Err(SubscribeError::TooManyStreams);
        }
        self.streams.insert(
            stream_id,
            StreamState::Pending {
                deadline: now + PENDING_SUBSCRIBE_TIMEOUT,
                opened: false,
            },
        );
        self.send(Control::Subscribe { stream_id, target });
        Ok(())
    }

    /// Stops relaying `stream_id` (the broker closes it silently).
    pub fn unsubscribe(&mut self, stream_id: u64) {
        if self.streams.remove(&stream_id).is_some() {
            self.send(Control::Unsubscribe { stream_id });
        }
    }

    /// A data stream for `stream_id` arrived: attach it, or refuse it with
    /// `unknown_stream` (never subscribed here, expired, or already attached).
    pub fn accept_data_stream(&mut self, stream_id: u64) -> Result<(), RefuseCode> {
        match self.streams.get_mut(&stream_id) {
            // The data stream may overtake `stream_opened` (they travel separately).
            Some(s @ StreamState::Pending { .. }) => {
                *s = StreamState::Active;
                Ok(())
            }
            _ => Err(RefuseCode::UnknownStream),
        }
    }

    /// The data stream of `stream_id` ended on this side (the router's socket closed
    /// it, or the transport failed): forget it and tell the broker.
    pub fn data_stream_ended(&mut self, stream_id: u64) {
        self.unsubscribe(stream_id);
    }

    /// Asks the broker to drain (shutdown, or moving its subscriptions elsewhere).
    pub fn drain(&mut self, deadline: Duration, reason: DrainReason) {
        if let RouterState::Active { .. } = self.state {
            self.state = RouterState::Active { draining: true };
            self.send(Control::Drain { deadline, reason });
        }
    }

    /// Ends the session from this side (a newer session of the same client id
    /// superseded it, or the router is stopping).
    pub fn close(&mut self) {
        self.end(SessionEnd::Closed);
    }

    /// Ends the session for `why` (the I/O layer found the peer's bytes unusable).
    pub fn abort(&mut self, why: SessionEnd) {
        self.end(why);
    }

    /// The client's role (a broker until a hello says otherwise).
    pub fn role(&self) -> Role {
        self.role
    }

    /// Records `sources` as announced and tells the owner of those that changed (an
    /// identical announcement again is no news: it costs the views nothing). A
    /// publisher named twice in one frame is announced as its last entry says.
    fn announce(&mut self, sources: Vec<AnnouncedSource>) {
        let mut last: HashMap<u64, usize> = HashMap::new();
        for (i, s) in sources.iter().enumerate() {
            last.insert(s.publisher_id, i);
        }
        let changed: Vec<AnnouncedSource> = sources
            .into_iter()
            .enumerate()
            .filter(|(i, s)| last.get(&s.publisher_id) == Some(i))
            .map(|(_, s)| s)
            .filter(|s| self.announced.get(&s.publisher_id) != Some(s))
            .collect();
        for source in &changed {
            self.announced.insert(source.publisher_id, source.clone());
        }
        if !changed.is_empty() {
            self.events.push_back(SessionEvent::Announced(changed));
        }
    }

    /// The owner did not take the `refused` announcements (another source's credential
    /// holds their channel, or the bus is full): those still announced as they were are
    /// no longer announced on this session, and the source is told with
    /// `announce_refused{code}` (it announces them again later).
    pub fn refuse_announced(&mut self, code: AnnounceRefusal, refused: Vec<AnnouncedSource>) {
        // Only the announcement held now: one the source replaced since (in the same
        // read) is the owner's to take or refuse in turn.
        let mut ids: Vec<u64> = refused
            .into_iter()
            .filter(|s| self.announced.get(&s.publisher_id) == Some(s))
            .map(|s| s.publisher_id)
            .collect();
        for id in &ids {
            self.announced.remove(id);
        }
        while !ids.is_empty() && self.state != RouterState::Ended {
            let tail = ids.split_off(ids.len().min(crate::tunnel::MAX_ANNOUNCE));
            self.send(Control::AnnounceRefused {
                publisher_ids: ids,
                code,
            });
            ids = tail;
        }
    }

    /// Answers `denied{code}` and ends the session.
    fn deny(&mut self, code: DenyCode) {
        self.end(SessionEnd::Denied(code));
        // The one frame an ended session still sends: why.
        self.outbox.frames.push_back(Control::Denied { code });
    }

    fn send(&mut self, frame: Control) {
        if let Err(end) = self.outbox.push(frame) {
            self.end(end);
        }
    }

    fn end(&mut self, why: SessionEnd) {
        if self.state != RouterState::Ended {
            self.state = RouterState::Ended;
            self.streams.clear();
            self.outbox.frames.clear();
            self.events.push_back(SessionEvent::Ended(why));
        }
    }
}
