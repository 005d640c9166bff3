//! The processor loop: engine lists in, router events out to a sink.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    Coalescer, DEFAULT_MAX_TRACKED_HASHES, DEFAULT_MAX_TRACKED_RANKS, DedupFilter, DedupMode,
    IndexError, KvEventData, Pipeline, PlacementEvent, RouterEvent, SinkError,
};
use crate::BoxFuture;
use crate::config::{self, ConfigError};
use crate::counter;
use crate::net::RateLimitedWarn;

/// Longest batching timeout accepted.
pub(crate) const MAX_BATCH_TIMEOUT: Duration = Duration::from_secs(15);

/// Where router events go (the event plane, a test collector, …).
///
/// ```
/// use std::sync::Mutex;
/// use eventplane::BoxFuture;
/// use eventplane::kv::{RouterEvent, pipeline::{EventSink, SinkError}};
///
/// /// Keeps everything in memory (a test collector).
/// #[derive(Default)]
/// struct Collect(Mutex<Vec<RouterEvent>>);
///
/// impl EventSink for Collect {
///     fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
///         self.0.lock().unwrap().extend_from_slice(events);
///         Box::pin(async { Ok(()) })
///     }
/// }
/// # let _ = Collect::default();
/// ```
pub trait EventSink: Send + Sync {
    /// Publishes one batch. Errors are logged and counted by the processor, never
    /// retried.
    fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>>;
}

/// A worker-local index the processor keeps in step before publishing.
///
/// ```
/// use std::collections::HashSet;
/// use eventplane::kv::{BlockHash, KvEventData, RouterEvent, pipeline::{IndexError, LocalIndex}};
///
/// /// The blocks this worker holds, kept in step before events are published.
/// #[derive(Default)]
/// struct Blocks(HashSet<BlockHash>);
///
/// impl LocalIndex for Blocks {
///     fn apply(&mut self, ev: &RouterEvent) -> Result<(), IndexError> {
///         match &ev.event.data {
///             KvEventData::Stored { blocks, .. } => self.0.extend(blocks.iter().map(|b| b.block_hash)),
///             KvEventData::Removed { block_hashes } => block_hashes.iter().for_each(|h| { self.0.remove(h); }),
///             _ => self.0.clear(),
///         }
///         Ok(())
///     }
/// }
/// # let _ = Blocks::default();
/// ```
pub trait LocalIndex: Send {
    /// Applies one event. A failure on `Cleared` fences the processor.
    fn apply(&mut self, event: &RouterEvent) -> Result<(), IndexError>;
}

/// Settings of a [`Processor`].
///
/// ```
/// use std::time::Duration;
/// use eventplane::kv::pipeline::ProcessorConfig;
/// let config = ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(50)));
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct ProcessorConfig {
    max_batch_blocks: usize,
    dedup: DedupMode,
    dedup_max_hashes: usize,
    dedup_max_ranks: usize,
    batch_timeout: Option<Duration>,
    publish_timeout: Duration,
}

impl Default for ProcessorConfig {
    fn default() -> Self {
        ProcessorConfig {
            max_batch_blocks: super::DEFAULT_MAX_BATCH_BLOCKS,
            dedup: DedupMode::RefCounted,
            dedup_max_hashes: DEFAULT_MAX_TRACKED_HASHES,
            dedup_max_ranks: DEFAULT_MAX_TRACKED_RANKS,
            batch_timeout: None,
            publish_timeout: Duration::from_secs(5),
        }
    }
}

