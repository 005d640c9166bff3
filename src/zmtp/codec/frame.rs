//! Frames (RFC 23 §2.4): a flags byte, a 1- or 8-byte size, the body.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use smallvec::SmallVec;

use crate::reader::Reader;
use crate::zmtp::{Message, ProtocolError};

/// More frames of this message follow.
///
/// ```
/// use eventplane::zmtp::codec::{FLAG_COMMAND, FLAG_LONG, FLAG_MORE};
/// assert_eq!(FLAG_MORE | FLAG_LONG | FLAG_COMMAND, 0b111);
/// ```
pub const FLAG_MORE: u8 = 0x01;
/// The size is 8 bytes (big-endian) instead of 1.
pub const FLAG_LONG: u8 = 0x02;
/// The frame is a command.
pub const FLAG_COMMAND: u8 = 0x04;
const FLAG_RESERVED: u8 = !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND);

/// Size of a short header (flags + 1-byte size).
///
/// ```
/// use eventplane::zmtp::codec::{encode_frame_header, LONG_HEADER_LEN, SHORT_HEADER_LEN};
/// let mut buf = bytes::BytesMut::new();
/// encode_frame_header(&mut buf, false, false, 255);
/// assert_eq!(buf.len(), SHORT_HEADER_LEN);
/// encode_frame_header(&mut buf, false, false, 256);
/// assert_eq!(buf.len(), SHORT_HEADER_LEN + LONG_HEADER_LEN);
/// ```
pub const SHORT_HEADER_LEN: usize = 2;
/// Size of a long header (flags + 8-byte size).
pub const LONG_HEADER_LEN: usize = 9;

/// Limits a [`FrameDecoder`] enforces on every header, before the body is buffered
/// (see the example there).
///
/// ```
/// use eventplane::zmtp::codec::FrameLimits;
/// let limits = FrameLimits { max_frame_size: 1 << 20, max_message_size: 4 << 20,
///     max_message_parts: 16, max_command_size: 64 << 10, strict: true };
/// assert!(limits.max_frame_size <= limits.max_message_size);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest message frame.
    pub max_frame_size: usize,
    /// Largest message (sum of frames).
    pub max_message_size: usize,
    /// Most frames in a message.
    pub max_message_parts: usize,
    /// Largest command frame.
    pub max_command_size: usize,
    /// Reject reserved flag bits.
    pub strict: bool,
}

/// One decoded unit: a command body or a complete multipart message (see
/// [`FrameDecoder`]).
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::{Decoded, FrameDecoder, FrameLimits};
/// let mut decoder = FrameDecoder::new(FrameLimits { max_frame_size: 64, max_message_size: 64,
///     max_message_parts: 4, max_command_size: 64, strict: false });
/// // A command frame (flag 0x04): its body is returned unparsed.
/// let mut src = BytesMut::from(&b"\x04\x05\x04PING"[..]);
/// assert!(matches!(decoder.decode(&mut src)?, Some(Decoded::Command(_))));
/// # Ok::<(), eventplane::zmtp::ProtocolError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A command frame's body (`name-len name data`), not yet parsed.
    Command(Bytes),
    /// All frames of one message.
    Message(Message),
}

#[derive(Debug, Clone, Copy)]
enum State {
    Header,
    Body {
        command: bool,
        more: bool,
        size: usize,
    },
}

