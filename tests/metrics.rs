//! The `metrics` feature across components: the catalogue page (docs/metrics.md) is the catalogue, and
//! publishers that come and go add no series. The suite lives in
//! `tests/metrics/suite.rs` and needs `--features metrics` (`cargo test
//! --all-features` and `.ci/run` run it). Without the feature, one ignored test says so.

#[cfg(feature = "metrics")]
#[path = "metrics/suite.rs"]
mod suite;
#[cfg(feature = "metrics")]
mod support;

#[cfg(not(feature = "metrics"))]
#[test]
#[ignore = "needs `--features metrics`: run `cargo test --all-features`"]
fn skipped_without_features_metrics() {}
