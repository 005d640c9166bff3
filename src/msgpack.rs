//! A small, bounded msgpack reader for engine payloads: borrows strings and binaries
//! from the input, limits nesting depth and the number of elements decoded (each
//! value, and each integer of an integer array, costs one), and never reserves from
//! a declared length: containers start at a small constant capacity and grow as
//! elements actually decode. A decoded element costs at most 64 bytes (a 32-byte
//! value in a vector grown by doubling), so the element budget bounds what a payload
//! can make us allocate whatever it declares. Nothing here can panic on hostile bytes.

use crate::reader::Reader;

/// Deepest nesting accepted.
pub(crate) const MAX_DEPTH: usize = 32;

/// Capacity a container starts with, whatever length it declares.
const INITIAL_CAPACITY: usize = 16;
/// Capacity an integer array starts with (token ids come by the thousand).
const INITIAL_UINTS: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    /// Negative integers only.
    NegInt(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    /// An array whose elements are all non-negative integers (token ids, hashes):
    /// decoded in a tight loop, 8 bytes per element.
    UInts(Vec<u64>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    Ext,
}

impl<'a> Value<'a> {
    pub(crate) fn as_str(&self) -> Option<&'a str> {
        match self {
            Value::Str(s) => std::str::from_utf8(s).ok(),
            _ => None,
        }
    }

    pub(crate) fn as_u64(&self) -> Option<u64> {
        match self {
            Value::UInt(u) => Some(*u),
            _ => None,
        }
    }

    pub(crate) fn as_array(&self) -> Option<&[Value<'a>]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The elements of an array of non-negative integers.
    pub(crate) fn as_uints(&self) -> Option<&[u64]> {
        match self {
            Value::UInts(a) => Some(a),
            _ => None,
        }
    }

    /// Number of elements, for arrays of either representation.
    pub(crate) fn array_len(&self) -> Option<usize> {
        match self {
            Value::Array(a) => Some(a.len()),
            Value::UInts(a) => Some(a.len()),
            _ => None,
        }
    }

    /// The value for string key `key` in a map.
    pub(crate) fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Why a payload is not msgpack we accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MsgpackError {
    Truncated,
    TooDeep,
    Reserved,
    Trailing,
    /// More elements than the budget allows.
    TooManyElements,
}

/// Parses one value that must span `input`, decoding at most `max_elements` elements.
pub(crate) fn parse(input: &[u8], max_elements: usize) -> Result<Value<'_>, MsgpackError> {
    let mut r = Reader::new(input);
    let mut budget = max_elements;
    let v = value(&mut r, input, 0, &mut budget)?;
    if r.remaining() != 0 {
        return Err(MsgpackError::Trailing);
    }
    Ok(v)
}

/// Checks, without allocating, that `input` is exactly one msgpack value nested at most
/// [`MAX_DEPTH`] deep, whose every container declares no more elements than bytes
/// remain (each element takes at least one). Run before a decoder that sizes its
/// vectors from declared lengths (serde's), it keeps what a payload can make it reserve
/// proportional to the payload's real size.
pub(crate) fn check_shape(input: &[u8]) -> Result<(), MsgpackError> {
    let mut r = Reader::new(input);
    skip_value(&mut r)?;
    if r.remaining() == 0 {
        Ok(())
    } else {
        Err(MsgpackError::Trailing)
    }
}

/// Steps `r` over one value, without allocating: nested at most [`MAX_DEPTH`] deep, and
/// no container declaring more elements than bytes remain.
pub(crate) fn skip_value(r: &mut Reader<'_>) -> Result<(), MsgpackError> {
    use MsgpackError::Truncated as T;
    // Values still to read at each open nesting level.
    let mut pending = [0u64; MAX_DEPTH + 2];
    let mut depth = 0usize;
    if let Some(top) = pending.first_mut() {
        *top = 1;
    }
    loop {
        loop {
            let left = pending.get_mut(depth).ok_or(MsgpackError::TooDeep)?;
            if *left > 0 {
                *left -= 1;
                break;
            }
            if depth == 0 {
                return Ok(());
            }
            depth -= 1;
        }
        let marker = r.u8().ok_or(T)?;
        let skip = |r: &mut Reader<'_>, n: usize| r.take(n).map(|_| ()).ok_or(T);
        let elements: u64 = match marker {
            0x80..=0x8f => 2 * u64::from(marker & 0x0f),
            0x90..=0x9f => u64::from(marker & 0x0f),
            0xdc => u64::from(r.u16_be().ok_or(T)?),
            0xdd => u64::from(r.u32_be().ok_or(T)?),
            0xde => 2 * u64::from(r.u16_be().ok_or(T)?),
            0xdf => 2 * u64::from(r.u32_be().ok_or(T)?),
            _ => {
                match marker {
                    0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => {}
                    0xc1 => return Err(MsgpackError::Reserved),
                    0xa0..=0xbf => skip(r, usize::from(marker & 0x1f))?,
                    0xc4 | 0xd9 => {
                        let n = usize::from(r.u8().ok_or(T)?);
                        skip(r, n)?;
                    }
                    0xc5 | 0xda => {
                        let n = usize::from(r.u16_be().ok_or(T)?);
                        skip(r, n)?;
                    }
                    0xc6 | 0xdb => {
                        let n = r.u32_be().ok_or(T)? as usize;
                        skip(r, n)?;
                    }
                    0xc7 => {
                        let n = usize::from(r.u8().ok_or(T)?);
                        skip(r, n + 1)?;
                    }
                    0xc8 => {
                        let n = usize::from(r.u16_be().ok_or(T)?);
                        skip(r, n + 1)?;
                    }
                    0xc9 => {
                        let n = r.u32_be().ok_or(T)? as usize;
                        skip(r, n.checked_add(1).ok_or(T)?)?;
                    }
                    0xca | 0xce | 0xd2 => skip(r, 4)?,
                    0xcb | 0xcf | 0xd3 => skip(r, 8)?,
                    0xcc | 0xd0 => skip(r, 1)?,
                    0xcd | 0xd1 => skip(r, 2)?,
                    // fixext 1, 2, 4, 8, 16: a type byte and the data.
                    0xd4..=0xd8 => skip(r, (1usize << (marker - 0xd4)) + 1)?,
                    _ => return Err(MsgpackError::Reserved),
                }
                0
            }
        };
        if elements > r.remaining() as u64 {
            return Err(T);
        }
        if elements > 0 {
            depth += 1;
            if depth > MAX_DEPTH {
                return Err(MsgpackError::TooDeep);
            }
            *pending.get_mut(depth).ok_or(MsgpackError::TooDeep)? = elements;
        }
    }
}

/// Reads a string if one is next (`r` is left where it was otherwise).
pub(crate) fn read_str<'a>(r: &mut Reader<'a>) -> Option<&'a [u8]> {
    let mut probe = *r;
    let n = match probe.u8()? {
        m @ 0xa0..=0xbf => usize::from(m & 0x1f),
        0xd9 => usize::from(probe.u8()?),
        0xda => usize::from(probe.u16_be()?),
        0xdb => probe.u32_be()? as usize,
        _ => return None,
    };
    let s = probe.take(n)?;
    *r = probe;
    Some(s)
}

