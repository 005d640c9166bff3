//! The sans-IO worker pipeline: coalescer → dedup → dense id stamping.

use super::{
    Coalescer, DEFAULT_MAX_BATCH_BLOCKS, DedupFilter, DedupMode, KvEvent, KvEventData, Placement,
    PlacementEvent, RouterEvent,
};
use crate::ConfigError;

/// Coalescer → dedup → dense id stamping, sans-IO. Ids start at 1 and are stamped at
/// emission, so an event that dedup drops consumes none.
///
/// ```
/// use eventplane::kv::{BlockHash, KvEvent, KvEventData, Placement, PlacementEvent, StorageTier, WorkerId, pipeline::Pipeline};
/// let at = Placement { worker_id: WorkerId(1), dp_rank: 0, tier: StorageTier::Device };
/// let removed = |id, h| PlacementEvent {
///     placement: at,
///     event: KvEvent { id, dp_rank: 0, data: KvEventData::Removed { block_hashes: vec![BlockHash(h)] } },
/// };
/// let mut pipeline = Pipeline::default();
/// let mut out = Vec::new();
/// pipeline.push(removed(100, 1), &mut out);
/// pipeline.push(removed(101, 2), &mut out); // merges with the first
/// pipeline.flush(&mut out);
/// assert_eq!(out.len(), 1);
/// assert_eq!(out[0].event.id, 1); // dense outbound ids
/// assert_eq!(pipeline.merged(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct Pipeline {
    coalescer: Coalescer,
    dedup: DedupFilter,
    next_id: u64,
}

impl Default for Pipeline {
    fn default() -> Self {
        Pipeline::with_checked(
            Coalescer::with_checked(DEFAULT_MAX_BATCH_BLOCKS),
            DedupFilter::new(DedupMode::RefCounted),
        )
    }
}

impl Pipeline {
    /// A pipeline with these settings; [`ConfigError::Zero`] when `max_batch_blocks`
    /// is zero.
    pub fn new(max_batch_blocks: usize, mode: DedupMode) -> Result<Pipeline, ConfigError> {
        Pipeline::with_dedup(max_batch_blocks, DedupFilter::new(mode))
    }

    /// A pipeline with its own dedup filter (for example with other caps).
    ///
    /// ```
    /// use eventplane::kv::{pipeline::{DedupFilter, DedupMode, Pipeline}};
    /// let pipeline = Pipeline::with_dedup(128, DedupFilter::new(DedupMode::RefCounted).with_limits(1 << 16, 8)?)?;
    /// assert_eq!(pipeline.dedup_resets(), 0);
    /// # Ok::<(), eventplane::ConfigError>(())
    /// ```
    pub fn with_dedup(
        max_batch_blocks: usize,
        dedup: DedupFilter,
    ) -> Result<Pipeline, ConfigError> {
        Ok(Pipeline::with_checked(
            Coalescer::new(max_batch_blocks)?,
            dedup,
        ))
    }

    pub(crate) fn with_checked(coalescer: Coalescer, dedup: DedupFilter) -> Pipeline {
        Pipeline {
            coalescer,
            dedup,
            next_id: 1,
        }
    }

    /// Feeds one engine event; router events completed by it are appended to `out`.
    pub fn push(&mut self, input: PlacementEvent, out: &mut Vec<RouterEvent>) {
        let Pipeline {
            coalescer,
            dedup,
            next_id,
        } = self;
        coalescer.push(input.placement, input.event.data, &mut |p, d| {
            stamp(dedup, next_id, p, d, out)
        });
    }

    /// Emits whatever is pending.
    pub fn flush(&mut self, out: &mut Vec<RouterEvent>) {
        let Pipeline {
            coalescer,
            dedup,
            next_id,
        } = self;
        coalescer.flush(&mut |p, d| stamp(dedup, next_id, p, d, out));
    }

    /// `true` when an event waits in the coalescer.
    pub fn has_pending(&self) -> bool {
        self.coalescer.has_pending()
    }

    /// Input events merged into another by coalescing so far.
    pub fn merged(&self) -> u64 {
        self.coalescer.merged()
    }

    /// Events dedup removed entirely so far.
    pub fn deduplicated(&self) -> u64 {
        self.dedup.suppressed()
    }

    /// Times a dedup cap made the filter forget what it tracked.
    pub fn dedup_resets(&self) -> u64 {
        self.dedup.resets()
    }

    /// The id the next emitted event will get.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }
}

fn stamp(
    dedup: &mut DedupFilter,
    next_id: &mut u64,
    placement: Placement,
    data: KvEventData,
    out: &mut Vec<RouterEvent>,
) {
    if let Some(data) = dedup.filter(&placement, data) {
        out.push(RouterEvent {
            worker_id: placement.worker_id,
            tier: placement.tier,
            event: KvEvent {
                id: *next_id,
                dp_rank: placement.dp_rank,
                data,
            },
        });
        *next_id += 1;
    }
}
