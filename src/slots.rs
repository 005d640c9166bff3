//! Slots, shared by the subscriber's lanes and the publisher's per-subscriber queues:
//! the table that gives each lane or peer a reusable index ([`Slab`]), and when a queue
//! that grew during a burst gives its spare slots back ([`SlotTrim`]).

use std::collections::VecDeque;

/// Slots a trimmed queue keeps however empty.
pub(crate) const IDLE_SLOTS: usize = 64;

/// Watches one `VecDeque` and shrinks it when, over as many pops as it has slots, it
/// never held more than a quarter of them (a queue that fills and drains every round
/// keeps its slots: no reallocation churn), and optionally frees them all as soon as it
/// drains.
#[derive(Debug, Default)]
pub(crate) struct SlotTrim {
    /// Most items held since the last check.
    high: usize,
    /// Pops since the last check.
    pops: usize,
}

impl SlotTrim {
    /// After a push: `len` items are held now.
    pub(crate) fn pushed(&mut self, len: usize) {
        self.high = self.high.max(len);
    }

    /// After a pop from `items`; with `on_drain`, a queue left empty gives all its
    /// slots back at once.
    pub(crate) fn popped<T>(&mut self, items: &mut VecDeque<T>, on_drain: bool) {
        self.pops += 1;
        let capacity = items.capacity();
        if on_drain && items.is_empty() && capacity > 0 {
            // An idle lane among thousands holds nothing: its next burst allocates
            // again (a few small allocations per drained batch).
            *items = VecDeque::new();
            *self = SlotTrim::default();
        } else if self.pops >= capacity {
            if capacity > IDLE_SLOTS && self.high < capacity / 4 {
                items.shrink_to((2 * self.high).max(IDLE_SLOTS));
            }
            self.pops = 0;
            self.high = items.len();
        }
    }
}

/// A table of values under reusable indices: a freed index is handed out again before
/// the table grows, so indices stay dense under churn.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    /// Stores `value`; returns its index.
    pub(crate) fn insert(&mut self, value: T) -> usize {
        if let Some(id) = self.free.pop() {
            if let Some(slot) = self.slots.get_mut(id) {
                *slot = Some(value);
                return id;
            }
        }
        self.slots.push(Some(value));
        self.slots.len() - 1
    }

    /// Takes the value at `id` out; its index is reused by a later insert.
    pub(crate) fn remove(&mut self, id: usize) -> Option<T> {
        let value = self.slots.get_mut(id)?.take()?;
        self.free.push(id);
        Some(value)
    }

    pub(crate) fn get(&self, id: usize) -> Option<&T> {
        self.slots.get(id)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, id: usize) -> Option<&mut T> {
        self.slots.get_mut(id)?.as_mut()
    }

    /// The values held, with their indices.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.as_ref().map(|v| (i, v)))
    }

    /// Values held.
    pub(crate) fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_reuses_freed_indices() {
        let mut slab = Slab::default();
        let (a, b) = (slab.insert("a"), slab.insert("b"));
        assert_eq!((a, b, slab.len()), (0, 1, 2));
        assert_eq!(slab.remove(a), Some("a"));
        assert_eq!(slab.remove(a), None);
        assert_eq!(slab.get(a), None);
        assert_eq!(slab.insert("c"), a);
        assert_eq!(slab.iter().collect::<Vec<_>>(), vec![(0, &"c"), (1, &"b")]);
        *slab.get_mut(b).unwrap() = "d";
        assert_eq!(
            (slab.get(b), slab.len(), slab.get(9)),
            (Some(&"d"), 2, None)
        );
    }

    /// A burst of 10 000, drained, then one item at a time: trimmed after two windows,
    /// or at once with `on_drain`.
    fn burst_then_trickle(on_drain: bool, trickle: usize) -> usize {
        let mut items = VecDeque::new();
        let mut trim = SlotTrim::default();
        for i in 0..10_000 {
            items.push_back(i);
            trim.pushed(items.len());
        }
        while items.pop_front().is_some() {
            trim.popped(&mut items, on_drain);
        }
        for i in 0..trickle {
            items.push_back(i);
            trim.pushed(items.len());
            items.pop_front();
            trim.popped(&mut items, on_drain);
        }
        items.capacity()
    }

    #[test]
    fn bursts_give_their_slots_back() {
        assert!(burst_then_trickle(true, 0) <= 2 * IDLE_SLOTS);
        assert!(burst_then_trickle(false, 0) > 4 * IDLE_SLOTS);
        assert!(burst_then_trickle(false, 40_000) <= 2 * IDLE_SLOTS);
    }

    #[test]
    fn a_queue_that_refills_keeps_its_slots() {
        let mut items = VecDeque::new();
        let mut trim = SlotTrim::default();
        let mut capacities = std::collections::BTreeSet::new();
        for _ in 0..50 {
            for i in 0..4000 {
                items.push_back(i);
                trim.pushed(items.len());
            }
            while items.len() > 1 {
                items.pop_front();
                trim.popped(&mut items, false);
            }
            capacities.insert(items.capacity());
        }
        assert_eq!(capacities.len(), 1, "{capacities:?}");
    }
}
