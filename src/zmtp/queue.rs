//! The sans-IO part of a publisher's fan-out: each message encoded once, into chunks
//! shared by every subscriber it is queued for, and each subscriber's queue as *runs*
//! of messages lying back to back in a chunk, so that queueing a message for one more
//! subscriber usually only moves the end of that subscriber's last run, and its writer
//! hands a whole run to the kernel as one slice (no copy per subscriber, no reference
//! count per message).
//!
//! No I/O, no clock, no lock: `PubSocket` drives it under its own lock.
//!
//! What a subscriber is charged ([`Queue::held`]) is what its queue keeps alive: a
//! chunk of small messages costs its whole allocation, once however many of the
//! subscriber's runs lie in it; a message with an allocation of its own costs its
//! length; the queue's slots cost their size.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::Message;
use super::codec::{encode_message, encoded_len};
use crate::slots::{Slab, SlotTrim};

/// Size of one chunk small messages are encoded into.
pub(crate) const CHUNK_SIZE: usize = 64 << 10;
/// Messages larger than this get an allocation of their own.
const CHUNK_MAX_MESSAGE: usize = 8 << 10;
/// A chunk is frozen piece by piece (whenever a writer takes messages that were not
/// frozen yet); one that was frozen this many times is retired early, so the list of
/// its pieces stays small whatever the send pattern.
const MAX_PIECES: usize = 64;
/// Below this many unfrozen bytes a writer copies what it takes of them rather than
/// freezing them into a piece (see [`Chunks::slices`]): a chunk has at most
/// `CHUNK_SIZE / FREEZE_MIN` pieces but for the last one, well below [`MAX_PIECES`].
const FREEZE_MIN: usize = 2 << 10;
/// What a message with an allocation of its own costs beyond its length: its entry in
/// the table of chunks and its list of one piece.
const OWN_OVERHEAD: usize = 128;
/// Below this `send_queue_bytes`, every message gets its own allocation: a queue
/// charged a whole chunk per message it holds would hold too few.
pub(crate) const CHUNKS_MIN_QUEUE_BYTES: usize = 1 << 20;

/// Where a message was encoded: its chunk and its byte range within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    chunk: usize,
    start: usize,
    end: usize,
    /// It has an allocation of its own (else it shares a chunk).
    own: bool,
}

impl Placed {
    /// The chunk it lies in.
    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }

    /// Encoded length.
    pub(crate) fn len(&self) -> usize {
        self.end - self.start
    }
}

/// A slice of queued bytes as [`Queue::take`] hands it out: a handle on a frozen
/// piece of a chunk, or bytes of the chunk being filled that the taker copies (a
/// writer keeping up with its sender takes a few messages at a time; copying them
/// where they go costs less than an allocation of their own).
#[derive(Debug)]
pub(crate) enum Piece<'a> {
    Shared(Bytes),
    Copied(&'a [u8]),
}

/// One allocation messages were encoded into.
#[derive(Debug)]
struct Chunk {
    /// Frozen pieces in order, each beginning where the previous one ends: (offset in
    /// the chunk, bytes).
    pieces: Vec<(usize, Bytes)>,
    /// Bytes encoded into it so far, frozen or not.
    len: usize,
    /// Its own allocation for one large message (else a shared chunk).
    own: bool,
    /// Runs, in all queues, lying in it: it is freed when none is left and it is no
    /// longer the chunk being filled.
    runs: usize,
}

/// What a queue holding messages of a shared chunk is charged for it: its
/// allocation and its list of pieces at their largest.
const SHARED_CHUNK_CHARGE: usize = CHUNK_SIZE + MAX_PIECES * std::mem::size_of::<(usize, Bytes)>();

impl Chunk {
    /// What a queue holding messages of this chunk is charged for it.
    fn charge(&self) -> usize {
        if self.own {
            self.len + OWN_OVERHEAD
        } else {
            SHARED_CHUNK_CHARGE
        }
    }
}

/// The chunks of one publisher: the one small messages are encoded into now, and
/// every older one some queue still holds a run of.
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    chunks: Slab<Chunk>,
    /// The chunk being filled, and the part of it not frozen yet (its spare capacity
    /// is where the next messages go).
    current: Option<usize>,
    tail: BytesMut,
}

