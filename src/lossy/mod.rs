//! Bounded, lossy lanes and a fair merge — the sync core of the dynamic subscriber,
//! usable on its own.
//!
//! Each producer owns a [`Lane`]; one consumer reads a [`Merge`] of all lanes.
//!
//! - A lane holds at most `lane_capacity` items and `lane_bytes` bytes; every item is
//!   charged its size plus its bookkeeping ([`ITEM_OVERHEAD`], or its queue slot when
//!   that is larger). Beyond their charge, lanes hold only spare queue slots, given
//!   back when a lane drains or stays below a quarter of them (64 kept per lane).
//! - All lanes together hold at most `max_buffered_bytes`. The budget is fair: a lane
//!   holding less than its share (`max_buffered_bytes / open lanes`) is never refused
//!   for lack of budget — room is made by dropping the oldest item of the lane that
//!   holds the most, counted on *that* lane.
//! - [`DropPolicy::DropNewest`] (default) refuses the new item when a bound is hit;
//!   [`DropPolicy::DropOldest`] evicts the lane's oldest instead (freshest data wins).
//! - Producers never wait: a push either succeeds or drops, and every drop is counted
//!   by reason in [`LaneStats`].
//! - The consumer takes one item per ready lane in turn (round-robin), so a flooding
//!   lane cannot starve a quiet one. Order within a lane is preserved.
//!
//! ```
//! use eventplane::lossy::{Merge, MergeConfig};
//! let merge = Merge::default();
//! let flood = merge.lane();
//! let quiet = merge.lane();
//! for i in 0..5 { flood.push(("flood", i), 100); }
//! quiet.push(("quiet", 0), 100);
//! let mut out = Vec::new();
//! merge.try_recv_many(&mut out, 3);
//! // Round-robin: the quiet lane's item comes second, not sixth.
//! assert_eq!(out, vec![("flood", 0), ("quiet", 0), ("flood", 1)]);
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use crate::config::{self, ConfigError};
use crate::slots::{Slab, SlotTrim};

/// Bytes charged per item on top of its size for the bookkeeping the bound must cover:
/// its queue slot and the headers of the allocations it references. Items whose queue
/// slot (`size_of::<(T, usize)>()`) plus 32 bytes of headers is larger are charged
/// that instead (a subscriber's `Delivery`: about 170 bytes), so what lanes hold in
/// memory is their charge plus spare queue slots (see the [module docs](self)).
///
/// ```
/// use eventplane::lossy::{Merge, MergeConfig, ITEM_OVERHEAD};
/// let merge = Merge::default();
/// let lane = merge.lane();
/// lane.push("x", 10);
/// assert_eq!(lane.stats().bytes, 10 + ITEM_OVERHEAD);
/// ```
pub const ITEM_OVERHEAD: usize = 64;

/// What an item of type `T` is charged beyond its size (see [`ITEM_OVERHEAD`]).
fn overhead<T>() -> usize {
    ITEM_OVERHEAD.max(std::mem::size_of::<(T, usize)>() + 32)
}

/// What to drop when a bound is hit.
///
/// ```
/// use eventplane::lossy::{DropPolicy, Merge, MergeConfig};
/// let merge = Merge::new(MergeConfig::default().lane_capacity(2).policy(DropPolicy::DropOldest))?;
/// let lane = merge.lane();
/// for i in 0..3 { lane.push(i, 1); }
/// let mut out = Vec::new();
/// merge.try_recv_many(&mut out, 10);
/// assert_eq!(out, vec![1, 2]); // the oldest made room
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DropPolicy {
    /// Refuse the new item.
    #[default]
    DropNewest,
    /// Evict the lane's oldest items to make room.
    DropOldest,
}

/// Bounds of a [`Merge`], checked by [`Merge::new`]: none may be zero, and the byte
/// bounds must exceed one item's overhead ([`ITEM_OVERHEAD`], or the item's slot).
///
/// ```
/// use eventplane::lossy::{DropPolicy, MergeConfig};
/// let config = MergeConfig::default().lane_capacity(1024).policy(DropPolicy::DropOldest);
/// assert_eq!(config.max_buffered_bytes_value(), 64 << 20);
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct MergeConfig {
    lane_capacity: usize,
    lane_bytes: usize,
    max_buffered_bytes: usize,
    policy: DropPolicy,
}

impl Default for MergeConfig {
    fn default() -> Self {
        MergeConfig {
            lane_capacity: 4096,
            lane_bytes: 4 << 20,
            max_buffered_bytes: 64 << 20,
            policy: DropPolicy::DropNewest,
        }
    }
}

