//! The oracle: what must hold exactly at the end of a soak, checked over what the
//! routers, relays and engines reported. Pure functions: each violation names the
//! invariant, the process and the publisher.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::engine::Held;
use crate::router::{IndexDump, Ledger, Life, RouterReport};

/// One invariant that did not hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Violation {
    pub(crate) invariant: &'static str,
    /// The process (`router r0#2`, `relay w3#1`) and publisher, where there is one.
    pub(crate) at: String,
    pub(crate) detail: String,
}

fn violation(invariant: &'static str, at: String, detail: String) -> Violation {
    Violation {
        invariant,
        at,
        detail,
    }
}

/// A publisher's counters over every following, and where its sequences ran.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sum {
    pub(crate) stats: Life,
    pub(crate) first: Option<u64>,
    pub(crate) last: Option<u64>,
}

/// Sums the lives of a ledger; the lowest first sequence and the highest last one.
pub(crate) fn sum(ledger: &Ledger) -> Sum {
    let mut s = Sum::default();
    for life in &ledger.lives {
        add(&mut s.stats, life);
        s.first = s
            .first
            .min(life.first_sequence)
            .or(s.first)
            .or(life.first_sequence);
        s.last = s.last.max(life.last_sequence);
    }
    s
}

fn add(total: &mut Life, o: &Life) {
    total.received += o.received;
    total.delivered += o.delivered;
    total.dropped_lane_full += o.dropped_lane_full;
    total.dropped_budget += o.dropped_budget;
    total.dropped_filtered_topic += o.dropped_filtered_topic;
    total.dropped_malformed += o.dropped_malformed;
    total.gaps += o.gaps;
    total.gap_messages += o.gap_messages;
    total.sequence_resets += o.sequence_resets;
    total.reconnects += o.reconnects;
    total.depth += o.depth;
}

/// Every publisher of one router process: the subscriber's ledger, the consumer's
/// own count, no duplicate, nothing after a departure.
pub(crate) fn check_router(router: &str, report: &RouterReport, out: &mut Vec<Violation>) {
    if report.notices_dropped > 0 {
        out.push(violation(
            "notices_complete",
            router.to_owned(),
            format!(
                "{} notices dropped: lives cannot be accounted",
                report.notices_dropped
            ),
        ));
    }
    for (id, l) in &report.publishers {
        let at = format!("{router} publisher {id}");
        // Our relays publish nothing a router cannot decode, fault or not.
        if l.undecodable > 0 {
            out.push(violation(
                "every_payload_decodes",
                at.clone(),
                format!("{} payloads the router could not decode", l.undecodable),
            ));
        }
        check_publisher(&at, l, out);
    }
}

