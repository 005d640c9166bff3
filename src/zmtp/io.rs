//! The thin async layer shared by both sockets: moves bytes between a stream and a
//! [`Session`], and runs its timers on tokio's clock.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};

use super::{Config, Error, Event, Session, SocketType};

/// Writes are coalesced into buffers of about this size.
pub(crate) const WRITE_BATCH: usize = 64 << 10;

/// A partial frame up to this size is moved into a fresh read buffer rather than
/// reclaiming the old allocation, so one large frame does not pin a large buffer for
/// the connection's lifetime.
const SMALL_LEFTOVER: usize = 4 << 10;

#[derive(Debug)]
pub(crate) struct Conn<S> {
    pub(crate) stream: S,
    pub(crate) session: Session,
    pub(crate) wbuf: BytesMut,
    sleep: Pin<Box<Sleep>>,
    armed: Option<Instant>,
    read_chunk: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    pub(crate) fn new(stream: S, socket_type: SocketType, config: &Config) -> Self {
        let now = Instant::now();
        Conn {
            stream,
            session: Session::new(socket_type, config, now.into_std()),
            wbuf: BytesMut::new(),
            sleep: Box::pin(tokio::time::sleep_until(now)),
            armed: None,
            read_chunk: config.read_chunk,
        }
    }

    /// Writes the session's output and anything already in `wbuf`. Ready once both
    /// are fully written and flushed.
    pub(crate) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.session.transmit_into(&mut self.wbuf);
        if self.wbuf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        while !self.wbuf.is_empty() {
            let n = ready!(Pin::new(&mut self.stream).poll_write(cx, &self.wbuf))?;
            if n == 0 {
                return Poll::Ready(Err(
                    std::io::Error::from(std::io::ErrorKind::WriteZero).into()
                ));
            }
            self.wbuf.advance(n);
        }
        ready!(Pin::new(&mut self.stream).poll_flush(cx))?;
        Poll::Ready(Ok(()))
    }

    /// Reads once into the session. `Ok(n)` with n > 0, or an error (`Closed` at EOF).
    pub(crate) fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<Result<usize, Error>> {
        let chunk = self.read_chunk;
        let buf = self.session.input_buffer();
        let spare_low = buf.capacity() - buf.len() < chunk / 8;
        let oversized = buf.capacity() > 4 * chunk;
        if buf.len() <= SMALL_LEFTOVER && (spare_low || oversized) {
            // Back to a `read_chunk` buffer: after large frames this releases the big
            // allocation instead of reading into its tail.
            let mut fresh = BytesMut::with_capacity(chunk);
            fresh.extend_from_slice(buf);
            *buf = fresh;
        } else if spare_low {
            // Assembling a large frame (already validated against the limits): grow
            // geometrically, as bytes actually arrive.
            buf.reserve(chunk.max(buf.len()));
        }
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.stream),
            cx,
            buf
        ))?;
        if n == 0 {
            return Poll::Ready(Err(Error::Closed));
        }
        self.session.handle_input(Instant::now().into_std());
        Poll::Ready(Ok(n))
    }

    /// Runs due session timers and arms the sleep for the next one.
    pub(crate) fn poll_timers(&mut self, cx: &mut Context<'_>) -> Result<(), Error> {
        for _ in 0..8 {
            let Some(deadline) = self.session.poll_timeout() else {
                return Ok(());
            };
            let deadline = Instant::from_std(deadline);
            let now = Instant::now();
            if deadline <= now {
                self.session.handle_timeout(now.into_std())?;
                continue;
            }
            // Re-arm only when the deadline moved earlier; a sleep that fires early just
            // re-arms (liveness deadlines move on every read).
            if self.armed.is_none_or(|armed| deadline < armed) {
                self.sleep.as_mut().reset(deadline);
                self.armed = Some(deadline);
            }
            match self.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => self.armed = None,
                Poll::Pending => return Ok(()),
            }
        }
        Ok(())
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
            ready!(self.poll_read(cx))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zmtp::{Message, PubSocket, SubSocket};

    #[tokio::test]
    async fn read_buffer_shrinks_back_after_a_large_frame() {
        let config = Config::default();
        let publisher = PubSocket::new(config.clone());
        let (a, b) = tokio::io::duplex(1 << 20);
        publisher.accept_stream(a, "t");
        let mut sub = SubSocket::handshake(b, config.clone()).await.unwrap();
        sub.subscribe("").await.unwrap();
        publisher.wait_for_subscribers(1).await;
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
}
