//! The catalogue in the README, and the series count under publisher churn.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
use eventplane::subscriber::DynamicSubscriber;
use eventplane::zmtp::{Config, PubSocket};
use metrics::{
    Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

const BEGIN: &str = "<!-- metrics-table:begin -->\n";
const END: &str = "<!-- metrics-table:end -->";

/// The catalogue page's table (docs/metrics.md, also the `metrics` module's rustdoc)
/// is `catalogue_table()`; with `EVENTPLANE_BLESS=1` this test writes it there instead.
#[test]
fn the_catalogue_page_is_the_catalogue() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let start = readme
        .find(BEGIN)
        .expect("docs/metrics.md has the metrics table markers")
        + BEGIN.len();
    let end = start + readme[start..].find(END).unwrap();
    let table = eventplane::metrics::catalogue_table();
    if std::env::var_os("EVENTPLANE_BLESS").is_some() {
        let updated = format!("{}{table}{}", &readme[..start], &readme[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        readme[start..end] == table,
        "docs/metrics.md's table is not the catalogue: run \
         `EVENTPLANE_BLESS=1 cargo test --features metrics --test metrics`"
    );
}

/// Keeps the name and labels of every series registered, and counts the updates of
/// each gauge by name (a sample updates every gauge of its source, changed or not).
#[derive(Default, Clone)]
struct Series(
    Arc<Mutex<BTreeSet<String>>>,
    Arc<Mutex<BTreeMap<String, Arc<Updates>>>>,
);

/// A gauge that counts its updates.
#[derive(Default)]
struct Updates(AtomicU64);

impl GaugeFn for Updates {
    fn increment(&self, _: f64) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn decrement(&self, _: f64) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn set(&self, _: f64) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl Series {
    fn note(&self, key: &Key) {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        self.0
            .lock()
            .unwrap()
            .insert(format!("{}{{{}}}", key.name(), labels.join(",")));
    }

    fn all(&self) -> BTreeSet<String> {
        self.0.lock().unwrap().clone()
    }

    /// Updates of the gauge `name` so far: the samples of the source that feeds it.
    fn updates(&self, name: &str) -> u64 {
        self.1
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |u| u.0.load(Ordering::Relaxed))
    }
}

impl Recorder for Series {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.note(key);
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.note(key);
        let mut updates = self.1.lock().unwrap();
        Gauge::from_arc(updates.entry(key.name().to_owned()).or_default().clone())
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.note(key);
        Histogram::noop()
    }
}

fn recorder() -> &'static Series {
    static SERIES: OnceLock<Series> = OnceLock::new();
    SERIES.get_or_init(|| {
        let series = Series::default();
        metrics::set_global_recorder(series.clone()).unwrap();
        series
    })
}

/// A gauge the subscriber samples, and one the exporter does (from the discovery).
const SUBSCRIBER_GAUGE: &str = "eventplane_subscriber_publishers";
const DISCOVERY_GAUGE: &str = "eventplane_discovery_registrations";

/// 1,000 publishers (ten rounds of 100) are discovered, followed, and go: the
/// subscriber's and the discovery's series after the last round are those after the
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_that_come_and_go_add_no_series() {
    let series = recorder();
    let discovery = Arc::new(MemoryDiscovery::new());
    let sub =
        DynamicSubscriber::builder(discovery.clone() as Arc<dyn Discovery>, Query::new("churn"))
            .topic("kv")
            .spawn()
            .unwrap();
    let sampled = discovery.clone();
    let handle = sub.handle();
    let exporter = eventplane::metrics::Exporter::new()
        .source(move || sampled.stats())
        .source(move || handle.stats());
    let stop = eventplane::CancellationToken::new();
    let exporting = tokio::spawn(exporter.run(Duration::from_millis(10), stop.clone()));
    let mut after_first = None;
    for round in 0..10u64 {
        let mut live = Vec::new();
        for i in 0..100u64 {
            let p = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
                .await
                .unwrap();
            let id = ChannelId::new("churn", "worker", "kv", round * 100 + i).unwrap();
            let reg = discovery
                .register(id, Transport::zmq(p.local_endpoint().unwrap()))
                .await
                .unwrap();
            live.push((p, reg));
        }
        for (p, _) in &live {
            support::within(p.wait_for_subscribers(1)).await;
        }
        assert_eq!(sub.stats().publishers.len(), 100);
        drop(live);
        support::within(async {
            while !sub.stats().publishers.is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        // Two samples of the subscriber and of the exporter after the last publisher
        // went: every series this round made is noted.
        let samples = || [SUBSCRIBER_GAUGE, DISCOVERY_GAUGE].map(|name| series.updates(name));
        let before = samples();
        let deadline = tokio::time::Instant::now() + support::DEADLINE;
        while samples()
            .iter()
            .zip(before)
            .any(|(now, then)| *now < then + 2)
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: samples (subscriber, exporter) went from {before:?} to {:?} \
                 in {:?}",
                samples(),
                support::DEADLINE
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now = series.all();
        match &after_first {
            None => after_first = Some(now),
            Some(first) => assert_eq!(&now, first, "round {round} added series"),
        }
    }
    stop.cancel();
    exporting.await.unwrap();
    let all = series.all();
    assert!(
        all.iter()
            .any(|s| s.starts_with("eventplane_subscriber_received_total"))
    );
    assert!(
        all.iter()
            .any(|s| s.starts_with("eventplane_discovery_registrations"))
    );
    assert!(
        all.iter()
            .all(|s| !s.contains("churn") && !s.contains("127.0.0.1")),
        "{all:?}"
    );
    println!("{} series for 1,000 publishers over 10 rounds", all.len());
}
