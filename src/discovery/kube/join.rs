//! Dynamo's join rule as a state machine: a resource's publishers are visible only
//! while readiness names the resource (by name) ready with the uid of the pod that
//! owns it. Fed with resource and readiness changes (from EndpointSlices in pod mode,
//! Pods in container mode), it answers with the publishers that appeared and
//! disappeared. Pure: no I/O, no clock.
//!
//! Readiness is a union: every readiness object contributes the (resource name, pod
//! uid) pairs it reports ready, and a name is ready while some object contributes it;
//! contributions of two different uids for one name conflict and exclude it.
//!
//! Shared caps are fair to the workers that can join:
//! - A resource no pod owns can never join: nothing of it is kept or counted.
//! - When a joined resource needs room (`max_resources` in its namespace, or
//!   `max_publisher_refs` in all), resources that are not joined make it: the one
//!   advertising the most publishers (the oldest of those) is evicted, counted, until
//!   there is room (none is evicted when all of them would not make enough); joined
//!   resources are never evicted. A resource not joined yet makes no room: refused
//!   (or evicted), it is parked, and readiness naming it ready sets `reread` (the
//!   caller reads everything again).
//! - Two joined resources advertising one publisher id: the older (its
//!   `creationTimestamp`, then its name) shows it, the other is counted; when the
//!   holder goes, the next claimant shows it.

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

