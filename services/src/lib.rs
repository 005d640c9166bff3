//! What eventplane's processes share: the command-line conventions of the examples
//! (the `eventplane-cli` crate, one source for both, so the processes and the examples
//! read flags, log and stop the same way), and what makes a process a service: its
//! admin endpoint, metrics, version and log format. Not an API: the binaries are the
//! product.
#![allow(missing_docs)]

pub use eventplane_cli as common;
pub mod score;
pub mod served;
pub mod service;