impl Chunks {
    /// Encodes `msg` once: into the current chunk when it is small and `shared`,
    /// else into an allocation of its own.
    pub(crate) fn place(&mut self, msg: &Message, shared: bool) -> Placed {
        let len = encoded_len(msg);
        if !shared || len > CHUNK_MAX_MESSAGE {
            let mut buf = BytesMut::with_capacity(len);
            encode_message(msg, &mut buf);
            let chunk = self.chunks.insert(Chunk {
                pieces: vec![(0, buf.freeze())],
                len,
                own: true,
                runs: 0,
            });
            return Placed {
                chunk,
                start: 0,
                end: len,
                own: true,
            };
        }
        let room = self.tail.capacity() - self.tail.len();
        let current = match self.current.and_then(|id| Some((id, self.chunks.get(id)?))) {
            Some((id, c)) if room >= len && c.pieces.len() < MAX_PIECES => id,
            _ => self.start_chunk(),
        };
        encode_message(msg, &mut self.tail);
        let Some(chunk) = self.chunks.get_mut(current) else {
            unreachable!("the current chunk is in the table");
        };
        chunk.len += len;
        Placed {
            chunk: current,
            start: chunk.len - len,
            end: chunk.len,
            own: false,
        }
    }

    /// Retires the current chunk (freed once no run lies in it) and starts another.
    fn start_chunk(&mut self) -> usize {
        self.freeze();
        if let Some(old) = self.current.take() {
            self.release_if_unused(old);
        }
        self.tail = BytesMut::with_capacity(CHUNK_SIZE);
        let id = self.chunks.insert(Chunk {
            pieces: Vec::new(),
            len: 0,
            own: false,
            runs: 0,
        });
        self.current = Some(id);
        id
    }

    /// Freezes what was encoded into the current chunk since it was last frozen.
    fn freeze(&mut self) {
        if self.tail.is_empty() {
            return;
        }
        let piece = self.tail.split().freeze();
        if let Some(chunk) = self.current.and_then(|id| self.chunks.get_mut(id)) {
            chunk.pieces.push((chunk.len - piece.len(), piece));
        }
    }

    /// Frees a chunk no run lies in, unless it is being filled.
    pub(crate) fn release_if_unused(&mut self, id: usize) {
        if self.current != Some(id) && self.chunks.get(id).is_some_and(|c| c.runs == 0) {
            self.chunks.remove(id);
        }
    }

    /// Appends the bytes of `run` to `out` as slices of its chunk's pieces (one slice
    /// unless the run was encoded across several freezes).
    /// The part of a run in the current chunk's unfrozen tail is copied out when the
    /// tail holds less than [`FREEZE_MIN`] (a writer keeping up with a slow sender
    /// would otherwise freeze a piece per message, and the chunk would be retired
    /// nearly empty); from that size on it is frozen and sliced like the rest.
    fn slices(&mut self, run: &Run, mut out: impl FnMut(Piece<'_>)) {
        if run.start == run.end {
            return;
        }
        let tail_start = self.tail_start();
        let in_tail = self.current == Some(run.chunk) && tail_start < run.end;
        let copy_tail = in_tail && self.tail.len() < FREEZE_MIN;
        if in_tail && !copy_tail {
            self.freeze();
        }
        let Some(chunk) = self.chunks.get(run.chunk) else {
            return;
        };
        let first = chunk
            .pieces
            .partition_point(|(at, piece)| at + piece.len() <= run.start);
        for (at, piece) in chunk.pieces.iter().skip(first) {
            if *at >= run.end {
                break;
            }
            let from = run.start.saturating_sub(*at);
            let to = (run.end - at).min(piece.len());
            out(Piece::Shared(piece.slice(from..to)));
        }
        if copy_tail {
            let from = run.start.max(tail_start) - tail_start;
            let to = run.end - tail_start;
            if let Some(bytes) = self.tail.get(from..to) {
                out(Piece::Copied(bytes));
            }
        }
    }

    /// Offset in the current chunk where its unfrozen part begins.
    fn tail_start(&self) -> usize {
        let len = self
            .current
            .and_then(|id| self.chunks.get(id))
            .map_or(0, |c| c.len);
        len - self.tail.len()
    }

    fn charge(&self, id: usize) -> usize {
        self.chunks.get(id).map_or(0, Chunk::charge)
    }

    fn is_own(&self, id: usize) -> bool {
        self.chunks.get(id).is_some_and(|c| c.own)
    }

    fn add_run(&mut self, id: usize) {
        if let Some(c) = self.chunks.get_mut(id) {
            c.runs += 1;
        }
    }

    fn drop_run(&mut self, id: usize) {
        if let Some(c) = self.chunks.get_mut(id) {
            c.runs -= 1;
        }
        self.release_if_unused(id);
    }

    /// Chunks alive (being filled, or holding a run of some queue).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.chunks.len()
    }
}

