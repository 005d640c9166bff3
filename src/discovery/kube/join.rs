//! Dynamo's join rule as a state machine: a resource's publishers are visible only
//! while readiness names the resource (by name) ready with the uid of the pod that
//! owns it. Fed with resource and readiness changes (from EndpointSlices in pod mode,
//! Pods in container mode), it answers with the publishers that appeared and
//! disappeared. Pure: no I/O, no clock.
//!
//! Readiness is a union: every readiness object contributes the (resource name, pod
//! uid) pairs it reports ready, and a name is ready while some object contributes it;
//! contributions of two different uids for one name conflict and exclude it.

use std::collections::HashMap;

use super::config::Limits;
use super::resource::{Advertised, PodRef};
use crate::discovery::{ChannelId, Instance};

/// A change of the joined view.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Change {
    /// A publisher became visible or changed.
    Up(Instance),
    /// A publisher is no longer visible; the incarnation it was seen with.
    Down(ChannelId, u64),
}

/// Which index a namespace has in the backend's list of namespaces.
pub(crate) type Ns = usize;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    ns: Ns,
    name: String,
}

/// One ready contribution of a readiness object: in pod mode an EndpointSlice
/// endpoint with `conditions.ready` and a `targetRef` (name = the resource's name,
/// the pod's name); in container mode a ready container of a Pod (name
/// `{pod}-{container}`, or the pod's own name for a container named `main`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// The name of the resource it makes ready.
    pub(crate) name: String,
    /// The pod's uid (never empty: the caller drops those).
    pub(crate) uid: String,
}

#[derive(Debug)]
struct Resource {
    owner: Option<PodRef>,
    publishers: Vec<Instance>,
}

/// The joined view of every followed namespace.
#[derive(Debug)]
pub(crate) struct Join {
    limits: Limits,
    resources: HashMap<Key, Resource>,
    per_namespace: HashMap<Ns, usize>,
    /// Readiness objects, by (namespace, object name): their ready contributions.
    readiness: HashMap<Key, Vec<Seen>>,
    readiness_per_namespace: HashMap<Ns, usize>,
    /// (namespace, resource name) → contributions by pod uid.
    ready: HashMap<Key, HashMap<String, u32>>,
    /// Which visible resource each publisher id is taken from (the first to show it).
    claims: HashMap<ChannelId, Key>,
    refs: usize,
    /// Resources, entries and publishers skipped (malformed, over a bound, or an id
    /// another resource already advertises): the caller adds them to `malformed`.
    pub(crate) skipped: u64,
}

impl Join {
    pub(crate) fn new(limits: Limits) -> Join {
        Join {
            limits,
            resources: HashMap::new(),
            per_namespace: HashMap::new(),
            readiness: HashMap::new(),
            readiness_per_namespace: HashMap::new(),
            ready: HashMap::new(),
            claims: HashMap::new(),
            refs: 0,
            skipped: 0,
        }
    }

    /// Every visible publisher.
    pub(crate) fn view(&self) -> Vec<Instance> {
        let mut out = Vec::with_capacity(self.claims.len());
        for (key, res) in &self.resources {
            for p in &res.publishers {
                if self.claims.get(&p.id) == Some(key) {
                    out.push(p.clone());
                }
            }
        }
        out
    }

    /// Resources held now.
    #[cfg(test)]
    pub(crate) fn resources(&self) -> usize {
        self.resources.len()
    }

