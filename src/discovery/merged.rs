//! [`Merged`]: several backends followed as one (etcd's or Kubernetes' publishers and
//! the sources announced on an event bus, say).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio_util::sync::CancellationToken;

use super::{
    BoxFuture, ChannelId, Discovery, DiscoveryError, DiscoveryEvent, DiscoveryStats,
    DiscoveryStream, Instance, Query, Registration, Transport, WorkerIdentity,
};

/// Several backends as one [`Discovery`]: a watch yields every backend's changes, and
/// its first `Resync` once each backend sent its own (a later one from any backend is
/// answered with the union again). An id two backends list is the first backend's;
/// it departs when no backend lists it. A backend's watch failing fails the merged
/// watch (the subscriber watches again, all of them). Registering goes to the first
/// backend.
///
/// ```
/// use std::sync::Arc;
/// use eventplane::discovery::{ChannelId, Discovery, DiscoveryEvent, MemoryDiscovery, Merged, Query, Transport};
/// use tokio_util::sync::CancellationToken;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::discovery::DiscoveryError> {
/// let (a, b) = (Arc::new(MemoryDiscovery::new()), Arc::new(MemoryDiscovery::new()));
/// let _one = a.register(ChannelId::new("prod", "w", "kv", 1)?, Transport::zmq("tcp://127.0.0.1:5001")).await?;
/// let _two = b.register(ChannelId::new("prod", "w", "kv", 2)?, Transport::zmq("tcp://127.0.0.1:5002")).await?;
/// let merged = Merged::new(vec![a, b]);
/// assert_eq!(merged.list(Query::new("prod")).await?.len(), 2);
/// let mut watch = merged.watch(Query::new("prod"), CancellationToken::new()).await?;
/// loop {
///     if let Some(DiscoveryEvent::Resync(all)) = watch.next().await.transpose()? {
///         assert_eq!(all.len(), 2);
///         break;
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Merged {
    backends: Vec<Arc<dyn Discovery>>,
}

impl Merged {
    /// The backends, in order of precedence.
    pub fn new(backends: Vec<Arc<dyn Discovery>>) -> Merged {
        Merged { backends }
    }
}

/// One backend's watch and what it lists now.
struct Part {
    stream: DiscoveryStream,
    listed: HashMap<ChannelId, Instance>,
    synced: bool,
}

struct MergedWatch {
    parts: Vec<Part>,
    /// Every part sent its first `Resync`.
    synced: bool,
    /// The next part to poll first (fairness).
    next: usize,
    /// Events ready to yield.
    ready: std::collections::VecDeque<DiscoveryEvent>,
    ended: bool,
}

impl MergedWatch {
    /// The instance of `id` by precedence, if any part lists it.
    fn owner(&self, id: &ChannelId) -> Option<&Instance> {
        self.parts.iter().find_map(|p| p.listed.get(id))
    }

    fn union(&self) -> Vec<Instance> {
        let mut seen: HashMap<&ChannelId, &Instance> = HashMap::new();
        for part in &self.parts {
            for (id, instance) in &part.listed {
                seen.entry(id).or_insert(instance);
            }
        }
        seen.into_values().cloned().collect()
    }

    fn apply(&mut self, part: usize, event: DiscoveryEvent) {
        let Some(p) = self.parts.get_mut(part) else {
            return;
        };
        match event {
            DiscoveryEvent::Added(instance) => {
                p.listed.insert(instance.id.clone(), instance.clone());
                if self.synced && self.owner(&instance.id) == Some(&instance) {
                    self.ready.push_back(DiscoveryEvent::Added(instance));
                }
            }
            DiscoveryEvent::Removed { id, incarnation } => {
                let held = p
                    .listed
                    .get(&id)
                    .is_some_and(|i| i.incarnation == incarnation);
                if held {
                    p.listed.remove(&id);
                }
                if self.synced && held {
                    match self.owner(&id) {
                        // Another backend lists it still: that one stands.
                        Some(other) => {
                            let other = other.clone();
                            self.ready.push_back(DiscoveryEvent::Added(other));
                        }
                        None => self
                            .ready
                            .push_back(DiscoveryEvent::Removed { id, incarnation }),
                    }
                }
            }
            DiscoveryEvent::Resync(all) => {
                p.listed = all.into_iter().map(|i| (i.id.clone(), i)).collect();
                p.synced = true;
                self.synced = self.parts.iter().all(|p| p.synced);
                if self.synced {
                    let union = self.union();
                    self.ready.push_back(DiscoveryEvent::Resync(union));
                }
            }
        }
    }
}

impl Stream for MergedWatch {
    type Item = Result<DiscoveryEvent, DiscoveryError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let n = self.parts.len();
            let start = self.next;
            let mut progressed = false;
            for k in 0..n {
                let i = (start + k) % n;
                let Some(part) = self.parts.get_mut(i) else {
                    continue;
                };
                match Pin::new(&mut part.stream).poll_next(cx) {
                    Poll::Pending => {}
                    Poll::Ready(Some(Ok(event))) => {
                        self.next = (i + 1) % n;
                        self.apply(i, event);
                        progressed = true;
                        break;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        self.ended = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                    Poll::Ready(None) => {
                        self.ended = true;
                        return Poll::Ready(None);
                    }
                }
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }
}

impl Discovery for Merged {
    fn register_with(
        &self,
        id: ChannelId,
        transport: Transport,
        worker: Option<WorkerIdentity>,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        match self.backends.first() {
            Some(first) => first.register_with(id, transport, worker),
            None => Box::pin(async {
                Err(DiscoveryError::Unsupported {
                    operation: "registering in a merge of no backend",
                })
            }),
        }
    }

    fn list(&self, query: Query) -> BoxFuture<'_, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move {
            let mut by_id: HashMap<ChannelId, Instance> = HashMap::new();
            for backend in &self.backends {
                for instance in backend.list(query.clone()).await? {
                    by_id.entry(instance.id.clone()).or_insert(instance);
                }
            }
            Ok(by_id.into_values().collect())
        })
    }

    fn watch(
        &self,
        query: Query,
        cancel: CancellationToken,
    ) -> BoxFuture<'_, Result<DiscoveryStream, DiscoveryError>> {
        Box::pin(async move {
            let mut parts = Vec::with_capacity(self.backends.len());
            for backend in &self.backends {
                parts.push(Part {
                    stream: backend.watch(query.clone(), cancel.child_token()).await?,
                    listed: HashMap::new(),
                    synced: false,
                });
            }
            let mut watch = MergedWatch {
                synced: parts.is_empty(),
                parts,
                next: 0,
                ready: std::collections::VecDeque::new(),
                ended: false,
            };
            if watch.synced {
                watch.ready.push_back(DiscoveryEvent::Resync(Vec::new()));
            }
            Ok(DiscoveryStream::with_cancellation(watch, cancel))
        })
    }

    fn stats(&self) -> DiscoveryStats {
        self.backends
            .iter()
            .map(|b| b.stats())
            .fold(DiscoveryStats::default(), |mut sum, s| {
                sum.registrations += s.registrations;
                sum.watchers += s.watchers;
                sum.buffered_events += s.buffered_events;
                sum.overflow_resyncs += s.overflow_resyncs;
                sum.expired += s.expired;
                sum.malformed += s.malformed;
                sum.lease_losses += s.lease_losses;
                sum.reconnects += s.reconnects;
                sum
            })
    }
}
