//! What eventplane's processes share: the command-line helpers of the examples (one
//! source for both, so the processes and the examples read flags, log and stop the
//! same way), and what makes a process a service: its admin endpoint, metrics,
//! version and log format. Not an API: the binaries are the product.
#![allow(missing_docs)]

#[path = "../../examples/common/mod.rs"]
pub mod common;
pub mod score;
pub mod served;
pub mod service;
