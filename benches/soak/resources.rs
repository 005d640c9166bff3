//! Resource series: every long-lived process's RSS and open fds, sampled every
//! [`SAMPLE_EVERY`]; after the warm-up, a least-squares slope and the peak, and the
//! growth per unit of work ([`per_work`]: RSS per message handled, fds per dial).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ledger::Violation;

/// Sampling period.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// RSS growth tolerated after the warm-up, KiB per minute (a leak of one message per
/// delivery at our rates is far above it)…
pub(crate) const RSS_SLOPE_KIB_PER_MIN: f64 = 1024.0;
/// …or in all over the judged window, whichever is more: a short run's slope is
/// mostly its faults' churn (reconnections, buffers grown once).
pub(crate) const RSS_ALLOWANCE_KIB: f64 = 8192.0;
/// Open fds growth tolerated after the warm-up, per minute…
pub(crate) const FD_SLOPE_PER_MIN: f64 = 1.0;
/// …or in all over the judged window, whichever is more, plus one per worker (a
/// partition or an etcd restart closes and reopens a connection per publisher).
pub(crate) const FD_ALLOWANCE: f64 = 8.0;

/// Samples after the warm-up a slope needs to be judged (a minute).
pub(crate) const MIN_JUDGED: usize = 30;

/// Whether a trend is flat: its growth over the judged window within the tolerances.
pub(crate) fn flat(t: &Trend, workers: usize) -> (bool, bool) {
    let minutes = t.window_min.max(1.0 / 60.0);
    let rss = t.rss_slope_kib_per_min <= RSS_SLOPE_KIB_PER_MIN.max(RSS_ALLOWANCE_KIB / minutes);
    let fd_allowance = FD_ALLOWANCE + workers as f64;
    let fds = t.fd_slope_per_min <= FD_SLOPE_PER_MIN.max(fd_allowance / minutes);
    (rss, fds)
}

/// Peak RSS budget of a role, KiB: routers 256 MiB, relays 64 MiB, engines 32 MiB
/// (etcd is not ours: reported, not judged).
pub(crate) fn budget_kib(role: &str) -> Option<u64> {
    match role {
        "router" | "kv-router" => Some(256 * 1024),
        "relay" => Some(64 * 1024),
        "engine" => Some(32 * 1024),
        _ => None,
    }
}

/// RSS growth tolerated per message handled after the warm-up, bytes, by role
/// (audit H3). Routers: per delivery, counted by the router; the CI run at `2af74c6`
/// (`target/soak-ci.json`) grew ≈ 40 B per delivery in router 0 (185 KiB/min at ≈ 80
/// deliveries/s), so the audit's 64 B would leave 1.6× of room: 128 B leaves 3×, and a
/// router that keeps its deliveries' payloads (and so their read buffers, ≥ 300 B a
/// delivery) is still far above it. Relays: per message published, taken as one per
/// engine batch; the same run grew 130–390 B per message in a correct build (its
/// buffers still filling), so only 1 KiB can be held to — a relay that keeps
/// every engine batch is not reliably caught by it (audit H3 c stays open).
pub(crate) fn bytes_per_message(role: &str) -> Option<f64> {
    match role {
        "router" => Some(128.0),
        // kv-router's index grows in steps (its maps double): 13–89 B per message in
        // unmutated 3-minute runs.
        "kv-router" => Some(256.0),
        "relay" => Some(1024.0),
        _ => None,
    }
}

/// Open fds growth tolerated per dial (a reconnect, or a dial that failed)…
pub(crate) const FDS_PER_DIAL: f64 = 0.1;
/// …plus this much (connections being replaced as a sample is taken).
pub(crate) const FD_NOISE: f64 = 2.0;
/// Samples after the warm-up a per-message judgment needs (30 s)…
pub(crate) const MIN_PER_WORK: usize = 15;
/// …and messages handled over them.
pub(crate) const MIN_MESSAGES: u64 = 1_000;

/// One process's samples: (seconds from the run's start, RSS KiB, fds); and, for a
/// process that counts its work, (seconds from the run's start, messages, dials).
#[derive(Debug, Default, Clone)]
pub(crate) struct Series {
    pub(crate) role: String,
    pub(crate) samples: Vec<(f64, u64, u64)>,
    pub(crate) work: Vec<(f64, u64, u64)>,
}

