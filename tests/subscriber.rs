//! DynamicSubscriber end to end over real TCP: the suite lives in
//! `tests/subscriber/suite.rs` and needs `--features test-support` (`cargo test
//! --all-features` and `.ci/run` run it). Without the feature, one ignored test says so
//! instead of the target silently vanishing.

#[cfg(feature = "test-support")]
#[path = "subscriber/suite.rs"]
mod suite;
#[cfg(feature = "test-support")]
mod support;

#[cfg(not(feature = "test-support"))]
#[test]
#[ignore = "needs `--features test-support`: run `cargo test --all-features`"]
fn skipped_without_features_test_support() {}
