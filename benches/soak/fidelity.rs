//! The oracle's fidelity samples: each second every router prints a fingerprint of
//! each worker's blocks in its index, each engine prints the fingerprint it had after
//! every batch; a router's sample is *exact* when it equals what the engine held at
//! some moment within the lag tolerance before it (the index may trail the engine by
//! the time events take to arrive, a stall or a partition — not hold a state the
//! engine never had). Its *lag* is how long before the sample that state ended (0:
//! the engine's state at the sample).
//!
//! An empty index matches only an engine that was empty within 1 s: engines are
//! empty after each clear, and a wiped index must not pass for a trailing one.
//!
//! A fingerprint is an XOR of mixed block hashes (`engine::block_print`): two
//! different sets collide with probability 2^-64 per comparison.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

/// Engine fingerprints kept per worker: 300 s of them at the soak's default 100 ms
/// interval (older samples find no match: lag beyond it is "unmatched").
const HISTORY: usize = 3_000;

/// A router's sample is judged once every engine's prints reach past its time, or
/// this long after it (an engine that stopped printing).
const JUDGE_AFTER_MS: u64 = 30_000;

/// Router samples waiting to be judged, at most (two routers, four minutes); past
/// it the oldest is dropped and counted.
const PENDING: usize = 480;

/// A sample within this lag counts as current.
const CURRENT_MS: u64 = 1_000;

/// One (router slot, worker)'s samples.
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub(crate) struct Cell {
    pub(crate) samples: u64,
    /// Equal to an engine state within the lag tolerance.
    pub(crate) exact: u64,
    /// ... within 1 s.
    pub(crate) current: u64,
    /// Equal to an engine state older than the tolerance (a router that stopped
    /// following).
    pub(crate) stale: u64,
    /// Equal to no engine state of the last 300 s; or empty while the engine was
    /// not empty within 1 s (a wipe).
    pub(crate) unmatched: u64,
    /// The longest lag of an exact sample.
    pub(crate) worst_lag_ms: u64,
}

/// The fidelity part of the soak's report.
#[derive(Debug, Default, Clone, Serialize)]
pub(crate) struct FidelityReport {
    pub(crate) lag_tolerance_ms: u64,
    /// Router samples never judged (the pending queue was full).
    pub(crate) dropped_samples: u64,
    /// Per wire (`eventplane`, `dynamo`): samples exact / samples.
    pub(crate) fidelity: BTreeMap<String, f64>,
    /// Per wire: samples within 1 s / samples.
    pub(crate) current: BTreeMap<String, f64>,
    pub(crate) samples: u64,
    pub(crate) stale: u64,
    pub(crate) unmatched: u64,
    /// The least exact (router, worker), `r0 w12`, and its fraction.
    pub(crate) worst_cell: Option<(String, f64)>,
    /// Over exact samples.
    pub(crate) lag_p99_ms: u64,
    pub(crate) worst_lag_ms: u64,
    /// Every (router, worker): `r0 w12`.
    pub(crate) cells: BTreeMap<String, Cell>,
}

#[derive(Debug, Deserialize)]
struct RouterPrints {
    t: u64,
    workers: BTreeMap<u64, u64>,
}

#[derive(Debug)]
struct Sample {
    router: usize,
    t: u64,
    workers: BTreeMap<u64, u64>,
}

/// The samples and what they were judged.
#[derive(Debug)]
pub(crate) struct Fidelity {
    tolerance_ms: u64,
    /// Per worker: (unix ms, fingerprint after the batch sent then), oldest first.
    engines: BTreeMap<u64, VecDeque<(u64, u64)>>,
    pending: VecDeque<Sample>,
    cells: BTreeMap<(usize, u64), Cell>,
    /// Lag of every exact sample, ms.
    lags: Vec<u64>,
    /// Per (router slot, worker): the times of its current samples (exact within
    /// 1 s), in order: when the index was right again after a fault.
    current_at: BTreeMap<(usize, u64), Vec<u64>>,
    /// Samples are taken until this (unix ms): the engines' settle.
    until: u64,
    /// Per router slot, its last sample judged (unix ms).
    sampled: BTreeMap<usize, u64>,
    dropped: u64,
}

