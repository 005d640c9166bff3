//! The worker side wired in one call: engine → [`EngineListener`] → [`Processor`] →
//! sink (an [`EventPlaneSink`] over an [`EventPublisher`], or a sink of your own).

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{
    EngineListener, EngineListenerConfig, EngineListenerHandle, EngineListenerStats,
    EventPlaneSink, EventSink, LocalIndex, Processor, ProcessorConfig, ProcessorHandle,
    ProcessorStats,
};
use crate::config::ConfigError;
use crate::publish::EventPublisher;
use crate::zmtp::PubStats;

/// Default capacity, in engine batches, of the queue between the listener and the
/// processor. A full queue makes the listener wait; the engine's PUB then drops at its
/// high-water mark, which the listener counts as sequence gaps.
pub(crate) const DEFAULT_WORKER_QUEUE: usize = 256;

/// Builds a [`Worker`]: [`Worker::builder`] for the usual case (router events on an
/// [`EventPublisher`]), [`Worker::with_sink`] for a sink of your own.
pub struct WorkerBuilder {
    engine: EngineListenerConfig,
    processor: ProcessorConfig,
    sink: Arc<dyn EventSink>,
    plane: Option<Arc<EventPlaneSink>>,
    queue: usize,
    index: Option<Box<dyn LocalIndex>>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("engine", &self.engine)
            .field("processor", &self.processor)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    /// Coalescing, dedup and batching settings. Default: [`ProcessorConfig::default`].
    #[must_use]
    pub fn processor(mut self, config: ProcessorConfig) -> Self {
        self.processor = config;
        self
    }

    /// Capacity of the queue between listener and processor, in engine batches.
    /// Default 256; zero is refused.
    #[must_use]
    pub fn queue_capacity(mut self, batches: usize) -> Self {
        self.queue = batches;
        self
    }

    /// Keep `index` in step with what is published (see [`Processor::with_local_index`]).
    #[must_use]
    pub fn local_index(mut self, index: Box<dyn LocalIndex>) -> Self {
        self.index = Some(index);
        self
    }

    /// Stop when `token` is cancelled, without loss: the listener stops taking engine
    /// batches and the processor publishes everything already queued, then stops.
    /// The worker uses a child of `token`. Default: a token of its own, cancelled by
    /// [`Worker::shutdown`].
    #[must_use]
    pub fn cancellation(mut self, token: &CancellationToken) -> Self {
        self.cancel = token.child_token();
        self
    }

    /// The first refused setting, if any, named as its setter (or as the
    /// [`EngineListenerConfig`] / [`ProcessorConfig`] field). Starts nothing.
    ///
    /// A publisher registered with a worker identity
    /// ([`EventPublisherBuilder::worker`](crate::publish::EventPublisherBuilder::worker))
    /// must name the engine's worker: otherwise routers would file this worker's
    /// events under another one (`worker_id` is refused). One registered without an
    /// identity is accepted with a warning, since routers then cannot tell from
    /// discovery whose events these are.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.engine.validate()?;
        self.processor.validate()?;
        if self.queue == 0 {
            return Err(ConfigError::Zero {
                field: "queue_capacity",
            });
        }
        let registered = self.plane.as_ref().and_then(|p| p.publisher().instance());
        if let Some(worker) = registered.and_then(|i| i.worker) {
            if worker.worker_id != self.engine.worker_id() {
                return Err(ConfigError::Inconsistent {
                    field: "worker_id",
                    reason: "differs from the worker identity the publisher registered",
                });
            }
        }
        Ok(())
    }

    /// Validates, then starts the listener and the processor as two tasks on the
    /// current Tokio runtime (it must be called within one).
    pub fn spawn(self) -> Result<Worker, ConfigError> {
        self.validate()?;
        if let Some(instance) = self.plane.as_ref().and_then(|p| p.publisher().instance()) {
            if instance.worker.is_none() {
                tracing::warn!(
                    id = %instance.id,
                    worker_id = self.engine.worker_id().0,
                    "the worker's publisher registered no worker identity: routers cannot tell \
                     from discovery whose events these are (EventPublisherBuilder::worker)"
                );
            }
        }
        let (tx, rx) = mpsc::channel(self.queue);
        let listener = EngineListener::new(self.engine, tx)?.cancellation(&self.cancel);
        // The processor does not stop on the worker's token: it stops when its input
        // closes, once the listener stopped, after publishing what was queued.
        let mut processor = Processor::new(self.processor, rx, self.sink)?;
        if let Some(index) = self.index {
            processor = processor.with_local_index(index);
        }
        let listener_handle = listener.handle();
        let processor_handle = processor.handle();
        Ok(Worker {
            plane: self.plane,
            listener: listener_handle,
            processor: processor_handle,
            cancel: self.cancel,
            listener_task: Some(tokio::spawn(listener.run())),
            processor_task: Some(tokio::spawn(processor.run())),
        })
    }
}

