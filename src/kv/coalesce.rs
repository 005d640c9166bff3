//! `Coalescer`: merges adjacent events of one placement and kind.

use super::event::{KvEventData, Placement};
use crate::config::{self, ConfigError};

/// Default cap on the blocks of one merged event.
pub(crate) const DEFAULT_MAX_BATCH_BLOCKS: usize = 128;

/// Merges adjacent events, sans-IO.
///
/// - Events merge only with the same [`Placement`] and kind. `Stored` + `Stored` merge
///   only when the new event's `parent_hash` is the last pending block (the chain
///   extends); the merged event keeps the first parent. `Removed` + `Removed` always
///   merge.
/// - A merge reaching `max_batch_blocks` is emitted at once; a merge that would exceed
///   it emits the pending event first. An event alone at or over the cap bypasses
///   pending (after flushing it).
/// - `Cleared` is a barrier: pending is flushed, then the clear passes alone.
///
/// Output goes to the `emit` callback, in order; call [`flush`](Self::flush) at a list
/// boundary or when a batching timer fires.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEventData, Placement, StorageTier, WorkerId, pipeline::Coalescer};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// let mut c = Coalescer::new(128)?;
/// let mut out = Vec::new();
/// c.push(at, KvEventData::Removed { block_hashes: vec![BlockHash(1)] }, &mut |p, d| out.push((p, d)));
/// c.push(at, KvEventData::Removed { block_hashes: vec![BlockHash(2)] }, &mut |p, d| out.push((p, d)));
/// assert!(out.is_empty());
/// c.flush(&mut |p, d| out.push((p, d)));
/// assert_eq!(out, vec![(at, KvEventData::Removed { block_hashes: vec![BlockHash(1), BlockHash(2)] })]);
/// # Ok::<(), eventplane::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Coalescer {
    max_batch_blocks: usize,
    pending: Option<(Placement, KvEventData)>,
    merged: u64,
}

impl Default for Coalescer {
    fn default() -> Self {
        Coalescer::with_checked(DEFAULT_MAX_BATCH_BLOCKS)
    }
}

impl Coalescer {
    /// A coalescer with a cap of `max_batch_blocks`, or [`ConfigError::Zero`] when it
    /// is zero.
    ///
    /// ```
    /// use eventplane::kv::pipeline::Coalescer;
    /// assert_eq!(Coalescer::new(0).unwrap_err().field(), "max_batch_blocks");
    /// assert!(!Coalescer::new(128)?.has_pending());
    /// # Ok::<(), eventplane::ConfigError>(())
    /// ```
    pub fn new(max_batch_blocks: usize) -> Result<Coalescer, ConfigError> {
        config::nonzero("max_batch_blocks", max_batch_blocks).map(Coalescer::with_checked)
    }

    pub(crate) fn with_checked(max_batch_blocks: usize) -> Coalescer {
        Coalescer {
            max_batch_blocks,
            pending: None,
            merged: 0,
        }
    }

    /// `true` when an event is pending.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Events absorbed into a pending one so far (each input event is either emitted,
    /// pending, or counted here).
    pub fn merged(&self) -> u64 {
        self.merged
    }

    /// Feeds one event; completed events go to `emit`.
    pub fn push(
        &mut self,
        placement: Placement,
        data: KvEventData,
        emit: &mut dyn FnMut(Placement, KvEventData),
    ) {
        if let KvEventData::Cleared = data {
            self.flush(emit);
            emit(placement, data);
            return;
        }
        let incoming = data.block_count();
        if let Some((pending_at, pending)) = self.pending.as_mut() {
            let same_place = *pending_at == placement;
            let fits = pending.block_count() + incoming <= self.max_batch_blocks;
            if same_place && fits && extends(pending, &data) {
                merge(pending, data);
                self.merged += 1;
                if pending.block_count() >= self.max_batch_blocks {
                    self.flush(emit);
                }
                return;
            }
            self.flush(emit);
        }
        if incoming >= self.max_batch_blocks {
            emit(placement, data);
        } else {
            self.pending = Some((placement, data));
        }
    }

    /// Emits the pending event, if any.
    pub fn flush(&mut self, emit: &mut dyn FnMut(Placement, KvEventData)) {
        if let Some((p, d)) = self.pending.take() {
            emit(p, d);
        }
    }
}

/// Whether `next` can be appended to `pending`: same kind, and for stores the chain
/// continues from the last pending block.
fn extends(pending: &KvEventData, next: &KvEventData) -> bool {
    match (pending, next) {
        (
            KvEventData::Stored { blocks, .. },
            KvEventData::Stored {
                parent_hash: Some(parent),
                ..
            },
        ) => blocks.last().is_some_and(|b| b.block_hash == *parent),
        (KvEventData::Removed { .. }, KvEventData::Removed { .. }) => true,
        _ => false,
    }
}

fn merge(pending: &mut KvEventData, next: KvEventData) {
    match (pending, next) {
        (KvEventData::Stored { blocks, .. }, KvEventData::Stored { blocks: more, .. }) => {
            blocks.extend(more);
        }
        (KvEventData::Removed { block_hashes }, KvEventData::Removed { block_hashes: more }) => {
            block_hashes.extend(more)
        }
        _ => {}
    }
}
