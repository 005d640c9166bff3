//! The tunnel end to end over real sockets: the suite lives in `tests/tunnel/suite.rs`
//! and needs `--features tunnel,unstable` (the suite drives the sans-IO protocol too;
//! `cargo test --all-features` and `.ci/run` run it).
//! Without the feature, one ignored test says so instead of the target silently
//! vanishing.

#[cfg(all(feature = "tunnel", feature = "unstable", feature = "kube"))]
#[path = "tunnel/admin.rs"]
mod admin;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/common.rs"]
mod common;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/event_broker.rs"]
mod event_broker;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/greedy.rs"]
mod greedy;
#[cfg(all(feature = "tunnel", feature = "unstable", feature = "kube"))]
#[path = "support/kube_api/mod.rs"]
mod kube_api;
#[cfg(all(feature = "tunnel", feature = "unstable", feature = "kube"))]
#[path = "tunnel/kube_broker.rs"]
mod kube_broker;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/source_cli.rs"]
mod source_cli;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/sources.rs"]
mod sources;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/stages.rs"]
mod stages;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/suite.rs"]
mod suite;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
mod support;
#[cfg(all(feature = "tunnel", feature = "unstable"))]
#[path = "tunnel/trust.rs"]
mod trust;

#[cfg(not(all(feature = "tunnel", feature = "unstable")))]
#[test]
#[ignore = "needs `--features tunnel,unstable`: run `cargo test --all-features`"]
fn skipped_without_features_tunnel() {}
