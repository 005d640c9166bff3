//! The thin async layer shared by both sockets: moves bytes between a stream and a
//! [`Session`], and runs its timers on tokio's clock.
//!
//! What a connection holds, and its bounds:
//! - **Read buffer**: `read_chunk` bytes, reached from 1 KiB by doubling on every
//!   read that fills the buffer (a connection starts at 1 KiB, and starts over after
//!   giving its buffer back for being idle), reclaimed in place while no received
//!   frame references it; a frame larger than a chunk is assembled in an allocation
//!   grown geometrically as its bytes arrive, never larger than the frame. Buffers that frames still reference when the connection
//!   moves on are *retired* into a [`Retention`] account (subscribers) so what they
//!   keep alive is counted. A subscriber's connections give theirs back whenever the
//!   peer has nothing more to read, so an idle connection holds none.
//! - **Output**: a list of slices handed over whole ([`Conn::push_output`]: a
//!   publisher's shared chunks), then a write buffer for the session's own output and
//!   copies of small slices (of every slice, on streams without vectored writes),
//!   written together with one vectored write, in that order. Session output is moved out only while less
//!   than [`WRITE_BATCH`] waits; beyond, it stays in the session, where a PONG
//!   replaces the previous unsent one. While [`WRITE_BATCH`] or more waits to be
//!   written the connection stops reading the peer; if the peer reads none of it for
//!   `write_stall_timeout`, the connection fails with [`TimeoutKind::WriteStall`].

use std::collections::VecDeque;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

use super::queue::Piece;
use super::retain::Retention;
use super::{Config, Error, Event, Session, SocketType, TimeoutKind};

/// Writes are coalesced into buffers of about this size; a connection with this much
/// output waiting stops reading its peer.
pub(crate) const WRITE_BATCH: usize = 64 << 10;

/// The read buffer a connection starts with (a greeting is 64 bytes, READY with its
/// metadata usually a few hundred; more grows it), and starts again from after it
/// gave its buffer back for being idle: a trickle of small messages is read into
/// buffers of this size, and each read that fills one doubles the size of the next,
/// up to `read_chunk`.
const SMALL_READ: usize = 1 << 10;

/// Slices passed to one vectored write.
const MAX_IOV: usize = 64;

/// Output handed over in slices smaller than this is copied into the write buffer.
const SMALL_SLICE: usize = 512;

#[derive(Debug)]
pub(crate) struct Conn<S> {
    pub(crate) stream: S,
    pub(crate) session: Session,
    pub(crate) wbuf: BytesMut,
    /// Output handed over whole (see [`Conn::push_output`]), each slice with what it
    /// keeps alive; everything in it goes out before what `wbuf` holds. Empty on
    /// streams without vectored writes: there, handed-over output is copied into
    /// `wbuf`.
    out: VecDeque<(Bytes, usize)>,
    /// Bytes waiting in `out`.
    out_len: usize,
    /// What the slices in `out` keep alive.
    out_held: usize,
    /// The stream writes several slices in one call.
    vectored: bool,
    sleep: Pin<Box<Sleep>>,
    armed: Option<Instant>,
    read_chunk: usize,
    /// Size the current read buffer was allocated with.
    allocation: usize,
    /// Where retired read buffers go; `None` drops them (nothing the connection
    /// hands out outlives it).
    retention: Option<Arc<Retention>>,
    /// Since when output has waited without a byte being written.
    blocked_since: Option<Instant>,
    write_stall_timeout: Option<Duration>,
    /// The most the write buffer held since it was last empty (its allocation is at
    /// least that large).
    wbuf_high: usize,
    /// A liveness deadline passed and one read found nothing: declared on the next
    /// poll if the next read finds nothing either (a read can be refused by tokio's
    /// cooperative budget although bytes are waiting).
    silence_seen: bool,
    /// Set when a timer check asked to be polled again before declaring silence: a
    /// driver looping on progress must yield first (the next poll gets a fresh
    /// cooperative budget).
    yield_requested: bool,
    /// Size of the next read buffer once the handshake is done: [`SMALL_READ`] after
    /// the buffer was given back for idleness, doubled by each read that fills the
    /// buffer, at most `read_chunk`.
    read_size: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    pub(crate) fn new(
        stream: S,
        socket_type: SocketType,
        config: &Config,
        retention: Option<Arc<Retention>>,
    ) -> Self {
        let now = Instant::now();
        let vectored = stream.is_write_vectored();
        Conn {
            stream,
            session: Session::new(socket_type, config, now.into_std()),
            wbuf: BytesMut::new(),
            out: VecDeque::new(),
            out_len: 0,
            out_held: 0,
            vectored,
            sleep: Box::pin(tokio::time::sleep_until(now)),
            armed: None,
            read_chunk: config.read_chunk,
            allocation: 0,
            retention,
            blocked_since: None,
            write_stall_timeout: config.write_stall_timeout,
            wbuf_high: 0,
            silence_seen: false,
            yield_requested: false,
            read_size: SMALL_READ.min(config.read_chunk),
        }
    }

