//! Watch plumbing shared by backends: a bounded per-watcher buffer that collapses into a
//! `Resync` on overflow, and the stale-removal filter of rule 5.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::task::Waker;

use super::{ChannelId, DiscoveryEvent};

/// Drops removals that are older than the registration a watcher last saw (rule 5 of
/// the watch contract), and removals of ids the watcher never saw.
///
/// Backends run every event through one of these per watch; consumers can use it on
/// any stream too.
///
/// ```
/// use eventplane::discovery::{ChannelId, DiscoveryEvent, Instance, StaleFilter, Transport};
/// let id = ChannelId::new("ns", "c", "t", 1)?;
/// let mut filter = StaleFilter::default();
/// let v2 = Instance::new(id.clone(), Transport::zmq("tcp://127.0.0.1:1"), 2);
/// assert!(filter.admit(&DiscoveryEvent::Added(v2)));
/// // A late removal of incarnation 1 must not remove incarnation 2.
/// assert!(!filter.admit(&DiscoveryEvent::Removed { id: id.clone(), incarnation: 1 }));
/// assert!(filter.admit(&DiscoveryEvent::Removed { id, incarnation: 2 }));
/// # Ok::<(), eventplane::discovery::DiscoveryError>(())
/// ```
#[derive(Debug, Default, Clone)]
pub struct StaleFilter {
    known: HashMap<ChannelId, u64>,
}

impl StaleFilter {
    /// Whether `event` should be delivered; updates the filter's view.
    pub fn admit(&mut self, event: &DiscoveryEvent) -> bool {
        match event {
            DiscoveryEvent::Added(instance) => {
                match self.known.get(&instance.id) {
                    Some(&seen) if seen > instance.incarnation => return false,
                    _ => {}
                }
                self.known.insert(instance.id.clone(), instance.incarnation);
                true
            }
            DiscoveryEvent::Removed { id, incarnation } => match self.known.get(id) {
                Some(&seen) if seen <= *incarnation => {
                    self.known.remove(id);
                    true
                }
                _ => false,
            },
            DiscoveryEvent::Resync(all) => {
                self.known = all.iter().map(|i| (i.id.clone(), i.incarnation)).collect();
                true
            }
        }
    }
}

/// A watcher's bounded backlog. Pushes past `capacity` discard the backlog and set
/// `overflowed`; the stream then emits one `Resync` with the current set.
#[derive(Debug)]
pub(crate) struct WatchBuffer {
    state: Mutex<BufferState>,
    capacity: usize,
}

#[derive(Debug, Default)]
pub(crate) struct BufferState {
    pub(crate) queue: VecDeque<DiscoveryEvent>,
    pub(crate) overflowed: bool,
    pub(crate) waker: Option<Waker>,
}

impl WatchBuffer {
    pub(crate) fn new(capacity: usize) -> Self {
        WatchBuffer {
            state: Mutex::new(BufferState::default()),
            capacity,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, BufferState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Events waiting now.
    pub(crate) fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Appends `event`, or collapses the backlog on overflow. Returns `true` when this
    /// push caused the overflow.
    pub(crate) fn push(&self, event: DiscoveryEvent) -> bool {
        let mut st = self.lock();
        let mut overflowed_now = false;
        if !st.overflowed {
            if st.queue.len() >= self.capacity {
                st.queue = VecDeque::new();
                st.overflowed = true;
                overflowed_now = true;
            } else {
                st.queue.push_back(event);
            }
        }
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        overflowed_now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_collapses() {
        let buf = WatchBuffer::new(2);
        let ev = DiscoveryEvent::Resync(vec![]);
        assert!(!buf.push(ev.clone()));
        assert!(!buf.push(ev.clone()));
        assert!(buf.push(ev.clone()));
        assert!(!buf.push(ev));
        let st = buf.lock();
        assert!(st.overflowed);
        assert!(st.queue.is_empty());
    }
}