/// Messages lying back to back in one chunk, queued for one subscriber.
#[derive(Debug, Clone, Copy)]
struct Run {
    chunk: usize,
    start: usize,
    end: usize,
    messages: usize,
}

/// One subscriber's queue: runs, in send order. A run holds its chunk alive; the
/// queue is charged for what it keeps alive (see the module docs), and its slots
/// too ([`held`](Queue::held)): a queue that keeps a burst's slots is counted and
/// capped like the rest.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    runs: VecDeque<Run>,
    /// The shared chunks this queue has runs in, in order, with how many runs: one
    /// charge per chunk however many runs lie in it, whatever lies between them.
    shared: VecDeque<(usize, usize)>,
    messages: usize,
    charge: usize,
    /// Gives a burst's slots back when the queue stays low (not on every drain: a
    /// queue that fills and drains every round keeps its slots).
    trim: SlotTrim,
}

/// What one [`Queue::take`] handed to a writer.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) messages: usize,
    pub(crate) bytes: usize,
}

impl Queue {
    /// What queueing `placed` would add to the charge.
    pub(crate) fn cost(&self, placed: &Placed) -> usize {
        if placed.own {
            placed.len() + OWN_OVERHEAD
        } else if self.shared.back().is_some_and(|(c, _)| *c == placed.chunk) {
            0
        } else {
            SHARED_CHUNK_CHARGE
        }
    }

    /// Queues `placed`, whose [`cost`](Self::cost) the caller computed.
    pub(crate) fn push(&mut self, chunks: &mut Chunks, placed: &Placed, cost: usize) {
        self.messages += 1;
        self.charge += cost;
        if let Some(run) = self.runs.back_mut() {
            if run.chunk == placed.chunk && run.end == placed.start {
                run.end = placed.end;
                run.messages += 1;
                return;
            }
        }
        if !placed.own {
            match self.shared.back_mut() {
                Some((c, runs)) if *c == placed.chunk => *runs += 1,
                _ => self.shared.push_back((placed.chunk, 1)),
            }
        }
        chunks.add_run(placed.chunk);
        self.runs.push_back(Run {
            chunk: placed.chunk,
            start: placed.start,
            end: placed.end,
            messages: 1,
        });
        self.trim.pushed(self.runs.len());
    }

