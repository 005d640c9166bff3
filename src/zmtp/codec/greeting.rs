//! The 64-byte ZMTP greeting (RFC 23 §2.3), decoded incrementally.

use bytes::{Buf, BufMut, BytesMut};

use crate::zmtp::ProtocolError;

/// Length of a ZMTP 3.x greeting.
///
/// ```
/// assert_eq!(eventplane::zmtp::codec::GREETING_LEN, 64);
/// ```
pub const GREETING_LEN: usize = 64;
/// Major version we speak.
///
/// ```
/// use eventplane::zmtp::codec::{VERSION_MAJOR, VERSION_MINOR};
/// assert_eq!((VERSION_MAJOR, VERSION_MINOR), (3, 1));
/// ```
pub const VERSION_MAJOR: u8 = 3;
/// Minor version we advertise (ZMTP 3.1, RFC 37).
pub const VERSION_MINOR: u8 = 1;
/// The only security mechanism supported.
///
/// ```
/// assert_eq!(eventplane::zmtp::codec::MECHANISM_NULL, b"NULL");
/// ```
pub const MECHANISM_NULL: &[u8] = b"NULL";

const MECHANISM_OFFSET: usize = 12;
const MECHANISM_LEN: usize = 20;
const AS_SERVER_OFFSET: usize = 32;

/// A peer's greeting, once fully received and validated (see [`GreetingDecoder`]).
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::{encode_greeting, GreetingDecoder};
/// let mut wire = BytesMut::new();
/// encode_greeting(&mut wire);
/// let greeting = GreetingDecoder::new().decode(&mut wire)?.unwrap();
/// assert_eq!((greeting.major, greeting.minor, greeting.as_server), (3, 1, false));
/// # Ok::<(), eventplane::zmtp::ProtocolError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    /// Major version (≥ 3).
    pub major: u8,
    /// Minor version: 0 for ZMTP 3.0, 1 for 3.1.
    pub minor: u8,
    /// The as-server bit (meaningless for NULL).
    pub as_server: bool,
}

/// Appends our greeting: ZMTP 3.1, NULL mechanism, as-server 0.
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::{encode_greeting, GREETING_LEN};
/// let mut buf = BytesMut::new();
/// encode_greeting(&mut buf);
/// assert_eq!(buf.len(), GREETING_LEN);
/// assert_eq!(&buf[..12], &[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1]);
/// assert_eq!(&buf[12..16], b"NULL");
/// ```
pub fn encode_greeting(buf: &mut BytesMut) {
    buf.reserve(GREETING_LEN);
    buf.put_u8(0xff);
    buf.put_bytes(0, 7);
    buf.put_u8(1);
    buf.put_u8(0x7f);
    buf.put_u8(VERSION_MAJOR);
    buf.put_u8(VERSION_MINOR);
    buf.put_slice(MECHANISM_NULL);
    buf.put_bytes(0, MECHANISM_LEN - MECHANISM_NULL.len());
    buf.put_u8(0); // as-server
    buf.put_bytes(0, 31);
}

/// Incremental greeting decoder: validates each byte as it arrives and rejects on the
/// first bad one, so a peer that speaks another protocol is dropped after a single
/// byte, and libzmq's staged 10 / 1 / 53-byte greeting is handled.
///
/// ```
/// use bytes::BytesMut;
/// use eventplane::zmtp::codec::{GreetingDecoder, encode_greeting};
/// let mut wire = BytesMut::new();
/// encode_greeting(&mut wire);
/// let mut decoder = GreetingDecoder::new();
/// let mut first = wire.split_to(10);
/// assert_eq!(decoder.decode(&mut first)?, None);
/// let greeting = decoder.decode(&mut wire)?.expect("complete");
/// assert_eq!((greeting.major, greeting.minor), (3, 1));
/// # Ok::<(), eventplane::zmtp::ProtocolError>(())
/// ```
#[derive(Debug, Clone)]
pub struct GreetingDecoder {
    buf: [u8; GREETING_LEN],
    len: usize,
}

impl Default for GreetingDecoder {
    fn default() -> Self {
        GreetingDecoder {
            buf: [0; GREETING_LEN],
            len: 0,
        }
    }
}

impl GreetingDecoder {
    /// A decoder that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many bytes of the greeting have arrived.
    pub fn received(&self) -> usize {
        self.len
    }

    /// Consumes greeting bytes from `src` (never more than the greeting), validating
    /// them. Returns the greeting once all 64 bytes have arrived.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Greeting>, ProtocolError> {
        let want = (GREETING_LEN - self.len).min(src.len());
        for _ in 0..want {
            let byte = src.get_u8();
            self.check(self.len, byte)?;
            if let Some(slot) = self.buf.get_mut(self.len) {
                *slot = byte;
            }
            self.len += 1;
        }
        if self.len < GREETING_LEN {
            return Ok(None);
        }
        self.finish().map(Some)
    }

    fn check(&self, index: usize, byte: u8) -> Result<(), ProtocolError> {
        match index {
            0 if byte != 0xff => Err(ProtocolError::BadSignature),
            // Padding bytes 1..=8 are not validated: libzmq sends 00..01.
            9 if byte & 1 == 0 => Err(ProtocolError::BadSignature),
            10 if byte < VERSION_MAJOR => Err(ProtocolError::UnsupportedVersion {
                major: byte,
                minor: 0,
            }),
            _ => Ok(()),
        }
    }

    fn finish(&self) -> Result<Greeting, ProtocolError> {
        let get = |i: usize| self.buf.get(i).copied().unwrap_or(0);
        let mechanism = self
            .buf
            .get(MECHANISM_OFFSET..MECHANISM_OFFSET + MECHANISM_LEN)
            .unwrap_or_default();
        let name_len = mechanism
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(MECHANISM_LEN);
        let name = mechanism.get(..name_len).unwrap_or_default();
        let padding_clean = mechanism
            .get(name_len..)
            .unwrap_or_default()
            .iter()
            .all(|&b| b == 0);
        if name != MECHANISM_NULL || !padding_clean {
            return Err(ProtocolError::UnsupportedMechanism {
                mechanism: String::from_utf8_lossy(name).into_owned(),
            });
        }
        Ok(Greeting {
            major: get(10),
            minor: get(11),
            as_server: get(AS_SERVER_OFFSET) != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours() -> BytesMut {
        let mut b = BytesMut::new();
        encode_greeting(&mut b);
        b
    }

    #[test]
    fn decodes_our_own_greeting_byte_by_byte() {
        let all = ours();
        let mut d = GreetingDecoder::new();
        for (i, byte) in all.iter().enumerate() {
            let mut one = BytesMut::from(&[*byte][..]);
            let r = d.decode(&mut one).unwrap();
            assert_eq!(r.is_some(), i == GREETING_LEN - 1);
        }
    }

    #[test]
    fn rejects_on_first_bad_byte() {
        let mut d = GreetingDecoder::new();
        let mut b = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
        assert_eq!(d.decode(&mut b), Err(ProtocolError::BadSignature));
        assert_eq!(d.received(), 0);
    }

    #[test]
    fn leaves_following_bytes_in_buffer() {
        let mut b = ours();
        b.extend_from_slice(b"\x04\x00");
        let g = GreetingDecoder::new().decode(&mut b).unwrap().unwrap();
        assert_eq!((g.major, g.minor), (3, 1));
        assert_eq!(&b[..], b"\x04\x00");
    }
}
