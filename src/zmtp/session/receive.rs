//! A subscriber's receive loop over a [`Session`]: messages are decoded, filtered and
//! handed to the caller in place, without an [`Event`] around each.

use super::{Event, MAX_PENDING_OUTPUT, Session, SocketType, State};
use crate::zmtp::codec::{Command, Decoded};
use crate::zmtp::{Error, Message};

impl Session {
    /// [`poll_event`](Self::poll_event) for a subscriber's receive loop: hands every
    /// message to `f` until it returns `false` (then `Ok(false)`) or input runs dry
    /// (`Ok(true)`); other events are consumed. An active SUB decodes and filters in
    /// place, without wrapping each message in an event.
    pub(crate) fn poll_messages(
        &mut self,
        mut f: impl FnMut(Message) -> bool,
    ) -> Result<bool, Error> {
        loop {
            let fast = matches!(self.state, State::Active)
                && self.socket_type == SocketType::Sub
                && self.output.len() < MAX_PENDING_OUTPUT;
            if !fast {
                match self.poll_event()? {
                    Some(Event::Message(m)) => {
                        if !f(m) {
                            return Ok(false);
                        }
                    }
                    Some(_) => {}
                    None => return Ok(true),
                }
                continue;
            }
            match self.decoder.decode(&mut self.input) {
                Ok(Some(Decoded::Message(msg))) => {
                    if self.sub_accepts(&msg) && !f(msg) {
                        return Ok(false);
                    }
                }
                Ok(Some(Decoded::Command(body))) => {
                    if self.decoder.in_message() {
                        self.stats.commands_between_frames += 1;
                    }
                    let handled = Command::parse(body)
                        .map_err(Error::from)
                        .and_then(|cmd| self.on_command(cmd));
                    match handled {
                        Ok(Some(Event::Message(m))) => {
                            if !f(m) {
                                return Ok(false);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => return self.fail(e),
                    }
                }
                Ok(None) => return Ok(true),
                Err(e) => return self.fail(e.into()),
            }
        }
    }

    /// A SUB's local filter: `true` (and counted as received) when a subscription
    /// matches the message's first frame; otherwise counted as filtered.
    pub(super) fn sub_accepts(&mut self, msg: &Message) -> bool {
        if self.subscriptions.matches(msg.get(0).unwrap_or_default()) {
            self.stats.messages += 1;
            self.stats.bytes = self.stats.bytes.saturating_add(msg.byte_len() as u64);
            true
        } else {
            self.stats.filtered += 1;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use std::time::Instant;

    use bytes::BytesMut;

    use crate::zmtp::codec::encode_message;
    use crate::zmtp::{Config, Message, Pair};

    /// Messages on topics `a…` and `b…`, an empty message, and a PING between the
    /// frames of a multipart message.
    fn stream() -> Vec<u8> {
        let mut b = BytesMut::new();
        for topic in ["a1", "b1", "a2"] {
            encode_message(&Message::from_parts([topic, "x"]), &mut b);
        }
        encode_message(&Message::from_parts(["", ""]), &mut b);
        // [a3 MORE] [PING ttl 0, context "c"] [y]
        b.extend_from_slice(b"\x01\x02a3");
        b.extend_from_slice(b"\x04\x08\x04PING\x00\x00c");
        b.extend_from_slice(b"\x00\x01y");
        encode_message(&Message::from_parts(["a4"]), &mut b);
        b.to_vec()
    }

    fn subscribed(prefix: &'static [u8]) -> Pair {
        let config = Config::default();
        let mut pair = Pair::new(&config, &config, Instant::now());
        pair.sub.subscribe(bytes::Bytes::from_static(prefix));
        pair.drive().unwrap();
        pair
    }

    #[test]
    fn poll_messages_delivers_what_poll_event_does() {
        for prefix in [&b"a"[..], b""] {
            let (mut by_event, mut by_loop) = (subscribed(prefix), subscribed(prefix));
            let bytes = stream();
            let now = by_event.now();
            by_event.sub.handle_bytes(now, &bytes);
            by_loop.sub.handle_bytes(now, &bytes);
            let mut expected = Vec::new();
            while let Some(ev) = by_event.sub.poll_event().unwrap() {
                if let crate::zmtp::Event::Message(m) = ev {
                    expected.push(m);
                }
            }
            // Stopped after two, then resumed: nothing lost or repeated.
            let mut got = Vec::new();
            assert!(
                !by_loop
                    .sub
                    .poll_messages(|m| {
                        got.push(m);
                        got.len() < 2
                    })
                    .unwrap()
            );
            assert!(
                by_loop
                    .sub
                    .poll_messages(|m| {
                        got.push(m);
                        true
                    })
                    .unwrap()
            );
            assert_eq!(got, expected, "prefix {prefix:?}");
            assert_eq!(by_loop.sub.stats(), by_event.sub.stats());
            assert_eq!(by_loop.sub.poll_transmit(), by_event.sub.poll_transmit());
            assert!(by_loop.sub.stats().pongs_sent == 1);
        }
    }

    #[test]
    fn a_failure_is_reported_like_poll_event() {
        let mut pair = subscribed(b"");
        let now = pair.now();
        // A command with MORE set: a protocol error, then the session is closed.
        pair.sub.handle_bytes(now, b"\x05\x00");
        assert!(pair.sub.poll_messages(|_| true).is_err());
        assert!(matches!(
            pair.sub.poll_messages(|_| true),
            Err(crate::zmtp::Error::SocketClosed)
        ));
    }
}