/// Reads binary data if it is next (`r` is left where it was otherwise).
pub(crate) fn read_bin<'a>(r: &mut Reader<'a>) -> Option<&'a [u8]> {
    let mut probe = *r;
    let n = match probe.u8()? {
        0xc4 => usize::from(probe.u8()?),
        0xc5 => usize::from(probe.u16_be()?),
        0xc6 => probe.u32_be()? as usize,
        _ => return None,
    };
    let b = probe.take(n)?;
    *r = probe;
    Some(b)
}

/// The non-negative integer at `bytes[at..]` and its encoded length, if one is there.
#[inline]
pub(crate) fn uint_at(bytes: &[u8], at: usize) -> Option<(u64, usize)> {
    let field = |n: usize| bytes.get(at + 1..at + 1 + n);
    let marker = *bytes.get(at)?;
    Some(match marker {
        0x00..=0x7f => (u64::from(marker), 1),
        0xcc => (u64::from(*field(1)?.first()?), 2),
        0xcd => (u64::from(u16::from_be_bytes(field(2)?.try_into().ok()?)), 3),
        0xce => (u64::from(u32::from_be_bytes(field(4)?.try_into().ok()?)), 5),
        0xcf => (u64::from_be_bytes(field(8)?.try_into().ok()?), 9),
        _ => return None,
    })
}

