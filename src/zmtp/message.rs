//! Multipart messages.

use std::fmt;
use std::hash::{Hash, Hasher};

use bytes::Bytes;
use smallvec::SmallVec;

/// A multipart ZMQ message: an ordered list of frames.
///
/// A received message holds one [`Bytes`] handle on the read buffer its frames
/// arrived in, plus each frame's place in it, so receiving costs one reference count,
/// not one per frame. A message built with [`from_parts`](Self::from_parts) or
/// [`push`](Self::push) holds each frame's own handle; up to three live inline (the
/// `[topic, sequence, payload]` layouts of the event plane). Either way frames read as
/// byte slices ([`get`](Self::get), [`parts`](Self::parts)), and
/// [`part`](Self::part) or [`into_parts`](Self::into_parts) hand out zero-copy
/// `Bytes` handles.
///
/// ```
/// use bytes::Bytes;
/// use eventplane::zmtp::Message;
///
/// let msg = Message::from_parts([Bytes::from_static(b"kv"), Bytes::from_static(b"payload")]);
/// assert_eq!(msg.len(), 2);
/// assert_eq!(msg.get(0), Some(&b"kv"[..]));
/// assert_eq!(msg.byte_len(), 9);
/// ```
#[derive(Clone, Default)]
pub struct Message {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    /// Each frame its own handle.
    Parts(SmallVec<[Bytes; 3]>),
    /// Frames that arrived together: one handle on the bytes holding them all (frame
    /// headers included) and each frame's `(offset, length)` in it.
    Spans {
        backing: Bytes,
        spans: SmallVec<[(u32, u32); 4]>,
    },
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Parts(SmallVec::new())
    }
}

/// The frames of a [`Message`] as byte slices, from [`Message::parts`].
///
/// ```
/// use eventplane::zmtp::Message;
/// let msg = Message::from_parts(["a", "bc"]);
/// let lens: Vec<usize> = msg.parts().map(<[u8]>::len).collect();
/// assert_eq!(lens, [1, 2]);
/// assert_eq!(msg.parts().len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct Parts<'a> {
    inner: PartsInner<'a>,
}

#[derive(Debug, Clone)]
enum PartsInner<'a> {
    Own(std::slice::Iter<'a, Bytes>),
    Spans {
        backing: &'a [u8],
        spans: std::slice::Iter<'a, (u32, u32)>,
    },
}

fn span(backing: &[u8], (start, len): (u32, u32)) -> &[u8] {
    let start = start as usize;
    backing.get(start..start + len as usize).unwrap_or_default()
}

