//! Every component's counters through the [`metrics` facade](https://docs.rs/metrics) (feature
//! `metrics`): the application installs a recorder (a Prometheus exporter, say) and
//! an [`Exporter`] samples the components' `stats()` into it.
//!
//! # Names and labels
//!
//! One scheme, `eventplane_<component>_<what>_total` for counters and
//! `eventplane_<component>_<what>` for gauges (sizes end in `_bytes`), listed in
//! [`CATALOGUE`] and in the table at the end of this page, which a test regenerates from it.
//!
//! Label sets are closed: a label's values come from a fixed list (a drop reason, a
//! tunnel [`RefuseCode`](crate::tunnel::RefuseCode), `CloseCode` or `DenyCode`; text a
//! peer sends that is not a known code reads as `unknown`). Publisher ids, hosts,
//! endpoints, namespaces and topics are never labels: a cluster's publishers come and
//! go (every engine restart is a new id), so each would leave a series behind in the
//! recorder and in Prometheus for as long as either runs, and one hostile discovery
//! record could add as many as it likes. What is per publisher stays in `stats()`
//! ([`SubscriberStats::publishers`](crate::subscriber::SubscriberStats::publishers)),
//! to log or inspect; the metrics are the process's totals.
//!
//! # Sampling
//!
//! Counters are read from the components' own atomics; an [`Exporter`] reads a
//! snapshot every interval and adds what changed since the last one, so several
//! components of one kind (two publishers, say) add up in the same series, and a
//! component that stops takes its gauges' share away with it. Nothing is looked up
//! or allocated per message. Every component is sampled the same way, a
//! [`DynamicSubscriber`](crate::subscriber::DynamicSubscriber) through its
//! [`handle`](crate::subscriber::DynamicSubscriber::handle)'s `stats()`:
//!
//! ```
//! use std::time::Duration;
//! use eventplane::metrics::Exporter;
//! use eventplane::zmtp::{Config, PubSocket};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let publisher = std::sync::Arc::new(PubSocket::new(Config::default()));
//! let sampled = publisher.clone();
//! let mut exporter = Exporter::new().source(move || sampled.stats());
//! exporter.sample(); // or: tokio::spawn(exporter.run(Duration::from_secs(1), cancel))
//! # }
//! ```

#![doc = include_str!("../../docs/metrics.md")]

mod catalogue;
mod sampled;

use std::collections::HashMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use catalogue::CATALOGUE;
pub use sampled::Sampled;

/// What a metric counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// Only grows (Prometheus `counter`, name ends in `_total`).
    Counter,
    /// A level now (Prometheus `gauge`).
    Gauge,
}

impl Kind {
    /// `counter` or `gauge`, as Prometheus names the type.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// One metric of the [`CATALOGUE`].
///
/// ```
/// use eventplane::metrics::{CATALOGUE, Kind};
/// let dropped = CATALOGUE.iter().find(|m| m.name == "eventplane_pub_dropped_total").unwrap();
/// assert_eq!((dropped.kind, dropped.label), (Kind::Counter, None));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metric {
    /// Its name.
    pub name: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// Its one label, when it has one (values from a closed set).
    pub label: Option<&'static str>,
    /// The stats type it is read from.
    pub source: &'static str,
    /// What it counts.
    pub help: &'static str,
}

/// Describes every metric of the [`CATALOGUE`] to the installed recorder (its help
/// text; Prometheus prints it as `# HELP`). Call it once after installing a recorder.
///
/// ```
/// eventplane::metrics::describe(); // without a recorder: nothing happens
/// ```
pub fn describe() {
    for m in CATALOGUE {
        match m.kind {
            Kind::Counter => ::metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => ::metrics::describe_gauge!(m.name, m.help),
        }
    }
}

/// The [`CATALOGUE`] as a Markdown table (name, type, label, stats type, meaning): the
/// catalogue at the end of this module's page (the repository's `docs/metrics.md`) is
/// this text.
///
/// ```
/// let table = eventplane::metrics::catalogue_table();
/// assert!(table.contains("| `eventplane_subscriber_dropped_total` | counter | `reason` |"));
/// ```
pub fn catalogue_table() -> String {
    let mut out =
        String::from("| metric | type | label | from | meaning |\n|---|---|---|---|---|\n");
    for m in CATALOGUE {
        let label = m.label.map_or_else(String::new, |l| format!("`{l}`"));
        out.push_str(&format!(
            "| `{}` | {} | {} | `{}` | {} |\n",
            m.name,
            m.kind.as_str(),
            label,
            m.source,
            m.help
        ));
    }
    out
}

/// What a [`Sampled`] value reports in one sample (opaque: only this crate's stats
/// types write to it).
#[derive(Debug, Default)]
pub struct Samples {
    values: Vec<(&'static Metric, Option<&'static str>, u64)>,
}

impl Samples {
    pub(crate) fn counter(&mut self, metric: &'static Metric, value: u64) {
        debug_assert!(metric.kind == Kind::Counter && metric.label.is_none());
        self.values.push((metric, None, value));
    }

