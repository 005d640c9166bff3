//! Two sessions wired back to back with a clock: the sans-IO way to test a session, a
//! peer's behaviour, or code built on both, without sockets or sleeps.

use std::time::{Duration, Instant};

use super::{Event, Session, SocketType};
use crate::zmtp::{Config, Error};

/// Which side of a [`Pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The SUB session.
    Sub,
    /// The PUB session.
    Pub,
}

/// A SUB and a PUB [`Session`] connected to each other, with a clock the caller
/// moves. [`drive`](Self::drive) carries bytes both ways until both are quiet and
/// collects each side's events; [`advance`](Self::advance) moves the clock and fires
/// both sides' timers (heartbeats, the handshake deadline) before driving.
///
/// ```
/// use std::time::{Duration, Instant};
/// use eventplane::zmtp::{Config, Event, Message, Pair, Side};
///
/// let config = Config::builder().heartbeat_interval(Some(Duration::from_secs(1))).build()?;
/// let mut pair = Pair::new(&config, &Config::default(), Instant::now());
/// pair.sub.subscribe(b"kv".as_slice().into());
/// pair.drive()?;
/// assert!(pair.sub.is_ready() && pair.publ.is_ready());
/// assert!(pair.take_events(Side::Pub).iter().any(|e| matches!(e, Event::Subscribe(p) if &p[..] == b"kv")));
/// assert!(matches!(&pair.take_events(Side::Sub)[..], [Event::Ready(_)]));
///
/// pair.publ.send_message(&Message::from_parts(["kv", "hello"]));
/// pair.drive()?;
/// assert!(matches!(&pair.take_events(Side::Sub)[..], [Event::Message(m)] if m.get(1).unwrap() == b"hello"));
///
/// // A minute of heartbeats: the SUB pings every second, the PUB answers, nobody fails.
/// for _ in 0..60 {
///     pair.advance(Duration::from_secs(1))?;
/// }
/// assert!(pair.sub.stats().pings_sent >= 59);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Pair {
    /// The SUB side.
    pub sub: Session,
    /// The PUB side.
    pub publ: Session,
    now: Instant,
    sub_events: Vec<Event>,
    pub_events: Vec<Event>,
}

impl Pair {
    /// A SUB with `sub_config` and a PUB with `pub_config`, both starting at `now`;
    /// nothing is exchanged until [`drive`](Self::drive).
    pub fn new(sub_config: &Config, pub_config: &Config, now: Instant) -> Pair {
        Pair {
            sub: Session::new(SocketType::Sub, sub_config, now),
            publ: Session::new(SocketType::Pub, pub_config, now),
            now,
            sub_events: Vec::new(),
            pub_events: Vec::new(),
        }
    }

    /// The pair's clock.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Carries bytes both ways until neither side has anything to send, collecting
    /// both sides' events. The first error either side reports ends it.
    pub fn drive(&mut self) -> Result<(), Error> {
        loop {
            let mut moved = false;
            while let Some(bytes) = self.sub.poll_transmit() {
                self.publ.handle_bytes(self.now, &bytes);
                moved = true;
            }
            while let Some(bytes) = self.publ.poll_transmit() {
                self.sub.handle_bytes(self.now, &bytes);
                moved = true;
            }
            while let Some(ev) = self.sub.poll_event()? {
                self.sub_events.push(ev);
                moved = true;
            }
            while let Some(ev) = self.publ.poll_event()? {
                self.pub_events.push(ev);
                moved = true;
            }
            if !moved {
                return Ok(());
            }
        }
    }

    /// Moves the clock by `by`, fires whichever timers fell due on either side, and
    /// drives.
    pub fn advance(&mut self, by: Duration) -> Result<(), Error> {
        self.now += by;
        for session in [&mut self.sub, &mut self.publ] {
            if session.poll_timeout().is_some_and(|t| t <= self.now) {
                session.handle_timeout(self.now)?;
            }
        }
        self.drive()
    }

    /// The events `side` reported since the last call.
    pub fn take_events(&mut self, side: Side) -> Vec<Event> {
        match side {
            Side::Sub => std::mem::take(&mut self.sub_events),
            Side::Pub => std::mem::take(&mut self.pub_events),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_silent_publisher_is_detected_by_the_heartbeat_in_paused_time() {
        let hb = Config::builder()
            .heartbeat_interval(Some(Duration::from_secs(1)))
            .heartbeat_timeout(Some(Duration::from_secs(2)))
            .build()
            .unwrap();
        let mut pair = Pair::new(&hb, &Config::default(), Instant::now());
        pair.drive().unwrap();
        pair.advance(Duration::from_secs(1)).unwrap();
        assert!(pair.sub.stats().pings_sent >= 1);
        // From now on the PUB's answers are lost: the SUB times out within the timeout.
        let mut failed = None;
        for _ in 0..4 {
            pair.now += Duration::from_secs(1);
            if let Some(t) = pair.sub.poll_timeout() {
                if t <= pair.now {
                    if let Err(e) = pair.sub.handle_timeout(pair.now) {
                        failed = Some(e);
                        break;
                    }
                }
            }
            while pair.sub.poll_transmit().is_some() {}
        }
        assert!(matches!(failed, Some(Error::Timeout(_))), "{failed:?}");
    }

    #[test]
    fn subscriptions_and_messages_cross() {
        let mut pair = Pair::new(&Config::default(), &Config::default(), Instant::now());
        pair.sub.subscribe(bytes::Bytes::from_static(b"a"));
        pair.drive().unwrap();
        let subs = pair.take_events(Side::Pub);
        assert!(
            subs.iter()
                .any(|e| matches!(e, Event::Subscribe(p) if &p[..] == b"a"))
        );
        for topic in ["a1", "b1", "a2"] {
            pair.publ
                .send_message(&crate::zmtp::Message::from_parts([topic, "x"]));
        }
        pair.drive().unwrap();
        let got: Vec<String> = pair
            .take_events(Side::Sub)
            .into_iter()
            .filter_map(|e| match e {
                Event::Message(m) => {
                    Some(String::from_utf8_lossy(m.get(0).unwrap_or_default()).into_owned())
                }
                _ => None,
            })
            .collect();
        // The PUB session sends what it is given; the SUB filters locally.
        assert_eq!(got, vec!["a1", "a2"]);
    }
}
