//! The synchronous fan-out core of a `PubSocket`: the peer table, the prefix index
//! and each peer's bounded queue, and how connection events change them.

use std::sync::{Mutex, MutexGuard};
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::Bytes;
use smallvec::SmallVec;
use tokio::sync::{Notify, watch};

use super::stats::{PubStats, SendReport};
use crate::net::RateLimitedWarn;
use crate::slots::Slab;
use crate::zmtp::prefix::PrefixMap;
use crate::zmtp::queue::{CHUNKS_MIN_QUEUE_BYTES, Chunks, Placed, Queue};
use crate::zmtp::{Config, Event, Message, SessionStats};

/// How often (at most) a drop warning is logged per subscriber.
const DROP_WARN_INTERVAL: Duration = Duration::from_secs(60);

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
    pub(super) chunks: Chunks,
}

/// Laid out in declaration order (`repr(C)`) so that what every send touches, the
/// first four fields, shares the first cache lines.
#[derive(Debug)]
#[repr(C)]
pub(super) struct Peer {
    /// `send_seq` of the last send that queued here: one copy per send even when
    /// several of the peer's prefixes match.
    pub(super) mark: u64,
    /// What the connection keeps alive beyond the queue: its write buffer, the
    /// chunks of the slices it was handed and unsent control output, as of its
    /// writer's last turn.
    pub(super) in_flight: usize,
    pub(super) waker: Option<Waker>,
    pub(super) queue: Queue,
    pub(super) label: String,
    pub(super) ready: bool,
    /// The writer holds data not yet written to the socket.
    pub(super) busy: bool,
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

    /// Queues `msg` for every peer holding a prefix of its first frame: once per peer
    /// however many of its prefixes match, dropped (and counted) for a peer whose
    /// queue is full by messages or by bytes (its queue, plus what its connection
    /// holds). The wakers of peers that got something are added to `wake`.
    pub(super) fn fan_out(
        &mut self,
        cfg: &Config,
        msg: &Message,
        wake: &mut SmallVec<[Waker; 8]>,
    ) -> SendReport {
        let topic: &[u8] = msg.get(0).unwrap_or_default();
        let mut report = SendReport::default();
        let mut placed: Option<Placed> = None;
        let shared_chunks = cfg.send_queue_bytes >= CHUNKS_MIN_QUEUE_BYTES;
        self.send_seq += 1;
        self.stats.messages += 1;
        let seq = self.send_seq;
        let peers = &mut self.peers;
        let chunks = &mut self.chunks;
        self.index.for_each_match(topic, |ids| {
            for &id in ids {
                let Some(peer) = peers.get_mut(id) else {
                    continue;
                };
                if peer.mark == seq {
                    continue;
                }
                peer.mark = seq;
                let placed = *placed.get_or_insert_with(|| chunks.place(msg, shared_chunks));
                let cost = peer.queue.cost(&placed);
                let pending = peer.queue.held() + peer.in_flight + cost;
                if peer.queue.len() >= cfg.send_queue_messages || pending > cfg.send_queue_bytes {
                    peer.dropped += 1;
                    report.dropped += 1;
                    peer.note_drop();
                    continue;
                }
                peer.queue.push(chunks, &placed, cost);
                report.queued += 1;
                if let Some(w) = peer.waker.take() {
                    wake.push(w);
                }
            }
        });
        if let Some(placed) = placed {
            // Dropped for every subscriber: its own allocation goes at once.
            self.chunks.release_if_unused(placed.chunk());
        }
        self.stats.queued += report.queued as u64;
        self.stats.dropped += report.dropped as u64;
        report
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
                "subscriber queue full: dropping messages for this subscriber (every drop \
                 is counted in PubStats::dropped; this warning repeats at most once per \
                 interval, with the drops since the last one)"
            );
            self.last_warn = Some(now);
            self.dropped_since_warn = 0;
        }
    }
}

pub(super) fn remove_peer(shared: &Shared, id: usize, failed: bool, stalled: bool) {
    let mut guard = shared.lock();
    let inner = &mut *guard;
    let Some(mut peer) = inner.peers.remove(id) else {
        return;
    };
    peer.queue.clear(&mut inner.chunks);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A core with peers subscribed to these prefix lists, no sockets anywhere.
    fn core(subscriptions: &[&[&str]]) -> Inner {
        let mut inner = Inner::default();
        for prefixes in subscriptions {
            let id = inner
                .peers
                .insert(Peer::new(format!("peer{}", inner.peers.len())));
            for p in *prefixes {
                let prefix = Bytes::copy_from_slice(p.as_bytes());
                inner.index.entry(&prefix, SmallVec::new).push(id);
                inner.peers.get_mut(id).unwrap().prefixes.push(prefix);
            }
        }
        inner
    }

    #[test]
    fn one_copy_per_matching_peer_and_bounded_queues() {
        let cfg = Config::builder()
            .send_queue_messages(2)
            .send_queue_bytes(1 << 20)
            .build()
            .unwrap();
        // peer0: "a"; peer1: "ab"; peer2: "a" and "ab" (one copy, not two); peer3: "b".
        let mut inner = core(&[&["a"], &["ab"], &["a", "ab"], &["b"]]);
        let mut wake = SmallVec::new();
        let send = |inner: &mut Inner, topic: &'static str, wake: &mut SmallVec<[Waker; 8]>| {
            inner.fan_out(&cfg, &Message::from_parts([topic, "x"]), wake)
        };
        let r = send(&mut inner, "abc", &mut wake);
        assert_eq!((r.queued, r.dropped), (3, 0));
        let r = send(&mut inner, "a", &mut wake);
        assert_eq!((r.queued, r.dropped), (2, 0));
        let lens: Vec<usize> = inner.peers.iter().map(|(_, p)| p.queue.len()).collect();
        assert_eq!(lens, vec![2, 1, 2, 0]);
        // peer0 and peer2 are full at 2 messages: dropped and counted, peer1 still queues.
        let r = send(&mut inner, "abc", &mut wake);
        assert_eq!((r.queued, r.dropped), (1, 2));
        let dropped: Vec<u64> = inner.peers.iter().map(|(_, p)| p.dropped).collect();
        assert_eq!(dropped, vec![1, 0, 1, 0]);
        assert_eq!(
            (
                inner.stats.messages,
                inner.stats.queued,
                inner.stats.dropped
            ),
            (3, 6, 2)
        );
        // Nothing matches "c".
        assert_eq!(send(&mut inner, "c", &mut wake), SendReport::default());
    }

    #[test]
    fn bytes_bound_counts_what_the_connection_holds() {
        let cfg = Config::builder()
            .send_queue_messages(100)
            .send_queue_bytes(1000)
            .build()
            .unwrap();
        let mut inner = core(&[&[""]]);
        inner.peers.get_mut(0).unwrap().in_flight = 990;
        let mut wake = SmallVec::new();
        let r = inner.fan_out(
            &cfg,
            &Message::from_parts(["t", "0123456789abcdef"]),
            &mut wake,
        );
        assert_eq!((r.queued, r.dropped), (0, 1));
        inner.peers.get_mut(0).unwrap().in_flight = 0;
        let r = inner.fan_out(
            &cfg,
            &Message::from_parts(["t", "0123456789abcdef"]),
            &mut wake,
        );
        assert_eq!((r.queued, r.dropped), (1, 0));
    }
}