/// One publisher's ledger, following by following: a +1 in one cannot hide a -1 in
/// another.
fn check_publisher(at: &str, l: &Ledger, out: &mut Vec<Violation>) {
    let mut v = |invariant, detail: String| out.push(violation(invariant, at.to_owned(), detail));
    let s = sum(l);
    if l.consumed != s.stats.delivered {
        v(
            "consumed_equals_delivered",
            format!(
                "the consumer took {} messages, the subscriber says it delivered {}",
                l.consumed, s.stats.delivered
            ),
        );
    }
    if l.duplicates > 0 {
        v(
            "no_duplicate",
            format!(
                "{} messages at or below the last sequence consumed",
                l.duplicates
            ),
        );
    }
    if l.after_departure > 0 {
        v(
            "nothing_after_departure",
            format!("{} messages after its Departed", l.after_departure),
        );
    }
    if l.unsettled > 0 {
        v(
            "followings_settle",
            format!(
                "{} followings still listed after the subscriber stopped",
                l.unsettled
            ),
        );
    }
    // Relays start with fresh ids: a reset here is a publisher mixed up with another.
    if s.stats.sequence_resets > 0 {
        v(
            "no_reset",
            format!("{} sequence resets", s.stats.sequence_resets),
        );
    }
    let mut lives = l.lives.clone();
    lives.sort_by_key(|life| (life.first_sequence.is_none(), life.first_sequence));
    let mut prev_last: Option<u64> = None;
    for (k, life) in lives.iter().enumerate() {
        let counted = life.delivered + life.dropped() + life.depth;
        if life.received != counted {
            v(
                "received_accounted",
                format!(
                    "following {k}: received {} != delivered {} + dropped {} + in lane {}",
                    life.received,
                    life.delivered,
                    life.dropped(),
                    life.depth
                ),
            );
        }
        let (Some(first), Some(last)) = (life.first_sequence, life.last_sequence) else {
            if life.received > 0 {
                v(
                    "sequence_ledger",
                    format!(
                        "following {k}: {} messages received, no sequence",
                        life.received
                    ),
                );
            }
            continue;
        };
        // The first following runs from its first sequence; a later one from where the
        // one before it ended (what was lost in between is its gap).
        let from = prev_last.map_or(first, |p| p + 1);
        let span = (last + 1).saturating_sub(from);
        let credited = counted + life.gap_messages;
        if credited != span || last < first {
            v(
                "sequence_ledger",
                format!(
                    "following {k}: delivered {} + dropped {} (lane_full {}, budget {}, topic {}, malformed {}) + gap messages {} + in lane {} = {credited}, but sequences {from}..={last} span {span}",
                    life.delivered,
                    life.dropped(),
                    life.dropped_lane_full,
                    life.dropped_budget,
                    life.dropped_filtered_topic,
                    life.dropped_malformed,
                    life.gap_messages,
                    life.depth
                ),
            );
        }
        prev_last = Some(last);
    }
}

/// What a relay said at a clean exit (its last stderr line), the parts checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RelayExit {
    pub(crate) name: String,
    pub(crate) registered_id: Option<u64>,
    pub(crate) published_messages: u64,
    pub(crate) input_events: u64,
    pub(crate) output_events: u64,
    pub(crate) merged_events: u64,
    pub(crate) deduplicated_events: u64,
    pub(crate) withheld_events: u64,
    /// The engine leg: batches and events its listener decoded, batches it saw
    /// missing in sequence jumps, losses its replays could not close (each a clear),
    /// events it discarded.
    pub(crate) decoded_batches: u64,
    pub(crate) decoded_events: u64,
    pub(crate) seq_gap_batches: u64,
    pub(crate) replay_fallbacks: u64,
    pub(crate) discarded_events: u64,
}

impl RelayExit {
    pub(crate) fn parse(name: &str, line: &str) -> Option<RelayExit> {
        // Every field required: a missing one must not read as a balancing 0.
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let p = &v["processor"];
        let l = &v["listener"];
        let fallbacks = l["replay"]["fallbacks"].as_object()?;
        Some(RelayExit {
            name: name.to_owned(),
            registered_id: v["registered_publisher_id"].as_u64(),
            published_messages: v["published_messages"].as_u64()?,
            input_events: p["input_events"].as_u64()?,
            output_events: p["output_events"].as_u64()?,
            merged_events: p["merged_events"].as_u64()?,
            deduplicated_events: p["deduplicated_events"].as_u64()?,
            withheld_events: p["withheld_events"].as_u64()?,
            decoded_batches: l["decoder"]["batches"].as_u64()?,
            decoded_events: l["decoder"]["events"].as_u64()?,
            seq_gap_batches: l["seq_gap_batches"].as_u64()?,
            replay_fallbacks: fallbacks
                .values()
                .map(|n| n.as_u64())
                .sum::<Option<u64>>()?,
            discarded_events: l["discarded_events"].as_u64()?,
        })
    }
}

/// What an engine said it published, at the settle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) struct Published {
    pub(crate) batches: u64,
    pub(crate) events: u64,
}