impl ProcessorConfig {
    /// Cap on blocks per merged event. Default 128; must not be zero.
    pub fn max_batch_blocks(mut self, blocks: usize) -> Self {
        self.max_batch_blocks = blocks;
        self
    }
    /// Dedup mode. Default [`DedupMode::RefCounted`].
    pub fn dedup(mut self, mode: DedupMode) -> Self {
        self.dedup = mode;
        self
    }
    /// Dedup caps: hashes tracked, all pairs together (default 2^21), and distinct
    /// pairs (default 64); see [`DedupFilter`]. Neither may be zero.
    pub fn dedup_limits(mut self, max_hashes: usize, max_ranks: usize) -> Self {
        self.dedup_max_hashes = max_hashes;
        self.dedup_max_ranks = max_ranks;
        self
    }
    /// Batch across lists for up to this long, counted from the last flush. Default
    /// `None`: flush at every list boundary. Between 1 ns and 15 s.
    pub fn batch_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.batch_timeout = timeout;
        self
    }
    /// Bound on one publish: a sink that has not answered by then is abandoned for
    /// that batch (counted in `publish_timeouts`), so a stuck sink can neither stall
    /// the loop nor block shutdown. Default 5 s; must not be zero.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// The first refused value, if any, named as its setter. [`Processor::new`] calls
    /// it; call it yourself to check settings before starting anything else.
    ///
    /// ```
    /// use eventplane::kv::pipeline::ProcessorConfig;
    /// let err = ProcessorConfig::default().max_batch_blocks(0).validate().unwrap_err();
    /// assert_eq!(err.to_string(), "max_batch_blocks must not be zero");
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.pipeline().map(drop)
    }

    /// The pipeline these settings describe, or the first refused value.
    fn pipeline(&self) -> Result<Pipeline, ConfigError> {
        if let Some(timeout) = self.batch_timeout {
            config::nonzero_duration("batch_timeout", timeout)?;
            if timeout > MAX_BATCH_TIMEOUT {
                return Err(ConfigError::OutOfRange {
                    field: "batch_timeout",
                    reason: "must be at most 15 s",
                });
            }
        }
        config::nonzero_duration("publish_timeout", self.publish_timeout)?;
        let coalescer = Coalescer::new(self.max_batch_blocks)?;
        let dedup = DedupFilter::new(self.dedup)
            .with_limits(self.dedup_max_hashes, self.dedup_max_ranks)
            .map_err(|e| e.renamed("dedup_limits"))?;
        Ok(Pipeline::with_checked(coalescer, dedup))
    }
}

/// Counters of a [`Processor`]. Every input event is accounted for: once the processor
/// has stopped (or nothing is pending), `input_events = output_events + merged_events +
/// deduplicated_events + withheld_events`.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::BoxFuture;
/// use eventplane::kv::{RouterEvent, pipeline::{EventSink, Processor, ProcessorConfig, SinkError}};
/// struct Discard;
/// impl EventSink for Discard {
///     fn publish<'a>(&'a self, _: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
///         Box::pin(async { Ok(()) })
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (tx, rx) = tokio::sync::mpsc::channel(8);
/// drop(tx); // input closed: the processor drains and stops
/// let stats = Processor::new(ProcessorConfig::default(), rx, Arc::new(Discard))?.run().await;
/// assert_eq!(stats.input_events, stats.output_events + stats.merged_events
///     + stats.deduplicated_events + stats.withheld_events);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ProcessorStats {
    /// Engine lists received.
    pub input_lists: u64,
    /// Engine events received.
    pub input_events: u64,
    /// Forward jumps in the engine's raw event ids.
    pub input_gaps: u64,
    /// Ids missing in those jumps.
    pub input_gap_events: u64,
    /// Router events emitted (after coalescing and dedup).
    pub output_events: u64,
    /// Input events merged into another by coalescing.
    pub merged_events: u64,
    /// Input events dedup removed entirely (removals of blocks still stored).
    pub deduplicated_events: u64,
    /// Events withheld because a failed local `Cleared` fenced the processor.
    pub withheld_events: u64,
    /// Sink calls that failed (timeouts included).
    pub publish_errors: u64,
    /// Of those, sink calls abandoned after `publish_timeout`.
    pub publish_timeouts: u64,
    /// Times a dedup cap made the filter forget what it tracked.
    pub dedup_resets: u64,
    /// `true` once a failed local `Cleared` fenced the processor.
    pub fenced: bool,
}

#[derive(Debug, Default)]
struct Counters {
    input_lists: AtomicU64,
    input_events: AtomicU64,
    input_gaps: AtomicU64,
    input_gap_events: AtomicU64,
    output_events: AtomicU64,
    merged_events: AtomicU64,
    deduplicated_events: AtomicU64,
    withheld_events: AtomicU64,
    publish_errors: AtomicU64,
    publish_timeouts: AtomicU64,
    dedup_resets: AtomicU64,
    fenced: AtomicBool,
}

/// Reads a running processor's counters.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::BoxFuture;
/// use eventplane::kv::{RouterEvent, pipeline::{EventSink, Processor, ProcessorConfig, SinkError}};
/// struct Discard;
/// impl EventSink for Discard {
///     fn publish<'a>(&'a self, _: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
///         Box::pin(async { Ok(()) })
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (_tx, rx) = tokio::sync::mpsc::channel(8);
/// let processor = Processor::new(ProcessorConfig::default(), rx, Arc::new(Discard))?;
/// let handle = processor.handle();
/// let task = tokio::spawn(processor.run());
/// assert_eq!(handle.stats().input_lists, 0);
/// handle.cancel(); // drain, flush, publish, stop
/// task.await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ProcessorHandle {
    counters: Arc<Counters>,
    cancel: CancellationToken,
}