/// Decodes frames from a byte buffer, zero-copy.
///
/// Contract: [`decode`](Self::decode) consumes complete frames from the front of `src`
/// and returns at most one [`Decoded`] per call. A command frame between the frames of
/// a multipart message is returned on its own while the message keeps assembling. A header is checked against
/// [`FrameLimits`] as soon as its size bytes are present, *before* the body is
/// buffered, so a forged size costs nothing but an error. A message whose frames are
/// all in `src` is split off whole, its frames located in it (one reference count);
/// otherwise bodies are split off one by one as they complete. An empty body
/// references nothing. The caller reads more bytes into `src` when it returns
/// `Ok(None)` ([`needed`](Self::needed) tells how many would make progress).
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::{Decoded, FrameDecoder, FrameLimits};
///
/// let limits = FrameLimits { max_frame_size: 1024, max_message_size: 4096,
///     max_message_parts: 8, max_command_size: 256, strict: false };
/// let mut decoder = FrameDecoder::new(limits);
/// let mut src = BytesMut::from(&b"\x01\x02kv\x00\x03abc"[..]);
/// let Some(Decoded::Message(msg)) = decoder.decode(&mut src)? else { panic!() };
/// assert_eq!(msg.len(), 2);
///
/// // A header claiming 2^36 bytes is refused before anything is buffered.
/// let mut forged = BytesMut::from(&b"\x02\x00\x00\x00\x10\x00\x00\x00\x00"[..]);
/// assert!(decoder.decode(&mut forged).is_err());
/// # Ok::<(), eventplane::zmtp::ProtocolError>(())
/// ```
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    limits: FrameLimits,
    state: State,
    parts: SmallVec<[Bytes; 3]>,
    /// Leading parts already copied out by [`compact_parts`](Self::compact_parts).
    compacted: usize,
    message_bytes: usize,
    commands_only: bool,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: FrameLimits) -> Self {
        FrameDecoder {
            limits,
            state: State::Header,
            parts: SmallVec::new(),
            compacted: 0,
            message_bytes: 0,
            commands_only: false,
        }
    }

    /// Refuses message frames at their header (a protocol error before any of the
    /// body is buffered) while `on`: before READY a peer may only send commands.
    ///
    /// ```
    /// use bytes::BytesMut;
    /// use eventplane::zmtp::codec::{FrameDecoder, FrameLimits};
    /// let mut decoder = FrameDecoder::new(FrameLimits { max_frame_size: 1 << 20, max_message_size: 1 << 20,
    ///     max_message_parts: 4, max_command_size: 64, strict: false });
    /// decoder.set_commands_only(true);
    /// // A message header claiming 1 MiB: refused at once, nothing buffered.
    /// let mut src = BytesMut::from(&b"\x02\x00\x00\x00\x00\x00\x10\x00\x00"[..]);
    /// assert!(decoder.decode(&mut src).is_err());
    /// ```
    pub fn set_commands_only(&mut self, on: bool) {
        self.commands_only = on;
    }

    /// Changes the limits (e.g. the command limit once the handshake is done).
    pub fn set_limits(&mut self, limits: FrameLimits) {
        self.limits = limits;
    }

    /// The limits in force.
    pub fn limits(&self) -> &FrameLimits {
        &self.limits
    }

    /// `true` when no partial frame or message is pending.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Header) && self.parts.is_empty()
    }

    /// `true` while some frames of a multipart message have arrived and the rest have
    /// not.
    pub fn in_message(&self) -> bool {
        !self.parts.is_empty()
    }

    /// Copies the frames of the message being assembled that are at most `max_part`
    /// bytes into one allocation of their combined size, so they no longer keep the
    /// buffer they were cut from alive. An I/O layer calls this before it moves on to
    /// a new read buffer while a message is incomplete (a peer that never sends the
    /// last frame must not pin every buffer its frames arrived in).
    ///
    /// ```
    /// use bytes::BytesMut;
    /// use eventplane::zmtp::codec::{FrameDecoder, FrameLimits};
    /// let mut decoder = FrameDecoder::new(FrameLimits { max_frame_size: 64, max_message_size: 256,
    ///     max_message_parts: 8, max_command_size: 64, strict: false });
    /// let mut src = BytesMut::from(&b"\x01\x02ab"[..]);
    /// assert!(decoder.decode(&mut src)?.is_none()); // first frame of two, held
    /// decoder.compact_parts(1024);
    /// assert!(decoder.in_message());
    /// # Ok::<(), eventplane::zmtp::ProtocolError>(())
    /// ```
    pub fn compact_parts(&mut self, max_part: usize) {
        // Parts copied out by an earlier call own their allocation already.
        let fresh = self.parts.get(self.compacted..).unwrap_or_default();
        let mut tail = Message::from_parts(fresh.iter().cloned());
        if tail.compact(max_part) {
            self.parts.truncate(self.compacted);
            self.parts.extend(tail.into_parts());
        }
        self.compacted = self.parts.len();
    }

    /// Bytes that must be in `src` before the next call can make progress (a lower
    /// bound, never more than the current frame's validated size plus a header).
    pub fn needed(&self, buffered: usize) -> usize {
        match self.state {
            State::Header => SHORT_HEADER_LEN.saturating_sub(buffered).max(1),
            State::Body { size, .. } => size.saturating_sub(buffered).max(1),
        }
    }

    /// Decodes the next command or complete message from `src`.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Decoded>, ProtocolError> {
        if matches!(self.state, State::Header) && self.parts.is_empty() {
            if let Some(msg) = self.decode_whole(src)? {
                return Ok(Some(Decoded::Message(msg)));
            }
        }
        loop {
            match self.state {
                State::Header => {
                    let Some((flags, size, header_len)) = parse_header(src) else {
                        return Ok(None);
                    };
                    let state = self.check_header(flags, size)?;
                    if let State::Body {
                        command: false,
                        size,
                        ..
                    } = state
                    {
                        self.message_bytes += size;
                    }
                    self.state = state;
                    src.advance(header_len);
                }
                State::Body {
                    command,
                    more,
                    size,
                } => {
                    if src.len() < size {
                        return Ok(None);
                    }
                    // An empty body references nothing (a slice would pin `src`).
                    let body = if size == 0 {
                        Bytes::new()
                    } else {
                        src.split_to(size).freeze()
                    };
                    self.state = State::Header;
                    if command {
                        return Ok(Some(Decoded::Command(body)));
                    }
                    self.parts.push(body);
                    if !more {
                        self.message_bytes = 0;
                        self.compacted = 0;
                        let parts = std::mem::take(&mut self.parts);
                        return Ok(Some(Decoded::Message(Message::from_smallvec(parts))));
                    }
                }
            }
        }
    }

    /// The fast path: a message whose frames are all in `src` already is taken with
    /// one split, its frames located in it (one reference count per message, not
    /// one per frame). Every header is checked as the frame-by-frame path checks it.
    /// `Ok(None)` leaves `src` untouched for that path: the message is incomplete, a
    /// command comes first, or an offset would not fit the message's `u32` spans.
    fn decode_whole(&mut self, src: &mut BytesMut) -> Result<Option<Message>, ProtocolError> {
        let mut spans: SmallVec<[(u32, u32); 4]> = SmallVec::new();
        let (mut pos, mut bytes) = (0usize, 0usize);
        loop {
            let Some((flags, size, header_len)) = src.get(pos..).and_then(parse_header) else {
                return Ok(None);
            };
            if flags & FLAG_COMMAND != 0 {
                return Ok(None);
            }
            let State::Body { more, size, .. } =
                self.check_header_with(flags, size, spans.len(), bytes)?
            else {
                return Ok(None);
            };
            let start = pos + header_len;
            let end = start.saturating_add(size);
            if end > src.len() {
                return Ok(None);
            }
            let (Ok(offset), Ok(len)) = (u32::try_from(start), u32::try_from(size)) else {
                return Ok(None);
            };
            spans.push((offset, len));
            bytes += size;
            pos = end;
            if !more {
                if bytes == 0 {
                    // Only empty frames: nothing to reference (a slice would pin
                    // the whole read buffer for no bytes at all).
                    src.advance(pos);
                    let empty = spans.iter().map(|_| Bytes::new());
                    return Ok(Some(Message::from_smallvec(empty.collect())));
                }
                let backing = src.split_to(pos).freeze();
                return Ok(Some(Message::from_spans(backing, spans)));
            }
        }
    }

    fn check_header(&self, flags: u8, size: u64) -> Result<State, ProtocolError> {
        self.check_header_with(flags, size, self.parts.len(), self.message_bytes)
    }

    /// [`check_header`](Self::check_header) for a message of which `parts` frames
    /// and `message_bytes` bytes came before this header.
    fn check_header_with(
        &self,
        flags: u8,
        size: u64,
        parts: usize,
        message_bytes: usize,
    ) -> Result<State, ProtocolError> {
        let l = &self.limits;
        if l.strict && flags & FLAG_RESERVED != 0 {
            return Err(ProtocolError::ReservedFlags { flags });
        }
        let more = flags & FLAG_MORE != 0;
        if flags & FLAG_COMMAND != 0 {
            // A command may arrive between the frames of a message (libzmq's heartbeat
            // timer sends PING regardless of MORE); the message keeps assembling. MORE
            // on a command itself is refused.
            if more {
                return Err(ProtocolError::CommandWithMore);
            }
            let size =
                checked_size(size, l.max_command_size).ok_or(ProtocolError::CommandTooLarge {
                    size,
                    max: l.max_command_size,
                })?;
            return Ok(State::Body {
                command: true,
                more: false,
                size,
            });
        }
        if self.commands_only {
            return Err(ProtocolError::UnexpectedDuringHandshake {
                what: "message frame".into(),
            });
        }
        if parts >= l.max_message_parts {
            return Err(ProtocolError::TooManyParts {
                max: l.max_message_parts,
            });
        }
        let size = checked_size(size, l.max_frame_size).ok_or(ProtocolError::FrameTooLarge {
            size,
            max: l.max_frame_size,
        })?;
        let total = message_bytes.saturating_add(size);
        if total > l.max_message_size {
            return Err(ProtocolError::MessageTooLarge {
                size: total as u64,
                max: l.max_message_size,
            });
        }
        Ok(State::Body {
            command: false,
            more,
            size,
        })
    }
}

