//! The broker's discovery view (DESIGN §7.2): a watch per namespace it covers, held as
//! a snapshot of advertised endpoints. It is ready once every namespace completed its
//! initial list; across watch restarts it keeps its last snapshot, replaced atomically
//! by the next complete list (the watch's `Resync`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::discovery::{ChannelId, Discovery, DiscoveryEvent, Instance, Query};
use crate::net::{Backoff, RateLimitedWarn, random_unit};

/// Instances a broker's view holds per namespace; more are not advertised (counted in
/// `BrokerStats::view_ignored`), so discovery records cannot grow a broker without
/// bound.
pub const MAX_VIEW_INSTANCES: usize = 65_536;

/// One namespace's advertised endpoints.
#[derive(Default)]
struct Namespace {
    /// Each instance's incarnation and endpoint.
    by_id: HashMap<ChannelId, (u64, String)>,
    /// How many instances advertise each endpoint.
    endpoints: HashMap<String, usize>,
}

impl Namespace {
    /// Adds or replaces `instance`; `false` when the namespace is full.
    fn add(&mut self, instance: &Instance) -> bool {
        if self.by_id.len() >= MAX_VIEW_INSTANCES && !self.by_id.contains_key(&instance.id) {
            return false;
        }
        let endpoint = instance.transport.endpoint().to_owned();
        *self.endpoints.entry(endpoint.clone()).or_default() += 1;
        if let Some((_, old)) = self
            .by_id
            .insert(instance.id.clone(), (instance.incarnation, endpoint))
        {
            self.forget(&old);
        }
        true
    }

    fn remove(&mut self, id: &ChannelId, incarnation: u64) {
        if self
            .by_id
            .get(id)
            .is_some_and(|(seen, _)| *seen <= incarnation)
        {
            if let Some((_, endpoint)) = self.by_id.remove(id) {
                self.forget(&endpoint);
            }
        }
    }

    fn forget(&mut self, endpoint: &str) {
        if let Some(n) = self.endpoints.get_mut(endpoint) {
            *n -= 1;
            if *n == 0 {
                self.endpoints.remove(endpoint);
            }
        }
    }

    /// The namespace holding `all`, and how many did not fit.
    fn from_snapshot(all: &[Instance]) -> (Namespace, u64) {
        let mut ns = Namespace::default();
        let mut ignored = 0;
        for instance in all {
            if !ns.add(instance) {
                ignored += 1;
            }
        }
        (ns, ignored)
    }
}

/// The namespaces' snapshots; `None` until a namespace's first complete list.
type Snapshots = Arc<Mutex<HashMap<String, Option<Namespace>>>>;

/// What the broker may dial: endpoints advertised in its discovery view.
#[derive(Clone)]
pub(crate) struct View {
    snapshots: Snapshots,
    /// How many namespaces have completed an initial list.
    synced: watch::Receiver<usize>,
    namespaces: usize,
    /// Instances not advertised because their namespace was full.
    ignored: Arc<AtomicU64>,
}

impl View {
    /// Starts watching `namespaces` of `discovery` until `cancel`.
    pub(crate) fn spawn(
        discovery: Arc<dyn Discovery>,
        namespaces: &[String],
        cancel: &CancellationToken,
    ) -> View {
        let snapshots: Snapshots = Arc::new(Mutex::new(
            namespaces.iter().map(|ns| (ns.clone(), None)).collect(),
        ));
        let (synced_tx, synced) = watch::channel(0);
        let synced_tx = Arc::new(synced_tx);
        let warn = Arc::new(RateLimitedWarn::default());
        let ignored = Arc::new(AtomicU64::new(0));
        for ns in namespaces {
            tokio::spawn(follow(
                discovery.clone(),
                ns.clone(),
                snapshots.clone(),
                Shared {
                    synced: synced_tx.clone(),
                    warn: warn.clone(),
                    ignored: ignored.clone(),
                },
                cancel.child_token(),
            ));
        }
        View {
            snapshots,
            synced,
            namespaces: namespaces.len(),
            ignored,
        }
    }

    /// Whether `endpoint` is advertised in any namespace the broker covers.
    pub(crate) fn advertised(&self, endpoint: &str) -> bool {
        let snapshots = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
        snapshots
            .values()
            .flatten()
            .any(|ns| ns.endpoints.contains_key(endpoint))
    }

    /// How many endpoints the view advertises (distinct within each namespace).
    pub(crate) fn endpoints(&self) -> usize {
        let snapshots = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
        snapshots
            .values()
            .flatten()
            .map(|ns| ns.endpoints.len())
            .sum()
    }

    /// Instances not advertised because their namespace held
    /// [`MAX_VIEW_INSTANCES`] already.
    pub(crate) fn ignored(&self) -> u64 {
        self.ignored.load(Ordering::Relaxed)
    }

    /// Whether every namespace completed its initial list.
    pub(crate) fn is_ready(&self) -> bool {
        *self.synced.borrow() >= self.namespaces
    }

    /// Waits until every namespace completed its initial list.
    pub(crate) async fn ready(&self) {
        let mut synced = self.synced.clone();
        let n = self.namespaces;
        let _ = synced.wait_for(|s| *s >= n).await;
    }
}

/// What the namespaces' followers share.
struct Shared {
    synced: Arc<watch::Sender<usize>>,
    warn: Arc<RateLimitedWarn>,
    ignored: Arc<AtomicU64>,
}

