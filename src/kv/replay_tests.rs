#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use super::*;

fn batch(engine: u8, seq: u64) -> Bytes {
    Bytes::from(vec![engine, seq as u8, (seq >> 8) as u8])
}

/// Replies for `seqs` of `engine`'s buffer, then the end marker.
fn replies(
    r: &mut Repair,
    now: Instant,
    engine: u8,
    seqs: impl IntoIterator<Item = u64>,
) -> Vec<Step> {
    let mut out = Vec::new();
    for s in seqs {
        r.on_reply(now, Some(Reply::Batch(s, batch(engine, s))), &mut out);
    }
    r.on_reply(now, Some(Reply::End), &mut out);
    out
}

fn live(r: &mut Repair, now: Instant, engine: u8, seq: u64) -> Vec<Step> {
    let mut out = Vec::new();
    r.on_live(now, seq, batch(engine, seq), &mut out);
    out
}

/// The sequences applied, and the clears, in order (`u64::MAX - n` for a clear).
fn applied(steps: &[Step]) -> Vec<u64> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Apply { seq, .. } => Some(*seq),
            Step::Clear(_) => Some(u64::MAX),
            _ => None,
        })
        .collect()
}

fn requests(steps: &[Step]) -> Vec<u64> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Request(from) => Some(*from),
            _ => None,
        })
        .collect()
}

fn clears(steps: &[Step]) -> Vec<ReplayFallback> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Clear(c) => Some(*c),
            _ => None,
        })
        .collect()
}

/// A repair that replayed 0..=last from engine 1 on connect.
fn started(now: Instant, last: u64) -> Repair {
    let mut r = Repair::new(ReplayLimits::default());
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    assert_eq!(requests(&out), [0]);
    let out = replies(&mut r, now, 1, 0..=last);
    assert_eq!(applied(&out), (0..=last).collect::<Vec<_>>());
    r
}

#[test]
fn a_gap_is_replayed_from_the_anchor_and_the_held_batches_follow_without_a_clear() {
    let now = Instant::now();
    let mut r = started(now, 1);
    let out = live(&mut r, now, 1, 4);
    assert_eq!(
        requests(&out),
        [1],
        "asks from the anchor, to prove continuity"
    );
    assert!(applied(&out).is_empty());
    assert!(
        live(&mut r, now, 1, 5).is_empty(),
        "held while the replay runs"
    );
    let out = replies(&mut r, now, 1, 1..=4);
    assert_eq!(applied(&out), [2, 3, 4, 5]);
    assert!(
        live(&mut r, now, 1, 4).is_empty(),
        "a late live copy is a duplicate"
    );
    assert_eq!(applied(&live(&mut r, now, 1, 6)), [6]);
    let s = r.stats();
    assert_eq!((s.replays, s.repairs, s.fallbacks.total()), (2, 2, 0));
    assert_eq!(s.replayed_batches, 2 + 3);
    assert!(!r.replaying());
}

#[test]
fn a_reconnect_to_the_same_engine_replays_what_it_missed() {
    let now = Instant::now();
    let mut r = started(now, 3);
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    assert_eq!(requests(&out), [3]);
    let out = replies(&mut r, now, 1, 3..=6);
    assert_eq!(applied(&out), [4, 5, 6]);
    assert_eq!(r.stats().fallbacks.total(), 0);
}

#[test]
fn another_batch_at_the_anchor_is_a_new_engine_replayed_from_zero() {
    let now = Instant::now();
    let mut r = started(now, 3);
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    // Engine 2 behind the endpoint: its batch 3 is not ours.
    r.on_reply(now, Some(Reply::Batch(3, batch(2, 3))), &mut out);
    assert_eq!(clears(&out), [ReplayFallback::Restart]);
    assert_eq!(requests(&out), [3, 0]);
    // The first replay's connection is dropped with the rest of it; the second one,
    // on a new connection, is applied from 0.
    assert!(out.contains(&Step::Disconnect));
    let out = replies(&mut r, now, 2, 0..=5);
    assert_eq!(applied(&out), [0, 1, 2, 3, 4, 5]);
    assert_eq!(r.stats().fallbacks.restart, 1);
}

