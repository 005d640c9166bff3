//! `EtcdDiscovery` against a real etcd started by the harness: the suite lives in
//! `tests/discovery_etcd/suite.rs` and needs `--features etcd,test-support` (`cargo
//! test --all-features` and `.ci/run` run it). Without the features, one ignored test
//! says so instead of the target silently vanishing.

#[cfg(all(feature = "etcd", feature = "test-support"))]
#[path = "discovery_etcd/suite.rs"]
mod suite;
#[cfg(all(feature = "etcd", feature = "test-support"))]
mod support;

#[cfg(not(all(feature = "etcd", feature = "test-support")))]
#[test]
#[ignore = "needs `--features etcd,test-support`: run `cargo test --all-features`"]
fn skipped_without_features_etcd_test_support() {}