    /// Writes the session's output and everything queued. Ready once all of it is
    /// written and flushed.
    pub(crate) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        loop {
            if self.pending_output() - self.session.pending_output() < WRITE_BATCH {
                self.session.transmit_into(&mut self.wbuf);
            }
            let written = if self.out.is_empty() {
                if self.wbuf.is_empty() {
                    break;
                }
                self.wbuf_high = self.wbuf_high.max(self.wbuf.len());
                Pin::new(&mut self.stream).poll_write(cx, &self.wbuf)
            } else {
                // The listed slices, then the write buffer: everything in it was
                // produced after the last slice was listed.
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let listed = self.out.len().min(MAX_IOV);
                for (slot, (b, _)) in iov.iter_mut().zip(&self.out) {
                    *slot = IoSlice::new(b);
                }
                let mut count = listed;
                if listed < MAX_IOV && !self.wbuf.is_empty() {
                    if let Some(slot) = iov.get_mut(listed) {
                        *slot = IoSlice::new(&self.wbuf);
                        count += 1;
                    }
                }
                let slices = iov.get(..count).unwrap_or_default();
                Pin::new(&mut self.stream).poll_write_vectored(cx, slices)
            };
            match written {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(
                        std::io::Error::from(std::io::ErrorKind::WriteZero).into()
                    ));
                }
                Poll::Ready(Ok(n)) => {
                    self.advance_output(n);
                    self.blocked_since = None;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => {
                    if self.blocked_since.is_none() {
                        self.blocked_since = Some(Instant::now());
                        // Wake for the stall deadline even if the peer never reads.
                        if let Some(deadline) = self.stall_deadline() {
                            if self.arm(deadline, cx) {
                                cx.waker().wake_by_ref();
                            }
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
        self.blocked_since = None;
        if std::mem::take(&mut self.wbuf_high) > 2 * WRITE_BATCH {
            // A large message went out: give its copy back (`capacity()` no longer
            // shows the allocation once the buffer has advanced to its end).
            self.wbuf = BytesMut::new();
        }
        ready!(Pin::new(&mut self.stream).poll_flush(cx))?;
        Poll::Ready(Ok(()))
    }

    /// Drops the first `n` bytes written: listed slices first, then the write buffer.
    fn advance_output(&mut self, mut n: usize) {
        while n > 0 {
            let Some((front, held)) = self.out.front_mut() else {
                break;
            };
            if n < front.len() {
                front.advance(n);
                self.out_len -= n;
                return;
            }
            n -= front.len();
            self.out_len -= front.len();
            self.out_held -= *held;
            self.out.pop_front();
        }
        if self.out.is_empty() && self.out.capacity() > MAX_IOV {
            self.out = VecDeque::new();
        }
        self.wbuf.advance(n.min(self.wbuf.len()));
    }

    /// [`poll_flush`](Self::poll_flush) with the timers run first, for callers that
    /// wait only for their output to go out (a subscribe): a peer that reads nothing
    /// fails it after `write_stall_timeout` instead of holding it forever.
    pub(crate) fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if let Err(e) = self.poll_timers(cx) {
            return Poll::Ready(Err(e));
        }
        self.poll_flush(cx)
    }

    /// Reads once into the session. `Ok(n)` with n > 0, or an error (`Closed` at EOF).
    pub(crate) fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, Error>> {
        self.prepare_read_buffer();
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.stream),
            cx,
            self.session.input_buffer()
        ))?;
        if n == 0 {
            return Poll::Ready(Err(Error::Closed));
        }
        let ready = self.session.is_ready();
        let buf = self.session.input_buffer();
        if ready && self.read_size < self.read_chunk && buf.len() == buf.capacity() {
            // More is coming than this buffer holds: the next one is twice as large.
            self.read_size = self.read_size.saturating_mul(2).min(self.read_chunk);
        }
        self.silence_seen = false;
        self.session.handle_input(Instant::now().into_std());
        Poll::Ready(Ok(n))
    }

    /// Makes room for the next read without letting received frames pin more than
    /// they must:
    /// - the current buffer is read into while it has room for what decoding needs
    ///   (or an eighth of a chunk);
    /// - otherwise, when no frame references it any more, its space is reclaimed in
    ///   place (the common case: the consumer keeps up);
    /// - otherwise a new buffer is allocated, a chunk, or for a frame larger than a
    ///   chunk up to twice the bytes already received of it (never past its end), and
    ///   the unconsumed bytes move over. Frames of an incomplete message are copied
    ///   out first, so they never pin the old buffer. A chunk that delivered frames
    ///   still reference is retired into the retention account; an allocation grown
    ///   for one large frame belongs to that frame (its holder is charged its size).
    fn prepare_read_buffer(&mut self) {
        // Until the handshake is done the peer sends a greeting and a few commands,
        // and a connection that was idle most likely brings one small message:
        // thousands of connections must not each touch a chunk for that.
        let chunk = if self.session.is_ready() {
            self.read_size
        } else {
            self.small_read()
        };
        let needed = self.session.input_needed();
        let buf = self.session.input_buffer();
        let len = buf.len();
        let frame_end = len.saturating_add(needed);
        let target = if frame_end <= chunk {
            chunk
        } else {
            frame_end.min(len.saturating_mul(2).max(chunk))
        };
        let spare = buf.capacity() - len;
        // An allocation grown for one large frame is never reused for small frames
        // (they would share it, pinning it whole, while it is not counted as a shared
        // chunk), nor kept far larger than what decoding needs.
        let oversized = (self.allocation > chunk && frame_end <= chunk)
            || self.allocation > frame_end.max(chunk).saturating_mul(2);
        if spare >= needed.min(chunk / 8).max(1) && !oversized {
            return;
        }
        if !oversized && target <= self.allocation && buf.try_reclaim(target - len) {
            return;
        }
        self.session.compact_partial_message(chunk);
        let buf = self.session.input_buffer();
        let size = target.max(len + 1);
        let reused = match &self.retention {
            Some(retention) if size == self.read_chunk => retention.reuse(size),
            _ => None,
        };
        let mut fresh = reused.unwrap_or_else(|| BytesMut::with_capacity(size));
        fresh.extend_from_slice(buf);
        let old = std::mem::replace(buf, fresh);
        let old_allocation = std::mem::replace(&mut self.allocation, size);
        if let Some(retention) = &self.retention {
            retention.replace_read_buffer(old, old_allocation, size, chunk);
        }
    }

    /// Gives the read buffer back between reads: the undecoded bytes (at most an
    /// eighth of a chunk, or nothing is done) move to an allocation of their own
    /// size and the chunk is retired, freed at once unless delivered frames still
    /// reference it. The next read allocates a fresh buffer of [`SMALL_READ`]. A
    /// subscriber's connections call this whenever their peer has nothing more to
    /// read, other sockets after every receive while their account holds more read
    /// buffers than its limit, so thousands of connections cost what the few being
    /// read at once hold, not a chunk each. A buffer grown for one large frame is
    /// kept (that frame is what it is for).
    pub(crate) fn release_read_buffer(&mut self) {
        let chunk = self.read_chunk;
        if self.allocation == 0 || self.allocation > chunk {
            return;
        }
        if self.session.input_buffer().len() > chunk / 8 {
            return;
        }
        self.session.compact_partial_message(chunk);
        let buf = self.session.input_buffer();
        let rest = buf.len();
        let kept = if rest == 0 {
            BytesMut::new()
        } else {
            BytesMut::from(&buf[..])
        };
        let old = std::mem::replace(buf, kept);
        let old_allocation = std::mem::replace(&mut self.allocation, rest);
        self.read_size = self.small_read();
        if let Some(retention) = &self.retention {
            retention.replace_read_buffer(old, old_allocation, rest, chunk);
        }
    }

    /// When output has waited this long without a byte written, the peer is stalled.
    fn stall_deadline(&self) -> Option<Instant> {
        let since = self.blocked_since?;
        since.checked_add(self.write_stall_timeout?)
    }

    /// Runs due session timers and the write-stall deadline, and arms the sleep for
    /// the next one. Before a heartbeat or TTL expiry is declared, whatever the
    /// transport already holds is read: a socket that was not polled for a while
    /// must not blame the peer for its own delay.
    pub(crate) fn poll_timers(&mut self, cx: &mut Context<'_>) -> Result<(), Error> {
        for _ in 0..8 {
            let session = self.session.poll_timeout().map(Instant::from_std);
            let stall = self.stall_deadline();
            let Some(deadline) = [session, stall].into_iter().flatten().min() else {
                return Ok(());
            };
            let now = Instant::now();
            if deadline <= now {
                if stall.is_some_and(|d| d <= now) {
                    // Try once more: the peer may have read while we were not polled.
                    if let Poll::Ready(Err(e)) = self.poll_flush(cx) {
                        return Err(e);
                    }
                    if self.stall_deadline().is_some_and(|d| d <= now) {
                        return Err(Error::Timeout(TimeoutKind::WriteStall));
                    }
                    continue;
                }
                if self.session.peer_silent(now.into_std()) {
                    match self.poll_read(cx) {
                        Poll::Ready(Ok(_)) => continue,
                        Poll::Ready(Err(e)) => return Err(e),
                        Poll::Pending if !self.silence_seen => {
                            // Nothing read: look once more on the next poll before
                            // blaming the peer.
                            self.silence_seen = true;
                            self.yield_requested = true;
                            cx.waker().wake_by_ref();
                            return Ok(());
                        }
                        Poll::Pending => {}
                    }
                }
                self.session.handle_timeout(now.into_std())?;
                continue;
            }
            if !self.arm(deadline, cx) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Makes sure the task wakes by `deadline`. Re-arms only when the deadline moved
    /// earlier; a sleep that fires early just re-arms (liveness deadlines move on every
    /// read). Returns `true` when the armed sleep has already fired.
    fn arm(&mut self, deadline: Instant, cx: &mut Context<'_>) -> bool {
        if self.armed.is_none_or(|armed| deadline < armed) {
            self.sleep.as_mut().reset(deadline);
            self.armed = Some(deadline);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.armed = None;
                true
            }
            Poll::Pending => false,
        }
    }

    /// Drives the handshake to completion.
    pub(crate) fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        loop {
            self.poll_timers(cx)?;
            let mut ready = false;
            while let Some(event) = self.session.poll_event()? {
                if let Event::Ready(_) = event {
                    ready = true;
                    break;
                }
            }
            // Our greeting, READY and subscriptions go out before we wait for input;
            // what would block is finished by later polls.
            if let Poll::Ready(Err(e)) = self.poll_flush(cx) {
                return Poll::Ready(Err(e));
            }
            if ready {
                return Poll::Ready(Ok(()));
            }
            if !self.may_read() {
                return Poll::Pending;
            }
            ready!(self.poll_read(cx))?;
        }
    }
}