impl ProcessorHandle {
    /// A snapshot of the counters.
    pub fn stats(&self) -> ProcessorStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProcessorStats {
            input_lists: l(&c.input_lists),
            input_events: l(&c.input_events),
            input_gaps: l(&c.input_gaps),
            input_gap_events: l(&c.input_gap_events),
            output_events: l(&c.output_events),
            merged_events: l(&c.merged_events),
            deduplicated_events: l(&c.deduplicated_events),
            withheld_events: l(&c.withheld_events),
            publish_errors: l(&c.publish_errors),
            publish_timeouts: l(&c.publish_timeouts),
            dedup_resets: l(&c.dedup_resets),
            fenced: c.fenced.load(Ordering::Relaxed),
        }
    }

    /// Asks the processor to drain what is queued, publish, and stop.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

/// Turns engine lists into router events: coalescing, dedup, dense ids, an optional
/// local index, then the sink.
///
/// - A whole list is processed before timers or cancellation are looked at.
/// - Without a batching timeout, pending work is flushed at every list boundary; with
///   one, the timer counts from the last flush, so the first event after an idle
///   period goes out alone and later ones batch.
/// - Cancellation or the input closing: what is queued is drained, flushed and
///   published, then the loop stops.
/// - Every publish is bounded by `publish_timeout`: a sink that never answers costs
///   that batch (counted), never the loop or its shutdown.
/// - A forward jump in raw engine ids counts `input_gaps`; a regression (an engine
///   restart) does not.
/// - If the local index fails to apply a `Cleared`, the clear is withheld, the
///   processor cancels its token and stops: it must not publish state it could not
///   keep.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use eventplane::BoxFuture;
/// use eventplane::kv::{RouterEvent, pipeline::{EventSink, Processor, ProcessorConfig, SinkError}};
///
/// #[derive(Default)]
/// struct Collect(Mutex<Vec<RouterEvent>>);
/// impl EventSink for Collect {
///     fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
///         self.0.lock().unwrap().extend_from_slice(events);
///         Box::pin(async { Ok(()) })
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let sink = Arc::new(Collect::default());
/// let (tx, rx) = tokio::sync::mpsc::channel(64);
/// let processor = Processor::new(ProcessorConfig::default(), rx, sink.clone())?;
/// let task = tokio::spawn(processor.run());
/// drop(tx); // input closed: drain, flush, stop
/// task.await?;
/// # Ok(())
/// # }
/// ```
pub struct Processor {
    config: ProcessorConfig,
    pipeline: Pipeline,
    input: mpsc::Receiver<Vec<PlacementEvent>>,
    sink: Arc<dyn EventSink>,
    index: Option<Box<dyn LocalIndex>>,
    cancel: CancellationToken,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Processor {
    /// A processor reading `input` (a bounded channel of engine lists), or the
    /// [`ConfigError`] naming the first refused [`ProcessorConfig`] value.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use eventplane::kv::{RouterEvent, pipeline::{EventSink, Processor, ProcessorConfig, SinkError}};
    /// # struct Nowhere;
    /// # impl EventSink for Nowhere {
    /// #     fn publish<'a>(&'a self, _: &'a [RouterEvent]) -> eventplane::BoxFuture<'a, Result<(), SinkError>> {
    /// #         Box::pin(async { Ok(()) })
    /// #     }
    /// # }
    /// let (_tx, rx) = tokio::sync::mpsc::channel(16);
    /// let config = ProcessorConfig::default().batch_timeout(Some(Duration::from_secs(60)));
    /// let err = Processor::new(config, rx, Arc::new(Nowhere)).unwrap_err();
    /// assert_eq!(err.field(), "batch_timeout");
    /// ```
    pub fn new(
        config: ProcessorConfig,
        input: mpsc::Receiver<Vec<PlacementEvent>>,
        sink: Arc<dyn EventSink>,
    ) -> Result<Processor, ConfigError> {
        let pipeline = config.pipeline()?;
        Ok(Processor {
            config,
            pipeline,
            input,
            sink,
            index: None,
            cancel: CancellationToken::new(),
            counters: Arc::default(),
        })
    }

    /// Keeps `index` in step before publishing.
    #[must_use]
    pub fn with_local_index(mut self, index: Box<dyn LocalIndex>) -> Processor {
        self.index = Some(index);
        self
    }

    /// Stop when `token` is cancelled (the processor uses a child of it, which a fence
    /// cancels). Default: a token of its own, cancelled through
    /// [`ProcessorHandle::cancel`]. Every long-running part of the crate takes its
    /// token this way.
    #[must_use]
    pub fn cancellation(mut self, token: &CancellationToken) -> Processor {
        self.cancel = token.child_token();
        self
    }

    /// A handle for stats and cancellation.
    pub fn handle(&self) -> ProcessorHandle {
        ProcessorHandle {
            counters: self.counters.clone(),
            cancel: self.cancel.clone(),
        }
    }

    /// Runs until cancelled, the input closes, or a fence; returns the final counters.
    pub async fn run(mut self) -> ProcessorStats {
        let mut pipeline = std::mem::take(&mut self.pipeline);
        let mut out: Vec<RouterEvent> = Vec::new();
        let mut last_raw: Option<u64> = None;
        let mut last_flush = tokio::time::Instant::now();
        let warn = RateLimitedWarn::default();
        loop {
            let deadline = self
                .config
                .batch_timeout
                .filter(|_| pipeline.has_pending())
                .map(|t| last_flush + t);
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                list = self.input.recv() => {
                    let Some(list) = list else { break };
                    self.ingest(list, &mut pipeline, &mut out, &mut last_raw);
                    let due = match self.config.batch_timeout {
                        None => true,
                        Some(t) => tokio::time::Instant::now() >= last_flush + t,
                    };
                    if due {
                        pipeline.flush(&mut out);
                        last_flush = tokio::time::Instant::now();
                    }
                }
                () = crate::time::sleep_until_opt(deadline) => {
                    pipeline.flush(&mut out);
                    last_flush = tokio::time::Instant::now();
                }
            }
            self.record(&pipeline);
            if !self.emit(&mut out, &warn).await {
                return self.handle().stats();
            }
        }
        // Drain what is already queued, flush, publish, stop.
        while let Ok(list) = self.input.try_recv() {
            self.ingest(list, &mut pipeline, &mut out, &mut last_raw);
        }
        pipeline.flush(&mut out);
        self.record(&pipeline);
        self.emit(&mut out, &warn).await;
        self.handle().stats()
    }

