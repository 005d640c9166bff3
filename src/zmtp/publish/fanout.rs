//! The synchronous fan-out core of a `PubSocket`: the peer table, the prefix index
//! and each peer's bounded queue, and how connection events change them.

use super::*;

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) config: Config,
    pub(super) inner: Mutex<Inner>,
    pub(super) subscribed: watch::Sender<usize>,
    pub(super) drained: Notify,
    pub(super) warn: RateLimitedWarn,
}

#[derive(Debug, Default)]
pub(super) struct Inner {
    pub(super) index: PrefixMap<SmallVec<[usize; 4]>>,
    pub(super) peers: Slab<Peer>,
    pub(super) send_seq: u64,
    pub(super) stats: PubStats,
    pub(super) arena: Arena,
}

#[derive(Debug)]
pub(super) struct Peer {
    pub(super) label: String,
    pub(super) ready: bool,
    pub(super) queue: Queue,
    /// Bytes the connection holds beyond the queue: its write buffer and unsent
    /// control output, as of its writer's last turn.
    pub(super) in_flight: usize,
    /// The writer holds data not yet written to the socket.
    pub(super) busy: bool,
    pub(super) waker: Option<Waker>,
    /// `send_seq` of the last send that queued here: one copy per send even when
    /// several of the peer's prefixes match.
    pub(super) mark: u64,
    /// The prefixes this peer holds (each once; the session counts repeats).
    pub(super) prefixes: Vec<Bytes>,
    pub(super) written: u64,
    pub(super) dropped: u64,
    pub(super) session: SessionStats,
    pub(super) dropped_since_warn: u64,
    pub(super) last_warn: Option<Instant>,
}

impl Inner {
    /// Connections being served (handshaking ones included): the occupied slots.
    pub(super) fn open(&self) -> usize {
        self.peers.len()
    }
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave `Inner` inconsistent in a way
        // that matters more than stopping all publishing, so recover the guard.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Peer {
    pub(super) fn new(label: String) -> Peer {
        Peer {
            label,
            ready: false,
            queue: Queue::default(),
            in_flight: 0,
            busy: false,
            waker: None,
            mark: 0,
            prefixes: Vec::new(),
            written: 0,
            dropped: 0,
            session: SessionStats::default(),
            dropped_since_warn: 0,
            last_warn: None,
        }
    }

    pub(super) fn idle(&self) -> bool {
        !self.ready || (self.queue.is_empty() && !self.busy)
    }

    pub(super) fn note_drop(&mut self) {
        self.dropped_since_warn += 1;
        let now = Instant::now();
        if self
            .last_warn
            .is_none_or(|t| now.duration_since(t) >= DROP_WARN_INTERVAL)
        {
            tracing::warn!(
                peer = %self.label,
                dropped = self.dropped_since_warn,
                total_dropped = self.dropped,
                "subscriber queue full: dropping messages for this subscriber"
            );
            self.last_warn = Some(now);
            self.dropped_since_warn = 0;
        }
    }
}

pub(super) fn remove_peer(shared: &Shared, id: usize, failed: bool, stalled: bool) {
    let mut guard = shared.lock();
    let inner = &mut *guard;
    let Some(peer) = inner.peers.remove(id) else {
        return;
    };
    if failed {
        inner.stats.failed += 1;
    }
    if stalled {
        inner.stats.stalled += 1;
    }
    if peer.ready {
        inner.stats.connections -= 1;
    }
    if !peer.prefixes.is_empty() {
        for prefix in &peer.prefixes {
            unindex(&mut inner.index, prefix, id);
        }
        inner.stats.subscribed -= 1;
        shared.subscribed.send_replace(inner.stats.subscribed);
    }
    drop(guard);
    shared.drained.notify_waiters();
}

pub(super) fn unindex(index: &mut PrefixMap<SmallVec<[usize; 4]>>, prefix: &[u8], id: usize) {
    if let Some(ids) = index.get_mut(prefix) {
        ids.retain(|i| *i != id);
        if ids.is_empty() {
            index.remove(prefix);
        }
    }
}

pub(super) fn on_peer_event(shared: &Shared, id: usize, event: Event) {
    let mut guard = shared.lock();
    let inner = &mut *guard;
    let Some(peer) = inner.peers.get_mut(id) else {
        return;
    };
    match event {
        Event::Ready(info) => {
            tracing::debug!(minor = info.minor, "subscriber handshake complete");
            peer.ready = true;
            inner.stats.connections += 1;
        }
        Event::Subscribe(prefix) => {
            let first = peer.prefixes.is_empty();
            inner.index.entry(&prefix, SmallVec::new).push(id);
            peer.prefixes.push(prefix);
            if first {
                inner.stats.subscribed += 1;
                shared.subscribed.send_replace(inner.stats.subscribed);
            }
        }
        Event::Cancel(prefix) => {
            peer.prefixes.retain(|p| *p != prefix);
            unindex(&mut inner.index, &prefix, id);
            if peer.prefixes.is_empty() {
                inner.stats.subscribed -= 1;
                shared.subscribed.send_replace(inner.stats.subscribed);
            }
        }
        Event::Message(_) => {}
    }
}
