//! Nothing to import: this crate's targets are its benchmarks (`cargo bench -p
//! eventplane-benches`) and its interop tests against the zeromq crate (`cargo test
//! -p eventplane-benches`). See `Cargo.toml` for why it is a crate of its own.
