//! The join's unit tests: the join rule, its caps and its claims.
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
        created: None,
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
    // Over the publisher-reference cap: the earlier advertisement is withdrawn,
    // and b, the next claimant of id 1, shows it (another resource's: up, with
    // its own incarnation).
    assert_eq!(
        j.upsert_resource(
            0,
            "a",
            adv("a", "u", vec![pub_(1, 3), pub_(4, 3), pub_(5, 3)])
        ),
        vec![Change::Up(pub_(1, 2))]
    );
    assert_eq!(j.view(), vec![pub_(1, 2)]);
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

fn adv_created(uid: &str, created: &str, pubs: Vec<Instance>) -> Result<Advertised, ()> {
    let mut a = adv("p", uid, pubs)?;
    a.created = Some(created.into());
    Ok(a)
}

#[test]
fn unowned_resources_cost_nothing() {
    let mut j = Join::new(Limits {
        max_resources: 1,
        max_publisher_refs: 1,
        ..Limits::default()
    });
    for i in 0..100 {
        let unowned = Ok::<_, ()>(Advertised {
            owner: None,
            created: None,
            publishers: vec![pub_(100 + i, 1)],
            skipped: 0,
        });
        assert!(
            j.upsert_resource(0, &format!("junk{i}"), unowned)
                .is_empty()
        );
    }
    assert_eq!((j.resources(), j.skipped), (0, 0));
    j.set_readiness(0, "s", Some(vec![ready("w0", "u")]));
    assert_eq!(
        j.upsert_resource(0, "w0", adv("w0", "u", vec![pub_(1, 1)])),
        vec![Change::Up(pub_(1, 1))]
    );
}

#[test]
fn resources_not_joined_make_room_the_largest_first() {
    let mut j = Join::new(Limits {
        max_resources: 2,
        max_publisher_refs: 4,
        ..Limits::default()
    });
    // Two resources owned by pods that are not ready (a tenant's), the larger
    // holding three of the four publisher slots.
    j.upsert_resource(
        0,
        "big",
        adv("x", "fake", vec![pub_(10, 1), pub_(11, 1), pub_(12, 1)]),
    );
    j.upsert_resource(0, "small", adv("y", "fake", vec![pub_(13, 1)]));
    assert_eq!(j.resources(), 2);
    // A worker (needing a resource slot and two publisher slots) evicts the
    // larger, not the smaller.
    j.set_readiness(0, "s", Some(vec![ready("w0", "u"), ready("w1", "u")]));
    assert_eq!(
        j.upsert_resource(0, "w0", adv("w0", "u", vec![pub_(1, 1), pub_(2, 1)]))
            .len(),
        2
    );
    assert_eq!((j.resources(), j.skipped), (2, 1));
    // The namespace's resource cap: the other one not joined goes.
    assert_eq!(
        j.upsert_resource(0, "w1", adv("w1", "u", vec![pub_(3, 1)]))
            .len(),
        1
    );
    assert_eq!((j.resources(), j.skipped), (2, 2));
    // Joined resources are never evicted: a third worker is refused, counted.
    j.upsert_resource(0, "w2", adv("w2", "u", vec![pub_(4, 1)]));
    assert_eq!((j.resources(), j.skipped), (2, 3));
    assert_eq!(j.view().len(), 3);
    j.set_readiness(0, "t", Some(vec![ready("w2", "u")]));
    assert_eq!(j.view().len(), 3, "{:?}", j.view());
}

#[test]
fn the_oldest_resource_shows_a_shared_id_and_the_next_takes_over() {
    let mut j = Join::new(limits());
    j.set_readiness(
        0,
        "s",
        Some(vec![ready("victim", "u"), ready("aa-tenant", "u")]),
    );
    let victim = pub_(1, 1);
    let mut forged = pub_(1, 2);
    forged.transport = Transport::zmq("tcp://10.9.9.9:1");
    assert_eq!(
        j.upsert_resource(
            0,
            "victim",
            adv_created("u", "2026-01-01T00:00:00Z", vec![victim.clone()])
        ),
        vec![Change::Up(victim.clone())]
    );
    // A newer resource first in name order: not shown, counted.
    assert!(
        j.upsert_resource(
            0,
            "aa-tenant",
            adv_created("u", "2026-06-01T00:00:00Z", vec![forged.clone()])
        )
        .is_empty()
    );
    assert_eq!((j.view(), j.skipped), (vec![victim.clone()], 1));
    // The victim goes: the next claimant shows its id.
    assert_eq!(
        j.delete_resource(0, "victim"),
        vec![Change::Up(forged.clone())]
    );
    // Back (an older creation cannot come back, but an older resource might
    // become ready): it takes the id over.
    assert_eq!(
        j.upsert_resource(
            0,
            "victim",
            adv_created("u", "2025-01-01T00:00:00Z", vec![victim.clone()])
        ),
        vec![Change::Up(victim.clone())]
    );
    assert_eq!(j.view(), vec![victim]);
}

