//! What a broker may queue toward the router (DESIGN §7.2): per stream and per
//! session, every queued chunk charged its length plus a fixed overhead. Sans-IO: the
//! relay asks before queueing and gives back when the router took the chunk.

use std::collections::HashMap;

/// What each queued chunk costs beyond its bytes (its handle and queue slot).
pub const CHUNK_OVERHEAD: usize = 64;

/// The most a stream may queue, whatever the router's `welcome` allows (1 MiB).
pub const MAX_STREAM_BUFFER_BYTES: usize = 1 << 20;

/// The least a stream's limit is set to (16 KiB): a smaller `welcome` value is raised.
pub const MIN_STREAM_BUFFER_BYTES: usize = 16 << 10;

/// The most one session may queue over all its streams (64 MiB).
pub const MAX_SESSION_BUFFER_BYTES: usize = 64 << 20;

/// What a broker relay reads from its publisher at once (16 KiB): its read buffer,
/// held for the stream's life, and the largest chunk it queues.
pub const RELAY_READ_BYTES: usize = 16 << 10;

/// What HTTP/2 may hold per stream beyond the budget (32 KiB): a chunk's budget comes
/// back when hyper takes it, and h2 then buffers at most this much of the stream
/// until the connection writes it (its send buffer is capped at this size).
pub const H2_SEND_BUFFER_BYTES: usize = 32 << 10;

/// Bytes one relayed stream may hold outside the [`RelayBudget`] (80 KiB): the relay's
/// read buffer, the chunk hyper took and waits to hand h2, and h2's send buffer, which
/// takes a whole chunk while under its cap (so the cap plus one chunk). A
/// broker's relay memory is at most its session budget plus this per open stream
/// (plus the bus connection's TLS buffers), whatever the router does.
pub const PER_STREAM_UNCHARGED_BYTES: usize =
    RELAY_READ_BYTES + RELAY_READ_BYTES + H2_SEND_BUFFER_BYTES + RELAY_READ_BYTES;

/// Which limit a chunk would have broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Overflow {
    /// The stream's own limit.
    #[error("the stream's buffer is full")]
    Stream,
    /// The session's total.
    #[error("the session's buffer is full")]
    Session,
}

/// The byte accounting of one broker session's streams.
///
/// ```
/// use eventplane::tunnel::protocol::{Overflow, RelayBudget, CHUNK_OVERHEAD};
/// let mut budget = RelayBudget::new(16 << 10, 64 << 20);
/// budget.open(1);
/// budget.charge(1, 1000)?;
/// assert_eq!(budget.charge(2, 10), Err(Overflow::Stream)); // never opened
/// assert_eq!(budget.queued(1), 1000 + CHUNK_OVERHEAD);
/// // A router that never reads: the stream's limit is reached, the stream must reset.
/// assert_eq!(budget.charge(1, 16 << 10), Err(Overflow::Stream));
/// budget.release(1, 1000);
/// assert_eq!(budget.queued(1), 0);
/// # Ok::<(), Overflow>(())
/// ```
#[derive(Debug, Clone)]
pub struct RelayBudget {
    stream_limit: usize,
    session_limit: usize,
    total: usize,
    high_water: usize,
    streams: HashMap<u64, usize>,
}

impl RelayBudget {
    /// Limits per stream (clamped to 16 KiB ..= 1 MiB) and per session (at most
    /// 64 MiB).
    pub fn new(stream_limit: usize, session_limit: usize) -> RelayBudget {
        RelayBudget {
            stream_limit: stream_limit.clamp(MIN_STREAM_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES),
            session_limit: session_limit.min(MAX_SESSION_BUFFER_BYTES),
            total: 0,
            high_water: 0,
            streams: HashMap::new(),
        }
    }

    /// The effective per-stream limit.
    pub fn stream_limit(&self) -> usize {
        self.stream_limit
    }

    /// Starts accounting for `stream` (nothing queued).
    pub fn open(&mut self, stream: u64) {
        self.streams.entry(stream).or_insert(0);
    }