/// A router's `fps` line (after the prefix): its deliveries and dials so far, noted
/// in its series; `origin_ms` is the unix ms of the run's start (the samples' zero).
pub(crate) fn note_work(
    all: &mut BTreeMap<String, Series>,
    process: &str,
    origin_ms: u64,
    line: &str,
) {
    #[derive(Deserialize)]
    struct Work {
        t: u64,
        delivered: u64,
        dials: u64,
    }
    let Ok(w) = serde_json::from_str::<Work>(line) else {
        return;
    };
    let s = all.entry(process.to_owned()).or_default();
    s.role = "router".to_owned();
    let secs = w.t.saturating_sub(origin_ms) as f64 / 1000.0;
    s.work.push((secs, w.delivered, w.dials));
}

/// RSS and fds against the work done.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PerWork {
    pub(crate) samples: usize,
    /// Whether it was judged: [`MIN_PER_WORK`] samples after the warm-up and
    /// [`MIN_MESSAGES`] messages handled over them.
    pub(crate) judged: bool,
    /// Messages handled over the window: a router's deliveries as it counted them, a
    /// relay's taken at its engine's batch rate.
    pub(crate) messages: u64,
    /// The least-squares slope of RSS on messages handled, bytes per message.
    pub(crate) rss_bytes_per_message: f64,
    /// Dials over the window (routers only), and the fds' growth from the median of
    /// its first 5 samples to the median of its last 5.
    pub(crate) dials: Option<u64>,
    pub(crate) fd_growth: f64,
}

/// A series against its work from `warm_up` seconds after its first sample: the work
/// it counted (the last count at or before each sample), else `rate` messages a
/// second; `None` without samples after the warm-up, or without either.
pub(crate) fn per_work(series: &Series, warm_up: f64, rate: Option<f64>) -> Option<PerWork> {
    let from = series.samples.first()?.0 + warm_up;
    // (messages, RSS KiB, fds, dials) at each sample.
    let points: Vec<(f64, u64, u64, Option<u64>)> = series
        .samples
        .iter()
        .filter(|s| s.0 >= from)
        .filter_map(|&(t, rss, fds)| {
            if series.work.is_empty() {
                Some(((t - from) * rate?, rss, fds, None))
            } else {
                let w = series.work.iter().rev().find(|w| w.0 <= t)?;
                Some((w.1 as f64, rss, fds, Some(w.2)))
            }
        })
        .collect();
    let (first, last) = (points.first()?, points.last()?);
    let messages = (last.0 - first.0).max(0.0) as u64;
    let bytes: Vec<(f64, f64)> = points.iter().map(|p| (p.0, p.1 as f64 * 1024.0)).collect();
    let median = |ps: &[(f64, u64, u64, Option<u64>)]| {
        let mut fds: Vec<u64> = ps.iter().map(|p| p.2).collect();
        fds.sort_unstable();
        fds.get(fds.len() / 2).copied().unwrap_or(0) as f64
    };
    let k = points.len().min(5);
    Some(PerWork {
        samples: points.len(),
        judged: points.len() >= MIN_PER_WORK && messages >= MIN_MESSAGES,
        messages,
        rss_bytes_per_message: slope(&bytes),
        dials: match (first.3, last.3) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        },
        fd_growth: median(&points[points.len() - k..]) - median(&points[..k]),
    })
}

/// Whether the growth per unit of work is within bounds: (RSS, fds). Fds are judged
/// where dials are counted (routers).
pub(crate) fn lean(w: &PerWork, bytes_per_message: f64) -> (bool, bool) {
    let rss = w.rss_bytes_per_message <= bytes_per_message;
    let fds = w
        .dials
        .is_none_or(|d| w.fd_growth <= FD_NOISE + FDS_PER_DIAL * d as f64);
    (rss, fds)
}

/// Messages a second of the processes that do not count their own: a relay's (one
/// per engine batch) and `kv-router`'s (every relay on our wire).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rates {
    pub(crate) relay: f64,
    pub(crate) kv_router: f64,
}