impl<'a> Iterator for Parts<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match &mut self.inner {
            PartsInner::Own(parts) => parts.next().map(|p| &p[..]),
            PartsInner::Spans { backing, spans } => spans.next().map(|&s| span(backing, s)),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.inner {
            PartsInner::Own(parts) => parts.len(),
            PartsInner::Spans { spans, .. } => spans.len(),
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Parts<'_> {}

impl DoubleEndedIterator for Parts<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match &mut self.inner {
            PartsInner::Own(parts) => parts.next_back().map(|p| &p[..]),
            PartsInner::Spans { backing, spans } => spans.next_back().map(|&s| span(backing, s)),
        }
    }
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
            repr: Repr::Parts(parts.into_iter().map(Into::into).collect()),
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
        let mut parts = self.take_parts();
        parts.push(part.into());
        self.repr = Repr::Parts(parts);
    }

    /// The frames as byte slices, in order.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let msg = Message::from_parts(["kv", "x"]);
    /// assert!(msg.parts().eq([&b"kv"[..], &b"x"[..]]));
    /// ```
    pub fn parts(&self) -> Parts<'_> {
        let inner = match &self.repr {
            Repr::Parts(parts) => PartsInner::Own(parts.iter()),
            Repr::Spans { backing, spans } => PartsInner::Spans {
                backing,
                spans: spans.iter(),
            },
        };
        Parts { inner }
    }

    /// Frame `index`, if present.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let msg = Message::from_parts(["a", "b"]);
    /// assert_eq!(msg.get(1), Some(&b"b"[..]));
    /// assert!(msg.get(2).is_none());
    /// ```
    pub fn get(&self, index: usize) -> Option<&[u8]> {
        match &self.repr {
            Repr::Parts(parts) => parts.get(index).map(|p| &p[..]),
            Repr::Spans { backing, spans } => spans.get(index).map(|&s| span(backing, s)),
        }
    }

    /// Frame `index` as its own zero-copy handle, if present.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let msg = Message::from_parts(["a", "b"]);
    /// assert_eq!(msg.part(1).as_deref(), Some(&b"b"[..]));
    /// ```
    pub fn part(&self, index: usize) -> Option<bytes::Bytes> {
        match &self.repr {
            Repr::Parts(parts) => parts.get(index).cloned(),
            Repr::Spans { spans, .. } => {
                let &(_, len) = spans.get(index)?;
                self.slice_of(index, 0, len as usize)
            }
        }
    }

    /// Bytes `start..end` of frame `index` as their own handle (one reference count),
    /// if the frame holds them.
    pub(crate) fn slice_of(&self, index: usize, start: usize, end: usize) -> Option<Bytes> {
        let (holder, offset, len) = match &self.repr {
            Repr::Parts(parts) => {
                let part = parts.get(index)?;
                (part, 0, part.len())
            }
            Repr::Spans { backing, spans } => {
                let &(offset, len) = spans.get(index)?;
                (backing, offset as usize, len as usize)
            }
        };
        if start > end || end > len {
            return None;
        }
        let end = offset.checked_add(end)?;
        (end <= holder.len()).then(|| holder.slice(offset + start..end))
    }

    /// Number of frames.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Parts(parts) => parts.len(),
            Repr::Spans { spans, .. } => spans.len(),
        }
    }

    /// `true` when the message has no frames.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sum of the frames' sizes.
    pub fn byte_len(&self) -> usize {
        match &self.repr {
            Repr::Parts(parts) => parts.iter().map(Bytes::len).sum(),
            Repr::Spans { spans, .. } => spans.iter().map(|&(_, len)| len as usize).sum(),
        }
    }

    /// The frames, by value.
    ///
    /// ```
    /// use eventplane::zmtp::Message;
    /// let parts: Vec<_> = Message::from_parts(["a", "b"]).into_parts().collect();
    /// assert_eq!(parts.len(), 2);
    /// ```
    pub fn into_parts(mut self) -> impl ExactSizeIterator<Item = Bytes> {
        self.take_parts().into_iter()
    }

    pub(crate) fn from_smallvec(parts: SmallVec<[Bytes; 3]>) -> Self {
        Message {
            repr: Repr::Parts(parts),
        }
    }

    /// A message whose frames lie in `backing` at `spans` (`(offset, length)` each,
    /// within it: the decoder's contract).
    pub(crate) fn from_spans(backing: Bytes, spans: SmallVec<[(u32, u32); 4]>) -> Self {
        debug_assert!(
            spans
                .iter()
                .all(|&(start, len)| u64::from(start) + u64::from(len) <= backing.len() as u64),
            "a span outside its backing"
        );
        Message {
            repr: Repr::Spans { backing, spans },
        }
    }

    /// The frames as their own handles, leaving the message empty.
    fn take_parts(&mut self) -> SmallVec<[Bytes; 3]> {
        match std::mem::take(&mut self.repr) {
            Repr::Parts(parts) => parts,
            spans => {
                let spanned = Message { repr: spans };
                (0..spanned.len()).filter_map(|i| spanned.part(i)).collect()
            }
        }
    }

    /// Copies every frame of at most `max_frame` bytes into one allocation of their
    /// combined size, so the message no longer keeps the buffers it was sliced from
    /// alive. Larger frames, which own their allocation, are left as they are.
    /// Returns `false` when the message referenced nothing to let go of.
    pub(crate) fn compact(&mut self, max_frame: usize) -> bool {
        if let Repr::Spans { backing, spans } = &self.repr {
            if spans.iter().all(|&(_, len)| len as usize <= max_frame) {
                let total = self.byte_len();
                if total == 0 {
                    // Empty frames need no bytes at all.
                    let released = !backing.is_empty();
                    self.repr = Repr::Parts(spans.iter().map(|_| Bytes::new()).collect());
                    return released;
                }
                let mut buf = bytes::BytesMut::with_capacity(total);
                let mut fresh = SmallVec::with_capacity(spans.len());
                for &(start, len) in spans {
                    let start = start as usize;
                    fresh.push((buf.len() as u32, len));
                    buf.extend_from_slice(
                        backing.get(start..start + len as usize).unwrap_or_default(),
                    );
                }
                self.repr = Repr::Spans {
                    backing: buf.freeze(),
                    spans: fresh,
                };
                return true;
            }
        }
        let mut parts = self.take_parts();
        let small = |p: &Bytes| !p.is_empty() && p.len() <= max_frame;
        let total: usize = parts.iter().filter(|p| small(p)).map(Bytes::len).sum();
        if total > 0 {
            let mut buf = bytes::BytesMut::with_capacity(total);
            for part in parts.iter().filter(|p| small(p)) {
                buf.extend_from_slice(part);
            }
            let mut all = buf.freeze();
            for part in parts.iter_mut().filter(|p| small(p)) {
                *part = all.split_to(part.len());
            }
        }
        self.repr = Repr::Parts(parts);
        total > 0
    }
}

