//! Dynamo's event-plane frame: `0x01`, a `u32` big-endian length, then a msgpack
//! envelope `{publisher_id, sequence, published_at, topic, payload: bin}`.
//! Pure functions over bytes; everything a hostile frame can reach is tested here.

use super::WireError;
use crate::msgpack::{self, put};
use crate::reader::Reader;

/// The first byte of every Dynamo event frame (its format version).
pub(crate) const DYNAMO_FRAME_VERSION: u8 = 0x01;

/// Bytes before the envelope: the version and the envelope's length.
const HEADER_LEN: usize = 5;

/// A decoded Dynamo envelope, borrowing from the frame.
///
/// ```
/// use eventplane::wire::{encode_dynamo_frame, parse_dynamo_frame};
/// let mut frame = Vec::new();
/// encode_dynamo_frame("kv-events", 42, 7, 1_700_000_000_000, b"payload", &mut frame);
/// let envelope = parse_dynamo_frame(&frame)?;
/// assert_eq!((envelope.topic, envelope.publisher_id, envelope.sequence), ("kv-events", 42, 7));
/// assert_eq!(envelope.published_at, Some(1_700_000_000_000));
/// assert_eq!(envelope.payload, b"payload");
/// # Ok::<(), eventplane::wire::WireError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DynamoEnvelope<'a> {
    /// The topic the envelope names (must equal frame 0).
    pub topic: &'a str,
    /// The publisher id the envelope names (must equal frame 1).
    pub publisher_id: u64,
    /// The sequence the envelope names (must equal frame 2).
    pub sequence: u64,
    /// Milliseconds since the Unix epoch at publication, when present.
    pub published_at: Option<u64>,
    /// The payload: for `kv-events`, a msgpack list of router events.
    pub payload: &'a [u8],
}

/// Appends one Dynamo event frame to `out`: the version byte, the envelope length and
/// the envelope, with its fields in the order a Dynamo 1.6.1 worker writes them and
/// every integer in its shortest msgpack form (so the bytes equal Dynamo's own).
///
/// ```
/// use eventplane::wire::encode_dynamo_frame;
/// let mut frame = Vec::new();
/// encode_dynamo_frame("t", 1, 2, 3, b"", &mut frame);
/// assert_eq!(frame[0], 0x01);
/// assert_eq!(u32::from_be_bytes(frame[1..5].try_into().unwrap()) as usize, frame.len() - 5);
/// ```
pub fn encode_dynamo_frame(
    topic: &str,
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    payload: &[u8],
    out: &mut Vec<u8>,
) {
    let start = out.len();
    out.push(DYNAMO_FRAME_VERSION);
    out.extend_from_slice(&[0; 4]);
    out.push(0x85); // a map of five entries
    put::str(out, "publisher_id");
    put::uint(out, publisher_id);
    put::str(out, "sequence");
    put::uint(out, sequence);
    put::str(out, "published_at");
    put::uint(out, published_at);
    put::str(out, "topic");
    put::str(out, topic);
    put::str(out, "payload");
    put::bin(out, payload);
    let envelope = out.len() - start - HEADER_LEN;
    // Envelopes over 4 GiB cannot be framed; the length saturates and any reader
    // rejects the frame (a length mismatch) rather than misreading it.
    let len = u32::try_from(envelope).unwrap_or(u32::MAX).to_be_bytes();
    if let Some(slot) = out.get_mut(start + 1..start + HEADER_LEN) {
        slot.copy_from_slice(&len);
    }
}

