//! Multipart messages.

use bytes::Bytes;
use smallvec::SmallVec;

/// A multipart ZMQ message: an ordered list of frames, each a cheaply cloned [`Bytes`].
///
/// Up to three frames live inline (the `[topic, sequence, payload]` layouts of the event
/// plane), so cloning or building one allocates nothing beyond the frames themselves.
///
/// ```
/// use bytes::Bytes;
/// use eventplane::zmtp::Message;
///
/// let msg = Message::from_parts([Bytes::from_static(b"kv"), Bytes::from_static(b"payload")]);
/// assert_eq!(msg.len(), 2);
/// assert_eq!(msg.get(0).map(|f| &f[..]), Some(&b"kv"[..]));
/// assert_eq!(msg.byte_len(), 9);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Message {
    parts: SmallVec<[Bytes; 3]>,
}

impl Message {
    /// An empty message (no frames). Sending it sends nothing.
    pub fn new() -> Self {
        Message::default()
    }

    /// A message of the given frames, in order.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let msg = Message::from_parts(["kv-events", "payload"]);
    /// assert_eq!((msg.len(), msg.byte_len()), (2, 16));
    /// ```
    pub fn from_parts<I>(parts: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<Bytes>,
    {
        Message {
            parts: parts.into_iter().map(Into::into).collect(),
        }
    }

    /// Appends a frame.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let mut msg = Message::new();
    /// msg.push("topic");
    /// msg.push(vec![0u8; 8]);
    /// assert_eq!(msg.len(), 2);
    /// ```
    pub fn push(&mut self, part: impl Into<Bytes>) {
        self.parts.push(part.into());
    }

    /// The frames.
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// Frame `index`, if present.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let msg = Message::from_parts(["a", "b"]);
    /// assert_eq!(msg.get(1).map(|b| &b[..]), Some(&b"b"[..]));
    /// assert!(msg.get(2).is_none());
    /// ```
    pub fn get(&self, index: usize) -> Option<&Bytes> {
        self.parts.get(index)
    }

    /// Number of frames.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    /// `true` when the message has no frames.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Sum of the frames' sizes.
    pub fn byte_len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    /// The frames, by value.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let parts: Vec<_> = Message::from_parts(["a", "b"]).into_parts().collect();
    /// assert_eq!(parts.len(), 2);
    /// ```
    pub fn into_parts(self) -> impl ExactSizeIterator<Item = Bytes> {
        self.parts.into_iter()
    }

    pub(crate) fn from_smallvec(parts: SmallVec<[Bytes; 3]>) -> Self {
        Message { parts }
    }

    /// Copies every frame of at most `max_frame` bytes into one allocation of their
    /// combined size, so the message no longer keeps the buffers it was sliced from
    /// alive. Larger frames, which own their allocation, are left as they are.
    /// Returns `false` when there was nothing to copy.
    pub(crate) fn compact(&mut self, max_frame: usize) -> bool {
        let small = |p: &Bytes| !p.is_empty() && p.len() <= max_frame;
        let total: usize = self.parts.iter().filter(|p| small(p)).map(Bytes::len).sum();
        if total == 0 {
            return false;
        }
        let mut buf = bytes::BytesMut::with_capacity(total);
        for part in self.parts.iter().filter(|p| small(p)) {
            buf.extend_from_slice(part);
        }
        let mut all = buf.freeze();
        for part in self.parts.iter_mut().filter(|p| small(p)) {
            *part = all.split_to(part.len());
        }
        true
    }
}

impl From<Bytes> for Message {
    fn from(frame: Bytes) -> Self {
        Message::from_parts([frame])
    }
}

impl From<Vec<Bytes>> for Message {
    fn from(parts: Vec<Bytes>) -> Self {
        Message::from_parts(parts)
    }
}

impl FromIterator<Bytes> for Message {
    fn from_iter<T: IntoIterator<Item = Bytes>>(iter: T) -> Self {
        Message::from_parts(iter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_copies_small_frames_only() {
        let big = Bytes::from(vec![1u8; 1000]);
        let mut backing = bytes::BytesMut::from(&[2u8; 4096][..]);
        let small = backing.split_to(10).freeze();
        let mut msg = Message::from_parts([small.clone(), Bytes::new(), big.clone()]);
        assert!(msg.compact(100));
        assert_eq!(msg, Message::from_parts([small, Bytes::new(), big.clone()]));
        // The small frame no longer shares the 4 KiB backing buffer.
        drop(backing);
        assert!(msg.get(0).is_some_and(|f| f.is_unique()));
        assert!(!Message::from_parts([big]).compact(100));
    }
}
