//! The catalogue in the README, and the series count under publisher churn.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

use crate::support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use eventplane::discovery::{ChannelId, Discovery, MemoryDiscovery, Query, Transport};
use eventplane::subscriber::DynamicSubscriber;
use eventplane::zmtp::{Config, PubSocket};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

const BEGIN: &str = "<!-- metrics-table:begin -->\n";
const END: &str = "<!-- metrics-table:end -->";

/// The README's metrics table is `catalogue_table()`; with `EVENTPLANE_BLESS=1` this
/// test writes it there instead.
#[test]
fn the_readme_table_is_the_catalogue() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let start = readme
        .find(BEGIN)
        .expect("README has the metrics table markers")
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
        "README.md's metrics table is not the catalogue: run \
         `EVENTPLANE_BLESS=1 cargo test --features metrics --test metrics`"
    );
}

/// Keeps the name and labels of every series registered.
#[derive(Default, Clone)]
struct Series(Arc<Mutex<BTreeSet<String>>>);

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
        Gauge::noop()
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
            .metrics_interval(Duration::from_millis(10))
            .spawn()
            .unwrap();
    let sampled = discovery.clone();
    let exporter = eventplane::metrics::Exporter::new().source(move || sampled.stats());
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
        // Two sampling intervals and more: every series this round made is noted.
        tokio::time::sleep(Duration::from_millis(50)).await;
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