/// Reads a non-negative integer if one is next (`r` is left where it was otherwise).
pub(crate) fn read_uint(r: &mut Reader<'_>) -> Option<u64> {
    let (v, len) = uint_at(r.peek_rest(), 0)?;
    r.take(len)?;
    Some(v)
}

/// Reads an array header if one is next: its number of elements.
pub(crate) fn read_array_len(r: &mut Reader<'_>) -> Option<usize> {
    let mut probe = *r;
    let n = match probe.u8()? {
        m @ 0x90..=0x9f => usize::from(m & 0x0f),
        0xdc => usize::from(probe.u16_be()?),
        0xdd => probe.u32_be()? as usize,
        _ => return None,
    };
    *r = probe;
    Some(n)
}

/// Reads a map header if one is next: its number of entries.
pub(crate) fn read_map_len(r: &mut Reader<'_>) -> Option<usize> {
    let mut probe = *r;
    let n = match probe.u8()? {
        m @ 0x80..=0x8f => usize::from(m & 0x0f),
        0xde => usize::from(probe.u16_be()?),
        0xdf => probe.u32_be()? as usize,
        _ => return None,
    };
    *r = probe;
    Some(n)
}

/// Takes `n` elements from the budget.
fn spend(budget: &mut usize, n: usize) -> Result<(), MsgpackError> {
    *budget = budget.checked_sub(n).ok_or(MsgpackError::TooManyElements)?;
    Ok(())
}

fn value<'a>(
    r: &mut Reader<'a>,
    input: &'a [u8],
    depth: usize,
    budget: &mut usize,
) -> Result<Value<'a>, MsgpackError> {
    use MsgpackError::Truncated as T;
    if depth > MAX_DEPTH {
        return Err(MsgpackError::TooDeep);
    }
    spend(budget, 1)?;
    let marker = r.u8().ok_or(T)?;
    let bytes = |r: &mut Reader<'a>, n: usize| r.take(n).ok_or(T);
    let v = match marker {
        0x00..=0x7f => Value::UInt(u64::from(marker)),
        0x80..=0x8f => map(r, input, usize::from(marker & 0x0f), depth, budget)?,
        0x90..=0x9f => array(r, input, usize::from(marker & 0x0f), depth, budget)?,
        0xa0..=0xbf => Value::Str(bytes(r, usize::from(marker & 0x1f))?),
        0xc0 => Value::Nil,
        0xc1 => return Err(MsgpackError::Reserved),
        0xc2 => Value::Bool(false),
        0xc3 => Value::Bool(true),
        0xc4 => {
            let n = usize::from(r.u8().ok_or(T)?);
            Value::Bin(bytes(r, n)?)
        }
        0xc5 => {
            let n = usize::from(r.u16_be().ok_or(T)?);
            Value::Bin(bytes(r, n)?)
        }
        0xc6 => {
            let n = r.u32_be().ok_or(T)? as usize;
            Value::Bin(bytes(r, n)?)
        }
        0xc7..=0xc9 => {
            let n = match marker {
                0xc7 => usize::from(r.u8().ok_or(T)?),
                0xc8 => usize::from(r.u16_be().ok_or(T)?),
                _ => r.u32_be().ok_or(T)? as usize,
            };
            bytes(r, n.checked_add(1).ok_or(T)?)?;
            Value::Ext
        }
        0xca => Value::Float(f64::from(f32::from_bits(r.u32_be().ok_or(T)?))),
        0xcb => Value::Float(f64::from_bits(r.u64_be().ok_or(T)?)),
        0xcc => Value::UInt(u64::from(r.u8().ok_or(T)?)),
        0xcd => Value::UInt(u64::from(r.u16_be().ok_or(T)?)),
        0xce => Value::UInt(u64::from(r.u32_be().ok_or(T)?)),
        0xcf => Value::UInt(r.u64_be().ok_or(T)?),
        0xd0 => int(i64::from(r.u8().ok_or(T)? as i8)),
        0xd1 => int(i64::from(r.u16_be().ok_or(T)? as i16)),
        0xd2 => int(i64::from(r.u32_be().ok_or(T)? as i32)),
        0xd3 => int(r.u64_be().ok_or(T)? as i64),
        0xd4..=0xd8 => {
            let n = 1usize << (marker - 0xd4);
            bytes(r, n + 1)?;
            Value::Ext
        }
        0xd9 => {
            let n = usize::from(r.u8().ok_or(T)?);
            Value::Str(bytes(r, n)?)
        }
        0xda => {
            let n = usize::from(r.u16_be().ok_or(T)?);
            Value::Str(bytes(r, n)?)
        }
        0xdb => {
            let n = r.u32_be().ok_or(T)? as usize;
            Value::Str(bytes(r, n)?)
        }
        0xdc => {
            let n = usize::from(r.u16_be().ok_or(T)?);
            array(r, input, n, depth, budget)?
        }
        0xdd => {
            let n = r.u32_be().ok_or(T)? as usize;
            array(r, input, n, depth, budget)?
        }
        0xde => {
            let n = usize::from(r.u16_be().ok_or(T)?);
            map(r, input, n, depth, budget)?
        }
        0xdf => {
            let n = r.u32_be().ok_or(T)? as usize;
            map(r, input, n, depth, budget)?
        }
        0xe0..=0xff => int(i64::from(marker as i8)),
    };
    Ok(v)
}