#[test]
fn an_empty_buffer_behind_a_known_anchor_is_a_new_engine() {
    let now = Instant::now();
    let mut r = started(now, 3);
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    let out = replies(&mut r, now, 2, []);
    assert_eq!(clears(&out), [ReplayFallback::Restart]);
    // The new engine's first batch is in order.
    assert_eq!(applied(&live(&mut r, now, 2, 0)), [0]);
}

#[test]
fn the_live_sequence_going_back_is_a_restart_replayed_from_zero() {
    let now = Instant::now();
    let mut r = started(now, 9);
    let out = live(&mut r, now, 2, 2);
    assert_eq!(clears(&out), [ReplayFallback::Restart]);
    assert_eq!(requests(&out), [0]);
    let out = replies(&mut r, now, 2, 0..=2);
    assert_eq!(applied(&out), [0, 1, 2]);
}

#[test]
fn a_buffer_that_starts_after_the_gap_clears_then_applies_what_it_has() {
    let now = Instant::now();
    let mut r = started(now, 1);
    let out = live(&mut r, now, 1, 50);
    assert_eq!(requests(&out), [1]);
    let out = replies(&mut r, now, 1, 40..=50);
    assert_eq!(clears(&out), [ReplayFallback::TooNew]);
    assert_eq!(applied(&out)[1..], (40..=50).collect::<Vec<_>>()[..]);
    assert_eq!(r.stats().repairs, 1, "the start's, not this one");
}

#[test]
fn a_silent_endpoint_times_out_clears_and_later_gaps_clear_at_once() {
    let now = Instant::now();
    let mut r = started(now, 1);
    let out = live(&mut r, now, 1, 3);
    assert_eq!(requests(&out), [1]);
    live(&mut r, now, 1, 4);
    let due = r.poll_timeout().unwrap();
    assert_eq!(due, now + DEFAULT_REPLAY_TIMEOUT);
    let mut out = Vec::new();
    r.on_timeout(due - Duration::from_millis(1), &mut out);
    assert!(out.is_empty(), "not before the timeout");
    r.on_timeout(due, &mut out);
    assert_eq!(out[0], Step::Disconnect);
    assert_eq!(clears(&out), [ReplayFallback::Timeout]);
    assert_eq!(applied(&out)[1..], [3, 4]);
    // Within REPLAY_RETRY_AFTER a gap clears without asking.
    let out = live(&mut r, due, 1, 9);
    assert_eq!(clears(&out), [ReplayFallback::Timeout]);
    assert!(requests(&out).is_empty());
    // After it, replay is tried again.
    let out = live(&mut r, due + REPLAY_RETRY_AFTER, 1, 12);
    assert_eq!(requests(&out), [9]);
}

#[test]
fn replies_keep_a_replay_alive_until_its_deadline() {
    let now = Instant::now();
    let limits = ReplayLimits {
        timeout: Duration::from_secs(1),
        deadline: Duration::from_secs(3),
        max_batches: 100,
    };
    let mut r = Repair::new(limits);
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    for i in 0..4u64 {
        let t = now + Duration::from_millis(900 * i);
        r.on_reply(t, Some(Reply::Batch(i, batch(1, i))), &mut out);
        r.on_timeout(t, &mut out);
    }
    assert!(clears(&out).is_empty(), "each reply moves the idle timeout");
    assert_eq!(r.poll_timeout(), Some(now + Duration::from_secs(3)));
    r.on_timeout(now + Duration::from_secs(3), &mut out);
    assert_eq!(clears(&out), [ReplayFallback::Timeout]);
}

