//! The watch backlog every backend uses: the bounded queue a backend fills and the
//! watcher's stream drains, plus the watcher's view of the matching set, for the
//! `Resync` that replaces an overflowed backlog (rule 4 of the watch contract). The
//! memory, etcd and Kubernetes backends use it; [`WatchBacklog`] is its public face
//! for backends of your own.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use futures_core::Stream;
use tokio_util::sync::DropGuard;
use tracing::debug;

use super::{ChannelId, DiscoveryError, DiscoveryEvent, Instance};

/// The watch counters of one backend, shared by its watches' backlogs: what
/// [`DiscoveryStats`](super::DiscoveryStats) reports as `watchers`, `buffered_events`
/// and `overflow_resyncs`.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{DiscoveryStats, WatchBacklog, WatchCounters};
/// let counters = Arc::new(WatchCounters::default());
/// let (backlog, _stream) = WatchBacklog::start(16, counters.clone(), Vec::new());
/// let mut stats = DiscoveryStats::default();
/// counters.fill(&mut stats);
/// assert_eq!((stats.watchers, stats.buffered_events), (1, 1)); // the initial Resync
/// drop((backlog, _stream));
/// counters.fill(&mut stats);
/// assert_eq!((stats.watchers, stats.buffered_events), (0, 0));
/// ```
#[derive(Debug, Default)]
pub struct WatchCounters {
    pub(crate) watchers: AtomicUsize,
    pub(crate) buffered_events: AtomicUsize,
    pub(crate) overflow_resyncs: AtomicU64,
}

impl WatchCounters {
    /// Writes the watch part of a backend's stats into `stats`.
    pub fn fill(&self, stats: &mut super::DiscoveryStats) {
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
    /// The producer is gone: the stream ends once the queue is drained.
    closed: bool,
    /// The watcher dropped its stream: nothing is queued any more.
    reader_gone: bool,
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
        if st.overflowed || st.reader_gone {
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
        if st.reader_gone {
            return;
        }
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
    #[cfg(any(feature = "etcd", feature = "kube"))]
    pub(crate) fn finish(&self) {
        let mut st = self.lock();
        self.discard(&mut st);
        st.current = HashMap::new();
        drop(st);
        self.counters.watchers.fetch_sub(1, Ordering::Relaxed);
    }

    /// The producer is gone for good: the stream ends after what is queued (a pending
    /// overflow `Resync` included, built from the view), and the watch stops counting.
    fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        drop(st);
        self.counters.watchers.fetch_sub(1, Ordering::Relaxed);
        Backlog::wake(self.lock(), true);
    }

    /// Drops every queued event (keeping the global count right).
    fn discard(&self, st: &mut BacklogState) {
        self.counters
            .buffered_events
            .fetch_sub(st.queue.len(), Ordering::Relaxed);
        st.queue = VecDeque::new();
    }
}

/// The watcher's side of a [`WatchBacklog`]: its events, in order, with one
/// `Resync` of the watcher's view in place of a backlog that overflowed. It ends once
/// the backlog's producer is dropped and what was queued is read. Wrap it with
/// [`DiscoveryStream::with_cancellation`](super::DiscoveryStream::with_cancellation)
/// to return it from [`Discovery::watch`](super::Discovery::watch).
#[derive(Debug)]
pub struct WatchStream {
    backlog: Arc<Backlog>,
    /// Dropping the stream stops the task following the store (etcd, Kubernetes).
    _stop_task: Option<DropGuard>,
}

impl WatchStream {
    /// The stream of a backlog a task fills; dropping the stream stops that task.
    #[cfg(any(feature = "etcd", feature = "kube"))]
    pub(crate) fn following(backlog: Arc<Backlog>, stop_task: DropGuard) -> WatchStream {
        WatchStream {
            backlog,
            _stop_task: Some(stop_task),
        }
    }
}

impl Drop for WatchStream {
    /// The watcher is gone: what was queued for it is freed (and uncounted) now, and
    /// nothing more is queued ([`WatchBacklog::watcher_gone`] tells the producer).
    fn drop(&mut self) {
        let mut st = self.backlog.lock();
        st.reader_gone = true;
        st.overflowed = false;
        st.current = HashMap::new();
        self.backlog.discard(&mut st);
    }
}

impl Stream for WatchStream {
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
        if st.closed {
            return Poll::Ready(None);
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// One watch's bounded backlog, for a [`Discovery`](super::Discovery) backend of your
/// own: the backend pushes what changed for the watcher, the watcher reads a
/// [`WatchStream`], and the watch contract's bound holds whatever the watcher's pace.
/// It is what the memory, etcd and Kubernetes backends use.
///
/// - [`start`](Self::start) queues the initial sync (one `Added` per instance of the
///   snapshot, then its `Resync`).
/// - [`push`](Self::push) applies a change to the watcher's view and queues it. Past
///   `capacity` queued events the backlog is discarded and the watcher reads one
///   `Resync` of its view instead (counted in `overflow_resyncs`): memory stays
///   O(capacity + matching instances) however far behind it is.
/// - Dropping the `WatchBacklog` ends the stream after what is queued.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, Transport, WatchBacklog, WatchCounters};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use futures_util::StreamExt;
/// let counters = Arc::new(WatchCounters::default());
/// let (backlog, mut stream) = WatchBacklog::start(2, counters, Vec::new());
/// assert_eq!(stream.next().await.transpose()?, Some(DiscoveryEvent::Resync(vec![])));
/// let up = |n| Instance::new(ChannelId::new("ns", "c", "t", n).unwrap(), Transport::zmq("tcp://10.0.0.1:5555"), n);
/// for n in 1..=3 {
///     backlog.push(DiscoveryEvent::Added(up(n))); // the third overflows
/// }
/// let Some(DiscoveryEvent::Resync(mut all)) = stream.next().await.transpose()? else { panic!() };
/// all.sort_by_key(|i| i.incarnation);
/// assert_eq!(all, vec![up(1), up(2), up(3)]);
/// drop(backlog);
/// assert!(stream.next().await.is_none());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct WatchBacklog {
    backlog: Arc<Backlog>,
}

impl WatchBacklog {
    /// A backlog of `capacity` events (at least 1), counted in `counters`, starting
    /// with the initial sync of `snapshot` (queued whole, however large: it is
    /// O(matches) like the snapshot itself; the next push past `capacity` collapses
    /// it); and the stream its watcher reads.
    pub fn start(
        capacity: usize,
        counters: Arc<WatchCounters>,
        snapshot: Vec<Instance>,
    ) -> (WatchBacklog, WatchStream) {
        let backlog = Backlog::start(capacity.max(1), counters, snapshot);
        let stream = WatchStream {
            backlog: backlog.clone(),
            _stop_task: None,
        };
        (WatchBacklog { backlog }, stream)
    }

