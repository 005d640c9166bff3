//! The byte framing of Dynamo 1.6.1's TCP request plane (sans-IO).
//!
//! A request, from a router to a worker's `recovery_target`, is one frame:
//! `u16be path_len, path, u16be headers_len, headers, u32be payload_len, payload`,
//! acknowledged by the worker with a 4-byte big-endian 0 on the same connection. The
//! payload, and every message of the response stream the worker then sends on a
//! connection of its own to the router, is a *two-part message*:
//! `u64be header_len, u64be body_len, u64be checksum, header, body` (the checksum is 0
//! from Dynamo's release builds and not checked).
//!
//! Both decoders take what has arrived so far and say how much of it one frame took,
//! or that more is needed. Each length is checked against its bound as soon as it
//! has arrived, before the bytes it announces are waited for: a peer announcing a
//! frame larger than the bound gets an error, not a buffer of that size.

use bytes::{Bytes, BytesMut};

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// A part is longer than its bound.
    #[error("{part} of {len} bytes, more than the {max} accepted")]
    TooLarge {
        /// Which part.
        part: &'static str,
        /// The length announced.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// A part that must be UTF-8 (the path) is not.
    #[error("the request path is not UTF-8")]
    NotUtf8,
}

/// Bounds of the request frame a worker accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Bytes of the path (Dynamo's are under 100).
    pub path: usize,
    /// Bytes of the headers (a JSON object of a few strings).
    pub headers: usize,
    /// Bytes of the payload (a two-part message carrying a query).
    pub payload: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            path: 1024,
            headers: 8 << 10,
            payload: 64 << 10,
        }
    }
}

/// One request frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFrame {
    /// Where the request goes (`{instance:x}/{namespace}/{component}/{endpoint}`).
    pub path: String,
    /// The headers, as sent (a JSON object of strings).
    pub headers: Bytes,
    /// The payload (a two-part message).
    pub payload: Bytes,
}

/// The worker's acknowledgement of a request: a 4-byte big-endian 0.
pub(crate) const ACK: [u8; 4] = [0; 4];

/// Writes one request frame. Parts longer than their length fields can say are
/// refused.
pub fn encode_request(path: &str, headers: &[u8], payload: &[u8]) -> Result<Vec<u8>, FrameError> {
    let too_large = |part, len: usize, max| FrameError::TooLarge {
        part,
        len: len as u64,
        max,
    };
    let path_len = u16::try_from(path.len()).map_err(|_| too_large("path", path.len(), 65_535))?;
    let headers_len =
        u16::try_from(headers.len()).map_err(|_| too_large("headers", headers.len(), 65_535))?;
    let payload_len = u32::try_from(payload.len())
        .map_err(|_| too_large("payload", payload.len(), u32::MAX as usize))?;
    let mut out = Vec::with_capacity(8 + path.len() + headers.len() + payload.len());
    out.extend_from_slice(&path_len.to_be_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(&headers_len.to_be_bytes());
    out.extend_from_slice(headers);
    out.extend_from_slice(&payload_len.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// Reads lengths off the front of what arrived, checking each as it comes.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    /// The next `N` bytes, if they arrived.
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let bytes = self.buf.get(self.at..self.at + N)?;
        self.at += N;
        <[u8; N]>::try_from(bytes).ok()
    }

    /// A length prefix, checked against `max`; `Ok(None)` until it arrived.
    fn len<const N: usize>(
        &mut self,
        part: &'static str,
        max: usize,
    ) -> Result<Option<usize>, FrameError> {
        let Some(raw) = self.take::<N>() else {
            return Ok(None);
        };
        let len = raw.iter().fold(0u64, |len, &b| len << 8 | u64::from(b));
        match usize::try_from(len) {
            Ok(n) if n <= max => Ok(Some(n)),
            _ => Err(FrameError::TooLarge { part, len, max }),
        }
    }

    /// Skips `n` bytes, if they arrived; their range.
    fn skip(&mut self, n: usize) -> Option<std::ops::Range<usize>> {
        let end = self.at.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        let range = self.at..end;
        self.at = end;
        Some(range)
    }
}

/// Takes one request frame off the front of `buf` when it has all arrived (`Ok(None)`
/// until then, with `buf` untouched).
pub fn decode_request(
    buf: &mut BytesMut,
    limits: RequestLimits,
) -> Result<Option<RequestFrame>, FrameError> {
    let mut c = Cursor { buf, at: 0 };
    let Some(path_len) = c.len::<2>("path", limits.path)? else {
        return Ok(None);
    };
    let Some(path) = c.skip(path_len) else {
        return Ok(None);
    };
    let Some(headers_len) = c.len::<2>("headers", limits.headers)? else {
        return Ok(None);
    };
    let Some(headers) = c.skip(headers_len) else {
        return Ok(None);
    };
    let Some(payload_len) = c.len::<4>("payload", limits.payload)? else {
        return Ok(None);
    };
    let Some(payload) = c.skip(payload_len) else {
        return Ok(None);
    };
    let used = c.at;
    let frame = buf.split_to(used).freeze();
    let path = std::str::from_utf8(frame.get(path).unwrap_or_default())
        .map_err(|_| FrameError::NotUtf8)?
        .to_owned();
    Ok(Some(RequestFrame {
        path,
        headers: frame.slice(headers),
        payload: frame.slice(payload),
    }))
}

/// One two-part message: a header (JSON in everything Dynamo sends) and a body (empty,
/// or in the stream's codec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwoPart {
    /// The header.
    pub header: Bytes,
    /// The body.
    pub body: Bytes,
}