/// The engine leg of the ledger, for a relay's last incarnation (`replayed`: it
/// replays its engine's history from the first batch when it starts): every batch
/// the engine published was decoded, or counted missing in a sequence jump that ended
/// in a clear (a replay that could not close it). A relay without replay misses what
/// its engine sent before it connected: it decoded no more than was published.
/// Nothing discarded at a clean exit.
pub(crate) fn check_engine_leg(
    exit: &RelayExit,
    engine: Published,
    replayed: bool,
    out: &mut Vec<Violation>,
) {
    let at = exit.name.clone();
    if exit.discarded_events > 0 {
        out.push(violation(
            "engine_leg",
            at.clone(),
            format!("{} events discarded at a clean exit", exit.discarded_events),
        ));
    }
    let decoded = (exit.decoded_batches, exit.decoded_events);
    // Past the engine's replay buffer a new relay cannot replay from the first batch:
    // what it never saw is no gap of its own.
    if !replayed || engine.batches > crate::engine::REPLAY_BUFFER as u64 {
        if decoded.0 > engine.batches || decoded.1 > engine.events {
            out.push(violation(
                "engine_leg",
                at,
                format!(
                    "the engine published {} batches ({} events), the relay decoded more: {} ({})",
                    engine.batches, engine.events, decoded.0, decoded.1
                ),
            ));
        }
    } else if exit.replay_fallbacks == 0 {
        if decoded != (engine.batches, engine.events) {
            out.push(violation(
                "engine_leg",
                at,
                format!(
                    "the engine published {} batches ({} events), the relay decoded {} ({}) and lost none",
                    engine.batches, engine.events, decoded.0, decoded.1
                ),
            ));
        }
    } else if exit.decoded_batches > engine.batches
        || exit.decoded_batches + exit.seq_gap_batches < engine.batches
    {
        out.push(violation(
            "engine_leg",
            at,
            format!(
                "the engine published {} batches, the relay decoded {} and counted {} missing",
                engine.batches, exit.decoded_batches, exit.seq_gap_batches
            ),
        ));
    }
}

/// A clean relay exit: its processor ledger balances, and every router that was
/// following it at the exit saw its last message (the relay drains before it exits).
/// A router that followed it from its first message and lost none decoded exactly
/// the events it published.
pub(crate) fn check_relay_exit(
    exit: &RelayExit,
    routers: &[(String, &RouterReport)],
    out: &mut Vec<Violation>,
) {
    let at = exit.name.clone();
    let accounted =
        exit.output_events + exit.merged_events + exit.deduplicated_events + exit.withheld_events;
    if exit.input_events != accounted {
        out.push(violation(
            "processor_ledger",
            at.clone(),
            format!(
                "input {} != output + merged + deduplicated + withheld = {accounted}",
                exit.input_events
            ),
        ));
    }
    let Some(id) = exit.registered_id else {
        out.push(violation(
            "relay_registered",
            at,
            "no registered publisher id".to_owned(),
        ));
        return;
    };
    for (router, report) in routers {
        let ledger = report
            .publishers
            .iter()
            .find(|(k, _)| publisher_id(k) == Some(id));
        let Some((key, l)) = ledger else {
            out.push(violation(
                "router_followed_relay",
                format!("{router} publisher {id:x}"),
                format!("never saw {at}"),
            ));
            continue;
        };
        let s = sum(l);
        let lossless = s.first == Some(0)
            && s.stats.gap_messages == 0
            && s.stats.dropped() == 0
            && s.stats.depth == 0
            && l.consumed == exit.published_messages;
        if lossless && l.events != exit.output_events {
            out.push(violation(
                "events_delivered",
                format!("{router} publisher {key}"),
                format!(
                    "{at} published {} events in {} messages; the router took every message and decoded {} events",
                    exit.output_events, exit.published_messages, l.events
                ),
            ));
        }
        if s.last.map(|l| l + 1) != Some(exit.published_messages) {
            out.push(violation(
                "saw_the_last_message",
                format!("{router} publisher {key}"),
                format!(
                    "{at} published {} messages, the router's last sequence is {:?}",
                    exit.published_messages, s.last
                ),
            ));
        }
    }
}

