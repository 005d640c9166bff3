//! The discovery conformance suite, and the broken backends it must fail: the suite
//! lives in `tests/discovery_conformance/suite.rs` and needs `--features test-support`
//! (`cargo test --all-features` and `.ci/run` run it). Without the feature, one ignored
//! test says so instead of the target silently vanishing.

#[cfg(feature = "test-support")]
#[cfg(feature = "test-support")]
#[path = "discovery_conformance/suite.rs"]
mod suite;

#[cfg(not(feature = "test-support"))]
#[test]
#[ignore = "needs `--features test-support`: run `cargo test --all-features`"]
fn skipped_without_features_test_support() {}
