use super::*;

fn merge(cap: usize, lane_bytes: usize, budget: usize, policy: DropPolicy) -> Merge<u32> {
    Merge::new(
        MergeConfig::default()
            .lane_capacity(cap)
            .lane_bytes(lane_bytes)
            .max_buffered_bytes(budget)
            .policy(policy),
    )
    .unwrap()
}

fn drain(m: &Merge<u32>) -> Vec<u32> {
    let mut out = Vec::new();
    m.try_recv_many(&mut out, usize::MAX);
    out
}

#[test]
fn lane_capacity_drop_newest() {
    let m = merge(3, 1 << 20, 1 << 20, DropPolicy::DropNewest);
    let l = m.lane();
    for i in 0..5 {
        l.push(i, 10);
    }
    assert_eq!(drain(&m), vec![0, 1, 2]);
    let s = l.stats();
    assert_eq!((s.received, s.delivered, s.dropped_lane_full), (5, 3, 2));
}

#[test]
fn lane_capacity_drop_oldest() {
    let m = merge(3, 1 << 20, 1 << 20, DropPolicy::DropOldest);
    let l = m.lane();
    for i in 0..5 {
        l.push(i, 10);
    }
    assert_eq!(drain(&m), vec![2, 3, 4]);
    assert_eq!(l.stats().dropped_lane_full, 2);
}

#[test]
fn lane_bytes_charge_overhead() {
    // Each item is charged 36 + 64 = 100 bytes: 3 fit in 300.
    let m = merge(100, 300, 1 << 20, DropPolicy::DropNewest);
    let l = m.lane();
    for i in 0..4 {
        l.push(i, 36);
    }
    assert_eq!(l.stats().bytes, 300);
    assert_eq!(l.stats().dropped_lane_full, 1);
    assert_eq!(m.buffered_bytes(), 300);
    drain(&m);
    assert_eq!(m.buffered_bytes(), 0);
}

#[test]
fn round_robin_fairness() {
    let m = merge(1000, 1 << 20, 1 << 20, DropPolicy::DropNewest);
    let a = m.lane();
    let b = m.lane();
    for i in 0..100 {
        a.push(i, 1);
    }
    b.push(1000, 1);
    b.push(1001, 1);
    let mut out = Vec::new();
    m.try_recv_many(&mut out, 5);
    assert_eq!(out, vec![0, 1000, 1, 1001, 2]);
}

#[test]
fn budget_is_fair_to_small_lanes() {
    // Budget of 10 items (charge 100 each) over 2 lanes: share 5 items.
    let m = merge(1000, 1 << 20, 1000, DropPolicy::DropNewest);
    let flood = m.lane();
    let quiet = m.lane();
    for i in 0..10 {
        assert!(matches!(flood.push(i, 36), PushOutcome::Queued { .. }));
    }
    // The flood is over its share: refused for budget.
    assert_eq!(flood.push(99, 36), PushOutcome::DroppedBudget);
    // The quiet lane is under its share: room is made from the flood.
    for i in 0..3 {
        assert_eq!(quiet.push(100 + i, 36), PushOutcome::Queued { evicted: 1 });
    }
    assert!(m.buffered_bytes() <= 1000);
    assert_eq!(flood.stats().dropped_budget, 4);
    assert_eq!(quiet.stats().dropped_budget, 0);
    let out = drain(&m);
    assert_eq!(out.iter().filter(|&&x| x >= 100).count(), 3);
}

#[test]
fn closed_lane_drains_then_frees() {
    let m = merge(10, 1 << 20, 1 << 20, DropPolicy::DropNewest);
    let l = m.lane();
    l.push(1, 1);
    drop(l);
    assert_eq!(drain(&m), vec![1]);
    let l2 = m.lane();
    l2.push(2, 1);
    assert_eq!(drain(&m), vec![2]);
}

#[test]
fn closed_merge_refuses() {
    let m = merge(10, 1 << 20, 1 << 20, DropPolicy::DropNewest);
    let l = m.lane();
    m.close();
    assert_eq!(l.push(1, 1), PushOutcome::Closed);
}