fn checked_size(size: u64, max: usize) -> Option<usize> {
    usize::try_from(size).ok().filter(|s| *s <= max)
}

/// Parses a frame header at the front of `src` without consuming it.
fn parse_header(src: &[u8]) -> Option<(u8, u64, usize)> {
    let mut r = Reader::new(src);
    let flags = r.u8()?;
    if flags & FLAG_LONG != 0 {
        Some((flags, r.u64_be()?, LONG_HEADER_LEN))
    } else {
        Some((flags, u64::from(r.u8()?), SHORT_HEADER_LEN))
    }
}

/// Appends a frame header. Uses the long form only when `size > 255` (RFC 23 §2.4).
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::encode_frame_header;
/// let mut buf = BytesMut::new();
/// encode_frame_header(&mut buf, true, false, 300);
/// assert_eq!(&buf[..], &[0x03, 0, 0, 0, 0, 0, 0, 1, 44]);
/// ```
pub fn encode_frame_header(buf: &mut BytesMut, more: bool, command: bool, size: usize) {
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    match u8::try_from(size) {
        Ok(short) => {
            buf.put_u8(flags);
            buf.put_u8(short);
        }
        Err(_) => {
            buf.put_u8(flags | FLAG_LONG);
            buf.put_u64(size as u64);
        }
    }
}