/// What was shown under each publisher id, and from which resource.
type Shown = HashMap<ChannelId, (Key, Instance)>;

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
    owner: PodRef,
    publishers: Vec<Instance>,
    /// Its creation timestamp (RFC 3339 as the server writes it: sorts by time).
    created: Option<String>,
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
    /// Resources refused or evicted for room, with their owner's uid (at most
    /// `max_resources`): when readiness names one ready, [`reread`](Self::reread).
    parked: HashMap<Key, String>,
    /// Set when a parked resource's pod became ready: the caller reads everything
    /// again (and clears it), where that resource, joined, makes its room.
    pub(crate) reread: bool,
    /// Their contributions in all, per namespace (at most `max_resources` and
    /// `max_channel_entries` more).
    readiness_entries: HashMap<Ns, usize>,
    /// (namespace, resource name) → contributions by pod uid.
    ready: HashMap<Key, HashMap<String, u32>>,
    /// Which visible resource each publisher id is taken from (the oldest joined
    /// resource advertising it).
    claims: HashMap<ChannelId, Key>,
    /// Every kept resource advertising each publisher id (as many entries as `refs`).
    advertisers: HashMap<ChannelId, Vec<Key>>,
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
            readiness_entries: HashMap::new(),
            parked: HashMap::new(),
            reread: false,
            ready: HashMap::new(),
            claims: HashMap::new(),
            advertisers: HashMap::new(),
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
                    created: None,
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
            .filter(|o| advertised.owner.as_ref() == Some(&o.owner))
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
        // No pod owns it: it can never join, and costs nothing.
        self.parked.remove(&key);
        let Some(owner) = advertised.owner else {
            return self.show(&keys, before);
        };
        // Only a joined resource makes room (one not joined yet is parked instead, and
        // read again once its pod is ready): a tenant's resources, never joined,
        // cannot evict a worker whose readiness is on its way.
        let joined = self.joined(&key, &owner);
        let count = |j: &Join| j.per_namespace.get(&ns).copied().unwrap_or(0);
        while joined && count(self) >= self.limits.max_resources && self.evict(Some(ns), false) {}
        if count(self) >= self.limits.max_resources {
            self.skipped += 1;
            self.park(key, owner);
            return self.show(&keys, before);
        }
        let mut publishers = advertised.publishers;
        let need = publishers.len();
        let short = (self.refs + need).saturating_sub(self.limits.max_publisher_refs);
        if joined && short > 0 && self.evictable_refs() >= short {
            while self.refs + need > self.limits.max_publisher_refs && self.evict(None, true) {}
        }
        if self.refs + need > self.limits.max_publisher_refs {
            // Over the total: its earlier advertisement is already withdrawn.
            self.skipped += need as u64;
            publishers = Vec::new();
            if !joined {
                self.parked.insert(key.clone(), owner.uid.clone());
            }
        }
        self.refs += publishers.len();
        for p in &publishers {
            self.advertisers
                .entry(p.id.clone())
                .or_default()
                .push(key.clone());
        }
        *self.per_namespace.entry(ns).or_default() += 1;
        self.resources.insert(
            key,
            Resource {
                owner,
                publishers,
                created: advertised.created,
            },
        );
        self.show(&keys, before)
    }

    /// Parks a resource refused or evicted for room (within `max_resources`).
    fn park(&mut self, key: Key, owner: PodRef) {
        if self.parked.len() < self.limits.max_resources {
            self.parked.insert(key, owner.uid);
        }
    }

    /// Publishers held by resources that are not joined (what evictions could free).
    fn evictable_refs(&self) -> usize {
        self.resources
            .iter()
            .filter(|(k, r)| !self.joined(k, &r.owner))
            .map(|(_, r)| r.publishers.len())
            .sum()
    }

    /// Evicts the resource (in `ns`, or anywhere; with `refs`, only one holding
    /// publishers) that is not joined and advertises the most publishers (the oldest
    /// of those), parking it: `false` when there is none.
    fn evict(&mut self, ns: Option<Ns>, refs: bool) -> bool {
        let victim = self
            .resources
            .iter()
            .filter(|(k, r)| ns.is_none_or(|ns| k.ns == ns) && !self.joined(k, &r.owner))
            .filter(|(_, r)| !refs || !r.publishers.is_empty())
            .max_by(|(ka, a), (kb, b)| {
                a.publishers
                    .len()
                    .cmp(&b.publishers.len())
                    .then_with(|| older(kb, b, ka, a))
            })
            .map(|(k, _)| k.clone());
        let Some(victim) = victim else {
            return false;
        };
        self.skipped += 1;
        if let Some(owner) = self.resources.get(&victim).map(|r| r.owner.clone()) {
            self.park(victim.clone(), owner);
        }
        self.remove_resource(&victim);
        true
    }

    /// A resource was deleted.
    pub(crate) fn delete_resource(&mut self, ns: Ns, name: &str) -> Vec<Change> {
        let keys = [Key {
            ns,
            name: name.to_owned(),
        }];
        let before = self.hide(&keys);
        self.remove_resource(&keys[0]);
        self.parked.remove(&keys[0]);
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
        // At most `max_channel_entries` an object, and in all, per namespace, as many
        // as resources and one object's more; past either, the entries naming no
        // resource held go first.
        let cap = self
            .limits
            .max_resources
            .saturating_add(self.limits.max_channel_entries);
        let held = self
            .readiness_entries
            .get(&ns)
            .copied()
            .unwrap_or(0)
            .saturating_sub(old.as_ref().map_or(0, Vec::len));
        let room = cap
            .saturating_sub(held)
            .min(self.limits.max_channel_entries);
        if seen.len() > room {
            let resources = &self.resources;
            seen.sort_by_key(|s| {
                !resources.contains_key(&Key {
                    ns,
                    name: s.name.clone(),
                })
            });
            self.skipped += (seen.len() - room) as u64;
            seen.truncate(room);
        }
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
        // (What is kept, once both bounds have spoken.)
        self.readiness_entries.insert(ns, held + seen.len());
        // A resource refused or evicted for room whose pod is now ready: read it again.
        if seen.iter().any(|s| {
            self.parked
                .get(&Key {
                    ns,
                    name: s.name.clone(),
                })
                .is_some_and(|uid| *uid == s.uid)
        }) {
            self.reread = true;
        }
        let old = old.unwrap_or_default();
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
        for p in &old.publishers {
            if let Some(keys) = self.advertisers.get_mut(&p.id) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.advertisers.remove(&p.id);
                }
            }
        }
        if let Some(n) = self.per_namespace.get_mut(&key.ns) {
            *n -= 1;
        }
    }

    /// Takes the publishers of `keys` out of the view (releasing their claims) and
    /// returns what was visible.
    fn hide(&mut self, keys: &[Key]) -> Shown {
        let mut before = HashMap::new();
        for key in keys {
            let Some(res) = self.resources.get(key) else {
                continue;
            };
            for p in &res.publishers {
                if self.claims.get(&p.id) == Some(key) {
                    self.claims.remove(&p.id);
                    before.insert(p.id.clone(), (key.clone(), p.clone()));
                }
            }
        }
        before
    }

    /// Puts the publishers of `keys` that are joined back into the view (each id to
    /// the oldest joined resource advertising it) and returns the difference with
    /// `before`; an id of `before` none of them shows goes to the next claimant.
    fn show(&mut self, keys: &[Key], mut before: Shown) -> Vec<Change> {
        let mut changes = Vec::new();
        // The oldest first: an id two of them advertise is shown once, from the older.
        let mut ordered: Vec<Key> = keys.to_vec();
        ordered.sort_by(
            |a, b| match (self.resources.get(a), self.resources.get(b)) {
                (Some(ra), Some(rb)) => older(a, ra, b, rb),
                (a, b) => b.is_some().cmp(&a.is_some()),
            },
        );
        for key in &ordered {
            let Some(res) = self.resources.get(key) else {
                continue;
            };
            if !self.joined(key, &res.owner) {
                continue;
            }
            let ids: Vec<ChannelId> = res.publishers.iter().map(|p| p.id.clone()).collect();
            for id in ids {
                match self.claims.get(&id) {
                    None => {}
                    Some(holder) if self.is_older(holder, key) => {
                        // The older resource keeps it.
                        self.skipped += 1;
                        continue;
                    }
                    Some(holder) => {
                        // This one is older: it takes the id over (the other counted).
                        let holder = holder.clone();
                        let shown = self.publisher(&holder, &id).cloned();
                        before.extend(shown.map(|p| (id.clone(), (holder, p))));
                        self.skipped += 1;
                    }
                }
                self.claims.insert(id.clone(), key.clone());
                self.changed(key, &id, before.remove(&id), &mut changes);
            }
        }
        for (id, old) in before {
            match self.next_claimant(&id) {
                Some(next) => {
                    self.claims.insert(id.clone(), next.clone());
                    self.changed(&next, &id, Some(old), &mut changes);
                }
                None => changes.push(Change::Down(id, old.1.incarnation)),
            }
        }
        changes
    }

    /// Records `key`'s publisher `id` as shown, replacing `old` (the resource that
    /// showed that id, and what it showed, if any): `Up` unless the same resource
    /// shows the same endpoint, worker and recovery endpoint.
    fn changed(
        &self,
        key: &Key,
        id: &ChannelId,
        old: Option<(Key, Instance)>,
        out: &mut Vec<Change>,
    ) {
        let Some(p) = self.publisher(key, id) else {
            return;
        };
        match old {
            Some((from, old))
                if from == *key
                    && old.transport == p.transport
                    && old.worker == p.worker
                    && old.recovery == p.recovery => {}
            _ => out.push(Change::Up(p.clone())),
        }
    }

    fn publisher(&self, key: &Key, id: &ChannelId) -> Option<&Instance> {
        self.resources
            .get(key)?
            .publishers
            .iter()
            .find(|p| p.id == *id)
    }

    /// The oldest joined resource advertising `id`, if any.
    fn next_claimant(&self, id: &ChannelId) -> Option<Key> {
        self.advertisers
            .get(id)?
            .iter()
            .filter_map(|k| Some((k, self.resources.get(k)?)))
            .filter(|(k, r)| self.joined(k, &r.owner))
            .min_by(|(ka, a), (kb, b)| older(ka, a, kb, b))
            .map(|(k, _)| k.clone())
    }

    /// Whether resource `a` is older than `b`.
    fn is_older(&self, a: &Key, b: &Key) -> bool {
        match (self.resources.get(a), self.resources.get(b)) {
            (Some(ra), Some(rb)) => older(a, ra, b, rb).is_lt(),
            _ => false,
        }
    }
}

/// Orders two resources by age: the creation timestamp (an unknown one last), then
/// the namespace and name.
fn older(ka: &Key, a: &Resource, kb: &Key, b: &Resource) -> std::cmp::Ordering {
    let created = |r: &Resource| (r.created.is_none(), r.created.clone());
    created(a)
        .cmp(&created(b))
        .then_with(|| (ka.ns, &ka.name).cmp(&(kb.ns, &kb.name)))
}

#[cfg(test)]
#[path = "join_tests.rs"]
mod tests;
