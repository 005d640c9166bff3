//! Accounting for read-buffer memory that received frames keep alive.
//!
//! Messages are sliced out of the connection's read buffer without copying (one
//! handle per message, on the bytes that hold its frames). A slice keeps its whole
//! allocation alive, so a small message kept for long (in a lane, in
//! the application) can pin a 64 KiB read buffer, or one grown for a large frame. When
//! a connection moves on to a fresh read buffer, the old one is *retired* here with a
//! sentinel handle: while any frame still references it, the sentinel is not unique and
//! its size counts as retained. Once every frame is gone the sentinel is the last
//! handle and pruning frees the allocation.
//!
//! Sockets consult [`Retention::over_limit`] before handing out a message: past the
//! limit, small frames are copied into an allocation of their own size, so new
//! messages pin nothing more while the old ones drain.
//!
//! The same limit bounds the read buffers connections hold between reads: while
//! their sum ([`Retention::current`]) exceeds it, each connection gives its buffer
//! back after every receive ([`Retention::reads_over_limit`]). A subscriber's
//! connections (thousands of publishers) give theirs back whenever their peer has
//! nothing more to read, so idle connections hold none.
//!
//! A connection that needs a fresh read chunk takes back a retired one no frame
//! references any more ([`Retention::reuse`]) instead of allocating one: a consumer
//! that keeps the last batch while the next is read makes two buffers alternate,
//! not an allocation (and its page faults) per chunk.
//!
//! Retiring prunes the list when it has doubled since the last prune or
//! [`PRUNE_INTERVAL`] has passed (amortised: no scan per retirement); a subscriber
//! also prunes once a second, so buffers whose frames are all gone do not linger.
//!
//! Only shared read chunks are retired here. An allocation grown for one frame larger
//! than a chunk holds nothing but that frame: whoever keeps the frame is charged its
//! size (a lane, a queue), so counting it again would be double.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

/// While over the limit, retired buffers are looked at again at most this often (each
/// look takes the lock and scans the list, which every connection would otherwise do
/// on every poll).
const PRUNE_INTERVAL: Duration = Duration::from_millis(1);

/// The list length below which `retire` does not scan it (but for the interval).
const PRUNE_MIN_LEN: usize = 64;

/// Retired buffers [`Retention::reuse`] looks at, oldest first.
const REUSE_SCAN: usize = 8;

/// Read buffers retired by one or more connections, with their sizes.
#[derive(Debug)]
pub(crate) struct Retention {
    limit: usize,
    /// Sum of the sizes in `retired`.
    bytes: AtomicUsize,
    retired: Mutex<Vec<(Bytes, usize)>>,
    /// Messages copied out because the limit was exceeded.
    copied: AtomicU64,
    /// Allocations of the read buffers connections read into now.
    current: AtomicUsize,
    /// When the list was last pruned, in nanoseconds since `epoch`.
    pruned_at: AtomicU64,
    /// `retire` prunes once the list is this long (twice what the last prune left,
    /// at least [`PRUNE_MIN_LEN`]) or [`PRUNE_INTERVAL`] has passed: a scan per
    /// retirement would cost thousands of connections a scan of the whole list each.
    prune_at_len: AtomicUsize,
    epoch: Instant,
}

impl Retention {
    /// An account whose holders copy small frames once `limit` bytes are retained.
    pub(crate) fn new(limit: usize) -> Retention {
        Retention {
            limit,
            bytes: AtomicUsize::new(0),
            retired: Mutex::new(Vec::new()),
            copied: AtomicU64::new(0),
            current: AtomicUsize::new(0),
            pruned_at: AtomicU64::new(0),
            prune_at_len: AtomicUsize::new(PRUNE_MIN_LEN),
            epoch: Instant::now(),
        }
    }

