//! Commands (RFC 23 §2.5, RFC 37 §2.7): `name-len name data`.

use bytes::{BufMut, Bytes, BytesMut};

use super::frame::encode_frame_header;
use crate::reader::Reader;
use crate::zmtp::ProtocolError;

/// Largest PING context (RFC 37: at most 16 bytes).
///
/// ```
/// assert_eq!(eventplane::zmtp::codec::MAX_PING_CONTEXT, 16); // RFC 37: up to 16 octets
/// ```
pub const MAX_PING_CONTEXT: usize = 16;

/// Most properties a READY may carry (libzmq sends one or two; applications add a few
/// with `ZMQ_METADATA`). Kept for the connection's lifetime, each costs about 100 bytes
/// of bookkeeping beyond its size, so their number is bounded as well as their bytes.
///
/// ```
/// assert_eq!(eventplane::zmtp::codec::MAX_METADATA_PROPERTIES, 64);
/// ```
pub const MAX_METADATA_PROPERTIES: usize = 64;

/// READY metadata: `(name, value)` properties in wire order. Names compare
/// case-insensitively.
///
/// ```
/// use eventplane::zmtp::codec::Metadata;
/// let mut md = Metadata::new();
/// md.push("Socket-Type", "PUB");
/// assert_eq!(md.get("socket-type").map(|v| &v[..]), Some(&b"PUB"[..]));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    properties: Vec<(Bytes, Bytes)>,
}

impl Metadata {
    /// Empty metadata.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a property. Names longer than 255 bytes are truncated when encoded.
    pub fn push(&mut self, name: impl Into<Bytes>, value: impl Into<Bytes>) {
        self.properties.push((name.into(), value.into()));
    }

    /// The first property called `name` (ASCII case-insensitive).
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.properties
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// All properties in wire order.
    pub fn iter(&self) -> impl Iterator<Item = (&Bytes, &Bytes)> {
        self.properties.iter().map(|(n, v)| (n, v))
    }

    fn parse(body: &Bytes, mut r: Reader<'_>) -> Result<Metadata, ProtocolError> {
        let malformed = ProtocolError::MalformedCommand { command: "READY" };
        let mut md = Metadata::new();
        while r.remaining() > 0 {
            if md.properties.len() >= MAX_METADATA_PROPERTIES {
                return Err(ProtocolError::TooManyProperties {
                    max: MAX_METADATA_PROPERTIES,
                });
            }
            let name_len = usize::from(r.u8().ok_or(malformed.clone())?);
            if name_len == 0 {
                return Err(malformed);
            }
            let name_at = r.position();
            r.take(name_len).ok_or(malformed.clone())?;
            let value_len = r
                .u32_be()
                .and_then(|l| usize::try_from(l).ok())
                .ok_or(malformed.clone())?;
            let value_at = r.position();
            r.take(value_len).ok_or(malformed.clone())?;
            // Copied: metadata lives as long as the connection and must not pin the
            // read buffer the READY arrived in.
            let name = body.get(name_at..name_at + name_len);
            let value = body.get(value_at..value_at + value_len);
            let (Some(name), Some(value)) = (name, value) else {
                return Err(malformed);
            };
            md.push(Bytes::copy_from_slice(name), Bytes::copy_from_slice(value));
        }
        Ok(md)
    }

    fn encode(&self, buf: &mut BytesMut) {
        for (name, value) in &self.properties {
            let name = name.get(..name.len().min(255)).unwrap_or_default();
            buf.put_u8(name.len() as u8);
            buf.put_slice(name);
            buf.put_u32(value.len() as u32);
            buf.put_slice(value);
        }
    }

    fn encoded_len(&self) -> usize {
        self.properties
            .iter()
            .map(|(n, v)| 1 + n.len().min(255) + 4 + v.len())
            .sum()
    }
}

/// A ZMTP command.
///
/// ```
/// use bytes::{Bytes, BytesMut};
/// use eventplane::zmtp::codec::Command;
/// let mut buf = BytesMut::new();
/// Command::Subscribe(Bytes::from_static(b"kv")).encode(&mut buf);
/// assert_eq!(&buf[..], b"\x04\x0c\x09SUBSCRIBEkv");
/// let body = buf.split_off(2).freeze();
/// assert_eq!(Command::parse(body)?, Command::Subscribe(Bytes::from_static(b"kv")));
/// # Ok::<(), eventplane::zmtp::ProtocolError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// `READY` with its metadata.
    Ready(Metadata),
    /// `ERROR` with its reason.
    Error {
        /// The reason, at most 255 bytes.
        reason: Bytes,
    },
    /// `SUBSCRIBE` (ZMTP 3.1) with the prefix.
    Subscribe(Bytes),
    /// `CANCEL` (ZMTP 3.1) with the prefix.
    Cancel(Bytes),
    /// `PING` (ZMTP 3.1) with its TTL in deciseconds and up to 16 context bytes.
    Ping {
        /// TTL in deciseconds; 0 means none.
        ttl_deciseconds: u16,
        /// Context to echo in the PONG.
        context: Bytes,
    },
    /// `PONG` echoing a PING's context.
    Pong {
        /// The PING's context.
        context: Bytes,
    },
    /// Any other command: ignored (and counted) after the handshake.
    Unknown {
        /// The command name.
        name: Bytes,
        /// The command data.
        body: Bytes,
    },
}