impl Fidelity {
    pub(crate) fn new(tolerance_ms: u64) -> Fidelity {
        Fidelity {
            tolerance_ms,
            engines: BTreeMap::new(),
            pending: VecDeque::new(),
            cells: BTreeMap::new(),
            lags: Vec::new(),
            current_at: BTreeMap::new(),
            until: u64::MAX,
            sampled: BTreeMap::new(),
            dropped: 0,
        }
    }

    /// An engine's `fps` line (after the prefix): `[[unix_ms, fp], …]`.
    pub(crate) fn engine(&mut self, worker: u64, line: &str) {
        let Ok(prints) = serde_json::from_str::<Vec<(u64, u64)>>(line) else {
            return;
        };
        let h = self.engines.entry(worker).or_default();
        for p in prints {
            if h.back().is_some_and(|last| last.0 > p.0) {
                continue;
            }
            h.push_back(p);
            if h.len() > HISTORY {
                h.pop_front();
            }
        }
    }

    /// A router's `fps` line (after the prefix), from router slot `router`.
    pub(crate) fn router(&mut self, router: usize, line: &str) {
        let Ok(p) = serde_json::from_str::<RouterPrints>(line) else {
            return;
        };
        if p.t > self.until {
            return;
        }
        if self.pending.len() >= PENDING {
            self.pending.pop_front();
            self.dropped += 1;
        }
        self.pending.push_back(Sample {
            router,
            t: p.t,
            workers: p.workers,
        });
    }

    /// No sample after `unix_ms` is taken (the engines stop publishing then).
    pub(crate) fn stop_at(&mut self, unix_ms: u64) {
        self.until = unix_ms;
    }

    /// Judges the samples every engine's prints reach past, or taken 30 s before
    /// `now_ms` (all of them with `now_ms` at `u64::MAX`).
    pub(crate) fn judge(&mut self, now_ms: u64) {
        let reached = self
            .engines
            .values()
            .map(|h| h.back().map_or(0, |last| last.0))
            .min()
            .unwrap_or(0);
        while self
            .pending
            .front()
            .is_some_and(|s| s.t < reached || s.t.saturating_add(JUDGE_AFTER_MS) <= now_ms)
        {
            let Some(s) = self.pending.pop_front() else {
                break;
            };
            let last = self.sampled.entry(s.router).or_default();
            *last = (*last).max(s.t);
            for (&worker, history) in &self.engines {
                let fp = s.workers.get(&worker).copied().unwrap_or(0);
                let Some(lag) = lag(history, s.t, fp) else {
                    // Before the engine's first print: nothing to compare with.
                    continue;
                };
                let cell = self.cells.entry((s.router, worker)).or_default();
                cell.samples += 1;
                match lag {
                    Some(lag) if lag <= self.tolerance_ms => {
                        self.lags.push(lag);
                        cell.worst_lag_ms = cell.worst_lag_ms.max(lag);
                        cell.exact += 1;
                        cell.current += u64::from(lag <= CURRENT_MS);
                        if lag <= CURRENT_MS {
                            self.current_at
                                .entry((s.router, worker))
                                .or_default()
                                .push(s.t);
                        }
                    }
                    Some(_) => cell.stale += 1,
                    None => cell.unmatched += 1,
                }
            }
        }
    }

    /// The report; `dynamo` names the workers on Dynamo's wire.
    pub(crate) fn report(&mut self, dynamo: &BTreeSet<u64>) -> FidelityReport {
        self.judge(u64::MAX);
        let mut r = FidelityReport {
            lag_tolerance_ms: self.tolerance_ms,
            dropped_samples: self.dropped,
            ..FidelityReport::default()
        };
        let mut by_wire: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for (&(router, worker), cell) in &self.cells {
            let wire = if dynamo.contains(&worker) {
                "dynamo"
            } else {
                "eventplane"
            };
            let e = by_wire.entry(wire.to_owned()).or_default();
            e.0 += cell.samples;
            e.1 += cell.exact;
            e.2 += cell.current;
            r.samples += cell.samples;
            r.stale += cell.stale;
            r.unmatched += cell.unmatched;
            r.worst_lag_ms = r.worst_lag_ms.max(cell.worst_lag_ms);
            let name = format!("r{router} w{worker}");
            let frac = ratio(cell.exact, cell.samples);
            if r.worst_cell.as_ref().is_none_or(|(_, f)| frac < *f) {
                r.worst_cell = Some((name.clone(), frac));
            }
            r.cells.insert(name, *cell);
        }
        for (wire, (samples, exact, current)) in by_wire {
            r.fidelity.insert(wire.clone(), ratio(exact, samples));
            r.current.insert(wire, ratio(current, samples));
        }
        self.lags.sort_unstable();
        if !self.lags.is_empty() {
            let i = (self.lags.len() * 99 / 100).min(self.lags.len() - 1);
            r.lag_p99_ms = self.lags.get(i).copied().unwrap_or(0);
        }
        r
    }
}