    /// Applies `event` to the watcher's view and queues it: an `Added` replaces what
    /// the view holds for its id; a `Removed` is dropped unless the view holds its id
    /// at that incarnation or an older one (no stale removals); a `Resync` replaces
    /// the view and everything queued.
    pub fn push(&self, event: DiscoveryEvent) {
        let mut st = self.backlog.lock();
        let event = match event {
            DiscoveryEvent::Resync(snapshot) => {
                drop(st);
                self.backlog.resync(snapshot);
                return;
            }
            DiscoveryEvent::Added(instance) => {
                st.current.insert(instance.id.clone(), instance.clone());
                DiscoveryEvent::Added(instance)
            }
            DiscoveryEvent::Removed { id, incarnation } => {
                match st.current.get(&id) {
                    Some(known) if known.incarnation <= incarnation => {
                        st.current.remove(&id);
                    }
                    _ => return,
                }
                DiscoveryEvent::Removed { id, incarnation }
            }
        };
        self.backlog.push(&mut st, event);
        Backlog::wake(st, true);
    }

    /// Events queued now (an overflow's pending `Resync`, built when read, is not
    /// one of them).
    pub fn buffered(&self) -> usize {
        self.backlog.lock().queue.len()
    }

    /// Whether the watcher dropped its [`WatchStream`]: a producer following a store
    /// for it should stop (pushes are ignored from then on, and the backlog holds
    /// nothing).
    pub fn watcher_gone(&self) -> bool {
        self.backlog.lock().reader_gone
    }
}

impl Drop for WatchBacklog {
    fn drop(&mut self) {
        self.backlog.close();
    }
}

/// The stream of a watch cancelled before it was established: it has ended.
#[cfg(any(feature = "etcd", feature = "kube"))]
#[derive(Debug)]
pub(crate) struct Ended;

#[cfg(any(feature = "etcd", feature = "kube"))]
impl Stream for Ended {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(None)
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;
    use crate::discovery::Transport;