#[test]
fn an_unreachable_endpoint_clears_once_and_the_first_live_batch_is_the_baseline() {
    let now = Instant::now();
    let mut r = Repair::new(ReplayLimits::default());
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    r.on_unreachable(now, &mut out);
    assert_eq!(clears(&out), [ReplayFallback::Unreachable]);
    let out = live(&mut r, now, 1, 700);
    assert_eq!(applied(&out), [700]);
    assert_eq!(r.stats().fallbacks.total(), 1);
}

#[test]
fn a_replay_stops_at_its_batch_budget_and_the_next_one_goes_on() {
    let now = Instant::now();
    let limits = ReplayLimits {
        max_batches: 3,
        ..ReplayLimits::default()
    };
    let mut r = Repair::new(limits);
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    live(&mut r, now, 1, 6);
    let mut out = Vec::new();
    for s in 0..=3 {
        r.on_reply(now, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    assert_eq!(applied(&out), [0, 1, 2]);
    assert_eq!(requests(&out), [2], "the rest on a new connection");
    // 3, 4, 5 from the second replay, then 6 as held (the rest of it skipped).
    let mut out = Vec::new();
    for s in 2..=6 {
        r.on_reply(now, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    assert_eq!(applied(&out), [3, 4, 5, 6]);
    // The cut replay may have had more: one more asks from there.
    assert_eq!(requests(&out), [6]);
    assert!(applied(&replies(&mut r, now, 1, 6..=6)).is_empty());
    assert!(!r.replaying());
    assert_eq!(r.stats().fallbacks.total(), 0);
}

#[test]
fn held_batches_beyond_the_bound_are_dropped_and_fetched_by_another_replay() {
    let now = Instant::now();
    let mut r = started(now, 0);
    live(&mut r, now, 1, 2);
    let last = MAX_HELD_BATCHES as u64 + 10;
    for s in 3..=last {
        live(&mut r, now, 1, s);
    }
    assert_eq!(
        r.stats().held_dropped,
        last - 2 - MAX_HELD_BATCHES as u64 + 1
    );
    let out = replies(&mut r, now, 1, 0..=1);
    assert_eq!(*requests(&out).last().unwrap(), MAX_HELD_BATCHES as u64 + 1);
    let out = replies(&mut r, now, 1, MAX_HELD_BATCHES as u64 + 1..=last);
    assert_eq!(
        applied(&out),
        (MAX_HELD_BATCHES as u64 + 2..=last).collect::<Vec<_>>()
    );
    assert_eq!(r.stats().fallbacks.total(), 0);
}

#[test]
fn replays_that_bring_nothing_give_up() {
    let now = Instant::now();
    let mut r = started(now, 1);
    live(&mut r, now, 1, 5);
    // The buffer ends at 2: 3 and 4 are nowhere.
    let out = replies(&mut r, now, 1, 1..=2);
    assert_eq!(requests(&out), [2]);
    let out = replies(&mut r, now, 1, 2..=2);
    assert_eq!(requests(&out), [2]);
    let out = replies(&mut r, now, 1, 2..=2);
    assert_eq!(clears(&out), [ReplayFallback::NoProgress]);
    assert_eq!(applied(&out), [u64::MAX, 5]);
}

#[test]
fn replies_nobody_asked_for_are_counted_not_applied() {
    let now = Instant::now();
    let mut r = Repair::new(ReplayLimits::default());
    let mut out = Vec::new();
    r.on_reply(now, Some(Reply::Batch(0, batch(1, 0))), &mut out);
    r.on_reply(now, None, &mut out);
    assert!(out.is_empty());
    assert_eq!(r.stats().malformed_replies, 2);
}

fn m(parts: &[&[u8]]) -> Message {
    Message::from_parts(parts.iter().map(|p| Bytes::copy_from_slice(p)))
}

#[test]
fn both_reply_layouts_and_their_end_markers_parse() {
    let seq = 7u64.to_be_bytes();
    let end = u64::MAX.to_be_bytes();
    let old = m(&[b"", &seq, b"payload"]);
    assert_eq!(
        parse_reply(&old, b"kv"),
        Some(Reply::Batch(7, Bytes::from_static(b"payload")))
    );
    let new = m(&[b"", b"kv", &seq, b"payload"]);
    assert_eq!(
        parse_reply(&new, b"kv"),
        Some(Reply::Batch(7, Bytes::from_static(b"payload")))
    );
    assert_eq!(parse_reply(&m(&[b"", &end, b""]), b"kv"), Some(Reply::End));
    assert_eq!(
        parse_reply(&m(&[b"", b"", &end, b""]), b"kv"),
        Some(Reply::End)
    );
    // Another topic, a missing delimiter, a short sequence, too many frames.
    assert_eq!(parse_reply(&m(&[b"", b"other", &seq, b"p"]), b"kv"), None);
    assert_eq!(parse_reply(&m(&[b"x", &seq, b"p"]), b"kv"), None);
    assert_eq!(parse_reply(&m(&[b"", b"\x07", b"p"]), b"kv"), None);
    assert_eq!(
        parse_reply(&m(&[b"", b"kv", &seq, b"p", b"q"]), b"kv"),
        None
    );
    assert_eq!(request(5), m(&[b"", &5u64.to_be_bytes()]));
}

#[test]
fn a_reply_missing_in_the_middle_is_asked_for_again() {
    let now = Instant::now();
    let mut r = started(now, 1);
    live(&mut r, now, 1, 6);
    let mut out = Vec::new();
    for s in [1, 2, 4] {
        r.on_reply(now, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    assert_eq!(applied(&out), [2]);
    assert_eq!(requests(&out), [2], "from what was applied");
    let mut out = Vec::new();
    for s in 2..=6 {
        r.on_reply(now, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    assert_eq!(applied(&out), [3, 4, 5, 6]);
    assert_eq!(r.stats().fallbacks.total(), 0);
}

#[test]
fn a_replay_that_went_silent_after_progress_asks_again_on_a_new_connection() {
    let now = Instant::now();
    let mut r = started(now, 1);
    live(&mut r, now, 1, 6);
    let mut out = Vec::new();
    for s in [1, 2, 3] {
        r.on_reply(now, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    // The end marker was dropped: silence.
    let due = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(due, &mut out);
    assert_eq!(out[0], Step::Disconnect);
    assert_eq!(requests(&out), [3]);
    assert!(clears(&out).is_empty());
    let out = replies(&mut r, due, 1, 3..=6);
    assert_eq!(applied(&out), [4, 5, 6]);
}

#[test]
fn after_a_replay_a_quiet_engine_is_asked_once_more_for_the_tail() {
    let now = Instant::now();
    let mut r = started(now, 1);
    // The replay on connect brought batches: a probe is due once the engine is quiet.
    let due = r.poll_timeout().unwrap();
    assert_eq!(due, now + REPLAY_TAIL_PROBE);
    // A live batch in order moves it on.
    let later = now + Duration::from_millis(100);
    live(&mut r, later, 1, 2);
    assert_eq!(r.poll_timeout(), Some(later + REPLAY_TAIL_PROBE));
    let mut out = Vec::new();
    r.on_timeout(later + REPLAY_TAIL_PROBE, &mut out);
    assert_eq!(requests(&out), [2]);
    // The burst's last batches were dropped by the PUB: the probe brings them.
    let t = later + REPLAY_TAIL_PROBE;
    let out = replies(&mut r, t, 1, 2..=4);
    assert_eq!(applied(&out), [3, 4]);
    // It brought some: probe again; the next brings nothing and probing stops.
    let mut out = Vec::new();
    r.on_timeout(t + REPLAY_TAIL_PROBE, &mut out);
    assert_eq!(requests(&out), [4]);
    assert!(applied(&replies(&mut r, t, 1, 4..=4)).is_empty());
    assert_eq!(r.poll_timeout(), None);
    assert_eq!(r.stats().fallbacks.total(), 0);
}

// Reproductions from an attack review of the first version (each failed on it).

/// R1: a tail probe is speculative (nothing is known to be missing), yet when the
/// endpoint is down it clears every router after every burst of a healthy engine.
#[test]
fn review_a_failed_tail_probe_clears_though_nothing_was_lost() {
    let now = Instant::now();
    let mut r = started(now, 1);
    let mut total = Vec::new();
    for round in 0..3u64 {
        let t = now + Duration::from_secs(10 * round);
        // One batch, in order: nothing lost.
        assert_eq!(applied(&live(&mut r, t, 1, 2 + round)), [2 + round]);
        let due = r.poll_timeout().unwrap();
        let mut out = Vec::new();
        r.on_timeout(due, &mut out);
        assert_eq!(requests(&out), [2 + round], "the probe dials the endpoint");
        // The endpoint is down (refused): a probe for nothing clears the routers.
        r.on_unreachable(due, &mut out);
        total.extend(clears(&out));
    }
    assert!(
        total.is_empty(),
        "no batch was lost, yet the routers were cleared {} times: {total:?}",
        total.len()
    );
}

/// R2: `barren_rounds` is reset only by `open()`, so barren steady-state tail probes
/// accumulate it; a gap seen while the next probe is in flight then clears
/// (no_progress) with no further replay, though the engine buffers the missing batch.
#[test]
fn review_barren_probes_make_a_repairable_gap_clear_at_once() {
    let now = Instant::now();
    let mut r = started(now, 1);
    // Probe 1 finds nothing.
    let t1 = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t1, &mut out);
    assert_eq!(requests(&out), [1]);
    assert!(applied(&replies(&mut r, t1, 1, 1..=1)).is_empty());
    // A batch in order, then probe 2.
    live(&mut r, t1, 1, 2);
    let t2 = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t2, &mut out);
    assert_eq!(requests(&out), [2]);
    // While probe 2 runs the engine publishes 3 (dropped by its PUB) and 4.
    assert!(live(&mut r, t2, 1, 4).is_empty(), "held");
    // The probe's answer predates 3: only the anchor, then the end.
    let out = replies(&mut r, t2, 1, 2..=2);
    assert!(
        clears(&out).is_empty() && requests(&out) == [2],
        "batch 3 is in the engine's buffer: ask for it, do not clear; got {out:?}"
    );
}

/// R3: same carry-over, no live batch: a probe whose replies lost one in the middle
/// (ROUTER HWM) is not retried, nothing is cleared and no probe is scheduled: the
/// buffered batches 3 and 4 are never applied and the loss is counted nowhere.
#[test]
fn review_barren_probes_make_a_cut_probe_lose_batches_silently() {
    let now = Instant::now();
    let mut r = started(now, 1);
    let t1 = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t1, &mut out);
    replies(&mut r, t1, 1, 1..=1);
    live(&mut r, t1, 1, 2);
    let t2 = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t2, &mut out);
    assert_eq!(requests(&out), [2]);
    // The engine buffers 2, 3, 4; reply 3 is dropped at the ROUTER's HWM.
    let mut out = Vec::new();
    for s in [2, 4] {
        r.on_reply(t2, Some(Reply::Batch(s, batch(1, s))), &mut out);
    }
    assert!(
        !requests(&out).is_empty() || !clears(&out).is_empty() || r.poll_timeout().is_some(),
        "3 and 4 neither asked again, nor cleared, nor probed later: {out:?}, stats {:?}",
        r.stats()
    );
}

/// R4: `baseline` is taken only when the first batch is *out* of order: a first
/// batch at the expected number leaves it set, and the next real gap is applied as a
/// baseline: no clear, no replay.
#[test]
fn review_a_baseline_left_set_swallows_a_later_gap() {
    let now = Instant::now();
    let mut r = Repair::new(ReplayLimits::default());
    let mut out = Vec::new();
    r.on_connect(now, &mut out);
    r.on_unreachable(now, &mut out);
    // A fresh engine: its first batch is 0, the number expected.
    assert_eq!(applied(&live(&mut r, now, 1, 0)), [0]);
    let later = now + REPLAY_RETRY_AFTER + Duration::from_secs(1);
    let out = live(&mut r, later, 1, 5);
    assert!(
        !requests(&out).is_empty() || !clears(&out).is_empty(),
        "1..=4 lost: applied 5 with neither a replay nor a clear: {out:?}"
    );
}

/// R5: a probe that discovers a restart (or a too_new buffer) is counted both as a
/// fallback and as a repair ("closed by replay alone, without a clear").
#[test]
fn review_a_probe_that_clears_is_also_counted_a_repair() {
    let now = Instant::now();
    let mut r = started(now, 3);
    assert_eq!(r.stats().repairs, 1);
    let t = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t, &mut out);
    r.on_reply(t, Some(Reply::Batch(3, batch(2, 3))), &mut out);
    assert_eq!(clears(&out), [ReplayFallback::Restart]);
    replies(&mut r, t, 2, 0..=5);
    let s = r.stats();
    assert_eq!(
        (s.repairs, s.fallbacks.restart),
        (1, 1),
        "the restart ended in a clear, yet repairs went up"
    );
}

/// R6: the SUB reconnects (to a new engine) while a round is in flight: on_connect is
/// ignored, the new engine's first live batch is held, the old round's dead connection
/// gives up, and give_up drops the held batch as a "duplicate" by number alone. The
/// next batch is applied after a restart clear without any replay (failing window):
/// the new engine's batch 0 is never applied nor fetched.
#[test]
fn review_a_new_engines_held_batch_is_dropped_as_a_duplicate_by_number() {
    let now = Instant::now();
    let mut r = started(now, 9);
    let t = r.poll_timeout().unwrap();
    let mut out = Vec::new();
    r.on_timeout(t, &mut out); // a tail probe is in flight
    assert_eq!(requests(&out), [9]);
    // Engine 1 dies, engine 2 starts; the SUB reconnects to it.
    let mut out = Vec::new();
    r.on_connect(t, &mut out);
    assert_eq!(out[0], Step::Disconnect, "the round in flight is abandoned");
    assert_eq!(requests(&out), [9], "and asked again on the new connection");
    assert!(
        live(&mut r, t, 2, 0).is_empty(),
        "engine 2's batch 0 is held"
    );
    // The new replay connection fails too.
    let mut all = Vec::new();
    r.on_unreachable(t, &mut all);
    all.extend(live(&mut r, t, 2, 1));
    all.extend(live(&mut r, t, 2, 2));
    assert!(
        applied(&all).contains(&0) || requests(&all).contains(&0),
        "engine 2's batch 0 neither applied nor fetched: {all:?} (duplicates {})",
        r.stats().duplicate_batches
    );
}

/// R7: the idle timeout is reset by any well-formed reply, progress or not: a ROUTER
/// that repeats an old batch every 1.9 s holds every live batch for the full 30 s
/// deadline (and the next gap 5 s later starts another one).
#[test]
fn review_duplicate_replies_hold_live_batches_until_the_deadline() {
    let now = Instant::now();
    let mut r = started(now, 1);
    assert_eq!(requests(&live(&mut r, now, 1, 3)), [1]);
    let mut out = Vec::new();
    let mut t = now;
    for i in 0..15u64 {
        t = now + Duration::from_millis(1900 * (i + 1));
        // The anchor (1) first, which verifies, then the same again: duplicates.
        r.on_reply(t, Some(Reply::Batch(1, batch(1, 1))), &mut out);
        out.extend(live(&mut r, t, 1, 4 + i));
        r.on_timeout(t, &mut out);
    }
    assert!(
        !applied(&out).is_empty(),
        "{:?} later, nothing applied: live batches 4..=18 still held",
        t - now
    );
}