/// Every process's resources judged: peak budgets, slopes over time ([`flat`]) and
/// growth per unit of work ([`lean`]; relays and `kv-router` at their `rates`).
/// With `require_router_0` (a run long enough), router 0's first process must have
/// been judged per message. The per-work figures, by process.
pub(crate) fn check(
    all: &BTreeMap<String, Series>,
    trends: &BTreeMap<String, Trend>,
    workers: usize,
    warm_up: f64,
    rates: Rates,
    require_router_0: bool,
    out: &mut Vec<Violation>,
) -> BTreeMap<String, PerWork> {
    let mut v = |invariant, at: &str, detail| {
        out.push(Violation {
            invariant,
            at: at.to_owned(),
            detail,
        })
    };
    let mut per: BTreeMap<String, PerWork> = BTreeMap::new();
    for (name, t) in trends {
        let role = all.get(name).map_or("", |s| s.role.as_str());
        let Some(budget) = budget_kib(role) else {
            continue;
        };
        if t.peak_rss_kib > budget {
            v(
                "rss_budget",
                name.as_str(),
                format!("peak {} KiB > {budget} KiB", t.peak_rss_kib),
            );
        }
        // Judged over a minute of samples at least.
        let (rss_flat, fds_flat) = flat(t, workers);
        if t.judged && !rss_flat {
            v(
                "rss_flat",
                name.as_str(),
                format!("{:.0} KiB/min", t.rss_slope_kib_per_min),
            );
        }
        if t.judged && !fds_flat {
            v(
                "fds_flat",
                name.as_str(),
                format!("{:.2} fds/min", t.fd_slope_per_min),
            );
        }
        let (Some(bound), Some(series)) = (bytes_per_message(role), all.get(name)) else {
            continue;
        };
        // Relays publish a message per engine batch; kv-router follows every relay on
        // our wire. The soak's routers say what they delivered.
        let rate = match role {
            "relay" => Some(rates.relay),
            "kv-router" => Some(rates.kv_router),
            _ => None,
        };
        let Some(w) = per_work(series, warm_up, rate) else {
            continue;
        };
        let (rss_lean, fds_lean) = lean(&w, bound);
        if w.judged && !rss_lean {
            v(
                "rss_per_message",
                name.as_str(),
                format!(
                    "{:.0} B per message over {} messages > {bound:.0} B",
                    w.rss_bytes_per_message, w.messages
                ),
            );
        }
        if w.judged && !fds_lean {
            v(
                "fds_per_dial",
                name.as_str(),
                format!(
                    "{:+.1} fds over {} dials > {FD_NOISE} + {FDS_PER_DIAL} per dial",
                    w.fd_growth,
                    w.dials.unwrap_or(0)
                ),
            );
        }
        per.insert(name.clone(), w);
    }
    let first_router = per.get("router r0#1").is_some_and(|w| w.judged);
    if require_router_0 && !first_router {
        v(
            "leak_judged",
            "router r0#1",
            "the router that lives the whole run was not judged per message".to_owned(),
        );
    }
    // kv-router follows the relays on our wire (none: nothing to judge it on).
    if require_router_0 && rates.kv_router > 0.0 && !per.get("kv-router").is_some_and(|w| w.judged)
    {
        v(
            "leak_judged",
            "kv-router",
            "kv-router (it lives the whole run) was not judged per message".to_owned(),
        );
    }
    // Audit H3: at least five relays judged (three may be killed in a 3-minute run).
    let relays = per
        .iter()
        .filter(|(n, w)| n.starts_with("relay") && w.judged)
        .count();
    // A relay handles its engine's batches: at a slow rate none reaches the
    // minimum in a 3-minute run's judged window (≈ 2 minutes).
    let wanted = workers.saturating_sub(3).min(5);
    let reachable = rates.relay * 120.0 >= MIN_MESSAGES as f64;
    if require_router_0 && reachable && relays < wanted {
        v(
            "leak_judged",
            "relays",
            format!("{relays} relays judged per message, fewer than {wanted}"),
        );
    }
    per
}

/// What a series comes to.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Trend {
    pub(crate) samples: usize,
    /// Whether the slopes were judged (at least [`MIN_JUDGED`] samples after the
    /// warm-up; a process that lived less is judged on its peak only).
    pub(crate) judged: bool,
    /// Minutes between the first and last sample judged.
    pub(crate) window_min: f64,
    pub(crate) rss_slope_kib_per_min: f64,
    pub(crate) fd_slope_per_min: f64,
    pub(crate) peak_rss_kib: u64,
    pub(crate) peak_fds: u64,
}

/// The least-squares slope of `ys` over `xs` (per unit of x), 0 with fewer than 2.
pub(crate) fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// The trend of a series from `warm_up` seconds after its first sample on (a process
/// started mid-run warms up too; peaks over the whole series).
pub(crate) fn trend(series: &Series, warm_up: f64) -> Trend {
    let from = series.samples.first().map_or(0.0, |s| s.0) + warm_up;
    let after: Vec<&(f64, u64, u64)> = series.samples.iter().filter(|s| s.0 >= from).collect();
    let per_min = |f: &dyn Fn(&(f64, u64, u64)) -> f64| {
        slope(&after.iter().map(|s| (s.0 / 60.0, f(s))).collect::<Vec<_>>())
    };
    Trend {
        samples: after.len(),
        judged: after.len() >= MIN_JUDGED,
        window_min: match (after.first(), after.last()) {
            (Some(a), Some(b)) => (b.0 - a.0) / 60.0,
            _ => 0.0,
        },
        rss_slope_kib_per_min: per_min(&|s| s.1 as f64),
        fd_slope_per_min: per_min(&|s| s.2 as f64),
        peak_rss_kib: series.samples.iter().map(|s| s.1).max().unwrap_or(0),
        peak_fds: series.samples.iter().map(|s| s.2).max().unwrap_or(0),
    }
}

