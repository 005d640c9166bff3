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

use crate::discovery::{ChannelId, Discovery, DiscoveryEvent, Instance, Query, Rewatch, Rewatched};
use crate::net::{Backoff, RateLimitedWarn};

/// Instances a broker's view holds per namespace; more are not advertised (counted in
/// `BrokerStats::view_ignored`), so discovery records cannot grow a broker without
/// bound.
pub(crate) const MAX_VIEW_INSTANCES: usize = 65_536;

/// Bytes a broker's view holds per namespace (its instances' ids and endpoints, 128 B
/// of bookkeeping each); past it, new instances are not advertised (counted in
/// `BrokerStats::view_ignored`). An endpoint over 1 KiB is never advertised: no
/// subscribe could name it.
pub(crate) const MAX_VIEW_BYTES: usize = 16 << 20;

/// What an instance costs the view, in bytes.
fn cost(id: &ChannelId, endpoints: &Advertised) -> usize {
    let names = endpoints.iter().map(|e| e.len() * 2).sum::<usize>();
    id.namespace().len() + id.component().len() + id.topic().len() + names + 128
}

/// What one instance advertises: its publisher endpoint, and its worker's recovery
/// endpoint when it registered one ([`Instance::recovery`]; a router asks it through
/// the broker as it subscribes through it).
type Advertised = Vec<String>;

/// One namespace's advertised endpoints.
#[derive(Default)]
struct Namespace {
    /// Each instance's incarnation and endpoints.
    by_id: HashMap<ChannelId, (u64, Advertised)>,
    /// How many instances advertise each endpoint.
    endpoints: HashMap<String, usize>,
    /// What it holds, by [`cost`].
    bytes: usize,
}

impl Namespace {
    /// Adds or replaces `instance`; `false` when it cannot be advertised as it is (the
    /// namespace is full, even counting what a replaced incarnation gives back; its
    /// endpoint is over 1 KiB; or its recovery endpoint is over 1 KiB or does not fit,
    /// in which case the publisher is advertised without it).
    fn add(&mut self, instance: &Instance) -> bool {
        let endpoint = instance.transport.endpoint();
        if endpoint.len() > crate::tunnel::MAX_NAME_LEN {
            return false;
        }
        let mut advertised = vec![endpoint.to_owned()];
        let mut whole = true;
        if let Some(recovery) = &instance.recovery {
            whole = recovery.len() <= crate::tunnel::MAX_NAME_LEN;
            if whole && recovery != endpoint {
                advertised.push(recovery.clone());
            }
        }
        let replaced = self
            .by_id
            .get(&instance.id)
            .map(|(_, old)| cost(&instance.id, old));
        if replaced.is_none() && self.by_id.len() >= MAX_VIEW_INSTANCES {
            return false;
        }
        let room = MAX_VIEW_BYTES.saturating_sub(self.bytes) + replaced.unwrap_or(0);
        if cost(&instance.id, &advertised) > room {
            // Without its recovery endpoint, if that fits.
            advertised.truncate(1);
            whole = false;
            if cost(&instance.id, &advertised) > room {
                // Discovery moved on from the earlier incarnation: it is not dialled
                // either.
                if let Some((_, old)) = self.by_id.remove(&instance.id) {
                    self.bytes = self.bytes.saturating_sub(cost(&instance.id, &old));
                    self.forget(&old);
                }
                return false;
            }
        }
        let added = cost(&instance.id, &advertised);
        for e in &advertised {
            *self.endpoints.entry(e.clone()).or_default() += 1;
        }
        self.bytes += added;
        if let Some((_, old)) = self
            .by_id
            .insert(instance.id.clone(), (instance.incarnation, advertised))
        {
            self.bytes = self.bytes.saturating_sub(cost(&instance.id, &old));
            self.forget(&old);
        }
        whole
    }

    fn remove(&mut self, id: &ChannelId, incarnation: u64) {
        if self
            .by_id
            .get(id)
            .is_some_and(|(seen, _)| *seen <= incarnation)
        {
            if let Some((_, advertised)) = self.by_id.remove(id) {
                self.bytes = self.bytes.saturating_sub(cost(id, &advertised));
                self.forget(&advertised);
            }
        }
    }

