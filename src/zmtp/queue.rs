//! The sans-IO part of a publisher's fan-out: messages encoded once (small ones into
//! shared arenas) and each subscriber's queue, charged for the memory it keeps alive.
//! No I/O, no clock, no lock: `PubSocket` drives it under its own lock.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::Message;
use super::codec::{encode_message, encoded_len};
use crate::slots::SlotTrim;

/// Size of one encoding arena.
const ARENA_SIZE: usize = 64 << 10;
/// Messages larger than this get their own allocation.
const ARENA_MAX_MESSAGE: usize = 8 << 10;
/// Below this `send_queue_bytes`, every message gets its own allocation: a queue
/// charged a whole arena per message it holds would hold too few.
pub(crate) const ARENA_MIN_QUEUE_BYTES: usize = 1 << 20;

/// Small messages are encoded back to back into a shared buffer and split off, so a
/// send allocates once per `ARENA_SIZE` bytes instead of once per message. A message
/// in a queue keeps its whole arena alive, so queues are charged per arena (see
/// [`Queue`]).
#[derive(Debug, Default)]
pub(crate) struct Arena {
    buf: BytesMut,
    /// Identifies the current arena; 0 means "own allocation".
    id: u64,
}

impl Arena {
    /// Encodes `msg` once, into the arena when it is small and arenas are enabled.
    pub(crate) fn encode(&mut self, msg: &Message, use_arena: bool) -> Encoded {
        let len = encoded_len(msg);
        if !use_arena || len > ARENA_MAX_MESSAGE {
            let mut buf = BytesMut::with_capacity(len);
            encode_message(msg, &mut buf);
            return Encoded {
                bytes: buf.freeze(),
                arena: 0,
            };
        }
        if self.buf.capacity() - self.buf.len() < len || self.id == 0 {
            self.buf = BytesMut::with_capacity(ARENA_SIZE);
            self.id += 1;
        }
        encode_message(msg, &mut self.buf);
        Encoded {
            bytes: self.buf.split().freeze(),
            arena: self.id,
        }
    }
}

/// One encoded message and the arena it lives in (0: its own allocation).
#[derive(Debug, Clone)]
pub(crate) struct Encoded {
    bytes: Bytes,
    arena: u64,
}

/// One subscriber's queue, charged for the memory it keeps alive: a message with its
/// own allocation costs its length; messages sharing an arena cost that whole arena,
/// once for all of them. Arenas are filled in send order and queues hold messages in
/// send order, so the arena ids of a queue's arena messages never decrease: the queue
/// keeps one run (id, count) per arena it holds messages of. Its slots are charged
/// too ([`held`](Queue::held)): a queue that keeps a burst's slots is counted and
/// capped like the rest.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    items: VecDeque<Encoded>,
    arenas: VecDeque<(u64, usize)>,
    charge: usize,
    /// Gives a burst's slots back when the queue stays low (not on every drain: a
    /// queue that fills and drains every round keeps its slots).
    trim: SlotTrim,
}

impl Queue {
    /// What pushing `e` would add to the charge.
    pub(crate) fn cost(&self, e: &Encoded) -> usize {
        match e.arena {
            0 => e.bytes.len(),
            id if self.arenas.back().is_some_and(|(last, _)| *last == id) => 0,
            _ => ARENA_SIZE,
        }
    }

    /// Queues `e`, whose [`cost`](Self::cost) the caller computed.
    pub(crate) fn push(&mut self, e: Encoded, cost: usize) {
        self.charge += cost;
        if e.arena != 0 {
            match self.arenas.back_mut() {
                Some((_, count)) if cost == 0 => *count += 1,
                _ => self.arenas.push_back((e.arena, 1)),
            }
        }
        self.items.push_back(e);
        self.trim.pushed(self.items.len());
    }

    pub(crate) fn pop(&mut self) -> Option<Bytes> {
        let e = self.items.pop_front()?;
        if e.arena == 0 {
            self.charge -= e.bytes.len();
        } else if let Some((_, count)) = self.arenas.front_mut() {
            // The front run is this message's arena (ids never decrease).
            *count -= 1;
            if *count == 0 {
                self.arenas.pop_front();
                self.charge -= ARENA_SIZE;
            }
        }
        self.trim.popped(&mut self.items, false);
        Some(e.bytes)
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    /// Memory the queue keeps alive: its charge and its slots.
    pub(crate) fn held(&self) -> usize {
        self.charge + self.items.capacity() * std::mem::size_of::<Encoded>()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Queue {
        fn push_new(&mut self, e: Encoded) {
            let cost = self.cost(&e);
            self.push(e, cost);
        }
    }

    fn encoded(arena: u64, len: usize) -> Encoded {
        Encoded {
            bytes: Bytes::from(vec![0u8; len]),
            arena,
        }
    }

    #[test]
    fn queues_pay_one_arena_per_run_whatever_sits_between() {
        let mut q = Queue::default();
        q.push_new(encoded(1, 10));
        q.push_new(encoded(0, 20_000)); // an own allocation between two of arena 1
        q.push_new(encoded(1, 10));
        q.push_new(encoded(2, 10));
        assert_eq!(q.charge, 2 * ARENA_SIZE + 20_000);
        assert_eq!(q.cost(&encoded(2, 10)), 0);
        assert_eq!(q.cost(&encoded(3, 10)), ARENA_SIZE);
        q.pop();
        assert_eq!(q.charge, 2 * ARENA_SIZE + 20_000);
        q.pop();
        assert_eq!(q.charge, 2 * ARENA_SIZE);
        q.pop();
        assert_eq!(q.charge, ARENA_SIZE);
        q.pop();
        assert_eq!((q.charge, q.len()), (0, 0));
        assert!(q.pop().is_none());
    }

    #[test]
    fn a_drained_queue_gives_back_its_slots() {
        let mut q = Queue::default();
        for _ in 0..10_000 {
            q.push_new(encoded(0, 1));
        }
        while q.pop().is_some() {}
        // Drained but not trimmed yet: its slots are charged.
        assert!(q.held() >= 10_000 * std::mem::size_of::<Encoded>());
        // Then a quiet period: one message at a time, for two trim windows.
        for _ in 0..40_000 {
            q.push_new(encoded(0, 1));
            q.pop();
        }
        assert!(
            q.items.capacity() <= 2 * crate::slots::IDLE_SLOTS,
            "{}",
            q.items.capacity()
        );
        assert_eq!(q.charge, 0);
    }
}