fn int<'a>(i: i64) -> Value<'a> {
    if i >= 0 {
        Value::UInt(i as u64)
    } else {
        Value::NegInt(i)
    }
}

fn array<'a>(
    r: &mut Reader<'a>,
    input: &'a [u8],
    n: usize,
    depth: usize,
    budget: &mut usize,
) -> Result<Value<'a>, MsgpackError> {
    if n > *budget {
        // Each element costs at least one: this array cannot fit, whatever it holds.
        return Err(MsgpackError::TooManyElements);
    }
    if n > 0 {
        let mut probe = Reader::new(input);
        probe.take(r.position());
        if let Some(ints) = uints(&mut probe, n) {
            *r = probe;
            spend(budget, n)?;
            return Ok(Value::UInts(ints));
        }
    }
    let mut out = Vec::with_capacity(n.min(INITIAL_CAPACITY));
    for _ in 0..n {
        out.push(value(r, input, depth + 1, budget)?);
    }
    Ok(Value::Array(out))
}

/// Reads `n` non-negative integers, or `None` at the first element that is not one
/// (the caller then parses the array generically from its start).
fn uints(r: &mut Reader<'_>, n: usize) -> Option<Vec<u64>> {
    let mut out = Vec::with_capacity(n.min(INITIAL_UINTS));
    for _ in 0..n {
        out.push(read_uint(r)?);
    }
    Some(out)
}

fn map<'a>(
    r: &mut Reader<'a>,
    input: &'a [u8],
    n: usize,
    depth: usize,
    budget: &mut usize,
) -> Result<Value<'a>, MsgpackError> {
    if n > *budget / 2 {
        return Err(MsgpackError::TooManyElements);
    }
    let mut out = Vec::with_capacity(n.min(INITIAL_CAPACITY));
    for _ in 0..n {
        let k = value(r, input, depth + 1, budget)?;
        let v = value(r, input, depth + 1, budget)?;
        out.push((k, v));
    }
    Ok(Value::Map(out))
}

/// A container longer than msgpack can declare (2^32 - 1 elements).
#[derive(Debug, thiserror::Error)]
#[error("{0} elements do not fit a msgpack length")]
pub(crate) struct TooLong(pub(crate) usize);

/// Writes msgpack the way `rmp` does (the smallest form of every integer, length and
/// string header), for encoders that write their schema directly.
pub(crate) mod put {
    use super::TooLong;

    pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 0x80 {
            out.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub(crate) fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    /// A string of fewer than 2^32 bytes (the schema's names and tiers).
    pub(crate) fn str(out: &mut Vec<u8>, s: &str) {
        let n = s.len();
        if n < 32 {
            out.push(0xa0 | n as u8);
        } else if n <= usize::from(u8::MAX) {
            out.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        out.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn array_len(out: &mut Vec<u8>, n: usize) -> Result<(), TooLong> {
        array_header(out, u32::try_from(n).map_err(|_| TooLong(n))?);
        Ok(())
    }

    /// The header of an array of `n` elements.
    pub(crate) fn array_header(out: &mut Vec<u8>, n: u32) {
        if n < 16 {
            out.push(0x90 | n as u8);
        } else if let Ok(n) = u16::try_from(n) {
            out.push(0xdc);
            out.extend_from_slice(&n.to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }

    /// The header of a map of fewer than 16 entries (a fixmap: every map our
    /// encoders write by hand is one).
    #[cfg_attr(not(feature = "tunnel"), allow(dead_code))]
    pub(crate) fn fixmap(out: &mut Vec<u8>, n: u8) {
        out.push(0x80 | (n & 0x0f));
    }

    #[cfg_attr(not(feature = "tunnel"), allow(dead_code))]
    pub(crate) fn bool(out: &mut Vec<u8>, v: bool) {
        out.push(if v { 0xc3 } else { 0xc2 });
    }

    /// Bytes of fewer than 2^32.
    pub(crate) fn bin(out: &mut Vec<u8>, b: &[u8]) {
        let n = b.len();
        if let Ok(n) = u8::try_from(n) {
            out.extend_from_slice(&[0xc4, n]);
        } else if let Ok(n) = u16::try_from(n) {
            out.push(0xc5);
            out.extend_from_slice(&n.to_be_bytes());
        } else {
            out.push(0xc6);
            out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
        }
        out.extend_from_slice(b);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn put_writes_what_rmp_writes() {
        for v in [
            0,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
            1 << 32,
            u64::MAX,
        ] {
            let mut ours = Vec::new();
            super::put::uint(&mut ours, v);
            assert_eq!(ours, rmp_serde::to_vec(&v).unwrap(), "{v}");
        }
        for n in [0usize, 15, 16, 31, 32, 255, 256, 65_535, 65_536] {
            let s = "x".repeat(n);
            let mut ours = Vec::new();
            super::put::str(&mut ours, &s);
            assert_eq!(ours, rmp_serde::to_vec(&s).unwrap(), "str {n}");
            // rmp's header of n zeros (one byte each); a map's differs in its markers.
            let zeros = rmp_serde::to_vec(&vec![0u8; n]).unwrap();
            let array = zeros.get(..zeros.len() - n).unwrap().to_vec();
            let mut ours = Vec::new();
            super::put::array_len(&mut ours, n).unwrap();
            assert_eq!(ours, array, "array {n}");
            let bytes = vec![7u8; n];
            let mut ours = Vec::new();
            super::put::bin(&mut ours, &bytes);
            assert_eq!(
                ours,
                rmp_serde::to_vec(&serde_bytes_of(&bytes)).unwrap(),
                "bin {n}"
            );
        }
        for v in [false, true] {
            let mut ours = Vec::new();
            super::put::bool(&mut ours, v);
            assert_eq!(ours, rmp_serde::to_vec(&v).unwrap(), "{v}");
        }
        for n in [0u8, 1, 15] {
            let map: std::collections::BTreeMap<u8, u8> = (0..n).map(|k| (k, 0)).collect();
            let theirs = rmp_serde::to_vec(&map).unwrap();
            let mut ours = Vec::new();
            super::put::fixmap(&mut ours, n);
            assert_eq!(ours[..], theirs[..1], "fixmap {n}");
        }
    }

    /// `b` as msgpack bin (serde serializes `&[u8]` as an array without this).
    fn serde_bytes_of(b: &[u8]) -> impl serde::Serialize + '_ {
        struct Bin<'a>(&'a [u8]);
        impl serde::Serialize for Bin<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
        Bin(b)
    }

    #[test]
    fn shape_check_agrees_with_the_parser_and_refuses_forged_lengths() {
        let good: [&[u8]; 5] = [
            b"\x91\x84\xa9worker_id\x01\xa1a\xc0\xa1b\x92\x01\xcf\0\0\0\0\0\0\0\x02\xa1c\xc4\x01z",
            b"\x90",
            b"\xc0",
            b"\x93\xd4\x01\x02\xcb\0\0\0\0\0\0\0\0\xd9\x01a",
            b"\x81\xa0\x80",
        ];
        for g in good {
            assert_eq!(check_shape(g), Ok(()), "{g:02x?}");
            assert!(parse(g, 1000).is_ok(), "{g:02x?}");
        }
        let bad: [(&[u8], MsgpackError); 6] = [
            (b"\xdd\xff\xff\xff\xff", MsgpackError::Truncated),
            (b"\xdf\0\0\0\x02\x01\x01\x01", MsgpackError::Truncated),
            (b"\x91\xdc\x01\x00", MsgpackError::Truncated),
            (b"\xc1", MsgpackError::Reserved),
            (b"\x90\x90", MsgpackError::Trailing),
            (b"\xc6\xff\xff\xff\xff", MsgpackError::Truncated),
        ];
        for (b, want) in bad {
            assert_eq!(check_shape(b), Err(want), "{b:02x?}");
        }
        let deep = [vec![0x91u8; MAX_DEPTH], vec![0xc0]].concat();
        assert_eq!(check_shape(&deep), Ok(()));
        let deeper = [vec![0x91u8; MAX_DEPTH + 1], vec![0xc0]].concat();
        assert_eq!(check_shape(&deeper), Err(MsgpackError::TooDeep));
    }

    use super::*;

    #[test]
    fn forged_lengths_and_depth() {
        assert_eq!(
            parse_all(b"\xdd\xff\xff\xff\xff"),
            Err(MsgpackError::Truncated)
        );
        assert_eq!(
            parse_all(b"\xdf\xff\xff\xff\xff\x01"),
            Err(MsgpackError::Truncated)
        );
        assert_eq!(
            parse_all(b"\xc6\xff\xff\xff\xff"),
            Err(MsgpackError::Truncated)
        );
        let deep = vec![0x91u8; 100];
        assert_eq!(parse_all(&deep), Err(MsgpackError::TooDeep));
        assert_eq!(parse_all(b"\xc1"), Err(MsgpackError::Reserved));
        assert_eq!(parse_all(b"\x01\x02"), Err(MsgpackError::Trailing));
    }

    fn parse_all(input: &[u8]) -> Result<Value<'_>, MsgpackError> {
        parse(input, usize::MAX)
    }

    #[test]
    fn element_budget_bounds_what_a_payload_declares() {
        // 8 M nils in an 8 MiB payload: refused at the array header.
        let mut nils = vec![0xdd, 0x00, 0x80, 0x00, 0x00];
        nils.resize(5 + (8 << 20), 0xc0);
        assert_eq!(parse(&nils, 1 << 20), Err(MsgpackError::TooManyElements));
        // The same spread over many small arrays runs out as they decode.
        let mut many = vec![0xdd, 0x00, 0x01, 0x00, 0x00];
        for _ in 0..(1 << 16) {
            many.extend_from_slice(&[0x9f; 1]);
            many.extend_from_slice(&[0xc0; 15]);
        }
        assert_eq!(parse(&many, 1 << 20), Err(MsgpackError::TooManyElements));
        assert!(parse(&many, 1 << 21).is_ok());
        // Integer arrays are charged per element too.
        let ints = [0x93, 1, 2, 3];
        assert_eq!(parse(&ints, 3), Err(MsgpackError::TooManyElements));
        assert!(parse(&ints, 4).is_ok());
    }

    #[test]
    fn integers() {
        assert_eq!(
            parse_all(b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"),
            Ok(Value::UInt(u64::MAX))
        );
        assert_eq!(
            parse_all(b"\xd3\xff\xff\xff\xff\xff\xff\xff\xfe"),
            Ok(Value::NegInt(-2))
        );
        assert_eq!(parse_all(b"\xff"), Ok(Value::NegInt(-1)));
        assert_eq!(parse_all(b"\xd0\x05"), Ok(Value::UInt(5)));
    }
}