impl<S> Conn<S> {
    /// Queues `bytes` for writing after everything queued so far. `held` is what the
    /// slice keeps alive (a publisher's shared chunk), counted by
    /// [`held_output`](Self::held_output) until the slice is written. Slices under
    /// [`SMALL_SLICE`], and all of them on a stream without vectored writes, are
    /// copied into the write buffer instead (a list entry would cost more than the
    /// copy, and pin its chunk).
    pub(crate) fn push_output(&mut self, bytes: Bytes, held: usize) {
        if bytes.len() < SMALL_SLICE || !self.vectored {
            self.wbuf.extend_from_slice(&bytes);
            return;
        }
        self.push_listed(bytes, held);
    }

    /// [`push_output`](Self::push_output) for a publisher's queued [`Piece`]: a
    /// copied piece goes into the write buffer without an allocation of its own when
    /// it would be copied there anyway.
    pub(crate) fn push_piece(&mut self, piece: Piece<'_>, held: usize) {
        match piece {
            Piece::Shared(bytes) => self.push_output(bytes, held),
            Piece::Copied(bytes) if bytes.len() < SMALL_SLICE || !self.vectored => {
                self.wbuf.extend_from_slice(bytes);
            }
            Piece::Copied(bytes) => self.push_listed(Bytes::copy_from_slice(bytes), held),
        }
    }