/// A stretch of time over which a fault disturbed what a router may know of a
/// worker (`None`: every router or every worker), unix ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disturbed {
    pub(crate) router: Option<usize>,
    pub(crate) worker: Option<u64>,
    pub(crate) start_ms: u64,
    pub(crate) end_ms: u64,
}

/// How long after its faults a cell was right again, for one judged recovery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Recovery {
    /// `r0 w3`.
    pub(crate) cell: String,
    /// The end of the (merged) disturbance, unix ms.
    pub(crate) end_ms: u64,
    /// From that end to the first current sample; `None`: none within the bound.
    pub(crate) took_ms: Option<u64>,
}

impl Fidelity {
    /// Audit M2's checkpoints, without pausing the engines: after each fault that
    /// touched a (router, worker), the router's index of that worker must be current
    /// (equal to what the engine held within 1 s) again within `within_ms` of the
    /// fault's end. Disturbances closer together than `within_ms` are judged as one.
    /// A cell the router never sampled after the end (it was killed, or the settle
    /// came first) is not judged. Call after [`report`](Self::report).
    pub(crate) fn recoveries(
        &self,
        disturbed: &[Disturbed],
        routers: usize,
        within_ms: u64,
    ) -> Vec<Recovery> {
        let mut out = Vec::new();
        for r in 0..routers {
            for &worker in self.engines.keys() {
                let mut spans: Vec<(u64, u64)> = disturbed
                    .iter()
                    .filter(|d| d.router.is_none_or(|x| x == r))
                    .filter(|d| d.worker.is_none_or(|w| w == worker))
                    .map(|d| (d.start_ms, d.end_ms.max(d.start_ms)))
                    .collect();
                spans.sort_unstable();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (s, e) in spans {
                    match merged.last_mut() {
                        Some(last) if s <= last.1 + within_ms => last.1 = last.1.max(e),
                        _ => merged.push((s, e)),
                    }
                }
                let times = self.current_at.get(&(r, worker));
                let sampled_after = |t: u64| self.sampled.get(&r).is_some_and(|last| *last >= t);
                for (_, end) in merged {
                    let first = times.and_then(|ts| ts.iter().find(|&&t| t >= end).copied());
                    let took = first.map(|t| t - end).filter(|d| *d <= within_ms);
                    if took.is_none() && !sampled_after(end + within_ms) {
                        continue;
                    }
                    out.push(Recovery {
                        cell: format!("r{r} w{worker}"),
                        end_ms: end,
                        took_ms: took,
                    });
                }
            }
        }
        out
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 1.0 } else { a as f64 / b as f64 }
}