/// Trends of every series, by process name.
pub(crate) fn trends(all: &BTreeMap<String, Series>, warm_up: f64) -> BTreeMap<String, Trend> {
    all.iter()
        .map(|(k, s)| (k.clone(), trend(s, warm_up)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat_series() -> Series {
        Series {
            role: "router".into(),
            // Churn: fds up and down by 6, RSS by 2 MiB, over 2 minutes.
            samples: (0..60)
                .map(|i| (i as f64 * 2.0, 10_000 + (i % 7) * 300, 12 + (i % 7)))
                .collect(),
            work: Vec::new(),
        }
    }

    /// A router's series: 80 deliveries/s, `leak` bytes kept per delivery, `fd_leak`
    /// fds per dial (a dial every 10 s), 2 minutes.
    fn router_series(leak: u64, fd_leak: u64) -> Series {
        let samples = (0..60)
            .map(|i| {
                let t = i as f64 * 2.0;
                let delivered = i * 160;
                let dials = i / 5;
                // Churn: ± 300 KiB, ± 3 fds.
                let rss = 10_000 + (i % 7) * 100 + delivered * leak / 1024;
                (t, rss, 20 + (i % 4) + dials * fd_leak)
            })
            .collect();
        let work = (0..60).map(|i| (i as f64 * 2.0, i * 160, i / 5)).collect();
        Series {
            role: "router".into(),
            samples,
            work,
        }
    }

    #[test]
    fn growth_is_judged_per_message_and_per_dial() {
        let ok = per_work(&router_series(0, 0), 10.0, None).unwrap();
        assert!(ok.judged, "{ok:?}");
        assert_eq!(lean(&ok, 128.0), (true, true), "{ok:?}");
        // A payload kept per delivery (audit H3 a: ≥ 300 B with its read buffer).
        let kept = per_work(&router_series(300, 0), 10.0, None).unwrap();
        assert!(
            (kept.rss_bytes_per_message - 300.0).abs() < 20.0,
            "{kept:?}"
        );
        assert_eq!(lean(&kept, 128.0), (false, true));
        // An fd forgotten per dial (audit H3 b).
        let fds = per_work(&router_series(0, 1), 10.0, None).unwrap();
        assert_eq!(lean(&fds, 128.0), (true, false), "{fds:?}");
        // A relay counts no work: its engine's rate stands for it (10/s here).
        let mut relay = router_series(0, 0);
        relay.work.clear();
        let w = per_work(&relay, 10.0, Some(10.0)).unwrap();
        assert_eq!((w.dials, w.messages), (None, 1080));
        assert_eq!(lean(&w, 1024.0), (true, true));
        // Too short a life is not judged.
        let mut short = router_series(300, 0);
        short.samples.truncate(15);
        assert!(!per_work(&short, 10.0, None).unwrap().judged);
    }

    #[test]
    fn a_leak_has_a_slope_and_a_flat_line_has_none() {
        let steady = Series {
            role: "relay".into(),
            samples: (0..60)
                .map(|i| (i as f64 * 2.0, 10_000 + (i % 3), 12))
                .collect(),
            work: Vec::new(),
        };
        let t = trend(&steady, 10.0);
        assert!(t.rss_slope_kib_per_min.abs() < 5.0, "{t:?}");
        assert_eq!(t.fd_slope_per_min, 0.0);
        // 200 KiB per 2 s sample: 6000 KiB a minute.
        let leak = Series {
            role: "relay".into(),
            samples: (0..60)
                .map(|i| (i as f64 * 2.0, 10_000 + 200 * i, 12 + i / 4))
                .collect(),
            work: Vec::new(),
        };
        let t = trend(&leak, 10.0);
        assert!((t.rss_slope_kib_per_min - 6000.0).abs() < 1.0, "{t:?}");
        assert!(t.fd_slope_per_min > FD_SLOPE_PER_MIN);
        assert_eq!(flat(&t, 2), (false, false)); // 10.6 MiB and 13 fds over 1.8 minutes
        assert_eq!(flat(&trend(&flat_series(), 10.0), 2), (true, true));
    }
}
