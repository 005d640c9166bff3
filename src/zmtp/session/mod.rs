//! The sans-IO per-connection state machine.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::codec::{
    Command, Decoded, FrameDecoder, FrameLimits, GreetingDecoder, encode_frame_header,
    encode_greeting, encode_message,
};
use super::prefix::PrefixMap;
use super::{Config, Error, Message, ProtocolError, TimeoutKind};

mod handshake;
#[cfg(any(test, fuzzing, feature = "unstable"))]
mod pair;
mod receive;
mod types;

#[cfg(any(test, fuzzing, feature = "unstable"))]
pub use pair::{Pair, Side};
pub use types::{Event, PeerInfo, SessionStats, SocketType};

/// Output the session will buffer before it stops decoding input until the I/O layer
/// has written some of it out. Bounds what a peer can make us queue by sending PINGs
/// (or subscriptions) without reading our replies.
pub(crate) const MAX_PENDING_OUTPUT: usize = 256 << 10;

/// Smallest command limit of a publisher's session after the handshake: room for
/// ERROR (255-byte reason) and PING/PONG whatever `max_subscription_size` is.
const PUB_MIN_COMMAND_SIZE: usize = 512;

#[derive(Debug)]
enum State {
    Greeting(GreetingDecoder),
    AwaitReady,
    Active,
    Failed,
}

/// One ZMTP connection, sans I/O: bytes in, bytes and events out, time passed in.
///
/// Drive it like this, in a loop:
/// 1. write out everything [`poll_transmit`](Self::poll_transmit) returns;
/// 2. call [`poll_event`](Self::poll_event) until it returns `Ok(None)`;
/// 3. when [`poll_timeout`](Self::poll_timeout)'s instant passes, call
///    [`handle_timeout`](Self::handle_timeout);
/// 4. read from the transport and hand the bytes to
///    [`handle_bytes`](Self::handle_bytes) (or read straight into
///    [`input_buffer`](Self::input_buffer) and call
///    [`handle_input`](Self::handle_input)).
///
/// Our greeting is queued at construction and sent at once; the peer's greeting is
/// parsed as it trickles in. Events are decoded lazily, one per call, so nothing the
/// peer sends is ever queued beyond the input buffer; and decoding pauses while more
/// than 256 KiB of replies wait to be written.
///
/// Driven by hand, two sessions back to back (`zmtp::Pair`, feature `unstable`, does
/// this with a clock):
///
/// ```
/// use std::time::Instant;
/// use eventplane::zmtp::{Config, Session, SocketType, Event};
///
/// let now = Instant::now();
/// let mut sub = Session::new(SocketType::Sub, &Config::default(), now);
/// let mut publ = Session::new(SocketType::Pub, &Config::default(), now);
/// sub.subscribe(b"kv".as_slice().into());
/// // Shuttle bytes both ways until both sides are ready.
/// for _ in 0..3 {
///     while let Some(b) = sub.poll_transmit() { publ.handle_bytes(now, &b); }
///     while let Some(b) = publ.poll_transmit() { sub.handle_bytes(now, &b); }
///     while let Some(ev) = publ.poll_event()? {
///         if let Event::Subscribe(prefix) = ev { assert_eq!(&prefix[..], b"kv"); }
///     }
///     while sub.poll_event()?.is_some() {}
/// }
/// assert!(sub.is_ready() && publ.is_ready());
/// # Ok::<(), eventplane::zmtp::Error>(())
/// ```
#[derive(Debug)]
pub struct Session {
    socket_type: SocketType,
    config: Config,
    state: State,
    peer: Option<PeerInfo>,
    input: BytesMut,
    output: BytesMut,
    decoder: FrameDecoder,
    /// SUB: our subscriptions with reference counts; also the local filter.
    subscriptions: PrefixMap<u32>,
    /// PUB: the peer's subscriptions with reference counts.
    peer_subscriptions: HashMap<Bytes, u32>,
    handshake_deadline: Option<Instant>,
    next_ping: Option<Instant>,
    ping_deadline: Option<Instant>,
    peer_ttl: Option<Duration>,
    last_input: Instant,
    /// The answer to the latest PING, until the I/O layer takes the output.
    pending_pong: Option<Bytes>,
    stats: SessionStats,
}