/// Head loss (audit H2): a relay's first incarnation, in the routers that were up
/// before it started, must be followed from one of its first `head` messages (what
/// it publishes before a router's subscription reaches it is lost unseen, and
/// uncounted: bounded here by time).
pub(crate) fn check_head(
    exit: &RelayExit,
    routers: &[(String, &RouterReport)],
    head: u64,
    out: &mut Vec<Violation>,
) {
    let Some(id) = exit.registered_id else {
        return;
    };
    for (router, report) in routers {
        let first = report
            .publishers
            .iter()
            .find(|(k, _)| publisher_id(k) == Some(id))
            .and_then(|(_, l)| sum(l).first);
        if first.is_none_or(|f| f >= head) {
            out.push(violation(
                "head_followed",
                format!("{router} publisher {id:x}"),
                format!(
                    "{} started after the router was up; its first message followed is {first:?}, not one of its first {head}",
                    exit.name
                ),
            ));
        }
    }
}

/// The publisher id at the end of a `ChannelId` as reports print it (hex).
fn publisher_id(key: &str) -> Option<u64> {
    key.rsplit('/')
        .next()
        .and_then(|p| u64::from_str_radix(p, 16).ok())
}

/// A router's final index against what the engines hold, and its publishers against
/// the relays alive at the end.
pub(crate) fn check_convergence(
    router: &str,
    dump: &IndexDump,
    truth: &BTreeMap<u64, Held>,
    live_ids: Option<&std::collections::BTreeSet<u64>>,
    out: &mut Vec<Violation>,
) {
    for (worker, held) in truth {
        let empty = Held::default();
        let got = dump.workers.get(worker).unwrap_or(&empty);
        if got != held {
            let missing = count_diff(&held.gpu, &got.gpu) + count_diff(&held.cpu, &got.cpu);
            let ghosts = count_diff(&got.gpu, &held.gpu) + count_diff(&got.cpu, &held.cpu);
            out.push(violation(
                "index_converged",
                format!("{router} worker {worker}"),
                format!("{missing} blocks the engine holds are missing, {ghosts} ghost blocks"),
            ));
        }
    }
    for worker in dump.workers.keys().filter(|w| !truth.contains_key(w)) {
        out.push(violation(
            "index_converged",
            format!("{router} worker {worker}"),
            "blocks of a worker no engine is".to_owned(),
        ));
    }
    if let Some(live) = live_ids {
        if &dump.publishers != live {
            let ghosts: Vec<String> = dump
                .publishers
                .difference(live)
                .map(|p| format!("{p:x}"))
                .collect();
            let missing: Vec<String> = live
                .difference(&dump.publishers)
                .map(|p| format!("{p:x}"))
                .collect();
            out.push(violation(
                "publishers_converged",
                router.to_owned(),
                format!("followed but not live: {ghosts:?}; live but not followed: {missing:?}"),
            ));
        }
    }
}

