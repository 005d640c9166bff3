//! Publisher lifecycle notices: what a router keeping per-publisher state must know
//! besides the messages themselves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::discovery::{ChannelId, Instance};

use super::PublisherStats;

/// Something that happened to a followed publisher, from
/// [`DynamicSubscriber::take_notices`](super::DynamicSubscriber::take_notices) when
/// [`notices`](super::DynamicSubscriberBuilder::notices) are enabled.
///
/// A router that indexes what each publisher sent uses them to keep the index honest:
/// after [`Departed`](Notice::Departed) it can forget the publisher; a second
/// [`Connected`](Notice::Connected) means messages sent while disconnected are gone. A
/// [`Gap`](Notice::Gap) or [`Reset`](Notice::Reset) says the message sequence skipped
/// or restarted — but only before this subscriber's lanes (what they drop is counted in
/// the stats, not noticed), and after the batch it came in: a KV router tracks its
/// events' own ids instead, which show every loss, in order (see the
/// [guide](crate::guide)).
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{Discovery, MemoryDiscovery, Query};
/// use eventplane::publish::EventPublisher;
/// use eventplane::subscriber::{DynamicSubscriber, Notice};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
/// let mut sub = DynamicSubscriber::builder(discovery.clone(), Query::new("ns"))
///     .topic("t")
///     .notices(1024)
///     .spawn()?;
/// let publisher = EventPublisher::builder(discovery, "ns", "c", "t").build().await?;
/// publisher.wait_for_subscribers(1).await;
/// let mut notices = Vec::new();
/// sub.take_notices(&mut notices);
/// assert!(matches!(&notices[..], [Notice::Connected(i)] if i.id.publisher_id() == publisher.publisher_id()));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Notice {
    /// A following of this publisher ended — it left discovery or moved to a new
    /// endpoint — and every message received from it has been handed to the consumer:
    /// `stats` are its final counters, from when it was first followed. Comes before
    /// the [`Departed`](Notice::Departed) it may be followed by. A publisher followed
    /// again under the same id counts from zero in
    /// [`SubscriberStats::publishers`](super::SubscriberStats::publishers), so summing
    /// a publisher's `Retired` stats gives every message it was ever credited with:
    /// what an exact per-publisher ledger needs (delivered + dropped + gap messages =
    /// `last_sequence - first_sequence + 1` when there was no reset).
    Retired {
        /// The publisher.
        id: ChannelId,
        /// Its final counters (`depth` 0).
        stats: Box<PublisherStats>,
    },
    /// A connection to this publisher is up and subscribed (the first one, or again
    /// after a failure): what it sends from now on arrives.
    Connected(Arc<Instance>),
    /// `missing` messages of this publisher were lost (a sequence gap, for layouts
    /// with sequences): state built from its messages is incomplete.
    Gap {
        /// The publisher.
        id: ChannelId,
        /// Messages missing.
        missing: u64,
    },
    /// The publisher's sequence started again (it restarted): what it sent before is
    /// no longer what it holds.
    Reset {
        /// The publisher.
        id: ChannelId,
    },
    /// The publisher left discovery, its connection ended, and every message it sent
    /// that was received has been handed to the consumer. Not sent for a publisher
    /// that moved to a new endpoint under the same id (it is still followed).
    Departed(ChannelId),
}

/// The bounded queue of notices; full, the newest is dropped and counted.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    queue: Mutex<VecDeque<Notice>>,
    capacity: usize,
    dropped: AtomicU64,
    /// Wakes a consumer waiting in [`ready`](Self::ready).
    queued: tokio::sync::Notify,
}

impl Notices {
    /// A queue of at most `capacity` notices; 0 keeps none (notices off).
    pub(crate) fn new(capacity: usize) -> Notices {
        Notices {
            queue: Mutex::new(VecDeque::new()),
            capacity,
            dropped: AtomicU64::new(0),
            queued: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub(crate) fn push(&self, notice: Notice) {
        if !self.enabled() {
            return;
        }
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.len() < self.capacity {
            queue.push_back(notice);
            drop(queue);
            self.queued.notify_one();
        } else {
            crate::counter::add(&self.dropped, 1);
        }
    }

    /// Moves every queued notice into `out`; returns how many.
    pub(crate) fn take(&self, out: &mut Vec<Notice>) -> usize {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let n = queue.len();
        out.extend(queue.drain(..));
        n
    }

    /// Completes once a notice is queued (at once if one is); never with notices off.
    /// Cancel-safe: a wake-up that was not awaited stays stored for the next call.
    pub(crate) async fn ready(&self) {
        if !self.enabled() {
            return std::future::pending().await;
        }
        loop {
            // Created before the check: a push in between stores its wake-up here.
            let queued = self.queued.notified();
            if !self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return;
            }
            queued.await;
        }
    }

    /// Notices dropped because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_the_newest_and_counts_it() {
        let notices = Notices::new(2);
        let id = |n| ChannelId::new("ns", "c", "t", n).unwrap();
        for n in 0..3 {
            notices.push(Notice::Departed(id(n)));
        }
        let mut out = Vec::new();
        assert_eq!(notices.take(&mut out), 2);
        assert_eq!(out, [Notice::Departed(id(0)), Notice::Departed(id(1))]);
        assert_eq!(notices.dropped(), 1);
        let off = Notices::new(0);
        off.push(Notice::Departed(id(9)));
        assert_eq!((off.take(&mut out), off.dropped()), (0, 0));
    }
}
