//! The msgpack pieces control frames are made of: a small writer (maps, arrays,
//! strings, unsigned integers) and typed, bounded access to a decoded frame's fields,
//! each failure naming frame and field.

use crate::msgpack::{Value, put};

/// Longest client id, namespace or target, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// A control frame that could not be decoded. The session that read it fails: the
/// peer does not speak this protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The declared body length exceeds the limit (nothing of it was buffered).
    #[error("control frame of {len} bytes exceeds the {max}-byte limit")]
    Oversized {
        /// The declared length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The body is not one bounded msgpack map.
    #[error("control frame is not a msgpack map we accept ({0})")]
    NotMsgpack(&'static str),
    /// A field is missing or has the wrong type.
    #[error("control frame {frame:?}: field {field:?} is missing or malformed")]
    Field {
        /// The frame type.
        frame: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field is present and typed right, but out of bounds.
    #[error("control frame {frame:?}: field {field:?} {reason}")]
    OutOfBounds {
        /// The frame type.
        frame: &'static str,
        /// The field.
        field: &'static str,
        /// What bound it breaks.
        reason: &'static str,
    },
}

/// Typed access to a frame's fields, each failure naming frame and field.
pub(crate) struct Fields<'v, 'a> {
    pub(crate) value: &'v Value<'a>,
}

impl<'v, 'a> Fields<'v, 'a> {
    pub(crate) fn get(
        &self,
        frame: &'static str,
        field: &'static str,
    ) -> Result<&'v Value<'a>, FrameError> {
        self.value
            .get(field)
            .ok_or(FrameError::Field { frame, field })
    }

    pub(crate) fn u64(&self, frame: &'static str, field: &'static str) -> Result<u64, FrameError> {
        self.get(frame, field)?
            .as_u64()
            .ok_or(FrameError::Field { frame, field })
    }

    pub(crate) fn u32(&self, frame: &'static str, field: &'static str) -> Result<u32, FrameError> {
        u32::try_from(self.u64(frame, field)?).map_err(|_| FrameError::OutOfBounds {
            frame,
            field,
            reason: "exceeds 2^32 - 1",
        })
    }

    pub(crate) fn str(
        &self,
        frame: &'static str,
        field: &'static str,
        max: usize,
    ) -> Result<&'a str, FrameError> {
        let s = self
            .get(frame, field)?
            .as_str()
            .ok_or(FrameError::Field { frame, field })?;
        if s.is_empty() || s.len() > max {
            return Err(FrameError::OutOfBounds {
                frame,
                field,
                reason: "is empty or too long",
            });
        }
        Ok(s)
    }

    pub(crate) fn name(
        &self,
        frame: &'static str,
        field: &'static str,
    ) -> Result<String, FrameError> {
        name_of(self.get(frame, field)?, frame, field)
    }

    pub(crate) fn array(
        &self,
        frame: &'static str,
        field: &'static str,
        max: usize,
    ) -> Result<Vec<&'v Value<'a>>, FrameError> {
        let out: Vec<&Value<'a>> = match self.get(frame, field)? {
            Value::Array(items) => items.iter().collect(),
            _ => return Err(FrameError::Field { frame, field }),
        };
        if out.len() > max {
            return Err(FrameError::OutOfBounds {
                frame,
                field,
                reason: "has too many elements",
            });
        }
        Ok(out)
    }

    /// An array of non-negative integers (the reader's compact form, or an empty
    /// array), at most `max` long.
    pub(crate) fn uints(
        &self,
        frame: &'static str,
        field: &'static str,
        max: usize,
    ) -> Result<Vec<u64>, FrameError> {
        let ints = match self.get(frame, field)? {
            Value::UInts(ints) => ints.clone(),
            Value::Array(items) if items.is_empty() => Vec::new(),
            _ => return Err(FrameError::Field { frame, field }),
        };
        if ints.len() > max {
            return Err(FrameError::OutOfBounds {
                frame,
                field,
                reason: "has too many elements",
            });
        }
        Ok(ints)
    }
}

pub(crate) fn name_of(
    value: &Value<'_>,
    frame: &'static str,
    field: &'static str,
) -> Result<String, FrameError> {
    let s = value.as_str().ok_or(FrameError::Field { frame, field })?;
    if s.is_empty() || s.len() > MAX_NAME_LEN {
        return Err(FrameError::OutOfBounds {
            frame,
            field,
            reason: "is empty or too long",
        });
    }
    Ok(s.to_owned())
}

/// The frames' msgpack writer (maps, strings, unsigned integers), over the crate's one
/// msgpack encoder.
pub(crate) struct Writer<'a>(pub(crate) &'a mut Vec<u8>);

impl Writer<'_> {
    pub(crate) fn map(&mut self, len: u8) {
        // Every frame has fewer than 16 fields.
        put::fixmap(self.0, len);
    }

    pub(crate) fn array(&mut self, len: usize) {
        put::array_header(self.0, u32::try_from(len).unwrap_or(u32::MAX));
    }

    pub(crate) fn str(&mut self, s: &str) {
        put::str(self.0, s);
    }

    pub(crate) fn uint(&mut self, v: u64) {
        put::uint(self.0, v);
    }

    pub(crate) fn bool(&mut self, v: bool) {
        put::bool(self.0, v);
    }

    pub(crate) fn entry_str(&mut self, key: &str, value: &str) {
        self.str(key);
        self.str(value);
    }

    pub(crate) fn entry_uint(&mut self, key: &str, value: u64) {
        self.str(key);
        self.uint(value);
    }
}