fn count_diff(a: &[u64], b: &[u64]) -> usize {
    a.iter().filter(|h| b.binary_search(h).is_err()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life(delivered: u64, lane_full: u64, gap: u64, first: u64, last: u64) -> Life {
        Life {
            received: delivered + lane_full,
            delivered,
            dropped_lane_full: lane_full,
            gap_messages: gap,
            first_sequence: Some(first),
            last_sequence: Some(last),
            ..Life::default()
        }
    }

    fn report(l: Ledger) -> RouterReport {
        let mut r = RouterReport::default();
        r.publishers.insert("ns/c/t/1".to_owned(), l); // ids in hex, as ChannelId prints them
        r
    }

    fn checked(l: Ledger) -> Vec<&'static str> {
        let mut out = Vec::new();
        check_router("r0", &report(l), &mut out);
        out.into_iter().map(|v| v.invariant).collect()
    }

    fn good() -> Ledger {
        // Two followings: 0..=99 with 5 lane drops and a gap of 3; it left and came
        // back at 110 (a gap of 10 in the second life), ending at 149.
        Ledger {
            consumed: 92 + 40,
            lives: vec![life(92, 5, 3, 0, 99), life(40, 0, 10, 110, 149)],
            ..Ledger::default()
        }
    }

    #[test]
    fn a_balanced_ledger_passes() {
        assert_eq!(checked(good()), Vec::<&str>::new());
    }

    /// The injected bugs the soak must catch, one line each.
    #[test]
    fn injected_bugs_are_caught() {
        // A gap counted as delivered: the subscriber claims more than the consumer took.
        let mut l = good();
        l.lives[0].delivered += 3;
        l.lives[0].gap_messages -= 3;
        l.lives[0].received += 3;
        assert_eq!(checked(l), ["consumed_equals_delivered"]);
        // A lane that forgets a departed publisher: deliveries after Departed.
        let mut l = good();
        l.after_departure = 2;
        assert_eq!(checked(l), ["nothing_after_departure"]);
        // A drop not counted (a lost message no counter names).
        let mut l = good();
        l.lives[1].gap_messages -= 1;
        assert_eq!(checked(l), ["sequence_ledger"]);
        // One following over-counted, the other under: each is checked alone.
        let mut l = good();
        l.lives[0].gap_messages += 1;
        l.lives[1].gap_messages -= 1;
        assert_eq!(checked(l), ["sequence_ledger", "sequence_ledger"]);
        // Lives told out of order are put in sequence order.
        let mut l = good();
        l.lives.reverse();
        assert_eq!(checked(l), Vec::<&str>::new());
        // A reset: a publisher mixed up with another.
        let mut l = good();
        l.lives[1].sequence_resets = 1;
        assert_eq!(checked(l), ["no_reset"]);
        // A message delivered twice.
        let mut l = good();
        l.duplicates = 1;
        assert_eq!(checked(l), ["no_duplicate"]);
    }

    #[test]
    fn a_ghost_block_or_worker_fails_convergence() {
        let truth: BTreeMap<u64, Held> = [(
            1,
            Held {
                gpu: vec![1, 2],
                cpu: vec![],
            },
        )]
        .into();
        let mut dump = IndexDump::default();
        dump.workers.insert(
            1,
            Held {
                gpu: vec![1, 2, 3],
                cpu: vec![],
            },
        );
        dump.workers.insert(
            2,
            Held {
                gpu: vec![9],
                cpu: vec![],
            },
        );
        dump.publishers.insert(5);
        let live = [5, 6].into();
        let mut out = Vec::new();
        check_convergence("r0", &dump, &truth, Some(&live), &mut out);
        let names: Vec<_> = out.iter().map(|v| v.invariant).collect();
        assert_eq!(
            names,
            ["index_converged", "index_converged", "publishers_converged"]
        );
        assert!(out[0].detail.contains("1 ghost"), "{:?}", out[0]);
    }

    #[test]
    fn a_relay_exit_is_cross_checked() {
        let exit = RelayExit::parse(
            "w0#1",
            r#"{"registered_publisher_id":1,"published_messages":150,"processor":{"input_events":10,"output_events":6,"merged_events":2,"deduplicated_events":1,"withheld_events":0},"listener":{"decoder":{"batches":150,"events":10},"seq_gap_batches":0,"discarded_events":0,"replay":{"fallbacks":{"timeout":0,"restart":0}}}}"#,
        )
        .unwrap();
        let r = report(good());
        let mut out = Vec::new();
        check_relay_exit(&exit, &[("r0".to_owned(), &r)], &mut out);
        let names: Vec<_> = out.iter().map(|v| v.invariant).collect();
        assert_eq!(names, ["processor_ledger"]); // 10 != 9; the last sequence 149 is the 150th
        // A field missing is no exit line (it must not read as a balancing 0).
        assert!(RelayExit::parse("w0#1", r#"{"registered_publisher_id":1,"published_messages":1,"processor":{"input_events":1,"output_events":1,"merged_events":0,"deduplicated_events":0,"withheld_events":0}}"#).is_none());
    }

    fn exit(batches: u64, events: u64, gap: u64, fallbacks: u64) -> RelayExit {
        RelayExit {
            name: "relay w0#1".into(),
            registered_id: Some(1),
            published_messages: 150,
            output_events: 40,
            decoded_batches: batches,
            decoded_events: events,
            seq_gap_batches: gap,
            replay_fallbacks: fallbacks,
            ..RelayExit::default()
        }
    }

    /// Audit H2 (a): a subscriber that skips a publisher's first 20 messages.
    #[test]
    fn a_relay_followed_late_fails_the_head_check() {
        let mut e = exit(0, 0, 0, 0);
        let mut l = good();
        let check = |l: &Ledger| {
            let r = report(l.clone());
            let mut out = Vec::new();
            check_head(&e, &[("r0#1".to_owned(), &r)], 20, &mut out);
            out.len()
        };
        assert_eq!(check(&l), 0);
        l.lives[0].first_sequence = Some(20);
        assert_eq!(check(&l), 1);
        l.lives[0].first_sequence = Some(19);
        assert_eq!(check(&l), 0);
        e.registered_id = Some(2);
        let r = report(good());
        let mut out = Vec::new();
        check_head(&e, &[("r0#1".to_owned(), &r)], 20, &mut out);
        assert_eq!(out.len(), 1, "never followed");
    }

    /// Audit H2 (b): a batch the relay drops uncounted after a reconnect.
    #[test]
    fn the_engine_leg_balances_batch_for_batch() {
        let engine = Published {
            batches: 100,
            events: 300,
        };
        let leg = |e: RelayExit| {
            let mut out = Vec::new();
            check_engine_leg(&e, engine, true, &mut out);
            out.len()
        };
        assert_eq!(leg(exit(100, 300, 0, 0)), 0);
        assert_eq!(leg(exit(99, 297, 0, 0)), 1, "one batch lost, uncounted");
        assert_eq!(leg(exit(100, 299, 0, 0)), 1, "one event lost");
        // A loss replay could not close: the missing batches are counted.
        assert_eq!(leg(exit(90, 270, 10, 1)), 0);
        assert_eq!(leg(exit(89, 267, 10, 1)), 1);
        let mut e = exit(100, 300, 0, 0);
        e.discarded_events = 1;
        assert_eq!(leg(e), 1);
        // Without replay, only what was published can have been decoded.
        let mut out = Vec::new();
        check_engine_leg(&exit(60, 180, 0, 0), engine, false, &mut out);
        check_engine_leg(&exit(101, 300, 0, 0), engine, false, &mut out);
        assert_eq!(out.len(), 1);
    }

    /// Audit H2 (c): a message the relay counted as published and never sent.
    #[test]
    fn a_lossless_following_decodes_every_event_published() {
        let mut l = Ledger {
            consumed: 150,
            events: 40,
            lives: vec![life(150, 0, 0, 0, 149)],
            ..Ledger::default()
        };
        let r = report(l.clone());
        let mut out = Vec::new();
        check_relay_exit(&exit(0, 0, 0, 0), &[("r0".to_owned(), &r)], &mut out);
        assert!(
            out.iter().all(|v| v.invariant != "events_delivered"),
            "{out:?}"
        );
        l.events = 39;
        let r = report(l.clone());
        let mut out = Vec::new();
        check_relay_exit(&exit(0, 0, 0, 0), &[("r0".to_owned(), &r)], &mut out);
        assert!(
            out.iter().any(|v| v.invariant == "events_delivered"),
            "{out:?}"
        );
        // With a message lost (a gap) the count is not exact: not judged.
        l.lives = vec![life(149, 0, 1, 0, 149)];
        l.consumed = 149;
        let r = report(l);
        let mut out = Vec::new();
        check_relay_exit(&exit(0, 0, 0, 0), &[("r0".to_owned(), &r)], &mut out);
        assert!(
            out.iter().all(|v| v.invariant != "events_delivered"),
            "{out:?}"
        );
    }
}
