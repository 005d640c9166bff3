//! Resource series: every long-lived process's RSS and open fds, sampled every
//! [`SAMPLE_EVERY`]; after the warm-up, a least-squares slope and the peak.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

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
        "router" => Some(256 * 1024),
        "relay" => Some(64 * 1024),
        "engine" => Some(32 * 1024),
        _ => None,
    }
}

/// One process's samples: (seconds from the run's start, RSS KiB, fds).
#[derive(Debug, Default, Clone)]
pub(crate) struct Series {
    pub(crate) role: String,
    pub(crate) samples: Vec<(f64, u64, u64)>,
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
        }
    }

    #[test]
    fn a_leak_has_a_slope_and_a_flat_line_has_none() {
        let steady = Series {
            role: "relay".into(),
            samples: (0..60)
                .map(|i| (i as f64 * 2.0, 10_000 + (i % 3), 12))
                .collect(),
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
        };
        let t = trend(&leak, 10.0);
        assert!((t.rss_slope_kib_per_min - 6000.0).abs() < 1.0, "{t:?}");
        assert!(t.fd_slope_per_min > FD_SLOPE_PER_MIN);
        assert_eq!(flat(&t, 2), (false, false)); // 10.6 MiB and 13 fds over 1.8 minutes
        assert_eq!(flat(&trend(&flat_series(), 10.0), 2), (true, true));
    }
}