    /// Lists `bytes` after what the write buffer holds (which was produced first).
    fn push_listed(&mut self, bytes: Bytes, held: usize) {
        // What the write buffer holds was produced first: it goes first.
        if !self.wbuf.is_empty() {
            let staged = self.wbuf.split().freeze();
            let len = staged.len();
            self.out_len += len;
            self.out_held += len;
            self.out.push_back((staged, len));
        }
        self.out_len += bytes.len();
        self.out_held += held;
        self.out.push_back((bytes, held));
    }

    /// Bytes waiting to be written to the peer: the write buffer, the listed slices
    /// and the session's unsent control output.
    pub(crate) fn pending_output(&self) -> usize {
        self.wbuf.len() + self.out_len + self.session.pending_output()
    }

    /// What the connection's unwritten output keeps alive: the write buffer, the
    /// session's unsent control output, the list of slices handed over whole, and for
    /// each of them what it was handed over with ([`push_output`](Self::push_output)).
    pub(crate) fn held_output(&self) -> usize {
        self.wbuf.len()
            + self.out_held
            + self.out.capacity() * std::mem::size_of::<(Bytes, usize)>()
            + self.session.pending_output()
    }

    /// Whether the connection should read from the peer now: not while a full write
    /// batch waits for the peer to read (a peer that sends without reading cannot make
    /// us queue replies), nor while the session asks for its output to drain first.
    pub(crate) fn may_read(&self) -> bool {
        self.session.wants_input() && self.pending_output() < WRITE_BATCH
    }