impl Session {
    /// A new connection for `socket_type`, with our greeting queued for transmission
    /// and the handshake deadline counting from `now`.
    pub fn new(socket_type: SocketType, config: &Config, now: Instant) -> Session {
        let mut output = BytesMut::with_capacity(128);
        encode_greeting(&mut output);
        let limits = FrameLimits {
            max_frame_size: config.max_frame_size,
            max_message_size: config.max_message_size,
            max_message_parts: config.max_message_parts,
            max_command_size: config.max_metadata_size,
            strict: config.strict,
        };
        // Until READY the peer may only send commands: a message header fails at once.
        let mut decoder = FrameDecoder::new(limits);
        decoder.set_commands_only(true);
        Session {
            socket_type,
            config: config.clone(),
            state: State::Greeting(GreetingDecoder::new()),
            peer: None,
            input: BytesMut::new(),
            output,
            decoder,
            subscriptions: PrefixMap::default(),
            peer_subscriptions: HashMap::new(),
            handshake_deadline: now.checked_add(config.handshake_timeout),
            next_ping: None,
            ping_deadline: None,
            peer_ttl: None,
            last_input: now,
            pending_pong: None,
            stats: SessionStats::default(),
        }
    }

    /// Our socket type.
    pub fn socket_type(&self) -> SocketType {
        self.socket_type
    }

    /// `true` once the peer's READY was accepted.
    pub fn is_ready(&self) -> bool {
        matches!(self.state, State::Active)
    }

    /// `true` after a fatal error; every later call fails with
    /// [`Error::SocketClosed`].
    pub fn is_failed(&self) -> bool {
        matches!(self.state, State::Failed)
    }