    /// Charges a chunk of `len` bytes (plus [`CHUNK_OVERHEAD`]) to `stream`, or says
    /// which limit it would break (and charges nothing). A stream not opened, or
    /// already closed, takes nothing ([`Overflow::Stream`]).
    pub fn charge(&mut self, stream: u64, len: usize) -> Result<(), Overflow> {
        let cost = len.saturating_add(CHUNK_OVERHEAD);
        let Some(&queued) = self.streams.get(&stream) else {
            return Err(Overflow::Stream);
        };
        if queued.saturating_add(cost) > self.stream_limit {
            return Err(Overflow::Stream);
        }
        if self.total.saturating_add(cost) > self.session_limit {
            return Err(Overflow::Session);
        }
        self.streams.insert(stream, queued + cost);
        self.total += cost;
        self.high_water = self.high_water.max(self.total);
        Ok(())
    }

    /// Gives back a chunk of `len` bytes the router took from `stream`.
    pub fn release(&mut self, stream: u64, len: usize) {
        let cost = len.saturating_add(CHUNK_OVERHEAD);
        if let Some(queued) = self.streams.get_mut(&stream) {
            let freed = cost.min(*queued);
            *queued -= freed;
            self.total -= freed;
        }
    }

    /// Ends `stream`, giving back everything it still had queued; returns that.
    pub fn close(&mut self, stream: u64) -> usize {
        let freed = self.streams.remove(&stream).unwrap_or(0);
        self.total -= freed;
        freed
    }

    /// What `stream` has queued now, overheads included.
    pub fn queued(&self, stream: u64) -> usize {
        self.streams.get(&stream).copied().unwrap_or(0)
    }

    /// What the session has queued now, overheads included.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The most the session ever had queued.
    pub fn high_water(&self) -> usize {
        self.high_water
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn limits_are_clamped_to_the_documented_range() {
        assert_eq!(
            RelayBudget::new(10, 1 << 30).stream_limit(),
            MIN_STREAM_BUFFER_BYTES
        );
        assert_eq!(
            RelayBudget::new(1 << 30, 1 << 30).stream_limit(),
            MAX_STREAM_BUFFER_BYTES
        );
        let mut b = RelayBudget::new(1 << 20, 1 << 40);
        // The session cap holds whatever was asked: 80 streams of up to 1 MiB each
        // would queue 80 MiB.
        for s in 0..80 {
            b.open(s);
            while b.charge(s, 16 << 10).is_ok() {}
        }
        b.open(99);
        assert!(b.total() <= MAX_SESSION_BUFFER_BYTES);
        assert_eq!(b.charge(99, 16 << 10), Err(Overflow::Session));
    }

    #[test]
    fn the_session_limit_binds_across_streams_and_release_restores_room() {
        let mut b = RelayBudget::new(64 << 10, 100 << 10);
        for s in 1..=3 {
            b.open(s);
        }
        b.charge(1, 60 << 10).unwrap();
        assert_eq!(b.charge(1, 8 << 10), Err(Overflow::Stream));
        b.charge(2, 30 << 10).unwrap();
        assert_eq!(b.charge(3, 20 << 10), Err(Overflow::Session));
        assert_eq!(b.high_water(), (90 << 10) + 2 * CHUNK_OVERHEAD);
        b.release(1, 60 << 10);
        b.charge(3, 20 << 10).unwrap();
        assert_eq!(b.close(2), (30 << 10) + CHUNK_OVERHEAD);
        assert_eq!(b.total(), (20 << 10) + CHUNK_OVERHEAD);
        // Releasing more than was charged (a bug upstream) never underflows.
        b.release(3, 1 << 30);
        assert_eq!(b.total(), 0);
        // A closed stream takes nothing more.
        assert_eq!(b.charge(2, 1), Err(Overflow::Stream));
    }

    #[test]
    fn every_chunk_pays_the_overhead() {
        // 1,000 empty chunks on a 16 KiB stream: the overhead alone fills it.
        let mut b = RelayBudget::new(16 << 10, 64 << 20);
        b.open(7);
        let fits = (0..1000).take_while(|_| b.charge(7, 0).is_ok()).count();
        assert_eq!(fits, (16 << 10) / CHUNK_OVERHEAD);
    }
}
