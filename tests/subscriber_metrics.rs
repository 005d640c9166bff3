//! The `metrics` feature: the subscriber's counters reach an installed recorder: the
//! suite lives in `tests/subscriber_metrics/suite.rs` and needs `--features metrics`
//! (`cargo test --all-features` and `.ci/run` run it). Without the feature, one ignored
//! test says so instead of the target silently vanishing.

#[cfg(feature = "metrics")]
#[path = "subscriber_metrics/suite.rs"]
mod suite;
#[cfg(feature = "metrics")]
mod support;

#[cfg(not(feature = "metrics"))]
#[test]
#[ignore = "needs `--features metrics`: run `cargo test --all-features`"]
fn skipped_without_features_metrics() {}