    /// Hands whole runs, oldest first, to `out` as slices with what each keeps alive
    /// (the charge of its chunk on the last slice taken from that chunk, 0 on the
    /// others), until about `budget` bytes or `max_runs` runs were taken. A
    /// [`Piece::Copied`] is always the last slice of its run.
    pub(crate) fn take(
        &mut self,
        chunks: &mut Chunks,
        budget: usize,
        max_runs: usize,
        mut out: impl FnMut(Piece<'_>, usize),
    ) -> Taken {
        let mut taken = Taken::default();
        let mut pending: Option<(Bytes, usize)> = None;
        for _ in 0..max_runs {
            if taken.bytes >= budget {
                break;
            }
            let Some(run) = self.runs.pop_front() else {
                break;
            };
            let own = chunks.is_own(run.chunk);
            let charge = chunks.charge(run.chunk);
            let last_of_chunk = self.runs.front().is_none_or(|r| r.chunk != run.chunk);
            let mut emitted = false;
            chunks.slices(&run, |piece| {
                if let Some((prev, c)) = pending.take() {
                    out(Piece::Shared(prev), c);
                }
                match piece {
                    Piece::Shared(b) => pending = Some((b, 0)),
                    // The run's last slice: it goes at once (it borrows the chunk
                    // being filled), with the charge the run's last slice carries.
                    copied @ Piece::Copied(_) => {
                        out(copied, if last_of_chunk { charge } else { 0 })
                    }
                }
                emitted = true;
            });
            if last_of_chunk && emitted {
                if let Some((_, c)) = pending.as_mut() {
                    *c = charge;
                }
            }
            self.messages -= run.messages;
            taken.messages += run.messages;
            taken.bytes += run.end - run.start;
            if own {
                self.charge -= charge;
            } else if let Some((_, runs)) = self.shared.front_mut() {
                // The front entry is this run's chunk: runs leave in the order they came.
                *runs -= 1;
                if *runs == 0 {
                    self.shared.pop_front();
                    self.charge -= charge;
                }
            }
            chunks.drop_run(run.chunk);
            self.trim.popped(&mut self.runs, false);
        }
        if let Some((b, c)) = pending {
            out(Piece::Shared(b), c);
        }
        taken
    }

    /// Empties the queue (the connection is gone), letting go of its chunks.
    pub(crate) fn clear(&mut self, chunks: &mut Chunks) {
        for run in self.runs.drain(..) {
            chunks.drop_run(run.chunk);
        }
        self.shared.clear();
        self.messages = 0;
        self.charge = 0;
    }

    /// Messages queued.
    pub(crate) fn len(&self) -> usize {
        self.messages
    }

    /// Memory the queue keeps alive: its charge and its slots.
    pub(crate) fn held(&self) -> usize {
        self.charge
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.shared.capacity() * std::mem::size_of::<(usize, usize)>()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.messages == 0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    impl Piece<'_> {
        fn bytes(&self) -> &[u8] {
            match self {
                Piece::Shared(b) => b,
                Piece::Copied(b) => b,
            }
        }
    }

    impl Queue {
        fn push_new(&mut self, chunks: &mut Chunks, placed: &Placed) {
            let cost = self.cost(placed);
            self.push(chunks, placed, cost);
        }

        /// Takes everything; returns the bytes in order and the charges handed out.
        fn take_all(&mut self, chunks: &mut Chunks) -> (Vec<u8>, Vec<usize>, Taken) {
            let (mut bytes, mut charges) = (Vec::new(), Vec::new());
            let taken = self.take(chunks, usize::MAX, usize::MAX, |b, c| {
                bytes.extend_from_slice(b.bytes());
                charges.push(c);
            });
            (bytes, charges, taken)
        }
    }

    fn msg(body: &[u8]) -> Message {
        Message::from_parts([Bytes::copy_from_slice(body)])
    }

    fn wire(bodies: &[&[u8]]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        for b in bodies {
            encode_message(&msg(b), &mut buf);
        }
        buf.to_vec()
    }

    #[test]
    fn back_to_back_messages_form_one_run_and_leave_as_one_slice() {
        let mut chunks = Chunks::default();
        let (mut a, mut b) = (Queue::default(), Queue::default());
        for body in [&b"one"[..], b"two", b"three"] {
            let p = chunks.place(&msg(body), true);
            a.push_new(&mut chunks, &p);
            b.push_new(&mut chunks, &p);
        }
        assert_eq!((a.runs.len(), a.len()), (1, 3));
        let (bytes, charges, taken) = a.take_all(&mut chunks);
        assert_eq!(bytes, wire(&[b"one", b"two", b"three"]));
        assert_eq!(charges, vec![Chunk::charge(chunks.chunks.get(0).unwrap())]);
        assert_eq!(taken.messages, 3);
        // b still holds its run: the chunk (also the current one) is alive.
        assert_eq!(b.take_all(&mut chunks).0, bytes);
        assert!(a.is_empty() && b.is_empty());
        assert_eq!(chunks.live(), 1, "only the chunk being filled is left");
    }

    #[test]
    fn a_queue_pays_one_chunk_per_run_of_chunks_whatever_lies_between() {
        let mut chunks = Chunks::default();
        let mut q = Queue::default();
        let charge = SHARED_CHUNK_CHARGE;
        let small = chunks.place(&msg(b"a"), true);
        q.push_new(&mut chunks, &small);
        let big = chunks.place(&msg(&[7u8; 20_000]), true);
        q.push_new(&mut chunks, &big);
        let small2 = chunks.place(&msg(b"b"), true);
        assert_eq!(q.cost(&small2), 0, "a new run, but a chunk already paid");
        q.push_new(&mut chunks, &small2);
        assert_eq!(q.charge, charge + big.len() + OWN_OVERHEAD);
        assert_eq!(q.runs.len(), 3);
        let (bytes, charges, taken) = q.take_all(&mut chunks);
        assert_eq!(bytes, wire(&[b"a", &[7u8; 20_000], b"b"]));
        // Each slice carries its chunk's charge (twice for the shared chunk: what the
        // connection holds is counted high, never low).
        assert_eq!(charges, vec![charge, big.len() + OWN_OVERHEAD, charge]);
        assert_eq!((taken.messages, q.charge), (3, 0));
        assert_eq!(chunks.live(), 1, "the large message's allocation was freed");
    }

    /// `early` takes after every message, `late` once at the end; both get every
    /// byte in order. Returns the pieces the chunk was frozen into and the slices
    /// `late` got.
    fn early_and_late(size: usize) -> (usize, usize) {
        let mut chunks = Chunks::default();
        let (mut early, mut late) = (Queue::default(), Queue::default());
        let mut bodies: Vec<Vec<u8>> = Vec::new();
        for i in 0..10u8 {
            let body = vec![i; size + usize::from(i)];
            let p = chunks.place(&msg(&body), true);
            early.push_new(&mut chunks, &p);
            late.push_new(&mut chunks, &p);
            let (bytes, _, _) = early.take_all(&mut chunks);
            assert_eq!(bytes, wire(&[&body]));
            bodies.push(body);
        }
        let all: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
        let mut slices = 0;
        let mut bytes = Vec::new();
        let taken = late.take(&mut chunks, usize::MAX, usize::MAX, |b, _| {
            slices += 1;
            bytes.extend_from_slice(b.bytes());
        });
        assert_eq!(taken.messages, 10);
        assert_eq!(bytes, wire(&all));
        let current = chunks.current.unwrap();
        (chunks.chunks.get(current).unwrap().pieces.len(), slices)
    }

    #[test]
    fn a_writer_keeping_up_with_small_messages_copies_them_instead_of_freezing() {
        // Each take finds less than FREEZE_MIN unfrozen: copied, nothing frozen, and
        // the late taker copies all ten at once.
        assert_eq!(early_and_late(10), (0, 1));
    }

    #[test]
    fn a_small_tail_is_handed_out_to_copy_with_its_runs_charge() {
        let mut chunks = Chunks::default();
        let mut q = Queue::default();
        let p = chunks.place(&msg(b"small"), true);
        q.push_new(&mut chunks, &p);
        let mut got = Vec::new();
        q.take(&mut chunks, usize::MAX, usize::MAX, |piece, held| {
            got.push((
                matches!(piece, Piece::Copied(_)),
                piece.bytes().to_vec(),
                held,
            ));
        });
        // Borrowed from the chunk being filled (no allocation of its own), charged like
        // the run's last slice.
        assert_eq!(got, vec![(true, wire(&[b"small"]), SHARED_CHUNK_CHARGE)]);
        assert_eq!(chunks.chunks.get(p.chunk).unwrap().pieces.len(), 0);
    }

    /// Everything `q` hands out: (copied, bytes, charge) per slice.
    fn pieces(q: &mut Queue, chunks: &mut Chunks) -> Vec<(bool, Vec<u8>, usize)> {
        let mut got = Vec::new();
        q.take(chunks, usize::MAX, usize::MAX, |piece, held| {
            got.push((
                matches!(piece, Piece::Copied(_)),
                piece.bytes().to_vec(),
                held,
            ));
        });
        got
    }

    #[test]
    fn a_run_frozen_then_copied_charges_its_copied_tail_only() {
        let mut chunks = Chunks::default();
        let (mut a, mut b) = (Queue::default(), Queue::default());
        let big = msg(&[1u8; 3000]);
        let p = chunks.place(&big, true);
        a.push_new(&mut chunks, &p);
        b.push_new(&mut chunks, &p);
        // `a` takes it: 3000 bytes unfrozen are frozen into a piece.
        assert_eq!(pieces(&mut a, &mut chunks).len(), 1);
        let p = chunks.place(&msg(b"small"), true);
        b.push_new(&mut chunks, &p);
        // `b`'s one run: the frozen piece, then the small tail copied; the charge goes
        // on the run's last slice.
        let got = pieces(&mut b, &mut chunks);
        let shape: Vec<(bool, usize)> = got.iter().map(|(c, _, h)| (*c, *h)).collect();
        assert_eq!(shape, vec![(false, 0), (true, SHARED_CHUNK_CHARGE)]);
        let bytes: Vec<u8> = got.into_iter().flat_map(|(_, b, _)| b).collect();
        assert_eq!(bytes, wire(&[&[1u8; 3000], b"small"]));
    }

    #[test]
    fn two_runs_of_one_chunk_charge_the_last_only() {
        let mut chunks = Chunks::default();
        let (mut a, mut b) = (Queue::default(), Queue::default());
        // `a` gets messages 1 and 3, `b` message 2: two runs of one chunk for `a`.
        for (body, queue) in [(&b"one"[..], 0), (b"two", 1), (b"three", 0)] {
            let p = chunks.place(&msg(body), true);
            let q = if queue == 0 { &mut a } else { &mut b };
            q.push_new(&mut chunks, &p);
        }
        let got = pieces(&mut a, &mut chunks);
        let shape: Vec<(bool, usize)> = got.iter().map(|(c, _, h)| (*c, *h)).collect();
        assert_eq!(shape, vec![(true, 0), (true, SHARED_CHUNK_CHARGE)]);
        let bytes: Vec<u8> = got.into_iter().flat_map(|(_, b, _)| b).collect();
        assert_eq!(bytes, wire(&[b"one", b"three"]));
    }

    #[test]
    fn messages_frozen_in_pieces_still_come_out_in_order() {
        // Each message alone passes FREEZE_MIN: one piece per take, a slice of each.
        assert_eq!(early_and_late(FREEZE_MIN), (10, 10));
    }

    #[test]
    fn chunks_are_freed_when_no_run_is_left_and_retired_when_full() {
        let mut chunks = Chunks::default();
        let mut q = Queue::default();
        let body = [1u8; 1000];
        // Fill several chunks; the queue holds every message.
        for _ in 0..200 {
            let p = chunks.place(&msg(&body), true);
            q.push_new(&mut chunks, &p);
        }
        assert!(chunks.live() >= 3, "{}", chunks.live());
        q.take_all(&mut chunks);
        assert_eq!(chunks.live(), 1);
        // A writer freezing after each message: at most one piece per FREEZE_MIN.
        let mut chunks = Chunks::default();
        for _ in 0..200 {
            let p = chunks.place(&msg(&[2u8; FREEZE_MIN]), true);
            q.push_new(&mut chunks, &p);
            q.take_all(&mut chunks);
            let current = chunks.current.unwrap();
            let pieces = chunks.chunks.get(current).unwrap().pieces.len();
            assert!(pieces <= CHUNK_SIZE / FREEZE_MIN, "{pieces}");
        }
        assert_eq!(chunks.live(), 1);
    }

    #[test]
    fn a_budget_takes_whole_runs_and_clear_lets_go() {
        let mut chunks = Chunks::default();
        let mut q = Queue::default();
        let other = Queue::default();
        for i in 0..4u8 {
            let p = chunks.place(&msg(&[i; 10]), false); // own allocations: one run each
            q.push_new(&mut chunks, &p);
        }
        assert_eq!(q.charge, 4 * (12 + OWN_OVERHEAD));
        let taken = q.take(&mut chunks, 15, usize::MAX, |_, _| {});
        assert_eq!(
            taken,
            Taken {
                messages: 2,
                bytes: 24
            }
        );
        let taken = q.take(&mut chunks, usize::MAX, 1, |_, _| {});
        assert_eq!(taken.messages, 1);
        q.clear(&mut chunks);
        assert_eq!((q.len(), q.charge, chunks.live()), (0, 0, 0));
        assert!(other.is_empty());
    }

    #[test]
    fn a_drained_queue_gives_back_its_slots() {
        let mut chunks = Chunks::default();
        let mut q = Queue::default();
        // Own allocations: every message its own run, so every push takes a slot.
        for _ in 0..10_000 {
            let p = chunks.place(&msg(b"x"), false);
            q.push_new(&mut chunks, &p);
        }
        q.take_all(&mut chunks);
        assert!(q.held() >= 10_000 * std::mem::size_of::<Run>());
        for _ in 0..40_000 {
            let p = chunks.place(&msg(b"x"), false);
            q.push_new(&mut chunks, &p);
            q.take(&mut chunks, usize::MAX, 1, |_, _| {});
        }
        assert!(
            q.runs.capacity() <= 2 * crate::slots::IDLE_SLOTS,
            "{}",
            q.runs.capacity()
        );
        assert_eq!((q.charge, chunks.live()), (0, 0));
    }
}