/// Writes one two-part message (checksum 0, as Dynamo's release builds write it).
pub fn encode_two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&0u64.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out
}

/// Takes one two-part message off the front of `buf` when it has all arrived, its
/// header at most `max_header` bytes and its body at most `max_body`.
pub fn decode_two_part(
    buf: &mut BytesMut,
    max_header: usize,
    max_body: usize,
) -> Result<Option<TwoPart>, FrameError> {
    let mut c = Cursor { buf, at: 0 };
    let Some(header_len) = c.len::<8>("header", max_header)? else {
        return Ok(None);
    };
    let Some(body_len) = c.len::<8>("body", max_body)? else {
        return Ok(None);
    };
    if c.take::<8>().is_none() {
        return Ok(None);
    }
    let Some(header) = c.skip(header_len) else {
        return Ok(None);
    };
    let Some(body) = c.skip(body_len) else {
        return Ok(None);
    };
    let used = c.at;
    let message = buf.split_to(used).freeze();
    Ok(Some(TwoPart {
        header: message.slice(header),
        body: message.slice(body),
    }))
}

/// Reads one two-part message from a whole payload (a request's): exactly one, with
/// nothing after it.
pub fn two_part_of(payload: &Bytes, max_header: usize, max_body: usize) -> Option<TwoPart> {
    let mut buf = BytesMut::from(payload.as_ref());
    match decode_two_part(&mut buf, max_header, max_body) {
        Ok(Some(m)) if buf.is_empty() => Some(m),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn a_request_round_trips_and_waits_for_every_byte() {
        let payload = encode_two_part(br#"{"id":"x"}"#, b"\x81\xa1k\x01");
        let frame = encode_request("5151/ns/c/e", br#"{"request-id":"x"}"#, &payload).unwrap();
        for cut in 0..frame.len() {
            let mut buf = BytesMut::from(&frame[..cut]);
            assert_eq!(decode_request(&mut buf, RequestLimits::default()), Ok(None));
            assert_eq!(buf.len(), cut, "nothing taken before the frame is whole");
        }
        let mut buf = BytesMut::from(&frame[..]);
        buf.extend_from_slice(b"next");
        let got = decode_request(&mut buf, RequestLimits::default())
            .unwrap()
            .unwrap();
        assert_eq!(got.path, "5151/ns/c/e");
        assert_eq!(&got.headers[..], br#"{"request-id":"x"}"#);
        assert_eq!(&buf[..], b"next");
        let message = two_part_of(&got.payload, 1024, 1024).unwrap();
        assert_eq!(&message.header[..], br#"{"id":"x"}"#);
        assert_eq!(&message.body[..], b"\x81\xa1k\x01");
    }

    #[test]
    fn lengths_past_their_bound_are_refused_as_soon_as_they_arrive() {
        let limits = RequestLimits {
            path: 4,
            headers: 4,
            payload: 4,
        };
        // Only the prefix has arrived: refused already, nothing waited for.
        let mut buf = BytesMut::from(&[0x00, 0x05][..]);
        assert_eq!(
            decode_request(&mut buf, limits),
            Err(FrameError::TooLarge {
                part: "path",
                len: 5,
                max: 4
            })
        );
        let mut buf = BytesMut::from(&b"\x00\x01p\x00\x00\xff\xff\xff\xff"[..]);
        assert!(matches!(
            decode_request(&mut buf, limits),
            Err(FrameError::TooLarge {
                part: "payload",
                len: 0xffff_ffff,
                ..
            })
        ));
        let mut forged = BytesMut::from(&[0xff; 8][..]);
        assert!(matches!(
            decode_two_part(&mut forged, 1 << 20, 1 << 20),
            Err(FrameError::TooLarge { part: "header", .. })
        ));
        let mut path = BytesMut::from(&b"\x00\x02\xff\xfe\x00\x00\x00\x00\x00\x00"[..]);
        assert_eq!(decode_request(&mut path, limits), Err(FrameError::NotUtf8));
    }

    #[test]
    fn two_part_messages_stream_one_after_another() {
        let mut stream = encode_two_part(br#"{"subject":"s"}"#, b"");
        stream.extend(encode_two_part(br#"{"error":null}"#, b""));
        stream.extend(encode_two_part(b"", br#"{"complete_final":true}"#));
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in stream {
            buf.extend_from_slice(&[b]);
            while let Some(m) = decode_two_part(&mut buf, 1024, 1024).unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 3);
        assert_eq!(&got[1].header[..], br#"{"error":null}"#);
        assert_eq!(&got[2].body[..], br#"{"complete_final":true}"#);
        // A payload must hold exactly one.
        let two = [encode_two_part(b"a", b""), encode_two_part(b"b", b"")].concat();
        assert_eq!(two_part_of(&Bytes::from(two), 16, 16), None);
    }
}