/// How long before `t` the engine last held the blocks fingerprinted `fp`: `Some(0)`
/// when it held them at `t`, `Some(None)` when it did not within its history, `None`
/// when its history starts after `t`.
///
/// An empty index (`fp` 0) matches only an engine empty within 1 s of `t`: engines
/// are empty after every clear, and a wiped index must not pass for one trailing.
fn lag(history: &VecDeque<(u64, u64)>, t: u64, fp: u64) -> Option<Option<u64>> {
    let k = history.partition_point(|e| e.0 <= t);
    if k == 0 {
        return None;
    }
    let mut ended = t;
    for i in (0..k).rev() {
        let (at, print) = *history.get(i)?;
        if print == fp {
            let lag = t - ended;
            return Some((fp != 0 || lag <= CURRENT_MS).then_some(lag));
        }
        ended = at;
    }
    Some(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fidelity() -> Fidelity {
        let mut f = Fidelity::new(2_000);
        // Engine 1 held A from 1000, B from 2000, C from 3000 on.
        f.engine(1, "[[1000, 10], [2000, 20]]");
        f.engine(1, "[[3000, 30]]");
        f
    }

    #[test]
    fn a_sample_is_exact_when_it_was_the_engine_state_within_the_tolerance() {
        let mut f = fidelity();
        for (t, fp) in [
            (3500, 30),
            (3500, 20),
            (4500, 10),
            (8000, 10),
            (3500, 99),
            (500, 7),
        ] {
            f.router(0, &format!(r#"{{"t": {t}, "workers": {{"1": {fp}}}}}"#));
        }
        f.judge(u64::MAX);
        let cell = f.cells[&(0, 1)];
        // (3500, 30): current; (3500, 20): 500 ms behind; (4500, 10): 2500 ms behind,
        // past the tolerance; (8000, 10): 6000; 99: never held; t 500: before the
        // engine's history, not judged.
        assert_eq!(
            cell,
            Cell {
                samples: 5,
                exact: 2,
                current: 2,
                stale: 2,
                unmatched: 1,
                worst_lag_ms: 500,
            }
        );
    }

    #[test]
    fn a_worker_missing_from_a_sample_is_an_empty_index_exact_only_when_the_engine_just_was() {
        let mut f = Fidelity::new(2_000);
        f.engine(1, "[[1000, 0], [2000, 20]]");
        f.router(1, r#"{"t": 2500, "workers": {}}"#);
        f.router(1, r#"{"t": 3500, "workers": {}}"#);
        let r = f.report(&BTreeSet::new());
        // 500 ms after the engine was empty: exact; 1.5 s after: not, although
        // within the tolerance (a wiped index is not a trailing one).
        assert_eq!(r.cells["r1 w1"].exact, 1);
        assert_eq!(r.cells["r1 w1"].unmatched, 1);
        assert_eq!(r.cells["r1 w1"].worst_lag_ms, 500);
        assert_eq!(r.fidelity["eventplane"], 0.5);
    }

    #[test]
    fn a_sample_waits_for_every_engine_to_print_past_it() {
        let mut f = fidelity();
        f.engine(2, "[[1000, 5]]");
        f.router(0, r#"{"t": 2500, "workers": {"1": 20, "2": 5}}"#);
        f.judge(2_600);
        assert!(f.cells.is_empty(), "engine 2 has not printed past 2500");
        f.engine(2, "[[2600, 6]]");
        f.judge(2_600);
        assert_eq!(f.cells[&(0, 2)].exact, 1);
    }

    #[test]
    fn a_cell_must_be_current_again_soon_after_its_faults() {
        let mut f = Fidelity::new(2_000);
        f.engine(1, "[[1000, 10], [20000, 20], [60000, 30]]");
        // Router 0 current at 5 s, wrong from 10 s to 24 s, current at 25 s; router 1
        // wrong from 10 s on.
        for t in [5_000, 10_000, 24_000, 25_000, 59_000] {
            let fp = if (10_000..25_000).contains(&t) {
                99
            } else {
                20
            };
            let fp = if t < 20_000 && fp != 99 { 10 } else { fp };
            f.router(0, &format!(r#"{{"t": {t}, "workers": {{"1": {fp}}}}}"#));
            f.router(1, &format!(r#"{{"t": {t}, "workers": {{"1": 99}}}}"#));
        }
        f.report(&BTreeSet::new());
        let d = |router, start_ms, end_ms| Disturbed {
            router,
            worker: Some(1),
            start_ms,
            end_ms,
        };
        // One fault on both routers ending at 12 s: router 0 recovered 13 s later.
        let r = f.recoveries(&[d(None, 9_000, 12_000)], 2, 20_000);
        let took: Vec<Option<u64>> = r.iter().map(|r| r.took_ms).collect();
        assert_eq!(took, [Some(13_000), None]);
        // With a 10 s bound, router 0 too is late.
        let r = f.recoveries(&[d(None, 9_000, 12_000)], 2, 10_000);
        assert!(r.iter().all(|r| r.took_ms.is_none()), "{r:?}");
        // Two faults 5 s apart are one: judged from the second's end (18 s).
        let r = f.recoveries(
            &[d(Some(0), 9_000, 12_000), d(Some(0), 17_000, 18_000)],
            2,
            10_000,
        );
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].took_ms, Some(7_000));
        // A fault ending after the router's last sample is not judged.
        let r = f.recoveries(&[d(Some(0), 55_000, 59_500)], 2, 10_000);
        assert!(r.is_empty(), "{r:?}");
    }

    #[test]
    fn samples_after_the_settle_are_not_taken() {
        let mut f = fidelity();
        f.stop_at(3000);
        f.router(0, r#"{"t": 3500, "workers": {"1": 99}}"#);
        assert_eq!(f.report(&BTreeSet::new()).samples, 0);
    }
}