/// Parses one Dynamo event frame. Unknown envelope fields are ignored; a frame whose
/// header, length or envelope is wrong gives the matching [`WireError`]. Never panics
/// and never allocates.
///
/// ```
/// use eventplane::wire::{parse_dynamo_frame, WireError};
/// assert!(matches!(parse_dynamo_frame(b"\x02\0\0\0\0"), Err(WireError::Header { .. })));
/// assert!(matches!(parse_dynamo_frame(b"\x01\0\0\0\x09\x80"), Err(WireError::Length { declared: 9, actual: 1 })));
/// assert!(matches!(parse_dynamo_frame(b"\x01\0\0\0\x01\x80"), Err(WireError::Envelope(_))));
/// ```
pub fn parse_dynamo_frame(frame: &[u8]) -> Result<DynamoEnvelope<'_>, WireError> {
    let (Some(&version), Some(len), Some(envelope)) = (
        frame.first(),
        frame.get(1..HEADER_LEN),
        frame.get(HEADER_LEN..),
    ) else {
        return Err(WireError::Header {
            version: frame.first().copied(),
        });
    };
    if version != DYNAMO_FRAME_VERSION {
        return Err(WireError::Header {
            version: Some(version),
        });
    }
    let declared = len
        .try_into()
        .map(u32::from_be_bytes)
        .map_err(|_| WireError::Header {
            version: Some(version),
        })?;
    if usize::try_from(declared).ok() != Some(envelope.len()) {
        return Err(WireError::Length {
            declared: u64::from(declared),
            actual: envelope.len() as u64,
        });
    }
    // Read in place, field by field: nothing is allocated per frame; unknown fields are
    // stepped over (nested at most `msgpack::MAX_DEPTH` deep).
    let bad = WireError::Envelope;
    let mut r = Reader::new(envelope);
    let entries = msgpack::read_map_len(&mut r).ok_or(bad("not a map"))?;
    let (mut topic, mut publisher_id, mut sequence) = (None, None, None);
    let (mut published_at, mut payload) = (None, None);
    for _ in 0..entries {
        let Some(key) = msgpack::read_str(&mut r) else {
            // A key that is not a string names no field of ours.
            msgpack::skip_value(&mut r).map_err(|_| bad("truncated or too deep"))?;
            msgpack::skip_value(&mut r).map_err(|_| bad("truncated or too deep"))?;
            continue;
        };
        let read = match key {
            // Read either way (a topic that is not UTF-8 is then missing, below):
            // never stepped over a second time, which would skip the next key.
            b"topic" => msgpack::read_str(&mut r).map(|t| {
                if let Ok(t) = std::str::from_utf8(t) {
                    topic = topic.or(Some(t));
                }
            }),
            b"publisher_id" => {
                msgpack::read_uint(&mut r).map(|v| publisher_id = publisher_id.or(Some(v)))
            }
            b"sequence" => msgpack::read_uint(&mut r).map(|v| sequence = sequence.or(Some(v))),
            b"published_at" => {
                msgpack::read_uint(&mut r).map(|v| published_at = published_at.or(Some(v)))
            }
            b"payload" => msgpack::read_bin(&mut r).map(|p| payload = payload.or(Some(p))),
            _ => None,
        };
        if read.is_none() {
            // An unknown field, or a known one of another type (then missing below).
            msgpack::skip_value(&mut r).map_err(|_| bad("truncated or too deep"))?;
        }
    }
    if r.remaining() != 0 {
        return Err(bad("bytes after the envelope"));
    }
    let topic = topic.ok_or(bad("topic missing or not a string"))?;
    let publisher_id =
        publisher_id.ok_or(bad("publisher_id missing or not an unsigned integer"))?;
    let sequence = sequence.ok_or(bad("sequence missing or not an unsigned integer"))?;
    let payload = payload.ok_or(bad("payload missing or not binary"))?;
    Ok(DynamoEnvelope {
        topic,
        publisher_id,
        sequence,
        published_at,
        payload,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn a_topic_that_is_not_utf8_is_missing_not_a_misread_envelope() {
        let mut frame = Vec::new();
        encode_dynamo_frame("\u{e9}", 1, 2, 3, b"p", &mut frame);
        // The topic's two bytes (é) made invalid UTF-8, lengths unchanged.
        let at = frame
            .windows(2)
            .position(|w| w == "\u{e9}".as_bytes())
            .unwrap();
        frame[at] = 0xff;
        assert_eq!(
            parse_dynamo_frame(&frame),
            Err(WireError::Envelope("topic missing or not a string"))
        );
    }

    #[test]
    fn integers_strings_and_binaries_take_their_shortest_form() {
        let cases: [(u64, &[u8]); 6] = [
            (0x7f, &[0x7f]),
            (0x80, &[0xcc, 0x80]),
            (0x100, &[0xcd, 1, 0]),
            (0x1_0000, &[0xce, 0, 1, 0, 0]),
            (0x1_0000_0000, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]),
            (
                u64::MAX,
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
        ];
        for (v, want) in cases {
            let mut out = Vec::new();
            put::uint(&mut out, v);
            assert_eq!(out, want, "{v:#x}");
        }
        for (len, marker) in [(31, 0xa0 | 31), (32, 0xd9), (256, 0xda), (65536, 0xdb)] {
            let mut out = Vec::new();
            put::str(&mut out, &"x".repeat(len));
            assert_eq!(out[0], marker, "str of {len}");
        }
        for (len, marker) in [(255, 0xc4), (256, 0xc5), (65536, 0xc6)] {
            let mut out = Vec::new();
            put::bin(&mut out, &vec![0; len]);
            assert_eq!(out[0], marker, "bin of {len}");
        }
    }

    #[test]
    fn round_trip_and_unknown_fields() {
        let mut frame = Vec::new();
        let big = vec![7u8; 70_000];
        encode_dynamo_frame("kv-events", u64::MAX >> 11, 1 << 40, 5, &big, &mut frame);
        let e = parse_dynamo_frame(&frame).unwrap();
        assert_eq!(e.publisher_id, u64::MAX >> 11);
        assert_eq!(e.sequence, 1 << 40);
        assert_eq!(e.payload, &big[..]);
        // A later release adds a field (and drops published_at): still decodes.
        let env = b"\x85\xa5topic\xa1t\xacpublisher_id\x01\xa8sequence\x02\xa7payload\xc4\x00\xa5extra\x92\x01\x02";
        let mut frame = vec![1, 0, 0, 0, env.len() as u8];
        frame.extend_from_slice(env);
        let e = parse_dynamo_frame(&frame).unwrap();
        assert_eq!(
            (e.topic, e.publisher_id, e.sequence, e.published_at),
            ("t", 1, 2, None)
        );
    }

    #[test]
    fn hostile_frames_get_the_named_error() {
        let mut good = Vec::new();
        encode_dynamo_frame("t", 1, 2, 3, b"p", &mut good);
        assert!(parse_dynamo_frame(&good).is_ok());
        let header = |v| WireError::Header { version: v };
        let mut longer = good.clone();
        longer.push(0);
        let mut forged = good.clone();
        forged[1..5].copy_from_slice(&u32::MAX.to_be_bytes());
        let mut wrong_version = good.clone();
        wrong_version[0] = 2;
        let cases: Vec<(Vec<u8>, WireError)> = vec![
            (vec![], header(None)),
            (vec![1, 0, 0, 0], header(Some(1))),
            (wrong_version, header(Some(2))),
            (
                longer.clone(),
                WireError::Length {
                    declared: (good.len() - 5) as u64,
                    actual: (longer.len() - 5) as u64,
                },
            ),
            (
                good[..good.len() - 1].to_vec(),
                WireError::Length {
                    declared: (good.len() - 5) as u64,
                    actual: (good.len() - 6) as u64,
                },
            ),
            (
                forged,
                WireError::Length {
                    declared: u64::from(u32::MAX),
                    actual: (good.len() - 5) as u64,
                },
            ),
        ];
        for (frame, want) in cases {
            assert_eq!(
                parse_dynamo_frame(&frame).unwrap_err(),
                want,
                "{frame:02x?}"
            );
        }
        let envelope = |env: &[u8]| {
            let mut f = vec![1];
            f.extend_from_slice(&(env.len() as u32).to_be_bytes());
            f.extend_from_slice(env);
            parse_dynamo_frame(&f).unwrap_err()
        };
        let field_errors: [&[u8]; 6] = [
            b"\x91\x01",                                                                  // not a map
            b"\x81\xa5topic\xa1t", // ids missing
            b"\x84\xa5topic\x01\xacpublisher_id\x01\xa8sequence\x02\xa7payload\xc4\x00", // topic not a string
            b"\x84\xa5topic\xa1t\xacpublisher_id\xff\xa8sequence\x02\xa7payload\xc4\x00", // negative id
            b"\x84\xa5topic\xa1t\xacpublisher_id\x01\xa8sequence\x02\xa7payload\xa0", // payload a string
            b"\xdf\xff\xff\xff\xff", // forged map length
        ];
        for env in field_errors {
            assert!(
                matches!(envelope(env), WireError::Envelope(_)),
                "{env:02x?}"
            );
        }
        // An unknown field nested deeper than the reader goes: refused, not recursed.
        let mut deep = b"\x81\xa1x".to_vec();
        deep.extend(std::iter::repeat_n(0x91u8, 40));
        deep.push(0xc0);
        assert!(matches!(envelope(&deep), WireError::Envelope(_)));
        // A key that is not a string is stepped over with its value.
        let odd_key =
            b"\x85\x01\x02\xa5topic\xa1t\xacpublisher_id\x01\xa8sequence\x02\xa7payload\xc4\x00";
        let mut f = vec![1];
        f.extend_from_slice(&(odd_key.len() as u32).to_be_bytes());
        f.extend_from_slice(odd_key);
        assert_eq!(parse_dynamo_frame(&f).unwrap().topic, "t");
    }
}