    fn forget(&mut self, advertised: &[String]) {
        for endpoint in advertised {
            if let Some(n) = self.endpoints.get_mut(endpoint) {
                *n -= 1;
                if *n == 0 {
                    self.endpoints.remove(endpoint);
                }
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

/// Follows one namespace: applies each watch's events to its snapshot, keeping the
/// last snapshot while discovery fails, until the next complete list.
async fn follow(
    discovery: Arc<dyn Discovery>,
    ns: String,
    snapshots: Snapshots,
    shared: Shared,
    cancel: CancellationToken,
) {
    let backoff = Backoff::checked(Duration::from_millis(200), Duration::from_secs(30));
    let mut watch = Rewatch::new(discovery, Query::new(&ns), backoff, cancel);
    // Before a watch's first complete list its events are partial: the list replaces
    // the snapshot in one step.
    let mut listed = false;
    let mut ever_listed = false;
    let with_view = |f: &mut dyn FnMut(&mut Option<Namespace>)| {
        let mut snapshots = snapshots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = snapshots.get_mut(&ns) {
            f(slot);
        }
    };
    while let Some(next) = watch.next().await {
        let left_out = match next {
            Rewatched::Event(DiscoveryEvent::Resync(all)) => {
                let (mut fresh, left_out) = Namespace::from_snapshot(&all);
                with_view(&mut |slot| *slot = Some(std::mem::take(&mut fresh)));
                listed = true;
                if !ever_listed {
                    ever_listed = true;
                    shared.synced.send_modify(|n| *n += 1);
                    tracing::info!(namespace = %ns, publishers = all.len(), "discovery view listed");
                }
                left_out
            }
            Rewatched::Event(DiscoveryEvent::Added(instance)) if listed => {
                let mut added = true;
                with_view(&mut |slot| added = slot.as_mut().is_none_or(|v| v.add(&instance)));
                u64::from(!added)
            }
            Rewatched::Event(DiscoveryEvent::Removed { id, incarnation }) if listed => {
                with_view(&mut |slot| {
                    if let Some(view) = slot {
                        view.remove(&id, incarnation);
                    }
                });
                0
            }
            Rewatched::Event(_) => 0,
            Rewatched::Failed(e) | Rewatched::Ended(Some(e)) => {
                listed = false;
                if let Some(suppressed) = shared.warn.check(&ns, Instant::now()) {
                    tracing::warn!(namespace = %ns, error = %crate::net::ErrorChain(&e), suppressed, "discovery watch failed; keeping the last snapshot");
                }
                0
            }
            Rewatched::Ended(None) => {
                listed = false;
                0
            }
        };
        if left_out > 0 {
            shared.ignored.fetch_add(left_out, Ordering::Relaxed);
            if let Some(suppressed) = shared.warn.check("full", Instant::now()) {
                tracing::warn!(namespace = %ns, ignored = left_out, suppressed, max_instances = MAX_VIEW_INSTANCES, max_bytes = MAX_VIEW_BYTES, "discovery view: instances not advertised, or without their recovery endpoint (the namespace is full, or an endpoint is over 1 KiB)");
            }
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

    #[test]
    fn a_namespace_is_bounded_in_bytes_and_skips_unusable_endpoints() {
        let long = |n: u64, len: usize| {
            Instance::new(
                ChannelId::new("ns", "c", "t", n).unwrap(),
                Transport::zmq(format!("tcp://{}:{n}", "h".repeat(len))),
                1,
            )
        };
        // An endpoint over 1 KiB is never advertised.
        let (ns, ignored) = Namespace::from_snapshot(&[long(1, 1100)]);
        assert_eq!((ns.by_id.len(), ignored), (0, 1));
        // 1 KiB endpoints fill the byte cap long before the instance cap.
        let all: Vec<Instance> = (0..20_000).map(|n| long(n, 1000)).collect();
        let (mut ns, ignored) = Namespace::from_snapshot(&all);
        assert!(ns.bytes <= MAX_VIEW_BYTES, "{}", ns.bytes);
        assert!(ignored > 0 && ns.by_id.len() < 20_000);
        let held = ns.bytes;
        // Removing gives its bytes back; the emptied namespace holds none.
        for i in &all {
            ns.remove(&i.id, 1);
        }
        assert!(held > 0 && ns.bytes == 0 && ns.endpoints.is_empty());
    }

    #[test]
    fn a_recovery_endpoint_is_advertised_with_its_publisher_and_goes_with_it() {
        let mut ns = Namespace::default();
        let recovering = instance(1, 1).with_recovery("tcp://10.0.0.1:6000");
        assert!(ns.add(&recovering));
        assert!(ns.endpoints.contains_key("tcp://10.0.0.1:6000"));
        // Its next incarnation moved the recovery endpoint: the old one is not dialled.
        assert!(ns.add(&instance(1, 2).with_recovery("tcp://10.0.0.1:6001")));
        assert!(!ns.endpoints.contains_key("tcp://10.0.0.1:6000"));
        assert!(ns.endpoints.contains_key("tcp://10.0.0.1:6001"));
        // One over 1 KiB is left out (and counted); the publisher stays.
        let long = format!("tcp://{}:1", "h".repeat(1100));
        assert!(!ns.add(&instance(2, 1).with_recovery(long.as_str())));
        assert!(!ns.endpoints.contains_key(&long));
        assert!(
            ns.endpoints
                .contains_key(instance(2, 1).transport.endpoint())
        );
        ns.remove(&recovering.id, 2);
        ns.remove(&ChannelId::new("ns", "c", "t", 2).unwrap(), 1);
        assert!(ns.endpoints.is_empty() && ns.bytes == 0);
    }

    #[test]
    fn replacements_are_held_to_the_byte_cap_too() {
        // Small instances up to the cap, then each replaced by a large incarnation:
        // the namespace never grows past its bytes.
        let small: Vec<Instance> = (0..20_000).map(|n| instance(n, 1)).collect();
        let (mut ns, _) = Namespace::from_snapshot(&small);
        let big = |n: u64| {
            Instance::new(
                ChannelId::new("ns", "c", "t", n).unwrap(),
                Transport::zmq(format!("tcp://{}:{n}", "h".repeat(1000))),
                2,
            )
            .with_recovery(format!("tcp://{}:{n}", "r".repeat(1000)))
        };
        let (mut refused, mut gone) = (0, 0);
        for n in 0..20_000 {
            refused += u64::from(!ns.add(&big(n)));
            gone += u64::from(!ns.by_id.contains_key(&big(n).id));
            assert!(ns.bytes <= MAX_VIEW_BYTES, "{} after {n}", ns.bytes);
        }
        assert!(refused > gone && gone > 0, "{refused} {gone}");
        // A replacement that does not fit at all takes its earlier incarnation out of
        // the view (discovery moved on from it).
        assert_eq!(ns.by_id.len() as u64, 20_000 - gone);
        let advertised: usize = ns.by_id.values().map(|(_, a)| a.len()).sum();
        assert_eq!(ns.endpoints.values().sum::<usize>(), advertised);
    }
}