#[test]
fn waker_fires_on_push() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Count(AtomicUsize);
    impl std::task::Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(count.clone());
    let mut cx = Context::from_waker(&waker);
    let m = merge(10, 1 << 20, 1 << 20, DropPolicy::DropNewest);
    let l = m.lane();
    let mut out = Vec::new();
    assert!(m.poll_recv_many(&mut cx, &mut out, 10).is_pending());
    l.push(7, 1);
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(m.poll_recv_many(&mut cx, &mut out, 10), Poll::Ready(1));
    m.close();
    assert_eq!(m.poll_recv_many(&mut cx, &mut out, 10), Poll::Ready(0));
}

#[test]
fn random_pushes_never_exceed_bounds() {
    let m = merge(50, 5_000, 20_000, DropPolicy::DropOldest);
    let lanes: Vec<_> = (0..8).map(|_| m.lane()).collect();
    let mut x: u64 = 12345;
    let mut pushed = [0u64; 8];
    let mut got = Vec::new();
    // Every push is accounted for, per lane and after every step: delivered (the
    // items the consumer holds, identified by lane), waiting, or dropped.
    let mut taken = [0u64; 8];
    let mut balanced = |pushed: &[u64; 8], got: &mut Vec<u32>| {
        for v in got.drain(..) {
            taken[v as usize] += 1;
        }
        for (i, l) in lanes.iter().enumerate() {
            let s = l.stats();
            assert_eq!(s.received, pushed[i], "lane {i}: {s:?}");
            assert_eq!(s.delivered, taken[i], "lane {i}: {s:?}");
            assert_eq!(
                s.received,
                s.delivered + s.dropped_lane_full + s.dropped_budget + s.depth as u64,
                "lane {i}: {s:?}"
            );
        }
    };
    for _ in 0..50_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % 8) as usize;
        lanes[i].push(i as u32, (x % 300) as usize);
        pushed[i] += 1;
        assert!(m.buffered_bytes() <= 20_000);
        for l in &lanes {
            let s = l.stats();
            assert!(s.depth <= 50 && s.bytes <= 5_000);
        }
        if x % 5 == 0 {
            m.try_recv_many(&mut got, 3);
        }
        balanced(&pushed, &mut got);
    }
    m.try_recv_many(&mut got, usize::MAX);
    balanced(&pushed, &mut got);
    assert!(lanes.iter().all(|l| l.stats().depth == 0));
    assert!(lanes.iter().any(|l| l.stats().dropped_budget > 0));
}

#[test]
fn closed_lane_emptied_by_eviction_frees_its_slot() {
    // Two items of 1000 (+64) fill the budget.
    let m = merge(100, 1 << 20, 2 * 1064, DropPolicy::DropNewest);
    let gone = m.lane();
    gone.push(0, 1000);
    gone.push(1, 1000);
    drop(gone); // closed, 2 items still queued
    let live = m.lane();
    for i in 10..30 {
        live.push(i, 0); // under its share: evicts from the largest lane, the closed one
    }
    {
        let st = m.shared.lock();
        assert!(st.lanes.get(0).is_none());
        assert_eq!(st.lanes.len(), 1); // only `live`'s slot is held
        assert!(!st.ready.contains(&0));
    }
    // The freed slot is reused; nothing is listed twice.
    let next = m.lane();
    next.push(99, 1);
    let mut expected = vec![10, 99];
    expected.extend(11..30);
    assert_eq!(drain(&m), expected);
    assert_eq!(m.buffered_bytes(), 0);
}

#[test]
fn drained_lanes_give_back_queue_slots() {
    let m = merge(10_000, 1 << 30, 1 << 30, DropPolicy::DropNewest);
    let l = m.lane();
    let capacity = |m: &Merge<u32>| {
        let st = m.shared.lock();
        st.lanes.get(0).map_or(0, |l| l.items.capacity())
    };
    // A burst, drained: the lane gives its slots back at once.
    for i in 0..5000 {
        l.push(i, 1);
    }
    assert_eq!(drain(&m).len(), 5000);
    assert!(
        capacity(&m) <= 2 * crate::slots::IDLE_SLOTS,
        "{}",
        capacity(&m)
    );
    // A burst, then a lane that never empties again: trimmed over a window.
    for i in 0..5000 {
        l.push(i, 1);
    }
    let mut out = Vec::new();
    m.try_recv_many(&mut out, 4999);
    for i in 0..20_000 {
        l.push(i, 1);
        m.try_recv_many(&mut out, 1);
    }
    assert!(
        capacity(&m) <= 2 * crate::slots::IDLE_SLOTS,
        "{}",
        capacity(&m)
    );
}