/// Follows one namespace: watches, applies the events, restarts a watch that fails or
/// ends (with backoff), keeping the last snapshot until the next complete list.
async fn follow(
    discovery: Arc<dyn Discovery>,
    ns: String,
    snapshots: Snapshots,
    shared: Shared,
    cancel: CancellationToken,
) {
    let Shared {
        synced,
        warn,
        ignored,
    } = shared;
    let full = |ns: &str, n: u64| {
        if n > 0 {
            ignored.fetch_add(n, Ordering::Relaxed);
            if let Some(suppressed) = warn.check("full", Instant::now()) {
                tracing::warn!(namespace = %ns, ignored = n, suppressed, max = MAX_VIEW_INSTANCES, "discovery view full: instances not advertised");
            }
        }
    };
    let mut backoff = Backoff::checked(Duration::from_millis(200), Duration::from_secs(30));
    let mut ever_synced = false;
    let apply = |f: &mut dyn FnMut(&mut Option<Namespace>)| {
        let mut snapshots = snapshots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = snapshots.get_mut(&ns) {
            f(slot);
        }
    };
    loop {
        let watched = tokio::select! {
            () = cancel.cancelled() => return,
            w = discovery.watch(Query::new(&ns), cancel.child_token()) => w,
        };
        match watched {
            Ok(mut stream) => {
                // Before this watch's first complete list its events are partial: the
                // list replaces the snapshot in one step.
                let mut listed = false;
                loop {
                    let event = tokio::select! {
                        () = cancel.cancelled() => return,
                        e = stream.next() => e,
                    };
                    match event {
                        None => break,
                        Some(Ok(DiscoveryEvent::Resync(all))) => {
                            let (view, left_out) = Namespace::from_snapshot(&all);
                            let mut view = Some(view);
                            apply(&mut |slot| *slot = view.take());
                            full(&ns, left_out);
                            listed = true;
                            backoff.reset();
                            if !ever_synced {
                                ever_synced = true;
                                synced.send_modify(|n| *n += 1);
                                tracing::info!(namespace = %ns, publishers = all.len(), "discovery view listed");
                            }
                        }
                        Some(Ok(DiscoveryEvent::Added(instance))) if listed => {
                            let mut added = true;
                            apply(&mut |slot| {
                                if let Some(view) = slot {
                                    added = view.add(&instance);
                                }
                            });
                            full(&ns, u64::from(!added));
                        }
                        Some(Ok(DiscoveryEvent::Removed { id, incarnation })) if listed => {
                            apply(&mut |slot| {
                                if let Some(view) = slot {
                                    view.remove(&id, incarnation);
                                }
                            });
                        }
                        Some(Ok(_)) => {}
                        Some(Err(e)) => {
                            if let Some(suppressed) = warn.check(&ns, Instant::now()) {
                                tracing::warn!(namespace = %ns, error = %crate::net::ErrorChain(&e), suppressed, "discovery watch error; keeping the last snapshot");
                            }
                        }
                    }
                }
            }
            Err(e) => {
                if let Some(suppressed) = warn.check(&ns, Instant::now()) {
                    tracing::warn!(namespace = %ns, error = %crate::net::ErrorChain(&e), suppressed, "cannot watch discovery; keeping the last snapshot");
                }
            }
        }
        let delay = backoff.next_delay(random_unit());
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::discovery::Transport;

    fn instance(n: u64, incarnation: u64) -> Instance {
        Instance::new(
            ChannelId::new("ns", "c", "t", n).unwrap(),
            Transport::zmq(format!("tcp://10.0.{}.{}:5557", n / 250, n % 250)),
            incarnation,
        )
    }

    #[test]
    fn a_namespace_holds_at_most_its_cap_and_still_takes_replacements() {
        let all: Vec<Instance> = (0..=MAX_VIEW_INSTANCES as u64)
            .map(|n| instance(n, 1))
            .collect();
        let (mut ns, ignored) = Namespace::from_snapshot(&all);
        assert_eq!(ignored, 1);
        assert_eq!(ns.by_id.len(), MAX_VIEW_INSTANCES);
        // Full: a new id is refused, a known id's new incarnation is taken.
        assert!(!ns.add(&instance(MAX_VIEW_INSTANCES as u64 + 7, 1)));
        assert!(ns.add(&instance(3, 2)));
        // A stale removal leaves the newer incarnation; a current one removes it.
        ns.remove(&instance(3, 1).id, 1);
        assert!(
            ns.endpoints
                .contains_key(instance(3, 2).transport.endpoint())
        );
        ns.remove(&instance(3, 2).id, 2);
        assert!(
            !ns.endpoints
                .contains_key(instance(3, 2).transport.endpoint())
        );
        assert!(ns.add(&instance(MAX_VIEW_INSTANCES as u64 + 7, 1)));
    }

    #[test]
    fn an_endpoint_shared_by_two_instances_stays_until_both_go() {
        let shared = |n| {
            Instance::new(
                ChannelId::new("ns", "c", "t", n).unwrap(),
                Transport::zmq("tcp://10.0.0.1:5557"),
                1,
            )
        };
        let (mut ns, _) = Namespace::from_snapshot(&[shared(1), shared(2)]);
        ns.remove(&shared(1).id, 1);
        assert!(ns.endpoints.contains_key("tcp://10.0.0.1:5557"));
        ns.remove(&shared(2).id, 1);
        assert!(ns.endpoints.is_empty());
    }
}