    /// Copies the pipeline's running totals into the shared counters.
    fn record(&self, pipeline: &Pipeline) {
        let c = &self.counters;
        c.merged_events.store(pipeline.merged(), Ordering::Relaxed);
        c.deduplicated_events
            .store(pipeline.deduplicated(), Ordering::Relaxed);
        c.dedup_resets
            .store(pipeline.dedup_resets(), Ordering::Relaxed);
    }

    fn ingest(
        &self,
        list: Vec<PlacementEvent>,
        pipeline: &mut Pipeline,
        out: &mut Vec<RouterEvent>,
        last_raw: &mut Option<u64>,
    ) {
        let c = &self.counters;
        counter::add(&c.input_lists, 1);
        counter::add(&c.input_events, list.len() as u64);
        for ev in list {
            let id = ev.event.id;
            if let Some(last) = *last_raw {
                if id > last.saturating_add(1) {
                    counter::add(&c.input_gaps, 1);
                    counter::add(&c.input_gap_events, id - last - 1);
                }
            }
            *last_raw = Some(id);
            pipeline.push(ev, out);
        }
    }

    /// Applies the local index and publishes `out`. Returns `false` when fenced.
    async fn emit(&mut self, out: &mut Vec<RouterEvent>, warn: &RateLimitedWarn) -> bool {
        if out.is_empty() {
            return true;
        }
        let mut fenced = false;
        if let Some(index) = self.index.as_mut() {
            for (i, ev) in out.iter().enumerate() {
                if let Err(e) = index.apply(ev) {
                    if matches!(ev.event.data, KvEventData::Cleared) {
                        tracing::error!(error = %crate::net::ErrorChain(&e), "local index failed to apply a Cleared; fencing the processor");
                        self.counters
                            .withheld_events
                            .fetch_add((out.len() - i) as u64, Ordering::Relaxed);
                        out.truncate(i);
                        fenced = true;
                        break;
                    }
                    tracing::warn!(error = %crate::net::ErrorChain(&e), "local index rejected an event");
                }
            }
        }
        if !out.is_empty() {
            self.counters
                .output_events
                .fetch_add(out.len() as u64, Ordering::Relaxed);
            let publish = self.sink.publish(out);
            let result = match tokio::time::timeout(self.config.publish_timeout, publish).await {
                Ok(result) => result,
                Err(_) => {
                    counter::add(&self.counters.publish_timeouts, 1);
                    Err(SinkError(
                        "the sink did not answer within publish_timeout".into(),
                    ))
                }
            };
            if let Err(e) = result {
                counter::add(&self.counters.publish_errors, 1);
                if let Some(suppressed) = warn.check("publish", Instant::now()) {
                    tracing::warn!(error = %crate::net::ErrorChain(&e), suppressed, "publishing router events failed; not retried");
                }
            }
            out.clear();
        }
        if fenced {
            self.counters.fenced.store(true, Ordering::Relaxed);
            self.cancel.cancel();
            return false;
        }
        true
    }
}
