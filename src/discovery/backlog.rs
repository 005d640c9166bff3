//! A remote backend's watch backlog: the bounded queue a follower task fills and the
//! consumer's stream drains, plus the watcher's view of the matching set, for the
//! `Resync` that replaces an overflowed backlog (rule 4 of the watch contract). Shared
//! by the backends that follow a remote store (etcd, Kubernetes).

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use futures_core::Stream;
use tokio_util::sync::DropGuard;
use tracing::debug;

use super::{ChannelId, DiscoveryError, DiscoveryEvent, Instance};

/// The watch counters of one backend, shared by its watches.
#[derive(Debug, Default)]
pub(crate) struct WatchCounters {
    pub(crate) watchers: AtomicUsize,
    pub(crate) buffered_events: AtomicUsize,
    pub(crate) overflow_resyncs: AtomicU64,
}

impl WatchCounters {
    /// The watch part of a backend's stats.
    pub(crate) fn fill(&self, stats: &mut super::DiscoveryStats) {
        stats.watchers = self.watchers.load(Ordering::Relaxed);
        stats.buffered_events = self.buffered_events.load(Ordering::Relaxed);
        stats.overflow_resyncs = self.overflow_resyncs.load(Ordering::Relaxed);
    }
}

/// One watch's bounded backlog.
#[derive(Debug)]
pub(crate) struct Backlog {
    state: Mutex<BacklogState>,
    capacity: usize,
    counters: Arc<WatchCounters>,
}

#[derive(Debug, Default)]
pub(crate) struct BacklogState {
    queue: VecDeque<DiscoveryEvent>,
    overflowed: bool,
    /// The watcher's view: what it has been told (or will be, once it drains).
    pub(crate) current: HashMap<ChannelId, Instance>,
    waker: Option<Waker>,
}

impl Backlog {
    /// A backlog holding at most `capacity` events, starting with the initial sync of
    /// `snapshot` (one `Added` each, then its `Resync`: it always fits, being
    /// O(matches) like the snapshot itself). Counts one more watcher until
    /// [`finish`](Self::finish).
    pub(crate) fn start(
        capacity: usize,
        counters: Arc<WatchCounters>,
        snapshot: Vec<Instance>,
    ) -> Arc<Backlog> {
        let mut state = BacklogState::default();
        for instance in &snapshot {
            state
                .queue
                .push_back(DiscoveryEvent::Added(instance.clone()));
        }
        state
            .queue
            .push_back(DiscoveryEvent::Resync(snapshot.clone()));
        state.current = snapshot.into_iter().map(|i| (i.id.clone(), i)).collect();
        counters
            .buffered_events
            .fetch_add(state.queue.len(), Ordering::Relaxed);
        counters.watchers.fetch_add(1, Ordering::Relaxed);
        Arc::new(Backlog {
            state: Mutex::new(state),
            capacity,
            counters,
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, BacklogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `change` (already applied to `st.current` by the caller); on overflow
    /// the queue collapses into one `Resync` of `current`, built when the consumer
    /// reads it. Call [`wake`](Self::wake) after releasing the lock.
    pub(crate) fn push(&self, st: &mut BacklogState, change: DiscoveryEvent) {
        if st.overflowed {
            return;
        }
        if st.queue.len() >= self.capacity {
            self.discard(st);
            st.overflowed = true;
            self.counters
                .overflow_resyncs
                .fetch_add(1, Ordering::Relaxed);
            debug!("watch backlog overflowed; the consumer gets a Resync");
        } else {
            st.queue.push_back(change);
            self.counters
                .buffered_events
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Replaces everything queued with one `Resync(snapshot)` and wakes the consumer.
    pub(crate) fn resync(&self, snapshot: Vec<Instance>) {
        let mut st = self.lock();
        self.discard(&mut st);
        st.overflowed = false;
        st.current = snapshot.iter().map(|i| (i.id.clone(), i.clone())).collect();
        st.queue.push_back(DiscoveryEvent::Resync(snapshot));
        self.counters
            .buffered_events
            .fetch_add(1, Ordering::Relaxed);
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes the consumer after changes were pushed (`pushed`), outside the lock.
    pub(crate) fn wake(mut st: MutexGuard<'_, BacklogState>, pushed: bool) {
        let waker = if pushed { st.waker.take() } else { None };
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The follower stopped: frees the queue and the view, and stops counting it.
    pub(crate) fn finish(&self) {
        let mut st = self.lock();
        self.discard(&mut st);
        st.current = HashMap::new();
        drop(st);
        self.counters.watchers.fetch_sub(1, Ordering::Relaxed);
    }

    /// Drops every queued event (keeping the global count right).
    fn discard(&self, st: &mut BacklogState) {
        self.counters
            .buffered_events
            .fetch_sub(st.queue.len(), Ordering::Relaxed);
        st.queue = VecDeque::new();
    }
}

/// The consumer's side of a backlog; dropping it stops the follower task.
#[derive(Debug)]
pub(crate) struct BacklogStream {
    backlog: Arc<Backlog>,
    _stop_task: DropGuard,
}

impl BacklogStream {
    pub(crate) fn new(backlog: Arc<Backlog>, stop_task: DropGuard) -> BacklogStream {
        BacklogStream {
            backlog,
            _stop_task: stop_task,
        }
    }
}

impl Stream for BacklogStream {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let backlog = &self.backlog;
        let mut st = backlog.lock();
        if st.overflowed {
            st.overflowed = false;
            let snapshot: Vec<Instance> = st.current.values().cloned().collect();
            return Poll::Ready(Some(Ok(DiscoveryEvent::Resync(snapshot))));
        }
        if let Some(event) = st.queue.pop_front() {
            drop(st);
            backlog
                .counters
                .buffered_events
                .fetch_sub(1, Ordering::Relaxed);
            return Poll::Ready(Some(Ok(event)));
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// The stream of a watch cancelled before it was established: it has ended.
#[derive(Debug)]
pub(crate) struct Ended;

impl Stream for Ended {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(None)
    }
}