    /// A resource was added or modified (`Err`: it is malformed, and withdrawn).
    pub(crate) fn upsert_resource<E>(
        &mut self,
        ns: Ns,
        name: &str,
        advertised: Result<Advertised, E>,
    ) -> Vec<Change> {
        let key = Key {
            ns,
            name: name.to_owned(),
        };
        let keys = [key.clone()];
        let before = self.hide(&keys);
        let advertised = match advertised {
            Ok(a) => a,
            Err(_) => {
                self.skipped += 1;
                Advertised {
                    owner: None,
                    publishers: Vec::new(),
                    skipped: 0,
                }
            }
        };
        self.skipped += advertised.skipped;
        // A publisher unchanged (same endpoint and worker) keeps the incarnation this
        // reader first saw it with: re-applying a resource is not a new registration.
        let mut advertised = advertised;
        // (Only while the same pod owns it: a new pod incarnation is a new registration.)
        if let Some(old) = self
            .resources
            .get(&key)
            .filter(|o| o.owner == advertised.owner)
        {
            for p in &mut advertised.publishers {
                if let Some(o) = old.publishers.iter().find(|o| o.id == p.id) {
                    if o.transport == p.transport && o.worker == p.worker {
                        p.incarnation = o.incarnation;
                    }
                }
            }
        }
        self.remove_resource(&key);
        let count = self.per_namespace.get(&ns).copied().unwrap_or(0);
        if count >= self.limits.max_resources {
            self.skipped += 1;
        } else {
            let mut publishers = advertised.publishers;
            if self.refs + publishers.len() > self.limits.max_publisher_refs {
                // Over the total: its earlier advertisement is already withdrawn.
                self.skipped += publishers.len() as u64;
                publishers = Vec::new();
            }
            self.refs += publishers.len();
            *self.per_namespace.entry(ns).or_default() += 1;
            self.resources.insert(
                key,
                Resource {
                    owner: advertised.owner,
                    publishers,
                },
            );
        }
        self.show(&keys, before)
    }

    /// A resource was deleted.
    pub(crate) fn delete_resource(&mut self, ns: Ns, name: &str) -> Vec<Change> {
        let keys = [Key {
            ns,
            name: name.to_owned(),
        }];
        let before = self.hide(&keys);
        self.remove_resource(&keys[0]);
        self.show(&keys, before)
    }

    /// A readiness object (slice or pod) was added or modified, with its ready
    /// contributions; `None`: deleted.
    pub(crate) fn set_readiness(
        &mut self,
        ns: Ns,
        object: &str,
        seen: Option<Vec<Seen>>,
    ) -> Vec<Change> {
        let obj = Key {
            ns,
            name: object.to_owned(),
        };
        let old = self.readiness.remove(&obj);
        let mut seen = seen.unwrap_or_default();
        // As many readiness objects per namespace as resources: more are skipped.
        if old.is_none() && !seen.is_empty() {
            let count = self.readiness_per_namespace.entry(ns).or_default();
            if *count >= self.limits.max_resources {
                self.skipped += 1;
                seen.clear();
            } else {
                *count += 1;
            }
        } else if old.is_some() && seen.is_empty() {
            if let Some(count) = self.readiness_per_namespace.get_mut(&ns) {
                *count = count.saturating_sub(1);
            }
        }
        let old = old.unwrap_or_default();
        if seen.len() > self.limits.max_channel_entries {
            self.skipped += (seen.len() - self.limits.max_channel_entries) as u64;
            seen.truncate(self.limits.max_channel_entries);
        }
        let mut affected: Vec<Key> = old
            .iter()
            .chain(seen.iter())
            .map(|s| Key {
                ns,
                name: s.name.clone(),
            })
            .collect();
        affected.sort_by(|a, b| a.name.cmp(&b.name));
        affected.dedup();
        let before = self.hide(&affected);
        for s in &old {
            let key = Key {
                ns,
                name: s.name.clone(),
            };
            if let Some(uids) = self.ready.get_mut(&key) {
                if let Some(n) = uids.get_mut(&s.uid) {
                    *n -= 1;
                    if *n == 0 {
                        uids.remove(&s.uid);
                    }
                }
                if uids.is_empty() {
                    self.ready.remove(&key);
                }
            }
        }
        for s in &seen {
            *self
                .ready
                .entry(Key {
                    ns,
                    name: s.name.clone(),
                })
                .or_default()
                .entry(s.uid.clone())
                .or_default() += 1;
        }
        if !seen.is_empty() {
            self.readiness.insert(obj, seen);
        }
        self.show(&affected, before)
    }

    /// Whether readiness names the resource ready with its owner's uid, and only
    /// with that uid.
    fn joined(&self, key: &Key, owner: &PodRef) -> bool {
        match self.ready.get(key) {
            Some(uids) if uids.len() == 1 => uids.contains_key(&owner.uid),
            _ => false,
        }
    }

    fn remove_resource(&mut self, key: &Key) {
        let Some(old) = self.resources.remove(key) else {
            return;
        };
        self.refs -= old.publishers.len();
        if let Some(n) = self.per_namespace.get_mut(&key.ns) {
            *n -= 1;
        }
    }