/// One engine's KV events, relayed as router events: [`EngineListener`] →
/// [`Processor`] → sink, wired with a bounded queue between the first two. The pieces
/// stay usable alone; this is the wiring a worker process needs, in a few lines.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use eventplane::discovery::{MemoryDiscovery, Query};
/// use eventplane::kv::{WorkerId, engine::EngineListenerConfig, pipeline::{ProcessorConfig, Worker}};
/// use eventplane::publish::EventPublisher;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let engine = eventplane::zmtp::PubSocket::bind("tcp://127.0.0.1:0", Default::default()).await?;
/// # let engine_endpoint = engine.local_endpoint().unwrap_or_default().to_owned();
/// let discovery = Arc::new(MemoryDiscovery::new());
/// // Router events go out on a publisher registered in discovery...
/// let publisher = EventPublisher::builder(discovery, "prod", "worker-7", "kv-events")
///     .worker(7, 0) // routers see whose events these are; must match the WorkerId below
///     .build()
///     .await?;
/// // ...fed from the engine's KV-event PUB (vLLM: `tcp://127.0.0.1:5557`, topic "", 16-token blocks).
/// let worker = Worker::builder(EngineListenerConfig::new(&engine_endpoint, "", WorkerId(7), 16), publisher)
///     .processor(ProcessorConfig::default().batch_timeout(Some(Duration::from_millis(10))))
///     .spawn()?;
/// // ... until the process is told to stop:
/// let stats = worker.shutdown().await; // publishes what was queued, unregisters
/// assert_eq!(stats.processor.input_events, 0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Worker {
    plane: Option<Arc<EventPlaneSink>>,
    listener: EngineListenerHandle,
    processor: ProcessorHandle,
    cancel: CancellationToken,
    listener_task: Option<JoinHandle<EngineListenerStats>>,
    processor_task: Option<JoinHandle<ProcessorStats>>,
}

/// Reads a running [`Worker`]'s counters, from [`Worker::handle`].
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use eventplane::BoxFuture;
/// use eventplane::kv::{RouterEvent, WorkerId, engine::EngineListenerConfig, pipeline::{EventSink, SinkError, Worker}};
/// struct Drop;
/// impl EventSink for Drop {
///     fn publish<'a>(&'a self, _: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
///         Box::pin(async { Ok(()) })
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::ConfigError> {
/// let worker = Worker::with_sink(EngineListenerConfig::new("tcp://127.0.0.1:5557", "", WorkerId(1), 16), Arc::new(Drop))
///     .spawn()?;
/// let handle = worker.handle();
/// let ready = move || handle.stats().listener.connected;
/// assert!(!ready()); // no engine there
/// worker.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    plane: Option<Arc<EventPlaneSink>>,
    listener: EngineListenerHandle,
    processor: ProcessorHandle,
}

impl WorkerHandle {
    /// A snapshot of the counters.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            listener: self.listener.stats(),
            processor: self.processor.stats(),
            published_messages: self.plane.as_ref().map_or(0, |p| p.messages()),
            publisher: self.plane.as_ref().map(|p| p.publisher().stats()),
        }
    }
}

/// A [`Worker`]'s counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct WorkerStats {
    /// The engine side: connections, sequence gaps, decode errors.
    pub listener: EngineListenerStats,
    /// Coalescing, dedup, publishing.
    pub processor: ProcessorStats,
    /// Messages handed to the publisher (0 with a sink of your own).
    pub published_messages: u64,
    /// The publisher's socket (with [`Worker::builder`]); from
    /// [`shutdown`](Worker::shutdown), as it stood once the processor had published
    /// everything, before the publisher drained and closed.
    pub publisher: Option<PubStats>,
}