    /// `true` once after a timer check asked the driver to yield before looping on.
    pub(crate) fn take_yield(&mut self) -> bool {
        std::mem::take(&mut self.yield_requested)
    }

    /// The first read buffer, and the one after an idle release: [`SMALL_READ`],
    /// never more than `read_chunk`.
    fn small_read(&self) -> usize {
        SMALL_READ.min(self.read_chunk)
    }

    /// Size of one socket read.
    pub(crate) fn read_chunk(&self) -> usize {
        self.read_chunk
    }

    /// Size the current read buffer was allocated with.
    pub(crate) fn read_buffer_allocation(&self) -> usize {
        self.allocation
    }
}

impl<S> Drop for Conn<S> {
    fn drop(&mut self) {
        // Frames handed out may outlive the connection: their buffer stays counted.
        if let Some(retention) = &self.retention {
            let buf = std::mem::take(self.session.input_buffer());
            retention.replace_read_buffer(buf, self.allocation, 0, self.read_chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::{Message, PubSocket, SubSocket};

    /// A publisher and a subscriber to everything, over an in-memory pipe.
    async fn subscribed(config: &Config) -> (PubSocket, SubSocket<tokio::io::DuplexStream>) {
        let publisher = PubSocket::new(config.clone());
        let (a, b) = tokio::io::duplex(1 << 20);
        publisher.accept_stream(a, "t");
        let mut sub = SubSocket::handshake(b, config.clone()).await.unwrap();
        sub.subscribe("").await.unwrap();
        publisher.wait_for_subscribers(1).await;
        (publisher, sub)
    }

    #[tokio::test]
    async fn a_copied_piece_is_written_in_order_and_holds_nothing_once_copied() {
        let config = Config::default();
        let (a, _b) = tokio::io::duplex(1 << 16);
        let mut conn = Conn::new(a, SocketType::Pub, &config, None);
        for vectored in [true, false] {
            conn.vectored = vectored;
            conn.push_piece(Piece::Shared(Bytes::from(vec![1u8; 600])), 7);
            conn.push_piece(Piece::Copied(&[2u8; 100]), 9);
            conn.push_piece(Piece::Copied(&[3u8; 600]), 11);
            let mut wire: Vec<u8> = conn.out.iter().flat_map(|(b, _)| b.to_vec()).collect();
            wire.extend_from_slice(&conn.wbuf);
            let mut expected = vec![1u8; 600];
            expected.extend([2u8; 100]);
            expected.extend([3u8; 600]);
            assert_eq!(wire, expected, "vectored {vectored}");
            // A small copy holds nothing beyond its bytes; a large one is listed with
            // what it was handed over with, like a shared slice.
            let listed_held: usize = conn.out.iter().map(|(_, h)| h).sum();
            let expected_held = if vectored { 7 + 100 + 11 } else { 0 };
            assert_eq!(listed_held, expected_held, "vectored {vectored}");
            conn.out.clear();
            conn.wbuf.clear();
            (conn.out_len, conn.out_held) = (0, 0);
        }
    }

    #[tokio::test]
    async fn read_buffer_shrinks_back_after_a_large_frame() {
        let config = Config::default();
        let (publisher, mut sub) = subscribed(&config).await;
        publisher.send(Message::from_parts([vec![1u8; 4 << 20]]));
        assert_eq!(sub.recv().await.unwrap().byte_len(), 4 << 20);
        for _ in 0..3 {
            for _ in 0..2000 {
                publisher.send(Message::from_parts([vec![2u8; 100]]));
            }
            for _ in 0..2000 {
                sub.recv().await.unwrap();
            }
        }
        let capacity = sub.input_capacity();
        assert!(capacity <= 2 * config.read_chunk, "{capacity}");
    }

    #[tokio::test]
    async fn a_buffer_grown_for_one_frame_never_becomes_a_shared_chunk() {
        // Frames between one and two chunks leave an allocation that would pass the
        // `2 ×` size check: it must still not be reclaimed for small frames.
        let config = Config::default();
        let (publisher, mut sub) = subscribed(&config).await;
        let big = config.read_chunk * 19 / 10;
        let mut kept = Vec::new();
        for _ in 0..20 {
            publisher.send(Message::from_parts([vec![1u8; big]]));
            assert_eq!(sub.recv().await.unwrap().byte_len(), big); // dropped
            for _ in 0..10 {
                publisher.send(Message::from_parts([vec![2u8; 100]]));
                kept.push(sub.recv().await.unwrap());
                let allocation = sub.input_capacity();
                assert!(allocation <= config.read_chunk, "{allocation}");
            }
        }
    }
}
