//! The broker's discovery view (DESIGN §7.2): a watch per namespace it covers, held as
//! a snapshot of advertised endpoints. It is ready once every namespace completed its
//! initial list; across watch restarts it keeps its last snapshot, replaced atomically
//! by the next complete list (the watch's `Resync`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::discovery::{ChannelId, Discovery, DiscoveryEvent, Instance, Query};
use crate::net::{Backoff, RateLimitedWarn, random_unit};

/// One namespace's advertised endpoints.
#[derive(Default)]
struct Namespace {
    /// Each instance's incarnation and endpoint.
    by_id: HashMap<ChannelId, (u64, String)>,
    /// How many instances advertise each endpoint.
    endpoints: HashMap<String, usize>,
}

impl Namespace {
    fn add(&mut self, instance: &Instance) {
        let endpoint = instance.transport.endpoint().to_owned();
        *self.endpoints.entry(endpoint.clone()).or_default() += 1;
        if let Some((_, old)) = self
            .by_id
            .insert(instance.id.clone(), (instance.incarnation, endpoint))
        {
            self.forget(&old);
        }
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

    fn from_snapshot(all: &[Instance]) -> Namespace {
        let mut ns = Namespace::default();
        for instance in all {
            ns.add(instance);
        }
        ns
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
        for ns in namespaces {
            tokio::spawn(follow(
                discovery.clone(),
                ns.clone(),
                snapshots.clone(),
                synced_tx.clone(),
                warn.clone(),
                cancel.child_token(),
            ));
        }
        View {
            snapshots,
            synced,
            namespaces: namespaces.len(),
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

/// Follows one namespace: watches, applies the events, restarts a watch that fails or
/// ends (with backoff), keeping the last snapshot until the next complete list.
async fn follow(
    discovery: Arc<dyn Discovery>,
    ns: String,
    snapshots: Snapshots,
    synced: Arc<watch::Sender<usize>>,
    warn: Arc<RateLimitedWarn>,
    cancel: CancellationToken,
) {
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
                            apply(&mut |slot| *slot = Some(Namespace::from_snapshot(&all)));
                            listed = true;
                            backoff.reset();
                            if !ever_synced {
                                ever_synced = true;
                                synced.send_modify(|n| *n += 1);
                                tracing::info!(namespace = %ns, publishers = all.len(), "discovery view listed");
                            }
                        }
                        Some(Ok(DiscoveryEvent::Added(instance))) if listed => {
                            apply(&mut |slot| {
                                if let Some(view) = slot {
                                    view.add(&instance);
                                }
                            });
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