impl Command {
    /// The command name as sent on the wire.
    pub fn name(&self) -> &[u8] {
        match self {
            Command::Ready(_) => b"READY",
            Command::Error { .. } => b"ERROR",
            Command::Subscribe(_) => b"SUBSCRIBE",
            Command::Cancel(_) => b"CANCEL",
            Command::Ping { .. } => b"PING",
            Command::Pong { .. } => b"PONG",
            Command::Unknown { name, .. } => name,
        }
    }

    /// Parses a command frame's body. Never panics; allocates at most the size of
    /// `body` (READY metadata is copied out, everything else is sliced from `body`).
    pub fn parse(body: Bytes) -> Result<Command, ProtocolError> {
        let mut r = Reader::new(&body);
        let malformed = |command| ProtocolError::MalformedCommand { command };
        let name_len = usize::from(r.u8().ok_or(malformed("unnamed"))?);
        let name = r.take(name_len).ok_or(malformed("truncated"))?;
        let data_at = r.position();
        let cmd = match name {
            b"READY" => Command::Ready(Metadata::parse(&body, r)?),
            b"ERROR" => {
                let len = usize::from(r.u8().ok_or(malformed("ERROR"))?);
                let at = r.position();
                r.take(len).ok_or(malformed("ERROR"))?;
                Command::Error {
                    reason: body.slice(at..at + len),
                }
            }
            b"SUBSCRIBE" => Command::Subscribe(body.slice(data_at..)),
            b"CANCEL" => Command::Cancel(body.slice(data_at..)),
            b"PING" => {
                let ttl_deciseconds = r.u16_be().ok_or(malformed("PING"))?;
                let at = r.position();
                if r.rest().len() > MAX_PING_CONTEXT {
                    return Err(malformed("PING"));
                }
                Command::Ping {
                    ttl_deciseconds,
                    context: body.slice(at..),
                }
            }
            b"PONG" => Command::Pong {
                context: body.slice(data_at..),
            },
            _ => Command::Unknown {
                name: body.slice(1..1 + name_len),
                body: body.slice(data_at..),
            },
        };
        Ok(cmd)
    }

    /// Appends the whole command frame (header included).
    pub fn encode(&self, buf: &mut BytesMut) {
        let name = self.name();
        let name = name.get(..name.len().min(255)).unwrap_or_default();
        let data_len = match self {
            Command::Ready(md) => md.encoded_len(),
            Command::Error { reason } => 1 + reason.len().min(255),
            Command::Subscribe(t) | Command::Cancel(t) => t.len(),
            Command::Ping { context, .. } => 2 + context.len(),
            Command::Pong { context } => context.len(),
            Command::Unknown { body, .. } => body.len(),
        };
        let size = 1 + name.len() + data_len;
        buf.reserve(9 + size);
        encode_frame_header(buf, false, true, size);
        buf.put_u8(name.len() as u8);
        buf.put_slice(name);
        match self {
            Command::Ready(md) => md.encode(buf),
            Command::Error { reason } => {
                let reason = reason.get(..reason.len().min(255)).unwrap_or_default();
                buf.put_u8(reason.len() as u8);
                buf.put_slice(reason);
            }
            Command::Subscribe(t) | Command::Cancel(t) => buf.put_slice(t),
            Command::Ping {
                ttl_deciseconds,
                context,
            } => {
                buf.put_u16(*ttl_deciseconds);
                buf.put_slice(context);
            }
            Command::Pong { context } => buf.put_slice(context),
            Command::Unknown { body, .. } => buf.put_slice(body),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(cmd: Command) {
        let mut buf = BytesMut::new();
        cmd.encode(&mut buf);
        let header = if buf.len() - 2 > 255 { 9 } else { 2 };
        let body = buf.split_off(header).freeze();
        assert_eq!(Command::parse(body).unwrap(), cmd);
    }

    #[test]
    fn roundtrips() {
        let mut md = Metadata::new();
        md.push("Socket-Type", "SUB");
        md.push("Identity", "");
        roundtrip(Command::Ready(md));
        roundtrip(Command::Error {
            reason: Bytes::from_static(b"no"),
        });
        roundtrip(Command::Cancel(Bytes::from_static(b"t")));
        roundtrip(Command::Ping {
            ttl_deciseconds: 300,
            context: Bytes::from_static(b"ctx"),
        });
        roundtrip(Command::Pong {
            context: Bytes::new(),
        });
        roundtrip(Command::Unknown {
            name: Bytes::from_static(b"HELLO"),
            body: Bytes::from_static(b"x"),
        });
    }

    #[test]
    fn malformed_never_panics() {
        for body in [
            &b""[..],
            b"\x05REA",
            b"\x05READY\x00",
            b"\x05READY\x04Name\x00\x00\x00\x09x",
            b"\x05ERROR",
            b"\x05ERROR\x05ab",
            b"\x04PING\x00",
            b"\x04PING\x00\x01aaaaaaaaaaaaaaaaa",
        ] {
            assert!(
                Command::parse(Bytes::copy_from_slice(body)).is_err(),
                "{body:?}"
            );
        }
    }
}
