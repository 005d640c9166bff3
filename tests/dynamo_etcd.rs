//! Next to Dynamo over a real etcd started by the harness: Dynamo's records (the
//! conformance suite in that format, golden records from a Dynamo 1.6.1 capture) and
//! the worker → etcd → router processes end to end; and against a real Dynamo 1.6.1
//! (`tests/dynamo_etcd/live.rs`). The suites live in `tests/dynamo_etcd/` and need
//! `--features etcd,test-support` (`cargo test --all-features` and `.ci/run` run them).
//! Without the features, one ignored test says so instead of the target silently
//! vanishing.

#[cfg(all(feature = "etcd", feature = "test-support", feature = "kube"))]
#[path = "support/kube_api/mod.rs"]
mod kube_api;
#[cfg(all(feature = "etcd", feature = "test-support"))]
#[path = "dynamo_etcd/live.rs"]
mod live;
#[cfg(all(feature = "etcd", feature = "test-support"))]
#[path = "dynamo_etcd/recovery.rs"]
mod recovery;
#[cfg(all(feature = "etcd", feature = "test-support"))]
#[path = "dynamo_etcd/suite.rs"]
mod suite;
#[cfg(all(feature = "etcd", feature = "test-support"))]
mod support;

#[cfg(not(all(feature = "etcd", feature = "test-support")))]
#[test]
#[ignore = "needs `--features etcd,test-support`: run `cargo test --all-features`"]
fn skipped_without_features_etcd_test_support() {}
