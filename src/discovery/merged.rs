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
/// answered with the union again). An id two backends list is the first backend's
/// (in the order given); when it passes to another backend, a watch says `Removed`
/// (the old incarnation) and then `Added` (the new one): incarnations of different
/// backends are not comparable. It departs when no backend lists it. A backend's watch failing fails the merged
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
    /// What subscribers were told each id is now: the part it came from and its
    /// incarnation (incarnations of different backends are not comparable, so a
    /// change of part is told as a removal, then an addition).
    told: HashMap<ChannelId, (usize, u64)>,
    /// The next part to poll first (fairness).
    next: usize,
    /// Events ready to yield.
    ready: std::collections::VecDeque<DiscoveryEvent>,
    ended: bool,
}

impl MergedWatch {
    /// The instance of `id` by precedence, and its part, if any part lists it.
    fn owner(&self, id: &ChannelId) -> Option<(usize, &Instance)> {
        self.parts
            .iter()
            .enumerate()
            .find_map(|(k, p)| p.listed.get(id).map(|i| (k, i)))
    }

    /// Tells subscribers what `id` is now, if that changed.
    fn retell(&mut self, id: &ChannelId) {
        let now = self.owner(id).map(|(k, i)| (k, i.clone()));
        let before = self.told.get(id).copied();
        match (before, now) {
            (None, None) => {}
            (Some((_, incarnation)), None) => {
                self.told.remove(id);
                self.ready.push_back(DiscoveryEvent::Removed {
                    id: id.clone(),
                    incarnation,
                });
            }
            (before, Some((part, instance))) => {
                if before == Some((part, instance.incarnation)) {
                    return;
                }
                if let Some((old_part, incarnation)) = before {
                    if old_part != part {
                        self.ready.push_back(DiscoveryEvent::Removed {
                            id: id.clone(),
                            incarnation,
                        });
                    }
                }
                self.told.insert(id.clone(), (part, instance.incarnation));
                self.ready.push_back(DiscoveryEvent::Added(instance));
            }
        }
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
                let id = instance.id.clone();
                p.listed.insert(id.clone(), instance);
                if self.synced {
                    self.retell(&id);
                }
            }
            DiscoveryEvent::Removed { id, incarnation } => {
                if p.listed
                    .get(&id)
                    .is_some_and(|i| i.incarnation == incarnation)
                {
                    p.listed.remove(&id);
                    if self.synced {
                        self.retell(&id);
                    }
                }
            }
            DiscoveryEvent::Resync(all) => {
                p.listed = all.into_iter().map(|i| (i.id.clone(), i)).collect();
                p.synced = true;
                self.synced = self.parts.iter().all(|p| p.synced);
                if self.synced {
                    let union = self.union();
                    // A part that changed while an id moved between parts: the set is
                    // the union, each id as its owner lists it.
                    self.told = union
                        .iter()
                        .filter_map(|i| {
                            self.owner(&i.id)
                                .map(|(k, _)| (i.id.clone(), (k, i.incarnation)))
                        })
                        .collect();
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

    fn register_instance(
        &self,
        instance: Instance,
    ) -> BoxFuture<'_, Result<Registration, DiscoveryError>> {
        match self.backends.first() {
            Some(first) => first.register_instance(instance),
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
                told: HashMap::new(),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use crate::discovery::MemoryDiscovery;

    async fn next(watch: &mut DiscoveryStream) -> DiscoveryEvent {
        tokio::time::timeout(std::time::Duration::from_secs(10), watch.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    }

    #[tokio::test]
    async fn an_id_two_backends_list_is_the_first_s_and_moves_as_removed_then_added() {
        let (a, b) = (
            Arc::new(MemoryDiscovery::new()),
            Arc::new(MemoryDiscovery::new()),
        );
        let id = ChannelId::new("prod", "w", "kv", 1).unwrap();
        let other = ChannelId::new("prod", "w", "kv", 2).unwrap();
        // The second backend's incarnations run ahead of the first's.
        for _ in 0..5 {
            drop(
                b.register(other.clone(), Transport::zmq("tcp://127.0.0.1:9"))
                    .await
                    .unwrap(),
            );
        }
        let in_b = b
            .register(id.clone(), Transport::zmq("tcp://127.0.0.1:2"))
            .await
            .unwrap();
        let merged = Merged::new(vec![a.clone(), b.clone()]);
        let mut watch = merged
            .watch(Query::new("prod"), CancellationToken::new())
            .await
            .unwrap();
        // Nothing before every backend's first Resync; then the union.
        let DiscoveryEvent::Resync(all) = next(&mut watch).await else {
            panic!("the first event is the union")
        };
        assert_eq!(all, vec![in_b.instance().clone()]);
        // The first backend lists it too: it takes precedence.
        let in_a = a
            .register(id.clone(), Transport::zmq("tcp://127.0.0.1:1"))
            .await
            .unwrap();
        assert!(in_a.instance().incarnation < in_b.instance().incarnation);
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id: id.clone(),
                incarnation: in_b.instance().incarnation
            }
        );
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Added(in_a.instance().clone())
        );
        // The second backend's change is shadowed: nothing to tell.
        drop(in_b);
        let in_b = b
            .register(id.clone(), Transport::zmq("tcp://127.0.0.1:3"))
            .await
            .unwrap();
        // The first lets go: back to the second, as a removal then an addition.
        let a_incarnation = in_a.instance().incarnation;
        in_a.unregister().await.unwrap();
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id: id.clone(),
                incarnation: a_incarnation
            }
        );
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Added(in_b.instance().clone())
        );
        // Gone from every backend: removed.
        let b_incarnation = in_b.instance().incarnation;
        in_b.unregister().await.unwrap();
        assert_eq!(
            next(&mut watch).await,
            DiscoveryEvent::Removed {
                id,
                incarnation: b_incarnation
            }
        );
    }
}