    /// The peer, once the handshake completed.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
    }

    /// Counters.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// The buffer the I/O layer may read into directly; call
    /// [`handle_input`](Self::handle_input) after appending.
    pub fn input_buffer(&mut self) -> &mut BytesMut {
        &mut self.input
    }

    /// Records that bytes were appended to [`input_buffer`](Self::input_buffer) at
    /// `now`. Any byte counts as liveness for the heartbeat.
    pub fn handle_input(&mut self, now: Instant) {
        self.last_input = now;
        self.ping_deadline = None;
    }

    /// Appends received bytes (copying); equivalent to extending
    /// [`input_buffer`](Self::input_buffer) and calling
    /// [`handle_input`](Self::handle_input).
    pub fn handle_bytes(&mut self, now: Instant, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.input.extend_from_slice(bytes);
            self.handle_input(now);
        }
    }

    /// How many more input bytes would let decoding progress (at least 1). The I/O
    /// layer reads `min(this, read_chunk)`-ish amounts; the value is bounded by the
    /// configured limits, never by what the peer claims beyond them.
    pub fn input_needed(&self) -> usize {
        match &self.state {
            State::Greeting(g) => super::codec::GREETING_LEN - g.received(),
            _ => self.decoder.needed(self.input.len()),
        }
    }

    /// `false` while too much output waits to be written: the I/O layer should write
    /// before it reads more.
    pub fn wants_input(&self) -> bool {
        self.output.len() < MAX_PENDING_OUTPUT && !self.is_failed()
    }

    /// Bytes the session holds for the peer and has not handed out yet (control
    /// output and a pending PONG).
    pub fn pending_output(&self) -> usize {
        let pong = self.pending_pong.as_ref().map_or(0, |c| c.len() + 7);
        self.output.len() + pong
    }

    /// Copies the frames of a partly received message out of the input buffer (see
    /// [`FrameDecoder::compact_parts`]); an I/O layer calls it before replacing the
    /// buffer it reads into.
    pub fn compact_partial_message(&mut self, max_part: usize) {
        if self.decoder.in_message() {
            self.decoder.compact_parts(max_part);
        }
    }

    /// `true` when the peer has been silent past the heartbeat timeout or its own
    /// TTL: the next [`handle_timeout`](Self::handle_timeout) fails. An I/O layer that
    /// was not polled for a while should first read what the transport already holds
    /// (any byte counts as liveness).
    pub fn peer_silent(&self, now: Instant) -> bool {
        let ttl_deadline = self
            .peer_ttl
            .and_then(|ttl| self.last_input.checked_add(ttl));
        [self.ping_deadline, ttl_deadline]
            .into_iter()
            .flatten()
            .any(|d| d <= now)
    }

    /// Bytes waiting to be written, if any. Hand them to the transport in order.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.take_pong();
        if self.output.is_empty() {
            None
        } else {
            Some(self.output.split().freeze())
        }
    }

    /// Appends the pending output to `buf` (no allocation when `buf` has room).
    pub fn transmit_into(&mut self, buf: &mut BytesMut) {
        self.take_pong();
        if !self.output.is_empty() {
            buf.extend_from_slice(&self.output);
            self.output.clear();
        }
    }

    fn take_pong(&mut self) {
        if let Some(context) = self.pending_pong.take() {
            Command::Pong { context }.encode(&mut self.output);
        }
    }

    /// Queues `msg` for the peer. Returns `false` (and queues nothing) before the
    /// handshake has completed.
    pub fn send_message(&mut self, msg: &Message) -> bool {
        if !self.is_ready() {
            return false;
        }
        encode_message(msg, &mut self.output);
        true
    }

    /// SUB: adds one reference to `prefix`; the first sends a subscription (a
    /// `SUBSCRIBE` command to ZMTP 3.1 peers, a `0x01 prefix` message to 3.0 peers).
    pub fn subscribe(&mut self, prefix: Bytes) {
        let count = self.subscriptions.entry(&prefix, || 0);
        *count += 1;
        if *count == 1 && self.is_ready() {
            self.queue_subscription(&prefix, true);
        }
    }

    /// SUB: drops one reference to `prefix`; the last sends a cancel. Returns `false`
    /// when there was no such subscription.
    pub fn unsubscribe(&mut self, prefix: &[u8]) -> bool {
        let Some(count) = self.subscriptions.get_mut(prefix) else {
            return false;
        };
        *count -= 1;
        if *count == 0 {
            self.subscriptions.remove(prefix);
            if self.is_ready() {
                self.queue_subscription(prefix, false);
            }
        }
        true
    }

    /// SUB: whether a topic (frame 0) passes the local filter.
    pub fn is_subscribed(&self, topic: &[u8]) -> bool {
        self.subscriptions.matches(topic)
    }

    /// The next instant at which [`handle_timeout`](Self::handle_timeout) must run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let ttl_deadline = self
            .peer_ttl
            .and_then(|ttl| self.last_input.checked_add(ttl));
        [
            self.handshake_deadline,
            self.next_ping,
            self.ping_deadline,
            ttl_deadline,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs due timers: fails on handshake or heartbeat expiry; queues a PING when one
    /// is due.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), Error> {
        if self.is_failed() {
            return Err(Error::SocketClosed);
        }
        let expired = |d: Option<Instant>| d.is_some_and(|d| d <= now);
        if expired(self.handshake_deadline) {
            return self.fail(Error::Timeout(TimeoutKind::Handshake));
        }
        let ttl_deadline = self
            .peer_ttl
            .and_then(|ttl| self.last_input.checked_add(ttl));
        if expired(self.ping_deadline) || expired(ttl_deadline) {
            return self.fail(Error::Timeout(TimeoutKind::Heartbeat));
        }
        if expired(self.next_ping) {
            let ttl = self.config.heartbeat_ttl().unwrap_or_default();
            let ttl_deciseconds = u16::try_from(ttl.as_millis() / 100).unwrap_or(u16::MAX);
            Command::Ping {
                ttl_deciseconds,
                context: Bytes::new(),
            }
            .encode(&mut self.output);
            self.stats.pings_sent += 1;
            self.next_ping = self
                .config
                .heartbeat_interval
                .and_then(|i| now.checked_add(i));
            if self.ping_deadline.is_none() {
                self.ping_deadline = self
                    .config
                    .heartbeat_timeout()
                    .and_then(|t| now.checked_add(t));
            }
        }
        Ok(())
    }

    /// Decodes the next event from buffered input. `Ok(None)` means: more input is
    /// needed, or output must be written first ([`wants_input`](Self::wants_input)).
    /// An error is fatal: the connection must be closed.
    pub fn poll_event(&mut self) -> Result<Option<Event>, Error> {
        match self.step() {
            Ok(ev) => Ok(ev),
            Err(e) => self.fail(e).map(|()| None),
        }
    }

    fn fail<T>(&mut self, e: Error) -> Result<T, Error> {
        let e = if self.is_failed() {
            Error::SocketClosed
        } else {
            e
        };
        self.state = State::Failed;
        // Cleared, not dropped: the I/O layer accounts for the allocation it read
        // into (frames handed out may still reference it).
        self.input.clear();
        Err(e)
    }

    fn step(&mut self) -> Result<Option<Event>, Error> {
        loop {
            if self.output.len() >= MAX_PENDING_OUTPUT {
                return Ok(None);
            }
            match &mut self.state {
                State::Failed => return Err(Error::SocketClosed),
                State::Greeting(decoder) => {
                    let Some(greeting) = decoder.decode(&mut self.input)? else {
                        return Ok(None);
                    };
                    self.on_greeting(greeting);
                }
                State::AwaitReady => {
                    let Some(decoded) = self.decoder.decode(&mut self.input)? else {
                        return Ok(None);
                    };
                    return self.on_handshake_frame(decoded).map(Some);
                }
                State::Active => {
                    let Some(decoded) = self.decoder.decode(&mut self.input)? else {
                        return Ok(None);
                    };
                    let event = match decoded {
                        Decoded::Message(msg) => self.on_message(msg)?,
                        Decoded::Command(body) => {
                            if self.decoder.in_message() {
                                self.stats.commands_between_frames += 1;
                            }
                            self.on_command(Command::parse(body)?)?
                        }
                    };
                    if event.is_some() {
                        return Ok(event);
                    }
                }
            }
        }
    }

    fn on_message(&mut self, msg: Message) -> Result<Option<Event>, Error> {
        match self.socket_type {
            SocketType::Sub => Ok(self.sub_accepts(&msg).then_some(Event::Message(msg))),
            SocketType::Dealer | SocketType::Router => {
                self.stats.messages += 1;
                self.stats.bytes = self.stats.bytes.saturating_add(msg.byte_len() as u64);
                Ok(Some(Event::Message(msg)))
            }
            SocketType::Pub => {
                // ZMTP 3.0 subscription form: one frame, `0x01 prefix` / `0x00 prefix`.
                let mut parts = msg.into_parts();
                match (parts.next(), parts.next()) {
                    (Some(mut frame), None) if matches!(frame.first(), Some(0 | 1)) => {
                        let subscribe = frame.get_u8() == 1;
                        self.on_peer_subscription(frame, subscribe)
                    }
                    _ => {
                        self.stats.ignored_messages += 1;
                        Ok(None)
                    }
                }
            }
        }
    }

    fn on_command(&mut self, cmd: Command) -> Result<Option<Event>, Error> {
        match cmd {
            Command::Ping {
                ttl_deciseconds,
                context,
            } => {
                self.stats.pings_received += 1;
                self.peer_ttl = (ttl_deciseconds > 0)
                    .then(|| Duration::from_millis(u64::from(ttl_deciseconds) * 100));
                // Copied (≤ 16 bytes) so the answer never pins the read buffer; only the
                // latest answer is kept until it is written.
                if self.pending_pong.is_some() {
                    self.stats.pongs_coalesced += 1;
                } else {
                    self.stats.pongs_sent += 1;
                }
                self.pending_pong = Some(Bytes::copy_from_slice(&context));
                Ok(None)
            }
            Command::Pong { .. } => {
                self.stats.pongs_received += 1;
                Ok(None)
            }
            Command::Subscribe(prefix) if self.socket_type == SocketType::Pub => {
                self.on_peer_subscription(prefix, true)
            }
            Command::Cancel(prefix) if self.socket_type == SocketType::Pub => {
                self.on_peer_subscription(prefix, false)
            }
            Command::Error { reason } => Err(Error::PeerError {
                reason: String::from_utf8_lossy(&reason).into_owned(),
            }),
            Command::Ready(_) => Err(ProtocolError::DuplicateReady.into()),
            _ => {
                self.stats.unknown_commands += 1;
                Ok(None)
            }
        }
    }

    fn on_peer_subscription(
        &mut self,
        prefix: Bytes,
        subscribe: bool,
    ) -> Result<Option<Event>, Error> {
        if subscribe {
            if prefix.len() > self.config.max_subscription_size {
                return Err(ProtocolError::SubscriptionLimit {
                    what: "subscription longer than max_subscription_size",
                }
                .into());
            }
            if let Some(count) = self.peer_subscriptions.get_mut(&prefix[..]) {
                *count = count.saturating_add(1);
                return Ok(None);
            }
            if self.peer_subscriptions.len() >= self.config.max_subscriptions {
                return Err(ProtocolError::SubscriptionLimit {
                    what: "more than max_subscriptions subscriptions",
                }
                .into());
            }
            // Kept for the connection's lifetime: copied, so it never pins the read
            // buffer it arrived in.
            let prefix = Bytes::copy_from_slice(&prefix);
            self.peer_subscriptions.insert(prefix.clone(), 1);
            Ok(Some(Event::Subscribe(prefix)))
        } else {
            let Some(count) = self.peer_subscriptions.get_mut(&prefix[..]) else {
                return Ok(None);
            };
            *count -= 1;
            if *count > 0 {
                return Ok(None);
            }
            let (prefix, _) = self
                .peer_subscriptions
                .remove_entry(&prefix[..])
                .unwrap_or((prefix, 0));
            Ok(Some(Event::Cancel(prefix)))
        }
    }

    fn queue_subscription(&mut self, prefix: &[u8], subscribe: bool) {
        let speaks_3_1 = self.peer.as_ref().is_some_and(PeerInfo::speaks_3_1);
        let bytes = Bytes::copy_from_slice(prefix);
        if speaks_3_1 {
            if subscribe {
                Command::Subscribe(bytes)
            } else {
                Command::Cancel(bytes)
            }
            .encode(&mut self.output);
        } else {
            encode_frame_header(&mut self.output, false, false, prefix.len() + 1);
            self.output.put_u8(u8::from(subscribe));
            self.output.put_slice(prefix);
        }
    }
}