impl PartialEq for Message {
    fn eq(&self, other: &Message) -> bool {
        self.len() == other.len() && self.parts().eq(other.parts())
    }
}

impl Eq for Message {}

impl Hash for Message {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_usize(self.len());
        for part in self.parts() {
            part.hash(state);
        }
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Frame<'a>(&'a [u8]);
        impl fmt::Debug for Frame<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "b\"{}\"", self.0.escape_ascii())
            }
        }
        f.debug_struct("Message")
            .field("parts", &self.parts().map(Frame).collect::<Vec<_>>())
            .finish()
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
        assert!(msg.into_parts().next().is_some_and(|f| f.is_unique()));
        assert!(!Message::from_parts([big]).compact(100));
    }

    /// `[2-byte header][frame]…` as the decoder leaves it: frames at `spans`.
    fn spanned(frames: &[&[u8]]) -> (Message, Bytes) {
        let mut buf = bytes::BytesMut::new();
        let mut spans = SmallVec::new();
        for f in frames {
            buf.extend_from_slice(&[0, 0]);
            spans.push((buf.len() as u32, f.len() as u32));
            buf.extend_from_slice(f);
        }
        let backing = buf.freeze();
        (Message::from_spans(backing.clone(), spans), backing)
    }

    #[test]
    fn spans_read_like_parts() {
        let (msg, _) = spanned(&[b"kv", b"", b"payload"]);
        let parts = Message::from_parts(["kv", "", "payload"]);
        assert_eq!(msg, parts);
        assert_eq!((msg.len(), msg.byte_len()), (3, 9));
        assert_eq!(msg.get(2), Some(&b"payload"[..]));
        assert_eq!(msg.part(0).as_deref(), Some(&b"kv"[..]));
        assert!(msg.get(3).is_none() && msg.part(3).is_none());
        for m in [&msg, &parts] {
            assert_eq!(m.slice_of(2, 1, 4).as_deref(), Some(&b"ayl"[..]));
            assert_eq!(m.slice_of(2, 7, 7).as_deref(), Some(&b""[..]));
            assert!(m.slice_of(2, 2, 8).is_none() && m.slice_of(2, 3, 1).is_none());
            assert!(m.slice_of(3, 0, 0).is_none());
        }
        assert!(msg.parts().rev().eq(parts.parts().rev()));
        assert_eq!(format!("{msg:?}"), format!("{parts:?}"));
        let state = std::collections::hash_map::RandomState::new();
        assert_eq!(
            std::hash::BuildHasher::hash_one(&state, &msg),
            std::hash::BuildHasher::hash_one(&state, &parts)
        );
        let mut pushed = msg.clone();
        pushed.push("more");
        assert_eq!(pushed, Message::from_parts(["kv", "", "payload", "more"]));
        let owned: Vec<Bytes> = msg.into_parts().collect();
        assert_eq!(owned, [&b"kv"[..], b"", b"payload"]);
    }

    #[test]
    fn compacted_spans_let_the_read_buffer_go() {
        let (mut msg, backing) = spanned(&[b"kv", b"payload"]);
        assert!(!backing.is_unique());
        assert!(msg.compact(100));
        assert!(
            backing.is_unique(),
            "the message still pins the read buffer"
        );
        assert_eq!(msg, Message::from_parts(["kv", "payload"]));
        // A frame above the limit stays a slice of its own buffer; the small one moves.
        let big = vec![9u8; 200];
        let (mut mixed, backing) = spanned(&[b"kv", &big]);
        assert!(mixed.compact(100));
        assert_eq!(
            mixed,
            Message::from_parts([Bytes::from_static(b"kv"), Bytes::from(big)])
        );
        drop(mixed);
        assert!(backing.is_unique());
        // Only empty frames: compacting lets the buffer go too.
        let (mut empty, backing) = spanned(&[b"", b""]);
        assert!(empty.compact(100));
        assert!(backing.is_unique());
        assert_eq!(empty, Message::from_parts(["", ""]));
    }
}