    pub(crate) fn gauge(&mut self, metric: &'static Metric, value: u64) {
        debug_assert!(metric.kind == Kind::Gauge && metric.label.is_none());
        self.values.push((metric, None, value));
    }

    /// A labelled metric's value for one label value (of a closed set).
    pub(crate) fn labelled(&mut self, metric: &'static Metric, label: &'static str, value: u64) {
        debug_assert!(metric.label.is_some());
        self.values.push((metric, Some(label), value));
    }
}

type SeriesKey = (&'static str, Option<&'static str>);

enum Handle {
    Counter(::metrics::Counter),
    Gauge(::metrics::Gauge),
}

/// One series of one source: its handle and the value last added to it.
struct Series {
    handle: Handle,
    last: u64,
}

/// One component behind an [`Exporter`].
struct Source {
    read: Box<dyn FnMut(&mut Samples) + Send>,
    series: HashMap<SeriesKey, Series>,
    samples: Samples,
    now: HashMap<SeriesKey, (&'static Metric, u64)>,
}

impl Source {
    fn sample(&mut self) {
        self.samples.values.clear();
        (self.read)(&mut self.samples);
        // Values of one series reported twice (two unknown codes) add up.
        self.now.clear();
        for &(metric, label, value) in &self.samples.values {
            let slot = self.now.entry((metric.name, label)).or_insert((metric, 0));
            slot.1 = slot.1.saturating_add(value);
        }
        for (&key, &(metric, value)) in &self.now {
            let series = self.series.entry(key).or_insert_with(|| Series {
                handle: register(metric, key.1),
                last: 0,
            });
            match &series.handle {
                // A counter that went back is a component that restarted behind the
                // same closure: its new count is all new.
                Handle::Counter(c) => c.increment(if value >= series.last {
                    value - series.last
                } else {
                    value
                }),
                Handle::Gauge(g) => g.increment(value as f64 - series.last as f64),
            }
            series.last = value;
        }
    }
}

impl Drop for Source {
    /// A component that stops takes its share of the gauges away.
    fn drop(&mut self) {
        for series in self.series.values() {
            if let Handle::Gauge(g) = &series.handle {
                g.decrement(series.last as f64);
            }
        }
    }
}

fn register(metric: &'static Metric, label: Option<&'static str>) -> Handle {
    match (metric.kind, metric.label.zip(label)) {
        (Kind::Counter, None) => Handle::Counter(::metrics::counter!(metric.name)),
        (Kind::Counter, Some((key, value))) => {
            Handle::Counter(::metrics::counter!(metric.name, key => value))
        }
        (Kind::Gauge, None) => Handle::Gauge(::metrics::gauge!(metric.name)),
        (Kind::Gauge, Some((key, value))) => {
            Handle::Gauge(::metrics::gauge!(metric.name, key => value))
        }
    }
}

/// Samples components' stats into the installed `metrics` recorder: each counter
/// grows by what its component counted since the last sample, each gauge carries
/// the component's level (components of one kind add up). Dropping it takes its
/// components' gauges away.
///
/// Install the recorder before the first sample: a series is registered with the
/// recorder installed at the time it is first sampled and kept (no look-up per
/// sample), so an exporter that sampled before the recorder came keeps writing to
/// nothing. (A [`DynamicSubscriber`](crate::subscriber::DynamicSubscriber) samples as
/// soon as it is spawned.)
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use eventplane::discovery::{Discovery, MemoryDiscovery};
/// use eventplane::metrics::Exporter;
/// use eventplane::zmtp::{Config, PubSocket};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let discovery = Arc::new(MemoryDiscovery::new());
/// let publisher = Arc::new(PubSocket::new(Config::default()));
/// let (d, p) = (discovery.clone(), publisher.clone());
/// let exporter = Exporter::new()
///     .source(move || d.stats())
///     .source(move || p.stats());
/// let stop = eventplane::CancellationToken::new();
/// let task = tokio::spawn(exporter.run(Duration::from_secs(1), stop.clone()));
/// stop.cancel(); // samples once more, then ends
/// task.await.unwrap();
/// # }
/// ```
#[derive(Default)]
pub struct Exporter {
    sources: Vec<Source>,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl Exporter {
    /// An exporter of no component yet.
    pub fn new() -> Exporter {
        Exporter::default()
    }

    /// Adds a component: `stats` reads its counters (its `stats()` method, say).
    pub fn source<S: Sampled>(mut self, mut stats: impl FnMut() -> S + Send + 'static) -> Self {
        self.sources.push(Source {
            read: Box::new(move |out| stats().sample(out)),
            series: HashMap::new(),
            samples: Samples::default(),
            now: HashMap::new(),
        });
        self
    }

    /// Samples every component once.
    pub fn sample(&mut self) {
        for source in &mut self.sources {
            source.sample();
        }
    }

    /// Samples every `interval` until `cancel`, once more then, and ends (taking the
    /// gauges' share away).
    pub async fn run(mut self, interval: Duration, cancel: CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stop = tokio::select! {
                () = cancel.cancelled() => true,
                _ = ticker.tick() => false,
            };
            self.sample();
            if stop {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests;