    fn up(n: u64) -> Instance {
        let id = ChannelId::new("ns", "c", "t", n).unwrap();
        Instance::new(id, Transport::zmq("tcp://10.0.0.1:5555"), n)
    }

    fn drain(stream: &mut WatchStream) -> Vec<DiscoveryEvent> {
        let mut cx = Context::from_waker(Waker::noop());
        let mut out = Vec::new();
        while let Poll::Ready(Some(event)) = Pin::new(&mut *stream).poll_next(&mut cx) {
            out.push(event.unwrap());
        }
        out
    }

    #[test]
    fn an_overflow_collapses_into_one_resync_of_the_view_and_is_counted() {
        let counters = Arc::new(WatchCounters::default());
        let (backlog, mut stream) = WatchBacklog::start(2, counters.clone(), vec![up(1)]);
        // The initial sync fills the backlog: the next change overflows it.
        backlog.push(DiscoveryEvent::Added(up(2)));
        backlog.push(DiscoveryEvent::Removed {
            id: up(1).id,
            incarnation: 1,
        });
        let mut stats = crate::discovery::DiscoveryStats::default();
        counters.fill(&mut stats);
        assert_eq!((stats.overflow_resyncs, stats.buffered_events), (1, 0));
        assert_eq!(
            drain(&mut stream),
            vec![DiscoveryEvent::Resync(vec![up(2)])]
        );
    }

    #[test]
    fn stale_removals_are_dropped_and_a_resync_replaces_the_queue() {
        let counters = Arc::new(WatchCounters::default());
        let (backlog, mut stream) = WatchBacklog::start(8, counters.clone(), Vec::new());
        let mut v3 = up(1);
        v3.incarnation = 3;
        backlog.push(DiscoveryEvent::Added(v3.clone()));
        // Incarnation 2 went away after 3 arrived: not a removal of 3.
        let stale = DiscoveryEvent::Removed {
            id: v3.id.clone(),
            incarnation: 2,
        };
        backlog.push(stale);
        assert_eq!(
            drain(&mut stream),
            vec![
                DiscoveryEvent::Resync(vec![]),
                DiscoveryEvent::Added(v3.clone())
            ]
        );
        backlog.push(DiscoveryEvent::Added(up(2)));
        backlog.push(DiscoveryEvent::Resync(vec![up(4)]));
        assert_eq!(backlog.buffered(), 1);
        assert_eq!(
            drain(&mut stream),
            vec![DiscoveryEvent::Resync(vec![up(4)])]
        );
        drop(backlog);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(
            Pin::new(&mut stream).poll_next(&mut cx),
            Poll::Ready(None)
        ));
        let mut stats = crate::discovery::DiscoveryStats::default();
        counters.fill(&mut stats);
        assert_eq!((stats.watchers, stats.buffered_events), (0, 0));
    }

    #[test]
    fn a_closed_overflowed_backlog_still_resyncs_and_a_dropped_stream_frees_its_queue() {
        let counters = Arc::new(WatchCounters::default());
        let (backlog, mut stream) = WatchBacklog::start(1, counters.clone(), vec![up(1)]);
        backlog.push(DiscoveryEvent::Added(up(2))); // overflows
        drop(backlog);
        let mut events = drain(&mut stream);
        if let Some(DiscoveryEvent::Resync(all)) = events.first_mut() {
            all.sort_by_key(|i| i.incarnation);
        }
        assert_eq!(events, vec![DiscoveryEvent::Resync(vec![up(1), up(2)])]);
        // A watcher that walks away: its queue is freed and the producer is told.
        let (backlog, stream) = WatchBacklog::start(8, counters.clone(), vec![up(1)]);
        drop(stream);
        assert!(backlog.watcher_gone());
        backlog.push(DiscoveryEvent::Added(up(2)));
        assert_eq!(backlog.buffered(), 0);
        let mut stats = crate::discovery::DiscoveryStats::default();
        counters.fill(&mut stats);
        assert_eq!((stats.watchers, stats.buffered_events), (1, 0));
        drop(backlog);
        counters.fill(&mut stats);
        assert_eq!(stats.watchers, 0);
    }
}
