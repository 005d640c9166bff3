//! The tunnel end to end over real sockets: the suite lives in `tests/tunnel/suite.rs`
//! and needs `--features tunnel` (`cargo test --all-features` and `.ci/run` run it).
//! Without the feature, one ignored test says so instead of the target silently
//! vanishing.

#[cfg(all(feature = "tunnel", feature = "kube"))]
#[path = "tunnel/admin.rs"]
mod admin;
#[cfg(feature = "tunnel")]
#[path = "tunnel/common.rs"]
mod common;
#[cfg(feature = "tunnel")]
#[path = "tunnel/event_broker.rs"]
mod event_broker;
#[cfg(feature = "tunnel")]
#[path = "tunnel/greedy.rs"]
mod greedy;
#[cfg(all(feature = "tunnel", feature = "kube"))]
#[path = "support/kube_api/mod.rs"]
mod kube_api;
#[cfg(all(feature = "tunnel", feature = "kube"))]
#[path = "tunnel/kube_broker.rs"]
mod kube_broker;
#[cfg(feature = "tunnel")]
#[path = "tunnel/source_cli.rs"]
mod source_cli;
#[cfg(feature = "tunnel")]
#[path = "tunnel/sources.rs"]
mod sources;
#[cfg(feature = "tunnel")]
#[path = "tunnel/stages.rs"]
mod stages;
#[cfg(feature = "tunnel")]
#[path = "tunnel/suite.rs"]
mod suite;
#[cfg(feature = "tunnel")]
mod support;
#[cfg(feature = "tunnel")]
#[path = "tunnel/trust.rs"]
mod trust;

#[cfg(not(feature = "tunnel"))]
#[test]
#[ignore = "needs `--features tunnel`: run `cargo test --all-features`"]
fn skipped_without_features_tunnel() {}