    /// Takes the publishers of `keys` out of the view (releasing their claims) and
    /// returns what was visible.
    fn hide(&mut self, keys: &[Key]) -> HashMap<ChannelId, Instance> {
        let mut before = HashMap::new();
        for key in keys {
            let Some(res) = self.resources.get(key) else {
                continue;
            };
            for p in &res.publishers {
                if self.claims.get(&p.id) == Some(key) {
                    self.claims.remove(&p.id);
                    before.insert(p.id.clone(), p.clone());
                }
            }
        }
        before
    }

    /// Puts the publishers of `keys` that are joined back into the view and returns
    /// the difference with `before`.
    fn show(&mut self, keys: &[Key], mut before: HashMap<ChannelId, Instance>) -> Vec<Change> {
        let mut changes = Vec::new();
        for key in keys {
            let Some(res) = self.resources.get(key) else {
                continue;
            };
            let Some(owner) = &res.owner else {
                continue;
            };
            if !self.joined(key, owner) {
                continue;
            }
            for p in &res.publishers {
                if self.claims.contains_key(&p.id) {
                    // Another visible resource advertises this id: it keeps it.
                    self.skipped += 1;
                    continue;
                }
                self.claims.insert(p.id.clone(), key.clone());
                match before.remove(&p.id) {
                    Some(old) if old.transport == p.transport && old.worker == p.worker => {}
                    _ => changes.push(Change::Up(p.clone())),
                }
            }
        }
        for (id, old) in before {
            changes.push(Change::Down(id, old.incarnation));
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use crate::discovery::{Transport, WorkerIdentity};

    fn limits() -> Limits {
        Limits::default()
    }

    fn pub_(n: u64, incarnation: u64) -> Instance {
        Instance::new(
            ChannelId::new("dyn", "c", "kv", n).unwrap(),
            Transport::zmq(format!("tcp://10.0.0.1:{n}")),
            incarnation,
        )
        .with_worker(WorkerIdentity::new(n, 0))
    }

    fn adv(pod: &str, uid: &str, pubs: Vec<Instance>) -> Result<Advertised, ()> {
        Ok(Advertised {
            owner: Some(PodRef {
                name: pod.into(),
                uid: uid.into(),
            }),
            publishers: pubs,
            skipped: 0,
        })
    }

    fn ready(name: &str, uid: &str) -> Seen {
        Seen {
            name: name.into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn visible_only_while_ready_with_the_owners_uid() {
        let mut j = Join::new(limits());
        assert!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(1, 5)]))
                .is_empty()
        );
        // Another incarnation of the pod is ready: not joined.
        assert!(
            j.set_readiness(0, "s", Some(vec![ready("w0", "u0")]))
                .is_empty()
        );
        assert_eq!(
            j.set_readiness(0, "s", Some(vec![ready("w0", "u1")])),
            vec![Change::Up(pub_(1, 5))]
        );
        assert_eq!(j.view(), vec![pub_(1, 5)]);
        // Not ready any more: down, with the incarnation it was seen with.
        assert_eq!(
            j.set_readiness(0, "s", Some(vec![])),
            vec![Change::Down(pub_(1, 5).id, 5)]
        );
        assert_eq!(
            j.set_readiness(0, "s", Some(vec![ready("w0", "u1")])),
            vec![Change::Up(pub_(1, 5))]
        );
        // Readiness is a union: a second slice adds nothing, its removal takes
        // nothing away.
        assert!(
            j.set_readiness(0, "s2", Some(vec![ready("w0", "u1")]))
                .is_empty()
        );
        assert!(j.set_readiness(0, "s2", None).is_empty());
        // Two uids for one name conflict: excluded until one is gone.
        assert_eq!(
            j.set_readiness(0, "s3", Some(vec![ready("w0", "u2")])),
            vec![Change::Down(pub_(1, 5).id, 5)]
        );
        assert_eq!(j.set_readiness(0, "s3", None), vec![Change::Up(pub_(1, 5))]);
        // The slice deleted: down.
        assert_eq!(
            j.set_readiness(0, "s", None),
            vec![Change::Down(pub_(1, 5).id, 5)]
        );
    }