impl MergeConfig {
    /// Items per lane. Default 4096.
    pub fn lane_capacity(mut self, items: usize) -> Self {
        self.lane_capacity = items;
        self
    }
    /// Bytes per lane (items charged their size plus [`ITEM_OVERHEAD`] or their slot).
    /// Default 4 MiB.
    pub fn lane_bytes(mut self, bytes: usize) -> Self {
        self.lane_bytes = bytes;
        self
    }
    /// Bytes across all lanes. Default 64 MiB.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered_bytes = bytes;
        self
    }
    /// Drop policy. Default [`DropPolicy::DropNewest`].
    pub fn policy(mut self, policy: DropPolicy) -> Self {
        self.policy = policy;
        self
    }
    /// The configured global budget.
    pub fn max_buffered_bytes_value(&self) -> usize {
        self.max_buffered_bytes
    }

    /// The first refused bound for items of type `T`, as [`Merge::new`] checks it.
    pub(crate) fn check<T>(&self) -> Result<(), ConfigError> {
        config::nonzero("lane_capacity", self.lane_capacity)?;
        config::nonzero("lane_bytes", self.lane_bytes)?;
        config::nonzero("max_buffered_bytes", self.max_buffered_bytes)?;
        // A byte bound that cannot hold one item's bookkeeping would drop everything.
        for (field, bytes) in [
            ("lane_bytes", self.lane_bytes),
            ("max_buffered_bytes", self.max_buffered_bytes),
        ] {
            if bytes <= overhead::<T>() {
                return Err(ConfigError::OutOfRange {
                    field,
                    reason: "must exceed one item's overhead (ITEM_OVERHEAD, or the item's slot)",
                });
            }
        }
        Ok(())
    }
}

/// Counters of one lane.
///
/// ```
/// use eventplane::lossy::{Merge, MergeConfig};
/// let merge = Merge::new(MergeConfig::default().lane_capacity(1))?;
/// let lane = merge.lane();
/// lane.push(1, 1);
/// lane.push(2, 1); // refused: the lane holds one item
/// let stats = lane.stats();
/// assert_eq!((stats.received, stats.dropped_lane_full, stats.depth), (2, 1, 1));
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaneStats {
    /// Items pushed.
    pub received: u64,
    /// Items handed to the consumer.
    pub delivered: u64,
    /// Items dropped because this lane was full (its item or byte bound).
    pub dropped_lane_full: u64,
    /// Items dropped for the global byte budget.
    pub dropped_budget: u64,
    /// Items waiting now.
    pub depth: usize,
    /// Bytes charged for the items waiting now.
    pub bytes: usize,
}

/// What happened to a pushed item.
///
/// ```
/// use eventplane::lossy::{Merge, MergeConfig, PushOutcome};
/// let merge = Merge::new(MergeConfig::default().lane_capacity(1))?;
/// let lane = merge.lane();
/// assert_eq!(lane.push("a", 1), PushOutcome::Queued { evicted: 0 });
/// assert_eq!(lane.push("b", 1), PushOutcome::DroppedLaneFull);
/// merge.close();
/// assert_eq!(lane.push("c", 1), PushOutcome::Closed);
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PushOutcome {
    /// Queued, possibly after evicting `evicted` older items (from this lane or, for
    /// the budget, from the largest lane).
    Queued {
        /// Items evicted to make room.
        evicted: usize,
    },
    /// Refused: the lane is full.
    DroppedLaneFull,
    /// Refused: the global budget is exhausted and this lane holds its share.
    DroppedBudget,
    /// Refused: the merge is closed.
    Closed,
}

struct LaneState<T> {
    items: VecDeque<(T, usize)>,
    /// Gives a burst's slots back when the lane drains (or stays low).
    trim: SlotTrim,
    bytes: usize,
    in_ready: bool,
    open: bool,
    stats: LaneStats,
}

struct State<T> {
    config: MergeConfig,
    lanes: Slab<LaneState<T>>,
    ready: VecDeque<usize>,
    total_bytes: usize,
    open_lanes: usize,
    waker: Option<Waker>,
    closed: bool,
}

struct Shared<T> {
    state: Mutex<State<T>>,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The consumer side: one per merge. Cloning is not offered; one reader drains it.
///
/// ```
/// use eventplane::lossy::{Merge, MergeConfig};
/// let merge = Merge::default();
/// let lane = merge.lane();
/// lane.push("hello", 5);
/// let mut out = Vec::new();
/// assert_eq!(merge.try_recv_many(&mut out, 8), 1);
/// assert_eq!(merge.buffered_bytes(), 0);
/// ```
pub struct Merge<T> {
    shared: Arc<Shared<T>>,
}

/// A producer's lane. Dropping it closes the lane: items already in it are still
/// delivered, then its slot is freed.
///
/// ```
/// use eventplane::lossy::{Merge, MergeConfig};
/// let merge = Merge::default();
/// let lane = merge.lane();
/// assert_eq!(lane.push_many([("a", 1), ("b", 1)]), 0); // none dropped
/// drop(lane); // closes it; what it holds is still delivered
/// let mut out = Vec::new();
/// merge.try_recv_many(&mut out, 8);
/// assert_eq!(out, vec!["a", "b"]);
/// ```
pub struct Lane<T> {
    shared: Arc<Shared<T>>,
    id: usize,
}

impl<T> std::fmt::Debug for Merge<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("Merge")
            .field("lanes", &st.open_lanes)
            .field("total_bytes", &st.total_bytes)
            .finish()
    }
}