    /// A connection moved from `old` (allocated with `old_allocation` bytes) to a new
    /// read buffer of `new_allocation` bytes (0 when it closes). `old` is retired when
    /// it was a shared chunk (at most `chunk` bytes) that frames still reference.
    pub(crate) fn replace_read_buffer(
        &self,
        old: BytesMut,
        old_allocation: usize,
        new_allocation: usize,
        chunk: usize,
    ) {
        self.current.fetch_add(new_allocation, Ordering::Relaxed);
        // Saturating: a buffer allocated before this account knew about it.
        let _ = self
            .current
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(old_allocation))
            });
        if old_allocation <= chunk {
            self.retire(old, old_allocation);
        }
    }

    /// Read buffers connections read into now (what a connection costs while alive).
    pub(crate) fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// `true` while the read buffers connections hold add up to more than the limit:
    /// each should give its buffer back between reads.
    pub(crate) fn reads_over_limit(&self) -> bool {
        self.current() > self.limit
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(Bytes, usize)>> {
        self.retired.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes over a read buffer the connection no longer reads into; `allocation` is
    /// the size it was allocated with. Freed at once when nothing references it.
    pub(crate) fn retire(&self, buffer: BytesMut, allocation: usize) {
        let sentinel = buffer.freeze();
        if sentinel.is_unique() || allocation == 0 {
            return;
        }
        let mut retired = self.lock();
        retired.push((sentinel, allocation));
        self.bytes.fetch_add(allocation, Ordering::Relaxed);
        if retired.len() >= self.prune_at_len.load(Ordering::Relaxed) || self.prune_due() {
            self.prune_with(&mut retired);
        }
    }

    /// A retired buffer allocated with `size` bytes that no frame references any more,
    /// emptied to be read into again: reading on does not allocate (and fault in) a
    /// fresh buffer each time the last one is still referenced when it fills. Looks at
    /// the [`REUSE_SCAN`] oldest retirements only.
    pub(crate) fn reuse(&self, size: usize) -> Option<BytesMut> {
        let mut retired = self.lock();
        let i = retired
            .iter()
            .take(REUSE_SCAN)
            .position(|(sentinel, allocation)| *allocation == size && sentinel.is_unique())?;
        let (sentinel, allocation) = retired.remove(i);
        self.bytes.fetch_sub(allocation, Ordering::Relaxed);
        drop(retired);
        let mut buf = sentinel.try_into_mut().ok()?;
        buf.clear();
        (buf.try_reclaim(size) && buf.capacity() >= size).then_some(buf)
    }

    /// Frees every retired buffer no frame references any more.
    pub(crate) fn prune(&self) {
        let mut retired = self.lock();
        self.prune_with(&mut retired);
    }

    fn prune_with(&self, retired: &mut Vec<(Bytes, usize)>) {
        Self::prune_locked(retired, &self.bytes);
        self.pruned_at.store(self.nanos(), Ordering::Relaxed);
        let next = retired.len().saturating_mul(2).max(PRUNE_MIN_LEN);
        self.prune_at_len.store(next, Ordering::Relaxed);
    }

    /// Whether [`PRUNE_INTERVAL`] has passed since the last prune.
    fn prune_due(&self) -> bool {
        let since = self
            .nanos()
            .saturating_sub(self.pruned_at.load(Ordering::Relaxed));
        u128::from(since) >= PRUNE_INTERVAL.as_nanos()
    }

    fn nanos(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn prune_locked(retired: &mut Vec<(Bytes, usize)>, bytes: &AtomicUsize) {
        retired.retain(|(sentinel, size)| {
            let alive = !sentinel.is_unique();
            if !alive {
                bytes.fetch_sub(*size, Ordering::Relaxed);
            }
            alive
        });
    }

    /// Bytes of retired read buffers that frames still keep alive (as of the last
    /// prune).
    pub(crate) fn retained(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// `true` when more than the limit is retained even after pruning: the caller
    /// should copy small frames rather than slice them.
    pub(crate) fn over_limit(&self) -> bool {
        if self.retained() <= self.limit {
            return false;
        }
        if self.prune_due() {
            self.prune();
        }
        self.retained() > self.limit
    }

    /// Counts a message copied out under pressure.
    pub(crate) fn note_copied(&self) {
        self.copied.fetch_add(1, Ordering::Relaxed);
    }

    /// Messages copied out under pressure so far.
    pub(crate) fn copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retired_buffers_count_until_their_frames_are_gone() {
        let account = Retention::new(100);
        let mut buf = BytesMut::with_capacity(1024);
        buf.extend_from_slice(&[7u8; 300]);
        let frame = buf.split_to(10).freeze();
        account.retire(buf, 1024);
        assert_eq!(account.retained(), 1024);
        assert!(account.over_limit());
        drop(frame);
        account.prune();
        assert!(!account.over_limit());
        assert_eq!(account.retained(), 0);
    }

    #[test]
    fn unreferenced_buffers_are_freed_at_once() {
        let account = Retention::new(100);
        let mut buf = BytesMut::with_capacity(1024);
        buf.extend_from_slice(&[7u8; 300]);
        drop(buf.split_to(10).freeze());
        account.retire(buf, 1024);
        account.retire(BytesMut::with_capacity(64), 64);
        assert_eq!(account.retained(), 0);
    }

    #[test]
    fn a_retired_buffer_is_read_into_again_once_its_frames_are_gone() {
        let account = Retention::new(1 << 20);
        let mut buf = BytesMut::with_capacity(1024);
        buf.extend_from_slice(&[7u8; 300]);
        let frame = buf.split_to(10).freeze();
        let at = frame.as_ptr();
        account.retire(buf, 1024);
        assert!(account.reuse(1024).is_none(), "a frame still references it");
        assert!(account.reuse(2048).is_none());
        drop(frame);
        let again = account
            .reuse(1024)
            .expect("reusable once the frame is gone");
        assert_eq!(
            (again.len(), again.as_ptr()),
            (0, at),
            "the same allocation, empty"
        );
        assert!(again.capacity() >= 1024);
        assert_eq!(account.retained(), 0);
        assert!(account.reuse(1024).is_none(), "taken once");
    }
}