impl Worker {
    /// A worker publishing router events through `publisher` (in an
    /// [`EventPlaneSink`]), in the publisher's wire.
    pub fn builder(engine: EngineListenerConfig, publisher: EventPublisher) -> WorkerBuilder {
        let plane = Arc::new(EventPlaneSink::new(Arc::new(publisher)));
        WorkerBuilder {
            engine,
            processor: ProcessorConfig::default(),
            sink: plane.clone(),
            plane: Some(plane),
            queue: DEFAULT_WORKER_QUEUE,
            index: None,
            cancel: CancellationToken::new(),
        }
    }

    /// A worker handing router events to `sink`.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use eventplane::BoxFuture;
    /// use eventplane::kv::{RouterEvent, WorkerId, engine::EngineListenerConfig, pipeline::{EventSink, SinkError, Worker}};
    /// #[derive(Default)]
    /// struct Collect(Mutex<Vec<RouterEvent>>);
    /// impl EventSink for Collect {
    ///     fn publish<'a>(&'a self, events: &'a [RouterEvent]) -> BoxFuture<'a, Result<(), SinkError>> {
    ///         self.0.lock().unwrap().extend_from_slice(events);
    ///         Box::pin(async { Ok(()) })
    ///     }
    /// }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), eventplane::ConfigError> {
    /// let sink = Arc::new(Collect::default());
    /// let worker = Worker::with_sink(EngineListenerConfig::new("tcp://127.0.0.1:5557", "", WorkerId(1), 16), sink.clone())
    ///     .queue_capacity(64)
    ///     .spawn()?;
    /// assert_eq!(worker.shutdown().await.published_messages, 0);
    /// # Ok(()) }
    /// ```
    pub fn with_sink(engine: EngineListenerConfig, sink: Arc<dyn EventSink>) -> WorkerBuilder {
        WorkerBuilder {
            engine,
            processor: ProcessorConfig::default(),
            sink,
            plane: None,
            queue: DEFAULT_WORKER_QUEUE,
            index: None,
            cancel: CancellationToken::new(),
        }
    }

    /// The publisher, when built with [`Worker::builder`]: its endpoint, instance,
    /// socket stats, and [`wait_for_subscribers_within`](EventPublisher::wait_for_subscribers_within).
    pub fn publisher(&self) -> Option<&Arc<EventPublisher>> {
        self.plane.as_ref().map(|p| p.publisher())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> WorkerStats {
        self.handle().stats()
    }

    /// A cloneable handle reading the counters while the worker runs elsewhere (a
    /// metrics exporter's or a readiness probe's).
    pub fn handle(&self) -> WorkerHandle {
        WorkerHandle {
            plane: self.plane.clone(),
            listener: self.listener.clone(),
            processor: self.processor.clone(),
        }
    }

    /// `true` once both tasks ended: after cancellation, or after a fenced processor
    /// (see [`ProcessorStats::fenced`]) stopped the pipeline.
    pub fn is_finished(&self) -> bool {
        fn done<T>(task: &Option<JoinHandle<T>>) -> bool {
            task.as_ref().is_none_or(JoinHandle::is_finished)
        }
        done(&self.listener_task) && done(&self.processor_task)
    }

    /// Stops without loss and returns the final counters: the listener stops, the
    /// processor publishes what was queued, then the publisher (when this worker owns
    /// the only reference to it) drains its queue up to its linger and unregisters.
    pub async fn shutdown(mut self) -> WorkerStats {
        self.cancel.cancel();
        self.join().await;
        let stats = self.stats();
        if let Some(plane) = self.plane.take() {
            match Arc::try_unwrap(plane)
                .ok()
                .and_then(|p| Arc::try_unwrap(p.into_publisher()).ok())
            {
                Some(publisher) => publisher.shutdown().await,
                None => tracing::debug!(
                    "worker's publisher still shared at shutdown: it unregisters when its last reference goes"
                ),
            }
        }
        stats
    }

    async fn join(&mut self) {
        if let Some(task) = self.listener_task.take() {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "the worker's engine listener task failed");
            }
        }
        if let Some(task) = self.processor_task.take() {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "the worker's processor task failed");
            }
        }
    }
}

impl Drop for Worker {
    /// Dropped without [`shutdown`](Worker::shutdown): the listener stops, and the
    /// processor still publishes what was queued, in the background.
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