impl<T> std::fmt::Debug for Lane<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("id", &self.id).finish()
    }
}

impl<T> Default for Merge<T> {
    /// A merge with [`MergeConfig::default`].
    fn default() -> Self {
        Merge::with_checked(MergeConfig::default())
    }
}

impl<T> Merge<T> {
    /// An empty merge, or the [`ConfigError`] naming the first zero bound.
    pub fn new(config: MergeConfig) -> Result<Merge<T>, ConfigError> {
        config.check::<T>()?;
        Ok(Merge::with_checked(config))
    }

    fn with_checked(config: MergeConfig) -> Merge<T> {
        Merge {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    config,
                    lanes: Slab::default(),
                    ready: VecDeque::new(),
                    total_bytes: 0,
                    open_lanes: 0,
                    waker: None,
                    closed: false,
                }),
            }),
        }
    }

    /// A new lane for one producer.
    pub fn lane(&self) -> Lane<T> {
        let mut st = self.shared.lock();
        let lane = LaneState {
            items: VecDeque::new(),
            trim: SlotTrim::default(),
            bytes: 0,
            in_ready: false,
            open: true,
            stats: LaneStats::default(),
        };
        let id = st.lanes.insert(lane);
        st.open_lanes += 1;
        Lane {
            shared: self.shared.clone(),
            id,
        }
    }

    /// Bytes buffered across all lanes (charged sizes).
    pub fn buffered_bytes(&self) -> usize {
        self.shared.lock().total_bytes
    }

    /// Moves up to `max` items into `out` without waiting, one per ready lane in turn.
    pub fn try_recv_many(&self, out: &mut Vec<T>, max: usize) -> usize {
        let mut st = self.shared.lock();
        take(&mut st, out, max)
    }

    /// Waits for at least one item, then moves up to `max` (round-robin) into `out`.
    /// `Ready(0)` means the merge is closed and empty.
    pub fn poll_recv_many(
        &self,
        cx: &mut Context<'_>,
        out: &mut Vec<T>,
        max: usize,
    ) -> Poll<usize> {
        let mut st = self.shared.lock();
        let n = take(&mut st, out, max);
        if n > 0 {
            return Poll::Ready(n);
        }
        if st.closed {
            return Poll::Ready(0);
        }
        if st.waker.as_ref().is_none_or(|w| !w.will_wake(cx.waker())) {
            st.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Closes the merge: later pushes are refused; buffered items can still be read.
    pub fn close(&self) {
        let waker = {
            let mut st = self.shared.lock();
            st.closed = true;
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

fn take<T>(st: &mut State<T>, out: &mut Vec<T>, max: usize) -> usize {
    let mut n = 0;
    while n < max {
        let Some(id) = st.ready.pop_front() else {
            break;
        };
        let Some(lane) = st.lanes.get_mut(id) else {
            continue;
        };
        let Some((item, charge)) = lane.items.pop_front() else {
            lane.in_ready = false;
            continue;
        };
        lane.bytes -= charge;
        lane.stats.delivered += 1;
        let now_empty = lane.items.is_empty();
        let closed = !lane.open;
        // Drained, an idle lane keeps little, whatever its last burst needed.
        lane.trim.popped(&mut lane.items, true);
        if now_empty {
            lane.in_ready = false;
        } else {
            st.ready.push_back(id);
        }
        if now_empty && closed {
            free_lane(st, id);
        }
        st.total_bytes -= charge;
        out.push(item);
        n += 1;
    }
    n
}

/// Frees `id`'s slot for reuse; a slot still listed as ready is unlisted first, or a
/// lane reusing it would be served twice per round.
fn free_lane<T>(st: &mut State<T>, id: usize) {
    if st.lanes.get(id).is_some_and(|l| l.in_ready) {
        st.ready.retain(|&r| r != id);
    }
    st.lanes.remove(id);
}

impl<T> Drop for Merge<T> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<T> Lane<T> {
    /// Pushes `item` of `size` bytes (charged `size` plus its bookkeeping, see
    /// [`ITEM_OVERHEAD`]). Never waits.
    pub fn push(&self, item: T, size: usize) -> PushOutcome {
        let mut st = self.shared.lock();
        let outcome = push_locked(&mut st, self.id, item, size);
        let waker = if matches!(outcome, PushOutcome::Queued { .. }) {
            st.waker.take()
        } else {
            None
        };
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        outcome
    }

    /// Pushes many items under one lock (a batch read from a socket). Returns how many
    /// were dropped, of either kind.
    pub fn push_many(&self, items: impl IntoIterator<Item = (T, usize)>) -> usize {
        let mut st = self.shared.lock();
        let mut dropped = 0;
        let mut queued = false;
        for (item, size) in items {
            match push_locked(&mut st, self.id, item, size) {
                PushOutcome::Queued { evicted } => {
                    queued = true;
                    dropped += evicted;
                }
                _ => dropped += 1,
            }
        }
        let waker = if queued { st.waker.take() } else { None };
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        dropped
    }

    /// This lane's counters.
    pub fn stats(&self) -> LaneStats {
        let st = self.shared.lock();
        match st.lanes.get(self.id) {
            Some(lane) => LaneStats {
                depth: lane.items.len(),
                bytes: lane.bytes,
                ..lane.stats
            },
            _ => LaneStats::default(),
        }
    }
}

fn push_locked<T>(st: &mut State<T>, id: usize, item: T, size: usize) -> PushOutcome {
    if st.closed {
        return PushOutcome::Closed;
    }
    let charge = size.saturating_add(overhead::<T>());
    let config = st.config;
    let share = config.max_buffered_bytes / st.open_lanes.max(1);
    let mut evicted = 0;
    {
        let Some(lane) = st.lanes.get_mut(id) else {
            return PushOutcome::Closed;
        };
        lane.stats.received += 1;
        let fits = |lane: &LaneState<T>| {
            lane.items.len() < config.lane_capacity && lane.bytes + charge <= config.lane_bytes
        };
        if !fits(lane) {
            if config.policy == DropPolicy::DropNewest || charge > config.lane_bytes {
                lane.stats.dropped_lane_full += 1;
                return PushOutcome::DroppedLaneFull;
            }
            while !fits(lane) {
                let Some((_, c)) = lane.items.pop_front() else {
                    break;
                };
                lane.bytes -= c;
                lane.stats.dropped_lane_full += 1;
                st.total_bytes -= c;
                evicted += 1;
            }
        }
    }
    if st.total_bytes + charge > config.max_buffered_bytes {
        let own = match st.lanes.get(id) {
            Some(lane) => lane.bytes,
            _ => 0,
        };
        if own + charge <= share {
            // Under its share: evict from the largest lane until it fits.
            while st.total_bytes + charge > config.max_buffered_bytes {
                let Some(victim) = largest_lane(st) else {
                    break;
                };
                if !evict_oldest(st, victim) {
                    break;
                }
                evicted += 1;
            }
        } else if config.policy == DropPolicy::DropOldest {
            while st.total_bytes + charge > config.max_buffered_bytes {
                if !evict_oldest(st, id) {
                    break;
                }
                evicted += 1;
            }
        }
        if st.total_bytes + charge > config.max_buffered_bytes {
            if let Some(lane) = st.lanes.get_mut(id) {
                lane.stats.dropped_budget += 1;
            }
            return PushOutcome::DroppedBudget;
        }
    }
    let Some(lane) = st.lanes.get_mut(id) else {
        return PushOutcome::Closed;
    };
    lane.items.push_back((item, charge));
    lane.trim.pushed(lane.items.len());
    lane.bytes += charge;
    let enqueue = !lane.in_ready;
    lane.in_ready = true;
    st.total_bytes += charge;
    if enqueue {
        st.ready.push_back(id);
    }
    PushOutcome::Queued { evicted }
}

fn largest_lane<T>(st: &State<T>) -> Option<usize> {
    st.lanes
        .iter()
        .map(|(i, l)| (i, l.bytes))
        .filter(|(_, b)| *b > 0)
        .max_by_key(|(_, b)| *b)
        .map(|(i, _)| i)
}

/// Evicts `id`'s oldest item for the global budget. A closed lane left empty is
/// freed (nobody else would free it: its producer is gone and the consumer will not
/// find it ready).
fn evict_oldest<T>(st: &mut State<T>, id: usize) -> bool {
    let Some(lane) = st.lanes.get_mut(id) else {
        return false;
    };
    let Some((_, c)) = lane.items.pop_front() else {
        return false;
    };
    lane.bytes -= c;
    lane.stats.dropped_budget += 1;
    let freed = lane.items.is_empty() && !lane.open;
    st.total_bytes -= c;
    if freed {
        free_lane(st, id);
    }
    true
}

impl<T> Drop for Lane<T> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.open_lanes = st.open_lanes.saturating_sub(1);
        let empty = match st.lanes.get_mut(self.id) {
            Some(lane) => {
                lane.open = false;
                lane.items.is_empty()
            }
            _ => false,
        };
        if empty {
            free_lane(&mut st, self.id);
        }
    }
}

#[cfg(test)]
mod tests;
