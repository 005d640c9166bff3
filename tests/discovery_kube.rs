//! `KubeDiscovery` over a Kubernetes API test server (`tests/support/kube_api/`):
//! the conformance suite with faults, the join rule, the bounds, the records Dynamo
//! 1.6.1 wrote and the requests it sent (fixtures in
//! `tests/fixtures/dynamo-1.6.1-kube/`). The suite lives in `tests/discovery_kube/`
//! and needs `--features kube,test-support` (`cargo test --all-features` and
//! `.ci/run` run it). Without the features, one ignored test says so instead of the
//! target silently vanishing.

#[cfg(all(feature = "kube", feature = "test-support"))]
#[path = "support/kube_api/mod.rs"]
mod kube_api;
#[cfg(all(feature = "kube", feature = "test-support"))]
#[path = "discovery_kube/suite.rs"]
mod suite;
#[cfg(all(feature = "kube", feature = "test-support"))]
mod support;
#[cfg(all(feature = "kube", feature = "test-support"))]
#[path = "discovery_kube/wire.rs"]
mod wire;

#[cfg(not(all(feature = "kube", feature = "test-support")))]
#[test]
#[ignore = "needs `--features kube,test-support`: run `cargo test --all-features`"]
fn skipped_without_features_kube_test_support() {}