#[test]
fn readiness_entries_are_bounded_in_all_and_held_resources_go_last() {
    // Two objects, and four entries in all (two resources, one object's more).
    let mut j = Join::new(Limits {
        max_resources: 2,
        max_channel_entries: 2,
        ..Limits::default()
    });
    j.upsert_resource(0, "w0", adv("w0", "u", vec![pub_(1, 1)]));
    // A tenant's slices: two entries, then three more (one naming w0): past the
    // object's bound, the junk goes first, and w0 stays.
    j.set_readiness(
        0,
        "t1",
        Some(vec![ready("junk1", "u"), ready("junk2", "u")]),
    );
    let changes = j.set_readiness(
        0,
        "t2",
        Some(vec![
            ready("junk3", "u"),
            ready("junk4", "u"),
            ready("w0", "u"),
        ]),
    );
    assert_eq!(changes, vec![Change::Up(pub_(1, 1))]);
    assert_eq!(j.skipped, 1);
    // Four in all: another object's entries are refused, counted.
    j.set_readiness(
        0,
        "t1",
        Some(vec![
            ready("junk1", "u"),
            ready("junk2", "u"),
            ready("junk9", "u"),
        ]),
    );
    assert_eq!(j.skipped, 2);
    // Gone, it makes room again.
    j.set_readiness(0, "t1", None);
    j.set_readiness(
        0,
        "t3",
        Some(vec![ready("junk5", "u"), ready("junk6", "u")]),
    );
    assert_eq!(j.skipped, 2);
}

#[test]
fn a_worker_not_ready_yet_is_parked_not_evicted_and_read_again_once_ready() {
    let mut j = Join::new(Limits {
        max_resources: 2,
        ..Limits::default()
    });
    j.upsert_resource(0, "g1", adv("g1", "ghost1", vec![]));
    j.upsert_resource(0, "g2", adv("g2", "ghost2", vec![]));
    // Not ready yet: it may not evict, it is parked (counted).
    j.upsert_resource(0, "w0", adv("w0", "u", vec![pub_(1, 1)]));
    assert_eq!((j.resources(), j.skipped), (2, 1));
    // Another tenant resource cannot evict anyone either.
    j.upsert_resource(0, "g3", adv("g3", "ghost3", vec![]));
    assert_eq!((j.resources(), j.skipped), (2, 2));
    assert!(!j.reread);
    // Its pod ready: read everything again (a joined resource makes room).
    assert!(
        j.set_readiness(0, "s", Some(vec![ready("w0", "u")]))
            .is_empty()
    );
    assert!(j.reread);
    let mut fresh = Join::new(Limits {
        max_resources: 2,
        ..Limits::default()
    });
    fresh.set_readiness(0, "s", Some(vec![ready("w0", "u")]));
    fresh.upsert_resource(0, "g1", adv("g1", "ghost1", vec![]));
    fresh.upsert_resource(0, "g2", adv("g2", "ghost2", vec![]));
    assert_eq!(
        fresh.upsert_resource(0, "w0", adv("w0", "u", vec![pub_(1, 1)])),
        vec![Change::Up(pub_(1, 1))]
    );
}

#[test]
fn a_slice_naming_both_claimants_never_shows_the_younger() {
    let mut j = Join::new(limits());
    let victim = pub_(1, 1);
    let mut forged = pub_(1, 2);
    forged.transport = Transport::zmq("tcp://10.9.9.9:1");
    j.upsert_resource(
        0,
        "victim",
        adv_created("u", "2026-01-01T00:00:00Z", vec![victim.clone()]),
    );
    j.upsert_resource(
        0,
        "aa-tenant",
        adv_created("u", "2026-06-01T00:00:00Z", vec![forged]),
    );
    assert_eq!(
        j.set_readiness(
            0,
            "s",
            Some(vec![ready("victim", "u"), ready("aa-tenant", "u")])
        ),
        vec![Change::Up(victim.clone())]
    );
    // The same slice again: nothing changes (no moment with the younger's).
    assert!(
        j.set_readiness(
            0,
            "s",
            Some(vec![ready("victim", "u"), ready("aa-tenant", "u")])
        )
        .is_empty()
    );
    assert_eq!(j.view(), vec![victim]);
}
