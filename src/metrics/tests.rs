#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ::metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

use super::*;
use crate::zmtp::PubStats;

/// Keeps every series by name and labels; gauges as f64 bits.
#[derive(Default, Clone)]
struct Capture {
    series: Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>,
}

impl Capture {
    fn handle(&self, key: &Key) -> Arc<AtomicU64> {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        self.series.lock().unwrap().entry(name).or_default().clone()
    }

    fn value(&self, name: &str) -> u64 {
        self.series.lock().unwrap()[name].load(Ordering::Relaxed)
    }

    fn gauge(&self, name: &str) -> f64 {
        f64::from_bits(self.value(name))
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.series.lock().unwrap().keys().cloned().collect();
        names.sort();
        names
    }
}

impl Recorder for Capture {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.handle(key))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn pub_stats(messages: u64, connections: usize) -> PubStats {
    PubStats {
        messages,
        connections,
        ..PubStats::default()
    }
}

#[test]
fn components_of_one_kind_add_up_and_a_stopped_one_takes_its_gauges_away() {
    let capture = Capture::default();
    let a = Arc::new(Mutex::new(pub_stats(5, 2)));
    let b = Arc::new(Mutex::new(pub_stats(7, 3)));
    ::metrics::with_local_recorder(&capture, || {
        let (ra, rb) = (a.clone(), b.clone());
        let mut both = Exporter::new().source(move || *ra.lock().unwrap());
        let mut other = Exporter::new().source(move || *rb.lock().unwrap());
        both.sample();
        other.sample();
        assert_eq!(capture.value("eventplane_pub_messages_total{}"), 12);
        assert_eq!(capture.gauge("eventplane_pub_connections{}"), 5.0);
        // Only what changed since the last sample is added.
        *a.lock().unwrap() = pub_stats(9, 1);
        both.sample();
        both.sample();
        assert_eq!(capture.value("eventplane_pub_messages_total{}"), 16);
        assert_eq!(capture.gauge("eventplane_pub_connections{}"), 4.0);
        // A component restarted behind the same closure: its count is all new.
        *a.lock().unwrap() = pub_stats(2, 1);
        both.sample();
        assert_eq!(capture.value("eventplane_pub_messages_total{}"), 18);
        drop(both);
        assert_eq!(capture.gauge("eventplane_pub_connections{}"), 3.0);
        assert_eq!(capture.value("eventplane_pub_messages_total{}"), 18);
    });
}

#[test]
fn every_catalogued_name_follows_the_scheme_once() {
    let mut seen = std::collections::HashSet::new();
    for m in CATALOGUE {
        assert!(seen.insert(m.name), "{} twice", m.name);
        assert!(m.name.starts_with("eventplane_"), "{}", m.name);
        assert_eq!(
            m.name.ends_with("_total"),
            m.kind == Kind::Counter,
            "{}: counters and only counters end in _total",
            m.name
        );
        assert!(
            m.name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{}",
            m.name
        );
        assert!(!m.help.is_empty() && !m.help.contains('|'), "{}", m.name);
    }
}

#[test]
fn every_series_sampled_is_catalogued() {
    let capture = Capture::default();
    ::metrics::with_local_recorder(&capture, || {
        let e = Exporter::new().source(PubStats::default);
        #[cfg(feature = "admin")]
        let e = e.source(crate::admin::AdminStats::default);
        let mut e = e
            .source(crate::subscriber::SubscriberStats::default)
            .source(crate::discovery::DiscoveryStats::default)
            .source(crate::kv::pipeline::WorkerStats::default);
        e.sample();
    });
    for name in capture.names() {
        let bare = name.split('{').next().unwrap();
        assert!(
            CATALOGUE.iter().any(|m| m.name == bare),
            "{name} is not in the catalogue"
        );
    }
    assert!(capture.names().len() > 40);
}

#[cfg(feature = "tunnel")]
#[test]
fn codes_a_peer_made_up_read_as_unknown() {
    use crate::tunnel::BrokerStats;
    let mut stats = BrokerStats::default();
    stats.refused.insert("dns_timeout".into(), 2);
    stats.refused.insert("from_the_future".into(), 3);
    stats.refused.insert("something_else".into(), 4);
    let capture = Capture::default();
    ::metrics::with_local_recorder(&capture, || {
        Exporter::new().source(move || stats.clone()).sample();
    });
    assert_eq!(
        capture.value("eventplane_broker_refused_total{code=dns_timeout}"),
        2
    );
    assert_eq!(
        capture.value("eventplane_broker_refused_total{code=unknown}"),
        7
    );
    let refused: Vec<String> = capture
        .names()
        .into_iter()
        .filter(|n| n.starts_with("eventplane_broker_refused_total"))
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
}