    #[test]
    fn reapplies_are_not_changes() {
        let mut j = Join::new(limits());
        j.set_readiness(0, "a", Some(vec![ready("w0", "u1")]));
        assert_eq!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(1, 5)])),
            vec![Change::Up(pub_(1, 5))]
        );
        // Re-applied unchanged (a new resourceVersion): not a change.
        assert!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(1, 6)]))
                .is_empty()
        );
        // A publisher added, one withdrawn, the resource deleted.
        assert_eq!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(1, 7), pub_(2, 7)])),
            vec![Change::Up(pub_(2, 7))]
        );
        // Unchanged publishers keep the incarnation first seen.
        assert_eq!(j.view().iter().map(|i| i.incarnation).min(), Some(5));
        assert_eq!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(2, 8)])),
            vec![Change::Down(pub_(1, 7).id, 5)]
        );
        assert_eq!(
            j.delete_resource(0, "w0"),
            vec![Change::Down(pub_(2, 8).id, 7)]
        );
        assert!(j.view().is_empty());
        // A new pod incarnation owning the resource is a new registration, even with
        // the same endpoint: a new incarnation.
        j.set_readiness(0, "b", Some(vec![ready("w0", "u2")]));
        j.set_readiness(0, "a", None);
        j.upsert_resource(0, "w0", adv("w0", "u2", vec![pub_(9, 20)]));
        assert_eq!(
            j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(9, 21)])),
            vec![Change::Down(pub_(9, 20).id, 20)]
        );
        j.set_readiness(0, "b", Some(vec![ready("w0", "u1")]));
        assert_eq!(j.view(), vec![pub_(9, 21)]);
        j.delete_resource(0, "w0");
        j.set_readiness(0, "a", Some(vec![ready("w0", "u1")]));
        // A malformed resource withdraws what it advertised.
        j.upsert_resource(0, "w0", adv("w0", "u1", vec![pub_(3, 9)]));
        assert_eq!(
            j.upsert_resource::<()>(0, "w0", Err(())),
            vec![Change::Down(pub_(3, 9).id, 9)]
        );
        assert_eq!(j.skipped, 1);
    }

    #[test]
    fn bounds_and_duplicate_ids() {
        let mut j = Join::new(Limits {
            max_resources: 2,
            max_publisher_refs: 3,
            ..Limits::default()
        });
        j.set_readiness(
            0,
            "s",
            Some(vec![ready("a", "u"), ready("b", "u"), ready("c", "u")]),
        );
        assert_eq!(
            j.upsert_resource(0, "a", adv("a", "u", vec![pub_(1, 1)]))
                .len(),
            1
        );
        // Another resource advertising the same id: the first keeps it.
        assert!(
            j.upsert_resource(0, "b", adv("b", "u", vec![pub_(1, 2)]))
                .is_empty()
        );
        assert_eq!(j.skipped, 1);
        // Over the resource cap: refused and counted.
        assert!(
            j.upsert_resource(0, "c", adv("c", "u", vec![pub_(3, 1)]))
                .is_empty()
        );
        assert_eq!(j.resources(), 2);
        // Over the publisher-reference cap: the earlier advertisement is withdrawn.
        assert_eq!(
            j.upsert_resource(
                0,
                "a",
                adv("a", "u", vec![pub_(1, 3), pub_(4, 3), pub_(5, 3)])
            ),
            vec![Change::Down(pub_(1, 1).id, 1)]
        );
        assert!(j.view().is_empty());
        // Readiness objects are bounded per namespace like resources: a third is
        // skipped and counted.
        let before = j.skipped;
        j.set_readiness(0, "t", Some(vec![ready("x", "u")]));
        assert_eq!(j.skipped, before);
        j.set_readiness(0, "v", Some(vec![ready("y", "u")]));
        assert_eq!(j.skipped, before + 1);
        // Once one goes, there is room again.
        j.set_readiness(0, "t", None);
        j.set_readiness(0, "v", Some(vec![ready("y", "u")]));
        assert_eq!(j.skipped, before + 1);
        // Other namespaces have their own resource cap.
        j.set_readiness(1, "s", Some(vec![ready("a", "u")]));
        assert_eq!(
            j.upsert_resource(1, "a", adv("a", "u", vec![pub_(9, 1)]))
                .len(),
            1
        );
    }
}
