//! The tasks of a `PubSocket`: accepting connections, and one task per subscriber
//! driving its session and writing its queue.

use super::fanout::{on_peer_event, remove_peer};
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::fanout::{Peer, Shared};
use crate::zmtp::io::{Conn, WRITE_BATCH};
use crate::zmtp::{Error, SocketType, TimeoutKind};

/// Runs handed to a connection per refill at most: each is a slice (or a few) of one
/// chunk, and a write takes up to 64 slices.
const TAKE_RUNS: usize = 64;

pub(super) async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    stop_accepting: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = stop_accepting.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, addr)) => {
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(%addr, error = %crate::net::ErrorChain(&e), "set_nodelay failed");
                }
                spawn_peer(
                    &tracker,
                    shared.clone(),
                    cancel.clone(),
                    stream,
                    addr.to_string(),
                );
            }
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(error = %crate::net::ErrorChain(&e), "accept failed");
                tokio::select! {
                    () = stop_accepting.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

/// Serves `stream` in a task of its own, or refuses it (dropping it, counted) when
/// `max_connections` are open. Returns whether it was accepted.
pub(super) fn spawn_peer<S>(
    tracker: &TaskTracker,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    stream: S,
    label: String,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let id = {
        let mut inner = shared.lock();
        if inner.open() >= shared.config.max_connections {
            inner.stats.refused += 1;
            let refused = inner.stats.refused;
            drop(inner);
            if let Some(suppressed) = shared.warn.check("refused", Instant::now()) {
                tracing::warn!(
                    peer = %label,
                    refused,
                    suppressed,
                    max_connections = shared.config.max_connections,
                    "connection limit reached: refusing subscriber"
                );
            }
            return false;
        }
        inner.stats.accepted += 1;
        let peer = Peer::new(label.clone());
        inner.peers.insert(peer)
    };
    let span = tracing::debug_span!("zmtp_pub_peer", peer = %label);
    let task = async move {
        let mut conn = Conn::new(stream, SocketType::Pub, &shared.config, None);
        let result = tokio::select! {
            () = cancel.cancelled() => Ok(()),
            r = poll_fn(|cx| drive_peer(&mut conn, &shared, id, cx)) => r,
        };
        let stalled = matches!(result, Err(Error::Timeout(TimeoutKind::WriteStall)));
        remove_peer(&shared, id, result.is_err(), stalled);
        match result {
            Ok(()) | Err(Error::Closed) => tracing::debug!("subscriber disconnected"),
            Err(e) if stalled => {
                if let Some(suppressed) = shared.warn.check("stalled", Instant::now()) {
                    tracing::warn!(error = %crate::net::ErrorChain(&e), suppressed, "closing a subscriber that reads nothing");
                }
            }
            Err(e) => {
                tracing::debug!(error = %crate::net::ErrorChain(&e), "subscriber connection failed")
            }
        }
    };
    tracker.spawn(tracing::Instrument::instrument(task, span));
    true
}

/// The per-subscriber task body: handshake, subscriptions, PINGs, and writing the
/// queue in batches.
pub(super) fn drive_peer<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<S>,
    shared: &Shared,
    id: usize,
    cx: &mut Context<'_>,
) -> Poll<Result<(), Error>> {
    // Yield after this many rounds of progress so one busy subscriber cannot hog a
    // worker thread.
    for _ in 0..64 {
        let mut progress = false;
        conn.poll_timers(cx)?;
        if conn.take_yield() {
            // A silence check wants a fresh poll (already woken) before it decides.
            return Poll::Pending;
        }
        while let Some(event) = conn.session.poll_event()? {
            progress = true;
            on_peer_event(shared, id, event);
        }
        if conn.session.is_ready() && conn.pending_output() < WRITE_BATCH {
            progress |= take_queued(shared, id, conn, cx);
        }
        let had_output = conn.pending_output() > 0;
        match conn.poll_flush(cx) {
            // A write that completes is progress: the next round takes more from the
            // queue, or marks the peer idle so `flush` waiters hear about it.
            Poll::Ready(Ok(())) => progress |= had_output,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        if conn.may_read() {
            match conn.poll_read(cx) {
                Poll::Ready(Ok(_)) => progress = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        if !progress {
            return Poll::Pending;
        }
    }
    cx.waker().wake_by_ref();
    Poll::Pending
}

/// Hands queued messages to the connection (as slices of the chunks they were
/// encoded into, written without a copy where the stream takes vectored writes), up
/// to a write batch. Registers the waker when the queue is empty, and reports
/// "drained" when nothing is left anywhere.
pub(super) fn take_queued<S>(
    shared: &Shared,
    id: usize,
    conn: &mut Conn<S>,
    cx: &mut Context<'_>,
) -> bool {
    // Read before the lock: the sender waits while the writer holds it.
    let session = conn.session.stats();
    let mut guard = shared.lock();
    let inner = &mut *guard;
    let Some(peer) = inner.peers.get_mut(id) else {
        return false;
    };
    let budget = WRITE_BATCH.saturating_sub(conn.pending_output());
    let taken = peer
        .queue
        .take(&mut inner.chunks, budget, TAKE_RUNS, |piece, held| {
            conn.push_piece(piece, held)
        });
    peer.written += taken.messages as u64;
    peer.session = session;
    // What the connection keeps alive beyond the queue, for `send`'s bound and the
    // stats. Refreshed whenever the writer refills (every round it can write); while
    // the peer reads nothing it stays at its last, highest, value.
    peer.in_flight = conn.held_output();
    let was_busy = peer.busy;
    peer.busy = conn.pending_output() > 0;
    if peer.queue.is_empty() {
        if peer.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker())) {
            peer.waker = Some(cx.waker().clone());
        }
        if was_busy && !peer.busy {
            drop(guard);
            shared.drained.notify_waiters();
        }
    }
    taken.messages > 0
}