fn header_len(size: usize) -> usize {
    if size > usize::from(u8::MAX) {
        LONG_HEADER_LEN
    } else {
        SHORT_HEADER_LEN
    }
}

/// Bytes [`encode_message`] appends for `msg`.
///
/// ```
/// use eventplane::zmtp::{Message, codec::encoded_len};
/// assert_eq!(encoded_len(&Message::from_parts(["kv", "x"])), 2 + 2 + 2 + 1);
/// ```
pub fn encoded_len(msg: &Message) -> usize {
    msg.parts().map(|p| header_len(p.len()) + p.len()).sum()
}

/// Appends every frame of `msg`, MORE set on all but the last. An empty message
/// appends nothing.
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::{Message, codec::encode_message};
/// let mut buf = BytesMut::new();
/// encode_message(&Message::from_parts(["kv", "x"]), &mut buf);
/// assert_eq!(&buf[..], b"\x01\x02kv\x00\x01x");
/// ```
pub fn encode_message(msg: &Message, buf: &mut BytesMut) {
    buf.reserve(encoded_len(msg));
    let last = msg.len().saturating_sub(1);
    for (i, part) in msg.parts().enumerate() {
        encode_frame_header(buf, i < last, false, part.len());
        buf.put_slice(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> FrameLimits {
        FrameLimits {
            max_frame_size: 1000,
            max_message_size: 1500,
            max_message_parts: 3,
            max_command_size: 100,
            strict: false,
        }
    }

    #[test]
    fn long_header_only_above_255() {
        let mut b = BytesMut::new();
        encode_frame_header(&mut b, false, false, 255);
        assert_eq!(&b[..], &[0x00, 0xff]);
        b.clear();
        encode_frame_header(&mut b, true, false, 256);
        assert_eq!(&b[..], &[0x03, 0, 0, 0, 0, 0, 0, 1, 0]);
    }

    #[test]
    fn forged_sizes_rejected_before_buffering() {
        for size in [1u64 << 36, 1 << 63, u64::MAX, 1001] {
            let mut b = BytesMut::new();
            b.put_u8(FLAG_LONG);
            b.put_u64(size);
            let err = FrameDecoder::new(limits()).decode(&mut b).unwrap_err();
            assert!(
                matches!(err, ProtocolError::FrameTooLarge { .. }),
                "{err:?}"
            );
        }
    }

    #[test]
    fn message_and_part_limits() {
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::new();
        let msg = Message::from_parts([vec![0u8; 1000], vec![0u8; 1000]]);
        encode_message(&msg, &mut b);
        assert!(matches!(
            d.decode(&mut b),
            Err(ProtocolError::MessageTooLarge { .. })
        ));
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::new();
        encode_message(&Message::from_parts(["a", "b", "c", "d"]), &mut b);
        assert_eq!(
            d.decode(&mut b),
            Err(ProtocolError::TooManyParts { max: 3 })
        );
    }

    #[test]
    fn command_flags() {
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::from(&[FLAG_COMMAND | FLAG_MORE, 0][..]);
        assert_eq!(d.decode(&mut b), Err(ProtocolError::CommandWithMore));
        // MORE on a command is refused mid-message too.
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::from(&[FLAG_MORE, 1, b'x', FLAG_COMMAND | FLAG_MORE, 0][..]);
        assert_eq!(d.decode(&mut b), Err(ProtocolError::CommandWithMore));
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::from(&[FLAG_COMMAND, 101][..]);
        assert!(matches!(
            d.decode(&mut b),
            Err(ProtocolError::CommandTooLarge { .. })
        ));
    }

    #[test]
    fn whole_and_trickled_messages_decode_alike() {
        // All at once (one split, frames located in it) or a byte at a time (frame by
        // frame): the same message, the same limits, nothing left over.
        let msg = Message::from_parts([&b"kv"[..], b"", &[7u8; 300][..]]);
        let mut wire = BytesMut::new();
        encode_message(&msg, &mut wire);
        encode_message(&msg, &mut wire);
        let mut d = FrameDecoder::new(limits());
        let mut whole = wire.clone();
        for _ in 0..2 {
            assert_eq!(
                d.decode(&mut whole),
                Ok(Some(Decoded::Message(msg.clone())))
            );
        }
        assert!(whole.is_empty() && d.is_idle());
        let mut d = FrameDecoder::new(limits());
        let mut src = BytesMut::new();
        let mut got = Vec::new();
        for byte in wire.iter() {
            src.put_u8(*byte);
            while let Some(decoded) = d.decode(&mut src).unwrap() {
                got.push(decoded);
            }
        }
        assert_eq!(
            got,
            vec![Decoded::Message(msg.clone()), Decoded::Message(msg)]
        );
        // A message over the limits is refused whole, before anything is split off.
        let mut d = FrameDecoder::new(limits());
        // A message of empty frames holds no part of the read buffer.
        let mut src = BytesMut::from(&b"\x01\x00\x00\x00 and more"[..]);
        let Ok(Some(Decoded::Message(empty))) = d.decode(&mut src) else {
            panic!("two empty frames")
        };
        assert_eq!(empty, Message::from_parts(["", ""]));
        assert!(
            src.freeze().is_unique(),
            "an empty message pins the read buffer"
        );
        let mut big = BytesMut::new();
        encode_message(&Message::from_parts(["a", "b", "c", "d"]), &mut big);
        let len = big.len();
        assert_eq!(
            d.decode(&mut big),
            Err(ProtocolError::TooManyParts { max: 3 })
        );
        assert_eq!(big.len(), len);
    }

    #[test]
    fn command_between_frames_of_a_message() {
        // [a MORE][PING][b MORE][PONG][c]: both commands surface, the message stays whole.
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::new();
        b.extend_from_slice(&[FLAG_MORE, 1, b'a']);
        b.extend_from_slice(b"\x04\x07\x04PING\x00\x01");
        b.extend_from_slice(&[FLAG_MORE, 1, b'b']);
        b.extend_from_slice(b"\x04\x05\x04PONG");
        b.extend_from_slice(&[0, 1, b'c']);
        let mut got = Vec::new();
        while let Some(x) = d.decode(&mut b).unwrap() {
            got.push(x);
        }
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(matches!(&got[0], Decoded::Command(c) if &c[..] == b"\x04PING\x00\x01"));
        assert!(matches!(&got[1], Decoded::Command(c) if &c[..] == b"\x04PONG"));
        let Decoded::Message(m) = &got[2] else {
            panic!("{got:?}")
        };
        assert_eq!(m, &Message::from_parts(["a", "b", "c"]));
        assert!(d.is_idle());
    }

    #[test]
    fn parts_are_copied_out_once() {
        let mut d = FrameDecoder::new(limits());
        let mut b = BytesMut::from(&[FLAG_MORE, 1, b'a'][..]);
        assert!(d.decode(&mut b).unwrap().is_none());
        d.compact_parts(100);
        let first = d.parts.first().map(|p| p.as_ptr());
        b.extend_from_slice(&[FLAG_MORE, 1, b'b']);
        assert!(d.decode(&mut b).unwrap().is_none());
        d.compact_parts(100);
        // The first part keeps its copy; only the new one was copied.
        assert_eq!(d.parts.first().map(|p| p.as_ptr()), first);
        assert_eq!(d.compacted, 2);
        b.extend_from_slice(&[0, 1, b'c']);
        let Some(Decoded::Message(m)) = d.decode(&mut b).unwrap() else {
            panic!("no message")
        };
        assert_eq!(m, Message::from_parts(["a", "b", "c"]));
        assert_eq!(d.compacted, 0);
    }

    #[test]
    fn commands_only_refuses_message_headers() {
        let mut d = FrameDecoder::new(limits());
        d.set_commands_only(true);
        let mut b = BytesMut::from(&b"\x04\x05\x04PONG\x00\x01x"[..]);
        assert!(matches!(d.decode(&mut b), Ok(Some(Decoded::Command(_)))));
        assert!(matches!(
            d.decode(&mut b),
            Err(ProtocolError::UnexpectedDuringHandshake { .. })
        ));
    }

    #[test]
    fn reserved_bits_only_in_strict() {
        let mut b = BytesMut::from(&[0x80, 1, b'x'][..]);
        assert!(
            FrameDecoder::new(limits())
                .decode(&mut b)
                .unwrap()
                .is_some()
        );
        let mut strict = limits();
        strict.strict = true;
        let mut b = BytesMut::from(&[0x80, 1, b'x'][..]);
        assert_eq!(
            FrameDecoder::new(strict).decode(&mut b),
            Err(ProtocolError::ReservedFlags { flags: 0x80 })
        );
    }
}
